"""The decoder's ops, and the one rule that picks their implementations: `select_ops`, once,
when the model loads, from the device and the dtype.

Each elementwise op has one contract and three implementations. The eager PyTorch one is the
reference: it follows transformers op for op (RMSNorm in float32, cast back to the activation
dtype before the weight multiply; RoPE tables in float32 cast to the activation dtype). The
Triton one (`kernels/triton/model_ops.py`, CUDA) fuses each op into one or two launches and
rounds where the eager path rounds, so results agree. On the CPU, float32 inference takes the
native kernels (`kernels/native/ops.c`): one call instead of the eager path's 4 to 10 small
ops, whose per-op overhead dominates at decode sizes. They round where the eager path rounds;
only the order of a norm's sum of squares and the last bit of some exps differ. Anything else
(other dtypes or devices, no C compiler) runs the eager path. The same choice covers the float
linears (`packed.select_packing` on the CPU; on CUDA `kernels/triton/dense_gemv`'s GEMV for
decode steps of one row, cuBLAS otherwise), the FP8 matmul (`fp8.reference_linear` or the
CUDA one), the packed integer matmul (`int_weights.reference_linear` or
`kernels/triton/int_linear`), the MoE experts (fused Triton kernels, or expert by expert),
batched LoRA (`lora.py`'s reference, or `kernels/triton/lora.py`) and whether a GGUF's
linears keep their blocks (CUDA: `gguf_linear`) or are dequantized at load (the CPU, whose
fast mode has its own quantized kernels: `packed.QuantizedMatmul`).

An `Ops` value holds the choice; the decoder's modules keep what they were given and call it
without asking again (no per-call device test). Tests pass one explicitly: `TORCH_OPS` (the
references), `native_ops()`, or `triton_ops()` (on the CPU under TRITON_INTERPRET=1). Triton
is imported by `triton_ops` only, so a CPU install needs no triton.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor

from pagedserve.kernels.native import ops as native
from pagedserve.model import int_weights
from pagedserve.model.fp8 import reference_linear
from pagedserve.model.lora import LoRAFn, reference_lora
from pagedserve.model.packed import Packing, PackedWeight, select_packing

Matmul = Callable[[Tensor, Tensor, "Tensor | None"], Tensor]  # (x, weight, bias) -> y


@dataclass(frozen=True)
class Ops:
    """The implementations a model's layers call, chosen once (`select_ops`)."""

    # x, residual [T, H], weight, eps -> (RMSNorm(residual + x), residual + x): see
    # `eager_fused_add_rms_norm`
    fused_add_rms_norm: Callable[[Tensor, Tensor | None, Tensor, float], tuple[Tensor, Tensor]]
    # qkv, positions, cos, sin, num_q_heads, num_kv_heads, q_weight, k_weight, eps (all
    # given: the Triton launcher has no defaults) -> None: see `eager_rotate_qk_`
    rotate_qk_: Callable[..., None]
    silu_and_mul: Callable[[Tensor], Tensor]  # see `eager_silu_and_mul`
    packing: Packing | None = None  # the float linears' prepacked kernel; None: F.linear
    # x, e4m3 weight, its per-row scales, bias -> y (`fp8.reference_linear`'s contract)
    fp8_linear: Callable[[Tensor, Tensor, Tensor, Tensor | None], Tensor] = reference_linear
    # x, a packed weight (`kernels.weight_formats`), bias -> y (`int_weights.reference_linear`)
    int_linear: Callable[[Tensor, object, Tensor | None], Tensor] = (
        int_weights.reference_linear)
    # a packed weight -> (its layer's matmul, the weight that matmul takes), once at load
    # (CUDA: `kernels/triton/int_linear.for_layer`, the weight in the layout of torch's int4
    # kernel and that layout's matmul where it fits; a weight returned converted is the only
    # copy kept: the loader drops the packed one); None: (`int_linear`, the weight)
    int_layer: Callable[[object], tuple[Callable, object]] | None = None
    # x, w13 (or the experts' (gate, up) kept quantized), w2, routing weights, expert ids ->
    # the MoE output (`kernels/triton/moe.fused_moe`); None: expert by expert
    fused_moe: Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor] | None = None
    # x, y, stacked A, stacked B, the step's LoRABatch -> None (y += the adapters' output)
    lora: LoRAFn = reference_lora
    # x, a `kernels.gguf_format.GgufWeight`, bias -> y (`kernels/triton/int_linear.linear`):
    # a GGUF's linears keep their blocks (`model.gguf_weights`); None: dequantized at load
    gguf_linear: Callable[[Tensor, object, Tensor | None], Tensor] | None = None
    # x, weight, bias, out (or None) -> y: the float linears' matmul where it is not F.linear
    # and can write into a given buffer (CUDA: `kernels/triton/dense_gemv.linear`, a GEMV
    # for decode steps of one row); None: F.linear (or the packed copy)
    dense_linear: Callable[[Tensor, Tensor, Tensor | None, Tensor | None], Tensor] | None = None

    def matmul(self) -> Matmul:
        """A float linear layer's own matmul: `dense_linear`, a packed copy of its weight, or
        F.linear."""
        if self.dense_linear is not None:
            return IntoMatmul(self.dense_linear)
        return F.linear if self.packing is None else PackedWeight(self.packing)

    def int_matmul(self, weight) -> tuple[Callable, object]:
        """A packed layer's matmul and the weight it takes (`int_layer`)."""
        return (self.int_linear, weight) if self.int_layer is None else self.int_layer(weight)


