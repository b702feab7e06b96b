"""Precision helpers the Triton kernels share: the `tl.dot` precision for an input dtype, and
rounding an intermediate float32 value to the activation dtype where eager PyTorch would.

Triton runs a float32 `tl.dot` on TF32 tensor cores by default (10-bit mantissa inputs):
fast, but a float32 model then no longer matches transformers' float32 greedy tokens, which
is why someone picks float32 in the first place. So float32 inputs ask for IEEE products;
half-precision inputs are unaffected (the option only concerns float32 operands).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def dot_precision(dtype: torch.dtype) -> str:
    """The `input_precision` for `tl.dot` on operands of `dtype`."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """float32 `x` rounded to `dtype` (to nearest, ties to even) and back to float32: where
    eager PyTorch stores an intermediate tensor in the activation dtype, so a fused kernel
    rounds at the same points as transformers.

    bf16 is rounded on the bits: the compiler folds `x.to(bf16).to(float32)` into `x` (the
    compiled rotary kernel had no conversion left in it, and many of its outputs were
    one step off eager PyTorch's), while integer ops on the bits are left alone. The
    interpreter also truncates where the GPU rounds; the bits round the same on both. Other
    dtypes keep the casts (float16 may then skip the rounding); float32 is a no-op."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    elif dtype == tl.float32:
        return x
    else:
        return x.to(dtype).to(tl.float32)
