"""Linear layers on GGUF blocks as the file stores them (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K):
the CUDA path of a GGUF model's weights (`model.gguf_weights`); imported on CUDA only (or
under TRITON_INTERPRET=1 in tests).

Why keep the blocks: a decode step reads every weight once, so its time is the weights' bytes
over memory bandwidth; a Q4_K_M file's blocks are under a third of bf16's bytes. A weight is a
uint8 tensor [N, bytes per row], each row the file's blocks along K, unchanged; K is a
multiple of the type's block (32 or 256 weights), as GGUF requires.

`_decode` is the one description of each type's unpacking: weight (row, k) as a float32
computed from its block's bytes the way the `gguf` package's `dequantize` computes it (the
same products in the same order, so the interpreter's values equal the package's bit for
bit; compiled for the GPU, a product and a sum may fuse into one rounding). The kernels are
built on it:

- `_one_row_kernel` (one token: batch-1 decode): each program streams BLOCK_N rows of blocks
  along K, multiplies in float32 without tl.dot (which would pad the row to 16) and sums once
  at the end;
- `_tiled_kernel` (a few to a few hundred tokens): [BLOCK_M, BLOCK_N] tiles, the weight tile
  decoded in registers and cast to the activations' dtype for tl.dot;
- `_dequantize_kernel`: the whole weight in the activations' dtype, for a prefill of many
  tokens, where one decode of the weight per call is cheaper than one per row tile and the
  dense matmul runs at full rate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from pagedserve.kernels.gguf_format import row_bytes
from pagedserve.kernels.triton.precision import dot_precision

# token counts: 1 -> the one-row kernel; up to this many -> the tiled kernel; more ->
# dequantize, then the dense matmul
MAX_TILED_ROWS = 256


@dataclass(frozen=True)
class Tiles:
    """Launch shapes. One row: few rows per program and a long K tile keep many bytes in
    flight per SM (the step is bound by reading weights); the tiled kernel: tl.dot tiles."""

    one_row_n: int = 16
    one_row_k: int = 256
    block_m: int = 16
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4


TILES = Tiles()


@triton.jit
def _f16(p, mask):
    """The little-endian float16 at byte pointers p, as float32."""
    lo = tl.load(p, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(p + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _byte(p, mask):
    return tl.load(p, mask=mask, other=0).to(tl.int32)


@triton.jit
def _k_scale_min(s, sub, mask):
    """A K-quant super-block's 6-bit scale and min of sub-block `sub` (0-7) from its 12 bytes
    at s: sub-blocks 0-3 in the low 6 bits of bytes sub and sub + 4; 4-7 in the nibbles of
    byte sub + 4 with their top 2 bits in the high bits of bytes sub - 4 and sub."""
    a = _byte(s + sub, mask)
    e = _byte(s + sub + 4, mask)
    c = _byte(s + sub % 4, mask)
    sc = tl.where(sub < 4, a & 63, (e & 15) | ((c >> 6) << 4))
    mn = tl.where(sub < 4, e & 63, (e >> 4) | ((a >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _decode(rows, k, mask, QTYPE: tl.constexpr):
    """Weights (row, k) as float32: rows [BN, 1] byte pointers to the rows' first blocks, k
    [1, BK] columns, mask [BN, BK] (masked weights come out 0)."""
    if QTYPE == 2:  # Q4_0: d (f16), 16 bytes: weight j in byte j % 16, low nibble if j < 16
        b = rows + (k // 32) * 18
        j = k % 32
        q = (_byte(b + 2 + j % 16, mask) >> ((j // 16) * 4)) & 15
        return _f16(b, mask) * (q.to(tl.float32) - 8.0)
    elif QTYPE == 3:  # Q4_1: d, m (f16), nibbles as Q4_0
        b = rows + (k // 32) * 20
        j = k % 32
        q = (_byte(b + 4 + j % 16, mask) >> ((j // 16) * 4)) & 15
        return _f16(b, mask) * q.to(tl.float32) + _f16(b + 2, mask)
    elif QTYPE == 8:  # Q8_0: d (f16), 32 int8
        b = rows + (k // 32) * 34
        q = tl.load(b + 2 + k % 32, mask=mask, other=0).to(tl.int8, bitcast=True)
        return q.to(tl.float32) * _f16(b, mask)
    elif QTYPE == 12 or QTYPE == 13:
        # Q4_K: d, dmin (f16), 12 bytes of 6-bit scales and mins, 128 bytes of nibbles (32
        # bytes per pair of 32-weight sub-blocks: the even one low, the odd one high). Q5_K:
        # 32 bytes of fifth bits (bit `sub` of byte j % 32) before the nibbles.
        SIZE: tl.constexpr = 144 if QTYPE == 12 else 176
        QS: tl.constexpr = 16 if QTYPE == 12 else 48
        b = rows + (k // 256) * SIZE
        j = k % 256
        sub = j // 32
        sc, mn = _k_scale_min(b + 4, sub, mask)
        q = (_byte(b + QS + (sub // 2) * 32 + j % 32, mask) >> ((sub % 2) * 4)) & 15
        if QTYPE == 13:
            q = q | (((_byte(b + 16 + j % 32, mask) >> sub) & 1) << 4)
        return (_f16(b, mask) * sc) * q.to(tl.float32) - _f16(b + 2, mask) * mn
    else:
        # Q6_K: 128 bytes of low nibbles, 64 of 2-bit high parts, 16 int8 scales (one per 16
        # weights), d (f16). In each half of 128 weights, quarter qq's weight l (0-31) has its
        # low bits in nibble qq // 2 of byte 32 (qq % 2) + l and its high bits at bit 2 qq of
        # byte l of the half's 32 high bytes.
        b = rows + (k // 256) * 210
        j = k % 256
        half = j // 128
        qq = (j % 128) // 32
        lane = j % 32
        low = (_byte(b + half * 64 + (qq % 2) * 32 + lane, mask) >> ((qq // 2) * 4)) & 15
        high = (_byte(b + 128 + half * 32 + lane, mask) >> (2 * qq)) & 3
        q = (low | (high << 4)) - 32
        sc = tl.load(b + 192 + j // 16, mask=mask, other=0).to(tl.int8, bitcast=True)
        return (_f16(b + 208, mask) * sc.to(tl.float32)) * q.to(tl.float32)


@triton.jit
def _one_row_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, N, K, stride_wn, QTYPE: tl.constexpr,
                    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[0, rows] = W[rows] @ x[0] (+ bias) for this program's BLOCK_N rows."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    row_ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        w = _decode(row_ptrs, k[None, :], row_mask[:, None] & k_mask[None, :], QTYPE)
        x = tl.load(x_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
        acc += w * x[None, :]
    y = tl.sum(acc, 1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_mask)


@triton.jit
def _tiled_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                  QTYPE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """y = x @ W^T (+ bias) by [BLOCK_M, BLOCK_N] tiles, W's tile decoded in registers."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    row_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        x = tl.load(x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = _decode(row_ptrs, k[None, :], n_mask[:, None] & k_mask[None, :], QTYPE)
        acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _dequantize_kernel(w_ptr, out_ptr, N, K, stride_wn, QTYPE: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows < N)[:, None] & (k < K)[None, :]
    w = _decode(w_ptr + rows.to(tl.int64)[:, None] * stride_wn, k[None, :], mask, QTYPE)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * K + k[None, :],
             w.to(out_ptr.dtype.element_ty), mask=mask)


