"""The whole engine generates the same tokens with the Triton kernels (interpreted) as with
the PyTorch reference: prefill chunks, a prefix-cache hit and decodes, all through the paged
cache, on a tiny random Qwen3 checkpoint in float32."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from benchmarks.make_checkpoint import make_checkpoint
from pagedserve.config import EngineConfig
from pagedserve.frontend.llm_engine import LLMEngine
from pagedserve.sampling_params import SamplingParams

CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 32,
    "hidden_size": 128, "intermediate_size": 256, "max_position_embeddings": 512,
    "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": True,
    "vocab_size": 512, "bos_token_id": 1, "eos_token_id": 2,
    # large random weights give peaked logits, so greedy choices are not near-ties
    "initializer_range": 0.5,
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tiny-qwen3")
    config = root / "config.json"
    config.write_text(json.dumps(CONFIG))
    make_checkpoint(config, root / "ckpt", torch.float32, seed=0, tokenizer="bytes")
    return root / "ckpt"


def generate(checkpoint: Path, backend: str, prompts: list[list[int]]) -> list[list[int]]:
    engine = LLMEngine(EngineConfig(
        model=str(checkpoint), device="cpu", dtype="float32", attention_backend=backend,
        kv_cache_memory=4 << 20, max_num_batched_tokens=48))  # chunked prefills
    assert engine.model_runner.backend.name == backend
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    results = {}
    for round_ in range(2):  # the second round hits the prefix cache
        for i, ids in enumerate(prompts):
            engine.add_request(f"{round_}-{i}", None, params, prompt_token_ids=ids)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    results[out.request_id] = out.outputs[0].token_ids
    assert engine.get_stats().prefix_cache_hits > 0
    assert engine.get_stats().num_running == 0
    return [results[k] for k in sorted(results)]


def test_triton_and_torch_backends_generate_the_same_tokens(checkpoint):
    rng = random.Random()
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 17, 40)]
    reference = generate(checkpoint, "torch", prompts)
    assert generate(checkpoint, "triton", prompts) == reference
    assert len({tuple(t) for t in reference}) > 1  # not a degenerate constant output
