"""One row of activations (a batch-1 decode step) against a weight in GGUF blocks
(`kernels/gguf_format.py`: every type kept quantized on the GPU, Q4_0, Q4_1, Q8_0, Q4_K, Q5_K,
Q6_K), read as the file stores them: `gemv`, which `int_linear.linear` takes for one row
(except a bfloat16/float16 row against Q4_K or Q6_K, which by default takes `gguf_dp4a`:
the row quantized to int8, integer dot products).

Why its own kernel: a batch-1 step's time should be the packed bytes over memory bandwidth,
and `dequant.dequant_tile`'s description of the blocks, right for the GEMM's tiles, reads
every byte a weight needs one by one (its nibble, its super-block's two float16 scales
byte by byte, three bytes of 6-bit scales): about eight one-byte loads and their address
arithmetic per weight, in 16-row programs over all of K. Here:

- A Q4_K or Q5_K super-block (144 or 176 bytes, multiples of 16) is read as int32 words, 16
  bytes a load: its 32 words of nibbles as one run, its header (the two float16 scales,
  twelve bytes of 6-bit scales and mins) as words. Q6_K's 210-byte blocks and the 18-, 20-
  and 34-byte ones of Q4_0, Q4_1 and Q8_0 are only 2-byte aligned, so their codes are read
  as halfwords (no re-layout: the blocks stay the file's bytes, which every other reader of
  a `GgufWeight` takes).
- The tile is [rows, pairs of sub-blocks, 8 words, 2 nibbles of a byte, 4 bytes of a word]
  (Q6_K: [rows, units, the 4 quarters, halfwords, 2 bytes]; the 32-weight blocks: [rows,
  blocks, nibble halves, halfwords, 2 bytes]). Each thread holds one row's 64 (Q6_K and the
  32-weight blocks: 32) columns: the scales are unpacked once per thread, not per weight; a
  code becomes a float by OR-ing the exponent of 2^23 into it and subtracting 2^23 (exact),
  not by a conversion; the activations each weight multiplies are runs of consecutive
  columns.
- As `dense_gemv`: K is split into slices until the grid fills the GPU (`fp8_linear`'s tile
  rule), the last of an output tile's programs to arrive sums the partials
  (`arrivals.sum_slices`), the next tile's words are loaded one iteration ahead, the first
  before the PDL wait (`pdl`).

Each weight is the reference's (`gguf_format`), the same float32 products in the same order
(e.g. Q4_K's (d * scale) * q - dmin * min; on the GPU a product and a sum may fuse), rounded
to the activation dtype as `int_linear`'s other kernels round it (`_round_weight`), times x
in float32; only the order of the float32 sums differs from them.
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch
import triton
import triton.language as tl
from torch import Tensor

from pagedserve.kernels.gguf_format import BLOCKS
from pagedserve.kernels.triton import pdl
from pagedserve.kernels.triton.arrivals import finish_row, split_buffers
from pagedserve.kernels.triton.fp8_linear import WeightOnlyConfig, num_sms, one_row_tiles
from pagedserve.kernels.triton.precision import round_to
from pagedserve.kernels.weight_formats import WeightFormat

# the GGML types `gemv` takes
TYPES = (int(WeightFormat.GGUF_Q4_0), int(WeightFormat.GGUF_Q4_1),
         int(WeightFormat.GGUF_Q8_0), int(WeightFormat.GGUF_Q4_K), int(WeightFormat.GGUF_Q5_K),
         int(WeightFormat.GGUF_Q6_K))
# the types whose blocks are only 2-byte aligned, read as halfwords
_HALFWORD_TYPES = (int(WeightFormat.GGUF_Q4_0), int(WeightFormat.GGUF_Q4_1),
                   int(WeightFormat.GGUF_Q8_0), int(WeightFormat.GGUF_Q6_K))

# Tiles: 16 rows of two super-blocks (512 columns, 4.5 KiB of Q4_K), narrowed to 4 rows of
# eight while a projection has too few rows to fill the SMs; `fp8_linear.one_row_tiles`
# splits K past that. block_k is a multiple of the 256-column super-block. Rows times
# super-blocks times 4 is the program's threads (32 a warp; narrowing keeps the product):
# each thread then holds one (row, 64 columns) of the tile, so the compiler lays the tile out
# with its words, scales and sums in that thread's registers (other shapes compiled to
# layouts that spread a thread's weights over rows and read the words byte-wide, at two to
# four times the instructions a weight).
ONE_ROW = WeightOnlyConfig(block_n=16, block_k=512, num_warps=4, num_stages=1,
                           programs_per_sm=5, min_block_n=4, fma=True)
# Q6_K: a thread holds one (row, 32 columns) (Q6_K_HALFWORDS halfwords of each quarter), so
# the same tiles take 8 warps (with 64 columns a thread its loop ran out of registers and
# spilled)
Q6_K_ONE_ROW = replace(ONE_ROW, num_warps=8)
Q6_K_HALFWORDS = 4
# Q4_0, Q4_1, Q8_0: a thread holds one (row, 32-column block): 16 rows of 16 blocks, 8 warps
BLOCK32_ONE_ROW = replace(ONE_ROW, num_warps=8)

_Q5_K = tl.constexpr(int(WeightFormat.GGUF_Q5_K))
_Q4_0 = tl.constexpr(int(WeightFormat.GGUF_Q4_0))
_Q4_1 = tl.constexpr(int(WeightFormat.GGUF_Q4_1))
_Q8_0 = tl.constexpr(int(WeightFormat.GGUF_Q8_0))
# inline PTX where the kernels compile; the interpreter runs the Triton ops they stand for
_PTX = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")


@triton.jit
def _nibble_float(shifted):
    """2^23 + (the low 4 bits of int32 `shifted`) as float32 (exact), by OR-ing the exponent
    of 2^23 into them. Compiled, one lop3 (mask and OR in one instruction) after the shift:
    written in Triton, the compiler turns the shift and mask into a bit-field extract, which
    sm_90 runs as two instructions, then ORs in a third."""
    if _PTX:
        bits = tl.inline_asm_elementwise("lop3.b32 $0, $1, 15, 1258291200, 0xEA;", "=r,r",
                                         [shifted], dtype=tl.int32, is_pure=True, pack=1)
    else:
        bits = (shifted & 15) | 0x4B000000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _q6_float(low_shifted, high_shifted):
    """2^23 + q as float32 (exact) for Q6_K's q = the low 4 bits of `low_shifted` | bits 4-5
    of `high_shifted` (its 2 high bits already shifted there), as `_nibble_float`: compiled,
    two lop3s."""
    if _PTX:
        bits = tl.inline_asm_elementwise(
            "{ .reg .b32 t; lop3.b32 t, $2, 48, 1258291200, 0xEA; "
            "lop3.b32 $0, $1, 15, t, 0xEA; }",
            "=r,r,r", [low_shifted, high_shifted], dtype=tl.int32, is_pure=True, pack=1)
    else:
        bits = (low_shifted & 15) | (high_shifted & 48) | 0x4B000000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _round_weight(w, DTYPE: tl.constexpr):
    """`precision.round_to(w, DTYPE)`, the same values. For bfloat16 compiled, by the GPU's
    conversion of two floats at once (cvt.rn.bf16x2.f32, round to nearest even) and a shift
    or a mask back to float32: about one and a half instructions a weight where round_to's
    bit arithmetic takes four, in a loop whose instructions, not its bytes, set its pace."""
    if DTYPE == tl.bfloat16 and _PTX:
        bits = tl.inline_asm_elementwise(
            "{ .reg .b32 t; cvt.rn.bf16x2.f32 t, $3, $2; shl.b32 $0, t, 16; "
            "and.b32 $1, t, 0xFFFF0000; }",
            "=r,=r,f,f", [w], dtype=tl.uint32, is_pure=True, pack=2)
        return bits.to(tl.float32, bitcast=True)
    else:
        return round_to(w, DTYPE)


@triton.jit
def _f16_half(word, SHIFT: tl.constexpr):
    """The float16 in bits SHIFT..SHIFT+15 of int32 words, as float32."""
    return ((word >> SHIFT) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def program_blocks(N, blocks_per_row, blocks_per_split, BLOCK_N: tl.constexpr):
    """A one-row program's share of the output and of K: (pid_n, pid_k, its rows offs_n
    [BLOCK_N] and their mask, its blocks s_start .. s_stop of each row). Shared with
    `gguf_dp4a`'s kernels."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    s_start = pid_k * blocks_per_split
    return (pid_n, pid_k, offs_n, offs_n < N, s_start,
            tl.minimum(s_start + blocks_per_split, blocks_per_row))


