"""Triton kernels of FP8 linear layers (`model.fp8`); imported on CUDA only (or under
TRITON_INTERPRET=1 in tests).

`quantize_tokens`: activations to e4m3, one scale per token, in one launch where eager
PyTorch needs five (abs, amax, divide, clamp, cast), ahead of `torch._scaled_mm`.

`weight_only_linear`: the decode steps' few tokens. There `_scaled_mm` does not stream the
weights at memory bandwidth and the activations' quantization is one launch more per layer,
while the step's time should be the weights' bytes over bandwidth. So the e4m3 weight is cast
in registers and multiplied with the activations as they are (no activation rounding either).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from pagedserve.attention.kernels.precision import dot_precision
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


@triton.jit
def _weight_only_kernel(x_ptr, w_ptr, w_scale_ptr, bias_ptr, y_ptr, M, N, K,
                        stride_xm, stride_wn, stride_ym, HAS_BIAS: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        DOT_PRECISION: tl.constexpr):
    """y[:, n-tile] = (x @ W_q[n-tile]^T) * s_w[n-tile] (+ bias): the e4m3 weight rows are
    cast to x's dtype in registers, the M rows of x (padded to BLOCK_M) ride along."""
    pid_n = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn  # W^T's columns: W's rows
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + offs_k) < K
        x = tl.load(x_rows + (k0 + offs_k)[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0)
        w = tl.load(w_cols + (k0 + offs_k)[:, None], mask=k_mask[:, None] & n_mask[None, :],
                    other=0.0).to(x.dtype)
        acc += tl.dot(x, w, input_precision=DOT_PRECISION)
    acc *= tl.load(w_scale_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@dataclass(frozen=True)
class WeightOnlyConfig:
    """Tiles of `weight_only_linear`. BLOCK_N is small so that even a 4096-row projection
    spreads over a couple of programs per SM; BLOCK_K long so that each program keeps many
    weight bytes in flight (a decode step's linear layers are bound by reading weights).
    32 rather than 16 rows per program: the H100 sweep of `benchmarks/fp8.py --parts gemv
    --sweep` (docs/benchmarks.md) had 16-row tiles no faster than bf16."""

    block_n: int = 32
    block_k: int = 512
    num_warps: int = 4
    num_stages: int = 4


# Token counts up to which `fp8.fp8_linear` takes `weight_only_linear` (tl.dot's 16 rows)
MAX_WEIGHT_ONLY_ROWS = 16


def weight_only_linear(x: Tensor, weight: Tensor, weight_scale: Tensor,
                       bias: Tensor | None = None,
                       cfg: WeightOnlyConfig = WeightOnlyConfig()) -> Tensor:
    """x [M <= 16, K] (rows contiguous) @ the e4m3 weight [N, K] with per-row scales [N]^T
    (+ bias) -> [M, N] in x's dtype, without quantizing x: one launch, no host sync (CUDA
    graphs capture it)."""
    num_rows, k = x.shape
    n = weight.shape[0]
    assert num_rows <= MAX_WEIGHT_ONLY_ROWS and x.stride(-1) == 1 and weight.stride(-1) == 1
    y = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    if num_rows > 0:
        _weight_only_kernel[(triton.cdiv(n, cfg.block_n),)](
            x, weight, weight_scale, weight_scale if bias is None else bias, y, num_rows, n,
            k, x.stride(0), weight.stride(0), y.stride(0), HAS_BIAS=bias is not None,
            BLOCK_M=MAX_WEIGHT_ONLY_ROWS, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            DOT_PRECISION=dot_precision(x.dtype), num_warps=cfg.num_warps,
            num_stages=cfg.num_stages)
    return y
