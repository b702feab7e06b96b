"""The native bfloat16 linear kernel (AMX tiles, `linear.c`) against a float64 reference of the
same bfloat16 weights and activations: ragged M (across 16-row tile groups), N (across
48-column panels), K not a multiple of the 32-wide tile step (odd, below one step), bias, 1 and
2 threads; and the fallback where the library lacks it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pagedserve.kernels.native import linear

pytestmark = pytest.mark.skipif(not linear.available(torch.bfloat16),
                                reason="no native bfloat16 kernel (needs AMX-BF16)")


def reference(x, w, b):
    """float64 sums of the bfloat16 inputs' exact products."""
    out = x.double() @ w.double().T
    return out if b is None else out + b.double()


def check(out, x, w, b):
    ref = reference(x, w, b)
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    # rounding to bfloat16 (8 significant bits) is within 2^-8 of the value; float32 sums of
    # K products add at most ~K 2^-24 of the sum of their magnitudes
    size = (x.double().abs() @ w.double().abs().T).max().item()
    torch.testing.assert_close(out.double(), ref, rtol=2**-8, atol=1e-5 * size + 1e-30)
    # and nearly always it is the float64 sum, rounded (the rest are ties within float32 error)
    assert (out == ref.float().bfloat16()).double().mean() > 0.97


def random(rows, n, k, bias, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    w = (torch.randn(n, k, generator=gen) / k**0.5).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    return x, w, b


@pytest.mark.parametrize("rows", [1, 2, 5, 15, 16, 17, 33, 70])
@pytest.mark.parametrize("n,k", [(48, 32), (200, 96), (33, 129), (7, 301), (101, 31),
                                 (576, 576), (50, 1), (97, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_reference(rows, n, k, bias):
    seed = torch.seed() % 2**31
    x, w, b = random(rows, n, k, bias, seed)
    out = linear.linear(x, linear.pack(w), n, b)
    check(out, x, w, b)


def test_pack_layout():
    """Pairs of K, 48-column panels, K padded to a multiple of 32 and N to the panel, zeros."""
    n, k = linear.panel(torch.bfloat16) + 5, 40
    w = torch.randn(n, k).bfloat16()
    packed = linear.pack(w)
    width = linear.panel(torch.bfloat16)
    assert packed.shape == (2, 32, width, 2) and packed.dtype == torch.bfloat16
    assert torch.equal(packed[0, 3, 7], w[7, 6:8])  # pair 3 of column 7
    assert torch.equal(packed[1, 19, 4, 1], w[width + 4, 39])
    assert not packed[1, :, 5:].any() and not packed[:, 20:].any()


def test_writes_only_its_output():
    """Rows and columns past the real ones (tile and panel padding) never reach memory."""
    x, w, b = random(19, 53, 45, True, 4)
    packed = linear.pack(w)
    fn = linear.kernel(torch.bfloat16)
    buffer = torch.full((19 * 53 + 64,), 7.0, dtype=torch.bfloat16)
    assert fn(x.data_ptr(), 19, 45, packed.data_ptr(), 53, b.data_ptr(), buffer.data_ptr(),
              2) == 0
    assert torch.all(buffer[19 * 53:] == 7.0)
    check(buffer[:19 * 53].view(19, 53), x, w, b)


def test_batched_strided_and_float32_input():
    x, w, _ = random(15, 64, 128, False, 5)
    strided = x.view(3, 5, 128)[..., ::2]  # [3, 5, 64], not contiguous
    half = w[:, :64]
    out = linear.linear(strided, linear.pack(half), 64)
    assert out.shape == (3, 5, 64)
    check(out.view(15, 64), strided.reshape(15, 64), half, None)
    # float32 activations are rounded to bfloat16 first
    packed = linear.pack(w)
    assert torch.equal(linear.linear(x.float(), packed, 64), linear.linear(x, packed, 64))


def test_no_rows():
    out = linear.linear(torch.empty(0, 32, dtype=torch.bfloat16),
                        linear.pack(torch.randn(16, 32).bfloat16()), 16)
    assert out.shape == (0, 16)


@pytest.mark.parametrize("threads", [1, 2])
def test_same_result_for_any_thread_count(threads):
    """One thread per panel, the same tile steps in K order: threads change no bit."""
    x, w, b = random(21, 300, 200, True, 6)
    packed = linear.pack(w)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = linear.linear(x, packed, 300, b)
        torch.set_num_threads(threads)
        out = linear.linear(x, packed, 300, b)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(out, one)
    check(out, x, w, b)


FALLBACK = """
import torch, torch.nn.functional as F
from pagedserve.kernels.native import build, linear
from pagedserve.model.ops import select_ops
assert build.variant().name == "avx2" and linear.available()
assert not hasattr(build.library(), "pagedserve_linear_bf16")
assert not linear.available(torch.bfloat16)
assert select_ops("cpu", torch.bfloat16).matmul() is F.linear
print("ok")
"""


def test_other_variants_fall_back_to_torch():
    """With the avx2 variant (no bfloat16 kernel compiled) bfloat16 weights take F.linear."""
    env = {**os.environ, "PAGEDSERVE_NATIVE_ISA": "avx2"}
    done = subprocess.run([sys.executable, "-c", FALLBACK], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
