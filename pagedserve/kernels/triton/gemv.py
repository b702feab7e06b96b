"""One row of activations against a weight kept quantized (`kernels/weight_formats.py`), as
Triton device functions: the inner loop of the dense one-row matmuls (`int_linear.py`) and
of the fused MoE's few-token path (`moe.py`), written once for both.

Why a row loop and not tl.dot: a decode step reads each weight once and does two flops per
weight, so its time is the packed bytes over memory bandwidth; tl.dot's smallest tile would
waste 15 of its 16 rows, and the unpacking must cost less than the bytes take to arrive.
Integer codes in column order (`int_row_dot`) become floats by an OR of the float32
exponent instead of a conversion, and take each group's scale per packed word; other formats
(g_idx, GGUF blocks) go through `dequant_tile`.

Rounding: `int_row_dot` keeps the weight in float32 (within the activation dtype's noise of
a float model built from the dequantized weights; float32 activations: the same to the last
bits); `tile_row_dot` rounds each weight to the activation dtype first, as that model holds
it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from pagedserve.kernels.triton.dequant import dequant_tile
from pagedserve.kernels.triton.precision import round_to
from pagedserve.kernels.weight_formats import WeightFormat

_INT = tl.constexpr(int(WeightFormat.INT))


@triton.jit
def int_row_dot(x_row, data_ptr, scales_ptr, zeros_ptr, data_stride, scales_stride, offs_n,
                n_mask, K, BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """x_row [K] . rows offs_n of an `INT` weight in column order -> float32 [BLOCK_N]. The
    tile is [rows, words, codes per word], each word read once; a code c becomes the float
    2^23 + c by OR-ing the exponent of 2^23 into its bits (exact), and 2^23 + zero is
    subtracted; scales and zeros are per word (a group holds whole words)."""
    PER_WORD: tl.constexpr = 32 // BITS
    WORDS: tl.constexpr = BLOCK_K // PER_WORD
    shifts = tl.arange(0, PER_WORD) * BITS
    data_rows = data_ptr + offs_n[:, None].to(tl.int64) * data_stride
    scale_rows = offs_n[:, None].to(tl.int64) * scales_stride
    acc = tl.zeros((BLOCK_N, WORDS, PER_WORD), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_w = k0 // PER_WORD + tl.arange(0, WORDS)
        mask = n_mask[:, None] & (offs_w * PER_WORD < K)[None, :]
        words = tl.load(data_rows + offs_w[None, :], mask=mask, other=0)
        codes = (words[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)
        f = (codes | 0x4B000000).to(tl.float32, bitcast=True)
        groups = scale_rows + ((offs_w * PER_WORD) // GROUP)[None, :]
        s = tl.load(scales_ptr + groups, mask=mask, other=0.0).to(tl.float32)
        offs_k = offs_w[:, None] * PER_WORD + tl.arange(0, PER_WORD)[None, :]
        x = tl.load(x_row + offs_k, mask=offs_k < K, other=0.0)
        if HAS_ZEROS:
            z = tl.load(zeros_ptr + groups, mask=mask, other=0.0).to(tl.float32) + 8388608.0
            q = f - z[:, :, None]
        else:
            q = f - (8388608.0 + (1 << (BITS - 1)))
        acc += q * (s[:, :, None] * x.to(tl.float32)[None, :, :])
    return tl.sum(tl.sum(acc, axis=2), axis=1)


@triton.jit
def tile_row_dot(x_row, data_ptr, scales_ptr, zeros_ptr, g_idx_ptr, data_stride,
                 scales_stride, offs_n, n_mask, K, dtype: tl.constexpr, FORMAT: tl.constexpr,
                 BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr,
                 HAS_G_IDX: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """x_row [K] . rows offs_n of any format's weight, unpacked tile by tile by
    `dequant_tile` and rounded to `dtype` -> float32 [BLOCK_N]."""
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w = dequant_tile(data_ptr, scales_ptr, zeros_ptr, g_idx_ptr, data_stride,
                         scales_stride, offs_n, n_mask, k0, K, FORMAT, BITS, GROUP,
                         HAS_ZEROS, HAS_G_IDX, BLOCK_N, BLOCK_K)
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_row + offs_k, mask=offs_k < K, other=0.0)
        acc += round_to(w, dtype) * x.to(tl.float32)[None, :]
    return tl.sum(acc, axis=1)


@triton.jit
def row_dot(x_row, data_ptr, scales_ptr, zeros_ptr, g_idx_ptr, data_stride, scales_stride,
            offs_n, n_mask, K, dtype: tl.constexpr, FORMAT: tl.constexpr, BITS: tl.constexpr,
            GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_G_IDX: tl.constexpr,
            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """x_row [K] . rows offs_n of the weight -> float32 [BLOCK_N], by `int_row_dot` where the
    format allows it, else `tile_row_dot`."""
    if FORMAT == _INT and not HAS_G_IDX:
        return int_row_dot(x_row, data_ptr, scales_ptr, zeros_ptr, data_stride,
                           scales_stride, offs_n, n_mask, K, BITS, GROUP, HAS_ZEROS,
                           BLOCK_N, BLOCK_K)
    else:
        return tile_row_dot(x_row, data_ptr, scales_ptr, zeros_ptr, g_idx_ptr, data_stride,
                            scales_stride, offs_n, n_mask, K, dtype, FORMAT, BITS, GROUP,
                            HAS_ZEROS, HAS_G_IDX, BLOCK_N, BLOCK_K)
