"""Triton store of this step's K/V rows into the paged cache at their slots.

One program per token copies its whole [Hkv, D] row for K and for V; a token whose slot is -1
(its KV is already cached: a prefix hit, or padding) writes nothing.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, stride_k, stride_v,
                     ROW: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token)
    if slot < 0:
        return
    offs = tl.arange(0, BLOCK)
    mask = offs < ROW
    dst = slot.to(tl.int64) * ROW + offs
    k = tl.load(k_ptr + token * stride_k + offs, mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(v_ptr + token * stride_v + offs, mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _rows_contiguous(x: Tensor) -> Tensor:
    """Each token's [H, D] row must be contiguous; the token stride may be anything (views
    of a fused QKV projection keep theirs)."""
    if x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        return x
    return x.contiguous()


def store_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
             slot_mapping: Tensor) -> None:
    """k/v [T, Hkv, D] into caches [num_blocks, block_size, Hkv, D] (contiguous)."""
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "KV caches must be contiguous"
    k, v = _rows_contiguous(k), _rows_contiguous(v)
    row = k.shape[1] * k.shape[2]
    _store_kv_kernel[(num_tokens,)](k, v, k_cache, v_cache, slot_mapping, k.stride(0),
                                    v.stride(0), ROW=row, BLOCK=triton.next_power_of_2(row))
