"""The prefix cache's hit rate weighs each admitted prompt once: a request that waits for KV
room is looked up again in every step it waits, and those lookups are not queries (else a
queue in front of a full pool decides the rate, not the cache)."""

from __future__ import annotations

from pagedserve.sampling_params import SamplingParams

FIRST = list(range(100, 180))  # five blocks of 16
SECOND = FIRST[:16] + list(range(500, 548))  # four blocks, the first shared with FIRST
NEW_TOKENS = 16


def steps_of(engine, prompts):
    """Add every prompt at once and step until done: per step, the (request, tokens so far)
    that came out."""
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for name, ids in prompts.items():
        engine.add_request(name, None, params, prompt_token_ids=ids)
    steps = []
    while engine.has_unfinished_requests():
        steps.append(sorted((o.request_id, len(o.outputs[0].token_ids)) for o in engine.step()))
    return steps


def test_a_request_waiting_for_room_is_counted_once(make_engine, engine):
    """Seven usable blocks: the second request (three blocks of its own) waits while the
    first holds five and grows to six, and is admitted when the first is done, with the
    first's leading block as its hit."""
    small = make_engine(kv_cache_memory=8 * engine.get_stats().kv_block_bytes)
    before = small.get_stats()
    steps = steps_of(small, {"first": FIRST, "second": SECOND})
    stats = small.get_stats()
    first_done = next(i for i, step in enumerate(steps) if ("first", NEW_TOKENS) in step)
    assert all(name == "first" for step in steps[:first_done + 1] for name, _ in step)
    assert stats.prefix_cache_queries - before.prefix_cache_queries == len(FIRST) + len(SECOND)
    assert stats.prefix_cache_hits - before.prefix_cache_hits == 16
