"""The decoder's Triton kernels, compiled for the GPU, against eager PyTorch on the GPU in bf16.

The CPU tests (tests/kernels/test_model_ops.py) run the same kernels in the interpreter, which
executes every cast as written; the compiler may not. Issue 27's sanitizer run found the
compiled rotary kernel one bf16 step off eager PyTorch in a quarter of its outputs: the
compiler had folded the float32 -> bf16 -> float32 round trips that mark eager's rounding
points. So the bit-for-bit claims are checked here, on the compiled code.
"""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels.triton import model_ops
from pagedserve.model import ops
from pagedserve.model.config import ModelConfig
from pagedserve.model.rope import RotaryEmbedding

DEV = torch.device("cuda")
DTYPE = torch.bfloat16


def fresh_generator() -> tuple[torch.Generator, int]:
    seed = torch.seed() % 2**31
    return torch.Generator(device=DEV).manual_seed(seed), seed


def tables(head_dim: int, max_len: int):
    config = ModelConfig(family="llama", vocab_size=8, hidden_size=head_dim, intermediate_size=8,
                         num_layers=1, num_heads=1, num_kv_heads=1, head_dim=head_dim,
                         rms_norm_eps=1e-6, rope_theta=10000.0, max_model_len=max_len,
                         tie_word_embeddings=True)
    return RotaryEmbedding(config).tables(DEV, DTYPE)


def assert_near_equal(actual, expected, msg: str, share: float) -> None:
    """Within one bf16 step of order-1 values, and equal in at least `share` of elements."""
    torch.testing.assert_close(actual, expected, atol=2**-7, rtol=2**-7, msg=msg)
    equal = (actual == expected).float().mean().item()
    assert equal >= share, f"{msg}: only {equal:.4f} of elements equal"


@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 32, 8), (128, 16, 8), (128, 8, 1)])
def test_rotary_without_norm_is_eager_bit_for_bit(head_dim, heads, kv_heads):
    gen, seed = fresh_generator()
    max_len = 4096
    cos, sin = tables(head_dim, max_len)
    positions = torch.randint(0, max_len, (37,), generator=gen, device=DEV)
    positions[0] = max_len - 1
    qkv = (2 * torch.randn(37, heads + 2 * kv_heads, head_dim, generator=gen, device=DEV)).to(DTYPE)
    expected = qkv.clone()
    ops.eager_rotate_qk_(expected, positions, cos, sin, heads, kv_heads)
    model_ops.rotate_qk_(qkv, positions, cos, sin, heads, kv_heads, None, None, 0.0)
    assert torch.equal(qkv, expected), f"seed {seed}"


@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 32, 8), (128, 16, 2)])
def test_rotary_with_qk_norm(head_dim, heads, kv_heads):
    gen, seed = fresh_generator()
    cos, sin = tables(head_dim, 4096)
    positions = torch.randint(0, 4096, (37,), generator=gen, device=DEV)
    qkv = (2 * torch.randn(37, heads + 2 * kv_heads, head_dim, generator=gen, device=DEV)).to(DTYPE)
    weights = [(1 + 0.3 * torch.randn(head_dim, generator=gen, device=DEV)).to(DTYPE)
               for _ in range(2)]
    expected = qkv.clone()
    ops.eager_rotate_qk_(expected, positions, cos, sin, heads, kv_heads, *weights, 1e-6)
    model_ops.rotate_qk_(qkv, positions, cos, sin, heads, kv_heads, *weights, 1e-6)
    # a norm's sum of squares is added up in another order: a rounding tips now and then
    assert_near_equal(qkv, expected, f"seed {seed}", share=0.98)


