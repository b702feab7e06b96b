"""The e4m3 format the FP8 paths share (the KV cache, FP8 weights and their kernels): the
dtype, its largest finite value and the floor of a scale's absolute maximum. Here, at the
bottom of the tree, so the kernels read it without importing the layers that use them."""

from __future__ import annotations

import torch
from torch import Tensor

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
MIN_AMAX = 1e-12  # the floor of an absolute maximum that sets a scale: zeros get a finite one


def is_fp8(cache: Tensor) -> bool:
    return cache.dtype == FP8_DTYPE
