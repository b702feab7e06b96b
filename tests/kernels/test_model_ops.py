"""The decoder's Triton ops (kernels/triton/model_ops.py) against the eager PyTorch ops
(model/ops.py), under TRITON_INTERPRET=1 (conftest), then the whole decoder built with one set
and the other (`ops.TORCH_OPS`, `ops.triton_ops()`).

Fresh seeds each run (printed on failure), ragged token counts, head_dim 64 and 128, GQA ratios
1-8, positions up to the last row of the RoPE table. bf16 runs too: the interpreter truncates
float32 -> bf16 where the GPU (and PyTorch) rounds to nearest even, so `exact_bf16` makes it
round; bf16 results must then equal the eager path's bit for bit, except where a norm's sum of
squares is added up in another order or exp differs in its last bit (one bf16 step, rarely).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton.language as tl
from triton.runtime import interpreter

from pagedserve.kernels.triton import model_ops
from pagedserve.model import ops
from pagedserve.model.config import ModelConfig
from pagedserve.model.decoder import Decoder, RotaryEmbedding
from tests.model.paged import PagedDriver

DTYPES = [torch.float32, torch.bfloat16]
GQA = [(2, 2), (4, 2), (8, 1)]  # ratios 1, 2, 8


def fresh_seed() -> int:
    return torch.seed() % 2**31


@pytest.fixture
def exact_bf16(monkeypatch):
    """float32 -> bf16 casts in the interpreter rounded to nearest even, as on the GPU."""
    original = interpreter._convert_float

    def convert(data, src_dtype, dst_dtype, rounding_mode):
        if src_dtype == tl.float32 and dst_dtype == tl.bfloat16:
            rounded = torch.from_numpy(np.asarray(data, dtype=np.float32)).to(torch.bfloat16)
            return rounded.view(torch.int16).numpy().view(np.uint16)
        return original(data, src_dtype, dst_dtype, rounding_mode)

    monkeypatch.setattr(interpreter, "_convert_float", convert)


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, msg: str,
                   exact: bool = False) -> None:
    """float32: to rounding. bf16: equal, or (unless `exact`) one bf16 step apart in a few
    elements, from a sum of squares added up in another order. The step is the operands'
    (values of order 1), not the result's: a rotation's x cos - y sin can cancel to a small
    value that carries its operands' one-step difference."""
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5, msg=msg)
        return
    if exact:
        torch.testing.assert_close(actual, expected, atol=0, rtol=0, msg=msg)
        return
    torch.testing.assert_close(actual, expected, atol=2**-7, rtol=2**-7, msg=msg)
    equal = (actual == expected).float().mean().item()
    assert equal > 0.98, f"{msg}: only {equal:.3f} of elements equal"


@pytest.mark.usefixtures("exact_bf16")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,hidden", [(1, 64), (7, 96), (33, 128)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_fused_add_rms_norm(dtype, num_tokens, hidden, with_residual):
    seed = fresh_seed()
    x = 2 * torch.randn(num_tokens, hidden).to(dtype)
    residual = 3 * torch.randn(num_tokens, hidden).to(dtype) if with_residual else None
    weight = (1 + 0.3 * torch.randn(hidden)).to(dtype)
    ref_res = None if residual is None else residual.clone()
    ref_out, ref_sum = ops.eager_fused_add_rms_norm(x.clone(), ref_res, weight, 1e-6)
    out, total = model_ops.rms_norm(x, weight, 1e-6, residual)
    if residual is None:
        assert total is x
    else:
        assert total is residual  # updated in place
    msg = f"seed {seed}"
    assert_matches(total, ref_sum, msg, exact=True)
    assert_matches(out, ref_out, msg)


def rope_tables(head_dim: int, max_len: int, dtype: torch.dtype):
    config = ModelConfig(family="llama", vocab_size=8, hidden_size=head_dim, intermediate_size=8,
                         num_layers=1, num_heads=1, num_kv_heads=1, head_dim=head_dim,
                         rms_norm_eps=1e-6, rope_theta=10000.0, max_model_len=max_len,
                         tie_word_embeddings=True)
    return RotaryEmbedding(config).tables(torch.device("cpu"), dtype)