@dataclass(frozen=True)
class IntoMatmul:
    """A float matmul that can also write its product into a given buffer (`matmul_into`):
    `linear`(x, weight, bias, out or None)."""

    linear: Callable[[Tensor, Tensor, Tensor | None, Tensor | None], Tensor]

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        return self.linear(x, weight, bias, None)


def matmul_into(matmul: Matmul, x: Tensor, weight: Tensor, out: Tensor | None) -> Tensor:
    """matmul(x, weight) with no bias, written into `out` when it is given (a tensor-parallel
    layer's peer memory, `parallel.partial_target`): F.linear's product lands there directly
    (torch.mm's out=, the same GEMM), as does an `IntoMatmul`'s; another matmul's is copied
    in."""
    if out is None:
        return matmul(x, weight, None)
    if matmul is F.linear:
        return torch.mm(x, weight.t(), out=out)
    if isinstance(matmul, IntoMatmul):
        return matmul.linear(x, weight, None, out)
    return out.copy_(matmul(x, weight, None))


def select_ops(device: torch.device | str, dtype: torch.dtype, dense_gemv: bool = True,
               gguf_int8_activations: bool = True) -> Ops:
    """The implementations for a model on `device` in `dtype`: Triton's on CUDA, the native
    kernels for float32 on the CPU (where the library builds), eager torch otherwise.
    `dense_gemv` (CUDA): the float linears' decode GEMV (`Ops.dense_linear`); False: cuBLAS
    at every row count (the engine's --no-dense-gemv, to compare). `gguf_int8_activations`
    (CUDA): one row against Q4_K/Q6_K blocks quantized to int8 (`gguf_dp4a`); False: float
    activations (`gguf_gemv`; the engine's --no-gguf-int8-activations)."""
    device = torch.device(device)
    if device.type == "cuda":
        ops = triton_ops()
        if not gguf_int8_activations:
            from pagedserve.kernels.triton import int_linear

            ops = replace(ops, gguf_linear=partial(int_linear.linear,
                                                   config=int_linear.FLOAT_GGUF_ACTIVATIONS))
        return ops if dense_gemv else replace(ops, dense_linear=None)
    ops = native_ops() if device.type == "cpu" and dtype == torch.float32 and (
        native.available()) else TORCH_OPS
    return replace(ops, packing=select_packing(device, dtype))


def native_ops() -> Ops:
    """The native C kernels (float32 CPU tensors with a contiguous last dim, no autograd)."""
    return Ops(native.fused_add_rms_norm, native.rotate_qk_, native.silu_and_mul)


def triton_ops() -> Ops:
    """The Triton kernels: the fused elementwise ops, the float matmul's decode GEMV, the
    FP8 and int matmuls, the fused MoE, batched LoRA, the matmul on GGUF blocks."""
    from pagedserve.kernels.triton import (dense_gemv, fp8_linear, int_linear, lora, model_ops,
                                           moe)

    def add_rms_norm(x: Tensor, residual: Tensor | None, weight: Tensor,
                     eps: float) -> tuple[Tensor, Tensor]:
        return model_ops.rms_norm(x, weight, eps, residual)

    return Ops(add_rms_norm, model_ops.rotate_qk_, model_ops.silu_and_mul,
               fp8_linear=fp8_linear.linear, int_linear=int_linear.linear,
               int_layer=int_linear.for_layer,
               fused_moe=moe.fused_moe, lora=lora.lora_shrink_expand,
               gguf_linear=int_linear.linear, dense_linear=dense_gemv.linear)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim, the eager reference: normalise in float32 (bf16 sums of
    squares lose too much), cast back, then scale."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def eager_fused_add_rms_norm(x: Tensor, residual: Tensor | None, weight: Tensor,
                             eps: float) -> tuple[Tensor, Tensor]:
    """x, residual [T, H] -> (RMSNorm(residual + x), residual + x), the sum written into
    `residual` in place: the reference. The decoder carries the residual stream apart from the
    sublayers' outputs so that the add and the next norm are one pass. The sum is rounded to the
    activation dtype before the norm, as transformers' `h = residual + h` does. With no
    residual (the first layer) the stream starts at x: (RMSNorm(x), x)."""
    if residual is None:
        return rms_norm(x, weight, eps), x
    residual.add_(x)
    return rms_norm(residual, weight, eps), residual


def eager_rotate_qk_(qkv: Tensor, positions: Tensor, cos: Tensor, sin: Tensor,
                     num_q_heads: int, num_kv_heads: int, q_weight: Tensor | None = None,
                     k_weight: Tensor | None = None, eps: float = 0.0) -> None:
    """In place on the fused projection qkv [T, Hq + 2 Hkv, D]: RMSNorm each q and k head with
    q_weight / k_weight when given (Qwen3), then apply RoPE for each token's position
    (NeoX half-split layout, as in transformers); the reference. v is left alone.

    cos, sin: [max_positions, D] tables in the activation dtype, sin sign-folded
    (`RotaryEmbedding`); positions [T] index them.
    """
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


def eager_silu_and_mul(gate_up: Tensor) -> Tensor:
    """gate_up [T, 2I] (gate first, as the fused projection lays it out) -> silu(gate) * up:
    the reference."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


TORCH_OPS = Ops(eager_fused_add_rms_norm, eager_rotate_qk_, eager_silu_and_mul)
