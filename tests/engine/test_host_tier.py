"""The prefix cache's host tier on the CPU engine (there the disk tier's staging: the CPU
engine takes --kv-offload-memory only with --kv-offload-path): a conversation whose blocks
the device pool evicted is recalled from the host tier and answers with the same greedy
tokens as an engine that never evicted it."""

from __future__ import annotations

import pytest

from pagedserve.sampling_params import SamplingParams

NEW_TOKENS = 12
SYSTEM = list(range(100, 160))  # four blocks of 16 shared by every turn of the conversation
OTHERS = [list(range(1000 + 97 * i, 1000 + 97 * i + 70)) for i in range(4)]


def generate(engine, request_id, prompt):
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    engine.add_request(request_id, None, params, prompt_token_ids=prompt)
    tokens = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                tokens = output.outputs[0].token_ids
    return list(tokens)


def conversation(engine):
    """Turn 1, other users' prompts that push it out of a small pool, turn 2 (turn 1, its
    answer and a follow-up): every answer, in order."""
    first = SYSTEM + [7, 8, 9]
    answers = [generate(engine, "turn1", first)]
    answers += [generate(engine, f"other{i}", ids) for i, ids in enumerate(OTHERS)]
    second = first + answers[0] + [11, 12, 13]
    answers.append(generate(engine, "turn2", second))
    return answers


@pytest.fixture(scope="module")
def reference(make_engine):
    return conversation(make_engine())


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_recalled_conversation_gives_the_same_tokens(make_engine, engine, reference,
                                                     async_scheduling, tmp_path):
    """With async scheduling a step's copies are queued while the step before is in flight."""
    block_bytes = engine.model_runner.block_bytes
    small = make_engine(kv_cache_memory=8 * block_bytes, kv_offload_memory=64 * block_bytes,
                        kv_offload_path=str(tmp_path), async_scheduling=async_scheduling)
    before = small.get_stats()
    assert conversation(small) == reference
    stats = small.get_stats()
    assert stats.prefix_cache_evictions > before.prefix_cache_evictions
    assert stats.host_tier_stores > 0
    assert stats.host_tier_hits >= len(SYSTEM) // 16  # turn 2 found the system prompt
    assert stats.disk_tier_stores == 0  # the host tier held it all


def test_without_the_tier_the_evicted_conversation_is_recomputed(make_engine, engine, reference):
    block_bytes = engine.model_runner.block_bytes
    small = make_engine(kv_cache_memory=8 * block_bytes)
    assert conversation(small) == reference
    assert small.get_stats().host_tier_hits == 0


def test_a_tiny_tier_drops_its_oldest_blocks_and_stays_exact(make_engine, engine, reference,
                                                             tmp_path):
    block_bytes = engine.model_runner.block_bytes
    small = make_engine(kv_cache_memory=8 * block_bytes, kv_offload_memory=3 * block_bytes,
                        kv_offload_path=str(tmp_path))
    assert conversation(small) == reference
    assert small.get_stats().host_tier_evictions > 0


def test_a_negative_offload_size_is_refused():
    from pagedserve.config import EngineConfig

    with pytest.raises(ValueError, match="kv_offload_memory"):
        EngineConfig(kv_offload_memory=-1)


def test_an_engine_without_prefix_caching_refuses_a_tier(make_engine, engine, tmp_path):
    """Without prefix caching nothing is evicted by hash (the CPU engine refuses a host tier
    alone: tests/engine/test_disk_tier.py)."""
    with pytest.raises(ValueError, match="kv_offload_memory"):
        make_engine(enable_prefix_caching=False, kv_offload_path=str(tmp_path),
                    kv_offload_memory=64 * engine.model_runner.block_bytes)


def costs_declining_early_hits():
    """Costs under which a copy is slower than recomputing a block near the start of a
    prompt, faster only near the end of this small engine's context (112 tokens): every
    hit of this conversation (its first 64 tokens) is recomputed, while the tier stays in
    use."""
    from pagedserve.messages import TierCosts

    return TierCosts(block_copy_s=32e-6, token_s=1e-6, token_context_s=6e-9, step_s=1e-6,
                     copy_blocks=4, prefill_tokens=64)


