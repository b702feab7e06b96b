"""Mistral, Mixtral, Qwen3-MoE, Phi-3, Gemma 2, Gemma 3 and the rope scalings (Llama 3.1's as a
`rope_freqs` tensor) from GGUF files: each tiny checkpoint of test_families.py (and test_decoder's
Llama 3.1 one) is converted the way llama.cpp converts it (`gguf_files.write_gguf`, float32
tensors), loaded from the GGUF, and must give the HF folder's config, weights and RoPE tables,
and transformers' logits and greedy tokens through the paged cache.

Windows are narrower than the sequences (Mistral's 5 tokens against 13), so the window read
from the GGUF metadata is what makes the logits agree. The writer itself is checked against a
third party: transformers' own GGUF reader must rebuild the checkpoint's weights from our files
(every family it reads: all but Mixtral).
"""

from __future__ import annotations

import pytest
import torch

from pagedserve.model import load_model
from tests.model.gguf_files import write_gguf
from tests.model.test_decoder import CASES as DENSE_CASES
from tests.model.test_decoder import make_checkpoint
from tests.model.test_families import CASES, GENERATE_ONLY, check_greedy_generation, \
    check_paged_logits

GGUF_CASES = ["mistral-window5", "mixtral-top2-of-4-window", "qwen3moe-top3-of-8-unnormalised",
              "phi3-fused", "phi3-window", "phi3-longrope-short", "gemma2",
              "gemma3-local-base-global-linear", "llama-linear", "llama-yarn",
              "llama3-rope-tied-mha"]
# Config fields a GGUF must reproduce exactly (the rest: float32-rounded or named differently).
SAME_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
               "num_kv_heads", "head_dim", "rope_theta", "max_model_len",
               "max_position_embeddings", "tie_word_embeddings", "qkv_bias", "qk_norm",
               "sliding_window", "local_rope_theta", "local_rope_scaling", "attn_softcap",
               "final_softcap", "hidden_act", "norm_unit_offset", "sandwich_norms",
               "scale_embeddings", "fused_checkpoint", "num_experts", "num_experts_per_tok",
               "moe_intermediate_size", "norm_topk_prob")
# The cases transformers' GGUF reader reads, with what it does not take from the metadata
# (the experts' size; a pad id inside the tiny vocabulary) given to it by hand.
TRANSFORMERS_READS = {"mistral-window5": {}, "gemma2": {}, "gemma3-local-base-global-linear": {},
                      "qwen3moe-top3-of-8-unnormalised": {"moe_intermediate_size": 40},
                      "phi3-longrope-short": {"pad_token_id": 0}}


@pytest.fixture(autouse=True)
def _no_gguf_cache(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE", "0")


def converted(case: str, folder):
    hf = make_checkpoint({**DENSE_CASES, **CASES, **GENERATE_ONLY}[case](), folder)
    return hf, write_gguf(folder, folder / "model.gguf")


def assert_same_model(ours, reference) -> None:
    (model, config, _), (ref_model, ref_config, _) = ours, reference
    for field in SAME_FIELDS:
        assert getattr(config, field) == getattr(ref_config, field), field
    assert config.rms_norm_eps == pytest.approx(ref_config.rms_norm_eps)
    assert config.scale == pytest.approx(ref_config.scale)
    assert [config.layer_window(i) for i in range(config.num_layers)] == \
        [ref_config.layer_window(i) for i in range(ref_config.num_layers)]
    for layer_type, rotary in model.rotary.items():  # Llama 3.1's scaling: another form
        for table, ref_table in zip(rotary.tables(torch.device("cpu"), torch.float32),
                                    ref_model.rotary[layer_type].tables(torch.device("cpu"),
                                                                        torch.float32)):
            torch.testing.assert_close(table, ref_table, atol=1e-6, rtol=0)
    params, ref_params = dict(model.named_parameters()), dict(ref_model.named_parameters())
    assert params.keys() == ref_params.keys()
    for name, p in params.items():  # Gemma's norms went through 1 + w and back
        torch.testing.assert_close(p, ref_params[name], atol=2e-7, rtol=0, msg=name)


@pytest.mark.parametrize("case", GGUF_CASES)
def test_gguf_matches_folder_and_transformers(case, tmp_path):
    hf, path = converted(case, tmp_path)
    ours = load_model(path, torch.float32, "cpu")
    assert_same_model(ours, load_model(tmp_path, torch.float32, "cpu"))
    model, config, _ = ours
    check_paged_logits(case, hf, model)
    check_greedy_generation(case, hf, model, config.max_model_len)


def test_gguf_longrope_past_the_original_context(tmp_path):
    """Phi-3's long factors, read from the file's tensors, take over past the original length."""
    hf, path = converted("phi3-longrope-long", tmp_path)
    model, config, _ = load_model(path, torch.float32, "cpu")
    check_greedy_generation("phi3-longrope-long", hf, model, config.max_model_len)


@pytest.mark.parametrize("case", list(TRANSFORMERS_READS))
def test_transformers_reads_our_files_back(case, tmp_path):
    """Our files follow llama.cpp's layout as transformers' GGUF reader understands it."""
    from transformers import AutoModelForCausalLM

    hf, path = converted(case, tmp_path)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name,
                                                  dtype=torch.float32, **TRANSFORMERS_READS[case])
    expected, read = hf.state_dict(), theirs.state_dict()
    assert expected.keys() == read.keys()
    for name, w in expected.items():
        torch.testing.assert_close(read[name], w, atol=2e-7, rtol=0, msg=name)
