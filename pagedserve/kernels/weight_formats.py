"""Weights kept quantized on the device: the layouts the kernels read, each described once.

Why one description: a format's unpacking (which bits of which word hold a weight, which scale
and zero point it takes) is needed by the torch reference, the one-row GEMV and the tiled
GEMM. Written once per format, here (`dequantize`, the reference) and in
`kernels/triton/dequant.py` (`dequant_tile`, the same arithmetic on a tile, which both
Triton kernels call), the three cannot drift apart; the tests hold them to each other.

A format is a `WeightFormat` id plus its constexpr parameters; the kernels take them as
`tl.constexpr`s and `dequant_tile` branches on the id, so each combination compiles to
straight-line code. A checkpoint family is converted to a kernel layout once, at load
(`model/int_weights.py` for compressed-tensors, GPTQ and AWQ); the kernels never see a
checkpoint's own packing.

`INT` (`IntWeight`): integer codes of `bits` (4 or 8) bits, packed along K into int32 words,
code i of a word in bits [i * bits, (i + 1) * bits) (low first: compressed-tensors'
`pack-quantized` order). Weight (n, k) is (code - zero[n, g]) * scale[n, g] with g the
group of column k: k // group_size, or g_idx[k] where the columns were quantized out of order
(GPTQ's desc_act, compressed-tensors' actorder "group"). A symmetric format has no zeros
tensor: its zero point is 2^(bits - 1). Scales (and zeros, integers held exactly) are in the
activation dtype; the product is rounded to it before the multiply, as a float model built
from the dequantized weight would hold it.

An MoE layer's experts are one `Stacked` per projection: each expert's weight, all of one
format and shape, as views of tensors stacked along a leading expert dim, so the fused MoE
kernel (`kernels/triton/moe.py`) reaches expert e's tensors e strides past expert 0's and
unpacks them with the same `dequant_tile`.

Adding a format (GGUF's blocks): a new `WeightFormat` id, its reference dequantization
beside `dequantize_int`, its branch in `dequant_tile`, and a dataclass of its tensors with
the same `format`, `kernel_args`, `shape` and `dequantize` members as `IntWeight`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import IntEnum

import torch
from torch import Tensor


class WeightFormat(IntEnum):
    """The id `dequant_tile` branches on (a tl.constexpr)."""

    INT = 0
    # GGUF blocks as the file stores them (`kernels/gguf_format.py`), by their GGML type id
    GGUF_Q4_0 = 2
    GGUF_Q4_1 = 3
    GGUF_Q8_0 = 8
    GGUF_Q4_K = 12
    GGUF_Q5_K = 13
    GGUF_Q6_K = 14


@dataclass(frozen=True)
class KernelArgs:
    """What the Triton kernels take for a format: four tensors (unused ones are any tensor),
    the row strides of the first two, and the format's constexprs."""

    data: Tensor
    scales: Tensor
    zeros: Tensor
    g_idx: Tensor
    data_stride: int
    scales_stride: int
    format: int
    bits: int
    group_size: int
    has_zeros: bool
    has_g_idx: bool


def codes_per_word(bits: int) -> int:
    return 32 // bits


def pack_codes(codes: Tensor, bits: int) -> Tensor:
    """Unsigned codes [N, K] -> int32 words [N, ceil(K / (32 / bits))], low bits first along
    K (K padded with zero codes)."""
    per_word = codes_per_word(bits)
    n, k = codes.shape
    padded = torch.zeros(n, math.ceil(k / per_word) * per_word, dtype=torch.int64,
                         device=codes.device)
    padded[:, :k] = codes.to(torch.int64)
    shifts = torch.arange(per_word, dtype=torch.int64, device=codes.device) * bits
    words = (padded.view(n, -1, per_word) << shifts).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_codes(words: Tensor, bits: int, k: int) -> Tensor:
    """int32 words [N, W] -> codes [N, k] (int32), the inverse of `pack_codes`."""
    per_word = codes_per_word(bits)
    shifts = torch.arange(per_word, dtype=torch.int32, device=words.device) * bits
    codes = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(words.shape[0], -1)[:, :k]