def costs_never_paying():
    from pagedserve.messages import TierCosts

    return TierCosts(block_copy_s=1e-3, token_s=1e-6, token_context_s=0.0, step_s=1e-6,
                     copy_blocks=4, prefill_tokens=64)


@pytest.mark.parametrize("costs", [costs_declining_early_hits, costs_never_paying])
def test_a_hit_not_worth_recalling_is_recomputed_exactly(make_engine, engine, reference,
                                                          tmp_path, monkeypatch, costs):
    """The rates are the engine's start-up measurements; here they are given. A declined hit
    is recomputed (same tokens), nothing is copied back, and every block is free again once
    the requests are done. Where no hit could ever pay, nothing is offloaded either."""
    from pagedserve.device.model_runner import ModelRunner

    monkeypatch.setattr(ModelRunner, "measure_tier_costs", lambda runner, _: costs())
    block_bytes = engine.model_runner.block_bytes
    small = make_engine(kv_cache_memory=8 * block_bytes, kv_offload_memory=64 * block_bytes,
                        kv_offload_path=str(tmp_path))
    assert conversation(small) == reference
    stats = small.get_stats()
    assert stats.host_tier_hits == 0 and stats.disk_tier_hits == 0
    assert stats.prefix_cache_evictions > 0
    if costs is costs_never_paying:
        assert stats.host_tier_stores == 0 and stats.host_tier_declined == 0
    else:
        assert stats.host_tier_stores > 0
        assert stats.host_tier_declined >= len(SYSTEM) // 16  # turn 2's system prompt
    assert stats.kv_cache_usage == 0.0


def steps_of(engine, batches):
    """Each batch of prompts added at once once the one before is done (they compete for
    the small pool: some wait for room); per step, the (request, tokens so far) out of it."""
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    steps = []
    for batch in batches:
        for name, ids in batch.items():
            engine.add_request(name, None, params, prompt_token_ids=ids)
        while engine.has_unfinished_requests():
            steps.append(sorted((o.request_id, list(o.outputs[0].token_ids))
                                for o in engine.step()))
    return steps


def test_declined_recalls_leave_the_device_pool_as_without_the_tier(make_engine, engine,
                                                                   tmp_path, monkeypatch):
    """A tier whose every hit the rule declines stores evicted blocks and costs copies, but
    the device pool must run as without it: the same requests in every step with the same
    tokens, the same device hits and evictions, each admitted prompt looked up once."""
    from pagedserve.device.model_runner import ModelRunner

    monkeypatch.setattr(ModelRunner, "measure_tier_costs",
                        lambda runner, _: costs_declining_early_hits())
    first = SYSTEM + [7, 8, 9]
    batches = [{"turn1": first, **{f"other{i}": ids for i, ids in enumerate(OTHERS[:2])}},
               {"turn2": first + list(range(20, 20 + NEW_TOKENS)) + [11, 12, 13],
                "turn2b": SYSTEM + [5, 6]}]
    block_bytes = engine.get_stats().kv_block_bytes
    runs = {}
    for name, options in (("off", {}), ("declined", {"kv_offload_memory": 64 * block_bytes,
                                                     "kv_offload_path": str(tmp_path)})):
        small = make_engine(kv_cache_memory=8 * block_bytes, **options)
        before = small.get_stats()
        runs[name] = (steps_of(small, batches), before, small.get_stats())
    (off_steps, off_before, off), (on_steps, on_before, on) = runs["off"], runs["declined"]
    assert on_steps == off_steps
    assert on.host_tier_declined - on_before.host_tier_declined >= len(SYSTEM) // 16
    assert on.host_tier_hits == on_before.host_tier_hits
    assert 0 < on.tier_offload_steps - on_before.tier_offload_steps <= len(on_steps)
    assert off.tier_offload_steps == 0
    for name in ("prefix_cache_queries", "prefix_cache_hits", "prefix_cache_evictions"):
        assert getattr(on, name) - getattr(on_before, name) == \
            getattr(off, name) - getattr(off_before, name), name
    prompts = sum(len(ids) for batch in batches for ids in batch.values())
    assert off.prefix_cache_queries - off_before.prefix_cache_queries == prompts
