"""Batched LoRA: requests of one step run under different adapters (or none) together.

Each dense projection of the decoder gets a `LoRAStack`: every device slot's A and B for it,
stacked, fixed in size and address (a CUDA graph replays the same addresses; a load writes a
slot in place). For a fused module of n shards (q/k/v: 3, gate/up: 2) the stacked rank is
n * max_rank and B is block-diagonal over the shards (`lora_adapter.py`), so one shrink
(x @ A.T) and one expand (@ B.T, added to the output) serve the whole module.

Which rows run under which slot is the step's `LoRABatch`, set around the forward pass by the
runner (`lora_context`), like the attention's forward context: per token its slot (-1: the
base model), and per request its segment, for the kernels that group a prefill's rows by
adapter. The implementation of the shrink-expand is the model's `Ops.lora`, chosen at load:
the torch reference below (the CPU engine), or the Triton kernels
(`kernels/triton/lora.py`). A row-parallel projection (o, down under tensor parallelism)
adds its LoRA output before the all-reduce: each rank's expand of its partial shrink sums to
the whole, so no extra communication is needed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

from pagedserve.model.lora_adapter import FUSED, LoRAAdapter


@dataclass
class LoRABatch:
    """The step's adapter rows. Tensors on the model's device, int32."""

    token_slots: Tensor  # [T]: each token's slot, -1 for the base model
    seg_starts: Tensor  # [S]: each request's first token
    seg_lens: Tensor  # [S]
    seg_slots: Tensor  # [S]
    max_seg_len: int  # 1: a decode-only step (the gathered kernels, one row at a time)
    # the reference's grouping, on the host: slot -> its rows (None under a CUDA graph)
    rows_by_slot: dict[int, Tensor] | None = None


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
