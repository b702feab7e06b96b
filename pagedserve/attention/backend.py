"""The attention backend interface and the per-step forward context (the choice of backend:
`selector.py`).

The model's attention layers do not receive metadata as arguments: the model runner sets a
forward context once per step and each layer fetches it, which keeps the model's `forward`
signature identical to a plain decoder's (`input_ids`, `positions`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from pagedserve.kernels.fp8_format import FP8_DTYPE
from pagedserve.attention.metadata import AttentionMetadata


@dataclass(frozen=True)
class AttentionShape:
    """What a model's attention layers hand a backend, known at load: the selector picks a
    backend (a kernel) that takes it, so no backend decides per call."""

    dtype: torch.dtype  # q's (the activations')
    cache_dtype: torch.dtype
    num_heads: int  # this rank's query heads
    num_kv_heads: int
    head_dim: int
    softcap: float | None = None  # a score cap (Gemma 2)


class QKRotation(NamedTuple):
    """A layer's rotation of q and k in one step: `rotate_qk_` (the model's `Ops.rotate_qk_`)
    and its arguments, RoPE at `positions` from the cos/sin tables after an RMSNorm of each q
    and k head with q_weight / k_weight (Qwen3; None: no norm)."""

    rotate_qk_: Callable[..., None]
    positions: Tensor
    cos: Tensor
    sin: Tensor
    q_weight: Tensor | None
    k_weight: Tensor | None
    eps: float

    def apply_(self, qkv: Tensor, num_q_heads: int, num_kv_heads: int) -> None:
        """Rotates qkv's q and k heads in place."""
        self.rotate_qk_(qkv, self.positions, self.cos, self.sin, num_q_heads, num_kv_heads,
                        self.q_weight, self.k_weight, self.eps)


class AttentionBackend(ABC):
    """Stores new K/V into the paged cache and attends through block tables.

    A model's attention layer hands it the fused QKV projection with q and k not yet rotated
    (`forward_qkv`), so that a backend whose K/V store can rotate them does both in one kernel
    (the Triton backend); the others rotate with the model's op, then run `forward`.

    `copy_blocks` and `swap_blocks` are plain torch here, correct on every device; a backend
    overrides them where a kernel is faster (the Triton backend's copy_blocks).
    """

    name: str = "base"
    # whether a CUDA graph can capture `forward`: no host syncs, no data-dependent shapes
    capturable: bool = True

    @abstractmethod
    def forward(self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                meta: AttentionMetadata, scale: float, window: int | None = None,
                softcap: float | None = None,
                kv_scales: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]; writes k/v at meta.slot_mapping.

        window: the layer's sliding window, None for global attention: a query at position
        p sees keys p - window < k <= p. softcap: scores s become softcap * tanh(s / softcap)
        (after the scale, before the softmax), None for none. kv_scales: an FP8 cache's
        (K, V) scales [Hkv] (`kv_quant`), None for a cache in the model's dtype.
        """

    def forward_qkv(self, qkv: Tensor, num_kv_heads: int, rotation: QKRotation,
                    k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, scale: float,
                    window: int | None = None, softcap: float | None = None,
                    kv_scales: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """qkv [T, Hq + 2 Hkv, D], q and k not yet rotated -> [T, Hq, D]: `rotation` applied
        to q (in place) and k, then `forward` of q, k and v. Here the two in turn; a backend
        may instead rotate in its K/V store, with the arithmetic of `rotate_qk_` on its
        device (the Triton backend: `kernels/triton/model_ops.rotate_qk_`'s, which every
        model on CUDA takes), leaving qkv's k heads as they were."""
        num_q_heads = qkv.shape[1] - 2 * num_kv_heads
        rotation.apply_(qkv, num_q_heads, num_kv_heads)
        q, k, v = qkv.split([num_q_heads, num_kv_heads, num_kv_heads], dim=1)
        return self.forward(q, k, v, k_cache, v_cache, meta, scale, window, softcap, kv_scales)

    def copy_blocks(self, kv_caches: list[tuple[Tensor, Tensor]], src_dst: Tensor) -> None:
        """Copy whole blocks within each layer's caches (copy-on-write). src_dst: [N, 2]."""
        if src_dst.numel() == 0:
            return
        src_dst = src_dst.to(device=kv_caches[0][0].device, dtype=torch.long)
        src, dst = src_dst[:, 0], src_dst[:, 1]
        for k_cache, v_cache in map(as_bytes, kv_caches):
            k_cache.index_copy_(0, dst, k_cache.index_select(0, src))
            v_cache.index_copy_(0, dst, v_cache.index_select(0, src))

    def swap_blocks(self, src_caches: list[tuple[Tensor, Tensor]],
                    dst_caches: list[tuple[Tensor, Tensor]], src_to_dst: Tensor) -> None:
        """Copy blocks between two sets of per-layer caches, e.g. GPU <-> CPU memory for
        preemption by swapping. src_to_dst: [N, 2] block ids.

        The gather happens where the source lives and the scatter where the destination
        lives, so only the selected blocks cross the bus, through pinned memory: a copy from
        pageable memory is a fraction of pinned memory's rate (docs/benchmarks.md, "Block copy
        and swap"). The ids are moved (and, for a swap
        out, split into runs) once for all layers.
        """
        if src_to_dst.numel() == 0:
            return
        src_to_dst = src_to_dst.to(torch.long)
        src_device, dst_device = src_caches[0][0].device, dst_caches[0][0].device
        src_ids = src_to_dst[:, 0].to(src_device)
        pairs = [(s, d) for src, dst in zip(map(as_bytes, src_caches), map(as_bytes, dst_caches))
                 for s, d in zip(src, dst)]
        if src_device != dst_device and dst_device.type == "cpu":
            _swap_out(pairs, src_ids, consecutive_runs(src_to_dst[:, 1].tolist()))
            return
        dst_ids = src_to_dst[:, 1].to(dst_device)
        for src, dst in pairs:
            if src_device == dst_device:
                dst.index_copy_(0, dst_ids, src.index_select(0, src_ids))
            else:  # swap in: gather into pinned memory, then upload
                staged = torch.empty((src_ids.numel(), *src.shape[1:]), dtype=src.dtype,
                                     pin_memory=True)
                torch.index_select(src, 0, src_ids, out=staged)
                dst.index_copy_(0, dst_ids, staged.to(dst_device, non_blocking=True))


