"""The K/V store that rotates (`rotate_store_kv_`) against RoPE's kernel then the store's
(`model_ops.rotate_qk_`, `store_kv`), under TRITON_INTERPRET=1 (conftest): the same bits in
q and in the caches, then the same logits from a decoder whose Triton attention backend takes
one path or the other.

Fresh seeds each run (printed on failure), ragged token counts, GQA ratios 1-8 and heads over
two tiles, head_dim 64 and 128, with and without Qwen3's q/k norm, float32/float16/bfloat16
activations and FP8 caches with per-head scales (one small enough to saturate), padding rows
(slot -1), slots on both edges of blocks, NaN-filled caches whose null block 0 no slot names,
scales followed by zeros (a read past them divides by 0: an error here).
bf16 runs with `exact_bf16`: the interpreter truncates float32 -> bf16 where the GPU rounds to
nearest even, as `round_to` does (the FP8 path rounds k to bf16 with it).
"""

from __future__ import annotations

import pytest
import torch

from pagedserve.attention.backend import AttentionBackend
from pagedserve.attention.torch_ref import TorchRefBackend
from pagedserve.attention.triton_backend import TritonBackend
from pagedserve.kernels import fp8_format
from pagedserve.kernels.triton import model_ops
from pagedserve.kernels.triton.attention import rotate_store_kv_, store_kv
from pagedserve.model import ops
from pagedserve.model.config import ModelConfig
from pagedserve.model.decoder import Decoder
from tests.kernels.test_fp8_kv import scales
from tests.kernels.test_kernels import SMALL_DECODE, SMALL_PREFILL, fresh_seed
from tests.kernels.test_model_ops import exact_bf16, rope_tables  # noqa: F401 (a fixture)
from tests.model.paged import PagedDriver

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
GQA = [(2, 2), (4, 2), (8, 2), (8, 1)]  # ratios 1, 2, 4, 8
MAX_LEN = 40
BLOCK_SIZE = 4


