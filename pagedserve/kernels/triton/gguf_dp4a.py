"""One row of activations against GGUF blocks with the activations quantized to int8 and the
products summed as integers (`dp4a`): `gemv`, which `int_linear` takes for one bfloat16 or
float16 row against Q4_K and Q6_K (the types of a Q4_K_M file) unless the engine runs with
--no-gguf-int8-activations (then `gguf_gemv`, float activations, for every type).

Why: `gguf_gemv` turns every weight into a float, scales it, rounds it to the activation dtype
and multiplies: several instructions a weight, so its loop, not the bytes, sets the pace
(docs/benchmarks.md, "The one-row GGUF GEMV with int8 activations"). Quantizing the row first (one
tiny launch, `quantize`: per 32 columns an int8 code per column, a float32 scale and the sum
of the codes, the layout llama.cpp calls Q8_1) lets the loop multiply 4 packed weights by 4
codes in one `dp4a` instruction and leave the weights as the integers they are: a
sub-block's 32 products are an exact int32, scaled once by the sub-block's scale and the
activation block's. The price is the activations' rounding, at most half a step of
amax / 127 per column (tests/kernels/test_gguf_dp4a.py bounds the product's error by it).

Q4_K: y += dx * (d sc * sum(q x) - dmin m * sum(x)) per 32-column sub-block, sum(x) from
`quantize`. A word's low nibbles (mask 0x0F0F0F0F) are 4 consecutive columns of a pair of
sub-blocks' first, its high ones (mask 0xF0F0F0F0: 16 q, the 16 taken out of the scale) of
the second, each one dp4a against a word of codes. Q6_K: a program's unit is 16 columns of
each of a half super-block's four 32-column quarters; q - 32 is summed as dp4a(q, x) +
dp4a(-32 in every byte, x), so no per-byte subtraction is needed; each 16 columns have
their own int8 scale; its blocks are only 2-byte aligned, so its words come from aligned
word loads and a funnel shift (`_funnel`).

The loop's pace is its instructions a weight (`benchmarks/gguf_ptx.py` counts them
offline), and what costs most there is moving values between threads: a layout conversion
in the loop is a round trip through shared memory with barriers. So a thread holds one
(row, pair of sub-blocks) of Q4_K, one (row, unit) of Q6_K, and every tensor of a step is
loaded at the shape [rows, pairs or units, 4] (16 bytes a thread a load where aligned): the
weight words, the Q4_K header (scales unpacked in the thread, `gguf_gemv.scale_min`), and
the codes, activation scales and sums, each row's the same (L1 serves the repeats), so that
the compiler gives them all one layout; a sub-block's dp4a feed one another and its sum
stays in its thread. No load is masked (Triton zeroes a masked load's registers first, an
instruction a pair): rows past N read row N - 1 (never stored) and blocks past a slice its
last block, whose sums the last step, run after the loop, drops.

Both keep `gguf_gemv`'s structure: split K (`fp8_linear.one_row_tiles`, partials summed by
the last program to arrive, `arrivals`), the next tile's weights loaded one iteration ahead
and the first before the PDL wait (`pdl`); no host sync and no memset (CUDA graphs capture
the two launches). Under TRITON_INTERPRET=1 the inline PTX does not run: `_dp4a` then sums
the same bytes with integer ops and `_funnel` selects the same halves, so the CPU tests run
the kernels' indexing.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from pagedserve.kernels.gguf_format import BLOCKS
from pagedserve.kernels.triton import pdl
from pagedserve.kernels.triton.arrivals import finish_row, split_buffers
from pagedserve.kernels.triton.fp8_linear import WeightOnlyConfig, num_sms
from pagedserve.kernels.triton.gguf_gemv import ONE_ROW, program_blocks, scale_min, tiles
from pagedserve.kernels.weight_formats import WeightFormat

# the GGML types `gemv` takes
TYPES = (int(WeightFormat.GGUF_Q4_K), int(WeightFormat.GGUF_Q6_K))
# the activation dtypes it quantizes (float32 rows keep `gguf_gemv`'s exact products)
DTYPES = (torch.bfloat16, torch.float16)
# columns per activation block (a code's scale and the codes' sum)
QBLOCK = 32
# activation blocks a `_quantize_kernel` program quantizes
QUANT_BLOCKS = 16

# Tiles: `gguf_gemv.ONE_ROW`'s, 16 rows of two super-blocks, 4 warps; a thread holds one
# (row, 64 columns) in both kernels, so rows x super-blocks x 4 is the program's threads as
# there (the narrowing keeps that product).
Q4_K_ONE_ROW = ONE_ROW
Q6_K_ONE_ROW = ONE_ROW

_Q4_K = tl.constexpr(int(WeightFormat.GGUF_Q4_K))
# inline PTX where the kernels compile; the interpreter runs plain integer ops instead
_PTX = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")
# 1.5 * 2^23: v + this, for |v| < 2^22, is the float whose low mantissa bits are rint(v)
_RINT_MAGIC = tl.constexpr(12582912.0)


@triton.jit
def _dp4a(a, b, c, A_SIGNED: tl.constexpr):
    """c + the sum of the products of the 4 bytes of int32 a (signed if A_SIGNED, else
    unsigned) and the 4 signed bytes of b: dp4a.s32.s32 or dp4a.u32.s32."""
    if _PTX:
        if A_SIGNED:
            return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r",
                                             [a, b, c], dtype=tl.int32, is_pure=True, pack=1)
        else:
            return tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r",
                                             [a, b, c], dtype=tl.int32, is_pure=True, pack=1)
    else:
        total = c
        for i in tl.static_range(4):
            a_byte = (a >> (8 * i)) & 255
            if A_SIGNED:
                a_byte = (a_byte ^ 128) - 128
            total += a_byte * ((((b >> (8 * i)) & 255) ^ 128) - 128)
        return total


@triton.jit
def _quantize_kernel(x_ptr, codes_ptr, scales_ptr, sums_ptr, n_blocks,
                     BLOCKS: tl.constexpr):
    """Activation blocks pid * BLOCKS .. of x (32 columns each): d = amax / 127 and the codes
    rint(x / d), each a single IEEE float32 division (div_rn: Triton's `/` on float32
    compiles to an approximate division), rounded to nearest even by the 1.5 * 2^23 trick
    (|x / d| <= 127); an all-zero block has d = 0 and zero codes. Also the codes' sum."""
    pdl.step_entry()  # x is the previous kernel's output
    blocks = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)
    mask = (blocks < n_blocks)[:, None]
    cols = blocks[:, None] * 32 + tl.arange(0, 32)[None, :]
    x = tl.load(x_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    d = tl.div_rn(tl.max(tl.abs(x), 1), 127.0)
    nonzero = (d > 0)[:, None]
    v = tl.where(nonzero, tl.div_rn(x, tl.where(nonzero, d[:, None], 1.0)), 0.0)
    q = (v + _RINT_MAGIC).to(tl.int32, bitcast=True) - 0x4B400000
    tl.store(codes_ptr + cols, q.to(tl.int8), mask=mask)
    tl.store(scales_ptr + blocks, d, mask=blocks < n_blocks)
    tl.store(sums_ptr + blocks, tl.sum(q, 1), mask=blocks < n_blocks)


@triton.jit
def _q4k_load(w_hdr, w_nibbles, s0, s_stop, pairs, EVICT: tl.constexpr):
    """Q4_K super-blocks s0 .. s0 + P // 4 by pair p [BLOCK_N, P, 1] (none past s_stop - 1:
    `_q4k_step` drops what it repeats): from w_hdr [BLOCK_N, P, 4], each row's super-block
    0's header words 0-3, and w_nibbles, its nibble words 8 (p % 4) .. + 3 (int32 pointers;
    36 words a block), (the pair's words 0-3, its words 4-7, its super-block's header words
    0-3), each [BLOCK_N, P, 4] and one 16-byte load, so that all three come in one layout, a
    thread's (row, pair) whole. Unmasked (a masked load zeroes its registers first)."""
    at = tl.minimum(s0 + pairs // 4, s_stop - 1) * 36
    nibbles = w_nibbles + at
    return (tl.load(nibbles, eviction_policy=EVICT), tl.load(nibbles + 4, eviction_policy=EVICT),
            tl.load(w_hdr + at, eviction_policy=EVICT))


@triton.jit
def _word(words, word, i: tl.constexpr):
    """Word i of each thread's 4 words [BLOCK_N, P, 4] -> [BLOCK_N, P] (in the thread)."""
    return tl.sum(tl.where(word == i, words, 0), 2)


@triton.jit
def _sub_block(dots, scale, min_, xd, xs):
    """A sub-block's share, dx (d sc sum(q x) - dmin m sum(x)), as `gguf_format` orders it."""
    return xd * (scale * dots.to(tl.float32) - min_ * xs.to(tl.float32))


@triton.jit
def _q4k_step(acc, lo_words, hi_words, hdr, s0, s_stop, x_pairs, xd_pairs, xs_pairs, pairs,
              word, RAGGED: tl.constexpr):
    """acc [BLOCK_N, P] + the step's super-blocks s0 .. (`_q4k_load`'s words): pair p's two
    sub-blocks 2 (p % 4), + 1 of super-block s0 + p // 4, whose codes (x_pairs: pair p's 16
    words in super-block 0 from word 0, 4 a thread, [BLOCK_N, P, 4]), activation scales and
    sums (xd_pairs, xs_pairs: its two blocks, [BLOCK_N, P, 2]) are loaded at the tile's
    shape (each row's the same, from L1) so that they come in the words' layout. RAGGED: the
    step may reach past s_stop - 1 (the loads repeat that block there): those pairs are
    left out of acc."""
    at = s0  # the step's first super-block; each pair's, past s_stop - 1, its last
    if RAGGED:
        at = tl.minimum(s0 + pairs // 4, s_stop - 1) - pairs // 4
    xq_at = x_pairs + 64 * at
    x0 = tl.load(xq_at)
    x1 = tl.load(xq_at + 4)
    x2 = tl.load(xq_at + 8)
    x3 = tl.load(xq_at + 12)
    xd_lo, xd_hi = tl.split(tl.load(xd_pairs + 8 * at))
    xs_lo, xs_hi = tl.split(tl.load(xs_pairs + 8 * at))
    w0 = _word(hdr, word, 0)
    s_0 = _word(hdr, word, 1)
    s_1 = _word(hdr, word, 2)
    s_2 = _word(hdr, word, 3)
    sub = 2 * tl.sum(pairs % 4, 2)
    sc_lo, mn_lo = scale_min(w0, s_0, s_1, s_2, sub)
    sc_hi, mn_hi = scale_min(w0, s_0, s_1, s_2, sub + 1)
    dots_lo = tl.sum(_dp4a(hi_words & 0x0F0F0F0F, x1,
                           _dp4a(lo_words & 0x0F0F0F0F, x0, tl.zeros_like(x0), False),
                           False), 2)
    dots_hi16 = tl.sum(_dp4a(hi_words & -252645136, x3,
                             _dp4a(lo_words & -252645136, x2, tl.zeros_like(x2), False),
                             False), 2)
    total = (acc + _sub_block(dots_lo, sc_lo, mn_lo, xd_lo, xs_lo)
             + _sub_block(dots_hi16, sc_hi * 0.0625, mn_hi, xd_hi, xs_hi))
    if RAGGED:
        total = tl.where(tl.sum(s0 + pairs // 4, 2) < s_stop, total, acc)
    return total


@triton.jit
def _q4k_kernel(xq_ptr, xd_ptr, xs_ptr, w_ptr, bias_ptr, y_ptr, part_ptr, arrivals_ptr, N,
                blocks_per_row, blocks_per_split, row_words, HAS_BIAS: tl.constexpr,
                BLOCK_N: tl.constexpr, SB: tl.constexpr, SPLIT_K: tl.constexpr,
                EVICT: tl.constexpr):
    """y[n-tile] = x @ W[n-tile]^T (+ bias) for one quantized row (codes xq, scales xd, sums
    xs per 32 columns) and Q4_K blocks, program (n, s) over super-blocks s * blocks_per_split
    onwards, SB a step. A thread holds one (row, pair p) of the tile [rows, P = 4 SB pairs,
    4 words] twice (words 0-3, 4-7), and the pair's header: word i's low nibbles are
    columns 64 p + 4 i .. + 3 (sub-block 2 p % 8, activation block 2 p, codes word 16 p +
    i), its high ones those 32 columns on (2 p + 1; codes word 16 p + 8 + i). All of a
    step's tensors are in that one layout, so a sub-block is summed in its thread (dp4a
    into dp4a, then 3 adds) and its scale and min unpacked there: no shuffle, no shared
    memory. The high nibbles are multiplied in place (w & 0xF0F0F0F0 = 16 q, as unsigned
    bytes) and their scale taken / 16 (exact, a power of 2). No load is masked (a masked
    load zeroes its registers first): rows past N read row N - 1 (not stored), and blocks
    past the slice its last block (`_q4k_step` drops them); the last step, the only one
    that can reach past the slice, runs after the loop, which loads each next step's words
    one ahead."""
    P: tl.constexpr = SB * 4
    pdl.allow_dependents()
    pid_n, pid_k, offs_n, n_mask, s_start, s_stop = program_blocks(
        N, blocks_per_row, blocks_per_split, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1)[:, None, None]
    w_rows = (w_ptr.to(tl.pointer_type(tl.int32))
              + rows.to(tl.int64) * tl.multiple_of(row_words, 4))
    pairs = 0 * rows + tl.arange(0, P)[None, :, None]
    word = tl.arange(0, 4)[None, None, :]
    # codes, activation scales and sums at the tile's shape, each row's the same
    x_pairs = xq_ptr.to(tl.pointer_type(tl.int32)) + 16 * pairs + word
    x_blocks = 2 * pairs + tl.arange(0, 2)[None, None, :]  # each pair's two
    acc = tl.zeros((BLOCK_N, P), tl.float32)
    w_hdr = w_rows + word
    w_nibbles = w_hdr + 4 + 8 * (pairs % 4)
    lo_words, hi_words, hdr = _q4k_load(w_hdr, w_nibbles, s_start, s_stop, pairs, EVICT)
    pdl.wait_for_previous()  # the codes are the previous kernel's output; the weights are not
    for s0 in range(s_start, s_stop - SB, SB):
        next_lo, next_hi, next_hdr = _q4k_load(w_hdr, w_nibbles, s0 + SB, s_stop, pairs, EVICT)
        acc = _q4k_step(acc, lo_words, hi_words, hdr, s0, s_stop, x_pairs, xd_ptr + x_blocks,
                        xs_ptr + x_blocks, pairs, word, False)
        lo_words, hi_words, hdr = next_lo, next_hi, next_hdr
    last = s_start + (s_stop - 1 - s_start) // SB * SB
    acc = _q4k_step(acc, lo_words, hi_words, hdr, last, s_stop, x_pairs, xd_ptr + x_blocks,
                    xs_ptr + x_blocks, pairs, word, True)
    finish_row(tl.sum(acc, 1), bias_ptr, y_ptr, part_ptr, arrivals_ptr, offs_n, n_mask, pid_n,
               pid_k, N, HAS_BIAS, SPLIT_K)


@triton.jit
def _funnel(lo, hi, n):
    """The word at byte n // 8 (n 0 or 16) of the 8 bytes lo, hi (little-endian): one
    funnel shift (shf.r.wrap), where the interpreter selects the halves."""
    if _PTX:
        return tl.inline_asm_elementwise("shf.r.wrap.b32 $0, $1, $2, $3;", "=r,r,r,r",
                                         [lo, hi, n], dtype=tl.int32, is_pure=True, pack=1)
    else:
        return tl.where(n == 0, lo, ((lo >> 16) & 0xFFFF) | (hi << 16))


@triton.jit
def _run(words, EVICT: tl.constexpr):
    """The 5 words from `words` on (int32 pointers [BLOCK_N, U]): 16 bytes that start 0 or
    2 bytes past the first, put together by `_unaligned`."""
    return (tl.load(words, eviction_policy=EVICT), tl.load(words + 1, eviction_policy=EVICT),
            tl.load(words + 2, eviction_policy=EVICT), tl.load(words + 3, eviction_policy=EVICT),
            tl.load(words + 4, eviction_policy=EVICT))


@triton.jit
def _unaligned(run, n):
    """A `_run`'s 16 bytes from bit n of its first word on, as 4 words."""
    return (_funnel(run[0], run[1], n), _funnel(run[1], run[2], n),
            _funnel(run[2], run[3], n), _funnel(run[3], run[4], n))


@triton.jit
def _q6k_load(w_rows, s0, s_stop, units, EVICT: tl.constexpr):
    """Q6_K super-blocks s0 .. s0 + U // 4 of rows w_rows [BLOCK_N, 1] (byte pointers; a
    block is 210 bytes, so 2-byte aligned) by unit u [1, U] (`_q6k_kernel`; none past
    s_stop - 1: `_q6k_step` drops what it repeats): (the bit n of the first word its bytes
    start at (0 or 16), the `_run`s of its low-nibble bytes of quarters 0 and 2, of quarters
    1 and 3 and of its high bits; its int8 scales of quarters 0-3; d). Aligned word loads,
    unmasked (a masked load zeroes its registers first), put together after the next
    iteration's wait (`_unaligned`), not here, so that they stay in flight. Every word read
    lies in the block or, for a block 2 bytes past a word, starts 2 bytes before it (inside
    the allocation: allocations are word aligned); a run's fifth word ends at byte 196 of
    the block at most, d (bytes 208-209) is read as a halfword."""
    block = w_rows + tl.minimum(s0 + units // 4, s_stop - 1) * 210
    off = (block.to(tl.int64) & 3).to(tl.int32)
    words = (block - off).to(tl.pointer_type(tl.int32))
    h = (units // 2) % 2
    j = units % 2
    low = words + 16 * h + 4 * j
    scales = (block + 192 + 8 * h + j).to(tl.pointer_type(tl.int8))
    return (8 * off, _run(low, EVICT), _run(low + 8, EVICT),
            _run(words + 32 + 8 * h + 4 * j, EVICT),
            (tl.load(scales, eviction_policy=EVICT), tl.load(scales + 2, eviction_policy=EVICT),
             tl.load(scales + 4, eviction_policy=EVICT),
             tl.load(scales + 6, eviction_policy=EVICT)),
            tl.load((block + 208).to(tl.pointer_type(tl.float16)), eviction_policy=EVICT))


@triton.jit
def _q6k_quarter(acc, low, high, sc, d, xq, xd, word, QQ: tl.constexpr):
    """acc [BLOCK_N, U] + quarter QQ of each unit's 16 columns: its low bits nibble QQ // 2
    of the 4 words `low`, its high bits 2 QQ, 2 QQ + 1 of `high`, its int8 scale sc, xq
    [BLOCK_N, U, 4] its codes' words, xd its activation block's scale; q - 32 summed as
    dp4a(q, x) + dp4a(-32 in every byte, x), all 8 into one int32."""
    dots = tl.zeros_like(acc).to(tl.int32)
    for i in tl.static_range(4):
        q = (((low[i] >> (4 * (QQ // 2))) & 0x0F0F0F0F)
             | (((high[i] >> (2 * QQ)) & 0x03030303) << 4))
        x = _word(xq, word, i)
        # -32 in every byte is 0xE0
        dots = _dp4a(q, x, _dp4a(tl.full(q.shape, -522133280, tl.int32), x, dots, True), False)
    return acc + xd * ((d.to(tl.float32) * sc.to(tl.float32)) * dots.to(tl.float32))


@triton.jit
def _q6k_step(acc, loaded, s0, s_stop, xq_ptr, xd_ptr, units, word, RAGGED: tl.constexpr):
    """acc [BLOCK_N, U] + the step's super-blocks s0 .. (`_q6k_load`'s `loaded`), whose codes
    and activation scales are loaded at [BLOCK_N, U, 4] (each row's the same, from L1: in
    the words' layout). RAGGED: as `_q4k_step`'s."""
    n, low02, low13, high, sc, d = loaded
    low02 = _unaligned(low02, n)
    low13 = _unaligned(low13, n)
    high = _unaligned(high, n)
    s = s0 + units // 4
    if RAGGED:
        s = tl.minimum(s, s_stop - 1)
    h = (units // 2) % 2
    x_block = (8 * s + 4 * h)[:, :, None]  # quarter 0's activation block
    xq_at = (xq_ptr.to(tl.pointer_type(tl.int32)) + 8 * x_block + 4 * (units % 2)[:, :, None]
             + word)
    # the 4 quarters' activation scales, as int32 (their words are picked by integer sums)
    xd = tl.load(xd_ptr + x_block + word).to(tl.int32, bitcast=True)
    total = acc
    for qq in tl.static_range(4):
        total = _q6k_quarter(total, low02 if qq % 2 == 0 else low13, high, sc[qq], d,
                             tl.load(xq_at + 8 * qq),
                             _word(xd, word, qq).to(tl.float32, bitcast=True), word, qq)
    if RAGGED:
        total = tl.where(s0 + units // 4 < s_stop, total, acc)
    return total


@triton.jit
def _q6k_kernel(xq_ptr, xd_ptr, xs_ptr, w_ptr, bias_ptr, y_ptr, part_ptr, arrivals_ptr, N,
                blocks_per_row, blocks_per_split, row_halves, HAS_BIAS: tl.constexpr,
                BLOCK_N: tl.constexpr, SB: tl.constexpr, SPLIT_K: tl.constexpr,
                EVICT: tl.constexpr):
    """`_q4k_kernel` for Q6_K (xs unused): in each half h of 128 columns, quarter qq's column
    l (0-31) has its low bits in nibble qq // 2 of byte 32 (qq % 2) + l of the half's 64
    and its high bits at bits 2 qq, 2 qq + 1 of byte l of the half's 32 high bytes; its
    scale is int8 8 h + 2 qq + l // 16, times d. A unit u is half h = u // 2 % 2 of
    super-block u // 4, l = 16 j .. 16 j + 15 (j = u % 2) of all four quarters: a thread
    holds one (row, unit), [rows, U = 4 SB units], its 12 words of 6-bit codes loaded as 3
    runs of aligned words (the block is only 2-byte aligned) and shifted into place; word w
    of quarter qq is columns 128 h + 32 qq + 16 j + 4 w .. + 3, codes word 32 h + 8 qq +
    4 j + w of the super-block's 64, activation block 4 h + qq. Rows past N read row
    N - 1, blocks past the slice its last (dropped), as `_q4k_kernel`'s."""
    U: tl.constexpr = SB * 4
    pdl.allow_dependents()
    pid_n, pid_k, offs_n, n_mask, s_start, s_stop = program_blocks(
        N, blocks_per_row, blocks_per_split, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1)[:, None]
    w_rows = w_ptr + rows.to(tl.int64) * (2 * row_halves)
    units = 0 * rows + tl.arange(0, U)[None, :]
    word = tl.arange(0, 4)[None, None, :]
    acc = tl.zeros((BLOCK_N, U), tl.float32)
    loaded = _q6k_load(w_rows, s_start, s_stop, units, EVICT)
    pdl.wait_for_previous()  # the codes are the previous kernel's output; the weights are not
    for s0 in range(s_start, s_stop - SB, SB):
        next_loaded = _q6k_load(w_rows, s0 + SB, s_stop, units, EVICT)
        acc = _q6k_step(acc, loaded, s0, s_stop, xq_ptr, xd_ptr, units, word, False)
        loaded = next_loaded
    last = s_start + (s_stop - 1 - s_start) // SB * SB
    acc = _q6k_step(acc, loaded, last, s_stop, xq_ptr, xd_ptr, units, word, True)
    finish_row(tl.sum(acc, 1), bias_ptr, y_ptr, part_ptr, arrivals_ptr, offs_n, n_mask, pid_n,
               pid_k, N, HAS_BIAS, SPLIT_K)


def quantize(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """x [1, K] (K a multiple of 32, contiguous) -> (int8 codes [K], float32 scales
    [K / 32], int32 sums of each block's codes [K / 32]): code = rint(x / d), d = amax / 127
    of its 32 columns, both one float32 division (IEEE, round to nearest even); d = 0 and
    codes 0 where a block is all zeros. One launch, no host sync."""
    k = x.shape[1]
    assert k % QBLOCK == 0 and x.stride(-1) == 1
    n_blocks = k // QBLOCK
    codes = torch.empty(k, dtype=torch.int8, device=x.device)
    scales = torch.empty(n_blocks, dtype=torch.float32, device=x.device)
    sums = torch.empty(n_blocks, dtype=torch.int32, device=x.device)
    _quantize_kernel[(triton.cdiv(n_blocks, QUANT_BLOCKS),)](
        x, codes, scales, sums, n_blocks, BLOCKS=QUANT_BLOCKS, num_warps=4,
        **pdl.launch_options())
    return codes, scales, sums


def takes(x: Tensor, qtype: int, blocks: Tensor) -> bool:
    """Whether `gemv` takes x [M, K] against GGUF blocks of `qtype`: one contiguous
    bfloat16 or float16 row, Q4_K or Q6_K, rows starting where the loads need them (16
    bytes for Q4_K's words, 2 for Q6_K's halfwords)."""
    align = 16 if qtype == WeightFormat.GGUF_Q4_K else 2
    return (x.shape[0] == 1 and x.shape[1] > 0 and x.stride(-1) == 1 and x.dtype in DTYPES
            and qtype in TYPES and blocks.stride(-1) == 1 and blocks.stride(0) % align == 0
            and blocks.data_ptr() % align == 0)


def gemv(x: Tensor, blocks: Tensor, qtype: int, bias: Tensor | None = None,
         out: Tensor | None = None, cfg: WeightOnlyConfig | None = None) -> Tensor:
    """x [1, K] @ the weight in GGUF blocks (uint8 [N, row bytes], a `GgufWeight`'s)^T
    (+ bias) -> [1, N] in x's dtype, into `out` [1, N] when given, with x quantized to int8
    (`quantize`): two launches, no host sync. cfg: the tiles (default `Q4_K_ONE_ROW`,
    `Q6_K_ONE_ROW`)."""
    assert takes(x, qtype, blocks)
    n, k = blocks.shape[0], x.shape[1]
    weights, size = BLOCKS[qtype]
    assert blocks.shape[1] == k // weights * size
    y = torch.empty((1, n), dtype=x.dtype, device=x.device) if out is None else out
    assert y.shape == (1, n) and y.stride(-1) == 1
    q4_k = qtype == WeightFormat.GGUF_Q4_K
    cfg, splits, per_split = tiles(n, k, num_sms(x.device),
                                   cfg or (Q4_K_ONE_ROW if q4_k else Q6_K_ONE_ROW))
    codes, scales, sums = quantize(x)
    n_tiles = triton.cdiv(n, cfg.block_n)
    parts, arrivals = split_buffers(splits, n, n_tiles, y)
    kernel, unit = (_q4k_kernel, 4) if q4_k else (_q6k_kernel, 2)
    kernel[(n_tiles, splits)](
        codes, scales, sums, blocks, y if bias is None else bias, y, parts, arrivals, n,
        k // weights, per_split, blocks.stride(0) // unit, HAS_BIAS=bias is not None,
        BLOCK_N=cfg.block_n, SB=cfg.block_k // 256, SPLIT_K=splits,
        EVICT="evict_first" if cfg.evict_first else "", num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **pdl.launch_options())
    return y
