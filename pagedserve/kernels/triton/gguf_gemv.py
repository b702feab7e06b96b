"""One row of activations (a batch-1 decode step) against a weight in GGUF K-quant blocks
(`kernels/gguf_format.py`: Q4_K, Q5_K), read as the file stores them: `gemv`, which
`int_linear.linear` takes for one row of those types.

Why its own kernel: a batch-1 step's time should be the packed bytes over memory bandwidth,
and `dequant.dequant_tile`'s description of the blocks, right for the GEMM's tiles, reads
every byte a weight needs one by one (its nibble, its super-block's two float16 scales
byte by byte, three bytes of 6-bit scales): about eight one-byte loads and their address
arithmetic per weight, in 16-row programs over all of K. Here:

- A K-quant super-block (144 or 176 bytes, multiples of 16) is read as int32 words, 16 bytes
  a load: its header (the two float16 scales and twelve bytes of 6-bit scales and mins) as
  one 4-word load, its nibbles as 8-word runs. The eight sub-block scales and mins are
  unpacked once per super-block and row, not per weight.
- The tile is [rows, pairs of sub-blocks, 8 words, 2 nibbles of a byte, 4 bytes of a word]:
  each thread splits the words it loaded in registers (a shift and a mask a weight; the
  float is made by OR-ing the exponent of 2^23 into the code and subtracting 2^23, exact,
  instead of a conversion), and the activations each weight multiplies are 4 consecutive
  columns (the 4 bytes of a word hold columns 4i..4i+3 of a 32-column sub-block).
- As `dense_gemv`: K is split into slices until the grid fills the GPU (`fp8_linear`'s tile
  rule), the last of an output tile's programs to arrive sums the partials
  (`arrivals.sum_slices`), the next tile's words are loaded one iteration ahead, the first
  before the PDL wait (`pdl`).

Each weight is the reference's (`gguf_format`): (d * scale) * q - dmin * min in float32 (on the
GPU the product and the difference may fuse), rounded to the activation dtype as
`int_linear`'s other kernels round it, times x in float32; only the order of the float32 sums
differs from them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from pagedserve.kernels.gguf_format import BLOCKS
from pagedserve.kernels.triton import pdl
from pagedserve.kernels.triton.arrivals import arrival_counters, sum_slices
from pagedserve.kernels.triton.fp8_linear import WeightOnlyConfig, num_sms, one_row_tiles
from pagedserve.kernels.triton.precision import round_to
from pagedserve.kernels.weight_formats import WeightFormat

# the GGML types `gemv` takes
TYPES = (int(WeightFormat.GGUF_Q4_K), int(WeightFormat.GGUF_Q5_K))

# Tiles: 16 rows of two super-blocks (512 columns, 4.5 KiB of Q4_K), narrowed to 4 rows of
# eight while a projection has too few rows to fill the SMs; `fp8_linear.one_row_tiles`
# splits K past that. block_k is a multiple of the 256-column super-block.
ONE_ROW = WeightOnlyConfig(block_n=16, block_k=512, num_warps=8, num_stages=1,
                           programs_per_sm=5, min_block_n=4, fma=True)

_Q5_K = tl.constexpr(int(WeightFormat.GGUF_Q5_K))


@triton.jit
def _f16_half(word, SHIFT: tl.constexpr):
    """The float16 in bits SHIFT..SHIFT+15 of int32 words, as float32."""
    return ((word >> SHIFT) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _sub_scales(hdr_ptr, mask):
    """A super-block's eight sub-block scales d * sc and mins dmin * m (float32, [..., 8]
    from header word pointers [...]): word 0 holds d and dmin, words 1-3 the 6-bit scales and
    mins (`gguf_dequant._k_scale_min`): sub-blocks 0-3 in the low 6 bits of bytes i (scale)
    and i + 4 (min); 4-7 in the nibbles of byte i + 8 with their top 2 bits in the top bits
    of bytes i and i + 4."""
    w0 = tl.load(hdr_ptr, mask=mask, other=0)
    s0 = tl.load(hdr_ptr + 1, mask=mask, other=0)[:, :, None]
    s1 = tl.load(hdr_ptr + 2, mask=mask, other=0)[:, :, None]
    s2 = tl.load(hdr_ptr + 3, mask=mask, other=0)[:, :, None]
    sh = tl.arange(0, 4) * 8
    sc_lo = (s0 >> sh) & 63
    mn_lo = (s1 >> sh) & 63
    sc_hi = ((s2 >> sh) & 15) | (((s0 >> (sh + 6)) & 3) << 4)
    mn_hi = ((s2 >> (sh + 4)) & 15) | (((s1 >> (sh + 6)) & 3) << 4)
    # [..., 4, 2] (i, half) -> [..., 8] sub-block 4 half + i
    sc = tl.reshape(tl.permute(tl.join(sc_lo, sc_hi), (0, 1, 3, 2)), (w0.shape[0], w0.shape[1], 8))
    mn = tl.reshape(tl.permute(tl.join(mn_lo, mn_hi), (0, 1, 3, 2)), (w0.shape[0], w0.shape[1], 8))
    d = _f16_half(w0, 0)[:, :, None]
    dmin = _f16_half(w0, 16)[:, :, None]
    return d * sc.to(tl.float32), dmin * mn.to(tl.float32)


@triton.jit
def _tile_dot(acc, words, high_words, scales, mins, x, pairs, DTYPE: tl.constexpr,
              QTYPE: tl.constexpr, BLOCK_N: tl.constexpr, P: tl.constexpr):
    """acc [BLOCK_N, P, 8, 2, 4] + the tile's weights times x [.., P, 8, 2, 4]: nibble
    (word i, half h, byte c) of pair p's 8 words is column 64 p + 32 h + 4 i + c of the
    super-block, of sub-block 2 p + h (scales, mins [BLOCK_N, P, 2]). Q5_K's fifth bit of
    column l = 4 i + c of sub-block s is bit s of byte l of the 32 high bytes (high_words
    [BLOCK_N, P, 8], word i: bit 8 c + s)."""
    half = tl.arange(0, 2)[None, None, None, :, None]
    byte = tl.arange(0, 4)[None, None, None, None, :]
    q = (words[:, :, :, None, None] >> (4 * half + 8 * byte)) & 15
    if QTYPE == _Q5_K:
        sub = 2 * (pairs % 4)[None, :, None, None, None] + half
        q |= ((high_words[:, :, :, None, None] >> (8 * byte + sub)) & 1) << 4
    f = (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    w = scales[:, :, None, :, None] * f - mins[:, :, None, :, None]
    return acc + round_to(w, DTYPE) * x


@triton.jit
def _load_tile(w_rows, n_mask, s0, s_stop, pairs, words_i, BLOCK_WORDS: tl.constexpr,
               QS: tl.constexpr, QH: tl.constexpr, QTYPE: tl.constexpr,
               BLOCK_N: tl.constexpr, SB: tl.constexpr, EVICT: tl.constexpr):
    """The words of super-blocks s0 .. s0 + SB (none at or past s_stop) of rows w_rows
    [BLOCK_N, 1] (int32 pointers): (the nibble words [BLOCK_N, P, 8], the fifth-bit words
    [BLOCK_N, P, 8] (Q5_K; else the nibble words again), header word pointers
    [BLOCK_N, SB] and their mask)."""
    s = s0 + pairs // 4  # each pair's super-block
    base = w_rows[:, :, None] + (s * BLOCK_WORDS)[None, :, None]
    mask = (n_mask[:, None] & (s < s_stop)[None, :])[:, :, None]
    words = tl.load(base + QS + 8 * (pairs % 4)[None, :, None] + words_i, mask=mask, other=0,
                    eviction_policy=EVICT)
    if QTYPE == _Q5_K:
        high = tl.load(base + QH + words_i, mask=mask, other=0, eviction_policy=EVICT)
    else:
        high = words
    blocks = s0 + tl.arange(0, SB)
    hdr = w_rows + (blocks * BLOCK_WORDS)[None, :]
    hdr_mask = n_mask[:, None] & (blocks < s_stop)[None, :]
    return words, high, hdr, hdr_mask


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, part_ptr, arrivals_ptr, N, blocks_per_row,
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
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    s_start = pid_k * blocks_per_split
    s_stop = tl.minimum(s_start + blocks_per_split, blocks_per_row)
    w_rows = (w_ptr.to(tl.pointer_type(tl.int32))
              + offs_n.to(tl.int64)[:, None] * tl.multiple_of(row_words, 4))
    pairs = tl.arange(0, P)
    words_i = tl.arange(0, 8)[None, None, :]
    # x's columns in the tile's shape: 64 p + 32 h + 4 i + c past the tile's first column
    cols = (64 * pairs[:, None, None, None] + 4 * tl.arange(0, 8)[None, :, None, None]
            + 32 * tl.arange(0, 2)[None, None, :, None] + tl.arange(0, 4)[None, None, None, :])
    x_cols = x_ptr + cols[None, :, :, :, :] + 0 * offs_n[:, None, None, None, None]
    acc = tl.zeros((BLOCK_N, P, 8, 2, 4), tl.float32)
    words, high, hdr, hdr_mask = _load_tile(w_rows, n_mask, s_start, s_stop, pairs, words_i,
                                            BLOCK_WORDS, QS, QH, QTYPE, BLOCK_N, SB, EVICT)
    pdl.wait_for_previous()  # x is the previous kernel's output; the weights are not
    for s0 in range(s_start, s_stop, SB):
        next_words, next_high, next_hdr, next_mask = _load_tile(
            w_rows, n_mask, s0 + SB, s_stop, pairs, words_i, BLOCK_WORDS, QS, QH, QTYPE,
            BLOCK_N, SB, EVICT)
        scales, mins = _sub_scales(hdr, hdr_mask)
        scales = tl.reshape(scales, (BLOCK_N, P, 2))
        mins = tl.reshape(mins, (BLOCK_N, P, 2))
        in_slice = (s0 + pairs // 4 < s_stop)[None, :, None, None, None]
        x = tl.load(x_cols + s0 * 256, mask=in_slice, other=0.0).to(tl.float32)
        acc = _tile_dot(acc, words, high, scales, mins, x, pairs, DTYPE, QTYPE, BLOCK_N, P)
        words, high, hdr, hdr_mask = next_words, next_high, next_hdr, next_mask
    total = tl.sum(tl.reshape(acc, (BLOCK_N, P * 64)), 1)
    if SPLIT_K == 1:
        _store(total, bias_ptr, y_ptr, offs_n, n_mask, HAS_BIAS)
    else:
        last, total = sum_slices(total, part_ptr, arrivals_ptr, offs_n, n_mask, pid_n, pid_k,
                                 N, SPLIT_K)
        if last:
            _store(total, bias_ptr, y_ptr, offs_n, n_mask, HAS_BIAS)


@triton.jit
def _store(acc, bias_ptr, y_ptr, offs_n, n_mask, HAS_BIAS: tl.constexpr):
    """y[offs_n] = acc (+ bias), rounded once to y's dtype."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_n, acc.to(y_ptr.dtype.element_ty), mask=n_mask)


