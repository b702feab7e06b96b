"""The runner's LoRA adapters: device slots, a host cache behind them, and each step's rows.

`max_loras` slots hold adapters on the device (the model's `LoRAStack`s, `model/lora.py`);
`max_cpu_loras` adapters stay read and laid out in host memory (pinned on CUDA) behind them.
An adapter a step needs is loaded on demand: from the host cache, else read from its folder
(`lora_adapter.read_adapter`: this rank's shard). A slot is taken from the free ones, else from
the adapter used least recently among those the step does not need; the scheduler admits at
most `max_loras` distinct adapters among its running requests, so one is always idle.
A slot is written by copies queued on the device's stream: a step still running there reads
the old weights to its end.

Each rank decides alone: the slots are this rank's memory, and every rank sees the same
steps, so their choices agree anyway, but nothing depends on that.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from pagedserve.device.input_batch import StepBuffers
from pagedserve.messages import LoRARequest
from pagedserve.model import lora
from pagedserve.model.config import ModelConfig
from pagedserve.model.lora_adapter import LoRAAdapter, read_adapter


class LoRASlots:
    def __init__(self, model, model_config: ModelConfig, max_loras: int, max_rank: int,
                 max_cpu_loras: int, device: torch.device) -> None:
        self.model_config = model_config
        self.max_rank = max_rank
        self.max_cpu_loras = max_cpu_loras
        self.device = device
        self.dtype = model.embed_tokens.weight.dtype
        self.stacks = lora.attach(model, max_loras, max_rank)
        # the torch reference reads each slot's rows, grouped on the host; the kernels do not
        self.grouped = model.lora_fn is lora.reference_lora
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, LRU first
        self._free = list(range(max_loras - 1, -1, -1))
        self._host: OrderedDict[int, LoRAAdapter] = OrderedDict()  # LRU first

    def slots(self, adapters: list[LoRARequest | None]) -> np.ndarray:
        """Each request's slot (-1: the base model), loading the adapters not in one."""
        needed = {a.lora_int_id for a in adapters if a is not None}
        return np.fromiter((-1 if a is None else self._slot(a, needed) for a in adapters),
                           dtype=np.int32, count=len(adapters))

    def _slot(self, adapter: LoRARequest, needed: set[int]) -> int:
        key = adapter.lora_int_id
        slot = self._slot_of.get(key)
        if slot is not None:
            self._slot_of.move_to_end(key)
            return slot
        weights = self._host_weights(adapter)
        if self._free:
            slot = self._free.pop()
        else:
            idle = next((k for k in self._slot_of if k not in needed), None)
            if idle is None:
                raise RuntimeError("a step needs more LoRA adapters than there are slots")
            slot = self._slot_of.pop(idle)
        lora.write_slot(self.stacks, slot, weights, self.max_rank)
        self._slot_of[key] = slot
        return slot

    def _host_weights(self, adapter: LoRARequest) -> LoRAAdapter:
        key = adapter.lora_int_id
        weights = self._host.get(key)
        if weights is None:
            weights = read_adapter(adapter.lora_path, self.model_config, self.max_rank,
                                   self.dtype)
            if self.device.type == "cuda":
                weights = _pinned(weights)
            while len(self._host) >= self.max_cpu_loras:
                self._host.popitem(last=False)
            self._host[key] = weights
        self._host.move_to_end(key)
        return weights

    def batch(self, buffers: StepBuffers, request_slots: np.ndarray, num_new: np.ndarray,
              query_start_loc, rows: int, token_rows: int, graph: bool) -> lora.LoRABatch | None:
        """The step's `LoRABatch` from each request's slot, written into the step buffers
        (padding rows are the base model's); None for an eager step with no adapter."""
        if not graph and not (request_slots >= 0).any():
            return None
        num_seqs, num_tokens = len(request_slots), int(num_new.sum())
        token_slots = buffers.lora_slots.np
        token_slots[:num_tokens] = np.repeat(request_slots, num_new)
        token_slots[num_tokens:token_rows] = -1
        seg_lens, seg_slots = buffers.lora_seg_lens.np, buffers.lora_seg_slots.np
        seg_lens[:num_seqs], seg_slots[:num_seqs] = num_new, request_slots
        seg_lens[num_seqs:rows], seg_slots[num_seqs:rows] = 1, -1
        rows_by_slot = None
        if self.grouped and not graph:
            host_rows = token_slots[:num_tokens]
            rows_by_slot = {int(s): torch.from_numpy(np.flatnonzero(host_rows == s)).to(
                self.device, non_blocking=True) for s in np.unique(request_slots) if s >= 0}
        return lora.LoRABatch(
            buffers.lora_slots.upload(token_rows), query_start_loc[:rows],
            buffers.lora_seg_lens.upload(rows), buffers.lora_seg_slots.upload(rows),
            int(num_new.max()) if num_seqs else 1, rows_by_slot)


def decode_graph_batch(buffers: StepBuffers, size: int) -> lora.LoRABatch:
    """The rows of a captured decode graph of `size` rows: the buffers it replays."""
    return lora.LoRABatch(buffers.lora_slots.device[:size], buffers.query_start_loc.device[:size],
                          buffers.lora_seg_lens.device[:size],
                          buffers.lora_seg_slots.device[:size], 1)


def _pinned(adapter: LoRAAdapter) -> LoRAAdapter:
    """Host copies in page-locked memory: the slot copies are then DMAs queued on the stream."""
    modules = {key: [type(s)(s.index, s.out_start, s.a.pin_memory(), s.b.pin_memory())
                     for s in shards] for key, shards in adapter.modules.items()}
    return LoRAAdapter(adapter.rank, modules)