@triton.jit
def _sub_scales(hdr, mask, pairs):
    """The sub-block scales d * sc and mins dmin * m (float32) of each (row, pair p, half h)
    of the tile, [BLOCK_N, P, 1, 2, 1] (sub-block 2 (p % 4) + h of its super-block), from
    pointers hdr [BLOCK_N, P, 1, 1, 1] to each pair's super-block header: word 0 holds d and
    dmin, words 1-3 the 6-bit scales and mins (`gguf_dequant._k_scale_min`): sub-blocks 0-3
    in the low 6 bits of bytes i (scale) and i + 4 (min); 4-7 in the nibbles of byte i + 8
    with their top 2 bits in the top bits of bytes i and i + 4. Computed at that shape, so
    each thread unpacks only the few its weights take."""
    sub = 2 * (pairs % 4)[None, :, None, None, None] + tl.arange(0, 2)[None, None, None, :, None]
    return sub_scale_min(hdr, mask, sub)


@triton.jit
def sub_scale_min(hdr, mask, sub):
    """The scale d * sc and min dmin * m (float32) of sub-block `sub` (0-7) of the K-quant
    super-block whose header `hdr` points to (int32 words; `_sub_scales` says where the
    6-bit values lie), at the shape of hdr and sub broadcast: each thread unpacks only the
    sub-blocks its weights take."""
    return scale_min(tl.load(hdr, mask=mask, other=0), tl.load(hdr + 1, mask=mask, other=0),
                     tl.load(hdr + 2, mask=mask, other=0), tl.load(hdr + 3, mask=mask, other=0),
                     sub)


