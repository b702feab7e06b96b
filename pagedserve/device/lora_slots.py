"""The runner's LoRA adapters: device slots, a host cache behind them, and each step's rows.

`max_loras` slots hold adapters on the device (the model's `LoRAStack`s, `model/lora.py`);
`max_cpu_loras` adapters stay read and laid out in host memory (pinned on CUDA) behind them.
An adapter a step needs is loaded on demand: from the host cache, else read from its folder
(`lora_adapter.read_adapter`: this rank's shard). A slot is taken from the free ones, else from
the adapter used least recently among those the step does not need; the scheduler admits at
most `max_loras` distinct adapters among its running requests, so one is always idle.
A slot is written by copies queued on the device's stream: a step still running there reads
the old weights to its end.

Each step's rows go to the kernels as `LoRABatch` (model/lora.py), built here with numpy into
buffers of fixed size and address (a CUDA graph replays reads of them): each token's slot,
and the rows of adapters sorted by slot and cut into tiles.

Each rank decides alone: the slots are this rank's memory, and every rank sees the same
steps, so their choices agree anyway, but nothing depends on that.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from pagedserve.device.input_batch import StagedTensor
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
        self.num_slots = max_loras
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

    def allocate(self, max_tokens: int) -> None:
        """The step inputs' buffers (host and device), for steps of up to `max_tokens`."""
        def staged(size: int) -> StagedTensor:
            return StagedTensor.allocate((size,), torch.int32, self.device)

        tiles = lora.max_tiles(max_tokens, self.num_slots)
        self._token_slots, self._sorted_rows = staged(max_tokens), staged(max_tokens)
        self._tile_starts, self._tile_lens = staged(tiles), staged(tiles)
        self._tile_slots = staged(tiles)
        # what a graph captures before any step writes them: every row the base model's,
        # every tile unused (set here, not in the capture, which would replay the fill)
        for buffer in (self._token_slots, self._tile_slots):
            buffer.host.fill_(-1)
            buffer.device.fill_(-1)

    def batch(self, request_slots: np.ndarray, num_new: np.ndarray, token_rows: int,
              graph: bool) -> lora.LoRABatch | None:
        """The step's `LoRABatch` from each request's slot, written into the buffers
        (padding rows are the base model's); None for a step with no adapter, which then
        launches no LoRA kernel (a graph step replays the graph captured without them). A
        graph's tile count is fixed by its size, unused tiles marked -1."""
        if not (request_slots >= 0).any():
            return None
        num_tokens = int(num_new.sum())
        slots = self._token_slots.np[:token_rows]
        slots[:num_tokens] = np.repeat(request_slots, num_new)
        slots[num_tokens:] = -1
        one_row = bool((num_new == 1).all()) and token_rows <= lora.ONE_ROW_MAX
        if self.grouped:  # the reference: each slot's rows, on the host
            rows_by_slot = {int(s): torch.from_numpy(np.flatnonzero(slots == s)).to(self.device)
                            for s in np.unique(request_slots) if s >= 0}
            return lora.LoRABatch(self._token_slots.upload(token_rows), *self._no_tiles(),
                                  one_row, rows_by_slot=rows_by_slot)
        if one_row:
            return lora.LoRABatch(self._token_slots.upload(token_rows), *self._no_tiles(),
                                  True, lora.TILE_ROWS)
        count = lora.fill_tiles(slots, self._sorted_rows.np, self._tile_starts.np,
                                self._tile_lens.np, self._tile_slots.np)
        if graph:
            capacity = lora.max_tiles(token_rows, self.num_slots)
            self._tile_slots.np[count:capacity] = -1
            self._tile_lens.np[count:capacity] = 0
            count = capacity
        return lora.LoRABatch(self._token_slots.upload(token_rows),
                              self._sorted_rows.upload(token_rows),
                              self._tile_starts.upload(count), self._tile_lens.upload(count),
                              self._tile_slots.upload(count), False, lora.TILE_ROWS)

    def _no_tiles(self) -> tuple:
        empty = self._tile_slots.device[:0]
        return empty, empty, empty, empty

    def graph_batch(self, size: int) -> lora.LoRABatch:
        """The inputs a captured decode graph of `size` rows reads: views of the buffers,
        which each step's `batch` rewrites in place."""
        tiles = lora.max_tiles(size, self.num_slots)
        return lora.LoRABatch(
            self._token_slots.device[:size], self._sorted_rows.device[:size],
            self._tile_starts.device[:tiles], self._tile_lens.device[:tiles],
            self._tile_slots.device[:tiles], size <= lora.ONE_ROW_MAX, lora.TILE_ROWS)


def _pinned(adapter: LoRAAdapter) -> LoRAAdapter:
    """Host copies in page-locked memory: the slot copies are then DMAs queued on the stream."""
    modules = {key: [type(s)(s.index, s.out_start, s.a.pin_memory(), s.b.pin_memory())
                     for s in shards] for key, shards in adapter.modules.items()}
    return LoRAAdapter(adapter.rank, modules)
