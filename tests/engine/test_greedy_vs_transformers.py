"""Greedy pagedserve == greedy transformers, token for token, on the default GGUF.

All prompts run as one continuously-batched mix with staggered arrivals (requests join
between steps while others decode), then again with the prefix cache warm, then on an
engine whose KV budget is small enough to force preemptions by recompute.
"""

from __future__ import annotations

import pytest

from pagedserve.entrypoints.llm import encode_chat
from pagedserve.sampling_params import SamplingParams

NEW_TOKENS = 48
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three uses of copper.",
    "Why is the sky blue?",
    "Give me a short recipe for pancakes.",
    "What does a CPU cache do?",
    "Translate 'good morning' into Spanish and German.",
    "Tell me a fun fact about octopuses.",
]


@pytest.fixture(scope="module")
def prompts(engine):
    return [encode_chat(engine.tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]


@pytest.fixture(scope="module")
def references(prompts, hf_greedy):
    return [hf_greedy(p, NEW_TOKENS) for p in prompts]


def run_staggered(engine, prompts, arrivals_per_step=2, steps_between=3):
    """Add `arrivals_per_step` requests, step `steps_between` times, repeat; then drain."""
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    results, pending, steps = {}, list(enumerate(prompts)), 0
    while pending or engine.has_unfinished_requests():
        if pending and steps % steps_between == 0:
            for i, ids in pending[:arrivals_per_step]:
                engine.add_request(f"r{i}", None, params, prompt_token_ids=ids)
            pending = pending[arrivals_per_step:]
        for output in engine.step():
            if output.finished:
                results[output.request_id] = output.outputs[0].token_ids
        steps += 1
    return [results[f"r{i}"] for i in range(len(prompts))]


def test_staggered_batch_matches_transformers_then_prefix_hits(make_engine, prompts,
                                                              references):
    engine = make_engine(max_num_batched_tokens=96)  # forces chunked prefills into the mix
    assert run_staggered(engine, prompts) == references
    first = engine.get_stats()
    assert run_staggered(engine, prompts) == references
    second = engine.get_stats()
    new_hits = second.prefix_cache_hits - first.prefix_cache_hits
    prompt_blocks = sum(len(p) // engine.config.block_size for p in prompts)
    assert new_hits >= (prompt_blocks - len(prompts)) * engine.config.block_size > 0


def test_preemption_keeps_tokens_exact(make_engine, engine, prompts, references):
    small = make_engine(kv_cache_memory=24 * engine.model_runner.block_bytes)
    assert run_staggered(small, prompts, arrivals_per_step=4, steps_between=1) == references
    assert small.get_stats().num_preemptions > 0
