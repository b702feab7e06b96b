"""The quantized-weight matmuls (`kernels/triton/int_linear.py`) under TRITON_INTERPRET=1
against the torch reference that dequantizes the same bytes (`weight_formats.dequantize_int`):
4 and 8 bits, symmetric and with zero points, groups narrower than a tile, spanning tiles,
per channel and permuted by g_idx; K not a multiple of the group or the tile, N not a
multiple of the tile; one row (the GEMV) and several (the GEMM)."""

import pytest
import torch

from pagedserve.kernels.triton.int_linear import IntLinearConfig, linear
from pagedserve.kernels.weight_formats import IntWeight, pack_codes, unpack_codes
from tests.kernels.test_kernels import fresh_seed

# small tiles so the ragged edges show: K tiles of 64 or 32 columns, N tiles of 16 rows;
# 5 rows take the decode-batch GEMM tiles, 19 the others, 40 the dequantized weight
SMALL = IntLinearConfig(gemv_block_n=16, gemv_block_k=64, gemm_block_m=16, gemm_block_n=16,
                        gemm_block_k=32, small_block_m=16, small_block_n=16, small_block_k=64,
                        small_max_rows=8, int_gemv_block_n=16, int_gemv_block_k=64,
                        dequant_min_rows=32, dequant_block_n=16, dequant_block_k=64)


def random_weight(n: int, k: int, bits: int, group: int, zeros: bool, g_idx: bool,
                  dtype: torch.dtype, gen: torch.Generator) -> IntWeight:
    groups = -(-k // group)
    codes = torch.randint(0, 1 << bits, (n, k), generator=gen)
    scales = (torch.rand(n, groups, generator=gen) * 0.02 + 0.001).to(dtype)
    zero = (torch.randint(0, 1 << bits, (n, groups), generator=gen).to(dtype) if zeros
            else None)
    order = (torch.randperm(k, generator=gen) // group).to(torch.int32) if g_idx else None
    return IntWeight(pack_codes(codes, bits), scales, zero, order, bits, group, k)


def test_pack_codes_round_trips():
    gen = torch.Generator().manual_seed(fresh_seed())
    for bits in (4, 8):
        codes = torch.randint(0, 1 << bits, (5, 37), generator=gen)
        assert torch.equal(unpack_codes(pack_codes(codes, bits), bits, 37), codes.int())


CASES = {  # bits, group, zeros, g_idx, K
    "4-bit g32 sym": (4, 32, False, False, 200),  # K: 6 groups and a part, 3 tiles and a part
    "4-bit g128 zeros": (4, 128, True, False, 328),  # a group spans two tiles
    "4-bit per-channel": (4, 1 << 20, True, False, 96),
    "4-bit g32 g_idx": (4, 32, True, True, 136),
    "8-bit g64 sym": (8, 64, False, False, 200),
    "8-bit g32 g_idx sym": (8, 32, False, True, 96),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
@pytest.mark.parametrize("rows,dtype", [(1, torch.bfloat16), (1, torch.float32),
                                        (5, torch.float16), (19, torch.float32),
                                        (40, torch.bfloat16), (40, torch.float32)])
def test_linear_matches_dequantized_reference(case, rows, dtype):
    bits, group, zeros, g_idx, k = case
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    n = 40  # 2 tiles and a half
    weight = random_weight(n, k, bits, group, zeros, g_idx, dtype, gen)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if rows == 5 else None
    w = weight.dequantize().float()
    expected = x.float() @ w.t()
    # float32 sums in another order: within a few units of 2^-23 of the sum of |terms|;
    # then each side's cast to the output dtype: the reference's rounds, the interpreter's
    # truncates (the GPU rounds), so up to 1.5 units of it apart
    bound = x.float().abs() @ w.abs().t()
    if bias is not None:
        expected += bias.float()
        bound += bias.float().abs()
    got = linear(x, weight, bias, SMALL)
    assert got.dtype == dtype and got.shape == (rows, n)
    ulp = {torch.float32: 0.0, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}[dtype]
    err = (got.float() - expected.to(dtype).float()).abs()
    limit = 1.5 * ulp * expected.abs() + 1e-6 * bound
    if rows == 1:  # the GEMVs keep each weight in float32, unrounded: half an ulp of it each
        limit += ulp / 2 * bound
    if rows >= SMALL.dequant_min_rows:  # the weight written out in dtype: the interpreter's
        limit += ulp * bound  # cast truncates it (the GPU's rounds), then a float matmul
    assert (err <= limit).all(), f"seed {seed}: worst {float((err - limit).max())} over"


def test_linear_keeps_leading_dims_and_empty_batches():
    gen = torch.Generator().manual_seed(fresh_seed())
    weight = random_weight(8, 64, 4, 32, False, False, torch.float32, gen)
    x = torch.randn(2, 3, 64, generator=gen)
    torch.testing.assert_close(linear(x, weight, None, SMALL),
                               x @ weight.dequantize().t(), atol=1e-5, rtol=1e-5)
    assert linear(x[:0], weight, None, SMALL).shape == (0, 3, 8)
