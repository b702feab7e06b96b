"""The decoder's elementwise ops in float32 on the CPU, one native call each (`ops.c`).

Contracts are those of the eager references in `pagedserve.model.ops`, whose `select_ops`
picks these for float32 inference on the CPU (no autograd: the kernels write behind its back).
Row tensors (x, residual, qkv, gate_up) may have any row stride; their last dim, and the
weights, must be contiguous. The RoPE tables and positions are made contiguous here. Dtypes,
strides and shapes are checked here, as a mismatch would read or write outside the tensors
rather than raise.
"""

from __future__ import annotations

from ctypes import c_float, c_int, c_int64, c_void_p
from functools import cache

import torch
from torch import Tensor
from torch.autograd.graph import increment_version

from pagedserve.kernels.native.build import function


@cache
def _add_rms_norm():
    return function("pagedserve_add_rms_norm", c_void_p, c_int64, c_void_p, c_int64,
                     c_void_p, c_void_p, c_int64, c_int64, c_int64, c_float, c_int)


@cache
def _rotate_qk():
    # returns -1, or the first token whose position is outside the tables
    return function("pagedserve_rotate_qk", c_void_p, c_int64, c_int64, c_int64, c_void_p,
                    c_int64, c_void_p, c_void_p, c_int64, c_int64, c_int64, c_void_p, c_void_p,
                    c_float, c_int, restype=c_int64)


@cache
def _silu_and_mul():
    return function("pagedserve_silu_and_mul", c_void_p, c_int64, c_int64, c_int64,
                     c_void_p, c_int)


def available() -> bool:
    return _add_rms_norm() is not None


def _check(*tensors: Tensor | None) -> None:
    """Raise unless each tensor (None entries ignored) is float32 with a contiguous last dim
    (else the kernels would read the bytes wrongly) and autograd is not recording it (the
    kernels write behind its back: its gradients would be wrong). Plain attribute checks in a
    loop: at decode sizes every microsecond of Python here is a fair share of the kernel's
    time."""
    recording = torch.is_grad_enabled()
    for t in tensors:
        if t is not None and (t.dtype is not torch.float32 or t.stride(-1) != 1
                              or recording and t.requires_grad):
            raise ValueError(f"the native ops take float32 tensors with a contiguous last dim, "
                             f"outside autograd; not {t.dtype} with strides {t.stride()}"
                             + (" requiring grad" if t.requires_grad else ""))


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _written(t: Tensor) -> None:
    """Bump the version counter of a tensor the kernel wrote in place, as an in-place torch op
    would (inference tensors have none)."""
    if not t.is_inference():
        increment_version(t)


def fused_add_rms_norm(x: Tensor, residual: Tensor | None, weight: Tensor,
                       eps: float) -> tuple[Tensor, Tensor]:
    """x, residual [T, H] -> (RMSNorm(residual + x) * weight, residual + x), the sum written
    into `residual` in place; without a residual, (RMSNorm(x) * weight, x)."""
    _check(x, residual, weight)
    rows, n = x.shape
    if weight.shape != (n,):
        raise ValueError(f"weight {tuple(weight.shape)} does not match x {tuple(x.shape)}")
    if residual is not None and (residual.shape != x.shape or
                                 rows > 1 and residual.stride(0) < n):
        raise ValueError(f"residual {tuple(residual.shape)} with row stride "
                         f"{residual.stride(0)} cannot take x {tuple(x.shape)} in place")
    out = torch.empty(rows, n, dtype=torch.float32)
    _add_rms_norm()(x.data_ptr(), x.stride(0), _ptr(residual),
                    0 if residual is None else residual.stride(0), weight.data_ptr(),
                    out.data_ptr(), n, rows, n, eps, torch.get_num_threads())
    if residual is None:
        return out, x
    _written(residual)
    return out, residual


def rotate_qk_(qkv: Tensor, positions: Tensor, cos: Tensor, sin: Tensor, num_q_heads: int,
               num_kv_heads: int, q_weight: Tensor | None = None,
               k_weight: Tensor | None = None, eps: float = 0.0) -> None:
    """In place on qkv [T, Hq + 2 Hkv, D]: RMSNorm each q / k head by q_weight / k_weight when
    given, then RoPE by position from the cos / sin_signed tables [max_positions, D]. A position
    outside the tables raises IndexError before anything is written."""
    _check(qkv, cos, sin, q_weight, k_weight)
    tokens, heads, d = qkv.shape
    if heads != num_q_heads + 2 * num_kv_heads or d % 2 or positions.shape != (tokens,):
        raise ValueError(f"qkv {tuple(qkv.shape)} does not hold {num_q_heads} + 2 x "
                         f"{num_kv_heads} heads of even size, or positions "
                         f"{tuple(positions.shape)} do not match its tokens")
    head_stride = qkv.stride(1)
    if heads > 1 and head_stride < d or tokens > 1 and qkv.stride(0) < heads * head_stride:
        raise ValueError(f"the heads of qkv (strides {qkv.stride()}) overlap")
    if cos.dim() != 2 or cos.shape[1] != d or sin.shape != cos.shape:
        raise ValueError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must be "
                         f"[max_positions, {d}]")
    if (q_weight is None) != (k_weight is None) or q_weight is not None and (
            q_weight.shape != (d,) or k_weight.shape != (d,)):
        raise ValueError(f"q_weight and k_weight must both be ({d},) or both None")
    positions = positions.to(torch.int64).contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    bad = _rotate_qk()(qkv.data_ptr(), qkv.stride(0), head_stride, tokens, positions.data_ptr(),
                       cos.shape[0], cos.data_ptr(), sin.data_ptr(), num_q_heads, num_kv_heads,
                       d, _ptr(q_weight), _ptr(k_weight), eps, torch.get_num_threads())
    if bad >= 0:
        raise IndexError(f"position {int(positions[bad])} of token {bad} is outside the "
                         f"RoPE tables ({cos.shape[0]} positions)")
    _written(qkv)


def silu_and_mul(gate_up: Tensor) -> Tensor:
    """gate_up [T, 2I] (gate first) -> silu(gate) * up [T, I]."""
    _check(gate_up)
    rows, width = gate_up.shape
    if width % 2:
        raise ValueError(f"gate_up {tuple(gate_up.shape)} is not [T, 2I]")
    out = torch.empty(rows, width // 2, dtype=torch.float32)
    _silu_and_mul()(gate_up.data_ptr(), gate_up.stride(0), rows, width // 2, out.data_ptr(),
                    torch.get_num_threads())
    return out
