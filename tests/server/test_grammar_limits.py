"""Grammar compiles apart from everything else (issue 29): bounded in size, time and threads,
so hostile schemas cannot starve tokenization, chat templates or /health; and a key from the
environment guarding /health and /metrics too.

The module's servers are stopped at the end of their tests: compiles that ran out of time go
on in the background until they finish (nothing can interrupt one), and end with them.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.server.conftest import start_server, stop_server

KEY = "grammar-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
COMPILE_TIMEOUT_S = 3  # a 120,000-value enum takes longer, several times over
REQUEST_TIMEOUT_S = 12
MAX_GRAMMAR = "1500K"


@pytest.fixture(scope="module")
def guarded():
    srv = start_server("--auth-health-and-metrics", "--grammar-compile-threads", "2",
                       "--grammar-compile-timeout", str(COMPILE_TIMEOUT_S),
                       "--max-grammar-bytes", MAX_GRAMMAR,
                       "--request-timeout", str(REQUEST_TIMEOUT_S),
                       headers=AUTH, env={"PAGEDSERVE_API_KEY": KEY})
    yield srv
    stop_server(srv)


def chat(server, timeout: float = 300, **body) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "Pick one."}], "max_tokens": 8, **body}
    return httpx.post(server.url + "/v1/chat/completions", json=body, headers=AUTH,
                      timeout=timeout)


def enum_schema(count: int, tag: str) -> dict:
    """A JSON schema whose one property is an enum of `count` short strings (10 bytes each
    in the body): 70,000 took 9 s to compile on the dev box, 120,000 take longer still."""
    return {"type": "object", "required": ["x"],
            "properties": {"x": {"enum": [f"{tag}{i:05d}" for i in range(count)]}}}


def json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "pick", "schema": schema}}


def test_health_and_metrics_need_the_key_from_the_environment(guarded):
    for path in ("/health", "/metrics", "/v1/models"):
        assert httpx.get(guarded.url + path, timeout=60).status_code == 401
        assert httpx.get(guarded.url + path, headers=AUTH, timeout=60).status_code == 200


def test_a_spec_over_the_size_bound_is_refused_naming_its_field(guarded):
    big = enum_schema(170_000, "s")  # ~1.7 MB, under the 2 MB body limit
    response = chat(guarded, response_format=json_schema_format(big))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "response_format" and "--max-grammar-bytes" in error["message"]
    tool = {"type": "function", "function": {"name": "pick", "parameters": big}}
    response = chat(guarded, tools=[tool])
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "tools.0.function.parameters"


class Pending(threading.Thread):
    def __init__(self, server, schema: dict) -> None:
        super().__init__()
        self.server, self.schema = server, schema
        self.response: httpx.Response | None = None

    def run(self) -> None:
        try:
            self.response = chat(self.server, response_format=json_schema_format(self.schema))
        except httpx.TransportError:  # its server was stopped first
            pass


def wait_for(condition, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


def compiles(server) -> tuple[float, float]:
    """Grammar compiles on a compile thread, and waiting for one."""
    m = server.metrics()
    return m["pagedserve_grammar_compiles_running"], m["pagedserve_grammar_compiles_waiting"]


@pytest.fixture
def patient():
    """Two compile threads and a compile timeout far longer than the test: whatever compiles
    or waits stays in flight until the server stops."""
    srv = start_server("--grammar-compile-threads", "2", "--grammar-compile-timeout", "3600",
                       "--max-grammar-bytes", MAX_GRAMMAR, headers=AUTH,
                       env={"PAGEDSERVE_API_KEY": KEY})
    yield srv
    stop_server(srv)


def test_six_huge_enum_schemas_in_flight_while_a_plain_chat_answers(patient):
    """Six distinct huge-enum schemas: two compile, four wait for a thread. A plain chat
    (tokenized and templated on other threads) is answered, and /health says 200, while all
    six are still in flight: the compile counts are the same after the chat as before it, so
    no compile ended meanwhile (one that ended would have let a waiting one start)."""
    pending = [Pending(patient, enum_schema(120_000, tag)) for tag in "abcdef"]
    for p in pending:
        p.start()
    wait_for(lambda: compiles(patient) == (2, 4))
    answered = chat(patient)
    assert answered.status_code == 200 and answered.json()["choices"][0]["message"]["content"]
    assert httpx.get(patient.url + "/health", headers=AUTH, timeout=60).status_code == 200
    assert compiles(patient) == (2, 4)
    assert all(p.is_alive() for p in pending)
    stop_server(patient)
    for p in pending:
        p.join(120)


def test_compiles_past_their_time_get_400_and_the_rest_429(guarded):
    """Six distinct huge-enum schemas under a 3 s compile timeout: the two that got a thread
    run out of time on it (400 naming response_format), the four that waited for one never
    get it (429, Retry-After the compile timeout: the threads go on with the compiles in the
    background). A schema that ran out of time is refused at once when sent again."""
    pending = [Pending(guarded, enum_schema(120_000, tag)) for tag in "abcdef"]
    for p in pending:
        p.start()
    for p in pending:
        p.join(300)
        assert not p.is_alive()
    statuses = sorted(p.response.status_code for p in pending)
    assert statuses == [400, 400, 429, 429, 429, 429], [p.response.text for p in pending]
    too_slow = [p for p in pending if p.response.status_code == 400]
    for p in too_slow:
        error = p.response.json()["error"]
        assert error["param"] == "response_format"
        assert "--grammar-compile-timeout" in error["message"]
    for p in pending:
        if p.response.status_code == 429:
            assert p.response.json()["error"]["code"] == "grammar_compiles_busy"
            assert int(p.response.headers["retry-after"]) == COMPILE_TIMEOUT_S

    again = chat(guarded, response_format=json_schema_format(too_slow[0].schema))
    assert again.status_code == 400 and "takes longer" in again.json()["error"]["message"]
    m = guarded.metrics()
    assert m["pagedserve_request_rejected_total{reason=grammar}"] >= 3
    assert m["pagedserve_request_rejected_total{reason=grammar_busy}"] >= 4


def test_the_server_timeout_aborts_a_request_that_asks_for_more(guarded):
    """--request-timeout 12 caps a request's own `timeout` of 1000 s; its blocks are freed."""
    body = {"prompt": "Once upon a time", "max_tokens": 2800, "ignore_eos": True,
            "timeout": 1000}
    response = httpx.post(guarded.url + "/v1/completions", json=body, headers=AUTH,
                          timeout=300)
    assert response.status_code == 408, response.text
    error = response.json()["error"]
    assert error["code"] == "request_timeout" and f"{REQUEST_TIMEOUT_S} s" in error["message"]
    m = guarded.wait_idle()
    assert m["pagedserve_num_requests_running"] == 0
    assert m["pagedserve_kv_cache_usage_perc"] == 0.0
