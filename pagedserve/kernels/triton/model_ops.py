"""Triton kernels for the decoder's elementwise work: one launch where eager PyTorch needs many.

A decode step at batch 256 spends most of its non-GEMM time launching tiny elementwise kernels
(an RMSNorm in float32 with casts is ~6 launches, RoPE with `torch.roll` ~4). Each kernel here
reads its inputs once and writes its outputs once:

- `rms_norm`: optional residual add (written back in place) then RMSNorm, one program per row.
- `rotate_qk_`: Qwen3's per-head q/k RMSNorm and RoPE, in place on the fused QKV output, one
  program per (token, group of heads); the cos/sin rows are read by position inside the kernel.
  Its arithmetic (`rotated_heads`) is also the Triton backend's KV store's, which rotates as it
  stores (`attention/store_kv.rotate_store_kv_`): models on CUDA run that one.
- `silu_and_mul`: silu(gate) * up over the fused gate/up output.

Numerics are those of the eager path in `ops.py` (and of transformers): math in float32, and a
rounding to the activation dtype wherever eager PyTorch would produce a tensor of that dtype
(`_round`), so bf16 results agree bit for bit except for the order of a norm's sum of squares.
Each starts with `pdl.step_entry` and is launched with PDL (see kernels/triton/pdl.py).
The kernels run on CUDA and, under TRITON_INTERPRET=1, on the CPU (tests/kernels).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from pagedserve.kernels.triton import pdl
from pagedserve.kernels.triton.precision import round_to


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, stride_x, stride_res, stride_out, eps,
                     N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    pdl.step_entry()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    add_rms_norm_row(x, res_ptr + row * stride_res, w_ptr, out_ptr + row * stride_out, offs,
                     mask, eps, N, HAS_RESIDUAL)


@triton.jit
def add_residual(x, res_row_ptr, offs, mask):
    """`x` (float32) plus the residual stream at `offs`, written back: the stream is stored in
    the activation dtype, so the sum is rounded to it."""
    dtype = res_row_ptr.dtype.element_ty
    res = tl.load(res_row_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x = round_to(x + res, dtype)
    tl.store(res_row_ptr + offs, x.to(dtype), mask=mask)
    return x


@triton.jit
def add_rms_norm_row(x, res_row_ptr, w_ptr, out_row_ptr, offs, mask, eps, N: tl.constexpr,
                     HAS_RESIDUAL: tl.constexpr):
    """One row's residual add (written back) and RMSNorm, `x` in float32: the arithmetic of
    `rms_norm`, shared with the fused all-reduce (`allreduce_norm.py`) so both round alike."""
    dtype = out_row_ptr.dtype.element_ty
    if HAS_RESIDUAL:
        x = add_residual(x, res_row_ptr, offs, mask)
    var = tl.sum(x * x, axis=0) / N
    y = round_to(x * tl.rsqrt(var + eps), dtype)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_row_ptr + offs, (y * w).to(dtype), mask=mask)


def rms_norm(x: Tensor, weight: Tensor, eps: float,
             residual: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """x [T, N] (plus residual [T, N], updated in place to residual + x) -> (RMSNorm of the
    sum, the sum). Without a residual the sum is x itself."""
    assert x.stride(-1) == 1 and weight.is_contiguous(), "rows must be contiguous"
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    num_rows, n = x.shape
    if num_rows > 0:
        block = triton.next_power_of_2(n)
        if residual is not None:
            assert residual.shape == x.shape and residual.stride(-1) == 1
        res = x if residual is None else residual  # an unused pointer when there is none
        _rms_norm_kernel[(num_rows,)](
            x, res, weight, out, x.stride(0), res.stride(0), out.stride(0), eps,
            N=n, BLOCK=block, HAS_RESIDUAL=residual is not None, num_warps=norm_warps(block),
            **pdl.launch_options())
    return out, x if residual is None else residual


@triton.jit
def _rotate_qk_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, q_w_ptr, k_w_ptr, stride_tok, eps,
                      NUM_Q: tl.constexpr, NUM_ROT: tl.constexpr, HEAD_DIM: tl.constexpr,
                      HALF_PAD: tl.constexpr, BLOCK_H: tl.constexpr, HAS_NORM: tl.constexpr):
    pdl.step_entry()
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    lo, out1, out2, mask = rotated_heads(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, q_w_ptr, k_w_ptr,
                                         token, heads, stride_tok, eps, NUM_Q, NUM_ROT,
                                         HEAD_DIM, HALF_PAD, HAS_NORM)
    dtype = qkv_ptr.dtype.element_ty
    tl.store(lo, out1.to(dtype), mask=mask)
    tl.store(lo + HEAD_DIM // 2, out2.to(dtype), mask=mask)


@triton.jit
def rotated_heads(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, q_w_ptr, k_w_ptr, token, heads,
                  stride_tok, eps, NUM_Q: tl.constexpr, NUM_ROT: tl.constexpr,
                  HEAD_DIM: tl.constexpr, HALF_PAD: tl.constexpr, HAS_NORM: tl.constexpr):
    """`heads` [BLOCK_H] of one token's q and k (q heads first), RMSNormed (HAS_NORM) and
    rotated: (each head's first half in qkv [BLOCK_H, HALF_PAD] pointers, the rotated first
    and second halves in float32, the mask of real elements). `rotate_qk_` stores them back;
    the KV store that rotates (`attention/store_kv.rotate_store_kv_`) stores q back and k in
    the cache: one function, launched on the same tiles, so both compute the same bits."""
    HALF: tl.constexpr = HEAD_DIM // 2
    d = tl.arange(0, HALF_PAD)
    d_mask = d < HALF
    mask = (heads < NUM_ROT)[:, None] & d_mask[None, :]
    dtype = qkv_ptr.dtype.element_ty
    # The two halves of each head: RoPE (NeoX layout) rotates element i with i + D/2.
    lo = qkv_ptr + token * stride_tok + heads[:, None] * HEAD_DIM + d[None, :]
    x1 = tl.load(lo, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(lo + HALF, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        var = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_DIM
        inv = tl.rsqrt(var + eps)[:, None]
        is_q = (heads < NUM_Q)[:, None]
        w1 = tl.where(is_q, tl.load(q_w_ptr + d, mask=d_mask, other=0.0)[None, :],
                      tl.load(k_w_ptr + d, mask=d_mask, other=0.0)[None, :]).to(tl.float32)
        w2 = tl.where(is_q, tl.load(q_w_ptr + HALF + d, mask=d_mask, other=0.0)[None, :],
                      tl.load(k_w_ptr + HALF + d, mask=d_mask, other=0.0)[None, :]).to(tl.float32)
        x1 = round_to(round_to(x1 * inv, dtype) * w1, dtype)
        x2 = round_to(round_to(x2 * inv, dtype) * w2, dtype)
    # Row `pos` of the tables: cos is [cos, cos], sin is sign-folded [-sin, sin] (decoder.py).
    pos = tl.load(pos_ptr + token).to(tl.int64)
    cos = tl.load(cos_ptr + pos * HEAD_DIM + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + pos * HEAD_DIM + HALF + d, mask=d_mask,
                  other=0.0).to(tl.float32)[None, :]
    # transformers: x * cos + rotate_half(x) * sin, each product rounded to the activation dtype.
    out1 = round_to(x1 * cos, dtype) - round_to(x2 * sin, dtype)
    out2 = round_to(x2 * cos, dtype) + round_to(x1 * sin, dtype)
    return lo, out1, out2, mask


def rotate_qk_(qkv: Tensor, positions: Tensor, cos: Tensor, sin: Tensor, num_q_heads: int,
               num_kv_heads: int, q_weight: Tensor | None, k_weight: Tensor | None,
               eps: float) -> None:
    """In place on qkv [T, Hq + 2 Hkv, D]: RMSNorm each q and k head (when weights are given),
    then rotate it by its token's position. cos/sin: [max_positions, D] tables (decoder.py);
    positions must be below max_positions (not checked: no host sync)."""
    num_tokens, _, head_dim = qkv.shape
    check_rotation(qkv, cos, sin, q_weight, k_weight)
    if num_tokens == 0:
        return
    num_rot = num_q_heads + num_kv_heads
    half_pad, block_h = rotation_tile(num_rot, head_dim)
    has_norm = q_weight is not None
    grid = (num_tokens, triton.cdiv(num_rot, block_h))
    _rotate_qk_kernel[grid](
        qkv, positions, cos, sin, q_weight if has_norm else cos, k_weight if has_norm else cos,
        qkv.stride(0), eps, NUM_Q=num_q_heads, NUM_ROT=num_rot, HEAD_DIM=head_dim,
        HALF_PAD=half_pad, BLOCK_H=block_h, HAS_NORM=has_norm, num_warps=ROTATION_WARPS,
        **pdl.launch_options())


ROTATION_WARPS = 4  # of a `rotated_heads` tile's program


def rotation_tile(num_rot: int, head_dim: int) -> tuple[int, int]:
    """(HALF_PAD, BLOCK_H) of the `rotated_heads` tiles over `num_rot` q and k heads. Up to 2K
    elements per half-tile: one program per token holds all 24 q/k heads of Qwen3-0.6B
    (D=128) in 64 registers a thread, no spills (sm_90)."""
    half_pad = triton.next_power_of_2(head_dim // 2)
    return half_pad, min(triton.next_power_of_2(num_rot), max(1, 2048 // half_pad))


def check_rotation(qkv: Tensor, cos: Tensor, sin: Tensor, q_weight: Tensor | None,
                   k_weight: Tensor | None) -> None:
    """What the `rotated_heads` kernels assume of their arguments."""
    head_dim = qkv.shape[2]
    assert qkv.stride(2) == 1 and qkv.stride(1) == head_dim, "each head must be contiguous"
    assert cos.is_contiguous() and sin.is_contiguous() and cos.shape[-1] == head_dim
    if q_weight is not None:
        assert k_weight is not None and q_weight.is_contiguous() and k_weight.is_contiguous()


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, stride_in, stride_out, N: tl.constexpr,
                         BLOCK: tl.constexpr):
    pdl.step_entry()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + N + cols, mask=mask, other=0.0).to(tl.float32)
    act = round_to(gate / (1.0 + tl.exp(-gate)), dtype)  # F.silu's output tensor
    tl.store(out_ptr + row * stride_out + cols, (act * up).to(dtype), mask=mask)


def silu_and_mul(gate_up: Tensor) -> Tensor:
    """gate_up [T, 2I] (gate first) -> silu(gate) * up [T, I]."""
    assert gate_up.stride(-1) == 1, "rows must be contiguous"
    num_rows, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((num_rows, n), dtype=gate_up.dtype, device=gate_up.device)
    if num_rows > 0:
        block = min(1024, triton.next_power_of_2(n))
        _silu_and_mul_kernel[(num_rows, triton.cdiv(n, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), N=n, BLOCK=block,
            num_warps=norm_warps(block), **pdl.launch_options())
    return out


def norm_warps(block: int) -> int:
    """One warp per 256 elements of a row (8 bf16 per thread), between 1 and 8 warps."""
    return min(8, max(1, block // 256))
