"""Speculative decoding with proposers on the device (issue 30): a draft model and EAGLE-3
heads, on the tiny random float32 Qwen3 of test_async_scheduling. Greedy tokens are those of
the engine without speculation, across chunked prefill, a prefix hit and preemption. A draft
that is the target itself must have every draft accepted: that holds only while the draft's
KV (in the target's blocks) stays that of the tokens it belongs to, through rejected drafts,
prefix hits and preemption. Bad configs are refused when the engine starts."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.make_checkpoint import make_checkpoint
from pagedserve.config import EngineConfig
from pagedserve.frontend.llm_engine import LLMEngine
from pagedserve.sampling_params import SamplingParams
from tests.engine.test_async_scheduling import (  # noqa: F401 (the module's model fixture)
    BLOCK, CONFIG, VOCAB, Arrival, greedy, loaded, prompts, run, summary)
from tests.engine.test_speculative import free_run, mixed_batch  # noqa: F401 (fixture)
from tests.spec.heads import write_eagle3_head

# K and V, 2 layers, 2 KV heads of 32, fp32: the target's block; a draft's share is added
TARGET_BLOCK = 2 * 2 * BLOCK * 2 * 32 * 4


def make(loaded, speculative_config, num_blocks: int = 256, draft_layers: int = 0,
         **options) -> LLMEngine:
    block_bytes = TARGET_BLOCK * (2 + draft_layers) // 2
    options.setdefault("max_num_batched_tokens", 64)  # prompts longer than this are chunked
    options.setdefault("async_scheduling", False)
    engine = LLMEngine(EngineConfig(
        model="tiny", device="cpu", dtype="float32", block_size=BLOCK,
        kv_cache_memory=num_blocks * block_bytes, speculative_config=speculative_config,
        **options), loaded)
    assert engine.engine_core.num_blocks == num_blocks
    return engine


@pytest.fixture(scope="module")
def models(tmp_path_factory, loaded) -> dict[str, str]:
    """Draft folders: another random model of the target's vocabulary (one layer), one of
    another vocabulary, one of a shorter context, and EAGLE-3 heads."""
    root = tmp_path_factory.mktemp("drafts")
    folders = {"self": loaded.tokenizer_source}
    for name, vocab, positions in (("draft", VOCAB, 512), ("other_vocab", VOCAB + 41, 512),
                                   ("short", VOCAB, 256)):
        config = dict(CONFIG, num_hidden_layers=1, vocab_size=vocab,
                      max_position_embeddings=positions)
        (root / f"{name}.json").write_text(json.dumps(config))
        make_checkpoint(root / f"{name}.json", root / name, torch.float32, seed=3,
                        tokenizer="bytes")
        folders[name] = str(root / name)
    # a head that states a shorter context than the target's, as published heads do: its
    # RoPE table is built as long as the engine's (the prompts here go past 64 positions)
    folders["eagle3"] = str(write_eagle3_head(root / "eagle3", CONFIG, [0, 0, 1], 200,
                                              max_position_embeddings=64))
    folders["eagle3_vocab"] = str(write_eagle3_head(root / "eagle3_vocab", CONFIG, None, 200,
                                                    vocab_size=VOCAB + 1))
    return folders


def arrivals() -> list[Arrival]:
    ps = prompts(7, [9, 90, 30])
    return [
        Arrival(0, "short", ps[0], greedy(28)),
        Arrival(0, "chunked", ps[1], greedy(24)),  # 90 tokens over a 64-token budget
        Arrival(1, "other", ps[2], greedy(28)),
        Arrival(4, "prefix-hit", ps[1][:64] + ps[0], greedy(20)),
    ]


def spec(models, name: str, method: str | None = None, k: int = 3) -> dict:
    config = {"model": models[name], "num_speculative_tokens": k}
    return config if method is None else config | {"method": method}


@pytest.fixture(scope="module")
def plain(loaded) -> dict:
    return summary(run(make(loaded, None), arrivals()))


@pytest.mark.parametrize("name, method, layers", [
    ("self", None, 2), ("draft", "draft_model", 1), ("eagle3", "eagle3", 1)])
def test_greedy_tokens_match_the_engine_without_speculation(loaded, models, plain, name,
                                                            method, layers):
    engine = make(loaded, spec(models, name, method), draft_layers=layers)
    assert summary(run(engine, arrivals())) == plain
    stats = engine.get_stats()
    assert stats.prefix_cache_hits >= 64 and stats.spec_num_draft_tokens > 0
    if name == "self":  # the target drafting for itself: every draft is its next token
        assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens


def mixed_batch_runs(loaded, free_run, runs: list[tuple[dict | None, dict]]):
    """The mixed batch (`mixed_batch`, p3's 13th free-run token made an EOS so a request
    stops mid-batch) on an engine per (speculative config, `make` options) of `runs`: each
    run's summary, and the engines."""
    arrivals = mixed_batch(free_run)
    eos = free_run["p3"].token_ids[12]
    results, engines = [], []
    for config, options in runs:
        engine = make(loaded, config, **options)
        engine.engine_core.eos_token_ids = frozenset({eos})
        results.append(summary(run(engine, arrivals)))
        engines.append(engine)
    return results, engines


