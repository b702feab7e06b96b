"""LoRARegistry: the API process's LoRA adapters, checked before any request runs under one.

An adapter is read and checked against the base model here (`lora_adapter.read_adapter`,
this process's whole model: the shapes every rank's shards come from) the first time its id
is seen, so a bad adapter is refused with its reason before the engine core is asked to load
it, and nothing is kept of it. The server names its adapters (`--lora-modules`, the load
endpoint): each load gets an id of its own, never reused, so the prefix cache and the
runner's caches never mistake one adapter's weights or KV for another's.
"""

from __future__ import annotations

from itertools import count

from pagedserve.errors import RequestError
from pagedserve.messages import LoRARequest
from pagedserve.model.config import ModelConfig
from pagedserve.model.lora_adapter import LoRAAdapterError, read_adapter


class LoRARegistry:
    def __init__(self, model_config: ModelConfig, max_rank: int) -> None:
        self.model_config = model_config
        self.max_rank = max_rank
        self._checked: dict[int, LoRARequest] = {}  # id -> the adapter checked under it
        self.by_name: dict[str, LoRARequest] = {}  # the server's named adapters
        self._ids = count(1 << 20)  # ids of named adapters: far from a caller's own

    def check(self, lora: LoRARequest) -> None:
        """Raise RequestError (param "lora_request") unless `lora` can run on the model."""
        if not isinstance(lora, LoRARequest):
            raise RequestError(f"lora_request must be a LoRARequest, got {type(lora).__name__}",
                               param="lora_request")
        if lora.lora_int_id < 1:
            raise RequestError(f"lora_int_id must be >= 1, got {lora.lora_int_id}",
                               param="lora_request")
        known = self._checked.get(lora.lora_int_id)
        if known is not None:
            if known.lora_path != lora.lora_path:
                raise RequestError(f"lora_int_id {lora.lora_int_id} already names the adapter "
                                   f"at {known.lora_path!r}", param="lora_request")
            return
        try:
            read_adapter(lora.lora_path, self.model_config, self.max_rank)
        except LoRAAdapterError as exc:
            raise RequestError(f"LoRA adapter {lora.lora_name!r}: {exc}",
                               param="lora_request") from None
        self._checked[lora.lora_int_id] = lora

    def add(self, name: str, path: str) -> LoRARequest:
        """Check and name a new adapter (RequestError if the name is taken or it is bad)."""
        if name in self.by_name:
            raise RequestError(f"a LoRA adapter named {name!r} is already loaded",
                               param="lora_name")
        lora = LoRARequest(name, next(self._ids), path)
        self.check(lora)
        self.by_name[name] = lora
        return lora

    def remove(self, name: str) -> LoRARequest:
        """Forget a named adapter (KeyError if none has that name)."""
        lora = self.by_name.pop(name)
        self._checked.pop(lora.lora_int_id, None)
        return lora
