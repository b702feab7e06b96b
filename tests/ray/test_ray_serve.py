"""Two pagedserve replicas on a local Ray Serve cluster behind one OpenAI endpoint: both
answer through the `openai` client, and requests that share a prompt prefix land on the
replica that cached it (the `x-pagedserve-replica` header, and the cached prompt tokens the
replica reports in `usage`)."""

from __future__ import annotations

import socket

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")

from pagedserve.entrypoints.ray_serve import REPLICA_HEADER, build_app  # noqa: E402

pytestmark = pytest.mark.timeout(600)

# two system prompts of several KV blocks each, distinct from their first token
SYSTEMS = [f"You are assistant number {i}. " + "Answer briefly and politely, in plain words. "
           * 8 for i in ("one", "two")]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def client():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(["--max-model-len", "512", "--max-num-seqs", "4"], num_replicas=2,
                            replica_cpus=0.5, max_ongoing_requests=8),
                  name="pagedserve", route_prefix="/")
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                            timeout=120, max_retries=0)
    finally:
        serve.shutdown()
        ray.shutdown()


def _ask(client, system: str, question: str):
    """(the replica that answered, cached prompt tokens, the answer)."""
    raw = client.chat.completions.with_raw_response.create(
        model="SmolLM2-135M-Instruct", max_tokens=4, temperature=0,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}])
    answer = raw.parse()
    details = answer.usage.prompt_tokens_details
    return raw.headers[REPLICA_HEADER], details.cached_tokens if details else 0, answer


def test_two_replicas_answer_and_shared_prefixes_stay_where_they_are_cached(client):
    first, cached, answer = _ask(client, SYSTEMS[0], "What is a cache?")
    assert answer.choices[0].message.content and cached == 0
    # a prompt that matches nowhere goes to the replica caching less: the other one
    other, _, answer = _ask(client, SYSTEMS[1], "What is a cache?")
    assert other != first and answer.choices[0].message.content
    for question in ("What is a block?", "Why share a prefix?"):
        for system, replica in ((SYSTEMS[0], first), (SYSTEMS[1], other)):
            landed, cached, _ = _ask(client, system, question)
            assert landed == replica
            assert cached >= 64  # the system prompt's blocks came from that replica's cache


def test_other_paths_are_relayed(client):
    assert [m.id for m in client.models.list().data]
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="SmolLM2-135M-Instruct", prompt="hi", max_tokens=-1)
