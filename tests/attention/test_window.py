"""Sliding windows and score caps in the PyTorch reference and the native CPU kernel, against
dense float64 attention: windows ending inside and at block boundaries, wider than the context,
of one token; blocks the window left behind are the null block (never written: NaN)."""

from __future__ import annotations

import pytest
import torch

from pagedserve.attention.backend import AttentionShape
from pagedserve.attention.cpu_backend import CpuBackend
from pagedserve.attention.selector import get_attention_backend
from pagedserve.attention.torch_ref import TorchRefBackend
from pagedserve.kernels.native import attention as native
from tests.attention.paged_case import make_case

# (cached, new) per sequence: decodes first, then prefills, one with a cached prefix
SEQS = [(0, 1), (6, 1), (15, 1), (16, 1), (40, 1), (0, 21), (23, 9), (33, 17)]
WINDOWS = [1, 5, 8, 16, 17, 100]


def backends() -> list:
    return [TorchRefBackend()] + ([CpuBackend()] if native.available() else [])


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("backend", backends(), ids=lambda b: b.name)
def test_window_matches_dense(backend, window):
    case = make_case(SEQS, 8, 2, 32, 8, seed=window, prefix_hit_rows=2, window=window)
    out = backend.forward(case.q, case.k, case.v, case.k_cache, case.v_cache, case.meta,
                          case.scale, window=window)
    torch.testing.assert_close(out.double(), case.expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 6])
def test_softcap_matches_dense(window):
    """A capped model gets the reference on the CPU (the kernel has no cap), chosen at load."""
    shape = AttentionShape(torch.float32, torch.float32, 4, 4, 16, softcap=0.7)
    backend = get_attention_backend("auto", "cpu", shape)
    assert backend.name == "torch"
    case = make_case(SEQS, 4, 4, 16, 8, seed=3, window=window, softcap=0.7)
    out = backend.forward(case.q, case.k, case.v, case.k_cache, case.v_cache, case.meta,
                          case.scale, window=window, softcap=0.7)
    torch.testing.assert_close(out.double(), case.expected, atol=1e-5, rtol=1e-5)


def test_native_short_prefills_take_the_window():
    """A step whose prefills are short goes through the kernel one token at a time."""
    if not native.available():
        pytest.skip("native kernels unavailable")
    case = make_case([(9, 1), (0, 12), (5, 7)], 8, 4, 16, 4, seed=4, window=3)
    out = CpuBackend().forward(case.q, case.k, case.v, case.k_cache, case.v_cache, case.meta,
                               case.scale, window=3)
    torch.testing.assert_close(out.double(), case.expected, atol=1e-5, rtol=1e-5)
