"""Block-quantized linear layers on the CPU (`quant.c`): GGUF weights kept quantized.

`QuantizedWeight` holds a weight row by row in one of two kinds (q4, q8; see quant.c);
`pagedserve.model.gguf_blocks` repacks a GGUF file's blocks into them without changing a
value, and the GGUF cache stores them so. `GroupedWeight` is the same weight in the kernel's
layout (groups of 16 rows interleaved 4 weights at a time, quant.c), made when a
`QuantizedLinear` is built: moving bytes only, `unpack` gives the weight back exactly.
`QuantizedLinear` multiplies int8-quantized activations into them; its results differ from a
float matmul on the dequantized weights by the activations' rounding (relative 1e-3 or so per
output).
K must be a multiple of 32, as every GGUF block type makes it.
"""

from __future__ import annotations

from ctypes import c_int, c_int64, c_void_p
from dataclasses import dataclass
from functools import cache

import torch

from pagedserve.kernels.native.build import function

BLOCK = 32  # weights per kernel block; K must be a multiple
GROUP = 16  # weight rows interleaved in the kernel's layout (quant.c's GR)


@cache
def kernel():
    """The C function through ctypes (looked up once), or None where the library is
    missing (no compiler, no AVX2)."""
    return function("pagedserve_qlinear", c_int, c_void_p, c_int64, c_int64, c_void_p,
                    c_void_p, c_void_p, c_int64, c_void_p, c_void_p, c_int64, c_int,
                    restype=c_int)


def available() -> bool:
    return kernel() is not None


