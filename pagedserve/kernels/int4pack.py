"""4-bit weights in the layout of torch's own int4 matmul (`aten._weight_int4pack_mm`, the
"tinygemm" kernel gpt-fast uses), for steps of a few rows on CUDA.

Why a second layout: a decode step at batch 1 reads each weight once, so it runs at the speed
the packed bytes stream in. torch's kernel keeps the codes in tensor-core fragment order and
unpacks them with a few bit operations per pair, which streams at a large share of copy
bandwidth, where a Triton GEMV over the checkpoint's layout spends most of its time
unpacking (docs/benchmarks.md, "4-bit weights on CUDA"). Its cost per row grows with the batch, so
larger batches keep the Triton kernels on the original layout, and a weight it can read is
held twice (`kernels/triton/int_linear.prepare` decides, once, at load).

It reads 4-bit codes with groups of 32 to 256 columns in order (no g_idx), activations in
bfloat16, weight (n, k) = (code - 8) * scale + offset per group. A symmetric format maps
exactly (offset 0); one with zero points takes offset (8 - zero) * scale, rounded once to
bfloat16: within bfloat16's noise of the reference, as any bfloat16 matmul is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from pagedserve.kernels.weight_formats import IntWeight, unpack_codes

INNER_K_TILES = 8  # the layout's K tiles of 16 per fragment: K must be a multiple of 128
GROUP_SIZES = (32, 64, 128, 256)


@dataclass(frozen=True)
class Int4Pack:
    packed: Tensor  # torch's int4 layout of the codes
    scales_and_offsets: Tensor  # bfloat16 [groups, N, 2]
    group_size: int


def fits(weight: IntWeight) -> bool:
    """Whether torch's int4 kernel can read `weight` (on CUDA, in bfloat16)."""
    n, k = weight.shape
    return (weight.bits == 4 and weight.g_idx is None and weight.group_size in GROUP_SIZES
            and k % weight.group_size == 0 and k % (INNER_K_TILES * 16) == 0 and n % 8 == 0
            and weight.qweight.is_cuda and weight.scales.dtype == torch.bfloat16)


def pack(weight: IntWeight) -> Int4Pack:
    """`weight`'s codes and groups in torch's layout (call `fits` first)."""
    codes = unpack_codes(weight.qweight, 4, weight.in_features)
    pairs = ((codes[:, ::2] << 4) | codes[:, 1::2]).to(torch.uint8)
    packed = torch.ops.aten._convert_weight_to_int4pack(pairs, INNER_K_TILES)
    scales = weight.scales.float()
    offsets = (torch.zeros_like(scales) if weight.zeros is None
               else (8 - weight.zeros.float()) * scales)
    table = torch.stack([scales.t(), offsets.t()], dim=-1).to(torch.bfloat16).contiguous()
    return Int4Pack(packed, table, weight.group_size)


def matmul(x: Tensor, pack: Int4Pack) -> Tensor:
    """x [M, K] bfloat16 @ the weight^T -> [M, N] bfloat16."""
    return torch.ops.aten._weight_int4pack_mm(x, pack.packed, pack.group_size,
                                              pack.scales_and_offsets)