def dequantize(blocks: Tensor, qtype: int, k: int, dtype: torch.dtype = torch.float32,
               tiles: Tiles = TILES) -> Tensor:
    """blocks uint8 [N, row_bytes(qtype, k)] -> the weight [N, k] in `dtype`."""
    n = blocks.shape[0]
    out = torch.empty((n, k), dtype=dtype, device=blocks.device)
    grid = (triton.cdiv(n, tiles.block_n), triton.cdiv(k, tiles.block_k))
    _dequantize_kernel[grid](blocks, out, n, k, blocks.stride(0), QTYPE=qtype,
                             BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
                             num_warps=tiles.num_warps)
    return out


def linear(x: Tensor, blocks: Tensor, qtype: int, bias: Tensor | None = None,
           tiles: Tiles = TILES) -> Tensor:
    """x [..., K] @ the GGUF weight (uint8 blocks [N, row bytes] of `qtype`)^T (+ bias) ->
    [..., N] in x's dtype. No host sync: CUDA graphs capture it."""
    k, n = x.shape[-1], blocks.shape[0]
    assert blocks.shape[1] == row_bytes(qtype, k) and blocks.stride(1) == 1
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m = rows.shape[0]
    if m > MAX_TILED_ROWS:
        return F.linear(x, dequantize(blocks, qtype, k, x.dtype, tiles), bias)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y.view(*x.shape[:-1], n)
    has_bias = bias is not None
    if m == 1:
        _one_row_kernel[(triton.cdiv(n, tiles.one_row_n),)](
            rows, blocks, bias if has_bias else y, y, n, k, blocks.stride(0), QTYPE=qtype,
            HAS_BIAS=has_bias, BLOCK_N=tiles.one_row_n, BLOCK_K=tiles.one_row_k,
            num_warps=tiles.num_warps)
    else:
        grid = (triton.cdiv(m, tiles.block_m), triton.cdiv(n, tiles.block_n))
        _tiled_kernel[grid](
            rows, blocks, bias if has_bias else y, y, m, n, k, rows.stride(0),
            blocks.stride(0), y.stride(0), QTYPE=qtype, HAS_BIAS=has_bias,
            BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
            DOT_PRECISION=dot_precision(x.dtype), num_warps=tiles.num_warps)
    return y.view(*x.shape[:-1], n)
