"""y = x @ W^T + b in float32 on prepacked weights (`linear.c`)."""

from __future__ import annotations

from ctypes import c_int, c_int64, c_void_p
from functools import cache

import torch

from pagedserve.native.build import function


@cache
def panel() -> int:
    """Output columns per packed panel: the library's (NR in linear.c: 48 with AVX-512, else
    24); 24 without the library, whose pack is then never multiplied."""
    fn = function("pagedserve_linear_panel", restype=c_int)
    return fn() if fn is not None else 24


@cache
def _kernel():
    return function("pagedserve_linear", c_void_p, c_int64, c_int64, c_void_p, c_int64,
                    c_void_p, c_void_p, c_int)


def available() -> bool:
    return _kernel() is not None


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] float32 -> panels [ceil(N/P), K, P] with P = panel(), columns past N
    zero."""
    n, k = weight.shape
    width = panel()
    panels = -(-n // width)
    padded = torch.zeros(panels * width, k, dtype=torch.float32)
    padded[:n] = weight
    return padded.view(panels, width, k).transpose(1, 2).contiguous()


def linear(x: torch.Tensor, packed: torch.Tensor, n: int,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] float32 @ W^T (+ bias [n]) -> [..., n], W given as `pack(W)`."""
    k = packed.shape[1]
    rows = x.reshape(-1, k).contiguous()
    out = torch.empty(rows.shape[0], n, dtype=torch.float32)
    bias = None if bias is None else bias.contiguous()
    _kernel()(rows.data_ptr(), rows.shape[0], k, packed.data_ptr(), n,
              None if bias is None else bias.data_ptr(), out.data_ptr(), torch.get_num_threads())
    return out.view(*x.shape[:-1], n)
