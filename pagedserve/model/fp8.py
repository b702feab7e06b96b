"""FP8 weights: the dense projections in e4m3 with a scale per output channel, activations
quantized per token as they arrive, the product through `torch._scaled_mm` on CUDA.

Why: a decode step at small batch reads every weight once, so its time is the weights' bytes
over memory bandwidth; e4m3 halves those bytes against bf16. Activation scales are computed
per token (row) at run time, so nothing is calibrated and an outlier token costs only its
own row's precision.

Decode steps of at most 16 tokens take `fp8_linear.weight_only_linear` instead: x @ (W_q *
s_w)^T with x unquantized, the weight cast in registers (`_scaled_mm` at a handful of rows
does not read the weights at bandwidth, which is all such a step should cost).

Otherwise y = (x_q * s_x) @ (W_q * s_w)^T, where x_q = round_e4m3(x / s_x) with
s_x = max|x_row| / 448, and W_q, s_w likewise per output row (`quantize_rows`). On CUDA
`torch._scaled_mm` applies both scales in its epilogue (`kernels/triton/fp8_linear.linear`);
elsewhere the same quantized operands are dequantized to float32 and multiplied
(`reference_linear`): slow, but it runs such a model on the CPU, and it is what the GPU path
is checked against. Which of the two a model takes is chosen when it loads
(`model.ops.select_ops`).

Which layers: the decoder's dense projections (q/k/v, o, gate/up, down: `Decoder.
dense_linears`). The embedding, the LM head and MoE experts keep the model's dtype (as
llm-compressor's FP8 recipes leave the LM head).

Checkpoints: a bf16/fp16/fp32 checkpoint is quantized while it loads, one tensor at a time
on the target device (a fused parameter's shards are row ranges of it, so per-row scales
are the same per shard as on the fused weight). One already in FP8 in the compressed-tensors
layout (llm-compressor's FP8 and FP8_DYNAMIC schemes: `quantization_config` in config.json)
stores `weight` in e4m3 with `weight_scale` per output channel ([out, 1]) or per tensor
([1]), and loads as it is. Its static activation scales (`input_scale`), if any, go unused:
per-token scales are at least as precise.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn

from pagedserve.kernels.fp8_format import FP8_DTYPE, FP8_MAX, MIN_AMAX
from pagedserve.config import QUANTIZATIONS
# An all-zero row gets this amax: its scale stays finite and its values quantize to zero.


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [rows, K] -> (e4m3 [rows, K], float32 scales [rows]): each row divided by its
    max |value| / 448 and rounded to nearest."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_(min=MIN_AMAX) / FP8_MAX
    return (x / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale.squeeze(-1)


def reference_linear(x: Tensor, weight: Tensor, weight_scale: Tensor,
                     bias: Tensor | None = None) -> Tensor:
    """x [..., K] @ the e4m3 weight [N, K] with scales [N]^T (+ bias) -> [..., N] in x's
    dtype, in float32 from the dequantized operands (any device): the reference, and the CPU's
    FP8 matmul."""
    x_q, x_scale = quantize_rows(x.reshape(-1, x.shape[-1]))
    y = (x_q.float() * x_scale[:, None]) @ (weight.float() * weight_scale[:, None]).t()
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype).view(*x.shape[:-1], weight.shape[0])


def to_fp8(linear: nn.Linear) -> None:
    """Give a linear layer an (uninitialised) e4m3 weight and float32 scales [out] on the
    weight's device (the meta device while a model is being built); once the model is on its
    device, `Fp8Matmul` multiplies by them."""
    weight = linear.weight
    linear.weight = nn.Parameter(torch.empty(weight.shape, dtype=FP8_DTYPE,
                                             device=weight.device), requires_grad=False)
    linear.weight_scale = nn.Parameter(torch.empty(weight.shape[0], dtype=torch.float32,
                                                   device=weight.device), requires_grad=False)


class Fp8Matmul:
    """An FP8 layer's matmul: the model's FP8 linear (`Ops.fp8_linear`) with the layer's
    weight scales, made once the scales are on their device."""

    def __init__(self, linear: Callable[[Tensor, Tensor, Tensor, Tensor | None], Tensor],
                 weight_scale: Tensor) -> None:
        self.linear, self.weight_scale = linear, weight_scale

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        return self.linear(x, weight, self.weight_scale, bias)


def is_fp8(weight: Tensor) -> bool:
    return weight.dtype == FP8_DTYPE


def checkpoint_quantization(folder: Path) -> str | None:
    """"fp8" for a compressed-tensors checkpoint with 8-bit float weights, None for one
    without float-quantized weights (`int_weights.read_scheme` reads integer ones); other
    float schemes are refused by name."""
    config = folder / "config.json"
    raw = json.loads(config.read_text()).get("quantization_config") if config.exists() else None
    if not raw or raw.get("quant_method") != "compressed-tensors":
        return None
    groups = raw.get("config_groups") or {}
    weights = [g.get("weights") or {} for g in groups.values()]
    if not weights or not all(w.get("type") == "float" for w in weights):
        return None
    if all(w.get("num_bits") == 8 and w.get("strategy") in ("channel", "tensor")
           for w in weights):
        return "fp8"
    schemes = [(w.get("type"), w.get("num_bits"), w.get("strategy")) for w in weights]
    raise ValueError(f"{folder} is quantized with compressed-tensors {schemes}; only FP8 "
                     "weights with per-channel or per-tensor scales are supported")


def check_device(device: torch.device) -> None:
    """FP8 matmuls need CUDA compute capability 8.9 (Ada) or more; the CPU takes the
    reference path."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError("FP8 weights need a GPU of compute capability 8.9 or more (Ada, "
                         "Hopper); this one is "
                         f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))}")
