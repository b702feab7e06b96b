"""Reading a 4-bit weight in torch's int4 layout (`kernels/int4pack.py`) from Triton: the
tile unpacking that every kernel over that layout shares (`int4pack_tile`), and a fused
GEMM on it for decode batches.

Why a fused GEMM: past the rows where torch's own int4 kernel pays (its cost per row grows
with the batch), the weight was dequantized into a bf16 scratch tensor and multiplied by
cuBLAS, which writes and reads again a bf16 copy of the whole weight each call: four times
the packed bytes, twice. `_int4pack_gemm_kernel` reads each packed word once from memory,
unpacks and scales it in registers and feeds `tl.dot` on half-precision tiles with float32
accumulation. It computes y^T = W x^T, the weight tile as the dot's first operand: on Hopper
that operand of a warpgroup MMA may come from registers, so the unpacked tile goes to the
tensor cores without a round trip through shared memory, and a decode batch's few rows are
the MMA's narrow N (16 or more). For few rows the grid has few output tiles, so split-K
(partial sums added atomically into a float32 buffer) keeps the SMs busy.

Unpacking: the layout keeps, per 8 output rows and 128 columns, 16 words a row; word
[n // 8, k // 128, (n % 8) * 4 + q, j] holds columns k = (k // 128) * 128 + j * 32 +
i * 8 + q * 2 + lo in nibble 4 * lo + i. So a row's 32 columns j * 32 ... are its 4 words
q = 0..3 at word column j, and one group's (scale, offset) serves all 32 (groups are
multiples of 32). `int4pack_tile` loads the four words as four tensors of one layout, so
one thread holds all four, turns each code into a float by OR-ing it into a mantissa
(exact: no shift, no conversion), scales it, and puts the 32 values in column order with
`tl.join`, which adds its dimension in the thread's own registers: no data moves between
threads. In float32 (`_value`) each nibble is masked where it lies into the mantissa of
2^23, giving 2^23 + code * 16^i, and rounded once to the activation dtype after the scale
and offset, exactly as the reference; for bfloat16 activations on the GPU (FAST_BF16)
nibbles i and 4 + i, the two adjacent columns one bfloat16x2 register holds, go into the
halves of one register over bfloat16 128 and take one bfloat16x2 subtraction and FMA (inline
PTX; one rounding where the reference rounds to float32 first, so a weight with zero points
may differ from it by one bfloat16 step in rare ties). About 6 instructions a weight in the
compiled sm_90 loop instead of 8.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

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
def _value(half, i: tl.constexpr, scale, offset, dtype: tl.constexpr):
    """Nibble i (0..3) of `half` (a word, or its upper half shifted down, OR-ed with the
    exponent bits of 2^23 0x4B000000) as (code - 8) * scale + offset. The nibble masked
    where it is, in the mantissa of 2^23, is 2^23 + code * 16^i exactly: one logic op a
    code (one constant), no shift, no conversion; the scale divided by 16^i is exact too."""
    bits = half & ((0xF << (4 * i)) | 0x4B000000)
    scaled = bits.to(tl.float32, bitcast=True) - (8388608.0 + 8.0 * (1 << (4 * i)))
    return (scaled * (scale * (1.0 / (1 << (4 * i)))) + offset).to(dtype)


@triton.jit
def _word(half, scale, offset, dtype: tl.constexpr):
    """The four nibbles of a half word, columns 8 * i (+ 2 * q + lo), as [..., i // 2,
    i % 2]."""
    return tl.join(tl.join(_value(half, 0, scale, offset, dtype),
                           _value(half, 2, scale, offset, dtype)),
                   tl.join(_value(half, 1, scale, offset, dtype),
                           _value(half, 3, scale, offset, dtype)))


@triton.jit
def _columns(h0, h1, h2, h3, scale, offset, dtype: tl.constexpr):
    """Columns 8 * i + 2 * q (+ lo) of the half words q = 0..3 of 32 columns, as
    [..., i // 2, i % 2, q // 2, q % 2]."""
    return tl.join(tl.join(_word(h0, scale, offset, dtype), _word(h2, scale, offset, dtype)),
                   tl.join(_word(h1, scale, offset, dtype), _word(h3, scale, offset, dtype)))


@triton.jit
def _pair_bf16(word, i: tl.constexpr, scale2, offset2):
    """Nibbles i and 4 + i of each word (columns 8 * i + 2 * q and the next) in bfloat16,
    [..., 2], from one register: both OR-ed into the mantissa of bfloat16 128 (0x4300), one
    in each half word, are 128 + code exactly; then one bfloat16x2 subtraction and FMA
    (scale2, offset2: the group's scale and offset in both halves)."""
    bits = ((word >> (4 * i)) & 0x000F000F) | 0x43004300
    return tl.inline_asm_elementwise(
        "{ .reg .b32 t, c; mov.b32 c, 0x43084308; sub.rn.bf16x2 t, $2, c; "
        "fma.rn.bf16x2 t, t, $3, $4; mov.b32 {$0, $1}, t; }",
        "=h,=h,r,r,r", [bits, scale2, offset2], dtype=(tl.bfloat16, tl.bfloat16),
        is_pure=True, pack=1)


@triton.jit
def _word_bf16(word, scale2, offset2):
    """A word's eight values as its four even columns and its four odd ones, each
    [..., i // 2, i % 2]."""
    a0, b0 = _pair_bf16(word, 0, scale2, offset2)
    a1, b1 = _pair_bf16(word, 1, scale2, offset2)
    a2, b2 = _pair_bf16(word, 2, scale2, offset2)
    a3, b3 = _pair_bf16(word, 3, scale2, offset2)
    return (tl.join(tl.join(a0, a2), tl.join(a1, a3)),
            tl.join(tl.join(b0, b2), tl.join(b1, b3)))


@triton.jit
def int4pack_tile(packed_ptr, pairs_ptr, offs_n, n_mask, k0, N, K, dtype: tl.constexpr,
                  GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  FAST_BF16: tl.constexpr = False):
    """Weight rows offs_n, columns k0 .. k0 + BLOCK_K (k0 and BLOCK_K multiples of 128) of a
    weight in torch's int4 layout, [BLOCK_N, BLOCK_K] in `dtype`, each value (code - 8) *
    scale + offset in float32 (the product exact) rounded to dtype, as
    `Int4Weight.dequantize` computes it (FAST_BF16: in bfloat16 by bfloat16x2 FMAs, dtype
    bfloat16 on a GPU only; module docstring); rows past N and columns past K are 0.
    pairs_ptr: the (scale, offset) table seen as int32 [groups, N], one bf16 pair a word
    (scale in the low half)."""
    tl.static_assert(BLOCK_K % 128 == 0)
    CHUNKS: tl.constexpr = BLOCK_K // 32
    n64 = offs_n.to(tl.int64)
    chunk = tl.arange(0, CHUNKS)
    first = k0 + chunk * 32  # first column of each 32
    mask = n_mask[:, None] & (first < K)[None, :]
    word = (((n64 // 8) * K + (n64 % 8) * 16)[:, None]
            + (k0 + (chunk // 4) * 128 + chunk % 4)[None, :])  # q = 0; k0: 128 * m
    w0 = tl.load(packed_ptr + word, mask=mask, other=0)
    w1 = tl.load(packed_ptr + word + 4, mask=mask, other=0)
    w2 = tl.load(packed_ptr + word + 8, mask=mask, other=0)
    w3 = tl.load(packed_ptr + word + 12, mask=mask, other=0)
    pair = tl.load(pairs_ptr + (first // GROUP).to(tl.int64)[None, :] * N + n64[:, None],
                   mask=mask, other=0)
    if FAST_BF16:
        scale2 = (pair << 16) | (pair & 0xFFFF)  # the scale in both halves
        offset2 = ((pair >> 16) << 16) | ((pair >> 16) & 0xFFFF)
        e0, o0 = _word_bf16(w0, scale2, offset2)
        e1, o1 = _word_bf16(w1, scale2, offset2)
        e2, o2 = _word_bf16(w2, scale2, offset2)
        e3, o3 = _word_bf16(w3, scale2, offset2)
        w = tl.join(tl.join(tl.join(e0, e2), tl.join(e1, e3)),
                    tl.join(tl.join(o0, o2), tl.join(o1, o3)))
        return tl.reshape(w, (BLOCK_N, BLOCK_K))
    scale = (pair << 16).to(tl.float32, bitcast=True)
    offset = ((pair >> 16) << 16).to(tl.float32, bitcast=True)
    e = 0x4B000000
    w = tl.join(_columns(w0 | e, w1 | e, w2 | e, w3 | e, scale, offset, dtype),  # 0..3
                _columns((w0 >> 16) | e, (w1 >> 16) | e, (w2 >> 16) | e, (w3 >> 16) | e,
                         scale, offset, dtype))
    return tl.reshape(w, (BLOCK_N, BLOCK_K))


@triton.jit
def _int4pack_gemm_kernel(x_ptr, y_ptr, bias_ptr, packed_ptr, pairs_ptr, M, N, K, stride_x,
                          stride_y, HAS_BIAS: tl.constexpr, GROUP: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                          PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                          FAST_BF16: tl.constexpr):
    """y [M, N] = x [M, K] @ W^T (+ bias), as y^T = W x^T (module docstring): a
    [BLOCK_N, BLOCK_M] tile of y^T per program, M tiles first on the grid (programs that
    share a weight tile run together, so it is read from memory once); with SPLIT_K > 1,
    program axis 2 takes every SPLIT_K-th K step and adds its partial sums into y (float32,
    zeroed; the bias is the caller's)."""
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    dtype = x_ptr.dtype.element_ty
    x_cols = x_ptr + offs_m[None, :].to(tl.int64) * stride_x
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # y^T: the weight is operand A
    for k0 in range(pid_k * BLOCK_K, K, SPLIT_K * BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        xt = tl.load(x_cols + offs_k[:, None], mask=(offs_k < K)[:, None] & m_mask[None, :],
                     other=0.0)
        w = int4pack_tile(packed_ptr, pairs_ptr, offs_n, n_mask, k0, N, K, dtype, GROUP,
                          BLOCK_N, BLOCK_K, FAST_BF16)
        if UPCAST:
            xt, w = xt.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(w, xt, acc, input_precision=PRECISION)
    out = y_ptr + offs_m[None, :].to(tl.int64) * stride_y + offs_n[:, None]
    mask = n_mask[:, None] & m_mask[None, :]
    if SPLIT_K > 1:
        tl.atomic_add(out, acc, mask=mask, sem="relaxed")
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class Int4GemmConfig:
    """One launch's tiles (powers of two): BLOCK_K whole 128-column blocks of the layout,
    split_k the programs that share one output tile's K steps. The weight tile is the
    tl.dot's first operand (y^T = W x^T), so BLOCK_N is its M: 64 rows per 4 warps take
    Hopper's warpgroup MMA with the unpacked weight straight from registers."""

    block_m: int
    block_n: int
    block_k: int = 128
    split_k: int = 1
    warps: int = 4
    stages: int = 3

    def __post_init__(self):
        if self.block_k % 128:
            raise ValueError(f"block_k {self.block_k}: not a multiple of 128")


def config_for(m: int, n: int, k: int, sms: int) -> Int4GemmConfig:
    """The tiles for an [m, k] @ [k, n] call on a GPU of `sms` SMs (placed by benchmarks/int4.py
    --sweep, docs/benchmarks.md: per row bucket, best or near it on each projection): 64 weight rows
    a program, the M tile the smallest power of two that holds the rows up to 128 (one M tile
    reads the weight once; the unpacking is shared by all its rows). K is split in four at 16
    rows or fewer (each program's few rows leave the SMs waiting on memory), and in two or four
    while the output tiles alone would leave over half of the SMs idle, each split keeping 8 K
    steps or more."""
    if m <= 16:
        config = Int4GemmConfig(16, 64, split_k=4, stages=4)
    elif m <= 32:
        config = Int4GemmConfig(32, 64, stages=4)
    elif m <= 64:
        config = Int4GemmConfig(64, 64)
    else:
        config = Int4GemmConfig(128, 64)
    tiles = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)
    split = config.split_k
    while split < 4 and tiles * split * 2 <= sms:
        split *= 2
    while split > 1 and k // (config.block_k * split) < 8:
        split //= 2
    return replace(config, split_k=split)


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
        UPCAST=_INTERPRET, FAST_BF16=x.dtype == torch.bfloat16 and not _INTERPRET,  # PTX
        num_warps=config.warps,
        num_stages=config.stages)
    if split > 1:
        y = y.to(x.dtype) if bias is None else (y + bias).to(x.dtype)
    return y