@dataclass(frozen=True)
class IntWeight:
    """An `INT` weight [N, K]: packed codes, per-group scales, zero points, column groups."""

    qweight: Tensor  # int32 [N, ceil(K / (32 / bits))]
    scales: Tensor  # [N, G] activation dtype
    zeros: Tensor | None  # [N, G] like scales (integer values); None: 2^(bits - 1)
    g_idx: Tensor | None  # int32 [K]: column k's group; None: k // group_size
    bits: int
    group_size: int  # columns per group; K (or more) for one scale per output channel
    in_features: int

    format = WeightFormat.INT

    @property
    def shape(self) -> tuple[int, int]:
        return self.qweight.shape[0], self.in_features

    def kernel_args(self) -> KernelArgs:
        scales = self.scales
        return KernelArgs(self.qweight, scales, scales if self.zeros is None else self.zeros,
                          self.qweight if self.g_idx is None else self.g_idx,
                          self.qweight.stride(0), scales.stride(0), int(self.format),
                          self.bits, self.group_size, self.zeros is not None,
                          self.g_idx is not None)

    def dequantize(self, dtype: torch.dtype | None = None) -> Tensor:
        return dequantize_int(self, dtype)


def groups_of(weight: IntWeight) -> Tensor:
    """Each column's group, int64 [K]."""
    if weight.g_idx is not None:
        return weight.g_idx.long()
    return torch.arange(weight.in_features, device=weight.qweight.device) // weight.group_size


def dequantize_int(weight: IntWeight, dtype: torch.dtype | None = None) -> Tensor:
    """The reference: weight [N, K] in `dtype` (the scales' by default), each value
    (code - zero) * scale computed in float32 and rounded once."""
    dtype = dtype or weight.scales.dtype
    codes = unpack_codes(weight.qweight, weight.bits, weight.in_features).float()
    groups = groups_of(weight)
    scales = weight.scales.float()[:, groups]
    zeros = (weight.zeros.float()[:, groups] if weight.zeros is not None
             else float(1 << (weight.bits - 1)))
    return ((codes - zeros) * scales).to(dtype)


@dataclass(frozen=True)
class Stacked:
    """Weights of one format and shape, one per expert, whose tensors are evenly spaced
    (views of stacked tensors): expert e's data, scales (and zeros) and g_idx start e times
    `strides` elements past expert 0's. Build with `stacked`."""

    experts: tuple
    strides: tuple[int, int, int]  # data, scales (zeros alike), g_idx

    @property
    def shape(self) -> tuple[int, int, int]:
        return (len(self.experts), *self.experts[0].shape)

    def kernel_args(self) -> KernelArgs:
        """Expert 0's (the others: `strides` on)."""
        return self.experts[0].kernel_args()


def stacked(experts) -> Stacked:
    """`Stacked` over per-expert weights of one format and shape; a ValueError when their
    tensors are not evenly spaced in memory (not views of stacked tensors)."""
    experts = tuple(experts)
    if len({(w.format, w.shape) for w in experts}) != 1:
        raise ValueError("stacked experts must share one format and shape")
    args = [w.kernel_args() for w in experts]
    strides = []
    for field in ("data", "scales", "zeros", "g_idx"):
        tensors = [getattr(a, field) for a in args]
        base = tensors[0].data_ptr()
        step = tensors[1].data_ptr() - base if len(tensors) > 1 else 0
        if any(t.data_ptr() != base + e * step for e, t in enumerate(tensors)):
            raise ValueError(f"the experts' {field} tensors are not evenly spaced")
        strides.append(step // tensors[0].element_size())
    if args[0].has_zeros and strides[2] != strides[1]:
        raise ValueError("the experts' zeros and scales are spaced apart differently")
    return Stacked(experts, (strides[0], strides[1], strides[3]))
