"""The quantized linear kernel (`quant.c`), every variant this CPU runs, on every GGUF type.

Weights are random GGUF blocks (random bytes with finite float16 scales), repacked by
`gguf_blocks.from_gguf`; the repacking must reproduce the `gguf` package's dequantization
exactly. The kernel quantizes x to int8 per 32-block, so it is held to two float64 references
on the dequantized blocks: the product with x quantized the same way (tight: only float32
accumulation differs), and the product with x itself (loose: the activation rounding)."""

from __future__ import annotations

import ctypes
import shutil

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

from pagedserve.kernels.native import build, quant
from pagedserve.kernels.native.quant import GroupedWeight, QuantizedLinear
from pagedserve.model.gguf_blocks import GGUF_TYPES, from_gguf

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")

RUNNABLE = [v for v in build.VARIANTS if v.cpu_flags <= build.cpu_flags()]
# The byte offsets of each type's float16 fields within its block.
F16_FIELDS = {T.Q4_0: [0], T.Q4_1: [0, 2], T.Q8_0: [0], T.Q4_K: [0, 2], T.Q6_K: [208]}


def random_blocks(qtype: T, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    size, nbytes = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (n, k // size, nbytes), dtype=np.uint8)
    for offset in F16_FIELDS[qtype]:
        scale = (rng.standard_normal((n, k // size)) * 0.02).astype(np.float16)
        blocks[..., offset:offset + 2] = scale.view(np.uint8).reshape(n, k // size, 2)
    return blocks.reshape(n, -1)


def quantize_rows(x: np.ndarray) -> np.ndarray:
    """x float32 [m, k] -> its int8 32-block quantization, dequantized (as the kernel does it:
    d = max|x| / 127, q = round-half-even(x * (127 / max|x|)))."""
    blocks = x.reshape(x.shape[0], -1, 32)
    amax = np.abs(blocks).max(-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.round(blocks * inv)
    return (q.astype(np.float64) * (amax / np.float32(127)).astype(np.float64)).reshape(x.shape)


@pytest.fixture(scope="module", params=RUNNABLE, ids=lambda v: v.name)
def variant(request, tmp_path_factory):
    """Point the wrapper at this variant's library (built once) for the module's tests; the
    library itself is the fixture's value."""
    lib = ctypes.CDLL(str(build.compile_variant(tmp_path_factory.mktemp(request.param.name),
                                         request.param)))
    fn = lib.pagedserve_qlinear
    fn.argtypes, fn.restype = quant.kernel().argtypes, ctypes.c_int
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(quant, "kernel", lambda: fn)
        yield lib


def test_this_cpu_runs_the_avx2_variant_at_least():
    assert RUNNABLE and RUNNABLE[0].name == "avx2"
    assert build.variant() in RUNNABLE


@pytest.mark.parametrize("qtype", GGUF_TYPES, ids=lambda t: t.name)
def test_repacking_keeps_every_value(qtype):
    rng = np.random.default_rng(1)
    k = 512 if qtype in (T.Q4_K, T.Q6_K) else 96
    blocks = random_blocks(qtype, 13, k, rng)
    weight = from_gguf(blocks, qtype)
    assert weight.shape == (13, k)
    np.testing.assert_array_equal(weight.dequantize().numpy(), dequantize(blocks, qtype))


@pytest.mark.parametrize("qtype", GGUF_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n", [1, 16, 37])
def test_grouped_layout_moves_bytes_only(qtype, n):
    """The kernel's layout (groups of 16 rows, padded) gives back every byte and scale."""
    rng = np.random.default_rng(n)
    k = 512 if qtype in (T.Q4_K, T.Q6_K) else 96
    weight = from_gguf(random_blocks(qtype, n, k, rng), qtype)
    grouped = GroupedWeight.pack(weight)
    assert grouped.shape == (n, k) and grouped.qs.shape[0] == -(-n // 16)
    back = grouped.unpack()
    assert back.kind == weight.kind
    for a, b in [(back.qs, weight.qs), (back.scales, weight.scales), (back.mins, weight.mins)]:
        assert (a is None and b is None) or torch.equal(a, b)
    # a padded row is zero everywhere: its scales (and q4 mins) make its outputs 0
    pad = grouped.scales.view(grouped.qs.shape[0], -1, 16)[-1, :, n % 16 or 16:]
    assert not pad.any()


@pytest.mark.parametrize("qtype", GGUF_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9, 16, 70])
@pytest.mark.parametrize("n", [1, 7, 37])
def test_matches_float64_reference(variant, qtype, rows, n):
    seed = int(torch.seed() % 2**31)
    rng = np.random.default_rng(seed)
    # K: one block, a ragged count of blocks (no multiple of 8), several K-quant super-blocks
    k = [768, 256][n % 2] if qtype in (T.Q4_K, T.Q6_K) else [32, 288, 96][n % 3]
    blocks = random_blocks(qtype, n, k, rng)
    w = dequantize(blocks, qtype).astype(np.float64)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32) if rows % 2 else None
    out = QuantizedLinear([from_gguf(blocks, qtype)])(
        torch.from_numpy(x), None if bias is None else torch.from_numpy(bias)).double().numpy()
    b = 0 if bias is None else bias
    exact = quantize_rows(x) @ w.T + b
    scale = np.abs(quantize_rows(x)) @ np.abs(w).T + np.abs(b)
    assert np.all(np.abs(out - exact) <= 1e-5 * scale + 1e-6), f"seed {seed}"
    # the activation rounding: |error| per x element <= max|x| / 254 of its block
    unquantized = x.astype(np.float64) @ w.T + b
    bound = np.abs(x).max() / 254 * np.abs(w).sum(1)
    assert np.all(np.abs(out - unquantized) <= bound + 1e-6), f"seed {seed}"


def test_fused_parts_of_mixed_types_and_batched_input(variant):
    """A fused layer whose shards come in different types (q4 and q8 layouts) writes each
    part's columns of one output; leading batch dims are kept."""
    rng = np.random.default_rng(2)
    types = [T.Q4_K, T.Q4_K, T.Q6_K]
    parts = [random_blocks(t, n, 256, rng) for t, n in zip(types, [24, 8, 8])]
    linear = QuantizedLinear([from_gguf(b, t) for b, t in zip(parts, types)])
    assert [p.kind for p in linear.parts] == ["q4", "q8"] and linear.out_features == 40
    x = torch.randn(2, 3, 256)
    bias = torch.randn(40)
    out = linear(x, bias)
    w = np.concatenate([dequantize(b, t) for b, t in zip(parts, types)])
    exact = quantize_rows(x.reshape(6, 256).numpy()) @ w.T.astype(np.float64) + bias.numpy()
    assert out.shape == (2, 3, 40)
    np.testing.assert_allclose(out.reshape(6, 40).double().numpy(), exact, rtol=1e-4, atol=1e-4)


def test_thread_count_does_not_change_results(variant):
    rng = np.random.default_rng(3)
    linear = QuantizedLinear([from_gguf(random_blocks(T.Q4_1, 50, 128, rng), T.Q4_1)])
    x = torch.randn(9, 128)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = linear(x)
        torch.set_num_threads(2)
        two = linear(x)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_zero_rows_and_zero_activations(variant):
    rng = np.random.default_rng(4)
    linear = QuantizedLinear([from_gguf(random_blocks(T.Q8_0, 5, 64, rng), T.Q8_0)])
    assert linear(torch.zeros(0, 64)).shape == (0, 5)
    assert torch.equal(linear(torch.zeros(2, 64)), torch.zeros(2, 5))


def test_wrong_input_is_rejected():
    rng = np.random.default_rng(5)
    linear = QuantizedLinear([from_gguf(random_blocks(T.Q4_0, 5, 64, rng), T.Q4_0)])
    with pytest.raises(ValueError, match="does not fit"):
        linear(torch.zeros(2, 32))
    with pytest.raises(ValueError, match="does not fit"):
        linear(torch.zeros(2, 64, dtype=torch.float64))
    with pytest.raises(ValueError, match="has no quantized kernel"):
        from_gguf(np.zeros((2, 64), dtype=np.uint8), T.Q5_0)


class _QRows(ctypes.Structure):
    _fields_ = [("q", ctypes.c_void_p), ("d", ctypes.c_void_p), ("s", ctypes.c_void_p),
                ("c", ctypes.c_void_p), ("nb", ctypes.c_int64)]


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q6_K], ids=lambda t: t.name)
def test_row_ranges_inside_groups_match_the_whole(variant, qtype):
    """decode.c asks for ranges of weight rows that may start or end inside a group of 16
    (`ps_qlinear_range`): each range writes exactly its outputs, bit for bit the whole
    layer's, and nothing outside them."""
    rng = np.random.default_rng(6)
    n, k, m = 45, 256, 11
    weight = from_gguf(random_blocks(qtype, n, k, rng), qtype)
    x = torch.randn(m, k)
    bias = torch.randn(n)
    whole = QuantizedLinear([weight])(x, bias)
    part = GroupedWeight.pack(weight)
    nb = k // 32
    q = torch.empty(m, k, dtype=torch.int8)
    d, s, c = torch.empty(m, nb), torch.empty(m, nb), torch.empty(m, 2 * nb, dtype=torch.int32)
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    variant.ps_quantize_rows.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, ptr]
    variant.ps_quantize_rows(x.data_ptr(), k, m, nb, q.data_ptr(), d.data_ptr(), s.data_ptr(),
                             c.data_ptr())
    rows = _QRows(q.data_ptr(), d.data_ptr(), s.data_ptr(), c.data_ptr(), nb)
    fn = variant.ps_qlinear_range
    fn.argtypes = [ctypes.c_int, ptr, ptr, ptr, ctypes.POINTER(_QRows), i64, i64, i64, i64,
                   ptr, ptr, i64]
    for n0, n1 in [(0, 45), (3, 12), (5, 21), (15, 17), (16, 32), (30, 45), (44, 45)]:
        width = n1 - n0
        y = torch.full((m, width + 2), float("nan"))  # one guard column each side
        fn(0 if part.kind == "q4" else 1, part.qs.data_ptr(), part.scales.data_ptr(),
           None if part.mins is None else part.mins.data_ptr(), ctypes.byref(rows), 2, m,
           n0, n1, bias.data_ptr(), y[:, 1:].data_ptr(), width + 2)
        assert torch.equal(y[2:, 1:-1], whole[2:, n0:n1]), (n0, n1)
        assert y[:, 0].isnan().all() and y[:, -1].isnan().all() and y[:2].isnan().all()
