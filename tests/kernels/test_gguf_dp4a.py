"""The int8-activation GGUF GEMV (`kernels/triton/gguf_dp4a.py`) under TRITON_INTERPRET=1 (its
dp4a summed by integer ops there): the row's quantization bit for bit against
`quantize_reference`; the GEMV against the dequantized blocks times the dequantized int8 row
(float32 sums in another order) on ragged N, K split and whole; the error against the exact
float row within the bound the quantization's half step gives; `int_linear` taking it for one
bfloat16 row unless told not to."""

from dataclasses import replace

import pytest
import torch

from pagedserve.kernels.gguf_format import BLOCKS, GgufWeight
from pagedserve.kernels.triton import gguf_dp4a, gguf_gemv
from pagedserve.kernels.triton.int_linear import FLOAT_GGUF_ACTIVATIONS, linear
from tests.kernels.test_gguf_gemv import _blocks
from tests.kernels.test_kernels import fresh_seed

TYPES = list(gguf_dp4a.TYPES)
IDS = ["Q4_K", "Q6_K"]


def quantize_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`gguf_dp4a.quantize` in torch: per 32 columns d = amax / 127 and codes
    round(x / d) (round half to even), each one float32 division, as the kernel divides;
    d = 0 and zero codes for an all-zero block."""
    blocks = x.float().reshape(-1, gguf_dp4a.QBLOCK)
    d = blocks.abs().amax(1) / 127
    nonzero = (d > 0)[:, None]
    v = torch.where(nonzero, blocks / torch.where(nonzero, d[:, None], 1.0), 0.0)
    codes = torch.round(v).to(torch.int8)
    return codes.flatten(), d, codes.int().sum(1, dtype=torch.int32)


def dequantized_row(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The row the int8 path multiplies: code * d, float64 [1, K]."""
    return (codes.double().reshape(-1, gguf_dp4a.QBLOCK) * scales.double()[:, None]).reshape(
        1, -1)


def random_row(k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """x [1, k]: normal, with an all-zero block, one of a single value and one spike."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, k, generator=gen)
    x[0, 32:64] = 0
    if k >= 128:
        x[0, 64:96] = -0.75
        x[0, 100] = 40.0
    return x.to(dtype)


def tiny(qtype: int, programs: int):
    """4 rows of 2 super-blocks a program, `programs` programs per "SM" (one, interpreted)."""
    return replace(gguf_dp4a.Q4_K_ONE_ROW, block_n=4, block_k=512, min_block_n=0,
                   programs_per_sm=programs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [96, 800, 1056, 4096 + 288])
def test_quantize_matches_reference_bit_for_bit(k, dtype):
    """K not a multiple of a program's 512 columns (a ragged last program)."""
    seed = fresh_seed()
    x = random_row(k, dtype, seed)
    codes, scales, sums = gguf_dp4a.quantize(x)
    ref_codes, ref_scales, ref_sums = quantize_reference(x)
    assert torch.equal(codes, ref_codes), f"seed {seed}"
    assert torch.equal(scales.view(torch.int32), ref_scales.view(torch.int32)), f"seed {seed}"
    assert torch.equal(sums, ref_sums), f"seed {seed}"
    assert (scales[1] == 0) and (codes[32:64] == 0).all()
    assert codes.abs().max() == 127


def _check(y: torch.Tensor, x_hat: torch.Tensor, w: torch.Tensor, bias, seed: int) -> None:
    """y against x_hat @ w^T (+ bias) in float64: float32 sums in another order, then one
    rounding to y's dtype."""
    w = w.double()
    expected = x_hat @ w.T + (0 if bias is None else bias.double())
    bound = (x_hat.abs() @ w.abs().T) * 1e-5 + 1e-6 + expected.abs() * torch.finfo(y.dtype).eps
    assert ((y.double() - expected).abs() <= bound).all(), f"seed {seed}"


@pytest.mark.parametrize("qtype", TYPES, ids=IDS)
@pytest.mark.parametrize("k_blocks,programs", [(5, 1), (5, 12), (3, 40)],
                         ids=["whole-K", "split-K", "split-ragged-slice"])
def test_gemv_matches_dequantized_int8_row(qtype, k_blocks, programs):
    """N = 9 (a ragged last tile of 4 rows); K of 5 or 3 super-blocks (steps of 2: a ragged
    last step); split so that slices end mid-step or hold one step; with and without a
    bias."""
    seed = fresh_seed()
    n, k = 9, 256 * k_blocks
    blocks, w = _blocks(qtype, n, k, seed)
    x = random_row(k, torch.bfloat16, seed)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(seed)).bfloat16()
    x_hat = dequantized_row(*quantize_reference(x)[:2])
    cfg = tiny(qtype, programs)
    _check(gguf_dp4a.gemv(x, blocks, qtype, bias, cfg=cfg), x_hat, w, bias, seed)
    out = torch.full((1, n), float("nan"), dtype=torch.bfloat16)
    y = gguf_dp4a.gemv(x, blocks, qtype, out=out, cfg=cfg)
    assert y is out
    _check(y, x_hat, w, None, seed)