@dataclass(frozen=True)
class QuantizedWeight:
    """A [n, k] weight in the kernel's layout. kind "q4": qs uint8 [n, k/2] (per 32 weights, 16
    bytes: byte j holds weight j low and j + 16 high), scales and mins float32 [n, k/32].
    kind "q8": qs int8 [n, k], scales float32 [n, k/16], mins None."""

    kind: str
    qs: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None

    @property
    def shape(self) -> tuple[int, int]:
        n = self.qs.shape[0]
        return n, self.scales.shape[1] * (BLOCK if self.kind == "q4" else BLOCK // 2)

    @classmethod
    def cat(cls, parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Stacked along the output dim (fused q/k/v or gate/up); all of one kind."""
        kinds = {p.kind for p in parts}
        if len(kinds) != 1:
            raise ValueError(f"cannot fuse quantized weights of kinds {sorted(kinds)}")
        mins = None if parts[0].mins is None else torch.cat([p.mins for p in parts])
        return cls(parts[0].kind, torch.cat([p.qs for p in parts]),
                   torch.cat([p.scales for p in parts]), mins)

    def rows(self, index: torch.Tensor) -> QuantizedWeight:
        """The output rows `index` in that order (blocks run along k, so rows move whole)."""
        idx = torch.as_tensor(index, dtype=torch.int64)
        return QuantizedWeight(self.kind, self.qs[idx], self.scales[idx],
                               None if self.mins is None else self.mins[idx])

    def dequantize(self) -> torch.Tensor:
        """float32 [n, k]: scale * q + min, the GGUF's own values."""
        n, k = self.shape
        if self.kind == "q8":
            return (self.qs.float().view(n, -1, BLOCK // 2) * self.scales[..., None]).view(n, k)
        nibbles = self.qs.view(n, -1, 1, BLOCK // 2)
        q = torch.cat([nibbles & 15, nibbles >> 4], dim=2).float().view(n, -1, BLOCK)
        return (q * self.scales[..., None] + self.mins[..., None]).view(n, k)


@dataclass(frozen=True)
class GroupedWeight:
    """A `QuantizedWeight` of `rows` rows in quant.c's layout, rows padded with zeros to
    groups of 16. kind "q4": qs uint8 [groups, blocks * 256] (per block 4 chunks of 16 rows x
    4 bytes, low nibbles weights 4c.., high nibbles 16 + 4c..), scales and mins float32
    [groups, blocks * 16]. kind "q8": qs uint8 [groups, blocks * 512] (8 chunks, q + 128),
    scales float32 [groups, 2 * blocks * 16], mins None."""

    kind: str
    rows: int
    qs: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None

    @property
    def shape(self) -> tuple[int, int]:
        per_block = 256 if self.kind == "q4" else 512
        return self.rows, self.qs.shape[1] // per_block * BLOCK

    @classmethod
    def pack(cls, w: QuantizedWeight) -> GroupedWeight:
        n, k = w.shape
        groups, nb = -(-n // GROUP), k // BLOCK
        if w.kind == "q4":
            qs = _interleave(w.qs.view(n, nb, 4, 4), groups)
        else:
            qs = _interleave((w.qs.to(torch.int16) + 128).to(torch.uint8).view(n, nb, 8, 4),
                             groups)
        mins = None if w.mins is None else _interleave(w.mins[..., None, None], groups)
        return cls(w.kind, n, qs.view(groups, -1), _interleave(w.scales[..., None, None],
                   groups).view(groups, -1), None if mins is None else mins.view(groups, -1))

    def unpack(self) -> QuantizedWeight:
        n, k = self.shape
        groups, nb = self.qs.shape[0], k // BLOCK
        if self.kind == "q4":
            qs = _deinterleave(self.qs.view(groups, nb, 4, GROUP, 4), n).reshape(n, -1)
        else:
            raw = _deinterleave(self.qs.view(groups, nb, 8, GROUP, 4), n).reshape(n, -1)
            qs = (raw.to(torch.int16) - 128).to(torch.int8)
        per = nb if self.kind == "q4" else 2 * nb
        scales = _deinterleave(self.scales.view(groups, per, 1, GROUP, 1), n).reshape(n, -1)
        mins = None if self.mins is None else _deinterleave(
            self.mins.view(groups, per, 1, GROUP, 1), n).reshape(n, -1)
        return QuantizedWeight(self.kind, qs, scales, mins)

    def dequantize(self) -> torch.Tensor:
        return self.unpack().dequantize()


def _interleave(t: torch.Tensor, groups: int) -> torch.Tensor:
    """[n, blocks, chunks, c] row-wise -> [groups, blocks, chunks, 16, c], rows zero-padded."""
    n = t.shape[0]
    padded = torch.zeros(groups * GROUP, *t.shape[1:], dtype=t.dtype)
    padded[:n] = t
    return padded.view(groups, GROUP, *t.shape[1:]).permute(0, 2, 3, 1, 4).contiguous()


def _deinterleave(t: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of `_interleave`: [groups, blocks, chunks, 16, c] -> [n, blocks, chunks, c]."""
    groups = t.shape[0]
    rows = t.permute(0, 3, 1, 2, 4).reshape(groups * GROUP, *t.shape[1:3], t.shape[4])
    return rows[:n]


class QuantizedLinear:
    """The output dim of one linear layer as quantized parts (the shards of a fused q/k/v or
    gate/up; consecutive ones of one kind are merged, so usually a single part). A file may
    mix types within a layer (Q4_K_M keeps v in Q6_K), hence parts rather than one weight."""

    def __init__(self, parts: list[QuantizedWeight]) -> None:
        merged: list[list[QuantizedWeight]] = []
        for part in parts:
            if merged and merged[-1][0].kind == part.kind:
                merged[-1].append(part)
            else:
                merged.append([part])
        self.parts = [GroupedWeight.pack(QuantizedWeight.cat(run) if len(run) > 1 else run[0])
                      for run in merged]
        ks = {p.shape[1] for p in self.parts}
        if len(ks) != 1:
            raise ValueError(f"quantized parts with different input sizes {sorted(ks)}")
        self.in_features = ks.pop()
        self.out_features = sum(p.shape[0] for p in self.parts)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., in] float32 @ W^T (+ bias [out]) -> [..., out] float32, x quantized to
        int8 per 32-block."""
        k, n = self.in_features, self.out_features
        if x.shape[-1] != k or x.dtype != torch.float32 or not x.is_cpu:
            raise ValueError(f"x {tuple(x.shape)} {x.dtype} does not fit a [{n}, {k}] weight")
        rows = x.reshape(-1, k).contiguous()
        out = torch.empty(rows.shape[0], n, dtype=torch.float32)
        bias = None if bias is None else bias.contiguous()
        qlinear, threads, offset = kernel(), torch.get_num_threads(), 0
        for part in self.parts:
            status = qlinear(0 if part.kind == "q4" else 1, rows.data_ptr(), rows.shape[0], k,
                             part.qs.data_ptr(), part.scales.data_ptr(),
                             None if part.mins is None else part.mins.data_ptr(),
                             part.shape[0], None if bias is None else bias[offset:].data_ptr(),
                             out[:, offset:].data_ptr(), n, threads)
            if status != 0:
                raise MemoryError("quantized linear: no memory for the quantized activations")
            offset += part.shape[0]
        return out.view(*x.shape[:-1], n)

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])
