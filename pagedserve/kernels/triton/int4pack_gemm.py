"""Reading a 4-bit weight in torch's int4 layout (`kernels/int4pack.py`) from Triton: the
tile unpacking that every kernel over that layout shares (`int4pack_tile`), and a fused
GEMM on it for decode batches.

Why a fused GEMM: past the rows where torch's own int4 kernel pays (its cost per row grows
with the batch), the weight was dequantized into a bf16 scratch tensor and multiplied by
cuBLAS, which writes and reads again a bf16 copy of the whole weight each call: four times
the packed bytes, twice. `_int4pack_gemm_kernel` reads each packed word once from memory,
unpacks and scales it in registers and feeds `tl.dot` on half-precision tiles with float32
accumulation. For few rows the grid has few M tiles, so split-K (partial sums added
atomically into a float32 buffer) keeps the SMs busy.

Unpacking: the layout keeps, per 8 output rows and 128 columns, 16 words a row; word
[n // 8, k // 128, (n % 8) * 4 + q, j] holds columns k = (k // 128) * 128 + j * 32 +
i * 8 + q * 2 + lo in nibble 4 * lo + i. So a row's 32 columns j * 32 ... are its 4 words
q = 0..3 at word column j, and one group's (scale, offset) serves all 32 (groups are
multiples of 32). `int4pack_tile` loads those words as [rows, chunks of 32, q], splits the
nibbles by broadcasting them into [rows, chunk, i, q, lo], which is column order, and turns
each code into a float by OR-ing it into the mantissa of 2^23 (exact, no conversion).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from pagedserve.kernels import int4pack
from pagedserve.kernels.triton.fp8_linear import num_sms
from pagedserve.kernels.triton.precision import dot_precision

# the interpreter's half-precision tl.dot multiplies the raw bits: there the tiles are upcast
# (the weight still rounded to the activation dtype first)
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def int4pack_tile(packed_ptr, pairs_ptr, offs_n, n_mask, k0, N, K, GROUP: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Weight rows offs_n, columns k0 .. k0 + BLOCK_K (k0 and BLOCK_K multiples of 32) of a
    weight in torch's int4 layout, float32 [BLOCK_N, BLOCK_K] in column order, each value
    (code - 8) * scale + offset (exact products, one rounding); rows past N and columns past
    K are 0. pairs_ptr: the (scale, offset) table seen as int32 [groups, N], one bf16 pair a
    word (scale in the low half)."""
    CHUNKS: tl.constexpr = BLOCK_K // 32
    n64 = offs_n.to(tl.int64)
    chunk = k0 + tl.arange(0, CHUNKS) * 32  # first column of each 32
    q = tl.arange(0, 4)
    row_word = (n64 // 8) * K + (n64 % 8) * 16
    chunk_word = (chunk // 128) * 128 + (chunk // 32) % 4
    mask = n_mask[:, None] & (chunk < K)[None, :]
    words = tl.load(packed_ptr + row_word[:, None, None] + chunk_word[None, :, None]
                    + q[None, None, :] * 4, mask=mask[:, :, None], other=0)
    pair = tl.load(pairs_ptr + (chunk // GROUP).to(tl.int64)[None, :] * N + n64[:, None],
                   mask=mask, other=0)
    scale = (pair << 16).to(tl.float32, bitcast=True)
    offset = ((pair >> 16) << 16).to(tl.float32, bitcast=True)
    i = tl.arange(0, 4)
    lo = tl.arange(0, 2)
    shifts = (4 * lo[None, :] + i[:, None]) * 4  # [i, lo]
    codes = (words[:, :, None, :, None] >> shifts[None, None, :, None, :]) & 0xF
    values = (codes | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0  # code - 8
    w = values * scale[:, :, None, None, None] + offset[:, :, None, None, None]
    return tl.reshape(w, (BLOCK_N, BLOCK_K))


@triton.jit
def _int4pack_gemm_kernel(x_ptr, y_ptr, bias_ptr, packed_ptr, pairs_ptr, M, N, K, stride_x,
                          stride_y, HAS_BIAS: tl.constexpr, GROUP: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                          PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """y [M, N] = x [M, K] @ W^T (+ bias): a [BLOCK_M, BLOCK_N] tile per program, M tiles
    first on the grid (programs that share a weight tile run together, so it is read from
    memory once); with SPLIT_K > 1, program axis 2 takes every SPLIT_K-th K step and adds its
    partial sums into y (float32, zeroed; the bias is the caller's)."""
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    dtype = x_ptr.dtype.element_ty
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_x
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, SPLIT_K * BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & (offs_k < K)[None, :],
                    other=0.0)
        w = int4pack_tile(packed_ptr, pairs_ptr, offs_n, n_mask, k0, N, K, GROUP, BLOCK_N,
                          BLOCK_K)
        w = w.to(dtype)
        if UPCAST:
            x, w = x.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    out = y_ptr + offs_m[:, None].to(tl.int64) * stride_y + offs_n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K > 1:
        tl.atomic_add(out, acc, mask=mask, sem="relaxed")
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class Int4GemmConfig:
    """One launch's tiles: BLOCK_K a multiple of 32 (a power of two), split_k the programs
    that share one output tile's K steps."""

    block_m: int
    block_n: int
    block_k: int = 128
    split_k: int = 1
    warps: int = 4
    stages: int = 3


def config_for(m: int, n: int, k: int, sms: int) -> Int4GemmConfig:
    """The tiles for an [m, k] @ [k, n] call on a GPU of `sms` SMs: the M tile the smallest
    that holds the rows (up to 64; 128 from 129 rows, where the unpacking is shared by more
    rows), and K split in two or four while the output tiles alone would leave over half of
    the SMs idle and each split still has 8 K steps or more."""
    if m <= 16:
        config = Int4GemmConfig(16, 64, stages=4)
    elif m <= 32:
        config = Int4GemmConfig(32, 64, stages=4)
    elif m <= 64:
        config = Int4GemmConfig(64, 64)
    elif m <= 128:
        config = Int4GemmConfig(64, 128, warps=8)
    else:
        config = Int4GemmConfig(128, 128, warps=8)
    tiles = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)
    split = 1
    while (split < 4 and tiles * split * 2 <= sms
           and k // (config.block_k * split * 2) >= 8):
        split *= 2
    return Int4GemmConfig(config.block_m, config.block_n, config.block_k, split,
                          config.warps, config.stages)


def matmul(x: Tensor, weight: int4pack.Int4Weight, bias: Tensor | None = None,
           config: Int4GemmConfig | None = None) -> Tensor:
    """x [M, K] (bfloat16, float16 or float32) @ the weight^T (+ bias) -> [M, N] in x's dtype,
    the weight read once from torch's int4 layout (`config_for` unless `config` is given)."""
    (m, k), (n, _) = x.shape, weight.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    if config is None:
        config = config_for(m, n, k, num_sms(x.device))
    split = config.split_k
    y = (torch.zeros((m, n), dtype=torch.float32, device=x.device) if split > 1
         else torch.empty((m, n), dtype=x.dtype, device=x.device))
    if m == 0:
        return y.to(x.dtype)
    grid = (triton.cdiv(m, config.block_m), triton.cdiv(n, config.block_n), split)
    _int4pack_gemm_kernel[grid](
        x, y, y if bias is None else bias, weight.packed,
        weight.scales_and_offsets.view(torch.int32), m, n, k, x.stride(0), y.stride(0),
        HAS_BIAS=bias is not None and split == 1, GROUP=weight.group_size,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        SPLIT_K=split, PRECISION="ieee" if _INTERPRET else dot_precision(x.dtype),
        UPCAST=_INTERPRET, num_warps=config.warps,
        num_stages=config.stages)
    if split > 1:
        y = y.to(x.dtype) if bias is None else (y + bias).to(x.dtype)
    return y