def step(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, fp8: bool,
         qk_norm: bool, gen: torch.Generator) -> dict:
    """One step's inputs: qkv [T, Hq + 2 Hkv, D] a view of a wider buffer (a token stride
    past its row), positions up to the table's last row, distinct slots over every block but
    the null block (some -1: padding), NaN-filled caches."""
    num_tokens = int(torch.randint(1, 14, (), generator=gen))
    width = num_heads + 2 * num_kv_heads
    buffer = (2 * torch.randn(num_tokens, width + 1, head_dim, generator=gen)).to(dtype)
    num_blocks = 1 + -(-num_tokens // BLOCK_SIZE) + 1
    slots = BLOCK_SIZE + torch.randperm((num_blocks - 1) * BLOCK_SIZE, generator=gen)
    slots = slots[:num_tokens]
    slots[torch.rand(num_tokens, generator=gen) < 0.25] = -1
    positions = torch.randint(0, MAX_LEN, (num_tokens,), generator=gen)
    positions[0] = MAX_LEN - 1
    cache_dtype = fp8_format.FP8_DTYPE if fp8 else dtype
    cache = torch.full((num_blocks, BLOCK_SIZE, num_kv_heads, head_dim), float("nan"),
                       dtype=cache_dtype)
    weights = ([(1 + 0.3 * torch.randn(head_dim, generator=gen)).to(dtype) for _ in range(2)]
               if qk_norm else [None, None])
    cos, sin = rope_tables(head_dim, MAX_LEN, dtype)
    seed = int(torch.randint(0, 2**31, (), generator=gen))
    return dict(buffer=buffer, positions=positions, cos=cos, sin=sin, weights=weights,
                slots=slots, k_cache=cache, v_cache=cache.clone(),
                kv_scales=zero_padded(scales(num_kv_heads, seed)) if fp8 else None)


def zero_padded(kv_scales: tuple) -> tuple:
    """The scales as views of longer tensors whose tail is 0: a kernel reading past them
    divides by 0, which numpy reports (a RuntimeWarning, an error in these tests)."""
    return tuple(torch.cat([s, torch.zeros(8)])[:s.shape[0]] for s in kv_scales)


def rotate_then_store(s: dict, num_heads: int, num_kv_heads: int) -> tuple:
    """(qkv, k cache, v cache) after the two kernels, on copies."""
    qkv = s["buffer"].clone()[:, 1:]
    k_cache, v_cache = s["k_cache"].clone(), s["v_cache"].clone()
    model_ops.rotate_qk_(qkv, s["positions"], s["cos"], s["sin"], num_heads, num_kv_heads,
                         *s["weights"], 1e-6)
    k = qkv[:, num_heads:num_heads + num_kv_heads]
    store_kv(k, qkv[:, num_heads + num_kv_heads:], k_cache, v_cache, s["slots"], s["kv_scales"])
    return qkv, k_cache, v_cache


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit, NaNs too."""
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def check(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, fp8: bool,
          qk_norm: bool) -> None:
    seed = fresh_seed()
    s = step(num_heads, num_kv_heads, head_dim, dtype, fp8, qk_norm,
             torch.Generator().manual_seed(seed))
    want_qkv, want_k, want_v = rotate_then_store(s, num_heads, num_kv_heads)
    buffer, k_cache, v_cache = s["buffer"].clone(), s["k_cache"], s["v_cache"]
    qkv = buffer[:, 1:]
    rotate_store_kv_(qkv, num_kv_heads, s["positions"], s["cos"], s["sin"], *s["weights"],
                     1e-6, k_cache, v_cache, s["slots"], s["kv_scales"])
    msg = f"seed {seed}"
    assert same_bits(qkv[:, :num_heads], want_qkv[:, :num_heads]), f"q differs: {msg}"
    assert same_bits(k_cache, want_k), f"the K cache differs: {msg}"
    assert same_bits(v_cache, want_v), f"the V cache differs: {msg}"
    # k and v left as they were in qkv, nothing written outside it
    assert same_bits(buffer[:, 1 + num_heads:], s["buffer"][:, 1 + num_heads:]), msg
    assert same_bits(buffer[:, 0], s["buffer"][:, 0]), f"wrote outside qkv: {msg}"
    written = s["slots"][s["slots"] >= 0]
    assert not k_cache.view(-1, num_kv_heads, head_dim)[written].float().isnan().any(), msg
    for cache in (k_cache, v_cache):  # only the slots given: the null block, -1 rows
        unwritten = torch.ones(cache.shape[0] * BLOCK_SIZE, dtype=torch.bool)
        unwritten[written] = False
        assert cache.view(-1, num_kv_heads, head_dim)[unwritten].float().isnan().all(), msg


@pytest.mark.filterwarnings("error::RuntimeWarning")
@pytest.mark.usefixtures("exact_bf16")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", GQA)
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("fp8", [False, True])
def test_rotate_store_kv_writes_what_rotate_then_store_writes(dtype, head_dim, num_heads,
                                                              num_kv_heads, qk_norm, fp8):
    check(num_heads, num_kv_heads, head_dim, dtype, fp8, qk_norm)


@pytest.mark.filterwarnings("error::RuntimeWarning")
@pytest.mark.usefixtures("exact_bf16")
@pytest.mark.parametrize("fp8", [False, True])
def test_rotate_store_kv_over_two_tiles(fp8):
    """40 q/k heads of dimension 128: two tiles of 32 heads a token, the first with q and k."""
    check(24, 8, 128, torch.bfloat16, fp8, qk_norm=True)
    check(32, 8, 128, torch.float16, fp8, qk_norm=False)


def test_no_tokens_writes_nothing():
    cache = torch.full((2, BLOCK_SIZE, 1, 64), float("nan"))
    cos, sin = rope_tables(64, MAX_LEN, torch.float32)
    rotate_store_kv_(torch.empty(0, 3, 64), 1, torch.empty(0, dtype=torch.int64), cos, sin,
                     None, None, 0.0, cache, cache, torch.empty(0, dtype=torch.int64))
    assert cache.isnan().all()


class RotateThenStore(TritonBackend):
    """The Triton backend on the separate path: the model's rotate_qk_, then `forward`
    (store_kv and the attention kernels)."""

    forward_qkv = AttentionBackend.forward_qkv


TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=80, num_layers=2,
            rms_norm_eps=1e-6, rope_theta=10000.0, max_model_len=64, tie_word_embeddings=True)
MODELS = {
    "qwen3": dict(family="qwen3", num_heads=4, num_kv_heads=2, head_dim=64, qk_norm=True),
    "llama": dict(family="llama", num_heads=4, num_kv_heads=1, head_dim=16),
    # q/k norm by (1 + w) before the rotation, a sliding layer with its own base, score cap
    "gemma3": dict(family="gemma3", num_heads=2, num_kv_heads=1, head_dim=32, qk_norm=True,
                   norm_unit_offset=True, sandwich_norms=True, hidden_act="gelu_tanh",
                   sliding_window=6, layer_types=["sliding_attention", "full_attention"],
                   local_rope_theta=1000.0, attn_softcap=20.0, scale_embeddings=True),
}


def logits(family: str, dtype: torch.dtype, seed: int, backend) -> torch.Tensor:
    """A prefill of two sequences, then decodes, through the paged cache: logits of every
    fed token."""
    model = Decoder(ModelConfig(**TINY, **MODELS[family]), ops.triton_ops())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.2 * noise if "norm" in name and "gemma" not in family
                    else 0.2 * noise)
    driver = PagedDriver(model.to(dtype), block_size=BLOCK_SIZE)
    driver.backend = backend
    prompt = torch.randint(0, TINY["vocab_size"], (11,), generator=gen).tolist()
    out = [driver.step({"a": prompt, "b": prompt[:5]})["a"]]
    for token in torch.randint(0, TINY["vocab_size"], (3,), generator=gen).tolist():
        out.append(driver.step({"a": [token], "b": [token]})["a"])
    return torch.cat(out)


# the interpreter's bf16 tl.dot is broken (tests/kernels/test_kernels.py): fp32 and fp16
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("family", list(MODELS))
def test_decoder_logits_are_those_of_rotate_then_store(family, dtype):
    seed = fresh_seed()
    fused = logits(family, dtype, seed, TritonBackend(SMALL_DECODE, SMALL_PREFILL))
    separate = logits(family, dtype, seed, RotateThenStore(SMALL_DECODE, SMALL_PREFILL))
    assert torch.equal(fused, separate), f"seed {seed}"
    reference = logits(family, dtype, seed, TorchRefBackend())
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.05, rtol=0.02)
    torch.testing.assert_close(fused, reference, **tol, msg=f"seed {seed}")
