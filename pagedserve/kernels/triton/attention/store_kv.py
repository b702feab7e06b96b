"""Triton store of this step's K/V rows into the paged cache at their slots.

One program per token copies its whole [Hkv, D] row for K and for V; a token whose slot is -1
(its KV is already cached: a prefix hit, or padding) writes nothing. Into an FP8 cache each
element is divided by its KV head's scale, clamped to e4m3's range and rounded
(`pagedserve.attention.kv_quant`).
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from pagedserve.kernels.fp8_format import FP8_MAX, is_fp8
from pagedserve.kernels.triton import pdl
from pagedserve.kernels.triton.e4m3 import round_to_e4m3

_FP8_MAX = tl.constexpr(FP8_MAX)


@triton.jit
def _quantized(x, scale_ptr, offs, mask, HEAD_DIM: tl.constexpr, FP8: tl.constexpr):
    """x as the cache stores it: unchanged, or x / scale[head] clamped and rounded for
    e4m3."""
    if FP8:
        scale = tl.load(scale_ptr + offs // HEAD_DIM, mask=mask, other=1.0)
        x = round_to_e4m3(tl.clamp(x.to(tl.float32) / scale, -_FP8_MAX, _FP8_MAX))
    return x


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr,
                     v_scale_ptr, stride_k, stride_v, ROW: tl.constexpr, BLOCK: tl.constexpr,
                     HEAD_DIM: tl.constexpr, FP8: tl.constexpr):
    pdl.step_entry()
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token)
    if slot < 0:
        return
    offs = tl.arange(0, BLOCK)
    mask = offs < ROW
    dst = slot.to(tl.int64) * ROW + offs
    k = _quantized(tl.load(k_ptr + token * stride_k + offs, mask=mask), k_scale_ptr, offs,
                   mask, HEAD_DIM, FP8)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = _quantized(tl.load(v_ptr + token * stride_v + offs, mask=mask), v_scale_ptr, offs,
                   mask, HEAD_DIM, FP8)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _rows_contiguous(x: Tensor) -> Tensor:
    """Each token's [H, D] row must be contiguous; the token stride may be anything (views
    of a fused QKV projection keep theirs)."""
    if x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        return x
    return x.contiguous()


def store_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
             kv_scales: tuple[Tensor, Tensor] | None = None) -> None:
    """k/v [T, Hkv, D] into caches [num_blocks, block_size, Hkv, D] (contiguous); an FP8
    cache needs kv_scales, its (K, V) scales [Hkv] float32."""
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "KV caches must be contiguous"
    fp8 = is_fp8(k_cache)
    assert not fp8 or kv_scales is not None, "an FP8 KV cache needs its scales"
    k_scale, v_scale = kv_scales if fp8 else (k_cache, v_cache)  # unread without FP8
    k, v = _rows_contiguous(k), _rows_contiguous(v)
    row = k.shape[1] * k.shape[2]
    _store_kv_kernel[(num_tokens,)](k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale,
                                    k.stride(0), v.stride(0), ROW=row,
                                    BLOCK=triton.next_power_of_2(row), HEAD_DIM=k.shape[2],
                                    FP8=fp8, **pdl.launch_options())
