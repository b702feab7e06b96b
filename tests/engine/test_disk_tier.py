"""The prefix cache's disk tier on the CPU engine (whose only tier it is): a conversation
whose blocks fell out of the device pool and of the host staging is read back from files and
answers with the same greedy tokens as an engine that never evicted it; a corrupt or
truncated file is a miss (recomputed, same tokens); a restart with the same options finds
the files and its first request hits, one under other options does not use them."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from pagedserve.sampling_params import SamplingParams

NEW_TOKENS = 4
SYSTEM = list(range(100, 164))  # four blocks of 16 shared by every turn of the conversation
OTHERS = [list(range(1000 + 97 * i, 1000 + 97 * i + 70)) for i in range(4)]
SEED = "disk-tier-test"


def generate(engine, request_id, prompt):
    """The greedy answer and how many prompt tokens the prefix cache (all tiers) provided."""
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    engine.add_request(request_id, None, params, prompt_token_ids=prompt)
    tokens, cached = None, None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                tokens, cached = output.outputs[0].token_ids, output.num_cached_tokens
    return list(tokens), cached


def conversation(engine, between=lambda: None):
    """Turn 1, other users' prompts that push it out of a small pool, `between`, turn 2:
    every answer in order, and turn 2's cached prompt tokens."""
    first = SYSTEM + [7, 8, 9]
    answers = [generate(engine, "turn1", first)[0]]
    answers += [generate(engine, f"other{i}", ids)[0] for i, ids in enumerate(OTHERS)]
    between()
    second = first + answers[0] + [11, 12, 13]
    answer, cached = generate(engine, "turn2", second)
    return answers + [answer], cached


@pytest.fixture(scope="module")
def reference(make_engine):
    return conversation(make_engine())[0]


def small_engine(make_engine, engine, path: Path, **options):
    """A device pool of 8 blocks and the smallest host staging, so the conversation's
    blocks reach the disk."""
    block_bytes = engine.model_runner.block_bytes
    options.setdefault("prefix_caching_hash_seed", SEED)
    return make_engine(kv_cache_memory=8 * block_bytes, kv_offload_path=str(path), **options)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_conversation_recalled_from_disk_gives_the_same_tokens(make_engine, engine, reference,
                                                                 tmp_path, async_scheduling):
    """With async scheduling the step that loads the files is in flight while the next
    one is scheduled: the request waits for it, not beyond."""
    small = small_engine(make_engine, engine, tmp_path, async_scheduling=async_scheduling)
    answers, cached = conversation(small)
    assert answers == reference
    stats = small.get_stats()
    assert stats.disk_tier_stores > 0 and stats.disk_tier_hits >= len(SYSTEM) // 16
    assert stats.disk_tier_load_failures == 0
    assert cached >= len(SYSTEM)


def test_a_damaged_file_is_a_miss_and_the_block_is_recomputed(make_engine, engine, reference,
                                                              tmp_path, caplog):
    """(Truncated files: tests/kv_cache/test_disk_format.py.)"""
    small = small_engine(make_engine, engine, tmp_path)

    def break_files():
        files = sorted(tmp_path.glob("*/rank0/*.kv"))
        assert files  # the other users pushed the conversation to disk
        for path in files:
            data = bytearray(path.read_bytes())
            data[-1] ^= 0xFF
            path.write_bytes(bytes(data))

    with caplog.at_level(logging.WARNING, logger="pagedserve.kv_cache.disk_format"):
        answers, cached = conversation(small, break_files)
    assert answers == reference
    stats = small.get_stats()
    assert stats.disk_tier_load_failures > 0 and stats.disk_tier_hits == 0
    assert cached < len(SYSTEM)
    assert "checksum mismatch; the block is recomputed" in caplog.text


def test_a_restart_finds_the_blocks_on_disk_under_the_same_options_only(
        make_engine, engine, reference, tmp_path, caplog):
    """Another hash seed (or model, dtype, block size, layout) is another fingerprint: its
    engine says the files are not used, and starts cold."""
    first = small_engine(make_engine, engine, tmp_path)
    assert conversation(first)[0] == reference
    with caplog.at_level(logging.WARNING, logger="pagedserve.kv_cache.disk_format"):
        other = small_engine(make_engine, engine, tmp_path,
                             prefix_caching_hash_seed="another seed")
    assert "they are not used" in caplog.text
    answer, cached = generate(other, "turn1", SYSTEM + [7, 8, 9])
    assert answer == reference[0]
    assert cached == 0 and other.get_stats().disk_tier_hits == 0
    again = small_engine(make_engine, engine, tmp_path)
    answer, cached = generate(again, "turn1", SYSTEM + [7, 8, 9])
    assert answer == reference[0]
    assert cached >= len(SYSTEM) - 16 and again.get_stats().disk_tier_hits > 0


def test_the_cpu_engine_refuses_a_host_tier_alone(make_engine, engine):
    with pytest.raises(ValueError, match="kv_offload_memory: the CPU engine's KV cache is host"):
        make_engine(kv_offload_memory=64 * engine.model_runner.block_bytes)


def test_a_disk_size_under_one_block_is_refused(make_engine, tmp_path):
    with pytest.raises(ValueError, match="kv_offload_disk"):
        make_engine(kv_offload_path=str(tmp_path), kv_offload_disk=1)
