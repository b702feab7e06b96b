"""Our decoder, fed through the paged KV cache, against transformers on tiny random checkpoints.

Each checkpoint is made with transformers and saved as safetensors, then loaded by our loader.
Two sequences of different lengths share every step: one prefills at once then decodes, the
other prefills in chunks (so a chunk attends to a cached prefix) while the first decodes. Every
fed token's logits must equal transformers' logits at that position of the full sequence.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from pagedserve.model import load_model
from tests.model.paged import PagedDriver

TINY = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}

CASES = {
    "llama-untied": lambda: LlamaConfig(**TINY, tie_word_embeddings=False),
    "llama3-rope-tied-mha": lambda: LlamaConfig(
        **{**TINY, "num_key_value_heads": 4}, tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE
    ),
    "qwen2-bias-tied": lambda: Qwen2Config(**TINY, tie_word_embeddings=True),
    "qwen2-bias-untied-gqa4": lambda: Qwen2Config(
        **{**TINY, "num_key_value_heads": 1}, tie_word_embeddings=False
    ),
    "qwen3-qknorm-tied": lambda: Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=True),
    "qwen3-qknorm-untied": lambda: Qwen3Config(**TINY, head_dim=16, tie_word_embeddings=False),
}


def make_checkpoint(config, folder, seed: int = 0, max_shard_size: str | None = None):
    """A random model whose every weight matters: norms and biases are perturbed too."""
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    config.architectures = [type(hf).__name__]
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0, 0.15)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    hf.save_pretrained(folder, **kwargs)
    return hf.eval()


@pytest.mark.parametrize("case", list(CASES))
def test_paged_logits_match_transformers(case, tmp_path):
    hf = make_checkpoint(CASES[case](), tmp_path)
    model, config, tok_src = load_model(tmp_path, torch.float32, "cpu")
    assert tok_src == str(tmp_path)
    assert config.tie_word_embeddings == hf.config.tie_word_embeddings
    assert (model.lm_head is None) == config.tie_word_embeddings

    gen = torch.Generator().manual_seed(1)
    seq_a = torch.randint(0, TINY["vocab_size"], (13,), generator=gen).tolist()  # 9 + 4 decodes
    seq_b = torch.randint(0, TINY["vocab_size"], (12,), generator=gen).tolist()  # 3+4+2 + 3
    with torch.no_grad():
        ref = {s: hf(torch.tensor([ids])).logits[0] for s, ids in (("a", seq_a), ("b", seq_b))}

    driver = PagedDriver(model, block_size=4)
    schedule = [  # (tokens of a, tokens of b) fed per step, as [start, end) positions
        ((0, 9), (0, 3)),  # a: full prefill; b: first chunk
        ((9, 10), (3, 7)),  # a decodes; b: chunk over a cached prefix crossing a block boundary
        ((10, 11), (7, 9)),
        ((11, 12), (9, 10)),  # both decode
        ((12, 13), (10, 11)),
        (None, (11, 12)),  # a finished; b decodes alone
    ]
    for feed_a, feed_b in schedule:
        feeds = {}
        if feed_a:
            feeds["a"] = seq_a[feed_a[0]:feed_a[1]]
        feeds["b"] = seq_b[feed_b[0]:feed_b[1]]
        out = driver.step(feeds)
        for seq, span in (("a", feed_a), ("b", feed_b)):
            if span:
                torch.testing.assert_close(out[seq], ref[seq][span[0]:span[1]], atol=1e-4,
                                           rtol=1e-4, msg=f"{case} seq {seq} positions {span}")


def test_sharded_checkpoint_and_dtype(tmp_path):
    """model.safetensors.index.json is followed, and weights land in the requested dtype."""
    hf = make_checkpoint(CASES["qwen2-bias-untied-gqa4"](), tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    model, _, _ = load_model(tmp_path, torch.bfloat16, "cpu")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    ids = torch.tensor([5, 17, 250, 3, 99, 7])
    out = PagedDriver(model).step({"x": ids.tolist()})["x"]
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    # bf16 weights and activations: only a coarse agreement is expected.
    assert torch.nn.functional.cosine_similarity(out, ref, dim=-1).min() > 0.99


def test_each_layer_takes_its_recalled_kv_before_it_reads_its_cache(tmp_path):
    """A recall lands layer by layer in the step that reads it (`device/tier_copies.py`):
    each attention layer asks for its own layer's blocks (the forward context's `kv_ready`)
    before it stores into or reads its cache. Here a prefix's KV is withheld (NaN) and each
    layer's is put back only when that layer asks: the logits are those of a run that never
    lost it, and the layers ask in order, once each."""
    make_checkpoint(LlamaConfig(**{**TINY, "num_hidden_layers": 3}), tmp_path)
    model, _, _ = load_model(tmp_path, torch.float32, "cpu")
    prompt = torch.randint(0, TINY["vocab_size"], (14,),
                           generator=torch.Generator().manual_seed(2)).tolist()
    kept = PagedDriver(model, block_size=4)  # the same seed: the same blocks
    kept.step({"a": prompt[:9]})
    want = kept.step({"a": prompt[9:]})["a"]
    driver = PagedDriver(model, block_size=4)
    driver.step({"a": prompt[:9]})
    blocks = torch.tensor(driver.blocks["a"])
    layers = model.attention_layers()
    saved = [(a.k_cache[blocks].clone(), a.v_cache[blocks].clone()) for a in layers]
    for attention in layers:
        attention.k_cache[blocks] = float("nan")
        attention.v_cache[blocks] = float("nan")
    asked = []

    def kv_ready(layer: int) -> None:
        asked.append(layer)
        layers[layer].k_cache[blocks], layers[layer].v_cache[blocks] = saved[layer]

    got = driver.step({"a": prompt[9:]}, kv_ready)["a"]
    assert asked == [0, 1, 2]
    torch.testing.assert_close(got, want, atol=0, rtol=0)
