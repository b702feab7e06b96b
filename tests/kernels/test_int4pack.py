"""torch's CUDA int4 layout (`kernels/int4pack.py`), checked on the CPU: `pack_reference`
below emulates CUDA's `_convert_weight_to_int4pack` (aten/src/ATen/native/cuda/int4mm.cu,
`matrix_to_m16n8k16_Bint4_layout`, line for line; tests/gpu/test_gpu_int4.py holds it to the
real conversion bit for bit), `int4pack.unpack_reference` must invert it, and the Triton
dequantization (`int_linear.dequantize`, TRITON_INTERPRET=1) must read (code - 8) * scale +
offset out of it. torch on the CPU cannot run the CUDA conversion, but two of its parts
check what they can here: the conversion's meta kernel declares its shape, and the CPU's own
int4 matmul (`_weight_int4pack_mm_for_cpu`, another layout of the codes, the same
(scale, offset) table as CUDA's) gives the products of the reference dequantization."""

from dataclasses import replace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from pagedserve.kernels import int4pack
from pagedserve.kernels.triton.int_linear import (Int4Path, IntLinearConfig, dequantize,
                                                   int4pack_linear, int4pack_path)
from pagedserve.kernels.weight_formats import unpack_codes
from tests.kernels.test_int_linear import random_weight
from tests.kernels.test_kernels import fresh_seed

# small tiles: several programs along N and K
SMALL = IntLinearConfig(dequant_block_n=16, dequant_block_k=128)


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


@pytest.mark.parametrize("inner_k_tiles", [2, 4, 8])
def test_emulated_packing_has_the_shapes_torch_declares(inner_k_tiles):
    """torch's shape rules for its CUDA int4 ops, which run without CUDA on fake tensors: the
    conversion's output has the emulation's shape, and the int4 matmul reads N as 8 rows
    per first index, as `Int4Weight.shape` does."""
    cases = [(8, 128), (24, 384), (1032, 256)]
    emulated = [pack_reference(torch.zeros(n, k // 2, dtype=torch.uint8), inner_k_tiles)
                for n, k in cases]
    with FakeTensorMode():
        for (n, k), packed in zip(cases, emulated):
            declared = torch.ops.aten._convert_weight_to_int4pack(
                torch.empty(n, k // 2, dtype=torch.uint8), inner_k_tiles)
            assert declared.dtype == torch.int32 and declared.shape == packed.shape
            y = torch.ops.aten._weight_int4pack_mm(
                torch.empty(5, k, dtype=torch.bfloat16),
                torch.empty(packed.shape, dtype=torch.int32), 128,
                torch.empty(k // 128, n, 2, dtype=torch.bfloat16))
            assert tuple(y.shape) == (5, n)
    assert int4pack.Int4Weight(emulated[1], None, 128, 384).shape == (24, 384)


@pytest.mark.parametrize("group,zeros", [(32, True), (128, False), (256, True)])
def test_torchs_cpu_int4_kernel_gives_the_reference_products(group, zeros):
    """torch's CPU int4 matmul, on a weight's codes (in the CPU's layout) and the table
    `int4pack.scales_and_offsets` made, equals x @ the reference dequantization of the
    emulated CUDA layout in float32: the table means to torch's kernels what the reference
    and the Triton dequantization take it to mean (zero points' offsets included), and the
    codes come back out of the layout where they went in. A symmetric weight's reference
    values are the checkpoint's own, exactly."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    n, k = 32, 512  # the CPU's conversion takes N in multiples of 16
    w = random_weight(n, k, 4, group, zeros, False, torch.bfloat16, gen)
    codes = unpack_codes(w.qweight, 4, k)
    table = int4pack.scales_and_offsets(w)
    reference = int4pack.Int4Weight(pack_reference(pairs_of(codes)), table, group,
                                    k).dequantize(torch.float32)
    x = torch.randn(5, k, generator=gen)
    cpu_codes = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.int(),
                                                                   int4pack.INNER_K_TILES)
    got = torch.ops.aten._weight_int4pack_mm_for_cpu(x, cpu_codes, group, table.float())
    expected = x @ reference.t()
    bound = x.abs() @ reference.abs().t()  # float32 sums in another order: ~1e-6 of it
    assert ((got - expected).abs() <= 2**-16 * bound).all(), f"seed {seed}"
    if not zeros:
        assert torch.equal(reference, w.dequantize(torch.float32))


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


def test_the_row_rule_takes_the_fused_gemm_between_torchs_kernel_and_the_dequantization():
    """A weight in torch's int4 layout: torch's kernel for a few bfloat16 rows (a batch-1
    decode), the fused GEMM for decode batches, verify and short prefill chunks past them up
    to `int4pack_gemm_max_rows`, dequantize + cuBLAS for longer prefills; activations torch's
    kernel does not take go to the fused GEMM from one row."""
    bf16 = torch.bfloat16
    assert [int4pack_path(m, bf16) for m in (1, 4, 7)] == [Int4Path.TORCH_KERNEL] * 3
    assert [int4pack_path(m, bf16) for m in (8, 16, 64, 256)] == [Int4Path.FUSED_GEMM] * 4
    assert [int4pack_path(m, bf16) for m in (257, 4096)] == [Int4Path.DEQUANTIZE] * 2
    assert int4pack_path(0, bf16) == Int4Path.FUSED_GEMM  # no rows: an empty result
    for dtype in (torch.float16, torch.float32):
        assert int4pack_path(1, dtype) == Int4Path.FUSED_GEMM
        assert int4pack_path(257, dtype) == Int4Path.DEQUANTIZE


@pytest.mark.parametrize("rows,dtype,config", [
    (0, torch.bfloat16, SMALL),
    (3, torch.float32, SMALL),  # the fused GEMM: activations torch's kernel does not take
    (17, torch.bfloat16, SMALL),  # the fused GEMM
    (17, torch.bfloat16, replace(SMALL, int4pack_gemm_max_rows=16)),  # dequantized
    (5, torch.float32, replace(SMALL, int4pack_gemm_max_rows=4)),  # dequantized
])
def test_int4pack_linear_is_x_times_the_reference_dequantization(rows, dtype, config):
    """`int4pack_linear` past torch's kernel's rows (or on activations it does not take),
    on the fused GEMM or the weight dequantized from torch's layout, as its rule picks:
    x @ (the dequantized weight)^T + bias, over leading dims as a linear layer's input."""
    gen = torch.Generator().manual_seed(fresh_seed())
    weight, codes, scales, offsets = int4_weight(16, 256, 64, True, gen)
    x = torch.randn(1, rows, 256, generator=gen).to(dtype)
    bias = torch.randn(16, generator=gen).to(dtype)
    w = ((codes - 8) * scales + offsets).to(dtype)
    got = int4pack_linear(x, weight, bias, config)
    assert got.dtype == dtype and got.shape == (1, rows, 16)
    expected = torch.nn.functional.linear(x.float(), w.float(), bias.float())
    bound = x.float().abs() @ w.float().abs().t() + bias.float().abs()
    ulp = {torch.float32: 2.0**-20, torch.bfloat16: 2.0**-6}[dtype]
    assert ((got.float() - expected).abs() <= ulp * bound + 1e-6).all()