def tiles(n: int, k: int, sms: int, cfg: WeightOnlyConfig) -> tuple[WeightOnlyConfig, int, int]:
    """(cfg narrowed to n, slices of K, super-blocks per slice): `fp8_linear.one_row_tiles`,
    whose K tiles are whole super-blocks here."""
    cfg, splits, k_per_split = one_row_tiles(n, k, sms, cfg)
    return cfg, splits, k_per_split // 256


def takes(x: Tensor, qtype: int, blocks: Tensor) -> bool:
    """Whether `gemv` takes x [M, K] against GGUF blocks of `qtype`: one contiguous row, a
    type it reads, and blocks whose rows start on 16 bytes (its word loads; a row of K-quant
    super-blocks is a multiple of 16 bytes, so only a view's offset can break that)."""
    return (x.shape[0] == 1 and x.stride(-1) == 1 and qtype in TYPES
            and blocks.stride(-1) == 1 and blocks.stride(0) % 16 == 0
            and blocks.data_ptr() % 16 == 0)


def gemv(x: Tensor, blocks: Tensor, qtype: int, bias: Tensor | None = None,
         out: Tensor | None = None, cfg: WeightOnlyConfig | None = None) -> Tensor:
    """x [1, K] (contiguous) @ the weight in GGUF blocks `blocks` (uint8 [N, row bytes], rows
    contiguous, a `GgufWeight`'s) ^T (+ bias) -> [1, N] in x's dtype: one launch, no host
    sync (CUDA graphs capture it, as `dense_gemv.gemv`)."""
    assert takes(x, qtype, blocks)
    n, k = blocks.shape[0], x.shape[1]
    weights, size = BLOCKS[qtype]
    assert blocks.shape[1] == k // weights * size
    y = torch.empty((1, n), dtype=x.dtype, device=x.device) if out is None else out
    assert y.shape == (1, n) and y.stride(-1) == 1
    cfg, splits, per_split = tiles(n, k, num_sms(x.device), cfg or ONE_ROW)
    n_tiles = triton.cdiv(n, cfg.block_n)
    if splits == 1:
        parts, arrivals = y, y
    else:
        parts = torch.empty((splits, n), dtype=torch.float32, device=x.device)
        arrivals = arrival_counters(n_tiles, x.device)
    bias_arg = y if bias is None else bias  # never read without HAS_BIAS
    _gemv_kernel[(n_tiles, splits)](
        x, blocks, bias_arg, y, parts, arrivals, n, k // weights, per_split,
        blocks.stride(0) // 4, HAS_BIAS=bias is not None, QTYPE=qtype, BLOCK_N=cfg.block_n,
        SB=cfg.block_k // 256, SPLIT_K=splits,
        EVICT="evict_first" if cfg.evict_first else "", num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **pdl.launch_options())
    return y

