"""/metrics counts each prompt once, reports the prefix cache's hit rate and evictions, and
the server's core publishes its KV-cache events to a ZeroMQ subscriber."""

from __future__ import annotations

import time

import httpx
import zmq

from pagedserve.kv_cache.kv_events import DEFAULT_TOPIC
from tests.vllm_kv_events import BlockStored, receive

PROMPT = "Paged attention keeps the KV cache in blocks of sixteen tokens each. " * 3


def _complete(server, **body) -> dict:
    response = httpx.post(server.url + "/v1/completions", timeout=120,
                          json={"prompt": PROMPT, "max_tokens": 2, **body})
    assert response.status_code == 200, response.text
    return response.json()


def test_a_prompt_counts_once_whatever_n(server):
    before = server.wait_idle()["pagedserve_prompt_tokens_total"]
    usage = _complete(server, n=3, temperature=1.0)["usage"]
    after = server.wait_idle()["pagedserve_prompt_tokens_total"]
    assert after - before == usage["prompt_tokens"] > 0


def test_hit_rate_and_evictions_are_reported(server):
    """The eviction count itself is checked on a tiny cache in tests/engine/test_kv_events.py
    (filling this server's cache would take minutes on a CPU)."""
    _complete(server)
    _complete(server)  # the same prompt: its full blocks come from the prefix cache
    m = server.wait_idle()
    queries, hits = m["pagedserve_prefix_cache_queries_total"], \
        m["pagedserve_prefix_cache_hits_total"]
    assert 0 < m["pagedserve_prefix_cache_hit_rate"] == hits / queries <= 1
    assert m["pagedserve_prefix_cache_evictions_total"] >= 0
    # nothing preempted by swapping here (tests/device/test_swap.py counts real swaps)
    assert m["pagedserve_swapped_out_blocks_total"] == m["pagedserve_swapped_in_blocks_total"] == 0
    # no host tier here (tests/engine/test_host_tier.py counts real recalls)
    assert m["pagedserve_host_tier_hit_blocks_total"] == 0
    assert m["pagedserve_host_tier_stored_blocks_total"] == 0
    assert m["pagedserve_disk_tier_hit_blocks_total"] == m["pagedserve_disk_tier_hit_bytes_total"] == 0
    assert m["pagedserve_kv_tier_copy_seconds_total"] == 0
    assert m["pagedserve_kv_tier_stream_seconds_total"] == 0
    assert m["pagedserve_kv_tier_recall_pass_overs_total"] == 0


def test_kv_events_reach_a_subscriber(server):
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, DEFAULT_TOPIC.encode())
    sub.connect(server.kv_events_endpoint)
    try:
        time.sleep(0.5)  # a PUB socket drops what it sends before the subscription arrives
        unique = f"A prompt no other test sends, at {time.time()}: " + PROMPT
        _complete(server, prompt=unique)
        stored = [e for _, batch in receive(sub, 2000) for e in batch.events
                  if isinstance(e, BlockStored)]
        assert stored, "no BlockStored event for a prompt of several full blocks"
        assert all(len(e.token_ids) == e.block_size * len(e.block_hashes) > 0 and
                   all(isinstance(h, int) for h in e.block_hashes) for e in stored)
    finally:
        sub.close()
