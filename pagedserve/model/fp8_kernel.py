"""Triton quantization of activations to e4m3, one scale per token (`model.fp8`): one launch
where eager PyTorch needs five (abs, amax, divide, clamp, cast), in each FP8 linear layer of
every step. Imported on CUDA only (or under TRITON_INTERPRET=1 in tests)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from pagedserve.attention.kernels.store_kv import round_to_e4m3
from pagedserve.attention.kv_quant import FP8_DTYPE, FP8_MAX
from pagedserve.model.fp8 import MIN_AMAX

_FP8_MAX = tl.constexpr(FP8_MAX)
_MIN_AMAX = tl.constexpr(MIN_AMAX)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, stride_x, N: tl.constexpr,
                          BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0), _MIN_AMAX) / _FP8_MAX
    q = round_to_e4m3(tl.clamp(x / scale, -_FP8_MAX, _FP8_MAX))
    tl.store(q_ptr + row * N + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


def quantize_tokens(x: Tensor) -> tuple[Tensor, Tensor]:
    """`quantize_rows` of activations x [T, K] in one Triton launch (CUDA, or the CPU under
    TRITON_INTERPRET=1) -> (e4m3 [T, K], float32 scales [T, 1], as `_scaled_mm` takes them)."""
    assert x.stride(-1) == 1, "rows must be contiguous"
    num_rows, n = x.shape
    q = torch.empty((num_rows, n), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((num_rows, 1), dtype=torch.float32, device=x.device)
    if num_rows > 0:
        block = triton.next_power_of_2(n)
        _quantize_rows_kernel[(num_rows,)](x, q, scale, x.stride(0), N=n, BLOCK=block,
                                           num_warps=min(16, max(4, block // 1024)))
    return q, scale
