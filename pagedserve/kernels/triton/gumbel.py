"""What the two sampling kernels (`sampling`, `filtered_sampling`) share, so that a row draws
the same token whichever serves it: counter-based Philox noise turned into base-2 Gumbel
noise (a pure function of seed, stream and token id), torch.argmax's order over candidates,
and whether the kernels run under the interpreter (no libdevice there)."""

from __future__ import annotations

import os

import triton
import triton.language as tl
from triton.language.extra import libdevice

LOG2E = tl.constexpr(1.4426950408889634)
FLOAT32_MAX = tl.constexpr(3.4028234663852886e38)
TOKEN_SENTINEL = tl.constexpr(2**31 - 1)  # above every token id: never a real row's minimum


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")


@triton.jit
def log2(x, FAST: tl.constexpr):
    """log2; on the GPU the one-instruction approximation (2^-22 relative error), which is
    all the noise needs, the interpreter has no libdevice."""
    if FAST:
        return libdevice.fast_log2f(x)
    else:
        return tl.log2(x)


@triton.jit
def gumbel2(seed, stream_lo, stream_hi, groups, ROUNDS: tl.constexpr, FAST: tl.constexpr):
    """Gumbel noise in base 2, -log2(log2(e) * E) with E ~ Exp(1), [GROUPS, 4] for tokens
    groups * 4 + lane; log2(e) times a natural Gumbel draw less a constant.

    V is the top 23 bits of a Philox output centred in its bin, exact in float32 and strictly
    inside (0, 1), and E = -ln(1 - V), so every log stays finite. The largest noise comes
    from the smallest E, where 1 - V is within 2^-7 of 1 and the fast log2 (absolute error
    2^-22 there) could even flip the sign: that range takes the series V + V^2/2 + V^3/3,
    exact to float32."""
    zero = groups * 0
    r0, r1, r2, r3 = tl.philox(seed, groups, zero + stream_lo, zero + stream_hi, zero, ROUNDS)
    lane = tl.arange(0, 4)[None, :]
    bits = tl.where(lane == 0, r0[:, None],
                    tl.where(lane == 1, r1[:, None], tl.where(lane == 2, r2[:, None], r3[:, None])))
    return bits_to_gumbel2(bits, FAST)


@triton.jit
def token_gumbel2(seed, stream_lo, stream_hi, tokens, ROUNDS: tl.constexpr,
                  FAST: tl.constexpr):
    """`gumbel2`'s noise for arbitrary token ids (any shape): one Philox call per token,
    for rows whose candidates are scattered over the vocabulary."""
    groups = (tokens // 4).to(tl.uint32)
    zero = groups * 0
    r0, r1, r2, r3 = tl.philox(seed, groups, zero + stream_lo, zero + stream_hi, zero, ROUNDS)
    lane = tokens % 4
    bits = tl.where(lane == 0, r0, tl.where(lane == 1, r1, tl.where(lane == 2, r2, r3)))
    return bits_to_gumbel2(bits, FAST)


@triton.jit
def bits_to_gumbel2(bits, FAST: tl.constexpr):
    """Base-2 Gumbel noise from one 32-bit Philox output (see `gumbel2`)."""
    v = ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
    series = v * (1.0 + v * (0.5 + v * (1.0 / 3.0))) * LOG2E
    exponential2 = tl.where(v < 1.0 / 128.0, series, -log2(1.0 - v, FAST))
    return -log2(exponential2, FAST)


@triton.jit
def best_of(scores, tokens):
    """(max score, lowest token id holding it) of a block of candidates."""
    best = tl.max(scores)
    return best, tl.min(tl.where(scores == best, tokens, TOKEN_SENTINEL))
