"""The FP8 linear layers' kernels under TRITON_INTERPRET=1: the activation quantization (CUDA's
path for many tokens) against the torch quantization the CPU reference uses, bit for bit; the
weight-only product (CUDA's path for decode steps) against the dequantized weight."""

import pytest
import torch

from pagedserve.model import fp8
from pagedserve.model.fp8_kernel import WeightOnlyConfig, quantize_tokens, weight_only_linear
from tests.kernels.test_kernels import fresh_seed


def test_quantize_tokens_matches_quantize_rows():
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 100, generator=gen) * torch.logspace(-5, 4, 5)[:, None]
    x[2] = 0  # an all-zero token
    x[3, 7] = 1e6  # one outlier sets its token's scale
    rows = x.to(torch.bfloat16)[:, :96]  # a strided view, as of a wider activation
    q, scale = quantize_tokens(rows)
    q_ref, scale_ref = fp8.quantize_rows(rows)
    assert scale.shape == (5, 1) and torch.equal(scale[:, 0], scale_ref), f"seed {seed}"
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)), f"seed {seed}"


@pytest.mark.parametrize("num_rows,dtype", [(1, torch.float16), (3, torch.float32),
                                            (16, torch.float16)])
def test_weight_only_linear_matches_dequantized_weights(num_rows, dtype):
    """Ragged N and K (not multiples of the tiles), with and without bias: the product of the
    unquantized activations with the dequantized weight, in float32. (fp16, not bf16: the
    interpreter's bf16 tl.dot is broken, see test_kernels.py; e4m3 casts exactly to both.)"""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    n, k = 37, 600
    cfg = WeightOnlyConfig(block_n=16, block_k=256, num_warps=4, num_stages=2)
    w = torch.randn(n, k, generator=gen) * torch.logspace(-3, 1, n)[:, None]
    w_q, w_scale = fp8.quantize_rows(w)
    x = torch.randn(num_rows, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    want = x.float() @ (w_q.float() * w_scale[:, None]).t()
    for b in (None, bias):
        got = weight_only_linear(x, w_q, w_scale, b, cfg)
        expected = want if b is None else want + b.float()
        assert got.dtype == dtype and got.shape == (num_rows, n)
        torch.testing.assert_close(got.float(), expected, atol=1e-2, rtol=1e-2,
                                   msg=f"seed {seed}")
