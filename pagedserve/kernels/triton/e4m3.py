"""e4m3 to a 16-bit float in registers, for kernels that read FP8 (weights, a KV cache), and
float32 rounded to e4m3 values (`round_to_e4m3`) for those that write it.

Triton's cast of e4m3 to bfloat16 goes e4m3 -> float16 (one packed conversion per two
values) and then float16 -> bfloat16 one value at a time, on the SM's conversion unit, which
retires a small fraction of what its integer and float pipes do: at the byte rate of an FP8
stream those conversions, not memory, can set the pace. `e4m3_bits` builds the same values
from integer ops and one multiply by a power of two instead (sm_90 SASS of the weight-only
kernel: 128 F2F per thread per tile become PRMT/LOP3/HFMA2):

e4m3fn is sign, 4 exponent bits (bias 7), 3 mantissa bits. Moving the exponent and mantissa
bits to the bottom of a bfloat16's (8 exponent bits, bias 127, 7 mantissa bits) gives the
value 2^(e - 127) (1 + m/8), i.e. the e4m3 value times 2^-120, and for e = 0 the subnormal
m/8 2^-126, again the e4m3 value (m/8 2^-6) times 2^-120: one multiply by 2^120 makes both
exact. Likewise float16 (5 exponent bits, bias 15, 10 mantissa bits) with 2^8. The NaN
encoding (all exponent and mantissa bits set) reads as 480, not NaN; a cache or weight holds
NaN only where the model already produced NaN.

On a GPU four values go through one inline-PTX block (two byte permutes put each byte in the
high half of a 16-bit lane, a shift and mask place its bits, a packed multiply rebiases);
the interpreter, which runs no PTX, does the same in float32.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

_INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")

# prmt selectors: bytes 0, 1 (resp. 2, 3) of the input into the high byte of each 16-bit half
_SPREAD = """prmt.b32 lo, $2, 0, 0x1404;
    prmt.b32 hi, $2, 0, 0x3424;
"""
_PLACE = """and.b32 s0, lo, 0x80008000;
    and.b32 s1, hi, 0x80008000;
    shr.b32 lo, lo, {shift};
    shr.b32 hi, hi, {shift};
    and.b32 lo, lo, {mask};
    and.b32 hi, hi, {mask};
    or.b32 lo, lo, s0;
    or.b32 hi, hi, s1;
    mov.b32 s0, {bias};
    mov.b32 s1, 0x80008000;
    fma.rn.{ty}x2 $0, lo, s0, s1;
    fma.rn.{ty}x2 $1, hi, s0, s1;
