"""Triton store of this step's K/V rows into the paged cache at their slots.

`store_kv`: one program per token copies its whole [Hkv, D] row for K and for V; a token whose
slot is -1 (its KV is already cached: a prefix hit, or padding) writes nothing. Into an FP8
cache each element is divided by its KV head's scale, clamped to e4m3's range and rounded
(`pagedserve.attention.kv_quant`).

`rotate_store_kv_` (what the Triton backend runs): the same store fused with the RoPE kernel
before it (`model_ops.rotate_qk_`, with Qwen3's q/k norm), which writes q back into the fused
QKV projection and k straight into the cache. Why: at batch 1 a decode step is a chain of
~340 small kernels, each boundary a few microseconds beyond its memory traffic, and this is
one a layer fewer (docs/benchmarks.md, "RoPE fused with the KV store"). It writes the bits of
the two kernels: the rotation is `model_ops.rotated_heads` on `rotate_qk_`'s tiles, and k goes
through the rounding to the activation dtype that storing it into qkv did.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from pagedserve.kernels.fp8_format import FP8_MAX, is_fp8
from pagedserve.kernels.triton import pdl
from pagedserve.kernels.triton.e4m3 import round_to_e4m3
from pagedserve.kernels.triton.model_ops import (ROTATION_WARPS, check_rotation, rotated_heads,
                                               rotation_tile)
from pagedserve.kernels.triton.precision import round_to

_FP8_MAX = tl.constexpr(FP8_MAX)


@triton.jit
def _quantized(x, scale_ptr, offs, mask, HEAD_DIM: tl.constexpr, FP8: tl.constexpr):
    """x as the cache stores it: unchanged, or x / scale[head] clamped and rounded for
    e4m3."""
    if FP8:
        scale = tl.load(scale_ptr + offs // HEAD_DIM, mask=mask, other=1.0)
        x = _to_e4m3(x.to(tl.float32), scale)
    return x


@triton.jit
def _to_e4m3(x, scale):
    """float32 x / scale, clamped to e4m3's range and rounded to an e4m3 value."""
    return round_to_e4m3(tl.clamp(x / scale, -_FP8_MAX, _FP8_MAX))


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr,
                     v_scale_ptr, stride_k, stride_v, ROW: tl.constexpr, BLOCK: tl.constexpr,
                     HEAD_DIM: tl.constexpr, FP8: tl.constexpr):
    pdl.step_entry()
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token)
    if slot < 0:
        return
    _store_row(k_ptr + token * stride_k, k_cache_ptr, k_scale_ptr, slot, ROW, BLOCK, HEAD_DIM,
               FP8)
    _store_row(v_ptr + token * stride_v, v_cache_ptr, v_scale_ptr, slot, ROW, BLOCK, HEAD_DIM,
               FP8)


@triton.jit
def _store_row(row_ptr, cache_ptr, scale_ptr, slot, ROW: tl.constexpr, BLOCK: tl.constexpr,
               HEAD_DIM: tl.constexpr, FP8: tl.constexpr):
    """One token's K (or V) row [Hkv * D] into the cache at `slot`, as the cache stores it."""
    offs = tl.arange(0, BLOCK)
    mask = offs < ROW
    x = _quantized(tl.load(row_ptr + offs, mask=mask), scale_ptr, offs, mask, HEAD_DIM, FP8)
    tl.store(cache_ptr + slot.to(tl.int64) * ROW + offs, x.to(cache_ptr.dtype.element_ty),
             mask=mask)


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
    k_scale, v_scale = _cache_scales(k_cache, v_cache, kv_scales)
    k, v = _rows_contiguous(k), _rows_contiguous(v)
    row = k.shape[1] * k.shape[2]
    _store_kv_kernel[(num_tokens,)](k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale,
                                    k.stride(0), v.stride(0), ROW=row,
                                    BLOCK=triton.next_power_of_2(row), HEAD_DIM=k.shape[2],
                                    FP8=is_fp8(k_cache), **pdl.launch_options())


def _cache_scales(k_cache: Tensor, v_cache: Tensor,
                  kv_scales: tuple[Tensor, Tensor] | None) -> tuple[Tensor, Tensor]:
    """The (K, V) scale pointers a store kernel takes: an FP8 cache's own (which it needs),
    else any tensors (unread)."""
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "KV caches must be contiguous"
    fp8 = is_fp8(k_cache)
    assert not fp8 or kv_scales is not None, "an FP8 KV cache needs its scales"
    return kv_scales if fp8 else (k_cache, v_cache)


