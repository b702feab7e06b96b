"""Speculative decoding (issue 30) on a tiny random float32 Qwen3 checkpoint: greedy tokens
identical to the engine without speculation across chunked prefill, prefix hits, n > 1, stop
strings, stop token ids, EOS, a json_schema request, penalties and logprobs in the same
batch, and across preemption; rows with penalties, logprobs or a JSON schema are verified
(drafts accepted) with the same tokens and logprobs as without; seeded sampling repeats;
every engine ends with its pool clean (`run` checks). The tiny model's greedy outputs loop,
so prompt lookup finds drafts and some are accepted (checked through the engine's stats)."""

from __future__ import annotations

import json

import pytest

from pagedserve.config import EngineConfig
from pagedserve.entrypoints.server.metrics import ServerMetrics
from pagedserve.frontend.llm_engine import LLMEngine
from pagedserve.sampling_params import SamplingParams
from pagedserve.structured.params import StructuredOutputsParams
from tests.engine.test_async_scheduling import (  # noqa: F401 (the module's model fixture)
    BLOCK, Arrival, greedy, loaded, prompts, run, summary)

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}


def make(loaded, speculative_config, num_blocks: int = 256, **options) -> LLMEngine:
    block_bytes = 2 * 2 * BLOCK * 2 * 32 * 4  # K and V, 2 layers, 2 KV heads of 32, fp32
    options.setdefault("max_num_batched_tokens", 64)  # prompts longer than this are chunked
    options.setdefault("async_scheduling", False)
    return LLMEngine(EngineConfig(
        model="tiny", device="cpu", dtype="float32", block_size=BLOCK,
        kv_cache_memory=num_blocks * block_bytes,
        speculative_config=speculative_config, **options), loaded)


