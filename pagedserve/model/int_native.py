"""Integer weight-only checkpoints (`model/int_weights.py`) on the CPU's int8-activation
kernels (`kernels/native/quant.c`, the GGUF fast mode's): each packed layer (and MoE expert,
run expert by expert on the CPU) converted once, at load, to the kernels' blocks where they
hold its weight exactly, the reference
(`int_weights.reference_linear`: dequantize, then a float matmul) elsewhere.

Why: a float32 matmul on a weight dequantized per call reads eight times the 4-bit bytes
and spends the call dequantizing; the native kernels multiply int8-quantized activations
into 4-bit (or 8-bit) blocks directly, as they do for a GGUF. Their results differ from a
float matmul on the dequantized weight by the activations' rounding only (the same
tolerance as the GGUF fast mode's), which is why the exact path (`--dtype float32`) keeps
the reference, as it does for a GGUF.

The blocks: q4 (4-bit codes) has a float32 scale and min per 32 weights, weight = scale * q
+ min; q8 (8-bit codes) signed int8 q and a float32 scale per 16 weights, no min. A block
takes one scale, so each quantization group is laid out as whole blocks: the columns put in
group order (a stable sort of g_idx, for GPTQ's desc_act and compressed-tensors' actorder),
each group padded to a multiple of the block with columns that read a zero activation. The
activations are gathered into that layout on each call (one copy of the step's rows, and
only where the layout is not the checkpoint's own: a group size that is not a multiple of
the block, a g_idx, K not a multiple of 32, or a tensor-parallel rank's share of desc_act
groups).
What is exact and what is not:

- 4-bit: code q with zero point z and scale s is s * q + (-z * s). Exact when -z * s is a
  float32: always for a symmetric checkpoint (z = 8) and for scales stored in float16 or
  bfloat16 (the tools' default); asymmetric float32 scales generally are not, and keep the
  reference.
- 8-bit: exact when every code minus its zero point fits int8 (symmetric checkpoints, z =
  128); an asymmetric one generally does not, and keeps the reference.

The whole-step decode (`fast_decode`) takes only layers without a gather. Which path each
layer took is logged once per reason at load.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from pagedserve.kernels.native.quant import BLOCK, QuantizedLinear, QuantizedWeight
from pagedserve.kernels.weight_formats import IntWeight, groups_of, unpack_codes
from pagedserve.model.packed import QuantizedMatmul

Matmul = Callable[[Tensor, "Tensor | None", "Tensor | None"], Tensor]

logger = logging.getLogger(__name__)


class NoFit(ValueError):
    """The weight has no exact form in the native blocks; the message says why."""


@dataclass(frozen=True)
class Blocks:
    """A layer's weight in the native kernels' blocks, with the column layout it takes."""

    weight: QuantizedWeight
    # int64 [K']: the columns of [x, 0] (x with a zero column appended) each weight column
    # multiplies; None: x as it is
    columns: Tensor | None


def block_layout(groups: Tensor, unit: int) -> tuple[Tensor, Tensor]:
    """Each column's group [K] -> (the columns of [x, 0] in block order [K'], each block's
    group [K' / unit]): groups in order, each padded to whole blocks of `unit` with index K
    (the zero column)."""
    k = groups.numel()
    order = torch.argsort(groups, stable=True)
    counts = torch.bincount(groups, minlength=1)
    padded = -(-counts // unit) * unit
    starts, padded_starts = counts.cumsum(0) - counts, padded.cumsum(0) - padded
    sorted_groups = groups[order]
    columns = torch.full((int(padded.sum()),), k, dtype=torch.int64)
    columns[padded_starts[sorted_groups] + torch.arange(k) - starts[sorted_groups]] = order
    return columns, torch.repeat_interleave(torch.arange(counts.numel()), padded // unit)


def to_blocks(weight: IntWeight) -> Blocks:
    """`weight` as the native kernels' q4 (4-bit) or q8 (8-bit) blocks, exactly; NoFit
    where the blocks cannot hold it (see the module docstring)."""
    n, k = weight.shape
    unit = BLOCK if weight.bits == 4 else BLOCK // 2
    columns, block_groups = block_layout(groups_of(weight), unit)
    if columns.numel() % BLOCK:  # q8 groups of 16: the kernel's blocks are 32 all the same
        extra = BLOCK - columns.numel() % BLOCK
        columns = torch.cat([columns, torch.full((extra,), k)])
        block_groups = torch.cat([block_groups, block_groups[-1:].expand(extra // unit)])
    pad = columns == k
    codes = unpack_codes(weight.qweight, weight.bits, k).to(torch.int16)
    if torch.equal(columns, torch.arange(k)):
        columns = None  # the checkpoint's own layout (no copy of the codes)
    else:
        codes = torch.cat([codes, codes.new_zeros(n, 1)], dim=1)[:, columns]
    scales = weight.scales.float()[:, block_groups].contiguous()
    zeros = (weight.zeros.float()[:, block_groups] if weight.zeros is not None
             else torch.full_like(scales, 1 << (weight.bits - 1)))
    if weight.bits == 4:
        return Blocks(_q4(codes, scales, zeros), columns)
    return Blocks(_q8(codes, scales, zeros, pad), columns)


def _q4(codes: Tensor, scales: Tensor, zeros: Tensor) -> QuantizedWeight:
    """4-bit codes [N, K'] with a scale and zero point per 32 columns -> q4 blocks: byte j of
    a block's 16 holds weight j (low nibble) and j + 16 (high)."""
    exact = -(zeros.double() * scales.double())
    mins = exact.float()
    if not torch.equal(mins.double(), exact):
        raise NoFit("zero point x scale is not a float32 (asymmetric float32 scales)")
    n, k = codes.shape
    halves = codes.view(n, k // BLOCK, 2, BLOCK // 2)
    qs = (halves[:, :, 0] | (halves[:, :, 1] << 4)).to(torch.uint8).view(n, k // 2)
    return QuantizedWeight("q4", qs.contiguous(), scales, mins)


def _q8(codes: Tensor, scales: Tensor, zeros: Tensor, pad: Tensor) -> QuantizedWeight:
    """8-bit codes [N, K'] with a scale and zero point per 16 columns -> q8 blocks: the
    codes less their zero points as int8 (0 in the padding columns)."""
    n, k = codes.shape
    q = (codes.view(n, -1, BLOCK // 2) - zeros.to(torch.int16)[..., None]).view(n, k)
    q[:, pad] = 0
    if q.min() < -128 or q.max() > 127:
        raise NoFit("a code minus its zero point is outside int8 (asymmetric 8-bit)")
    return QuantizedWeight("q8", q.to(torch.int8), scales, None)


class PermutedMatmul(QuantizedMatmul):
    """`QuantizedMatmul` on blocks in a layout of their own (`Blocks.columns`): x's columns
    (and zeros) gathered into it first."""

    def __init__(self, quantized: QuantizedLinear, columns: Tensor) -> None:
        super().__init__(quantized)
        self.columns = columns

    def __call__(self, x: Tensor, weight: Tensor | None, bias: Tensor | None = None) -> Tensor:
        padded = torch.nn.functional.pad(x, (0, 1))
        return self.quantized(padded.index_select(-1, self.columns), bias)


def native_matmul(weight: IntWeight) -> QuantizedMatmul:
    """A packed layer's matmul on the native blocks (NoFit where they cannot hold it)."""
    blocks = to_blocks(weight)
    linear = QuantizedLinear([blocks.weight])
    if blocks.columns is None:
        return QuantizedMatmul(linear)
    return PermutedMatmul(linear, blocks.columns)


def int_matmuls(layers: dict[str, IntWeight],
               reference: Callable[[IntWeight], Matmul]) -> dict[str, Matmul]:
    """Each packed layer's matmul (by name): `native_matmul` where its weight fits the
    blocks, `reference(weight)` elsewhere; one log line for the native ones and one per
    reason for the others."""
    matmuls: dict[str, Matmul] = {}
    unfit: dict[str, list[str]] = defaultdict(list)
    for name, weight in layers.items():
        try:
            matmuls[name] = native_matmul(weight)
        except NoFit as e:
            unfit[str(e)].append(name)
            matmuls[name] = reference(weight)
    if layers:
        logger.info("integer weights on the CPU: %d of %d packed layers on the native "
                    "int8-activation kernels", len(layers) - sum(map(len, unfit.values())),
                    len(layers))
    for reason, names in unfit.items():
        logger.info("integer weights on the CPU: %d layers keep the reference (dequantizing) "
                    "matmul: %s (%s%s)", len(names), reason, names[0],
                    ", ..." if len(names) > 1 else "")
    return matmuls