@pytest.mark.usefixtures("exact_bf16")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", GQA)
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rotate_qk(dtype, head_dim, num_heads, num_kv_heads, qk_norm):
    seed = fresh_seed()
    max_len = 40
    cos, sin = rope_tables(head_dim, max_len, dtype)
    num_tokens = int(torch.randint(1, 12, ()))
    positions = torch.randint(0, max_len, (num_tokens,))
    positions[0] = max_len - 1  # the table's last row
    heads = num_heads + 2 * num_kv_heads
    # A token stride wider than the row, as a view of a larger buffer would have.
    buffer = 2 * torch.randn(num_tokens, heads + 1, head_dim).to(dtype)
    qkv = buffer[:, 1:]
    weights = [(1 + 0.3 * torch.randn(head_dim)).to(dtype) for _ in range(2)] if qk_norm \
        else [None, None]
    expected = qkv.clone()
    ops.eager_rotate_qk_(expected, positions, cos, sin, num_heads, num_kv_heads, *weights,
                         1e-6)
    before = buffer.clone()
    model_ops.rotate_qk_(qkv, positions, cos, sin, num_heads, num_kv_heads, *weights, 1e-6)
    msg = f"seed {seed}"
    rotated = num_heads + num_kv_heads
    assert_matches(qkv[:, :rotated], expected[:, :rotated], msg, exact=not qk_norm)
    assert torch.equal(qkv[:, rotated:], before[:, 1 + rotated:]), "v must be left alone"
    assert torch.equal(buffer[:, 0], before[:, 0]), "wrote outside qkv"


@pytest.mark.usefixtures("exact_bf16")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,inner", [(1, 96), (6, 1500)])  # 1500: two column blocks
def test_silu_and_mul(dtype, num_tokens, inner):
    seed = fresh_seed()
    gate_up = 3 * torch.randn(num_tokens, 2 * inner).to(dtype)
    expected = ops.eager_silu_and_mul(gate_up)
    actual = model_ops.silu_and_mul(gate_up)
    # exp differs from PyTorch's in the last float32 bit, which can tip a bf16 rounding
    assert_matches(actual, expected, f"seed {seed}")


TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=80, num_layers=2,
            rms_norm_eps=1e-6, rope_theta=10000.0, max_model_len=64, tie_word_embeddings=True)
MODELS = {
    "qwen3": dict(family="qwen3", num_heads=4, num_kv_heads=2, head_dim=64, qk_norm=True),
    "llama": dict(family="llama", num_heads=4, num_kv_heads=1, head_dim=16),
}


def random_decoder(family: str, dtype: torch.dtype, seed: int, model_ops: ops.Ops) -> Decoder:
    model = Decoder(ModelConfig(**TINY, **MODELS[family]), model_ops)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.2 * noise if "norm" in name else 0.2 * noise)
    return model.to(dtype)


def run_steps(model: Decoder, prompt: list[int], decodes: list[int]) -> torch.Tensor:
    """A prefill then decodes through the paged cache: logits of every fed token."""
    driver = PagedDriver(model, block_size=4)
    logits = [driver.step({"a": prompt, "b": prompt[:5]})["a"]]
    for tok in decodes:
        logits.append(driver.step({"a": [tok], "b": [tok]})["a"])
    return torch.cat(logits).float()


@pytest.mark.usefixtures("exact_bf16")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", list(MODELS))
def test_decoder_with_triton_ops_matches_torch_ops(family, dtype):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, TINY["vocab_size"], (11,), generator=gen).tolist()
    decodes = torch.randint(0, TINY["vocab_size"], (2,), generator=gen).tolist()
    expected = run_steps(random_decoder(family, dtype, seed, ops.TORCH_OPS), prompt, decodes)
    actual = run_steps(random_decoder(family, dtype, seed, ops.triton_ops()), prompt, decodes)
    # bf16: a rounding tipped by a norm's summation order propagates; logits here are up to
    # ~8, where one bf16 step is 0.03, and differ by 2 steps at most over many seeds.
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.15, rtol=0.02)
    torch.testing.assert_close(actual, expected, **tol, msg=f"seed {seed}")