@triton.jit
def _rotate_store_kv_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, q_w_ptr, k_w_ptr, k_cache_ptr,
                            v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr, stride_tok, eps,
                            NUM_Q: tl.constexpr, NUM_KV: tl.constexpr, HEAD_DIM: tl.constexpr,
                            HALF_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
                            BLOCK_V: tl.constexpr, HAS_NORM: tl.constexpr, FP8: tl.constexpr):
    pdl.step_entry()
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    NUM_ROT: tl.constexpr = NUM_Q + NUM_KV
    ROW: tl.constexpr = NUM_KV * HEAD_DIM
    HALF: tl.constexpr = HEAD_DIM // 2
    if tl.program_id(1) == tl.num_programs(1) - 1:  # the last program stores v
        if slot >= 0:
            _store_row(qkv_ptr + token * stride_tok + NUM_ROT * HEAD_DIM, v_cache_ptr,
                       v_scale_ptr, slot, ROW, BLOCK_V, HEAD_DIM, FP8)
    else:  # the others rotate heads of q (stored back) and k (stored in the cache)
        heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        lo, out1, out2, mask = rotated_heads(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, q_w_ptr,
                                             k_w_ptr, token, heads, stride_tok, eps, NUM_Q,
                                             NUM_ROT, HEAD_DIM, HALF_PAD, HAS_NORM)
        dtype = qkv_ptr.dtype.element_ty
        is_q = (heads < NUM_Q)[:, None]
        tl.store(lo, out1.to(dtype), mask=mask & is_q)
        tl.store(lo + HALF, out2.to(dtype), mask=mask & is_q)
        if slot >= 0:
            _store_k(out1, out2, mask, heads - NUM_Q, k_cache_ptr + slot * ROW, k_scale_ptr,
                     dtype, NUM_KV, HEAD_DIM, HALF_PAD, FP8)


@triton.jit
def _store_k(out1, out2, mask, k_heads, row_ptr, scale_ptr, dtype: tl.constexpr,
             NUM_KV: tl.constexpr, HEAD_DIM: tl.constexpr, HALF_PAD: tl.constexpr,
             FP8: tl.constexpr):
    """The rotated halves of a tile's k heads (0 <= `k_heads` < NUM_KV; below: q's) into
    their cache row, as `store_kv` stores what `rotate_qk_` stored: rounded to the activation
    dtype, and for an FP8 cache quantized with the head's scale."""
    is_k = (k_heads >= 0) & (k_heads < NUM_KV)
    mask = mask & is_k[:, None]
    offs = k_heads[:, None] * HEAD_DIM + tl.arange(0, HALF_PAD)[None, :]
    # No more elements a store than qkv's 16-byte loads take: a 16-byte store of 16 FP8
    # values would pull the tile into another layout, where the q/k norm's sum adds up in
    # another order than `rotate_qk_`'s (sm_90 TTGIR, benchmarks/rotate_store_ptx.py).
    offs = tl.max_contiguous(offs, [1, 128 // dtype.primitive_bitwidth])
    if FP8:  # rounded on the bits (`round_to`): the compiler folds a cast there and back
        scale = tl.load(scale_ptr + k_heads, mask=is_k, other=1.0)[:, None]
        k1 = _to_e4m3(round_to(out1, dtype), scale)
        k2 = _to_e4m3(round_to(out2, dtype), scale)
    else:
        k1 = out1.to(dtype)
        k2 = out2.to(dtype)
    cache_dtype = row_ptr.dtype.element_ty
    tl.store(row_ptr + offs, k1.to(cache_dtype), mask=mask)
    tl.store(row_ptr + offs + HEAD_DIM // 2, k2.to(cache_dtype), mask=mask)


def rotate_store_kv_(qkv: Tensor, num_kv_heads: int, positions: Tensor, cos: Tensor,
                     sin: Tensor, q_weight: Tensor | None, k_weight: Tensor | None, eps: float,
                     k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
                     kv_scales: tuple[Tensor, Tensor] | None = None) -> None:
    """`model_ops.rotate_qk_` then `store_kv` of qkv's k and v, in one launch, to the bit:
    the q and k heads of qkv [T, Hq + 2 Hkv, D] RMSNormed (with q_weight / k_weight, when
    given) and rotated by their token's position, q written back in place, k and v into the
    caches at slot_mapping (nothing where -1). qkv's k heads are left as they were:
    attention reads K only from the cache. cos/sin and positions as `rotate_qk_` takes
    them; an FP8 cache needs kv_scales, as `store_kv`."""
    num_tokens, width, head_dim = qkv.shape
    check_rotation(qkv, cos, sin, q_weight, k_weight)
    if num_tokens == 0:
        return
    k_scale, v_scale = _cache_scales(k_cache, v_cache, kv_scales)
    num_q = width - 2 * num_kv_heads
    half_pad, block_h = rotation_tile(num_q + num_kv_heads, head_dim)
    has_norm = q_weight is not None
    # a token's rotation tiles, then one program for its v row
    grid = (num_tokens, triton.cdiv(num_q + num_kv_heads, block_h) + 1)
    _rotate_store_kv_kernel[grid](
        qkv, positions, cos, sin, q_weight if has_norm else cos, k_weight if has_norm else cos,
        k_cache, v_cache, slot_mapping, k_scale, v_scale, qkv.stride(0), eps, NUM_Q=num_q,
        NUM_KV=num_kv_heads, HEAD_DIM=head_dim, HALF_PAD=half_pad, BLOCK_H=block_h,
        BLOCK_V=triton.next_power_of_2(num_kv_heads * head_dim), HAS_NORM=has_norm,
        FP8=is_fp8(k_cache), num_warps=ROTATION_WARPS, **pdl.launch_options())