def as_bytes(caches: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """A layer's FP8 caches viewed as uint8: copies move bytes, and not every torch
    index kernel takes float8 tensors."""
    if caches[0].dtype != FP8_DTYPE:
        return caches
    return caches[0].view(torch.uint8), caches[1].view(torch.uint8)


def _swap_out(pairs: list[tuple[Tensor, Tensor]], src_ids: Tensor,
              runs: list[tuple[int, int, int]]) -> None:
    """Gather on the device, then one DMA per run of consecutive destination blocks straight
    into the (pinned) CPU cache. Nothing waits here: a CPU-side scatter would need the copy
    finished, i.e. a sync with the step in flight. Whoever reads the CPU cache on the host
    must first wait for these copies (ModelRunner.swap does)."""
    for src, dst in pairs:
        gathered = src.index_select(0, src_ids)
        for start, stop, first in runs:
            dst[first:first + stop - start].copy_(gathered[start:stop], non_blocking=True)


def consecutive_runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """(start, stop, first id) of each run of consecutive values in ids[start:stop]."""
    runs, start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[i - 1] + 1:
            runs.append((start, i, ids[start]))
            start = i
    return runs


@dataclass
class ForwardContext:
    """What an attention layer needs for the current step besides its own KV cache."""

    meta: AttentionMetadata
    backend: AttentionBackend
    # a recall this step lands layer by layer: layer n's attention first waits for its part
    # (`device/tier_copies.TierCopies.await_layer`); None: nothing to wait for
    kv_ready: Callable[[int], None] | None = None


_forward_context: ForwardContext | None = None


@contextmanager
def set_forward_context(meta: AttentionMetadata, backend: AttentionBackend,
                        kv_ready: Callable[[int], None] | None = None
                        ) -> Iterator[ForwardContext]:
    """Make `meta`, `backend` (and a recall's per-layer wait) visible to attention layers
    for one forward step."""
    global _forward_context
    previous = _forward_context
    _forward_context = ForwardContext(meta, backend, kv_ready)
    try:
        yield _forward_context
    finally:
        _forward_context = previous


def get_forward_context() -> ForwardContext:
    if _forward_context is None:
        raise RuntimeError("no forward context: call the model inside set_forward_context()")
    return _forward_context
