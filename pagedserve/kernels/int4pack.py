"""4-bit weights in the layout of torch's own int4 matmul (`aten._weight_int4pack_mm`, the
"tinygemm" kernel gpt-fast uses), kept as a weight's ONLY copy on CUDA.

Why this layout: a decode step at batch 1 reads each weight once, so it runs at the speed
the packed bytes stream in. torch's kernel keeps the codes in tensor-core fragment order and
unpacks them with a few bit operations per pair, which streams at a large share of copy
bandwidth, where a Triton GEMV over the checkpoint's layout spends most of its time
unpacking (docs/benchmarks.md, "4-bit weights on CUDA"). Its cost per row grows with the
batch, so larger batches dequantize the weight FROM this layout into a scratch tensor
(`kernels/triton/int_linear.py`) and multiply by cuBLAS: the checkpoint's packed codes are
then not needed, and the loader drops them (`int_linear.prepare` decides, once, at load).

It reads 4-bit codes with groups of 32 to 256 columns in order (no g_idx), activations in
bfloat16, weight (n, k) = (code - 8) * scale + offset per group. A symmetric format maps
exactly (offset 0); one with zero points takes offset (8 - zero) * scale, rounded once to
bfloat16: within bfloat16's noise of the reference, as any bfloat16 matmul is.

The layout (CUDA's `_convert_weight_to_int4pack`, innerKTiles 8; ROCm's differs): int32
[N / 8, K / 128, 32, 4]. Word [nt, kt, t, j] belongs to lane t of the m16n8k16 B fragment of
output rows nt * 8 + t // 4, columns kt * 128 + j * 32 ... (two 16-column k-tiles); its
nibble p = 4 * lo + i (bits 4p..4p+3) holds weight (n, k) with
    n = nt * 8 + t // 4,   k = kt * 128 + j * 32 + i * 8 + (t % 4) * 2 + lo,
so nibbles p and p + 4 are the column pair (k, k + 1) that one bf16x2 register takes.
`unpack_reference` inverts it; the Triton dequantization reads it with the same formula.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from pagedserve.kernels.weight_formats import IntWeight, unpack_codes

INNER_K_TILES = 8  # the layout's K tiles of 16 per fragment: K must be a multiple of 128
GROUP_SIZES = (32, 64, 128, 256)
N_TILE, K_TILE = 8, INNER_K_TILES * 16  # the rows and columns one [32, 4] block of words holds


@dataclass(frozen=True)
class Int4Weight:
    """A 4-bit weight [N, K] in torch's int4 layout: the codes and a [groups, N, 2] table of
    (scale, offset) in bfloat16."""

    packed: Tensor  # int32 [N / 8, K / 128, 32, 4]
    scales_and_offsets: Tensor  # bfloat16 [K / group_size, N, 2]
    group_size: int
    in_features: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0] * N_TILE, self.in_features

    def dequantize(self, dtype: torch.dtype | None = None) -> Tensor:
        """The reference: weight [N, K] in `dtype` (bfloat16 by default), each value
        (code - 8) * scale + offset computed in float32 and rounded once."""
        n, k = self.shape
        codes = unpack_reference(self.packed, n, k).float()
        table = self.scales_and_offsets.float().repeat_interleave(self.group_size, dim=0)
        scales, offsets = table[..., 0].t(), table[..., 1].t()
        return ((codes - 8) * scales + offsets).to(dtype or torch.bfloat16)


def fits(weight: IntWeight) -> bool:
    """Whether torch's int4 kernel can read `weight` (on CUDA, in bfloat16)."""
    n, k = weight.shape
    return (weight.bits == 4 and weight.g_idx is None and weight.group_size in GROUP_SIZES
            and k % weight.group_size == 0 and k % K_TILE == 0 and n % N_TILE == 0
            and weight.qweight.is_cuda and torch.version.hip is None
            and weight.scales.dtype == torch.bfloat16)


def scales_and_offsets(weight: IntWeight) -> Tensor:
    """`weight`'s groups as the kernel takes them: bfloat16 [groups, N, (scale, offset)]."""
    scales = weight.scales.float()
    offsets = (torch.zeros_like(scales) if weight.zeros is None
               else (8 - weight.zeros.float()) * scales)
    return torch.stack([scales.t(), offsets.t()], dim=-1).to(torch.bfloat16).contiguous()


def pack(weight: IntWeight) -> Int4Weight:
    """`weight` in torch's layout (call `fits` first)."""
    codes = unpack_codes(weight.qweight, 4, weight.in_features)
    pairs = ((codes[:, ::2] << 4) | codes[:, 1::2]).to(torch.uint8)
    packed = torch.ops.aten._convert_weight_to_int4pack(pairs, INNER_K_TILES)
    return Int4Weight(packed, scales_and_offsets(weight), weight.group_size,
                      weight.in_features)


def matmul(x: Tensor, weight: Int4Weight) -> Tensor:
    """x [M, K] bfloat16 @ the weight^T -> [M, N] bfloat16."""
    return torch.ops.aten._weight_int4pack_mm(x.contiguous(), weight.packed, weight.group_size,
                                              weight.scales_and_offsets)


def unpack_reference(packed: Tensor, n: int, k: int) -> Tensor:
    """The codes [N, K] (int32, 0..15) of CUDA's int4 layout (the module docstring's
    formula): each word's eight nibbles, indexed [nt, kt, t // 4, t % 4, j, lo, i], moved
    to [nt, t // 4, kt, j, i, t % 4, lo], which is row-major [N, K]."""
    words = packed.reshape(n // N_TILE, k // K_TILE, 8, 4, INNER_K_TILES // 2, 1)
    shifts = torch.arange(8, device=packed.device, dtype=torch.int32) * 4
    nibbles = (words.to(torch.int32) >> shifts) & 0xF  # [nt, kt, tn, tk, j, p]
    nibbles = nibbles.reshape(*nibbles.shape[:5], 2, 4)  # p = 4 * lo + i
    return nibbles.permute(0, 2, 1, 4, 6, 3, 5).reshape(n, k)
