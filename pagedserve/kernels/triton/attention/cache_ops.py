"""Triton copy of whole KV blocks inside each layer's caches (copy-on-write).

torch's index_select + index_copy_ moves every byte twice (through a temporary) and reaches a
small share of the GPU's copy bandwidth; this kernel reads each source block once and writes it
once (docs/benchmarks.md, "Block copy and swap").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _copy_blocks_kernel(k_ptr, v_ptr, pairs_ptr, BLOCK_NUMEL: tl.constexpr,
                        CHUNK: tl.constexpr):
    pair = tl.program_id(0)
    offs = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    mask = offs < BLOCK_NUMEL
    src = tl.load(pairs_ptr + 2 * pair).to(tl.int64) * BLOCK_NUMEL + offs
    dst = tl.load(pairs_ptr + 2 * pair + 1).to(tl.int64) * BLOCK_NUMEL + offs
    tl.store(k_ptr + dst, tl.load(k_ptr + src, mask=mask), mask=mask)
    tl.store(v_ptr + dst, tl.load(v_ptr + src, mask=mask), mask=mask)


def copy_blocks(kv_caches: list[tuple[Tensor, Tensor]], src_dst: Tensor) -> None:
    """src_dst [N, 2] (src block, dst block); one launch per layer, K and V together."""
    if src_dst.numel() == 0:
        return
    pairs = src_dst.to(device=kv_caches[0][0].device, dtype=torch.int64).contiguous()
    block_numel = kv_caches[0][0][0].numel()
    chunk = min(4096, triton.next_power_of_2(block_numel))
    grid = (pairs.shape[0], triton.cdiv(block_numel, chunk))
    for k_cache, v_cache in kv_caches:
        assert k_cache.is_contiguous() and v_cache.is_contiguous()
        _copy_blocks_kernel[grid](k_cache, v_cache, pairs, BLOCK_NUMEL=block_numel,
                                  CHUNK=chunk)
