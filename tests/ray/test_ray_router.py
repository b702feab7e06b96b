"""The router's view of a replica's cache is built from the replica's KV events, batches
missed before it subscribed recovered by replay, and matches a prompt's chain from its first
block (no Ray cluster needed: a publisher stands in for the replica's engine)."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("ray.serve.request_router")

from pagedserve.entrypoints.ray_router import ReplicaCache  # noqa: E402
from pagedserve.kv_cache.events import (AllBlocksCleared, BlockRemoved, BlockStored,  # noqa: E402
                                        KVEventBatch)
from pagedserve.kv_cache.kv_events import KVEventPublisher  # noqa: E402


def stored(*hashes: int, medium: str = "GPU") -> BlockStored:
    return BlockStored(list(hashes), None, [], 16, None, medium)


def read_until(cache: ReplicaCache, seq: int) -> None:
    for _ in range(100):
        cache.read()
        if cache.last_seq >= seq:
            return
        time.sleep(0.05)
    raise AssertionError(f"batch {seq} never arrived")


def test_events_missed_before_subscribing_are_replayed_and_matched_as_a_chain():
    publisher = KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    try:
        publisher.publish([stored(1, 2)])  # before anyone subscribes: lost on PUB
        publisher.publish([stored(3, medium="CPU")])
        cache = ReplicaCache(publisher.endpoint, publisher.replay_endpoint)
        cache.subscribe()
        time.sleep(0.3)  # the subscription reaches the publisher
        publisher.publish([BlockRemoved([2], "GPU")])
        read_until(cache, 2)
        assert cache.match([1, 2, 3]) == 1  # 2 was evicted: the chain stops there
        assert cache.match([3, 1]) == 2  # the host tier's blocks count as cached
        assert cache.match([9, 1]) == 0  # a match starts at the first block
        publisher.publish([AllBlocksCleared()])
        read_until(cache, 3)
        assert cache.match([1]) == 0 and cache.size() == 0
        cache.close()
    finally:
        publisher.close()


def test_without_replay_a_gap_is_skipped_not_waited_for():
    publisher = KVEventPublisher("tcp://127.0.0.1:*")
    try:
        publisher.publish([stored(1)])
        cache = ReplicaCache(publisher.endpoint, None)
        cache.subscribe()
        time.sleep(0.3)
        publisher.publish([stored(2)])
        read_until(cache, 1)
        assert cache.match([1]) == 0 and cache.match([2]) == 1
        cache.close()
    finally:
        publisher.close()


def test_a_routed_prompt_counts_as_cached_until_the_cache_is_cleared():
    """A burst sharing a prefix follows its first request before any event arrives."""
    cache = ReplicaCache("tcp://127.0.0.1:1", None)
    cache.add_routed([7, 8])
    assert cache.match([7, 8, 9]) == 2
    cache.apply(KVEventBatch(0.0, [stored(7)]))
    assert cache.match([7, 8]) == 2 and cache.size() == 2
    cache.apply(KVEventBatch(0.0, [AllBlocksCleared()]))
    assert cache.match([7]) == 0
