"""The FP8 activation-quantization kernel (CUDA's path in FP8 linear layers) against the torch
quantization the CPU reference uses, bit for bit, under TRITON_INTERPRET=1."""

import torch

from pagedserve.model import fp8
from pagedserve.model.fp8_kernel import quantize_tokens
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