@pytest.mark.parametrize("qtype", TYPES, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int8_row_error_within_half_a_step(qtype, dtype):
    """Against the exact x @ W (float64): each code is within half a step d of x / d (plus
    the float32 division's rounding, < 2^-16 of a step), so |y - x @ W^T| <=
    sum_j (d_j / 2 + d_j 2^-16) |W_j| + the float32 sums' noise + y's rounding. On normal
    rows that bound is itself a small fraction of |x| @ |W|^T (the step is amax / 127)."""
    seed = fresh_seed()
    n, k = 7, 1024
    blocks, w = _blocks(qtype, n, k, seed)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(seed)).to(dtype)
    codes, scales, _ = quantize_reference(x)
    steps = scales.double().repeat_interleave(gguf_dp4a.QBLOCK)[None]
    w = w.double()
    exact = x.double() @ w.T
    y = gguf_dp4a.gemv(x, blocks, qtype, cfg=tiny(qtype, 4)).double()
    x_hat = dequantized_row(codes, scales)
    bound = ((steps * (0.5 + 2.0 ** -16)) @ w.abs().T + (x_hat.abs() @ w.abs().T) * 1e-5
             + 1e-6 + y.abs() * torch.finfo(dtype).eps)
    assert ((y - exact).abs() <= bound).all(), f"seed {seed}"
    assert (bound < 0.05 * (x.double().abs() @ w.abs().T)).all()


@pytest.mark.parametrize("qtype", TYPES, ids=IDS)
def test_linear_takes_the_int8_path_for_one_half_precision_row(qtype):
    """`int_linear.linear` on one bfloat16 row: `gguf_dp4a` by default, `gguf_gemv` with
    FLOAT_GGUF_ACTIVATIONS (--no-gguf-int8-activations); a float32 row: `gguf_gemv`."""
    seed = fresh_seed()
    n, k = 5, 512
    blocks, _ = _blocks(qtype, n, k, seed)
    weight = GgufWeight(blocks, qtype, k)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(seed))
    xb = x.bfloat16()
    assert gguf_dp4a.takes(xb, qtype, blocks) and not gguf_dp4a.takes(x, qtype, blocks)
    assert torch.equal(linear(xb, weight), gguf_dp4a.gemv(xb, blocks, qtype))
    assert torch.equal(linear(xb, weight, config=FLOAT_GGUF_ACTIVATIONS),
                       gguf_gemv.gemv(xb, blocks, qtype))
    assert torch.equal(linear(x, weight), gguf_gemv.gemv(x, blocks, qtype))


def test_only_the_k_quants_of_q4_k_m_are_taken():
    x = torch.zeros(1, 256, dtype=torch.bfloat16)
    for qtype, (weights, size) in BLOCKS.items():
        blocks = torch.zeros(2, 256 // weights * size, dtype=torch.uint8)
        assert gguf_dp4a.takes(x, qtype, blocks) == (qtype in gguf_dp4a.TYPES)


@pytest.mark.parametrize("int8", [True, False])
def test_cuda_ops_choose_the_one_row_gguf_kernel_once(int8):
    """The engine's kernels on CUDA (`engine_ops`, which the model and its speculative draft
    both take): the GGUF matmul takes `gguf_dp4a` for one bfloat16 Q4_K row, or `gguf_gemv`
    with --no-gguf-int8-activations; --no-dense-gemv takes the float GEMV away alone."""
    from pagedserve.config import EngineConfig
    from pagedserve.device.loading import engine_ops

    seed = fresh_seed()
    qtype, n, k = TYPES[0], 6, 256
    blocks, _ = _blocks(qtype, n, k, seed)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(seed)).bfloat16()
    ops = engine_ops(EngineConfig(gguf_int8_activations=int8, dense_gemv=int8),
                     torch.device("cuda"), torch.bfloat16)
    assert (ops.dense_linear is not None) == int8
    gguf_linear = ops.gguf_linear
    kernel = gguf_dp4a if int8 else gguf_gemv
    assert torch.equal(gguf_linear(x, GgufWeight(blocks, qtype, k), None),
                       kernel.gemv(x, blocks, qtype))
