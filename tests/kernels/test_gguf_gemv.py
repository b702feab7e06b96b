"""The one-row GGUF GEMV (`kernels/triton/gguf_gemv.py`) under TRITON_INTERPRET=1 against x @
the `gguf` package's dequantization of the same bytes (each weight rounded to the activation
dtype, as `int_linear`'s kernels round it): every type it takes, N not a multiple of the rows
per program, K slices and steps that leave ragged super-blocks, a bias, bfloat16; and
`int_linear.linear` taking it for one row."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from pagedserve.kernels.gguf_format import BLOCKS, GgufWeight
from pagedserve.kernels.triton import gguf_gemv
from pagedserve.kernels.triton.int_linear import linear
from tests.kernels.test_gguf_kernel import IDS, TYPES, random_blocks, reference
from tests.kernels.test_kernels import fresh_seed

GEMV_TYPES = [t for t in TYPES if t in gguf_gemv.TYPES]
GEMV_IDS = [name for t, name in zip(TYPES, IDS) if t in gguf_gemv.TYPES]


def tiny(qtype: int, programs: int):
    """4 rows of 2 blocks a program; `programs` programs per "SM" (one, interpreted), so that
    K is cut into slices of whole steps."""
    return replace(gguf_gemv.ONE_ROW, block_n=4, block_k=2 * BLOCKS[qtype][0], min_block_n=0,
                   programs_per_sm=programs)


def _blocks(qtype: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the blocks, uint8 [n, row bytes] starting on 16 bytes; the reference weight)."""
    blocks = random_blocks(qtype, n, k, np.random.default_rng(seed))
    aligned = torch.empty(blocks.size + 16, dtype=torch.uint8)
    start = (-aligned.data_ptr()) % 16
    t = aligned[start:start + blocks.size].view(blocks.shape)
    t.copy_(torch.from_numpy(blocks))
    return t, reference(blocks, qtype)


def _check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias, seed: int) -> None:
    w = w.to(x.dtype).double()  # rounded to the activation dtype, as the kernels do
    expected = x.double() @ w.T + (0 if bias is None else bias.double())
    # float32 sums in another order, then one rounding to y's dtype
    bound = (x.double().abs() @ w.abs().T) * 1e-5 + 1e-6
    if y.dtype != torch.float32:
        bound = bound + expected.abs() * torch.finfo(y.dtype).eps
    assert ((y.double() - expected).abs() <= bound).all(), f"seed {seed}"


@pytest.mark.parametrize("qtype", GEMV_TYPES, ids=GEMV_IDS)
@pytest.mark.parametrize("k_blocks,programs", [(5, 1), (5, 12), (3, 40)],
                         ids=["whole-K", "split-K", "split-ragged-slice"])
def test_gemv_matches_dequantized_matmul(qtype, k_blocks, programs):
    """N = 9 (rows per program 4: a ragged last tile); K of 5 or 3 blocks (steps of 2: a
    ragged last step); split so that slices end mid-step or hold one step."""
    seed = fresh_seed()
    n, k = 9, k_blocks * BLOCKS[qtype][0]
    blocks, w = _blocks(qtype, n, k, seed)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    cfg = tiny(qtype, programs)
    y = gguf_gemv.gemv(x, blocks, qtype, bias, cfg=cfg)
    _check(y, x, w, bias, seed)
    no_bias = gguf_gemv.gemv(x, blocks, qtype, cfg=cfg)
    _check(no_bias, x, w, None, seed)


@pytest.mark.parametrize("qtype", GEMV_TYPES, ids=GEMV_IDS)
def test_gemv_bfloat16_rounds_each_weight(qtype):
    seed = fresh_seed()
    n, k = 6, 2 * BLOCKS[qtype][0]
    blocks, w = _blocks(qtype, n, k, seed)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(seed)).bfloat16()
    out = torch.full((1, n), float("nan"), dtype=torch.bfloat16)
    y = gguf_gemv.gemv(x, blocks, qtype, out=out, cfg=tiny(qtype, 8))
    assert y is out
    _check(y, x, w, None, seed)


@pytest.mark.parametrize("qtype", GEMV_TYPES, ids=GEMV_IDS)
def test_linear_takes_the_gemv_for_one_aligned_row(qtype):
    """`int_linear.linear` on one row: the GEMV where the blocks start on 16 bytes, the
    general kernel on a view that does not; both the same product."""
    seed = fresh_seed()
    n, k = 5, BLOCKS[qtype][0]
    blocks, w = _blocks(qtype, n, k, seed)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(seed))
    assert gguf_gemv.takes(x, qtype, blocks)
    _check(linear(x, GgufWeight(blocks, qtype, k)), x, w, None, seed)
    shifted = torch.empty(blocks.numel() + 1, dtype=torch.uint8)[1:].view(blocks.shape)
    shifted.copy_(blocks)
    assert not gguf_gemv.takes(x, qtype, shifted)
    _check(linear(x, GgufWeight(shifted, qtype, k)), x, w, None, seed)
