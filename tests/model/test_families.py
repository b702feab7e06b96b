"""Mistral, Qwen2 with sliding windows, Phi-3, Gemma 2, Gemma 3, Mixtral, Qwen3-MoE and the rope
scalings, against transformers on tiny random checkpoints, through the paged cache (see
test_decoder.py).

Windows are a few tokens wide and blocks 4 tokens, so windows start and end inside blocks and
cross block boundaries. The dynamic and longrope scalings pick their frequencies from the
context's length (see `pagedserve.model.rope`), so they are compared with transformers'
token-by-token generation, which is what they reproduce, from a prompt below the threshold.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (Gemma2Config, Gemma3TextConfig, LlamaConfig, MistralConfig,
                          MixtralConfig, Phi3Config, Qwen2Config, Qwen3MoeConfig)

from pagedserve.model import load_model
from tests.model.paged import PagedDriver
from tests.model.test_decoder import TINY, make_checkpoint

HEAD_DIM = TINY["hidden_size"] // TINY["num_attention_heads"]
GEMMA = dict(TINY, head_dim=HEAD_DIM, query_pre_attn_scalar=24, pad_token_id=0)
PHI3 = dict(TINY, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)


def longrope(original: int) -> dict:
    half = HEAD_DIM // 2
    return {"rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.1 * i for i in range(half)],
            "long_factor": [2.0 + 0.5 * i for i in range(half)],
            "original_max_position_embeddings": original}


CASES = {
    "mistral-window5": lambda: MistralConfig(**TINY, sliding_window=5),
    "qwen2-sliding-upper-layers": lambda: Qwen2Config(
        **TINY, use_sliding_window=True, sliding_window=6, max_window_layers=1),
    "phi3-fused": lambda: Phi3Config(**PHI3),
    "phi3-window": lambda: Phi3Config(**PHI3, sliding_window=7),
    "gemma2": lambda: Gemma2Config(**GEMMA, sliding_window=5, attn_logit_softcapping=2.0,
                                   final_logit_softcapping=3.0),
    "gemma3-local-base-global-linear": lambda: Gemma3TextConfig(
        **GEMMA, sliding_window=5, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0,
                                            "rope_theta": 10000.0}}),
    "llama-linear": lambda: LlamaConfig(
        **TINY, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
    "llama-yarn": lambda: LlamaConfig(**TINY, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
        "rope_theta": 10000.0}),
    "mixtral-top2-of-4-window": lambda: MixtralConfig(
        **TINY, num_local_experts=4, num_experts_per_tok=2, sliding_window=7),
    "qwen3moe-top3-of-8-unnormalised": lambda: Qwen3MoeConfig(
        **TINY, head_dim=16, moe_intermediate_size=40, num_experts=8, num_experts_per_tok=3,
        norm_topk_prob=False),
    "qwen3moe-top2-of-6-normalised": lambda: Qwen3MoeConfig(
        **TINY, head_dim=16, moe_intermediate_size=40, num_experts=6, num_experts_per_tok=2,
        norm_topk_prob=True),
    "phi3-longrope-short": lambda: Phi3Config(
        **{**PHI3, "max_position_embeddings": 64}, rope_parameters=longrope(32)),
}
# Compared by generation only (the length picks the frequencies).
GENERATE_ONLY = {
    "llama-dynamic": lambda: LlamaConfig(**{**TINY, "max_position_embeddings": 10},
                                         rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                          "rope_theta": 10000.0}),
    "phi3-longrope-long": lambda: Phi3Config(
        **{**PHI3, "max_position_embeddings": 32}, rope_parameters=longrope(8)),
}

SCHEDULE = [  # (positions of a, positions of b) fed per step, as [start, end)
    ((0, 9), (0, 3)),  # a: full prefill; b: first chunk
    ((9, 10), (3, 7)),  # a decodes; b: chunk over a cached prefix crossing a block boundary
    ((10, 11), (7, 9)),
    ((11, 12), (9, 10)),  # both decode
    ((12, 13), (10, 11)),
    (None, (11, 12)),  # a finished; b decodes alone
]


@pytest.mark.parametrize("case", list(CASES) + list(GENERATE_ONLY))
def test_paged_logits_and_greedy_tokens_match_transformers(case, tmp_path):
    hf = make_checkpoint({**CASES, **GENERATE_ONLY}[case](), tmp_path)
    model, config, _ = load_model(tmp_path, torch.float32, "cpu")
    if case in CASES:
        check_paged_logits(case, hf, model)
    check_greedy_generation(case, hf, model, config.max_model_len)


def check_paged_logits(case, hf, model) -> None:
    """Two sequences sharing steps (prefill, chunked prefill, decodes), then a prefix hit."""
    gen = torch.Generator().manual_seed(1)
    seqs = {"a": torch.randint(0, TINY["vocab_size"], (13,), generator=gen).tolist(),
            "b": torch.randint(0, TINY["vocab_size"], (12,), generator=gen).tolist()}
    with torch.no_grad():
        ref = {s: hf(torch.tensor([ids])).logits[0] for s, ids in seqs.items()}
    driver = PagedDriver(model, block_size=4)
    for feed_a, feed_b in SCHEDULE:
        spans = {"a": feed_a, "b": feed_b}
        out = driver.step({s: seqs[s][sp[0]:sp[1]] for s, sp in spans.items() if sp})
        for s, sp in spans.items():
            if sp:
                torch.testing.assert_close(out[s], ref[s][sp[0]:sp[1]], atol=1e-4, rtol=1e-4,
                                           msg=f"{case} seq {s} positions {sp}")
    # a prefix hit: a third sequence reuses a's first two blocks and prefills the rest
    driver.blocks["c"], driver.lens["c"] = list(driver.blocks["a"][:2]), 8
    out = driver.step({"c": seqs["a"][8:13]})["c"]
    torch.testing.assert_close(out, ref["a"][8:13], atol=1e-4, rtol=1e-4, msg=f"{case} hit")


def check_greedy_generation(case, hf, model, max_model_len: int) -> None:
    """Greedy decoding one token per step: every step's logits and the tokens."""
    prompt = torch.randint(0, TINY["vocab_size"], (6,),
                           generator=torch.Generator().manual_seed(2)).tolist()
    new = min(8, max_model_len - len(prompt))
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new,
                          do_sample=False, output_logits=True, return_dict_in_generate=True)
    driver = PagedDriver(model, block_size=4)
    logits = driver.step({"s": prompt})["s"][-1:]
    tokens = []
    for step in range(new):
        torch.testing.assert_close(logits[0], ref.logits[step][0], atol=1e-4, rtol=1e-4,
                                   msg=f"{case} step {step}")
        tokens.append(int(logits[0].argmax()))
        logits = driver.step({"s": tokens[-1:]})["s"]
    assert tokens == ref.sequences[0, len(prompt):].tolist()
