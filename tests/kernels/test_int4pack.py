"""torch's CUDA int4 layout (`kernels/int4pack.py`), checked on the CPU: `pack_reference`
below emulates CUDA's `_convert_weight_to_int4pack` (aten/src/ATen/native/cuda/int4mm.cu,
`matrix_to_m16n8k16_Bint4_layout`, line for line; tests/gpu/test_gpu_int4.py holds it to the
real conversion bit for bit), `int4pack.unpack_reference` must invert it, and the Triton
dequantization (`int_linear.dequantize`, TRITON_INTERPRET=1) must read (code - 8) * scale +
offset out of it. The CPU's own `_convert_weight_to_int4pack_for_cpu` uses another layout
and is not what these emulate."""

import pytest
import torch

from pagedserve.kernels import int4pack
from pagedserve.kernels.triton.int_linear import IntLinearConfig, dequantize, linear
from tests.kernels.test_int_linear import random_weight
from tests.kernels.test_kernels import fresh_seed

# small tiles: several programs along N and K, a K tile narrower than the layout's 128
SMALL = IntLinearConfig(dequant_block_n=16, dequant_block_k=64)


def pack_reference(pairs: torch.Tensor, inner_k_tiles: int = int4pack.INNER_K_TILES
                   ) -> torch.Tensor:
    """uint8 [N, K / 2] (code of column 2i in the high nibble of byte i, 2i + 1 in the low)
    -> int32 [ceil(N / 8), K / (inner_k_tiles * 16), 32, inner_k_tiles / 2], as the CUDA
    kernel writes it: block (n tile, k super-tile), lane t, word innerKTile / 2."""
    n, half = pairs.shape
    n_tiles, k_super = -(-n // 8), half * 2 // (inner_k_tiles * 16)
    n_tile = torch.arange(n_tiles).view(-1, 1, 1, 1)
    k_outer = torch.arange(k_super).view(1, -1, 1, 1)
    t = torch.arange(32).view(1, 1, -1, 1)
    inner_k_tile = (torch.arange(inner_k_tiles // 2) * 2).view(1, 1, 1, -1)
    n0 = n_tile * 8 + t // 4
    k_base0 = (k_outer * inner_k_tiles + inner_k_tile) * 16 // 2
    k_base1 = k_base0 + 16 // 2
    ks = [k_base0 + t % 4, k_base0 + t % 4 + 4, k_base1 + t % 4, k_base1 + t % 4 + 4]
    source = pairs.long()
    v = []
    for k_i in ks:
        valid = (n0 < n) & (k_i < half)
        v.append(torch.where(valid, source[n0.clamp(max=n - 1), k_i.clamp(max=half - 1)], 0))
    word = (((v[3] & 0xF) << 28) | ((v[2] & 0xF) << 24) | ((v[1] & 0xF) << 20)
            | ((v[0] & 0xF) << 16) | ((v[3] & 0xF0) << 8) | ((v[2] & 0xF0) << 4)
            | (v[1] & 0xF0) | ((v[0] & 0xF0) >> 4))
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def pairs_of(codes: torch.Tensor) -> torch.Tensor:
    """Codes [N, K] -> the uint8 [N, K / 2] that `_convert_weight_to_int4pack` takes."""
    return ((codes[:, ::2] << 4) | codes[:, 1::2]).to(torch.uint8)


def test_unpack_reference_inverts_the_cuda_packing():
    gen = torch.Generator().manual_seed(fresh_seed())
    n, k = 24, 384  # 3 row tiles, 3 column super-tiles
    codes = torch.randint(0, 16, (n, k), generator=gen)
    packed = pack_reference(pairs_of(codes))
    assert packed.shape == (n // 8, k // 128, 32, 4) and packed.dtype == torch.int32
    assert torch.equal(int4pack.unpack_reference(packed, n, k), codes.int())
    # one code alone lands in one nibble of one word: the layout is a permutation
    lone = torch.zeros(n, k, dtype=torch.long)
    lone[13, 77] = 5
    assert int(pack_reference(pairs_of(lone)).ne(0).sum()) == 1


def int4_weight(n: int, k: int, group: int, zeros: bool, gen: torch.Generator):
    """A random 4-bit weight in the emulated CUDA layout (the table made by
    `int4pack.scales_and_offsets`), and its codes, scales and offsets [N, K] in float32."""
    w = random_weight(n, k, 4, group, zeros, False, torch.bfloat16, gen)
    codes = torch.randint(0, 16, (n, k), generator=gen)
    table = int4pack.scales_and_offsets(w)
    weight = int4pack.Int4Weight(pack_reference(pairs_of(codes)), table, group, k)
    per_column = table.float().repeat_interleave(group, dim=0)
    return weight, codes.float(), per_column[..., 0].t(), per_column[..., 1].t()


@pytest.mark.parametrize("group,zeros", [(32, True), (128, False), (256, True)])
def test_dequantizing_from_the_layout_reads_each_code_its_group(group, zeros):
    seed = fresh_seed()
    weight, codes, scales, offsets = int4_weight(24, 512, group, zeros,
                                                 torch.Generator().manual_seed(seed))
    expected = (codes - 8) * scales + offsets  # float32: the product exact, one rounding
    assert torch.equal(dequantize(weight, torch.float32, SMALL), expected), f"seed {seed}"
    assert torch.equal(weight.dequantize(torch.float32), expected), f"seed {seed}"
    # bfloat16: the interpreter's cast truncates where torch's rounds: one unit apart at most
    got = dequantize(weight, torch.bfloat16, SMALL).float()
    ulp = 2.0 ** (torch.floor(torch.log2(expected.abs().clamp(min=1e-30))) - 7)
    assert ((got - expected.to(torch.bfloat16).float()).abs() <= ulp).all(), f"seed {seed}"


@pytest.mark.parametrize("rows,dtype", [(3, torch.float32), (17, torch.bfloat16)])
def test_linear_dequantizes_a_weight_in_torchs_layout_past_its_kernel(rows, dtype):
    """Rows past `int4pack_max_rows` (or activations torch's kernel does not take) run on
    the weight dequantized from torch's layout: x @ (the dequantized weight)^T + bias."""
    gen = torch.Generator().manual_seed(fresh_seed())
    weight, codes, scales, offsets = int4_weight(16, 256, 64, True, gen)
    x = torch.randn(rows, 256, generator=gen).to(dtype)
    bias = torch.randn(16, generator=gen).to(dtype)
    w = ((codes - 8) * scales + offsets).to(dtype)
    got = linear(x, weight, bias, SMALL)
    assert got.dtype == dtype and got.shape == (rows, 16)
    expected = torch.nn.functional.linear(x.float(), w.float(), bias.float())
    bound = x.float().abs() @ w.float().abs().t() + bias.float().abs()
    ulp = {torch.float32: 2.0**-22, torch.bfloat16: 2.0**-6}[dtype]
    assert ((got.float() - expected).abs() <= ulp * bound + 1e-6).all()
