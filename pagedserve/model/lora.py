"""Batched LoRA: requests of one step run under different adapters (or none) together.

Each dense projection of the decoder gets a `LoRAStack`: every device slot's A and B for it,
stacked, fixed in size and address (a CUDA graph replays the same addresses; a load writes a
slot in place). For a fused module of n shards (q/k/v: 3, gate/up: 2) the stacked rank is
n * max_rank and B is block-diagonal over the shards (`lora_adapter.py`), so one shrink
(x @ A.T) and one expand (@ B.T, added to the output) serve the whole module.

Which rows run under which slot is the step's `LoRABatch`, set around the forward pass by the
runner (`lora_context`), like the attention's forward context: per token its slot (-1: the
base model), and the rows grouped by slot in tiles, for the kernels that read an adapter's
weights once per tile of its rows. The implementation of the shrink-expand is the model's `Ops.lora`, chosen at load:
the torch reference below (the CPU engine), or the Triton kernels
(`kernels/triton/lora.py`). A row-parallel projection (o, down under tensor parallelism)
adds its LoRA output before the all-reduce: each rank's expand of its partial shrink sums to
the whole, so no extra communication is needed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from pagedserve.model.lora_adapter import FUSED, LoRAAdapter


@dataclass
class LoRABatch:
    """The step's adapter rows. Tensors on the model's device, int32."""

    token_slots: Tensor  # [T]: each token's slot, -1 for the base model
    # the rows of adapters sorted by slot, cut into tiles of one slot each (the kernels' unit:
    # a tile's rows share its slot's weights); unused tiles have slot -1
    sorted_rows: Tensor  # [T]
    tile_starts: Tensor  # [tiles]: the tile's first entry of sorted_rows
    tile_lens: Tensor  # [tiles]
    tile_slots: Tensor  # [tiles]
    one_row_kernels: bool  # a small decode step: each row on its own (kernels/triton/lora.py)
    tile_rows: int = 32  # the most rows in a tile (TILE_ROWS)
    # the reference's grouping, on the host: slot -> its rows (None where the kernels run)
    rows_by_slot: dict[int, Tensor] | None = None


TILE_ROWS = 32  # a tile's rows: weights read once per this many rows of an adapter
ONE_ROW_MAX = 8  # decode steps of at most this many rows run each row on its own


def max_tiles(num_rows: int, num_slots: int) -> int:
    """The most tiles `num_rows` rows over `num_slots` adapters can make."""
    return -(-num_rows // TILE_ROWS) + num_slots


def fill_tiles(token_slots: np.ndarray, sorted_rows: np.ndarray, tile_starts: np.ndarray,
               tile_lens: np.ndarray, tile_slots: np.ndarray) -> int:
    """Sort the rows of adapters (slot >= 0) by slot into `sorted_rows` and cut each slot's
    run into tiles of at most TILE_ROWS; returns the tile count. Entries past it are left to
    the caller (a graph's fixed grid marks them unused: slot -1)."""
    rows = np.flatnonzero(token_slots >= 0)
    rows = rows[np.argsort(token_slots[rows], kind="stable")]
    sorted_rows[:len(rows)] = rows
    slots, starts, counts = np.unique(token_slots[rows], return_index=True, return_counts=True)
    offsets = [np.arange(0, c, TILE_ROWS) for c in counts.tolist()]
    n = sum(len(o) for o in offsets)
    if n:
        tile_starts[:n] = np.concatenate([start + o for start, o in zip(starts, offsets)])
        tile_lens[:n] = np.concatenate([np.minimum(TILE_ROWS, c - o)
                                        for c, o in zip(counts, offsets)])
        tile_slots[:n] = np.repeat(slots, [len(o) for o in offsets])
    return n


LoRAFn = Callable[[Tensor, Tensor, Tensor, Tensor, LoRABatch], None]  # x, y, a, b, batch

_BATCH: list[LoRABatch | None] = [None]


@contextmanager
def lora_context(batch: LoRABatch | None) -> Iterator[None]:
    """The adapters' rows for the forward pass inside; None: every row is the base model's."""
    previous, _BATCH[0] = _BATCH[0], batch
    try:
        yield
    finally:
        _BATCH[0] = previous


class LoRAStack:
    """One projection's slots: a [slots, R, in], b [slots, out, R]; applied to the rows of
    the current `LoRABatch` through `fn` (y += x @ a[slot].T @ b[slot].T, in place)."""

    def __init__(self, num_slots: int, rank: int, in_features: int, out_features: int,
                 fn: LoRAFn, device: torch.device, dtype: torch.dtype) -> None:
        self.a = torch.zeros(num_slots, rank, in_features, device=device, dtype=dtype)
        self.b = torch.zeros(num_slots, out_features, rank, device=device, dtype=dtype)
        self.fn = fn

    def __call__(self, x: Tensor, y: Tensor) -> None:
        batch = _BATCH[0]
        if batch is not None:
            self.fn(x, y, self.a, self.b, batch)


def reference_lora(x: Tensor, y: Tensor, a: Tensor, b: Tensor, batch: LoRABatch) -> None:
    """The torch reference: each slot's rows in one gather, shrink, expand and add."""
    for slot, rows in batch.rows_by_slot.items():
        y.index_add_(0, rows, (x.index_select(0, rows) @ a[slot].T) @ b[slot].T)


def attach(model, num_slots: int, max_rank: int) -> dict[tuple[int, str], LoRAStack]:
    """Give each layer's dense projections their stacks (zeros: an empty slot adds nothing),
    applied through the model's `lora_fn` (its `Ops.lora`); returns them by (layer, module).
    The fast mode's whole-step decode has no LoRA: it is turned off."""
    fn = model.lora_fn
    param = model.embed_tokens.weight
    stacks = {}
    for index, layer in enumerate(model.layers):
        for name, linear in _linears(layer):
            rank = len(FUSED[name]) * max_rank
            stack = LoRAStack(num_slots, rank, linear.in_features, linear.out_features, fn,
                              param.device, param.dtype)
            linear.lora = stacks[index, name] = stack
    model.fast_decode = None
    return stacks


def _linears(layer) -> list[tuple[str, object]]:
    attn, mlp = layer.self_attn, layer.mlp
    found = [("qkv_proj", attn.qkv_proj), ("o_proj", attn.o_proj)]
    if hasattr(mlp, "gate_up_proj"):  # dense MLP (MoE experts have none)
        found += [("gate_up_proj", mlp.gate_up_proj), ("down_proj", mlp.down_proj)]
    return found


def write_slot(stacks: dict[tuple[int, str], LoRAStack], slot: int,
               adapter: LoRAAdapter | None, max_rank: int) -> None:
    """Put `adapter` in `slot` of every stack (None: clear it). Copies in place: the stacks'
    addresses never change."""
    for (layer, name), stack in stacks.items():
        stack.a[slot].zero_()
        stack.b[slot].zero_()
        for shard in (adapter.modules.get((layer, name), []) if adapter else []):
            r, cols = shard.a.shape[0], shard.index * max_rank
            out = shard.b.shape[0]
            stack.a[slot, cols:cols + r].copy_(shard.a, non_blocking=True)
            stack.b[slot, shard.out_start:shard.out_start + out, cols:cols + r].copy_(
                shard.b, non_blocking=True)
