"""y = x @ W^T + b on prepacked weights (`linear.c`): float32, and bfloat16 on AMX.

The dispatch rule lives here, once: a weight's dtype picks its kernel kind (`available`,
`pack` and `linear` all follow it). float32 takes `pagedserve_linear` in every variant.
bfloat16 takes `pagedserve_linear_bf16` where all of these hold: the library has it (only the
avx512 variant, compiled under `__AVX512BF16__`, so not with `PAGEDSERVE_NATIVE_ISA=avx2`),
the CPU's flags have amx_tile and amx_bf16, and Linux grants the process the tile state;
anywhere else bfloat16 is not available and the caller keeps its torch path."""

from __future__ import annotations

from ctypes import c_int, c_int64, c_void_p
from functools import cache

import torch

from pagedserve.kernels.native.build import cpu_flags, function, library

# C function per weight dtype: (GEMM, panel width).
_KERNELS = {torch.float32: ("pagedserve_linear", "pagedserve_linear_panel"),
            torch.bfloat16: ("pagedserve_linear_bf16", "pagedserve_linear_bf16_panel")}


def _has(name: str) -> bool:
    lib = library()
    return lib is not None and hasattr(lib, name)


@cache
def panel(dtype: torch.dtype = torch.float32) -> int:
    """Output columns per packed panel: the library's (NR in linear.c: 48 with AVX-512, else
    24); 24 without the library, whose pack is then never multiplied."""
    name = _KERNELS[dtype][1]
    return function(name, restype=c_int)() if _has(name) else 24


@cache
def kernel(dtype: torch.dtype):
    """The C function through ctypes (looked up once), or None where the library is
    missing (no compiler, no AVX2)."""
    name = _KERNELS[dtype][0]
    if not _has(name):
        return None
    if dtype == torch.bfloat16 and not (
            {"amx_tile", "amx_bf16"} <= cpu_flags()
            and function("pagedserve_linear_bf16_init", restype=c_int)() == 0):
        return None
    return function(name, c_void_p, c_int64, c_int64, c_void_p, c_int64, c_void_p, c_void_p,
                    c_int, restype=c_int if dtype == torch.bfloat16 else None)


def available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether weights of `dtype` have a native kernel here."""
    return dtype in _KERNELS and kernel(dtype) is not None


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] -> panels of P = panel(dtype) output columns, columns past N zero:
    float32 [ceil(N/P), K, P]; bfloat16 [ceil(N/P), pairs, P, 2], pairs of K (AMX's B tile
    rows) with K zero-padded to a multiple of 32 (pairs = 16 ceil(K/32))."""
    n, k = weight.shape
    width = panel(weight.dtype)
    panels = -(-n // width)
    if weight.dtype == torch.bfloat16:
        pairs = -(-k // 32) * 16
        padded = torch.zeros(panels * width, 2 * pairs, dtype=torch.bfloat16)
        padded[:n, :k] = weight
        return padded.view(panels, width, pairs, 2).transpose(1, 2).contiguous()
    padded = torch.zeros(panels * width, k, dtype=torch.float32)
    padded[:n] = weight
    return padded.view(panels, width, k).transpose(1, 2).contiguous()


def linear(x: torch.Tensor, packed: torch.Tensor, n: int,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias [n]) -> [..., n], W given as `pack(W)`, in W's dtype: x (and
    the bias) are converted to it (bfloat16: rounded to nearest even), float32 sums."""
    dtype = packed.dtype
    k = x.shape[-1]
    rows = x.reshape(-1, k).to(dtype).contiguous()
    out = torch.empty(rows.shape[0], n, dtype=dtype)
    bias = None if bias is None else bias.to(dtype).contiguous()
    failed = kernel(dtype)(rows.data_ptr(), rows.shape[0], k, packed.data_ptr(), n,
                            None if bias is None else bias.data_ptr(), out.data_ptr(),
                            torch.get_num_threads())
    if failed:
        raise MemoryError(f"native linear: no memory for a copy of x {tuple(rows.shape)}")
    return out.view(*x.shape[:-1], n)