def repeated(seed: int, period: int, length: int) -> list[int]:
    """A prompt that repeats a random phrase: what prompt lookup feeds on."""
    phrase = prompts(seed, [period])[0]
    return (phrase * (length // period + 1))[:length]


@pytest.fixture(scope="module")
def free_run(loaded) -> dict:
    engine = make(loaded, None)
    ps = [repeated(0, 7, 30), repeated(1, 11, 90), prompts(2, [17])[0], repeated(3, 5, 40)]
    out = run(engine, [Arrival(0, f"p{i}", p, greedy(32)) for i, p in enumerate(ps)])
    return {f"p{i}": out[f"p{i}"][0] for i in range(len(ps))} | {"prompts": ps}


def mixed_batch(free_run) -> list[Arrival]:
    ps = free_run["prompts"]
    p0, p3 = free_run["p0"], free_run["p3"]
    stop_text = p3.text[len(p3.text) // 2:len(p3.text) // 2 + 2]
    assert stop_text and stop_text in p3.text
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    return [
        Arrival(0, "p0", ps[0], greedy(32)),
        Arrival(0, "p1-chunked", ps[1], greedy(30)),
        Arrival(1, "p0-stop-token", ps[0], greedy(32, stop_token_ids=[p0.token_ids[20]])),
        Arrival(2, "p3-stop-string", ps[3], greedy(32, stop=[stop_text], logprobs=1)),
        Arrival(3, "p4-n2", ps[2] + ps[0], SamplingParams(n=2, temperature=0.0, max_tokens=20,
                                                          ignore_eos=True)),
        Arrival(5, "p5-prefix-hit", ps[1][:48] + ps[3][:20], greedy(24)),
        Arrival(6, "p6-penalties", ps[0], greedy(16, repetition_penalty=1.3)),
        Arrival(6, "p7-logprobs", ps[3], greedy(16, logprobs=2)),
        Arrival(7, "p8-json", ps[2], SamplingParams(
            temperature=0.0, max_tokens=16,
            structured_outputs=StructuredOutputsParams(json=schema))),
        Arrival(8, "p9-eos", ps[3], SamplingParams(temperature=0.0, max_tokens=30)),
    ]


def test_greedy_tokens_match_the_engine_without_speculation(loaded, free_run):
    arrivals = mixed_batch(free_run)
    eos = free_run["p3"].token_ids[12]
    results, stats = [], []
    for spec in (None, NGRAM):
        engine = make(loaded, spec)
        engine.engine_core.eos_token_ids = frozenset({eos})
        results.append(summary(run(engine, arrivals)))
        stats.append(engine.get_stats())
    plain, speculative = results
    assert speculative == plain
    assert stats[1].spec_num_draft_tokens > 0 and stats[1].spec_num_accepted_tokens > 0
    assert stats[1].prefix_cache_hits >= 48
    assert stats[1].spec_accepted_per_position[0] >= stats[1].spec_accepted_per_position[-1]
    assert stats[0].spec_num_drafts == 0
    # the stops fired mid-generation
    assert plain["p0-stop-token"][0][2] == "stop" and plain["p3-stop-string"][0][2] == "stop"
    assert plain["p9-eos"][0][2] == "stop"
    if plain["p8-json"][0][2] == "stop":  # else it ran out of max_tokens
        assert isinstance(json.loads(plain["p8-json"][0][1])["a"], int)


def verified_and_plain(loaded, prompt: list[int], params: SamplingParams, **options):
    """The request's output with speculation and without, and the speculative engine's
    stats."""
    outs = []
    for spec in (NGRAM, None):
        engine = make(loaded, spec, **options)
        outs.append(run(engine, [Arrival(0, "r", prompt, params)])["r"][0])
        if spec is not None:
            stats = engine.get_stats()
    return outs[0], outs[1], stats


@pytest.mark.parametrize("period, params", [
    # a penalty strong enough that a position penalized without the drafts before it
    # picks another token here
    (5, greedy(32, frequency_penalty=1.0, logprobs=2)),
    (7, greedy(32, logprobs=3)),
], ids=["penalties", "logprobs"])
@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_penalty_and_logprobs_rows_are_verified_exactly(loaded, period, params, backend):
    """Each position penalized as of the drafts before it; the logprobs of every accepted
    token are the target's. With the torch backend a verify is a short prefill against the
    paged cache, as CUDA runs it (the CPU backend runs a lone verify as one decode per
    token)."""
    speculative, plain, stats = verified_and_plain(loaded, repeated(0, period, 30), params,
                                                   attention_backend=backend)
    assert stats.spec_num_accepted_tokens > 0
    assert speculative.token_ids == plain.token_ids
    assert len(speculative.logprobs) == len(plain.logprobs) == 32
    for got, want in zip(speculative.logprobs, plain.logprobs):
        assert got.keys() == want.keys()
        for token, logprob in want.items():
            # a verify chunk and a decode sum attention in other orders: float32's ~1e-5
            assert got[token].logprob == pytest.approx(logprob.logprob, abs=1e-4)
            assert got[token].rank == logprob.rank
    assert speculative.cumulative_logprob == pytest.approx(plain.cumulative_logprob, abs=1e-3)


def test_json_schema_row_is_verified_under_its_grammar(loaded):
    """Each draft position masked by the grammar state its drafts lead to."""
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    params = SamplingParams(temperature=0.0, max_tokens=40,
                            structured_outputs=StructuredOutputsParams(json=schema))
    speculative, plain, stats = verified_and_plain(loaded, repeated(0, 7, 30), params)
    assert stats.spec_num_accepted_tokens > 0
    assert speculative.token_ids == plain.token_ids
    assert speculative.finish_reason == "stop"
    assert isinstance(json.loads(speculative.text)["a"], str)


def test_async_scheduling_drafts_in_small_batches_and_pipelines_large_ones(loaded, free_run):
    """With async scheduling, the steps whose batch is small enough to draft for run
    synchronously (the step in flight completed first), the others pipelined: a long
    request drafted for alone, then joined by a burst (penalties and logprobs, a JSON
    schema, a stop string) that takes the batch past disable_by_batch_size and back, gives
    the tokens of the synchronous engine without speculation."""
    ps = free_run["prompts"]
    p3 = free_run["p3"]
    stop_text = p3.text[len(p3.text) // 2:len(p3.text) // 2 + 2]
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    arrivals = [
        Arrival(0, "long", ps[0], greedy(48)),
        Arrival(3, "b-penalties", ps[3], greedy(12, frequency_penalty=1.0, logprobs=2)),
        Arrival(3, "b-json", ps[2], SamplingParams(
            temperature=0.0, max_tokens=16,
            structured_outputs=StructuredOutputsParams(json=schema))),
        Arrival(3, "b-stop", ps[3], greedy(16, stop=[stop_text])),
        Arrival(4, "b-plain", ps[1], greedy(8)),
    ]
    results, stats = [], []
    for spec, async_scheduling in ((None, False), (NGRAM | {"disable_by_batch_size": 2}, True)):
        engine = make(loaded, spec, async_scheduling=async_scheduling)
        assert engine.async_scheduling is async_scheduling
        results.append(summary(run(engine, arrivals)))
        stats.append(engine.get_stats())
    assert results[1] == results[0]
    assert stats[1].spec_num_accepted_tokens > 0


def test_greedy_tokens_match_across_preemption(loaded, free_run):
    ps = free_run["prompts"]
    arrivals = [Arrival(i % 3, f"r{i}", p, greedy(40)) for i, p in enumerate(ps + ps[:2])]
    results = []
    for spec in (None, NGRAM):
        engine = make(loaded, spec, num_blocks=18)
        results.append(summary(run(engine, arrivals)))
        assert engine.get_stats().num_preemptions > 0
    assert results[1] == results[0]


def test_seeded_sampling_repeats_and_ends_clean(loaded, free_run):
    ps = free_run["prompts"]
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=5, max_tokens=30,
                            ignore_eos=True)
    outs = []
    for _ in range(2):
        engine = make(loaded, NGRAM)
        outs.append(summary(run(engine, [Arrival(0, "s", ps[0], params),
                                         Arrival(0, "g", ps[3], greedy(30))])))
        assert engine.get_stats().spec_num_draft_tokens > 0
    assert outs[0] == outs[1]


def test_no_drafting_above_the_batch_size_rule(loaded, free_run):
    ps = free_run["prompts"]
    engine = make(loaded, NGRAM | {"disable_by_batch_size": 2})
    run(engine, [Arrival(0, f"r{i}", ps[0], greedy(12)) for i in range(3)])
    assert engine.get_stats().spec_num_drafts == 0


def test_metrics_report_acceptance(loaded, free_run):
    engine = make(loaded, NGRAM)
    run(engine, [Arrival(0, "r", free_run["prompts"][0], greedy(32))])
    stats = engine.get_stats()
    metrics = ServerMetrics()
    metrics.update_engine_stats(stats)
    text = metrics.render().decode()
    assert (f"pagedserve_spec_decode_num_accepted_tokens_total "
            f"{float(stats.spec_num_accepted_tokens)}") in text
    assert 'pagedserve_spec_decode_num_accepted_tokens_per_pos_total{position="0"} ' \
           f"{float(stats.spec_accepted_per_position[0])}" in text
    assert (f"pagedserve_spec_decode_mean_accepted_length "
            f"{stats.spec_mean_accepted_length}") in text
    assert stats.spec_mean_accepted_length > 1.0


@pytest.mark.parametrize("config, message", [
    ({"method": "lookahead"}, "method must be one of"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 99}, "num_speculative_tokens"),
    ({"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "ngram", "speculative_tokens": 4}, "unknown key"),
    ({"method": "medusa", "model": "/some/heads"}, "not built yet"),
    ({"method": "eagle3"}, 'needs "model"'),
    ('{"method": "ngram",', "not valid JSON"),
    ([4], "JSON object"),
])
def test_bad_configs_are_refused_at_start(config, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative_config=config)


def test_configs_parse_with_async_scheduling():
    assert EngineConfig(speculative_config=NGRAM, async_scheduling=True).async_scheduling
    assert EngineConfig(speculative_config={"model": "/some/draft"},
                        async_scheduling=True).async_scheduling
    parsed = EngineConfig(speculative_config=json.dumps(NGRAM)).speculative_config
    assert parsed.num_speculative_tokens == 4 and parsed.prompt_lookup_max == 3


def test_async_engine_keeps_its_pipeline_until_a_lookup_finds_a_draft(loaded):
    """With async scheduling a speculating engine steps synchronously only while prompt
    lookup would draft for a running request: a prompt that never repeats itself keeps the
    pipeline, one that does switches to drafting."""
    engine = make(loaded, NGRAM, async_scheduling=True)
    assert engine.async_scheduling
    engine.add_request("plain", None, greedy(8), prompt_token_ids=list(range(3, 20)))
    engine.step()  # the prompt's prefill; its first token is in flight
    assert not engine.scheduler.may_draft()
    engine.add_request("looping", None, greedy(8), prompt_token_ids=repeated(0, 5, 30))
    engine.step()  # admitted beside "plain"
    assert engine.scheduler.may_draft()
    engine.abort_request(["plain", "looping"])
    while engine.has_unfinished_requests():
        engine.step()
