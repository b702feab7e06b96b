"""Matmuls on weights kept quantized (`kernels/weight_formats.py`): y = x @ W^T + b with W
unpacked in registers by `dequant.dequant_tile`.

Why several kernels, chosen by the call's row count: a decode step at batch 1 reads each
weight once and does two flops per weight, so its time is the packed bytes over memory
bandwidth, and the unpacking must cost less than the bytes take to arrive. A 4-bit weight
that torch's own int4 kernel reads is converted to that kernel's layout once, at load
(`prepare`, `kernels/int4pack.py`), kept ONLY there and multiplied by `int4pack_linear`
(`for_layer` picks it at load): up to `int4pack_max_rows` rows (bfloat16) run on torch's
kernel, whose cost per row grows with the batch; up to `int4pack_gemm_max_rows` on the fused
GEMM over that layout (`int4pack_gemm.py`), which reads each packed word once; more rows
dequantize it from that layout (`_int4pack_dequant_kernel`) into a scratch tensor for
cuBLAS, whose cost is then the dequantization's, paid once per call. Other weights keep
their checkpoint's layout: one row takes a GEMV (no tl.dot, whose smallest tile would waste
15 of 16 rows; the row loops are `gemv.py`'s): `_int_gemv_kernel` for integer codes in
column order, which turns codes into floats with an OR of the float32 exponent instead of a
conversion and applies each group's scale per word, `gguf_dp4a.gemv` for a bfloat16 or
float16 row against Q4_K or Q6_K blocks (the row quantized to int8, integer dot products;
`gguf_int8_activations`), `gguf_gemv.gemv` for other GGUF blocks (read as words or halfwords,
not byte by byte), and `_gemv_kernel` for the rest (g_idx; GGUF
blocks a view leaves unaligned). A few rows take `_gemm_kernel`, a tiled GEMM whose B
operand is dequantized per tile through tl.dot. From `dequant_min_rows` rows the GEMM is
compute-bound and cuBLAS is far faster than a Triton GEMM unpacking in its inner loop, so
the weight is dequantized once into a scratch tensor (`_dequant_kernel`) and multiplied by
cuBLAS.

Rounding: the GEMMs round each dequantized weight to the activation dtype (the tl.dot
operand; cuBLAS's input), as a float model built from the dequantized weights holds it, and
so does `_gemv_kernel`; `_int_gemv_kernel` keeps it in float32, within that dtype's noise of
the float model (float32 activations: the same to the last bits).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from pagedserve.kernels import int4pack
from pagedserve.kernels.triton.dequant import dequant_tile
from pagedserve.kernels.triton.gemv import int_row_dot, tile_row_dot
from pagedserve.kernels.triton import gguf_dp4a, gguf_gemv, int4pack_gemm
from pagedserve.kernels.triton.int4pack_gemm import int4pack_tile
from pagedserve.kernels.triton.precision import dot_precision
from pagedserve.kernels.weight_formats import IntWeight, Stacked, WeightFormat


@dataclass(frozen=True)
class IntLinearConfig:
    """Tile sizes: the GEMV's rows per program and columns per step; the GEMM's tile, and a
    narrower one for decode batches (up to `small_max_rows` rows), whose few M tiles would
    otherwise leave most SMs idle (N / 64 programs). Rows up to `gemv_max_rows` take the
    GEMV, one pass per row. A weight in torch's int4 layout runs on torch's kernel up to
    `int4pack_max_rows` rows, on the fused GEMM up to `int4pack_gemm_max_rows` and is
    dequantized for cuBLAS beyond (`int4pack_path`). torch's kernel reads the weight once
    per row: its cost grows with each row, while the fused GEMM's stays flat up to a tile of
    rows, so the two cross between 4 rows (torch's kernel faster on every projection
    measured) and 8 (the fused GEMM faster in sum; docs/benchmarks.md).
    `gguf_int8_activations`: one bfloat16/float16 row against the GGUF types `gguf_dp4a`
    takes is quantized to int8 and multiplied there; False: `gguf_gemv` (float activations,
    the engine's --no-gguf-int8-activations)."""

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
    int_gemv_block_n: int = 4
    int_gemv_block_k: int = 512
    int_gemv_warps: int = 2
    int4pack_max_rows: int = 7
    int4pack_gemm_max_rows: int = 256
    dequant_min_rows: int = 64
    dequant_block_n: int = 32
    dequant_block_k: int = 256
    gguf_int8_activations: bool = True


DEFAULT = IntLinearConfig()
# one GGUF row always with float activations (`gguf_gemv`): --no-gguf-int8-activations
FLOAT_GGUF_ACTIVATIONS = IntLinearConfig(gguf_int8_activations=False)


@triton.jit
def _gemv_kernel(x_ptr, y_ptr, bias_ptr, data_ptr, scales_ptr, zeros_ptr, g_idx_ptr,
                 data_stride, scales_stride, N, K, stride_x, stride_y,
                 HAS_BIAS: tl.constexpr, FORMAT: tl.constexpr, BITS: tl.constexpr,
                 GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_G_IDX: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n, row = tl.program_id(0), tl.program_id(1).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    y = tile_row_dot(x_ptr + row * stride_x, data_ptr, scales_ptr, zeros_ptr, g_idx_ptr,
                     data_stride, scales_stride, offs_n, n_mask, K, x_ptr.dtype.element_ty,
                     FORMAT, BITS, GROUP, HAS_ZEROS, HAS_G_IDX, BLOCK_N, BLOCK_K)
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
    x_rows = offs_m[:, None].to(tl.int64) * stride_x
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w = dequant_tile(data_ptr, scales_ptr, zeros_ptr, g_idx_ptr, data_stride,
                         scales_stride, offs_n, n_mask, k0, K, FORMAT, BITS, GROUP,
                         HAS_ZEROS, HAS_G_IDX, BLOCK_N, BLOCK_K)
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + x_rows + offs_k[None, :],
                    mask=m_mask[:, None] & (offs_k < K)[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w.to(dtype)), acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None].to(tl.int64) * stride_y + offs_n[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _int_gemv_kernel(x_ptr, y_ptr, bias_ptr, data_ptr, scales_ptr, zeros_ptr, N, K,
                     data_stride, scales_stride, stride_x, stride_y, HAS_BIAS: tl.constexpr,
                     BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One row of x against an `INT` weight in column order (`gemv.int_row_dot`)."""
    pid_n, row = tl.program_id(0), tl.program_id(1).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    y = int_row_dot(x_ptr + row * stride_x, data_ptr, scales_ptr, zeros_ptr, data_stride,
                    scales_stride, offs_n, n_mask, K, BITS, GROUP, HAS_ZEROS, BLOCK_N,
                    BLOCK_K)
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _dequant_kernel(w_ptr, data_ptr, scales_ptr, zeros_ptr, g_idx_ptr, data_stride,
                    scales_stride, N, K, data_e, scales_e, g_idx_e, FORMAT: tl.constexpr,
                    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr,
                    HAS_G_IDX: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The weight [N, K] written out in w's dtype, a tile per program; grid axis 2 walks a
    `Stacked`'s experts (its tensors *_e elements apart; w's N * K)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    e = tl.program_id(2).to(tl.int64)
    n_mask = offs_n < N
    w = dequant_tile(data_ptr + e * data_e, scales_ptr + e * scales_e,
                     zeros_ptr + e * scales_e, g_idx_ptr + e * g_idx_e, data_stride,
                     scales_stride, offs_n, n_mask, k0, K, FORMAT, BITS, GROUP, HAS_ZEROS,
                     HAS_G_IDX, BLOCK_N, BLOCK_K)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    tl.store(w_ptr + e * N * K + offs_n[:, None].to(tl.int64) * K + offs_k[None, :],
             w.to(w_ptr.dtype.element_ty), mask=n_mask[:, None] & (offs_k < K)[None, :])


@triton.jit
def _int4pack_dequant_kernel(w_ptr, packed_ptr, pairs_ptr, N, K, GROUP: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """A weight in torch's int4 layout written out [N, K] in w's dtype, a tile per program
    (`int4pack_gemm.int4pack_tile`: the layout's one reader)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    n_mask = offs_n < N
    w = int4pack_tile(packed_ptr, pairs_ptr, offs_n, n_mask, k0, N, K,
                      w_ptr.dtype.element_ty, GROUP, BLOCK_N, BLOCK_K)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    tl.store(w_ptr + offs_n[:, None].to(tl.int64) * K + offs_k[None, :], w,
             mask=n_mask[:, None] & (offs_k < K)[None, :])


def prepare(weight):
    """At load, once per layer: an `IntWeight` that torch's int4 kernel reads is returned in
    that kernel's layout (`int4pack.Int4Weight`), which every row count then reads, so the
    caller may drop the original packed tensors; other weights are returned as they are."""
    if isinstance(weight, IntWeight) and int4pack.fits(weight):
        return int4pack.pack(weight)
    return weight


def for_layer(weight) -> tuple[Callable, object]:
    """At load, once per layer: (its matmul, the weight that matmul takes), `prepare`'s
    weight with `int4pack_linear` where it converted it, else `weight` with `linear`; a
    converted weight is the only copy the caller need keep."""
    prepared = prepare(weight)
    return (linear, weight) if prepared is weight else (int4pack_linear, prepared)


def linear(x: Tensor, weight, bias: Tensor | None = None,
           config: IntLinearConfig = DEFAULT) -> Tensor:
    """x [..., K] (float16, bfloat16 or float32) @ weight^T (+ bias) -> [..., N] in x's
    dtype, for any `weight_formats` weight (its `kernel_args`)."""
    n, k = weight.shape
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m = rows.shape[0]
    if m == 0:
        y = torch.empty((0, n), dtype=x.dtype, device=x.device)
    elif m >= config.dequant_min_rows:
        y = torch.nn.functional.linear(rows, dequantize(weight, x.dtype, config), bias)
    else:
        y = torch.empty((m, n), dtype=x.dtype, device=x.device)
        _launch(rows, y, weight, bias, config)
    return y.view(*x.shape[:-1], n)


class Int4Path(enum.Enum):
    """How `int4pack_linear` multiplies a call's rows (`int4pack_path`)."""

    TORCH_KERNEL = "torch's int4 kernel"
    FUSED_GEMM = "fused GEMM"
    DEQUANTIZE = "dequantize + cuBLAS"


def int4pack_path(rows: int, dtype: torch.dtype,
                  config: IntLinearConfig = DEFAULT) -> Int4Path:
    """The row-count rule for a weight in torch's int4 layout (module docstring): torch's
    kernel (bfloat16 only) up to `int4pack_max_rows` rows, the fused GEMM up to
    `int4pack_gemm_max_rows` (and no rows), dequantize + cuBLAS beyond."""
    if 0 < rows <= config.int4pack_max_rows and dtype == torch.bfloat16:
        return Int4Path.TORCH_KERNEL
    if rows <= config.int4pack_gemm_max_rows:
        return Int4Path.FUSED_GEMM
    return Int4Path.DEQUANTIZE


def int4pack_linear(x: Tensor, weight: int4pack.Int4Weight, bias: Tensor | None = None,
                    config: IntLinearConfig = DEFAULT) -> Tensor:
    """x [..., K] (float16, bfloat16 or float32) @ weight^T (+ bias) -> [..., N] in x's
    dtype, for a weight in torch's int4 layout, by `int4pack_path`."""
    n, k = weight.shape
    rows = x.reshape(-1, k)
    path = int4pack_path(rows.shape[0], x.dtype, config)
    if path is Int4Path.TORCH_KERNEL:
        y = int4pack.matmul(rows, weight)
        if bias is not None:
            y += bias
    elif path is Int4Path.FUSED_GEMM:
        y = int4pack_gemm.matmul(rows, weight, bias)
    else:
        y = torch.nn.functional.linear(rows, _dequantize_int4pack(weight, x.dtype, config),
                                       bias)
    return y.view(*x.shape[:-1], n)


def dequantize(weight, dtype: torch.dtype, config: IntLinearConfig = DEFAULT) -> Tensor:
    """The weight [N, K] in `dtype`, or a `Stacked`'s experts [E, N, K], by
    `_dequant_kernel` (or `_int4pack_dequant_kernel` for a weight in torch's int4 layout)."""
    if isinstance(weight, int4pack.Int4Weight):
        return _dequantize_int4pack(weight, dtype, config)
    if isinstance(weight, Stacked):
        (e, n, k), steps = weight.shape, weight.strides
    else:
        (n, k), e, steps = weight.shape, 1, (0, 0, 0)
    a = weight.kernel_args()
    w = torch.empty((e, n, k), dtype=dtype, device=a.data.device)
    grid = (triton.cdiv(n, config.dequant_block_n), triton.cdiv(k, config.dequant_block_k), e)
    _dequant_kernel[grid](w, a.data, a.scales, a.zeros, a.g_idx, a.data_stride,
                          a.scales_stride, n, k, *steps, FORMAT=a.format, BITS=a.bits,
                          GROUP=a.group_size, HAS_ZEROS=a.has_zeros, HAS_G_IDX=a.has_g_idx,
                          BLOCK_N=config.dequant_block_n, BLOCK_K=config.dequant_block_k)
    return w if isinstance(weight, Stacked) else w[0]


def _dequantize_int4pack(weight: int4pack.Int4Weight, dtype: torch.dtype,
                         config: IntLinearConfig) -> Tensor:
    """A weight in torch's int4 layout [N, K] in `dtype`, by `_int4pack_dequant_kernel`."""
    n, k = weight.shape
    w = torch.empty((n, k), dtype=dtype, device=weight.packed.device)
    grid = (triton.cdiv(n, config.dequant_block_n), triton.cdiv(k, config.dequant_block_k))
    pairs = weight.scales_and_offsets.view(torch.int32)
    _int4pack_dequant_kernel[grid](w, weight.packed, pairs, n, k, GROUP=weight.group_size,
                                   BLOCK_N=config.dequant_block_n,
                                   BLOCK_K=config.dequant_block_k)
    return w


def _launch(rows: Tensor, y: Tensor, weight, bias: Tensor | None,
            config: IntLinearConfig) -> None:
    """The GEMV (one row) or the tiled GEMM into y."""
    (m, k), n = rows.shape, y.shape[1]
    a = weight.kernel_args()
    if (m <= config.gemv_max_rows and config.gguf_int8_activations
            and gguf_dp4a.takes(rows, a.format, a.data)):
        gguf_dp4a.gemv(rows, a.data, a.format, bias, out=y)
        return
    if m <= config.gemv_max_rows and gguf_gemv.takes(rows, a.format, a.data):
        gguf_gemv.gemv(rows, a.data, a.format, bias, out=y)
        return
    bias_arg = y if bias is None else bias
    if m <= config.gemv_max_rows and a.format == WeightFormat.INT and not a.has_g_idx:
        grid = (triton.cdiv(n, config.int_gemv_block_n), m)
        _int_gemv_kernel[grid](rows, y, bias_arg, a.data, a.scales, a.zeros, n, k,
                               a.data_stride, a.scales_stride, rows.stride(0), y.stride(0),
                               HAS_BIAS=bias is not None, BITS=a.bits, GROUP=a.group_size,
                               HAS_ZEROS=a.has_zeros, BLOCK_N=config.int_gemv_block_n,
                               BLOCK_K=config.int_gemv_block_k,
                               num_warps=config.int_gemv_warps)
        return
    common = dict(HAS_BIAS=bias is not None, FORMAT=a.format, BITS=a.bits,
                  GROUP=a.group_size, HAS_ZEROS=a.has_zeros, HAS_G_IDX=a.has_g_idx)
    args = (rows, y, bias_arg, a.data, a.scales, a.zeros, a.g_idx, a.data_stride,
            a.scales_stride)
    if m <= config.gemv_max_rows:
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
                           PRECISION=dot_precision(rows.dtype), num_warps=config.gemm_warps,
                           num_stages=config.gemm_stages)
