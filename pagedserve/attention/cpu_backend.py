"""CPU attention backend: the native paged-decode kernel for decodes, torch for prefills.

The decode step is where the CPU engine spends its attention time, and there the reference's
gather of every decode's context into a padded copy costs more than the attention itself; the
kernel (`pagedserve/native/attention.c`) reads K/V in place through the block tables, in the
same call that stores the step's new K/V rows. Prefill chunks are many queries against one
context each, which SDPA already does well, so they keep the reference's `paged_prefill_one`.

The kernel trusts the block ids, slots and lengths it is given, so those are checked once per
step, when the first layer builds the step's `StepIndices`; every later layer only calls the
kernel. Anything but float32 q and caches, or a head shape the kernel does not handle, runs
the whole layer through the reference backend.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pagedserve.attention.backend import AttentionBackend
from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.attention.torch_ref import TorchRefBackend, paged_prefill_one
from pagedserve.native import attention as native


def step_indices(meta: AttentionMetadata, k_cache: Tensor) -> native.StepIndices:
    """The step's indices as the kernel takes them, built and checked by the step's first
    layer and kept in `meta.derived` (which lives exactly as long as the step's metadata)."""
    num_blocks, block_size = k_cache.shape[:2]
    indices = meta.derived.get("cpu")
    if indices is None or (indices.num_blocks, indices.block_size) != (num_blocks, block_size):
        nd = meta.num_decodes
        indices = meta.derived["cpu"] = native.StepIndices.check(
            meta.slot_mapping.to(torch.int64).contiguous(),
            meta.block_tables[:nd].to(torch.int32).contiguous(),
            meta.seq_lens[:nd].to(torch.int32).contiguous(), num_blocks, block_size)
    return indices


class CpuBackend(AttentionBackend):
    """Native float32 store and decode attention; the reference for everything else."""

    name = "cpu"

    def __init__(self) -> None:
        self._reference = TorchRefBackend()

    def forward(self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                meta: AttentionMetadata, scale: float) -> Tensor:
        if not self._native(q, k_cache):
            return self._reference.forward(q, k, v, k_cache, v_cache, meta, scale)
        out = torch.empty(q.shape, dtype=q.dtype)
        native.store_and_decode(q, k, v, k_cache, v_cache, step_indices(meta, k_cache), scale,
                                out)
        if meta.num_seqs > meta.num_decodes:
            _prefills(q, k_cache, v_cache, meta, scale, out)
        return out

    @staticmethod
    def _native(q: Tensor, k_cache: Tensor) -> bool:
        """Whether the kernel takes this layer: float32 on the CPU, a supported head shape."""
        return (q.dtype == k_cache.dtype == torch.float32 and q.is_cpu
                and native.supports(q.shape[1], k_cache.shape[2], k_cache.shape[3]))


def _prefills(q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata,
              scale: float, out: Tensor) -> None:
    """The prefill sequences (after the decodes), one reference SDPA each, into out."""
    starts = meta.query_start_loc.tolist()
    seq_lens = meta.seq_lens.tolist()
    for i in range(meta.num_decodes, meta.num_seqs):
        s, e = starts[i], starts[i + 1]
        out[s:e] = paged_prefill_one(q[s:e], k_cache, v_cache, meta.block_tables[i],
                                     seq_lens[i], scale)
