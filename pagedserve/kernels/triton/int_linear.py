"""Matmuls on weights kept quantized (`kernels/weight_formats.py`): y = x @ W^T + b with W
unpacked in registers by `dequant.dequant_tile`, never written out.

Why two kernels: a decode step at batch 1 reads each weight once and does two flops per
weight, so its time is the packed bytes over memory bandwidth: `_gemv_kernel` gives each
program a few output rows and streams their packed words along K with FMAs (no tl.dot, whose
smallest tile would waste 15 of 16 rows). Larger batches reuse each unpacked tile across many
rows: `_gemm_kernel` is a tiled GEMM whose B operand is dequantized per tile, through tl.dot.
Which one runs is the call's row count (`linear`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from pagedserve.kernels.triton.dequant import dequant_tile
from pagedserve.kernels.triton.precision import dot_precision, round_to

@dataclass(frozen=True)
class IntLinearConfig:
    """Tile sizes: the GEMV's rows per program and columns per step; the GEMM's tile, and a
    narrower one for decode batches (up to `small_max_rows` rows), whose few M tiles would
    otherwise leave most SMs idle (N / 64 programs). Rows up to `gemv_max_rows` take the
    GEMV, one pass per row."""

    gemv_block_n: int = 16
    gemv_block_k: int = 256
    gemv_warps: int = 4
    gemm_block_m: int = 64
    gemm_block_n: int = 64
    gemm_block_k: int = 64
    gemm_warps: int = 4
    gemm_stages: int = 3
    gemv_max_rows: int = 1
    small_block_m: int = 16
    small_block_n: int = 32
    small_block_k: int = 128
    small_max_rows: int = 16


DEFAULT = IntLinearConfig()


@triton.jit
def _gemv_kernel(x_ptr, y_ptr, bias_ptr, data_ptr, scales_ptr, zeros_ptr, g_idx_ptr,
                 data_stride, scales_stride, N, K, stride_x, stride_y,
                 HAS_BIAS: tl.constexpr, FORMAT: tl.constexpr, BITS: tl.constexpr,
                 GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_G_IDX: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n, row = tl.program_id(0), tl.program_id(1).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w = dequant_tile(data_ptr, scales_ptr, zeros_ptr, g_idx_ptr, data_stride,
                         scales_stride, offs_n, n_mask, k0, K, FORMAT, BITS, GROUP,
                         HAS_ZEROS, HAS_G_IDX, BLOCK_N, BLOCK_K)
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_x + offs_k, mask=offs_k < K, other=0.0)
        acc += round_to(w, dtype) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _gemm_kernel(x_ptr, y_ptr, bias_ptr, data_ptr, scales_ptr, zeros_ptr, g_idx_ptr,
                 data_stride, scales_stride, M, N, K, stride_x, stride_y,
                 HAS_BIAS: tl.constexpr, FORMAT: tl.constexpr, BITS: tl.constexpr,
                 GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_G_IDX: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PRECISION: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w = dequant_tile(data_ptr, scales_ptr, zeros_ptr, g_idx_ptr, data_stride,
                         scales_stride, offs_n, n_mask, k0, K, FORMAT, BITS, GROUP,
                         HAS_ZEROS, HAS_G_IDX, BLOCK_N, BLOCK_K)
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_x + offs_k[None, :],
                    mask=m_mask[:, None] & (offs_k < K)[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w.to(dtype)), acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None].to(tl.int64) * stride_y + offs_n[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def linear(x: Tensor, weight, bias: Tensor | None = None,
           config: IntLinearConfig = DEFAULT) -> Tensor:
    """x [..., K] (float16, bfloat16 or float32) @ weight^T (+ bias) -> [..., N] in x's
    dtype, for any `weight_formats` weight (its `kernel_args`)."""
    n, k = weight.shape
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m = rows.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    a = weight.kernel_args()
    common = dict(HAS_BIAS=bias is not None, FORMAT=a.format, BITS=a.bits,
                  GROUP=a.group_size, HAS_ZEROS=a.has_zeros, HAS_G_IDX=a.has_g_idx)
    args = (rows, y, y if bias is None else bias, a.data, a.scales, a.zeros, a.g_idx,
            a.data_stride, a.scales_stride)
    if m == 0:
        pass
    elif m <= config.gemv_max_rows:
        grid = (triton.cdiv(n, config.gemv_block_n), m)
        _gemv_kernel[grid](*args, n, k, rows.stride(0), y.stride(0), **common,
                           BLOCK_N=config.gemv_block_n, BLOCK_K=config.gemv_block_k,
                           num_warps=config.gemv_warps)
    else:
        small = m <= config.small_max_rows
        bm, bn, bk = ((config.small_block_m, config.small_block_n, config.small_block_k)
                      if small else
                      (config.gemm_block_m, config.gemm_block_n, config.gemm_block_k))
        grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
        _gemm_kernel[grid](*args, m, n, k, rows.stride(0), y.stride(0), **common,
                           BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                           PRECISION=dot_precision(x.dtype), num_warps=config.gemm_warps,
                           num_stages=config.gemm_stages)
    return y.view(*x.shape[:-1], n)
