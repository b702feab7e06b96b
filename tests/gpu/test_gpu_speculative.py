"""Speculative decoding on CUDA (issue 30): the ngram, draft-model and EAGLE-3 engines against
the default (async, CUDA graphs) engine, same weights. A verify runs eagerly through the paged
prefill kernel while plain decodes replay graphs, so bf16 near-ties of random weights may flip
a token: most requests must agree, drafts must be accepted, and every block comes back. The
draft model is the target's own checkpoint (so nearly every draft is accepted, which needs
the draft's KV in the target's blocks to be right); the EAGLE-3 heads are random, in the
published layout (tests/spec/heads.py), reading the target's default three layers."""

from __future__ import annotations

import random

import pytest
import torch

from tests.gpu.test_gpu_async_scheduling import run
from tests.gpu.test_gpu_engine import make_engine, prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}


def repeating_prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        phrase = [rng.randrange(10_000) for _ in range(rng.randint(5, 20))]
        out.append((phrase * 20)[:rng.randint(60, 200)])
    return out


@torch.inference_mode()
@pytest.mark.parametrize("batch", [1, 4])
def test_ngram_gives_the_default_engines_greedy_tokens(loaded, batch):
    from pagedserve.sampling_params import SamplingParams

    prompt_list = repeating_prompts(batch, seed=batch)
    params = [SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)] * batch
    plain = run(make_engine(loaded), prompt_list, params)
    engine = make_engine(loaded, speculative_config=NGRAM)
    assert engine.async_scheduling  # its steps that may draft run synchronously
    speculative = run(engine, prompt_list, params)
    agree = sum(a == b for a, b in zip(plain, speculative))
    assert agree >= max(1, batch - 1)
    stats = engine.get_stats()
    assert stats.spec_num_accepted_tokens > 0 and stats.kv_cache_usage == 0.0


@torch.inference_mode()
def test_sampled_rows_and_a_mixed_batch_end_clean(loaded):
    from pagedserve.sampling_params import SamplingParams

    prompt_list = repeating_prompts(6, seed=9)
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=40,
                             ignore_eos=True, repetition_penalty=1.1 if i == 5 else 1.0)
              for i in range(6)]
    outs = [run(make_engine(loaded, speculative_config=NGRAM), prompt_list, params)
            for _ in range(2)]
    assert outs[0] == outs[1]  # seeded rows repeat under speculation


@torch.inference_mode()
@pytest.mark.parametrize("batch", [1, 4])
def test_a_draft_model_gives_the_default_engines_greedy_tokens(loaded, checkpoint, batch):
    from pagedserve.sampling_params import SamplingParams

    prompt_list = prompts(batch, seed=20 + batch)
    params = [SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)] * batch
    plain = run(make_engine(loaded), prompt_list, params)
    engine = make_engine(loaded, speculative_config={"model": checkpoint,
                                                     "num_speculative_tokens": 4})
    speculative = run(engine, prompt_list, params)
    assert sum(a == b for a, b in zip(plain, speculative)) >= max(1, batch - 1)
    stats = engine.get_stats()
    assert stats.spec_num_accepted_tokens >= 0.8 * stats.spec_num_draft_tokens > 0
    assert stats.kv_cache_usage == 0.0


@torch.inference_mode()
def test_eagle3_heads_give_the_default_engines_greedy_tokens(loaded, tmp_path):
    from pagedserve.sampling_params import SamplingParams
    from tests.spec.heads import write_eagle3_head

    mc = loaded.model_config
    head = write_eagle3_head(tmp_path / "eagle3", {
        "hidden_size": mc.hidden_size, "vocab_size": mc.vocab_size,
        "max_position_embeddings": mc.max_position_embeddings}, None, 4096, heads=16,
        kv_heads=8, head_dim=64)
    prompt_list = prompts(4, seed=31)
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)] * 4
    plain = run(make_engine(loaded), prompt_list, params)
    engine = make_engine(loaded, speculative_config={
        "method": "eagle3", "model": str(head), "num_speculative_tokens": 3})
    speculative = run(engine, prompt_list, params)
    assert sum(a == b for a, b in zip(plain, speculative)) >= 3
    stats = engine.get_stats()
    assert stats.spec_num_draft_tokens > 0 and stats.kv_cache_usage == 0.0


def run_outputs(engine, prompt_list, params_list) -> list:
    """Each request's final CompletionOutput (tokens, text, logprobs, finish reason)."""
    for i, (ids, params) in enumerate(zip(prompt_list, params_list)):
        engine.add_request(f"c{i}", None, params, prompt_token_ids=ids)
    done = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output.outputs[0]
    assert not engine.kv_cache_manager.req_to_blocks
    return [done[f"c{i}"] for i in range(len(prompt_list))]


@torch.inference_mode()
def test_penalty_logprobs_and_json_rows_are_verified(loaded):
    """Rows with penalties and logprobs and a json_schema row (its k + 1 bitmask rows per
    verify filled by the grammar process, CUDA's default) are drafted for: drafts are
    accepted, the greedy tokens mostly match the default engine's (bf16 near-ties aside),
    every token has its logprobs, close to the default engine's where the tokens agree, and
    the JSON parses."""
    import json

    from pagedserve.sampling_params import SamplingParams
    from pagedserve.structured.params import StructuredOutputsParams

    schema = {"type": "object", "required": ["a"],
              "properties": {"a": {"type": "string", "pattern": "^[a-z]{1,12}$"}}}
    prompt_list = repeating_prompts(3, seed=11)
    params = [SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=2,
                             frequency_penalty=0.3, repetition_penalty=1.05),
              SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=1),
              SamplingParams(temperature=0.0, max_tokens=48,
                             structured_outputs=StructuredOutputsParams(json=schema))]
    plain = run_outputs(make_engine(loaded), prompt_list, params)
    engine = make_engine(loaded, speculative_config=NGRAM)
    speculative = run_outputs(engine, prompt_list, params)
    assert engine.get_stats().spec_num_accepted_tokens > 0
    assert sum(p.token_ids == s.token_ids for p, s in zip(plain, speculative)) >= 2
    for p, s in zip(plain[:2], speculative[:2]):
        assert len(s.logprobs) == len(s.token_ids)
        for token, entry in zip(s.token_ids, s.logprobs):
            assert token in entry
        if p.token_ids == s.token_ids:
            for token, got, want in zip(s.token_ids, s.logprobs, p.logprobs):
                assert got[token].logprob == pytest.approx(want[token].logprob, abs=0.1)
    assert speculative[2].finish_reason == "stop"
    assert json.loads(speculative[2].text)["a"].isalpha()


@torch.inference_mode()
def test_async_engine_pipelines_large_batches_and_drafts_small_ones(loaded):
    """12 requests of different lengths with drafting off above 4: the async engine pipelines
    (graphs, placeholders) while more than 4 run, then completes its step in flight and
    verifies synchronously; greedy tokens mostly match the default engine's, drafts are
    accepted, every block comes back."""
    from pagedserve.sampling_params import SamplingParams

    prompt_list = repeating_prompts(12, seed=17)
    params = [SamplingParams(temperature=0.0, max_tokens=16 + 8 * i, ignore_eos=True)
              for i in range(12)]
    plain = run(make_engine(loaded), prompt_list, params)
    engine = make_engine(loaded, speculative_config=NGRAM | {"disable_by_batch_size": 4})
    assert engine.async_scheduling
    speculative = run(engine, prompt_list, params)
    assert sum(a == b for a, b in zip(plain, speculative)) >= 10
    stats = engine.get_stats()
    assert stats.spec_num_accepted_tokens > 0 and stats.kv_cache_usage == 0.0
