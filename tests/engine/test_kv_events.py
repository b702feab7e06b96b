"""KV-cache events reach a ZeroMQ subscriber in vLLM's schema, decoded by a decoder written
from that schema alone (tests/vllm_kv_events.py): stored blocks chained by their parents'
hashes with their tokens, evictions, a cleared cache, numbered batches, and the batches a
subscriber missed replayed on request."""

from __future__ import annotations

import time

import pytest
import zmq

from pagedserve.kv_cache.events import external_hash
from pagedserve.kv_cache.hashing import get_hash_fn
from pagedserve.kv_cache.kv_events import DEFAULT_TOPIC
from pagedserve.sampling_params import SamplingParams
from tests.vllm_kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, receive,
                                  replay)

BLOCK = 16
SEED = "fleet-seed"


@pytest.fixture
def subscribe():
    sockets = []

    def connect(endpoint: str) -> zmq.Socket:
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, DEFAULT_TOPIC.encode())
        sub.connect(endpoint)
        time.sleep(0.3)  # a PUB socket drops what it sends before the subscription arrives
        sockets.append(sub)
        return sub

    yield connect
    for sub in sockets:
        sub.close()


def events_of(batches) -> list:
    return [e for _, batch in batches for e in batch.events]


def run(engine, request_id: str, prompt: list[int]) -> None:
    engine.add_request(request_id, None, SamplingParams(max_tokens=1), prompt_token_ids=prompt)
    while engine.has_unfinished_requests():
        engine.step()


def test_stored_removed_and_cleared_events_reach_a_subscriber(make_engine, engine, subscribe):
    small = 7 * engine.model_runner.block_bytes  # 6 usable blocks: a third prompt evicts
    engine = make_engine(kv_events_endpoint="tcp://127.0.0.1:*", block_size=BLOCK,
                         kv_cache_memory=small, prefix_caching_hash_seed=SEED)
    sub = subscribe(engine.engine_core.kv_event_publisher.endpoint)
    first = list(range(100, 100 + 3 * BLOCK + 5))  # 3 full blocks, then a partial one
    run(engine, "a", first)
    batches = receive(sub)
    assert [seq for seq, _ in batches] == list(range(len(batches)))
    assert all(batch.data_parallel_rank == 0 and batch.ts > 0 for _, batch in batches)
    stored = events_of(batches)
    assert all(isinstance(e, BlockStored) for e in stored)
    hashes = [h for e in stored for h in e.block_hashes]
    # the hashes a router computes from the prompt with the fleet's seed
    expected = get_hash_fn("sha256", SEED).chain(None, first[:3 * BLOCK], BLOCK, [None] * 3)
    assert hashes == [external_hash(h) for h in expected]
    assert all(0 <= h < 2 ** 64 for h in hashes)
    assert stored[0].parent_block_hash is None
    assert [e.parent_block_hash for e in stored[1:]] == \
        [e.block_hashes[-1] for e in stored[:-1]]
    assert [t for e in stored for t in e.token_ids] == first[:3 * BLOCK]
    assert {(e.block_size, e.lora_id, e.medium) for e in stored} == {(BLOCK, None, "GPU")}

    # other prompts fill the small cache: the first prompt's blocks are evicted
    before = engine.get_stats().prefix_cache_evictions
    for i in range(2):
        run(engine, f"b{i}", list(range(2000 + 1000 * i, 2000 + 1000 * i + 3 * BLOCK + 5)))
    events = events_of(receive(sub))
    removed = {h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes}
    assert removed & set(hashes)
    assert {e.medium for e in events if isinstance(e, BlockRemoved)} == {"GPU"}
    assert engine.get_stats().prefix_cache_evictions - before == len(removed) > 0

    assert engine.kv_cache_manager.reset_prefix_cache()
    engine.step()  # events are published after each step
    assert receive(sub)[-1][1].events == [AllBlocksCleared()]


def test_a_subscriber_that_missed_batches_gets_them_replayed(make_engine, subscribe):
    engine = make_engine(kv_events_endpoint="tcp://127.0.0.1:*", block_size=BLOCK,
                         kv_events_replay_endpoint="tcp://127.0.0.1:*")
    publisher = engine.engine_core.kv_event_publisher
    early = subscribe(publisher.endpoint)
    run(engine, "before", list(range(500, 500 + 2 * BLOCK + 1)))
    sub = subscribe(publisher.endpoint)  # connects late: it misses the first batches
    run(engine, "after", list(range(900, 900 + 2 * BLOCK + 1)))
    seen, everything = receive(sub), receive(early)
    first_seen = seen[0][0]
    assert first_seen > 0  # a gap: batches 0 .. first_seen - 1 were missed
    replayed = replay(publisher.replay_endpoint, 0)
    assert [seq for seq, _ in replayed] == [seq for seq, _ in everything]
    assert replayed[:first_seen] == everything[:first_seen]
    assert replay(publisher.replay_endpoint, first_seen) == everything[first_seen:]
    assert replay(publisher.replay_endpoint, 10 ** 6) == []


def test_events_off_by_default(engine):
    assert engine.engine_core.kv_event_publisher is None
    assert not engine.kv_cache_manager.block_pool.enable_events


def test_an_endpoint_in_use_is_a_clear_error(make_engine):
    engine = make_engine(kv_events_endpoint="tcp://127.0.0.1:*")
    with pytest.raises(ValueError, match="cannot publish KV events"):
        make_engine(kv_events_endpoint=engine.engine_core.kv_event_publisher.endpoint)
    with pytest.raises(ValueError, match="kv_events_replay_endpoint needs kv_events_endpoint"):
        make_engine(kv_events_replay_endpoint="tcp://127.0.0.1:*")


def test_tier_events_carry_their_medium(make_engine, engine, subscribe, tmp_path):
    """Blocks the device pool evicts are stored in the host tier (medium "CPU", under the
    same hashes); the blocks it drops go to the disk tier (medium "DISK"); each tier's
    events match its counts."""
    block_bytes = engine.model_runner.block_bytes
    engine = make_engine(kv_events_endpoint="tcp://127.0.0.1:*", block_size=BLOCK,
                         kv_cache_memory=7 * block_bytes, kv_offload_memory=2 * block_bytes,
                         kv_offload_path=str(tmp_path))
    sub = subscribe(engine.engine_core.kv_event_publisher.endpoint)
    for i in range(6):
        run(engine, f"c{i}", list(range(3000 + 1000 * i, 3000 + 1000 * i + 3 * BLOCK + 5)))
    events = events_of(receive(sub))

    def hashes(kind, medium):
        return [h for e in events if isinstance(e, kind) and e.medium == medium
                for h in e.block_hashes]

    host_stored, host_removed = hashes(BlockStored, "CPU"), hashes(BlockRemoved, "CPU")
    disk_stored = hashes(BlockStored, "DISK")
    assert host_stored and set(host_stored) <= set(hashes(BlockRemoved, "GPU"))
    assert all(e.token_ids == [] and e.parent_block_hash is None for e in events
               if isinstance(e, BlockStored) and e.medium in ("CPU", "DISK"))
    assert host_removed and set(host_removed) <= set(host_stored)
    assert disk_stored and set(disk_stored) <= set(host_removed)
    stats = engine.get_stats()
    assert (stats.host_tier_stores, stats.host_tier_evictions) == (len(host_stored),
                                                                   len(host_removed))
    assert (stats.disk_tier_stores, stats.disk_tier_evictions) == (
        len(disk_stored), len(hashes(BlockRemoved, "DISK")))
