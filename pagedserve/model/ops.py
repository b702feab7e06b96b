"""The decoder's elementwise building blocks: native C kernels or eager PyTorch on the CPU,
Triton kernels on CUDA.

Each op has one contract and three implementations. The eager PyTorch one is the reference: it
follows transformers op for op (RMSNorm in float32, cast back to the activation dtype before the
weight multiply; RoPE tables in float32 cast to the activation dtype). The Triton one
(`kernels/triton/model_ops.py`) fuses each op into one or two launches and rounds where the
eager path rounds, so results agree. Triton is imported only when a CUDA tensor (or
`triton_on_cpu`, for the interpreter tests) first needs it. On the CPU, float32 inference goes
to the native kernels (`pagedserve/kernels/native/ops.c`): one call instead of the eager path's
4 to 10 small ops, whose per-op overhead dominates at decode sizes. They round where the eager
path rounds; only the order of a norm's sum of squares and the last bit of some exps differ.
Anything else on the CPU (other dtypes, autograd, no C compiler) runs the eager path.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor

from pagedserve.kernels.native import ops as native

_force_triton = False  # set by `triton_on_cpu`


@contextmanager
def triton_on_cpu() -> Iterator[None]:
    """Route CPU tensors through the Triton kernels too (for tests under TRITON_INTERPRET=1)."""
    global _force_triton
    previous, _force_triton = _force_triton, True
    try:
        yield
    finally:
        _force_triton = previous


@cache
def _kernels() -> ModuleType:
    from pagedserve.kernels.triton import model_ops

    return model_ops


def _use_triton(x: Tensor) -> bool:
    return x.is_cuda or _force_triton


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim, the eager reference: normalise in float32 (bf16 sums of
    squares lose too much), cast back, then scale."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def fused_add_rms_norm(x: Tensor, residual: Tensor | None, weight: Tensor,
                       eps: float) -> tuple[Tensor, Tensor]:
    """x, residual [T, H] -> (RMSNorm(residual + x), residual + x), the sum written into
    `residual` in place. The decoder carries the residual stream apart from the sublayers'
    outputs so that the add and the next norm are one pass. The sum is rounded to the
    activation dtype before the norm, as transformers' `h = residual + h` does. With no
    residual (the first layer) the stream starts at x: (RMSNorm(x), x)."""
    if _use_triton(x):
        return _kernels().rms_norm(x, weight, eps, residual)
    if native.takes(x, residual, weight):
        return native.fused_add_rms_norm(x, residual, weight, eps)
    return eager_fused_add_rms_norm(x, residual, weight, eps)


def eager_fused_add_rms_norm(x: Tensor, residual: Tensor | None, weight: Tensor,
                             eps: float) -> tuple[Tensor, Tensor]:
    """`fused_add_rms_norm` in eager PyTorch: the reference."""
    if residual is None:
        return rms_norm(x, weight, eps), x
    residual.add_(x)
    return rms_norm(residual, weight, eps), residual


def rotate_qk_(qkv: Tensor, positions: Tensor, cos: Tensor, sin: Tensor, num_q_heads: int,
               num_kv_heads: int, q_weight: Tensor | None = None,
               k_weight: Tensor | None = None, eps: float = 0.0) -> None:
    """In place on the fused projection qkv [T, Hq + 2 Hkv, D]: RMSNorm each q and k head with
    q_weight / k_weight when given (Qwen3), then apply RoPE for each token's position
    (NeoX half-split layout, as in transformers). v is left alone.

    cos, sin: [max_positions, D] tables in the activation dtype, sin sign-folded
    (`RotaryEmbedding`); positions [T] index them.
    """
    if _use_triton(qkv):
        _kernels().rotate_qk_(qkv, positions, cos, sin, num_q_heads, num_kv_heads, q_weight,
                              k_weight, eps)
        return
    if native.takes(qkv, cos, sin, q_weight, k_weight):
        native.rotate_qk_(qkv, positions, cos, sin, num_q_heads, num_kv_heads, q_weight,
                          k_weight, eps)
        return
    eager_rotate_qk_(qkv, positions, cos, sin, num_q_heads, num_kv_heads, q_weight, k_weight,
                     eps)


def eager_rotate_qk_(qkv: Tensor, positions: Tensor, cos: Tensor, sin: Tensor,
                     num_q_heads: int, num_kv_heads: int, q_weight: Tensor | None = None,
                     k_weight: Tensor | None = None, eps: float = 0.0) -> None:
    """`rotate_qk_` in eager PyTorch: the reference."""
    cos, sin = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)  # [T, 1, D]: all heads
    hq, hkv = num_q_heads, num_kv_heads
    if q_weight is None:
        qk = qkv[:, : hq + hkv]  # q and k are adjacent heads: rotate them in one go
        qk.copy_(_rope(qk, cos, sin))
        return
    q, k = qkv[:, :hq], qkv[:, hq : hq + hkv]
    q.copy_(_rope(rms_norm(q, q_weight, eps), cos, sin))
    k.copy_(_rope(rms_norm(k, k_weight, eps), cos, sin))


def _rope(x: Tensor, cos: Tensor, sin_signed: Tensor) -> Tensor:
    """x * cos + rotate_half(x) * sin, with rotate_half(x) * sin == roll(x, D/2) * sin_signed."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin_signed


def silu_and_mul(gate_up: Tensor) -> Tensor:
    """gate_up [T, 2I] (gate first, as the fused projection lays it out) -> silu(gate) * up."""
    if _use_triton(gate_up):
        return _kernels().silu_and_mul(gate_up)
    if native.takes(gate_up):
        return native.silu_and_mul(gate_up)
    return eager_silu_and_mul(gate_up)


def eager_silu_and_mul(gate_up: Tensor) -> Tensor:
    """`silu_and_mul` in eager PyTorch: the reference."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)