@triton.jit
def scale_min(w0, s0, s1, s2, sub):
    """`sub_scale_min` from the header's words already loaded (w0: d and dmin; s0, s1, s2:
    the 6-bit scales and mins). The source words and masks are chosen by `sub` before
    shifting (sub is fixed per thread, so those choices leave the loop): per value two
    shifts, two logic ops and a select. Shared with `gguf_dp4a`'s Q4_K kernel."""
    sh = 8 * (sub % 4)
    low = sub < 4
    keep = tl.where(low, 63, 15)
    top = tl.where(low, 0, 48)  # bits 6-7 of the low byte, at bits 4-5, for sub-blocks 4-7
    sc = ((tl.where(low, s0, s2) >> sh) & keep) | ((s0 >> (sh + 2)) & top)
    mn = ((tl.where(low, s1, s2 >> 4) >> sh) & keep) | ((s1 >> (sh + 2)) & top)
    return _f16_half(w0, 0) * sc.to(tl.float32), _f16_half(w0, 16) * mn.to(tl.float32)


@triton.jit
def _tile_dot(acc, words, high_words, scales, mins, x, pairs, DTYPE: tl.constexpr,
              QTYPE: tl.constexpr):
    """acc [BLOCK_N, P, 8, 2, 4] + the tile's weights times x [.., P, 8, 2, 4]: nibble
    (word i, half h, byte c) of pair p's 8 words is column 64 p + 32 h + 4 i + c of the
    super-block, of sub-block 2 p + h (scales, mins [BLOCK_N, P, 1, 2, 1]). Q5_K's fifth
    bit of column l = 4 i + c of sub-block s is bit s of byte l of the 32 high bytes
    (high_words [BLOCK_N, P, 8], word i: bit 8 c + s)."""
    half = tl.arange(0, 2)[None, None, None, :, None]
    byte = tl.arange(0, 4)[None, None, None, None, :]
    q = words[:, :, :, None, None] >> (4 * half + 8 * byte)
    if QTYPE == _Q5_K:
        sub = 2 * (pairs % 4)[None, :, None, None, None] + half
        q = (q & 15) | (((high_words[:, :, :, None, None] >> (8 * byte + sub)) & 1) << 4)
        f = (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    else:
        f = _nibble_float(q) - 8388608.0
    w = scales * f - mins
    return acc + _round_weight(w, DTYPE) * x


@triton.jit
def _load_tile(w_rows, n_mask, s0, s_stop, pairs, BLOCK_WORDS: tl.constexpr,
               QS: tl.constexpr, QH: tl.constexpr, QTYPE: tl.constexpr,
               BLOCK_N: tl.constexpr, SB: tl.constexpr, EVICT: tl.constexpr):
    """Super-blocks s0 .. s0 + SB (none at or past s_stop) of rows w_rows [BLOCK_N, 1]
    (int32 pointers): (the nibble words [BLOCK_N, P, 8], each super-block's 32 loaded as one
    run; the fifth-bit words [BLOCK_N, P, 8] (Q5_K; else the nibble words again); pointers to
    each pair's header [BLOCK_N, P, 1, 1, 1] and their mask)."""
    P: tl.constexpr = SB * 4
    blocks = s0 + tl.arange(0, SB)
    base = w_rows[:, :, None] + (blocks * BLOCK_WORDS)[None, :, None]  # [BLOCK_N, SB, 1]
    mask = (n_mask[:, None] & (blocks < s_stop)[None, :])[:, :, None]
    words = tl.load(base + QS + tl.arange(0, 32)[None, None, :], mask=mask, other=0,
                    eviction_policy=EVICT)
    words = tl.reshape(words, (BLOCK_N, P, 8))
    if QTYPE == _Q5_K:
        high = tl.load(base + QH + tl.arange(0, 8)[None, None, :], mask=mask, other=0,
                       eviction_policy=EVICT)
        high = tl.reshape(tl.broadcast_to(high[:, :, None, :], (BLOCK_N, SB, 4, 8)),
                          (BLOCK_N, P, 8))
    else:
        high = words
    s = (s0 + pairs // 4)[None, :, None, None, None]
    hdr = w_rows[:, :, None, None, None] + s * BLOCK_WORDS
    hdr_mask = n_mask[:, None, None, None, None] & (s < s_stop)
    return words, high, hdr, hdr_mask


@triton.jit
def _kquant_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, part_ptr, arrivals_ptr, N, blocks_per_row,
                 blocks_per_split, row_words, HAS_BIAS: tl.constexpr, QTYPE: tl.constexpr,
                 BLOCK_N: tl.constexpr, SB: tl.constexpr, SPLIT_K: tl.constexpr,
                 EVICT: tl.constexpr):
    """y[n-tile] = x @ W[n-tile]^T (+ bias) for one row x, program (n, s) over super-blocks
    s * blocks_per_split onwards (SB a step); with SPLIT_K > 1 the last of the n-tile's
    programs to arrive sums the slices (partials [SPLIT_K, N]) and stores."""
    BLOCK_WORDS: tl.constexpr = 36 if QTYPE != _Q5_K else 44
    QS: tl.constexpr = 4 if QTYPE != _Q5_K else 12
    QH: tl.constexpr = 4
    P: tl.constexpr = SB * 4
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    pdl.allow_dependents()
    pid_n, pid_k, offs_n, n_mask, s_start, s_stop = program_blocks(
        N, blocks_per_row, blocks_per_split, BLOCK_N)
    w_rows = (w_ptr.to(tl.pointer_type(tl.int32))
              + offs_n.to(tl.int64)[:, None] * tl.multiple_of(row_words, 4))
    pairs = tl.arange(0, P)
    # x's columns in the tile's shape: 64 p + 32 h + 4 i + c past the tile's first column
    cols = (64 * pairs[:, None, None, None] + 4 * tl.arange(0, 8)[None, :, None, None]
            + 32 * tl.arange(0, 2)[None, None, :, None] + tl.arange(0, 4)[None, None, None, :])
    x_cols = x_ptr + cols
    acc = tl.zeros((BLOCK_N, P, 8, 2, 4), tl.float32)
    words, high, hdr, hdr_mask = _load_tile(w_rows, n_mask, s_start, s_stop, pairs,
                                            BLOCK_WORDS, QS, QH, QTYPE, BLOCK_N, SB, EVICT)
    pdl.wait_for_previous()  # x is the previous kernel's output; the weights are not
    for s0 in range(s_start, s_stop, SB):
        next_words, next_high, next_hdr, next_mask = _load_tile(
            w_rows, n_mask, s0 + SB, s_stop, pairs, BLOCK_WORDS, QS, QH, QTYPE, BLOCK_N, SB,
            EVICT)
        scales, mins = _sub_scales(hdr, hdr_mask, pairs)
        in_slice = (s0 + pairs // 4 < s_stop)[:, None, None, None]
        x = tl.load(x_cols + s0 * 256, mask=in_slice, other=0.0).to(tl.float32)[None]
        acc = _tile_dot(acc, words, high, scales, mins, x, pairs, DTYPE, QTYPE)
        words, high, hdr, hdr_mask = next_words, next_high, next_hdr, next_mask
    finish_row(tl.sum(tl.reshape(acc, (BLOCK_N, P * 64)), 1), bias_ptr, y_ptr, part_ptr,
               arrivals_ptr, offs_n, n_mask, pid_n, pid_k, N, HAS_BIAS, SPLIT_K)


@triton.jit
def _q6k_load(w_rows, n_mask, s0, s_stop, units, BLOCK_N: tl.constexpr, U: tl.constexpr,
              HW: tl.constexpr, EVICT: tl.constexpr):
    """Q6_K super-blocks s0 .. s0 + U // (32 // HW) (none at or past s_stop) of rows w_rows
    [BLOCK_N, 1] (int16 pointers; a block is 105 halfwords, so only 2-byte aligned), by unit
    u (`_q6k_kernel`): (the low-nibble halfwords [BLOCK_N, U, 1, 2, HW, 1] (quarters m and
    m + 2 share bytes 32 m + l of the half's 64), the high-bits halfwords
    [BLOCK_N, U, 1, 1, HW, 1], the mask [BLOCK_N, U, 1, 1, 1, 1])."""
    LQ: tl.constexpr = 16 // HW
    u = units[None, :, None, None, None, None]
    s = s0 + u // (2 * LQ)
    h = (u // LQ) % 2
    lq = u % LQ
    base = w_rows[:, :, None, None, None, None] + s * 105
    mask = n_mask[:, None, None, None, None, None] & (s < s_stop)
    hw = tl.arange(0, HW)[None, None, None, None, :, None]
    m = tl.arange(0, 2)[None, None, None, :, None, None]
    low = tl.load(base + 32 * h + 16 * m + HW * lq + hw, mask=mask, other=0,
                  eviction_policy=EVICT)
    high = tl.load(base + 64 + 16 * h + HW * lq + hw, mask=mask, other=0,
                   eviction_policy=EVICT)
    return low, high, mask


@triton.jit
def _q6k_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, part_ptr, arrivals_ptr, N, blocks_per_row,
                blocks_per_split, row_halves, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                SB: tl.constexpr, SPLIT_K: tl.constexpr, EVICT: tl.constexpr,
                HW: tl.constexpr):
    """`_kquant_kernel` for Q6_K: 128 bytes of low nibbles, 64 of 2-bit high parts, 16 int8
    scales (one per 16 columns), d (float16) a super-block; in each half of 128 columns,
    quarter qq's column l (0-31) has its low bits in nibble qq // 2 of byte 32 (qq % 2) + l
    and its high bits at bit 2 qq of byte l of the half's 32 high bytes
    (`gguf_dequant._decode`). A unit u is half h = u // LQ % 2 of super-block u // (2 LQ),
    columns 2 HW (u % LQ) + 0 .. 2 HW - 1 of each of its four quarters (LQ = 16 / HW); the
    tile is [rows, units, qq // 2, qq % 2, HW halfwords, 2 bytes]: a unit's 8 HW weights take
    3 HW halfwords, 4 scales and d, and multiply 4 runs of 2 HW consecutive columns of x.
    The weight is (d * scale) * (q - 32), q - 32 made exact from 2^23 + q."""
    LQ: tl.constexpr = 16 // HW
    U: tl.constexpr = SB * 2 * LQ
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    pdl.allow_dependents()
    pid_n, pid_k, offs_n, n_mask, s_start, s_stop = program_blocks(
        N, blocks_per_row, blocks_per_split, BLOCK_N)
    w_rows = (w_ptr.to(tl.pointer_type(tl.int16))
              + offs_n.to(tl.int64)[:, None] * row_halves)
    units = tl.arange(0, U)
    qhi = tl.arange(0, 2)[None, None, :, None, None, None]
    m = tl.arange(0, 2)[None, None, None, :, None, None]
    c2 = tl.arange(0, 2)[None, None, None, None, None, :]
    u = units[:, None, None, None, None]
    # x's columns: 128 h + 32 (2 qhi + m) + 2 HW lq + 2 hw + c2 past the super-block's first
    cols = (256 * (u // (2 * LQ)) + 128 * ((u // LQ) % 2) + 2 * HW * (u % LQ)
            + 64 * tl.arange(0, 2)[None, :, None, None, None]
            + 32 * tl.arange(0, 2)[None, None, :, None, None]
            + 2 * tl.arange(0, HW)[None, None, None, :, None]
            + tl.arange(0, 2)[None, None, None, None, :])
    acc = tl.zeros((BLOCK_N, U, 2, 2, HW, 2), tl.float32)
    low, high, mask = _q6k_load(w_rows, n_mask, s_start, s_stop, units, BLOCK_N, U, HW, EVICT)
    pdl.wait_for_previous()  # x is the previous kernel's output; the weights are not
    for s0 in range(s_start, s_stop, SB):
        next_low, next_high, next_mask = _q6k_load(w_rows, n_mask, s0 + SB, s_stop, units,
                                                   BLOCK_N, U, HW, EVICT)
        uu = units[None, :, None, None, None, None]
        block = w_rows[:, :, None, None, None, None] + (s0 + uu // (2 * LQ)) * 105
        d = tl.load(block + 104, mask=mask, other=0).to(tl.float16, bitcast=True)
        sc = tl.load(block.to(tl.pointer_type(tl.int8)) + 192 + 8 * ((uu // LQ) % 2)
                     + 2 * (2 * qhi + m) + (2 * HW * (uu % LQ)) // 16, mask=mask, other=0)
        scale = d.to(tl.float32) * sc.to(tl.float32)
        # the high bits at 8 c2 + 2 qq, moved to bits 4-5: (high << 4) >> (8 c2 + 2 qq)
        f = _q6_float(low.to(tl.int32) >> (8 * c2 + 4 * qhi),
                      (high.to(tl.int32) << 4) >> (8 * c2 + 4 * qhi + 2 * m)) - 8388640.0
        in_slice = (s0 + u // (2 * LQ) < s_stop)
        x = tl.load(x_ptr + s0 * 256 + cols, mask=in_slice, other=0.0).to(tl.float32)
        acc += _round_weight(scale * f, DTYPE) * x[None]
        low, high, mask = next_low, next_high, next_mask
    finish_row(tl.sum(tl.reshape(acc, (BLOCK_N, U * 8 * HW)), 1), bias_ptr, y_ptr, part_ptr,
               arrivals_ptr, offs_n, n_mask, pid_n, pid_k, N, HAS_BIAS, SPLIT_K)


@triton.jit
def _byte_float(shifted):
    """2^23 + 128 + (the int8 in the low byte of int32 `shifted`) as float32 (exact): the
    byte with its sign bit flipped (the int8 plus 128), the exponent of 2^23 OR-ed in; one
    lop3 compiled ((a & 0xFF) ^ 0x4B000080)."""
    if _PTX:
        bits = tl.inline_asm_elementwise("lop3.b32 $0, $1, 255, 1258291328, 0x6A;", "=r,r",
                                         [shifted], dtype=tl.int32, is_pure=True, pack=1)
    else:
        bits = (shifted & 255) ^ 0x4B000080
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _block32_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, part_ptr, arrivals_ptr, N, blocks_per_row,
                    blocks_per_split, row_halves, HAS_BIAS: tl.constexpr,
                    QTYPE: tl.constexpr, BLOCK_N: tl.constexpr, B: tl.constexpr,
                    SPLIT_K: tl.constexpr, EVICT: tl.constexpr):
    """`_kquant_kernel` for the 32-weight blocks (18, 20 and 34 bytes: 2-byte aligned, read
    as halfwords): Q4_0 (d, 16 bytes of nibbles: weight j in byte j % 16, the high nibble
    from 16; d (q - 8)), Q4_1 (d, m, the same nibbles; d q + m), Q8_0 (d, 32 int8; q d). A
    thread holds one (row, block); the tile is [rows, blocks, nibble half, code halfwords, 2
    bytes], column 2 NQ h + 2 hw + c of its block."""
    HALVES: tl.constexpr = 9 if QTYPE == _Q4_0 else (10 if QTYPE == _Q4_1 else 17)
    QS: tl.constexpr = 2 if QTYPE == _Q4_1 else 1
    NQ: tl.constexpr = 16 if QTYPE == _Q8_0 else 8
    H: tl.constexpr = 1 if QTYPE == _Q8_0 else 2
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    pdl.allow_dependents()
    pid_n, pid_k, offs_n, n_mask, s_start, s_stop = program_blocks(
        N, blocks_per_row, blocks_per_split, BLOCK_N)
    w_rows = (w_ptr.to(tl.pointer_type(tl.int16))
              + offs_n.to(tl.int64)[:, None] * row_halves)[:, :, None, None, None]
    b = tl.arange(0, B)[None, :, None, None, None]
    h = tl.arange(0, H)[None, None, :, None, None]
    hw = tl.arange(0, NQ)[None, None, None, :, None]
    c = tl.arange(0, 2)[None, None, None, None, :]
    cols = (32 * tl.arange(0, B)[:, None, None, None]
            + 2 * NQ * tl.arange(0, H)[None, :, None, None]
            + 2 * tl.arange(0, NQ)[None, None, :, None] + tl.arange(0, 2)[None, None, None, :])
    rows_mask = n_mask[:, None, None, None, None]
    acc = tl.zeros((BLOCK_N, B, H, NQ, 2), tl.float32)
    codes = tl.load(w_rows + (s_start + b) * HALVES + QS + hw,
                    mask=rows_mask & (s_start + b < s_stop), other=0, eviction_policy=EVICT)
    pdl.wait_for_previous()  # x is the previous kernel's output; the weights are not
    for s0 in range(s_start, s_stop, B):
        next_codes = tl.load(w_rows + (s0 + B + b) * HALVES + QS + hw,
                             mask=rows_mask & (s0 + B + b < s_stop), other=0,
                             eviction_policy=EVICT)
        block = w_rows + (s0 + b) * HALVES
        mask = rows_mask & (s0 + b < s_stop)
        d = tl.load(block, mask=mask, other=0).to(tl.float16, bitcast=True).to(tl.float32)
        shifted = codes.to(tl.int32) >> (8 * c + 4 * h)
        if QTYPE == _Q8_0:
            w = (_byte_float(shifted) - 8388736.0) * d
        elif QTYPE == _Q4_0:
            w = d * (_nibble_float(shifted) - 8388616.0)
        else:
            m = tl.load(block + 1, mask=mask, other=0).to(tl.float16, bitcast=True)
            w = d * (_nibble_float(shifted) - 8388608.0) + m.to(tl.float32)
        in_slice = (s0 + tl.arange(0, B) < s_stop)[:, None, None, None]
        x = tl.load(x_ptr + s0 * 32 + cols, mask=in_slice, other=0.0).to(tl.float32)
        acc += _round_weight(w, DTYPE) * x[None]
        codes = next_codes
    finish_row(tl.sum(tl.reshape(acc, (BLOCK_N, B * 32)), 1), bias_ptr, y_ptr, part_ptr,
               arrivals_ptr, offs_n, n_mask, pid_n, pid_k, N, HAS_BIAS, SPLIT_K)


def tiles(n: int, k: int, sms: int, cfg: WeightOnlyConfig,
          block: int = 256) -> tuple[WeightOnlyConfig, int, int]:
    """(cfg narrowed to n, slices of K, blocks of `block` columns per slice):
    `fp8_linear.one_row_tiles`, whose K tiles are whole blocks here."""
    cfg, splits, k_per_split = one_row_tiles(n, k, sms, cfg)
    return cfg, splits, k_per_split // block


def takes(x: Tensor, qtype: int, blocks: Tensor) -> bool:
    """Whether `gemv` takes x [M, K] against GGUF blocks of `qtype`: one contiguous row
    (K > 0), a type it reads, and rows that start where its loads need them: on 16 bytes for
    Q4_K and Q5_K (words; their rows are multiples of 16 bytes, so only a view's offset can
    break that), on 2 for the others (halfwords: their 18-, 20-, 34- and 210-byte blocks are
    no more aligned)."""
    align = 2 if qtype in _HALFWORD_TYPES else 16
    return (x.shape[0] == 1 and x.shape[1] > 0 and x.stride(-1) == 1 and qtype in TYPES
            and blocks.stride(-1) == 1 and blocks.stride(0) % align == 0
            and blocks.data_ptr() % align == 0)


def gemv(x: Tensor, blocks: Tensor, qtype: int, bias: Tensor | None = None,
         out: Tensor | None = None, cfg: WeightOnlyConfig | None = None) -> Tensor:
    """x [1, K] (contiguous) @ the weight in GGUF blocks `blocks` (uint8 [N, row bytes], rows
    contiguous, a `GgufWeight`'s) ^T (+ bias) -> [1, N] in x's dtype, into `out` [1, N] when
    given (its row contiguous): one launch, no host sync (CUDA graphs capture it, as
    `dense_gemv.gemv`). cfg: the tiles (default `ONE_ROW`, `Q6_K_ONE_ROW`)."""
    assert takes(x, qtype, blocks)
    n, k = blocks.shape[0], x.shape[1]
    weights, size = BLOCKS[qtype]
    assert blocks.shape[1] == k // weights * size
    y = torch.empty((1, n), dtype=x.dtype, device=x.device) if out is None else out
    assert y.shape == (1, n) and y.stride(-1) == 1
    q6_k = qtype == WeightFormat.GGUF_Q6_K
    cfg = cfg or (Q6_K_ONE_ROW if q6_k else ONE_ROW if weights == 256 else BLOCK32_ONE_ROW)
    cfg, splits, per_split = tiles(n, k, num_sms(x.device), cfg, weights)
    n_tiles = triton.cdiv(n, cfg.block_n)
    parts, arrivals = split_buffers(splits, n, n_tiles, y)
    bias_arg = y if bias is None else bias  # never read without HAS_BIAS
    common = dict(HAS_BIAS=bias is not None, BLOCK_N=cfg.block_n, SPLIT_K=splits,
                  EVICT="evict_first" if cfg.evict_first else "",
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.launch_options())
    args = (x, blocks, bias_arg, y, parts, arrivals, n, k // weights, per_split)
    if weights == 32:
        _block32_kernel[(n_tiles, splits)](*args, blocks.stride(0) // 2, QTYPE=qtype,
                                           B=cfg.block_k // 32, **common)
    elif q6_k:
        _q6k_kernel[(n_tiles, splits)](*args, blocks.stride(0) // 2, HW=Q6_K_HALFWORDS,
                                       SB=cfg.block_k // 256, **common)
    else:
        _kquant_kernel[(n_tiles, splits)](*args, blocks.stride(0) // 4, QTYPE=qtype,
                                          SB=cfg.block_k // 256, **common)
    return y

