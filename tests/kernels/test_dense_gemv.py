"""The float matmul's decode GEMV (`kernels/triton/dense_gemv.py`) under TRITON_INTERPRET=1
against torch, and the rule that makes it the CUDA models' float matmul for one row
(`ops.select_ops`).

Under the interpreter a launch spreads over one SM, so the split-K case asks for many
programs per SM to split K. Casts to bf16 truncate in the interpreter where the GPU rounds:
bf16 results are held to one bf16 step of the float32 product."""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
import triton

from pagedserve.kernels.triton import dense_gemv
from pagedserve.kernels.triton.arrivals import arrival_counters
from pagedserve.kernels.triton.fp8_linear import one_row_tiles
from pagedserve.model import ops
from tests.kernels.test_kernels import fresh_seed

# default tiles; "split": K split 3 ways in 4-row tiles; "wide": the tiles neither narrowed
# nor K split
CONFIGS = {"default": None,
           "split": replace(dense_gemv.ONE_ROW, block_k=32, programs_per_sm=64),
           "wide": replace(dense_gemv.ONE_ROW, min_block_n=0, programs_per_sm=0)}


def close(got: torch.Tensor, want: torch.Tensor, seed: int) -> None:
    """got (x's dtype) against the float32 product: to rounding in float32; within one step
    of the result's dtype (and its sums' order) in fp16 / bf16."""
    if got.dtype == torch.float32:
        tol = dict(atol=1e-4, rtol=1e-4)
    else:
        tol = dict(atol=2e-2, rtol=2 * torch.finfo(got.dtype).eps)
    torch.testing.assert_close(got.float(), want.float(), **tol, msg=f"seed {seed}")


def operands(num_rows: int, n: int, k: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=gen) * torch.logspace(-2, 0, n)[:, None]).to(dtype)
    x = torch.randn(num_rows, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    return x, w, bias


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gemv_matches_torch(dtype, name):
    """Ragged N and K (not multiples of any tile), with and without bias, K whole or split:
    x @ W^T (+ b) in float32; the arrival counters are left zero for the next launch."""
    seed = fresh_seed()
    n, k = 37, 300
    x, w, bias = operands(1, n, k, dtype, seed)
    want = x.float() @ w.float().t()
    for b in (None, bias):
        got = dense_gemv.gemv(x, w, b, cfg=CONFIGS[name])
        assert got.dtype == dtype and got.shape == (1, n)
        close(got, want if b is None else want + b.float(), seed)
    assert not arrival_counters(triton.cdiv(n, 4), x.device).any()


def test_gemv_writes_into_a_given_buffer():
    """out= (a row-parallel layer's peer memory): the product lands in the buffer given, a
    row of a wider one, K split, and nothing beside it is written."""
    seed = fresh_seed()
    x, w, _ = operands(1, 40, 129, torch.float16, seed)
    wide = torch.full((3, 48), float("nan"), dtype=torch.float16)
    out = wide[1:2, 4:44]
    got = dense_gemv.gemv(x, w, out=out, cfg=CONFIGS["split"])
    assert got.data_ptr() == out.data_ptr()
    close(out, x.float() @ w.float().t(), seed)
    beside = torch.ones(wide.shape, dtype=torch.bool)
    beside[1, 4:44] = False
    assert wide[beside].isnan().all()


def test_linear_takes_the_gemv_for_one_row_then_torch():
    """`linear` keeps F.linear's contract at every row count: leading dims, bias, out=. One
    half-precision row is the GEMV's; two rows and more, float32, and what autograd records
    are cuBLAS's (here torch's CPU) F.linear."""
    seed = fresh_seed()
    x, w, bias = operands(5, 24, 70, torch.float16, seed)
    for rows in (1, 2, 5):
        xs = x[:rows]
        assert dense_gemv.takes(xs, w) == (rows == 1)
        want = F.linear(xs, w, bias)
        close(dense_gemv.linear(xs.view(rows, 1, -1), w, bias).view(rows, -1), want, seed)
        out = torch.empty(rows, 24, dtype=x.dtype)
        assert dense_gemv.linear(xs, w, bias, out).data_ptr() == out.data_ptr()
        close(out, want, seed)
    x32, w32 = x[:1].float(), w.float()
    assert not dense_gemv.takes(x32, w32)
    close(dense_gemv.linear(x32, w32), x32 @ w32.t(), seed)
    grad_x = x[:1].clone().requires_grad_()
    assert not dense_gemv.takes(grad_x, w)
    dense_gemv.linear(grad_x, w).sum().backward()
    close(grad_x.grad, w.float().sum(0, keepdim=True), seed)


@pytest.mark.parametrize("rows", [1, 3])
def test_cuda_models_take_the_gemv_as_their_float_matmul(rows):
    """The one dispatch rule: on CUDA `Ops.matmul` is the GEMV's `linear`, which
    `matmul_into` writes straight into the given buffer (no copy), at one row and at more
    (cuBLAS); with the engine's --no-dense-gemv it is F.linear (cuBLAS); the CPU keeps its
    own."""
    seed = fresh_seed()
    x, w, bias = operands(rows, 24, 70, torch.float16, seed)
    matmul = ops.select_ops("cuda", torch.float16).matmul()
    close(matmul(x, w, bias), x.float() @ w.float().t() + bias.float(), seed)
    out = torch.empty(rows, 24, dtype=torch.float16)
    assert ops.matmul_into(matmul, x, w, out).data_ptr() == out.data_ptr()
    close(out, x.float() @ w.float().t(), seed)
    assert ops.select_ops("cuda", torch.float16, dense_gemv=False).matmul() is F.linear
    assert not isinstance(ops.select_ops("cpu", torch.float32).matmul(), ops.IntoMatmul)


def test_tiles_fill_the_sms_on_a_tensor_parallel_slice():
    """Llama-3-8B's q/k/v slice at TP=4 ([1536, 4096]) on 132 SMs: 4-row tiles with K split
    in two (768 programs, >= 5 per SM); K's slices are whole tiles and none is empty."""
    one, splits, per = one_row_tiles(1536, 4096, 132, dense_gemv.ONE_ROW)
    assert (one.block_n, one.block_k, splits, per) == (4, 512, 2, 2048)
    for n, k in ((4096, 1024), (3584 // 7, 100_000), (128_256, 4096)):
        cfg, splits, per = one_row_tiles(n, k, 132, dense_gemv.ONE_ROW)
        assert per % cfg.block_k == 0 and (splits - 1) * per < k <= splits * per
