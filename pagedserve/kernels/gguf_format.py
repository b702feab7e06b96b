"""GGUF weights kept in the file's blocks on the device: the block types the kernels take, the
`GgufWeight` the matmuls of `kernels/triton/int_linear.py` read (a `weight_formats` format:
`format`, `kernel_args`, `shape`, `dequantize`), and its torch reference dequantization.

A weight is uint8 [N, row bytes], each row the file's blocks along K, unchanged; K is a
multiple of the type's block (32 or 256 weights), as GGUF requires. The formats' ids are the
GGML type ids. The reference computes each weight with the same float32 products, in the same
order, as the `gguf` package's `dequantize` (tests hold it to that bit for bit); the Triton
description of the same unpacking is `kernels/triton/gguf_dequant.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from pagedserve.kernels.weight_formats import KernelArgs, WeightFormat

# GGML type id -> (weights per block, bytes per block)
BLOCKS = {int(WeightFormat.GGUF_Q4_0): (32, 18), int(WeightFormat.GGUF_Q4_1): (32, 20),
          int(WeightFormat.GGUF_Q8_0): (32, 34), int(WeightFormat.GGUF_Q4_K): (256, 144),
          int(WeightFormat.GGUF_Q5_K): (256, 176), int(WeightFormat.GGUF_Q6_K): (256, 210)}


def row_bytes(qtype: int, k: int) -> int:
    """Bytes of one row of k weights in `qtype`'s blocks."""
    weights, size = BLOCKS[qtype]
    if k % weights:
        raise ValueError(f"GGUF type {qtype}: K = {k} is not a multiple of its {weights}-weight "
                         "blocks")
    return k // weights * size


@dataclass(frozen=True)
class GgufWeight:
    """A weight [N, in_features] in GGUF blocks of `qtype`: uint8 [N, row bytes]."""

    blocks: Tensor
    qtype: int
    in_features: int

    def __post_init__(self) -> None:
        if self.blocks.shape[1] != row_bytes(self.qtype, self.in_features):
            raise ValueError(f"GGUF type {self.qtype}: rows of {self.blocks.shape[1]} bytes "
                             f"do not hold {self.in_features} weights")

    @property
    def format(self) -> WeightFormat:
        return WeightFormat(self.qtype)

    @property
    def shape(self) -> tuple[int, int]:
        return self.blocks.shape[0], self.in_features

    def kernel_args(self) -> KernelArgs:
        b = self.blocks
        return KernelArgs(b, b, b, b, b.stride(0), 0, self.qtype, 0, 1, False, False)

    def dequantize(self, dtype: torch.dtype | None = None) -> Tensor:
        """The reference: the weight [N, K] in `dtype` (float32 by default)."""
        n, k = self.shape
        weights, size = BLOCKS[self.qtype]
        blocks = self.blocks.reshape(n, k // weights, size)
        return _DEQUANTIZE[self.qtype](blocks).reshape(n, k).to(dtype or torch.float32)


def _f16(b: Tensor) -> Tensor:
    """float16 fields [..., 2] bytes -> float32 [..., 1]."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: Tensor, dim: int) -> Tensor:
    """Low nibbles, then high ones, stacked at `dim`."""
    return torch.stack([qs & 15, qs >> 4], dim=dim)


def _q4_0(b: Tensor) -> Tensor:
    q = _nibbles(b[..., 2:], -2).flatten(-2).float()  # 16 bytes: low nibbles are 0-15
    return _f16(b[..., :2]) * (q - 8)


def _q4_1(b: Tensor) -> Tensor:
    q = _nibbles(b[..., 4:], -2).flatten(-2).float()
    return _f16(b[..., :2]) * q + _f16(b[..., 2:4])


def _q8_0(b: Tensor) -> Tensor:
    return b[..., 2:].contiguous().view(torch.int8).float() * _f16(b[..., :2])


def _k_scales(b: Tensor) -> tuple[Tensor, Tensor]:
    """Q4_K / Q5_K: the eight 6-bit scales and mins of bytes 4-15 (see gguf_dequant)."""
    s = b[..., 4:16].int()
    lo, hi, mix = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([lo & 63, (mix & 15) | ((lo >> 6) << 4)], -1).float()
    mn = torch.cat([hi & 63, (mix >> 4) | ((hi >> 6) << 4)], -1).float()
    return (_f16(b[..., 0:2]) * sc)[..., None], (_f16(b[..., 2:4]) * mn)[..., None]


def _q4_k(b: Tensor) -> Tensor:
    d, dm = _k_scales(b)
    q = _nibbles(b[..., 16:].unflatten(-1, (4, 32)), -2).flatten(-3, -2).float()
    return d * q - dm


def _q5_k(b: Tensor) -> Tensor:
    d, dm = _k_scales(b)
    low = _nibbles(b[..., 48:].unflatten(-1, (4, 32)), -2).flatten(-3, -2)
    shifts = torch.arange(8, dtype=torch.uint8, device=b.device)[:, None]
    high = (b[..., None, 16:48] >> shifts) & 1
    return d * (low | (high << 4)).float() - dm


def _q6_k(b: Tensor) -> Tensor:
    low = _nibbles(b[..., :128].unflatten(-1, (2, 64)), -2).flatten(-2).unflatten(-1, (4, 32))
    shifts = 2 * torch.arange(4, dtype=torch.uint8, device=b.device)[:, None]
    high = (b[..., 128:192].unflatten(-1, (2, 1, 32)) >> shifts) & 3
    q = ((low | (high << 4)).int() - 32).float().flatten(-3).unflatten(-1, (16, 16))
    d = _f16(b[..., 208:210]) * b[..., 192:208].contiguous().view(torch.int8).float()
    return d[..., None] * q


_DEQUANTIZE = {2: _q4_0, 3: _q4_1, 8: _q8_0, 12: _q4_k, 13: _q5_k, 14: _q6_k}
