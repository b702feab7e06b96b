"""Many concurrent streams through one engine loop, some clients leaving mid-stream."""

from __future__ import annotations

import asyncio
import json

import httpx

NUM_CLIENTS = 32
NUM_LEAVING = 8  # every fourth client drops the connection after its first tokens
MAX_TOKENS = 10
LEAVING_MAX_TOKENS = 200  # far more than they wait for, so only an abort can end them


async def _stream(http: httpx.AsyncClient, i: int, leave: bool) -> dict:
    body = {"prompt": f"Request {i}: list some animals.", "stream": True, "temperature": 0,
            "max_tokens": LEAVING_MAX_TOKENS if leave else MAX_TOKENS, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    events = []
    async with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[len("data: "):])
            if leave and len(events) >= 2:
                return {"left": True}  # closes the connection mid-stream
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text_chunks = [c for c in chunks if c["choices"]]
    return {"left": False,
            "text": "".join(c["choices"][0]["text"] for c in text_chunks),
            "finish": text_chunks[-1]["choices"][0]["finish_reason"],
            "early_finishes": [c["choices"][0]["finish_reason"] for c in text_chunks[:-1]],
            "usage": chunks[-1]["usage"]}


async def _run_all(url: str) -> list[dict]:
    limits = httpx.Limits(max_connections=NUM_CLIENTS + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        return await asyncio.gather(*[_stream(http, i, i % 4 == 0)
                                      for i in range(NUM_CLIENTS)])


def test_concurrent_streams_with_disconnects(server):
    before = server.metrics()
    results = asyncio.run(_run_all(server.url))

    stayed = [r for r in results if not r["left"]]
    assert len(stayed) == NUM_CLIENTS - NUM_LEAVING
    for r in stayed:
        assert r["finish"] == "length"
        assert all(f is None for f in r["early_finishes"])
        assert r["usage"]["completion_tokens"] == MAX_TOKENS
        assert r["usage"]["total_tokens"] == r["usage"]["prompt_tokens"] + MAX_TOKENS
        assert r["text"]

    m = server.wait_idle()
    assert m["pagedserve_num_requests_running"] == 0
    assert m["pagedserve_num_requests_waiting"] == 0
    assert m["pagedserve_kv_cache_usage_perc"] == 0.0  # the leavers' blocks came back

    def delta(key: str) -> float:
        return m.get(key, 0.0) - before.get(key, 0.0)

    assert delta("pagedserve_request_finished_total{finish_reason=abort}") == NUM_LEAVING
    assert delta("pagedserve_request_finished_total{finish_reason=length}") == len(stayed)
    # each leaver generated far fewer than its max_tokens before its abort took effect
    generated = delta("pagedserve_generation_tokens_total")
    assert len(stayed) * MAX_TOKENS <= generated < len(stayed) * MAX_TOKENS + \
        NUM_LEAVING * LEAVING_MAX_TOKENS