"""


def _asm(ty: str, shift: int, mask: int, bias: int) -> str:
    place = _PLACE.format(shift=shift, mask=f"0x{mask:04X}{mask:04X}", ty=ty,
                          bias=f"0x{bias:04X}{bias:04X}")
    return "{\n    .reg .b32 lo, hi, s0, s1;\n    " + _SPREAD + "    " + place + "}"


# bfloat16: (b & 0x7F) << 4 is (b << 8) >> 4 masked; 2^120 is 0x7B80
_BF16_ASM = tl.constexpr(_asm("bf16", 4, 0x07F0, 0x7B80))
# float16: (b & 0x7F) << 7 is (b << 8) >> 1 masked; 2^8 is 0x5C00
_F16_ASM = tl.constexpr(_asm("f16", 1, 0x3F80, 0x5C00))


@triton.jit
def _e4m3_bits_f32(x, dtype: tl.constexpr):
    """The bit moves into a float32 (exponent bias 127, like bfloat16's), times 2^120, then
    rounded (exactly) to `dtype`: the interpreter's `e4m3_bits`, and float32 reads."""
    b = x.to(tl.uint8, bitcast=True).to(tl.uint32)
    bits = ((b & 0x7F) << 20) | ((b & 0x80) << 24)
    return (bits.to(tl.float32, bitcast=True) * 1.329227995784916e36).to(dtype)


@triton.jit
def e4m3_bits(x, dtype: tl.constexpr, AS_LOADED: tl.constexpr = False):
    """e4m3 values x as `dtype` (bfloat16 or float16), exactly, by bit moves.

    AS_LOADED: convert in the layout x was loaded in (16 bytes a thread), not in the layout
    of the tl.dot operand it feeds. Triton moves a pure elementwise op past the layout
    conversion to a dot operand, which keeps shared memory in e4m3; but where the operand
    wants the loaded rows transposed (P @ V's V: rows of V are contiguous in the head dim,
    the product runs over tokens) it then gathers single bytes from shared memory (one load
    per value) and packs them before converting. Marked impure, the conversion stays where
    it is written, and the 16-bit result reaches the operand through shared memory with
    Triton's transposing matrix loads, as a bf16 cache's rows do."""
    if _INTERPRET:
        y = _e4m3_bits_f32(x, dtype)
    elif dtype == tl.float16:
        y = tl.inline_asm_elementwise(_F16_ASM, "=r,=r,r", [x.to(tl.uint8, bitcast=True)],
                                      dtype=tl.float16, is_pure=not AS_LOADED, pack=4)
    else:
        y = tl.inline_asm_elementwise(_BF16_ASM, "=r,=r,r", [x.to(tl.uint8, bitcast=True)],
                                      dtype=tl.bfloat16, is_pure=not AS_LOADED, pack=4)
    return y


# float32 bits of an e4m3 byte moved to bits 20-27: its sign (bit 31), exponent and mantissa
E4M3_F32_BITS = tl.constexpr(-0x78100000)  # 0x87F00000 as int32
# what `e4m3_word_f32` leaves out: its values times this are the e4m3 values
E4M3_WORD_F32_UNSCALE = tl.constexpr(2.0**120)


@triton.jit
def e4m3_word_f32(w, j: tl.constexpr):
    """Byte j of int32 words w holding four e4m3 values (byte 0 the first in memory) as
    float32 times 2^-120, exactly, in at most three integer ops: shifted to the top byte,
    shifted down 4 arithmetically (the sign copied into bits 28-30, which the mask clears),
    masked. As `_e4m3_bits_f32` but without its multiply by 2^120, which the caller applies
    once to a sum of products (`E4M3_WORD_F32_UNSCALE`); subnormal e4m3 values become
    subnormal float32 ones, which Triton's float32 FMAs keep (no flush to zero).

    Why words: Triton keeps an e4m3 tensor as single bytes, so converting it (by cast or
    inline PTX) first unpacks and repacks the bytes the load brought in as words."""
    return (((w << (24 - 8 * j)) >> 4) & E4M3_F32_BITS).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_to(x, dtype: tl.constexpr, BITS: tl.constexpr, AS_LOADED: tl.constexpr = False):
    """x (e4m3) as `dtype`: where BITS by bit moves (`e4m3_bits` for a 16-bit float,
    AS_LOADED passed on; the same into float32), else Triton's cast."""
    if BITS and dtype == tl.float32:
        y = _e4m3_bits_f32(x, dtype)
    elif BITS and (dtype == tl.bfloat16 or dtype == tl.float16):
        y = e4m3_bits(x, dtype, AS_LOADED)
    else:
        y = x.to(dtype)
    return y


@triton.jit
def round_to_e4m3(x):
    """float32 x with |x| <= 448 rounded to the nearest e4m3 value (ties to even), still in
    float32, so that the cast that follows is exact. Why not the cast alone: the Triton
    interpreter's float32 -> e4m3 cast rounds ties up and drops the carry of a rounded-up
    mantissa (126.7 became 64), and rounding here makes every backend agree bit for bit
    with torch. Normal values keep 3 of float32's 23 mantissa bits (carries move into the
    exponent); below e4m3's smallest normal, 2^-6, magnitudes round to multiples of 2^-9 by an
    add whose float32 spacing is 2^-9."""
    bits = x.to(tl.uint32, bitcast=True)
    normal = (bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000
    magnitude = tl.abs(x)
    subnormal = ((magnitude + 24576.0) - 24576.0).to(tl.uint32, bitcast=True)
    subnormal = subnormal | (bits & 0x80000000)  # the sign, -0.0 included
    return tl.where(magnitude < 0.015625, subnormal, normal).to(tl.float32, bitcast=True)
