"""Block-quantized linear layers on the CPU (`quant.c`): GGUF weights kept quantized.

`QuantizedWeight` holds a weight in one of the kernel's two layouts (see quant.c);
`pagedserve.model.gguf_blocks` repacks a GGUF file's blocks into them without changing a
value. `QuantizedLinear` multiplies int8-quantized activations into them; its results differ
from a float matmul on the dequantized weights by the activations' rounding (relative 1e-3 or
so per output).
K must be a multiple of 32, as every GGUF block type makes it.
"""

from __future__ import annotations

from ctypes import c_int, c_int64, c_void_p
from dataclasses import dataclass
from functools import cache

import torch

from pagedserve.native.build import function

BLOCK = 32  # weights per kernel block; K must be a multiple


@cache
def _kernel():
    return function("pagedserve_qlinear", c_int, c_void_p, c_int64, c_int64, c_void_p,
                    c_void_p, c_void_p, c_int64, c_void_p, c_void_p, c_int64, c_int,
                    restype=c_int)


def available() -> bool:
    return _kernel() is not None


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
        self.parts = [QuantizedWeight.cat(run) if len(run) > 1 else run[0] for run in merged]
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
        kernel, threads, offset = _kernel(), torch.get_num_threads(), 0
        for part in self.parts:
            status = kernel(0 if part.kind == "q4" else 1, rows.data_ptr(), rows.shape[0], k,
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
