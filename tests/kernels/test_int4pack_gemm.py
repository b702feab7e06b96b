"""The fused GEMM on a weight in torch's int4 layout (`kernels/triton/int4pack_gemm.py`),
under TRITON_INTERPRET=1 against x @ the reference dequantization (`Int4Weight.dequantize`)
of the emulated CUDA layout (tests/kernels/test_int4pack.py; tests/gpu/test_gpu_int4.py
checks the same on the real one): ragged M, N past the last N tile, K past the last K
tile, groups of 32 to 256, zero points, split-K, bias."""

import pytest
import torch

from pagedserve.kernels.triton.int4pack_gemm import Int4GemmConfig, config_for, matmul
from tests.kernels.test_int4pack import int4_weight
from tests.kernels.test_kernels import fresh_seed


@pytest.mark.parametrize("m,n,k,group,zeros,config", [
    (5, 40, 384, 32, True, Int4GemmConfig(16, 32, 256)),  # N, K ragged; K 1.5 tiles
    (19, 24, 256, 64, False, Int4GemmConfig(16, 16, 128, split_k=3)),  # a split of no step
    (33, 16, 512, 128, True, Int4GemmConfig(32, 16, 128, split_k=2)),
    (3, 8, 768, 256, False, Int4GemmConfig(16, 8, 128, split_k=4)),  # 6 steps: 2, 2, 1, 1
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_gemm_is_x_times_the_reference_dequantization(m, n, k, group, zeros, config,
                                                            dtype):
    """float32 activations: the reference's products to float32 summation noise; bfloat16:
    each weight rounded to bfloat16 once (the tl.dot operand; the interpreter truncates), so
    within two bfloat16 steps of the sum of |products| (the bias's own rounding beside)."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    weight, _, _, _ = int4_weight(n, k, group, zeros, gen)
    x = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    w = weight.dequantize(torch.float32)
    expected = x.float() @ w.t() + bias.float()
    bound = x.float().abs() @ w.abs().t() + bias.float().abs()
    ulp = {torch.float32: 2.0**-20, torch.bfloat16: 2.0**-6}[dtype]
    got = matmul(x, weight, bias, config)
    assert got.dtype == dtype and got.shape == (m, n)
    assert ((got.float() - expected).abs() <= ulp * bound + 1e-6).all(), f"seed {seed}"
    no_bias = matmul(x, weight, None, config).float()
    assert ((no_bias - x.float() @ w.t()).abs() <= ulp * bound + 1e-6).all(), f"seed {seed}"


def test_the_rule_splits_k_only_while_the_tiles_leave_sms_idle():
    """Decode batches on a 132-SM GPU: 64 weight rows a program, the M tile the smallest that
    holds the rows (up to 128); K split in four at 16 rows or fewer, in two or four while
    the output tiles would leave over half of the SMs idle, never below 8 K steps a split."""
    small = config_for(16, 28672, 4096, 132)
    assert (small.block_m, small.block_n, small.split_k) == (16, 64, 4)  # 448 tiles
    assert config_for(16, 1024, 1024, 132).split_k == 1  # 8 K steps: no split
    assert config_for(32, 4096, 4096, 132).split_k == 2  # 64 tiles
    assert config_for(32, 6144, 4096, 132).split_k == 1  # 96 tiles
    assert config_for(100, 4096, 14336, 132).split_k == 2  # one M tile of 128: 64 tiles
    assert config_for(256, 4096, 14336, 132).split_k == 1  # 128 tiles
    for m, block_m in ((17, 32), (33, 64), (64, 64), (65, 128), (256, 128), (4096, 128)):
        config = config_for(m, 4096, 4096, 132)
        assert (config.block_m, config.block_n) == (block_m, 64), m
