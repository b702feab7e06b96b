"""Integer weight-only checkpoints (`model/int_weights.py`) on the CPU's int8-activation
kernels (`kernels/native/quant.c`, the GGUF fast mode's): each packed layer converted once,
at load, to the kernels' blocks where they hold its weight exactly, the reference
(`int_weights.reference_linear`: dequantize, then a float matmul) elsewhere.

Why: a float32 matmul on a weight dequantized per call reads eight times the 4-bit bytes
and spends the call dequantizing; the native kernels multiply int8-quantized activations
into 4-bit (or 8-bit) blocks directly, as they do for a GGUF. Their results differ from a
float matmul on the dequantized weight by the activations' rounding only (the same
tolerance as the GGUF fast mode's), which is why the exact path (`--dtype float32`) keeps
the reference, as it does for a GGUF.

The kernels' two block kinds and when a layer's `IntWeight` fits one exactly:

- q4 (4-bit codes): a float32 scale and min per 32 weights, weight = scale * q + min. A 4-bit
  code q with zero point z and scale s is s * q + (-z * s): exact when every block of 32
  columns lies inside one quantization group (group size a multiple of 32, or one per
  channel) and -z * s is a float32 (always for a symmetric checkpoint, z = 8, and for scales
  stored in float16 or bfloat16; not for asymmetric float32 scales, which keep the
  reference).
- q8 (8-bit codes): signed int8 q and a float32 scale per 16 weights, no min. Exact when
  every code minus its zero point fits int8 (symmetric checkpoints, z = 128; an asymmetric
  one only where its codes happen to) and groups hold whole blocks of 16 columns.
- K (this rank's input columns) a multiple of 32, as the kernels need.

Columns grouped out of order (`g_idx`: GPTQ's desc_act, compressed-tensors' actorder) are
put in group order once (a stable sort of g_idx); the activations' columns are then taken in
that order on each call (one gather of the step's rows), so each group's columns are
contiguous and the test above applies to them: a checkpoint whose groups hold whole blocks
(every group of GPTQ's desc_act has exactly group-size columns) runs natively, one whose
groups are cut mid-block (a tensor-parallel rank's share of a group, say) keeps the
reference. The whole-step decode (`fast_decode`) takes only layers without that gather.

Which path each layer took is logged once per reason at load.
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

# columns per scale in each block kind (quant.c: q4 one per 32, q8 one per 16)
_UNIT = {4: BLOCK, 8: BLOCK // 2}


class NoFit(ValueError):
    """The weight has no exact form in the native blocks; the message says why."""


@dataclass(frozen=True)
class Blocks:
    """A layer's weight in the native kernels' blocks, with the column order it takes."""

    weight: QuantizedWeight
    columns: Tensor | None  # int64 [K]: x's columns in the blocks' order; None: as they are


def to_blocks(weight: IntWeight) -> Blocks:
    """`weight` as the native kernels' q4 (4-bit) or q8 (8-bit) blocks, exactly; NoFit
    otherwise (see the module docstring)."""
    n, k = weight.shape
    if k % BLOCK:
        raise NoFit(f"{k} input columns are not whole blocks of {BLOCK}")
    unit = _UNIT[weight.bits]
    groups, columns = groups_of(weight), None
    if weight.g_idx is not None:
        order = torch.argsort(groups, stable=True)
        if not torch.equal(order, torch.arange(k)):
            groups, columns = groups[order], order
    per_block = groups.view(-1, unit)
    if not (per_block == per_block[:, :1]).all():
        raise NoFit(f"a quantization group ends inside a block of {unit} columns")
    block_groups = per_block[:, 0]
    codes = unpack_codes(weight.qweight, weight.bits, k).to(torch.int16)
    if columns is not None:
        codes = codes[:, columns]
    scales = weight.scales.float()[:, block_groups].contiguous()
    zeros = (weight.zeros.float()[:, block_groups] if weight.zeros is not None
             else torch.full_like(scales, 1 << (weight.bits - 1)))
    if weight.bits == 4:
        return Blocks(_q4(codes, scales, zeros), columns)
    return Blocks(_q8(codes, scales, zeros), columns)


def _q4(codes: Tensor, scales: Tensor, zeros: Tensor) -> QuantizedWeight:
    """4-bit codes [N, K] with a scale and zero point per 32 columns -> q4 blocks: byte j of
    a block's 16 holds weight j (low nibble) and j + 16 (high)."""
    exact = -(zeros.double() * scales.double())
    mins = exact.float()
    if not torch.equal(mins.double(), exact):
        raise NoFit("zero point x scale is not a float32 (asymmetric float32 scales)")
    n, k = codes.shape
    halves = codes.view(n, k // BLOCK, 2, BLOCK // 2)
    qs = (halves[:, :, 0] | (halves[:, :, 1] << 4)).to(torch.uint8).view(n, k // 2)
    return QuantizedWeight("q4", qs.contiguous(), scales, mins)


def _q8(codes: Tensor, scales: Tensor, zeros: Tensor) -> QuantizedWeight:
    """8-bit codes [N, K] with a scale and zero point per 16 columns -> q8 blocks: the
    codes less their zero points as int8."""
    n, k = codes.shape
    q = codes.view(n, -1, BLOCK // 2) - zeros.to(torch.int16)[..., None]
    if q.min() < -128 or q.max() > 127:
        raise NoFit("a code minus its zero point is outside int8 (asymmetric 8-bit)")
    return QuantizedWeight("q8", q.to(torch.int8).view(n, k), scales, None)


class PermutedMatmul(QuantizedMatmul):
    """`QuantizedMatmul` on blocks whose columns are in group order: x's columns gathered
    into that order first."""

    def __init__(self, quantized: QuantizedLinear, columns: Tensor) -> None:
        super().__init__(quantized)
        self.columns = columns

    def __call__(self, x: Tensor, weight: Tensor | None, bias: Tensor | None = None) -> Tensor:
        return self.quantized(x.index_select(-1, self.columns), bias)


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
