"""The precision of the attention kernels' `tl.dot` for a given input dtype.

Triton runs a float32 `tl.dot` on TF32 tensor cores by default (10-bit mantissa inputs):
fast, but a float32 model then no longer matches transformers' float32 greedy tokens, which
is why someone picks float32 in the first place. So float32 inputs ask for IEEE products;
half-precision inputs are unaffected (the option only concerns float32 operands).
"""

from __future__ import annotations

import torch


def dot_precision(dtype: torch.dtype) -> str:
    """The `input_precision` for `tl.dot` on operands of `dtype`."""
    return "ieee" if dtype == torch.float32 else "tf32"
