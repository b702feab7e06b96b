"""The FP8 linear layers' kernels under TRITON_INTERPRET=1: the activation quantization (CUDA's
path for many tokens) against the torch quantization the CPU reference uses, bit for bit; the
weight-only product (CUDA's path for decode steps, K whole or split) against the
dequantized weight; e4m3 read by bit moves against torch's cast."""

from dataclasses import replace

import pytest
import torch

import triton
import triton.language as tl

from pagedserve.kernels.fp8_format import FP8_DTYPE
from pagedserve.kernels.triton.arrivals import arrival_counters
from pagedserve.kernels.triton.e4m3 import E4M3_WORD_F32_UNSCALE, e4m3_bits, e4m3_word_f32
from pagedserve.model import fp8
from pagedserve.kernels.triton.fp8_linear import (WeightOnlyConfig, narrowed, quantize_tokens,
                                         split_k, weight_only_linear)
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


# one program per 16 rows of N; K split in 2 (600 = 3 tiles of 256: slices of 2 and 1
# tiles); in 3 (one tile each: more slices than that cannot be); e4m3 by bit moves
CONFIGS = {"no split": WeightOnlyConfig(16, 256, 4, 2),
           "split 2": WeightOnlyConfig(16, 256, 4, 2, programs_per_sm=4),
           "split 3": WeightOnlyConfig(16, 256, 4, 2, programs_per_sm=64),
           "split bits": WeightOnlyConfig(16, 256, 4, 2, programs_per_sm=64, bits=True),
           # one row without tl.dot (more rows take tl.dot still)
           "fma": WeightOnlyConfig(16, 256, 4, 2, fma=True),
           "fma split 3 bits": WeightOnlyConfig(16, 256, 4, 2, programs_per_sm=64, bits=True,
                                                fma=True),
           # one row in 4x1024 tiles (`narrowed`), K whole
           "fma narrowed": WeightOnlyConfig(16, 256, 4, 2, programs_per_sm=64, fma=True,
                                            min_block_n=4)}


@pytest.mark.parametrize("cfg", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("num_rows,dtype", [(1, torch.float16), (3, torch.float32),
                                            (16, torch.float16)])
def test_weight_only_linear_matches_dequantized_weights(num_rows, dtype, cfg):
    """Ragged N and K (not multiples of the tiles), with and without bias, K whole or split:
    the product of the unquantized activations with the dequantized weight, in float32.
    (fp16, not bf16: the interpreter's bf16 tl.dot is broken, see test_kernels.py; e4m3
    casts exactly to both.)"""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    n, k = 37, 600
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
    counters = arrival_counters(triton.cdiv(n, cfg.block_n), x.device)
    assert not counters.any(), "a replayed split launch would reduce at the wrong arrival"


def test_one_row_off_words_takes_tl_dot():
    """A row of K = 602 cannot be read as int32 words: the one-row config's tl.dot
    fallback still gives the product."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    w_q, w_scale = fp8.quantize_rows(torch.randn(37, 602, generator=gen))
    x = torch.randn(1, 602, generator=gen).to(torch.float16)
    want = x.float() @ (w_q.float() * w_scale[:, None]).t()
    got = weight_only_linear(x, w_q, w_scale, None, CONFIGS["fma"])
    torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=1e-2, msg=f"seed {seed}")


def test_split_k_fills_the_sms_without_empty_slices():
    cfg = WeightOnlyConfig(block_n=32, block_k=512, programs_per_sm=4)
    # Llama-3-8B on 132 SMs: qkv 192 tiles x 3, o 128 x 4 (8 tiles of K, 2 per slice),
    # down 128 x 5 (28 tiles, 6 per slice), gate_up's 896 tiles need no split
    assert split_k(6144, 4096, 132, cfg) == (3, 3 * 512)
    assert split_k(4096, 4096, 132, cfg) == (4, 2 * 512)
    assert split_k(4096, 14336, 132, cfg) == (5, 6 * 512)
    assert split_k(28672, 4096, 132, cfg) == (1, 8 * 512)
    assert split_k(4096, 4096, 132, WeightOnlyConfig(programs_per_sm=0)) == (1, 8 * 512)
    one_row = WeightOnlyConfig(16, 256, programs_per_sm=5, min_block_n=4)
    # Llama-3-8B's q/k/v to 8x512 tiles, o and down to 4x1024, gate/up kept, none split
    assert [(c.block_n, c.block_k, split_k(n, k, 132, c)[0]) for n, k, c in (
        (n, k, narrowed(n, 132, one_row)) for n, k in
        ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)))] == [
        (8, 512, 1), (4, 1024, 1), (16, 256, 1), (4, 1024, 1)]
    assert narrowed(4096, 132, replace(one_row, min_block_n=0)) == replace(one_row,
                                                                            min_block_n=0)
    for n, k in ((4096, 300), (64, 100_000), (100_000, 64)):
        splits, per = split_k(n, k, 132, cfg)
        assert per % cfg.block_k == 0 and (splits - 1) * per < k <= splits * per


def test_e4m3_bits_reads_every_value_exactly():
    """Every finite e4m3 value (subnormals and both zeros included) to bfloat16 and float16
    by `e4m3_bits`, bit for bit as torch casts it."""
    x = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE)
    finite = x.float().isfinite()
    for dtype in (torch.bfloat16, torch.float16):
        y = torch.empty(256, dtype=dtype)
        _read_bits[(1,)](x, y, N=256)
        assert torch.equal(y[finite].view(torch.int16), x[finite].to(dtype).view(torch.int16))


@triton.jit
def _read_bits(x_ptr, y_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(y_ptr + offs, e4m3_bits(tl.load(x_ptr + offs), y_ptr.dtype.element_ty))


def test_e4m3_word_f32_reads_every_value_in_every_byte():
    """Every finite e4m3 value in each of a word's four bytes (the others holding other
    values, sign bits set) to float32 by `e4m3_word_f32`, times 2^120: torch's cast."""
    values = torch.arange(256, dtype=torch.uint8)
    words = torch.stack([values.roll(-j) for j in range(4)], dim=1)  # byte j of word i: i + j
    got = torch.empty(256, 4)
    _read_words[(1,)](words.contiguous().view(torch.int32), got, N=256)
    want = words.view(FP8_DTYPE).float()
    finite = want.isfinite()
    assert torch.equal(got[finite], want[finite])


@triton.jit
def _read_words(w_ptr, y_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    w = tl.load(w_ptr + offs)
    for j in tl.static_range(4):
        tl.store(y_ptr + offs * 4 + j, e4m3_word_f32(w, j) * E4M3_WORD_F32_UNSCALE)
