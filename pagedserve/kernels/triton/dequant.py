"""`dequant_tile`: a tile of a quantized weight, unpacked in registers; the one Triton
description of each format's unpacking (`kernels/weight_formats.py` says why and holds the
torch reference), which the GEMV and the GEMM (`int_linear.py`) both call.

Every format takes the same arguments: four pointers (the packed data, scales, zeros, the
column groups; a format uses those it has), the row strides of the first two, the rows
(offs_n, n_mask) and the first column k0 of the tile (a multiple of BLOCK_K), K, and the
format's constexprs. It returns the tile [BLOCK_N, BLOCK_K] in float32, not yet rounded to
the activation dtype (the GEMV rounds it with `precision.round_to`, the GEMM casts it for
tl.dot); columns past K come out finite (the kernels load zeros of x there).
"""

from __future__ import annotations

import triton
import triton.language as tl

from pagedserve.kernels.triton.gguf_dequant import gguf_tile
from pagedserve.kernels.weight_formats import WeightFormat

_INT = tl.constexpr(int(WeightFormat.INT))


@triton.jit
def _group_values(ptr, stride, offs_n, n_mask, groups_ptr, offs_k, k0, K,
                  GROUP: tl.constexpr, HAS_G_IDX: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    """Per-group values (scales or zeros) [N, G] laid over the tile's columns, float32:
    [BLOCK_N, BLOCK_K] where columns pick their group (g_idx, or a group narrower than the
    tile), [BLOCK_N, BLOCK_K // GROUP, 1] for whole groups inside the tile, [BLOCK_N, 1] for
    a group spanning the tile."""
    rows = ptr + offs_n[:, None].to(tl.int64) * stride
    if HAS_G_IDX:
        g = tl.load(groups_ptr + offs_k, mask=offs_k < K, other=0)
        return tl.load(rows + g[None, :], mask=n_mask[:, None] & (offs_k < K)[None, :],
                       other=0.0).to(tl.float32)
    elif BLOCK_K % GROUP == 0:
        g = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
        v = tl.load(rows + g[None, :], mask=n_mask[:, None] & (g * GROUP < K)[None, :],
                    other=0.0).to(tl.float32)
        return v[:, :, None]
    elif GROUP % BLOCK_K == 0:
        return tl.load(rows + k0 // GROUP, mask=n_mask[:, None], other=0.0).to(tl.float32)
    else:
        g = offs_k // GROUP
        return tl.load(rows + g[None, :], mask=n_mask[:, None] & (offs_k < K)[None, :],
                       other=0.0).to(tl.float32)


@triton.jit
def _int_tile(data_ptr, scales_ptr, zeros_ptr, g_idx_ptr, data_stride, scales_stride,
              offs_n, n_mask, k0, K, BITS: tl.constexpr, GROUP: tl.constexpr,
              HAS_ZEROS: tl.constexpr, HAS_G_IDX: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr):
    PER_WORD: tl.constexpr = 32 // BITS
    WORDS: tl.constexpr = BLOCK_K // PER_WORD
    offs_w = k0 // PER_WORD + tl.arange(0, WORDS)
    words = tl.load(data_ptr + offs_n[:, None].to(tl.int64) * data_stride + offs_w[None, :],
                    mask=n_mask[:, None] & (offs_w * PER_WORD < K)[None, :], other=0)
    shifts = tl.arange(0, PER_WORD) * BITS
    codes = (words[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    GROUPED: tl.constexpr = (not HAS_G_IDX) and BLOCK_K % GROUP == 0
    if GROUPED:  # whole groups: [BLOCK_N, groups, GROUP] against [BLOCK_N, groups, 1]
        q = tl.reshape(codes, (BLOCK_N, BLOCK_K // GROUP, GROUP)).to(tl.float32)
    else:
        q = tl.reshape(codes, (BLOCK_N, BLOCK_K)).to(tl.float32)
    s = _group_values(scales_ptr, scales_stride, offs_n, n_mask, g_idx_ptr, offs_k, k0, K,
                      GROUP, HAS_G_IDX, BLOCK_N, BLOCK_K)
    if HAS_ZEROS:
        z = _group_values(zeros_ptr, scales_stride, offs_n, n_mask, g_idx_ptr, offs_k, k0, K,
                          GROUP, HAS_G_IDX, BLOCK_N, BLOCK_K)
    else:
        z = float(1 << (BITS - 1))
    w = (q - z) * s
    return tl.reshape(w, (BLOCK_N, BLOCK_K))


@triton.jit
def dequant_tile(data_ptr, scales_ptr, zeros_ptr, g_idx_ptr, data_stride, scales_stride,
                 offs_n, n_mask, k0, K, FORMAT: tl.constexpr, BITS: tl.constexpr,
                 GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_G_IDX: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Weights of rows offs_n [BLOCK_N], columns k0 + arange(BLOCK_K) -> [BLOCK_N, BLOCK_K]
    in float32, as `weight_formats` describes FORMAT."""
    if FORMAT == _INT:
        return _int_tile(data_ptr, scales_ptr, zeros_ptr, g_idx_ptr, data_stride,
                         scales_stride, offs_n, n_mask, k0, K, BITS, GROUP, HAS_ZEROS,
                         HAS_G_IDX, BLOCK_N, BLOCK_K)
    else:  # a GGUF block type: its GGML id is the format's
        return gguf_tile(data_ptr, data_stride, offs_n, n_mask, k0, K, FORMAT, BLOCK_K)