@pytest.mark.parametrize("head_dim,heads,kv_heads", [(128, 16, 4), (128, 32, 8), (128, 16, 8),
                                                    (64, 8, 1), (128, 24, 8)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rotating_store_is_rotate_then_store_bit_for_bit(head_dim, heads, kv_heads, dtype, fp8,
                                                         qk_norm):
    """The Triton backend's K/V store that rotates (`rotate_store_kv_`) writes the q and cache
    bytes of `rotate_qk_` then `store_kv`, compiled: the q/k norm's sum in the same order, k
    rounded to the activation dtype before its FP8 quantization (Llama-3-8B's heads at TP=2
    and 1, Qwen3-0.6B's, GQA 8 at D=64, 32 q/k heads over two tiles)."""
    from pagedserve.kernels import fp8_format
    from pagedserve.kernels.triton.attention import rotate_store_kv_, store_kv

    gen, seed = fresh_generator()
    tokens, block_size, max_len = 37, 16, 4096
    cos, sin = (t.to(dtype) for t in tables(head_dim, max_len))
    positions = torch.randint(0, max_len, (tokens,), generator=gen, device=DEV)
    qkv = (2 * torch.randn(tokens, heads + 2 * kv_heads, head_dim, generator=gen,
                           device=DEV)).to(dtype)
    weights = ([(1 + 0.3 * torch.randn(head_dim, generator=gen, device=DEV)).to(dtype)
                for _ in range(2)] if qk_norm else [None, None])
    num_blocks = 1 + tokens // block_size + 2  # block 0: the null block, never a slot
    slots = block_size + torch.randperm((num_blocks - 1) * block_size, device=DEV)[:tokens]
    slots[::5] = -1  # padding rows
    cache = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"), device=DEV)
    cache = cache.to(fp8_format.FP8_DTYPE if fp8 else dtype)
    scales = tuple(0.004 + 0.03 * torch.rand(kv_heads, generator=gen, device=DEV)
                   for _ in range(2)) if fp8 else None
    want, want_k, want_v = qkv.clone(), cache.clone(), cache.clone()
    model_ops.rotate_qk_(want, positions, cos, sin, heads, kv_heads, *weights, 1e-6)
    store_kv(want[:, heads:heads + kv_heads], want[:, heads + kv_heads:], want_k, want_v, slots,
             scales)
    k_cache, v_cache = cache.clone(), cache.clone()
    rotate_store_kv_(qkv, kv_heads, positions, cos, sin, *weights, 1e-6, k_cache, v_cache,
                     slots, scales)
    for got, expected, what in ((qkv[:, :heads], want[:, :heads], "q"),
                                (k_cache, want_k, "K cache"), (v_cache, want_v, "V cache")):
        assert torch.equal(got.contiguous().view(torch.uint8),
                           expected.contiguous().view(torch.uint8)), f"{what}: seed {seed}"


@pytest.mark.parametrize("tokens,hidden", [(1, 1024), (33, 4096)])
def test_add_rms_norm(tokens, hidden):
    gen, seed = fresh_generator()
    x = (2 * torch.randn(tokens, hidden, generator=gen, device=DEV)).to(DTYPE)
    residual = (3 * torch.randn(tokens, hidden, generator=gen, device=DEV)).to(DTYPE)
    weight = (1 + 0.3 * torch.randn(hidden, generator=gen, device=DEV)).to(DTYPE)
    ref_out, ref_sum = ops.eager_fused_add_rms_norm(x.clone(), residual.clone(), weight, 1e-6)
    out, total = model_ops.rms_norm(x, weight, 1e-6, residual)
    assert torch.equal(total, ref_sum), f"seed {seed}: the residual sum is rounded once"
    assert_near_equal(out, ref_out, f"seed {seed}", share=0.98)


def test_silu_and_mul():
    gen, seed = fresh_generator()
    gate_up = (3 * torch.randn(37, 2 * 1500, generator=gen, device=DEV)).to(DTYPE)
    # exp differs from PyTorch's in the last float32 bit, which can tip a bf16 rounding
    assert_near_equal(model_ops.silu_and_mul(gate_up), ops.eager_silu_and_mul(gate_up),
                      f"seed {seed}", share=0.98)
