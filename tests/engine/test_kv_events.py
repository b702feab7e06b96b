"""KV-cache events reach a ZeroMQ subscriber: stored blocks chained by their parents' hashes,
evictions, and a cleared cache, in numbered batches that decode with `decode_batch`."""

from __future__ import annotations

import time

import pytest
import zmq

from pagedserve.kv_cache.block_pool import AllBlocksCleared, BlockRemoved, BlockStored
from pagedserve.kv_cache.kv_events import DEFAULT_TOPIC, decode_batch
from pagedserve.sampling_params import SamplingParams

BLOCK = 16


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


def receive(sub: zmq.Socket) -> list[tuple[int, list]]:
    """Every batch published so far, as (sequence number, events)."""
    batches = []
    while sub.poll(500):
        topic, seq, payload = sub.recv_multipart()
        assert topic == DEFAULT_TOPIC.encode()
        batches.append((int.from_bytes(seq, "big"), decode_batch(payload).events))
    return batches


def run(engine, request_id: str, prompt: list[int]) -> None:
    engine.add_request(request_id, None, SamplingParams(max_tokens=1), prompt_token_ids=prompt)
    while engine.has_unfinished_requests():
        engine.step()


def test_stored_removed_and_cleared_events_reach_a_subscriber(make_engine, engine, subscribe):
    small = 7 * engine.model_runner.block_bytes  # 6 usable blocks: a third prompt evicts
    engine = make_engine(kv_events_endpoint="tcp://127.0.0.1:*", block_size=BLOCK,
                         kv_cache_memory=small)
    sub = subscribe(engine.engine_core.kv_event_publisher.endpoint)
    first = list(range(100, 100 + 3 * BLOCK + 5))  # 3 full blocks, then a partial one
    run(engine, "a", first)
    batches = receive(sub)
    assert [seq for seq, _ in batches] == list(range(len(batches)))
    stored = [e for _, events in batches for e in events]
    assert all(isinstance(e, BlockStored) for e in stored) and len(stored) == 3
    assert stored[0].parent_block_hash is None
    assert [e.parent_block_hash for e in stored[1:]] == [e.block_hash for e in stored[:-1]]
    hashes = engine.kv_cache_manager.block_pool.cached_block_hash_to_block
    assert {e.block_hash: e.block_id for e in stored} == {
        h: b.block_id for h, b in hashes.items()}

    # other prompts fill the small cache: the first prompt's blocks are evicted
    before = engine.get_stats().prefix_cache_evictions
    for i in range(2):
        run(engine, f"b{i}", list(range(2000 + 1000 * i, 2000 + 1000 * i + 3 * BLOCK + 5)))
    events = [e for _, batch in receive(sub) for e in batch]
    removed = {e.block_hash for e in events if isinstance(e, BlockRemoved)}
    assert removed & {e.block_hash for e in stored}
    assert engine.get_stats().prefix_cache_evictions - before == len(removed) > 0

    assert engine.kv_cache_manager.reset_prefix_cache()
    engine.step()  # events are published after each step
    assert receive(sub)[-1][1] == [AllBlocksCleared()]


def test_events_off_by_default(engine):
    assert engine.engine_core.kv_event_publisher is None
    assert not engine.kv_cache_manager.block_pool.enable_events


def test_an_endpoint_in_use_is_a_clear_error(make_engine):
    engine = make_engine(kv_events_endpoint="tcp://127.0.0.1:*")
    with pytest.raises(ValueError, match="cannot publish KV events"):
        make_engine(kv_events_endpoint=engine.engine_core.kv_event_publisher.endpoint)


def test_host_tier_events_carry_their_medium(make_engine, engine, subscribe):
    """Blocks the device pool evicts are stored in the host tier (medium "host", under the
    same hashes); a tier of two slots drops its oldest, also as a "host" event."""
    block_bytes = engine.model_runner.block_bytes
    engine = make_engine(kv_events_endpoint="tcp://127.0.0.1:*", block_size=BLOCK,
                         kv_cache_memory=7 * block_bytes, kv_offload_memory=2 * block_bytes)
    sub = subscribe(engine.engine_core.kv_event_publisher.endpoint)
    for i in range(3):
        run(engine, f"c{i}", list(range(3000 + 1000 * i, 3000 + 1000 * i + 3 * BLOCK + 5)))
    events = [e for _, batch in receive(sub) for e in batch]
    device_removed = {e.block_hash for e in events
                      if isinstance(e, BlockRemoved) and e.medium == "device"}
    host_stored = [e for e in events if isinstance(e, BlockStored) and e.medium == "host"]
    host_removed = [e for e in events if isinstance(e, BlockRemoved) and e.medium == "host"]
    assert host_stored and {e.block_hash for e in host_stored} <= device_removed
    assert all(e.medium == "device" for e in events if isinstance(e, BlockStored)
               and e not in host_stored)
    assert all(0 <= e.block_id < 2 for e in host_stored + host_removed)
    assert len(host_stored) - len(host_removed) <= 2 and host_removed
    stats = engine.get_stats()
    assert (stats.host_tier_stores, stats.host_tier_evictions) == (len(host_stored),
                                                                   len(host_removed))
