"""GGUF weights in their blocks (`kernels/gguf_format.py`) under TRITON_INTERPRET=1, on random
blocks of every type kept quantized on the GPU: the torch reference and the Triton unpacking
(`gguf_dequant`, read back through the GEMM with the identity as x) against the `gguf`
package's `dequantize` of the same bytes, bit for bit; the GEMV (one row) and the GEMM
(several) of `int_linear` against x @ that weight^T on ragged shapes (N not a multiple of the
tile, K not a multiple of the K tile); tensor-parallel slices of the blocks."""

from dataclasses import replace

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from pagedserve.kernels.gguf_format import BLOCKS, GgufWeight
from pagedserve.kernels.triton.int_linear import IntLinearConfig, linear
from pagedserve.model.gguf_weights import GgufBlocks
from tests.kernels.test_kernels import fresh_seed

TYPES = sorted(BLOCKS)
IDS = [GGMLQuantizationType(t).name for t in TYPES]
# where each type keeps its float16 scales in a block: (offset, count)
F16_FIELDS = {2: (0, 1), 3: (0, 2), 8: (0, 1), 12: (0, 2), 13: (0, 2), 14: (208, 1)}
# K tiles of 512: the shapes below take two, the second ragged; from 16 rows the weight is
# dequantized into a float tensor first
SMALL = IntLinearConfig(gemv_block_n=16, gemv_block_k=512, gemm_block_m=16, gemm_block_n=16,
                        gemm_block_k=512, dequant_min_rows=16, dequant_block_n=16,
                        dequant_block_k=512)
GEMM_ONLY = replace(SMALL, dequant_min_rows=1 << 30)


def random_blocks(qtype: int, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [n, row bytes]: random bytes (every bit pattern of quants and 6-bit/int8 scales
    is a valid block) with finite float16 scales of a model's magnitude."""
    weights, size = BLOCKS[qtype]
    assert GGML_QUANT_SIZES[GGMLQuantizationType(qtype)] == (weights, size)
    blocks = rng.integers(0, 256, (n, k // weights, size), dtype=np.uint8)
    offset, count = F16_FIELDS[qtype]
    scales = (rng.standard_normal((n, k // weights, count)) * 0.01).astype(np.float16)
    blocks[..., offset:offset + 2 * count] = scales.view(np.uint8)
    return blocks.reshape(n, -1)


def reference(blocks: np.ndarray, qtype: int) -> torch.Tensor:
    return torch.from_numpy(gguf_dequantize(blocks, GGMLQuantizationType(qtype)).copy())


@pytest.mark.parametrize("config", [GEMM_ONLY, SMALL], ids=["gemm", "dequantized"])
@pytest.mark.parametrize("qtype", TYPES, ids=IDS)
def test_unpacking_equals_gguf_dequantize(qtype, config):
    seed = fresh_seed()
    k = 2 * BLOCKS[qtype][0]
    blocks = random_blocks(qtype, 21, k, np.random.default_rng(seed))
    weight = GgufWeight(torch.from_numpy(blocks), qtype, k)
    expected = reference(blocks, qtype)
    assert torch.equal(weight.dequantize(), expected), f"seed {seed}"
    # I @ W^T = W^T exactly: float32 products by 1 and sums with 0
    unpacked = linear(torch.eye(k), weight, config=config).T
    assert torch.equal(unpacked, expected), f"seed {seed}"


@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("qtype", TYPES, ids=IDS)
def test_linear_matches_dequantized_matmul(qtype, rows):
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    k = 672 if BLOCKS[qtype][0] == 32 else 768  # 21 or 3 blocks
    n = 37  # not a multiple of any tile
    blocks = random_blocks(qtype, n, k, rng)
    w = reference(blocks, qtype)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k + 5, generator=gen)[:, 5:]  # a strided view, as of a wider tensor
    bias = torch.randn(n, generator=gen)
    y = linear(x, GgufWeight(torch.from_numpy(blocks), qtype, k), bias, config=SMALL)
    expected = x.double() @ w.double().T + bias.double()
    # float32 sums in another order: errors scale with the sum of |products|
    bound = (x.abs().double() @ w.abs().double().T) * 1e-5 + 1e-6
    assert ((y.double() - expected).abs() <= bound).all(), f"seed {seed}"


def test_rows_of_the_wrong_length_are_refused():
    with pytest.raises(ValueError, match="multiple"):
        GgufWeight(torch.zeros(4, 18, dtype=torch.uint8), 2, 100)
    with pytest.raises(ValueError, match="do not hold"):
        GgufWeight(torch.zeros(4, 18, dtype=torch.uint8), 2, 64)


def test_tensor_parallel_slices_of_blocks():
    """A row-parallel rank's input features on block boundaries are its blocks' bytes; off
    them, a clear error. A column-parallel rank's rows (-1: vocab padding) are whole rows."""
    rng = np.random.default_rng(fresh_seed())
    blocks = random_blocks(14, 6, 768, rng)  # Q6_K, three 256-weight blocks per row
    whole = GgufBlocks(14, torch.from_numpy(blocks), 768)
    w = reference(blocks, 14)
    half = whole.take(1, list(range(256, 768)))
    assert half.shape == (6, 512)
    assert torch.equal(GgufWeight(half.blocks.contiguous(), 14, 512).dequantize(), w[:, 256:])
    rows = GgufWeight(whole.take(0, [4, 1, -1]).blocks, 14, 768).dequantize()
    assert torch.equal(rows[:2], w[[4, 1]]) and not rows[2].any()
    with pytest.raises(ValueError, match="boundaries of its GGUF blocks of 256"):
        whole.take(1, list(range(384)))