@pytest.mark.parametrize("name, method, layers", [("self", None, 2), ("eagle3", "eagle3", 1)])
def test_a_mixed_batch_matches(loaded, models, free_run, name, method, layers):
    """Stops, n > 1, penalties, logprobs and a JSON schema in one batch, drafted for by the
    target itself or EAGLE-3 heads: the same outputs, logprobs included, as without
    speculation."""
    results, engines = mixed_batch_runs(loaded, free_run, [
        (None, {}), (spec(models, name, method), {"draft_layers": layers})])
    assert results[1] == results[0]
    stats = engines[1].get_stats()
    assert stats.spec_num_draft_tokens > 0
    if name == "self":
        assert stats.spec_num_accepted_tokens > 0


@pytest.mark.parametrize("name, method, layers", [("self", None, 2), ("eagle3", "eagle3", 1)])
def test_greedy_tokens_match_across_preemption(loaded, models, name, method, layers):
    ps = prompts(11, [40, 33, 50, 21])
    batch = [Arrival(i % 2, f"r{i}", p, greedy(40)) for i, p in enumerate(ps)]
    results = []
    for config in (None, spec(models, name, method)):
        engine = make(loaded, config, num_blocks=14, draft_layers=layers if config else 0)
        results.append(summary(run(engine, batch)))
        stats = engine.get_stats()
        assert stats.num_preemptions > 0
    assert results[1] == results[0]
    if name == "self":
        assert 0 < stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens


@pytest.mark.parametrize("name, method, layers", [("self", None, 2), ("eagle3", "eagle3", 1)])
def test_async_scheduling_drafts_in_small_batches_and_pipelines_large_ones(
        loaded, models, free_run, name, method, layers):
    """With async scheduling the steps small enough to draft for run synchronously, the
    others pipelined, the draft running over each pipelined step's chunks once its tokens
    are back (requests finishing, by a stop, while a step holding them is in flight): the
    mixed batch, whose size passes disable_by_batch_size and comes back under it, gives
    the outputs of the synchronous engine without speculation. The target drafting for
    itself has every draft accepted: the pipelined steps kept the draft's KV right."""
    results, engines = mixed_batch_runs(loaded, free_run, [
        (None, {"async_scheduling": False}),
        (spec(models, name, method) | {"disable_by_batch_size": 3},
         {"draft_layers": layers, "async_scheduling": True})])
    assert [engine.async_scheduling for engine in engines] == [False, True]
    assert results[1] == results[0]
    stats = engines[1].get_stats()
    assert stats.spec_num_draft_tokens > 0
    if name == "self":
        assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens


def test_seeded_sampling_repeats_with_a_draft_model(loaded, models):
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=24,
                            ignore_eos=True)
    batch = [Arrival(0, "s", prompts(13, [20])[0], params)]
    outs = []
    for _ in range(2):
        engine = make(loaded, spec(models, "self"), draft_layers=2)
        outs.append(summary(run(engine, batch)))
        assert engine.get_stats().spec_num_accepted_tokens > 0
    assert outs[0] == outs[1]


def test_the_drafts_kv_moves_with_swaps_and_the_offload_tiers(loaded, models, tmp_path):
    """Swapped out and in, or evicted to the host tier and recalled: the target drafting for
    itself still has every draft accepted, so the draft's KV came back with the blocks."""
    ps = prompts(17, [40, 33, 50, 21])
    batch = [Arrival(i % 2, f"r{i}", p, greedy(40)) for i, p in enumerate(ps)]
    block = TARGET_BLOCK * 2  # the target's and its own draft's
    swap = dict(num_blocks=14, preemption_mode="swap", swap_space=64 * block)
    tiers = dict(num_blocks=8, kv_offload_memory=64 * block, kv_offload_path=str(tmp_path))
    turns = [Arrival(0, "turn1", ps[0], greedy(8))] + [
        Arrival(1 + 12 * i, f"other{i}", p, greedy(8)) for i, p in enumerate(ps[1:])]
    for options, arrivals, counter in ((swap, batch, "num_blocks_swapped_in"),
                                       (tiers, turns, "host_tier_hits")):
        if options is tiers:  # turn 2: turn 1 and more, after the others pushed it out
            arrivals = arrivals + [Arrival(60, "turn2", ps[0] + [5, 6, 7], greedy(8))]
        outs, stats = [], None
        for config in (None, spec(models, "self")):
            engine = make(loaded, config, draft_layers=2 if config else 0, **options)
            outs.append(summary(run(engine, arrivals)))
            stats = engine.get_stats()
        assert outs[1] == outs[0]
        assert getattr(stats, counter) > 0
        assert 0 < stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens


@pytest.mark.parametrize("name, config, message", [
    ("other_vocab", {}, "vocabulary"),
    ("eagle3_vocab", {"method": "eagle3"}, "vocabulary"),
    ("short", {}, "shorter than max_model_len"),
    ("draft", {"num_speculative_tokens": 17}, "num_speculative_tokens"),
    ("draft", {"method": "medusa"}, "not built yet"),
    ("draft", {"method": "lookahead"}, "method must be one of"),
    ("draft", {"method": "ngram"}, "speculative_config.model is for"),
])
def test_bad_configs_are_refused_at_start(loaded, models, name, config, message):
    with pytest.raises(ValueError, match=message):
        make(loaded, {"model": models[name]} | config)


def test_a_model_method_needs_its_model(models):
    with pytest.raises(ValueError, match="needs \"model\""):
        EngineConfig(speculative_config={"method": "eagle3"})
    parsed = EngineConfig(speculative_config={"model": models["draft"]}).speculative_config
    assert parsed.method == "draft_model" and parsed.on_device
