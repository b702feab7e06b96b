"""A sliding-window model through the whole engine (scheduler, block manager, runner, the CPU
attention backend), greedy, against transformers' generate: chunked prefills, a prefix hit on
blocks the window had freed, and a KV pool small enough that only window freeing lets every
request run at once."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from benchmarks.make_checkpoint import make_checkpoint
from pagedserve.config import EngineConfig
from pagedserve.frontend.llm_engine import LLMEngine, LoadedModel
from pagedserve.sampling_params import SamplingParams
from tests.conftest import assert_pool_clean

WINDOW, BLOCK, NEW = 6, 4, 10
CONFIG = {
    "architectures": ["MistralForCausalLM"], "model_type": "mistral", "head_dim": 16,
    "hidden_size": 64, "intermediate_size": 128, "max_position_embeddings": 256,
    "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "sliding_window": WINDOW,
    "tie_word_embeddings": False, "vocab_size": 259, "bos_token_id": 1, "eos_token_id": 2,
    "initializer_range": 0.5,
}
SHARED = list(range(40, 60))
PROMPTS = [SHARED + [7, 8, 9], list(range(100, 131)), SHARED + [11]]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-mistral-window")
    (root / "config.json").write_text(json.dumps(CONFIG))
    make_checkpoint(root / "config.json", root / "ckpt", torch.float32, seed=0,
                    tokenizer="bytes")
    return root / "ckpt"


@pytest.fixture(scope="module")
def references(folder):
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    with torch.no_grad():
        return [hf.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW,
                            do_sample=False)[0, len(p):].tolist() for p in PROMPTS]


def test_engine_frees_out_of_window_blocks_and_matches_transformers(folder, references):
    loaded = LoadedModel.load(EngineConfig(model=str(folder), device="cpu", dtype="float32"))
    assert loaded.model_config.kv_window == WINDOW
    block_bytes = 2 * 2 * BLOCK * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads of 16, fp32
    # 15 blocks: the three requests need 9 + 11 + 8 blocks without freeing
    engine = LLMEngine(EngineConfig(
        model=str(folder), device="cpu", dtype="float32", block_size=BLOCK,
        kv_cache_memory=16 * block_bytes, max_num_batched_tokens=8), loaded)
    assert engine.num_blocks == 16
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    for run in range(2):  # the second run hits the prefix blocks the first one freed
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"{run}-{i}", None, params, prompt_token_ids=prompt)
        results, nulled = {}, False
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    results[output.request_id] = output.outputs[0].token_ids
            rows = engine.model_runner.block_rows
            for request_id, blocks in engine.kv_cache_manager.req_to_blocks.items():
                if blocks and blocks[0].is_null:
                    nulled = True
                    # the runner's row, kept from the step messages alone, is the manager's
                    row = rows.table[rows.rows([request_id])[0], :len(blocks)]
                    assert row.tolist() == [b.block_id for b in blocks]
        assert nulled, "no block was ever freed out of the window"
        assert engine.scheduler.num_preemptions == 0
        assert [results[f"{run}-{i}"] for i in range(len(PROMPTS))] == references
    assert engine.get_stats().prefix_cache_hits > 0
    assert_pool_clean(engine)
