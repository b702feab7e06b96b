"""`gguf_tile`: a tile of a weight in GGUF blocks as the file stores them (Q4_0, Q4_1, Q8_0,
Q4_K, Q5_K, Q6_K), unpacked in registers: `dequant.dequant_tile`'s branch for the GGUF formats
(`kernels/gguf_format.py` has the layout and the torch reference), so the GEMV and the GEMM of
`int_linear.py` run on GGUF weights too.

Each weight (row, k) is computed from its block's bytes the way the `gguf` package's
`dequantize` computes it (the same products in the same order, so the interpreter's values
equal the package's bit for bit; compiled for the GPU, a product and a sum may fuse into one
rounding). Bytes are read one by one (GGUF blocks are 18 to 210 bytes, so nothing is
aligned) and the float16 scales put together from two.
"""

from __future__ import annotations

import triton
import triton.language as tl


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
def gguf_tile(data_ptr, data_stride, offs_n, n_mask, k0, K, QTYPE: tl.constexpr,
              BLOCK_K: tl.constexpr):
    """Rows offs_n [BLOCK_N] of the blocks at data_ptr (uint8, rows data_stride bytes apart),
    columns k0 + arange(BLOCK_K) -> float32 [BLOCK_N, BLOCK_K]; zeros past K."""
    k = k0 + tl.arange(0, BLOCK_K)
    rows = data_ptr + offs_n.to(tl.int64)[:, None] * data_stride
    return _decode(rows, k[None, :], n_mask[:, None] & (k < K)[None, :], QTYPE)
