"""The float matmul's decode GEMV (`kernels/triton/dense_gemv.py`) on CUDA (CI skips this
file): one row against the float32 product and cuBLAS on Llama-3-8B's projections as a TP=4
rank holds them and on ragged shapes, bf16 and fp16, K whole and split; into a given
buffer; captured in a CUDA graph and replayed with new inputs (the arrival counters must be
zero again after every launch); and chained, each product the next one's input, where PDL
lets a launch start before the one it reads has finished. Timings: benchmarks/kernels.py."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SHAPES = [(1536, 4096), (4096, 1024), (7168, 4096), (4096, 3584), (1000, 333), (37, 8200)]


def operands(num_rows: int, n: int, k: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w = (torch.randn(n, k, generator=gen, device="cuda") * k**-0.5).to(dtype)
    x = torch.randn(num_rows, k, generator=gen, device="cuda").to(dtype)
    bias = torch.randn(n, generator=gen, device="cuda").to(dtype)
    return x, w, bias


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).norm() / want.norm())


@pytest.mark.parametrize("tiles", ["default", "whole"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", SHAPES)
def test_gemv_matches_float32_and_cublas(n, k, dtype, tiles):
    """Within the output dtype's rounding of the float32 product, as close as cuBLAS is:
    the default tiles, and 16-row tiles over all of K (neither narrowed nor split)."""
    from dataclasses import replace

    from pagedserve.kernels.triton import dense_gemv

    x, w, bias = operands(1, n, k, dtype, seed=n + k)
    want = x.float() @ w.float().t() + bias.float()
    cfg = None
    if tiles == "whole":
        cfg = replace(dense_gemv.ONE_ROW, programs_per_sm=0, min_block_n=0)
    got = dense_gemv.gemv(x, w, bias, cfg=cfg)
    cublas = torch.nn.functional.linear(x, w, bias)
    assert got.dtype == dtype and got.shape == (1, n)
    limit = 2 * max(rel_err(cublas, want), torch.finfo(dtype).eps / 2)
    assert rel_err(got, want) <= limit, (rel_err(got, want), limit)


def test_gemv_into_a_buffer_in_a_cuda_graph():
    """`linear` of one row into a row of a wider buffer, captured once, replayed on new
    inputs: each replay's product is the new input's, and nothing beside the buffer is
    written."""
    from pagedserve.kernels.triton import dense_gemv

    n, k, num_rows = 4096, 1024, 1  # o at TP=4: K split
    x, w, _ = operands(num_rows, n, k, torch.bfloat16, seed=num_rows)
    wide = torch.full((num_rows, n + 16), float("nan"), device="cuda", dtype=torch.bfloat16)
    out = wide[:, 8:8 + n]
    dense_gemv.linear(x, w, None, out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dense_gemv.linear(x, w, None, out)
    for seed in range(3):
        x.copy_(operands(num_rows, n, k, torch.bfloat16, seed=100 + seed)[0])
        out.fill_(float("nan"))
        graph.replay()
        want = x.float() @ w.float().t()
        assert rel_err(out, want) < 1e-2
    assert wide[:, :8].isnan().all() and wide[:, 8 + n:].isnan().all()


def test_chained_gemvs_read_their_predecessors_results():
    """y_{i+1} = y_i W_i^T through square weights, eager and in a graph: a launch that read
    its input before the previous one had written it (PDL's wait) would be far off."""
    from pagedserve.kernels.triton import dense_gemv

    n = 2048
    x, _, _ = operands(1, n, n, torch.bfloat16, seed=7)
    weights = [operands(1, n, n, torch.bfloat16, seed=10 + i)[1] for i in range(6)]

    def chain(y):
        for w in weights:
            y = dense_gemv.gemv(y, w)
        return y

    want = x.float()
    for w in weights:
        want = (want @ w.float().t()).to(torch.bfloat16).float()
    assert rel_err(chain(x), want) < 2e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = chain(x)
    graph.replay()
    assert rel_err(captured, want) < 2e-2
