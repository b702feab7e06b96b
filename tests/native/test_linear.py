"""The native float32 linear kernel against F.linear (float64 reference) on random inputs:
every register-tile row count (1-6 and their sums), N not a multiple of the panel (24 columns,
48 in the AVX-512 build), K across K-block boundaries, bias, non-contiguous and batched inputs;
every variant this CPU runs, bit for bit alike."""

from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F

from pagedserve.kernels.native import build, linear

pytestmark = pytest.mark.skipif(not linear.available(), reason="native kernels unavailable")


def reference(x, w, b):
    return F.linear(x.double(), w.double(), None if b is None else b.double())


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 12, 16, 17, 37])
@pytest.mark.parametrize("n,k", [(24, 8), (200, 96), (33, 129), (576, 576), (7, 300), (50, 256)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_reference(rows, n, k, bias):
    seed = torch.seed() % 2**31
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen)
    w = torch.randn(n, k, generator=gen) / k**0.5
    b = torch.randn(n, generator=gen) if bias else None
    out = linear.linear(x, linear.pack(w), n, b)
    assert out.shape == (rows, n) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), reference(x, w, b), atol=1e-5, rtol=1e-5,
                               msg=f"seed {seed}")


def test_writes_only_its_output_and_keeps_padding_out():
    """The padded columns of the last panel must never reach y: output rows are adjacent in
    memory, so a stray write would land in the next row."""
    torch.manual_seed(0)
    n, k = linear.panel() + 5, 40
    w = torch.randn(n, k)
    packed = linear.pack(w)
    assert packed.shape == (2, k, linear.panel()) and not packed[1, :, 5:].any()
    x = torch.randn(9, k)
    torch.testing.assert_close(linear.linear(x, packed, n).double(), reference(x, w, None),
                               atol=1e-5, rtol=1e-5)


def test_batched_and_strided_input():
    torch.manual_seed(1)
    w = torch.randn(48, 64)
    x = torch.randn(3, 5, 128)[..., ::2]  # [3, 5, 64], not contiguous
    out = linear.linear(x, linear.pack(w), 48)
    assert out.shape == (3, 5, 48)
    torch.testing.assert_close(out.double(), reference(x, w, None), atol=1e-5, rtol=1e-5)


def test_no_rows():
    out = linear.linear(torch.empty(0, 32), linear.pack(torch.randn(16, 32)), 16)
    assert out.shape == (0, 16)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_same_result_for_any_thread_count(threads):
    """Each output column is summed by one thread in K order, so threads change nothing."""
    torch.manual_seed(2)
    w, x = torch.randn(300, 200), torch.randn(16, 200)
    packed = linear.pack(w)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = linear.linear(x, packed, 300)
        torch.set_num_threads(threads)
        assert torch.equal(linear.linear(x, packed, 300), one)
    finally:
        torch.set_num_threads(before)


def _pack(w: torch.Tensor, width: int) -> torch.Tensor:
    n, k = w.shape
    padded = torch.zeros(-(-n // width) * width, k)
    padded[:n] = w
    return padded.view(-1, width, k).transpose(1, 2).contiguous()


def test_every_variant_gives_the_same_bits(tmp_path):
    """Each output is one FMA chain over K in order, whatever the vector width: the AVX2
    (24-column panels) and AVX-512 (48) builds agree exactly, and with float64 closely."""
    torch.manual_seed(3)
    n, k, rows = 101, 300, 13  # a ragged last panel in both widths, 3 K-blocks
    w, x, b = torch.randn(n, k) / k**0.5, torch.randn(rows, k), torch.randn(n)
    outs = {}
    for variant in [v for v in build.VARIANTS if v.cpu_flags <= build.cpu_flags()]:
        lib = ctypes.CDLL(str(build.compile_variant(tmp_path, variant)))
        width = lib.pagedserve_linear_panel()
        fn = lib.pagedserve_linear
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [ptr, i64, i64, ptr, i64, ptr, ptr, ctypes.c_int]
        packed = _pack(w, width)
        out = torch.full((rows, n + 1), float("nan"))[:, :n].contiguous()
        fn(x.data_ptr(), rows, k, packed.data_ptr(), n, b.data_ptr(), out.data_ptr(), 2)
        torch.testing.assert_close(out.double(), reference(x, w, b), atol=1e-5, rtol=1e-5)
        outs[(variant.name, width)] = out
    assert {w for _, w in outs} <= {24, 48}
    first = next(iter(outs.values()))
    assert all(torch.equal(o, first) for o in outs.values()), list(outs)
