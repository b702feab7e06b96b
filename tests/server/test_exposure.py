"""A server put on a network (issue 29): API keys, a bound on the waiting queue, priorities, a
per-request deadline, header- and body-read timeouts, and /health when the worker threads are
stuck.

One server for the module, with one running slot (`--max-num-seqs 1`), so that what waits and
in which order is decided by the server alone, not by timing.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from pagedserve.entrypoints.server.options import api_keys
from pagedserve.entrypoints.server.drain import MAX_RETRY_AFTER_S
from tests.server.conftest import MODEL_NAME, start_server, stop_server

KEYS = ("key-one", "key-two", "key-three")
AUTH = {"Authorization": f"Bearer {KEYS[0]}"}
MAX_QUEUED = 2
# runs until aborted or timed out: ~30 s at the dev box's ~90 tokens/s (max_model_len 2896)
LONG = {"max_tokens": 2800, "ignore_eos": True}


@pytest.fixture(scope="module")
def exposed():
    srv = start_server("--api-key", ",".join(KEYS[:2]), "--api-key", KEYS[2],
                       "--cache-salt-from-api-key", "--max-num-seqs", "1",
                       "--max-queued-requests", str(MAX_QUEUED), "--scheduling-policy",
                       "priority", "--header-timeout", "1", "--body-timeout", "1",
                       "--health-timeout", "0.5")
    yield srv
    stop_server(srv)


def post(server, path: str, body: dict, headers: dict | None = AUTH, **kw) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=headers, timeout=120, **kw)


def complete(server, **body) -> httpx.Response:
    return post(server, "/v1/completions", {"prompt": "Once upon a time", **body})


def assert_openai_error(response: httpx.Response, status: int, code: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code, error
    assert error["message"].strip()
    return error


def idle(server) -> dict[str, float]:
    m = server.wait_idle()
    assert m["pagedserve_num_requests_running"] == 0
    assert m["pagedserve_num_requests_waiting"] == 0
    assert m["pagedserve_kv_cache_usage_perc"] == 0.0
    return m


# ---- API keys --------------------------------------------------------------------------------


@pytest.mark.parametrize("headers", [
    None, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEYS[0]}"},
    {"Authorization": f"Bearer {KEYS[0][:-1]}"}, {"Authorization": f"Bearer {KEYS[0]}x"},
    {"Authorization": "Bearer"}], ids=["none", "wrong", "basic", "prefix", "longer", "empty"])
def test_without_a_valid_key_every_route_answers_401_in_openai_shape(exposed, headers):
    for method, path in [("GET", "/v1/models"), ("POST", "/v1/completions"),
                         ("POST", "/v1/chat/completions"), ("POST", "/tokenize"),
                         ("GET", "/openapi.json")]:
        response = httpx.request(method, exposed.url + path, headers=headers,
                                 json={"prompt": "Hi"}, timeout=60)
        error = assert_openai_error(response, 401, "invalid_api_key")
        assert error["type"] == "invalid_request_error"
        assert response.headers["www-authenticate"] == "Bearer"
        assert KEYS[0] not in response.text


def test_every_key_of_flags_and_comma_lists_is_accepted(exposed):
    for key in KEYS:
        client = openai.OpenAI(base_url=exposed.base_url, api_key=key, max_retries=0)
        assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=exposed.base_url, api_key="nope", max_retries=0).models.list()


def test_health_and_metrics_stay_open_for_probes_and_scrapers(exposed):
    assert httpx.get(exposed.url + "/health", timeout=60).status_code == 200
    metrics = httpx.get(exposed.url + "/metrics", timeout=60)
    assert metrics.status_code == 200
    assert 'pagedserve_request_rejected_total{reason="unauthorized"}' in metrics.text


def test_a_request_without_a_key_is_refused_before_its_body_is_read(exposed):
    """3 MB, over the body limit: the 401 comes first, without reading it."""
    response = httpx.post(exposed.url + "/v1/completions", content=b"x" * (3 << 20),
                          headers={"content-type": "application/json"}, timeout=60)
    assert_openai_error(response, 401, "invalid_api_key")


def test_api_keys_from_flags_comma_lists_and_the_environment(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_API_KEY", "env-a, env-b")
    assert api_keys(None) == ("env-a", "env-b")
    assert api_keys(["a,b", "c", "a"]) == ("a", "b", "c")  # the flags win over the variable
    monkeypatch.delenv("PAGEDSERVE_API_KEY")
    assert api_keys(None) == ()


def test_each_key_gets_a_prefix_cache_of_its_own(exposed):
    """--cache-salt-from-api-key: a long prompt repeated with the same key hits the cache;
    with another key (a tenant of its own) it shares no block."""
    prompt = "A paged KV cache keeps blocks of keys and values. " * 12

    def cached(key: str, **extra) -> int:
        response = post(exposed, "/v1/completions", {"prompt": prompt, "max_tokens": 1,
                                                     **extra},
                        headers={"Authorization": f"Bearer {key}"})
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    cached(KEYS[0])
    assert cached(KEYS[0]) > 64
    assert cached(KEYS[1]) == 0
    assert cached(KEYS[1]) > 64
    assert cached(KEYS[0], cache_salt="mine") == 0  # a tenant's own salt splits further


# ---- the waiting queue and priorities --------------------------------------------------------


class Stream(threading.Thread):
    """A streamed completion on a thread: when its first token came (in arrival order over
    all streams of a test) and how it ended. Setting `stop` closes it (aborts the request)."""

    def __init__(self, server, name: str, order: list[str], **body) -> None:
        super().__init__(name=name)
        self.url = server.url + "/v1/completions"
        self.body, self.order = {"prompt": f"{name} says", "stream": True, **body}, order
        self.started = threading.Event()
        self.events: list[str] = []
        self.status: int | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        with httpx.stream("POST", self.url, json=self.body, headers=AUTH,
                          timeout=120) as response:
            self.status = response.status_code
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                self.events.append(line[6:])
                if not self.started.is_set() and _has_text(line[6:]):
                    self.order.append(self.name)
                    self.started.set()
                if self.stop.is_set():
                    return


def _has_text(event: str) -> bool:
    if event == "[DONE]":
        return False
    choices = json.loads(event).get("choices") or [{}]
    return bool(choices[0].get("text"))


def streams(server, order: list[str], **named: dict) -> dict[str, Stream]:
    return {name: Stream(server, name, order, **body) for name, body in named.items()}


def wait_for(condition, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.1)


def test_priority_order_and_429_past_the_queue_bound(exposed):
    """One running slot: `running` holds it; `late` (priority 5) then `urgent` (priority 1)
    wait. Past the bound of 2 waiting a request gets 429 with Retry-After. When the slot
    frees, `urgent` runs before `late`, although it came second."""
    order: list[str] = []
    s = streams(exposed, order, running={**LONG, "priority": 0},
                late={"max_tokens": 4, "priority": 5}, urgent={"max_tokens": 4, "priority": 1})
    s["running"].start()
    assert s["running"].started.wait(120)
    s["late"].start()
    wait_for(lambda: exposed.metrics()["pagedserve_num_requests_waiting"] == 1)
    s["urgent"].start()
    wait_for(lambda: exposed.metrics()["pagedserve_num_requests_waiting"] == 2)

    refused = complete(exposed, max_tokens=2)
    error = assert_openai_error(refused, 429, "queue_full")
    retry_after = int(refused.headers["retry-after"])  # from the drain rate (test_drain.py)
    assert 1 <= retry_after <= MAX_RETRY_AFTER_S
    assert str(MAX_QUEUED) in error["message"] and f"retry in {retry_after} s" in error["message"]
    assert_openai_error(complete(exposed, max_tokens=2, n=2), 429, "queue_full")

    s["running"].stop.set()  # its client goes away: the slot frees
    for stream in s.values():
        stream.join(120)
        assert not stream.is_alive() and stream.status == 200
    assert order == ["running", "urgent", "late"]
    assert s["late"].events[-1] == "[DONE]" and s["urgent"].events[-1] == "[DONE]"
    m = idle(exposed)
    assert m['pagedserve_request_rejected_total{reason=queue_full}'] >= 2


def test_an_empty_queue_takes_a_request_with_more_samples_than_the_bound(exposed):
    idle(exposed)
    response = complete(exposed, max_tokens=2, n=MAX_QUEUED + 1)
    assert response.status_code == 200 and len(response.json()["choices"]) == MAX_QUEUED + 1


def test_priority_outside_64_bits_is_refused(exposed):
    error = assert_openai_error(complete(exposed, max_tokens=1, priority=2**63), 400,
                                "invalid_value")
    assert error["param"] == "priority"


def test_fcfs_server_refuses_a_priority_it_would_ignore(server):
    """The shared server schedules first come, first served."""
    body = {"prompt": "Hi", "max_tokens": 1}
    response = httpx.post(server.url + "/v1/completions", json={**body, "priority": 3},
                          timeout=120)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "priority" and "--scheduling-policy" in error["message"]
    assert httpx.post(server.url + "/v1/completions", json={**body, "priority": 0},
                      timeout=120).status_code == 200


def test_responses_priority_and_timeout_reach_the_engine(exposed, server):
    """/v1/responses passes both to the chat path: a priority the shared fcfs server would
    ignore is refused there, naming it; a timeout that passes at once aborts with a 408."""
    body = {"model": MODEL_NAME, "input": "Hi", "max_output_tokens": 16}
    response = httpx.post(server.url + "/v1/responses", json={**body, "priority": 3},
                          timeout=120)
    assert response.status_code == 400 and response.json()["error"]["param"] == "priority"
    assert post(exposed, "/v1/responses", {**body, "priority": 3}).status_code == 200
    error = assert_openai_error(post(exposed, "/v1/responses", {**body, "timeout": 0.001}),
                                408, "request_timeout")
    assert error["param"] == "timeout"
    idle(exposed)


# ---- deadlines -------------------------------------------------------------------------------


def test_a_request_past_its_timeout_is_aborted_and_frees_its_blocks(exposed):
    before = exposed.metrics().get('pagedserve_request_finished_total{finish_reason=timeout}', 0)
    response = complete(exposed, timeout=1, **LONG)
    error = assert_openai_error(response, 408, "request_timeout")
    assert error["param"] == "timeout" and "aborted" in error["message"]
    m = idle(exposed)
    assert m['pagedserve_request_finished_total{finish_reason=timeout}'] == before + 1


def test_a_stream_past_its_timeout_ends_with_an_error_event(exposed):
    order: list[str] = []
    stream = streams(exposed, order, s={**LONG, "timeout": 1.5})["s"]
    stream.start()
    stream.join(120)
    assert stream.status == 200 and stream.events[-1] == "[DONE]"
    assert json.loads(stream.events[1])["choices"][0]["text"]  # tokens came first
    assert json.loads(stream.events[-2])["error"]["code"] == "request_timeout"
    idle(exposed)


# ---- slow clients ------------------------------------------------------------------------------


def _closed_by_server(sock: socket.socket, trickle: bytes = b"", timeout: float = 60.0) -> bool:
    """Send `trickle` a byte at a time (0.2 s apart) until the server closes the connection."""
    sock.settimeout(0.2)
    deadline = time.monotonic() + timeout
    sent = 0
    while time.monotonic() < deadline:
        try:
            if sent < len(trickle):
                sock.sendall(trickle[sent:sent + 1])
                sent += 1
            if sock.recv(1024) == b"":
                return True
        except socket.timeout:
            continue
        except (ConnectionResetError, BrokenPipeError):
            return True
    return False


def test_connections_that_never_finish_their_headers_are_closed(exposed):
    """--header-timeout 1: silent connections and ones trickling a header byte by byte are
    closed, while the server keeps answering others; a kept-alive connection's next request
    gets the same deadline."""
    host, port = exposed.url.removeprefix("http://").split(":")
    partial = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer key-one\r\n"
               b"X-Slow: " + b"a" * 200)
    socks = [socket.create_connection((host, int(port))) for _ in range(40)]
    with ThreadPoolExecutor(len(socks)) as pool:
        closed = [pool.submit(_closed_by_server, sock, partial if i % 2 else b"")
                  for i, sock in enumerate(socks)]
        assert complete(exposed, max_tokens=2).status_code == 200
        assert all(f.result() for f in closed)
    for sock in socks:
        sock.close()

    with socket.create_connection((host, int(port))) as sock:  # keep-alive, then stalls
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        sock.settimeout(30)
        assert sock.recv(1024).startswith(b"HTTP/1.1 200")
        assert _closed_by_server(sock, b"GET /health HTTP/1.1\r\nHost: x\r\n")


def _answer_while_trickling(sock: socket.socket, trickle: bytes,
                            timeout: float = 60.0) -> tuple[bytes, int]:
    """Send `trickle` a byte at a time (0.2 s apart) and read until the server closes the
    connection: what it answered, and how many bytes of `trickle` went out before."""
    sock.settimeout(0.2)
    deadline = time.monotonic() + timeout
    answer, sent = b"", 0
    while time.monotonic() < deadline:
        try:
            if sent < len(trickle):
                sock.sendall(trickle[sent:sent + 1])
                sent += 1
            data = sock.recv(4096)
        except socket.timeout:
            continue
        except (ConnectionResetError, BrokenPipeError):
            break
        if not data:
            break
        answer += data
    return answer, sent


BODY = json.dumps({"prompt": "Once upon a time", "max_tokens": 1, "padding": "x" * 160})


@pytest.mark.parametrize("encoding", ["sized", "chunked", "silent"])
def test_a_body_that_does_not_arrive_in_time_gets_408_and_is_closed(exposed, encoding):
    """--body-timeout 1: headers sent at once, then the body a byte every 0.2 s (sized or
    chunked: 40 s or more in all), or nothing: the server answers 408 in OpenAI's shape and
    closes the connection while most of the body is still to come; others are served."""
    host, port = exposed.url.removeprefix("http://").split(":")
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer key-one\r\n"
            b"Content-Type: application/json\r\n")
    body = BODY.encode()
    if encoding == "chunked":
        head += b"Transfer-Encoding: chunked\r\n\r\n"
        trickle = b"".join(b"1\r\n" + body[i:i + 1] + b"\r\n" for i in range(len(body)))
        trickle += b"0\r\n\r\n"
    else:
        head += b"Content-Length: %d\r\n\r\n" % len(body)
        trickle = body if encoding == "sized" else b""
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(head)
        answer, sent = _answer_while_trickling(sock, trickle)
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
    assert sent < len(trickle) // 2 or not trickle
    status_line, _, payload = answer.partition(b"\r\n\r\n")
    assert b"connection: close" in status_line.lower()
    error = json.loads(payload)["error"]
    assert error["code"] == "body_timeout" and "--body-timeout" in error["message"]
    assert complete(exposed, max_tokens=2).status_code == 200


def test_a_body_in_pieces_within_the_timeout_is_served(exposed):
    """The bound is on the whole body's time, not on its pieces: a chunked body sent at
    once, in small chunks, is read and answered."""
    host, port = exposed.url.removeprefix("http://").split(":")
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": 1}).encode()
    chunks = b"".join(b"%x\r\n" % len(body[i:i + 7]) + body[i:i + 7] + b"\r\n"
                      for i in range(0, len(body), 7))
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                     b"key-one\r\nContent-Type: application/json\r\nConnection: close\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n" + chunks + b"0\r\n\r\n")
        answer, _ = _answer_while_trickling(sock, b"")
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]


# ---- health ------------------------------------------------------------------------------------


def test_health_says_503_while_the_tokenizer_threads_are_stuck(exposed):
    """Twelve ~2 MB prompts to tokenize fill the worker threads for seconds; /health's probe
    of them (--health-timeout 0.5) waits behind and answers 503, then 200 again."""
    prompt = "tokenize me " * 160_000
    statuses: list[int] = []
    with ThreadPoolExecutor(12) as pool:
        jobs = [pool.submit(post, exposed, "/tokenize", {"prompt": prompt}) for _ in range(12)]
        while not all(job.done() for job in jobs):
            statuses.append(httpx.get(exposed.url + "/health", timeout=60).status_code)
        assert all(job.result().status_code == 200 for job in jobs)
    assert 503 in statuses
    assert httpx.get(exposed.url + "/health", timeout=60).status_code == 200


def test_anthropic_clients_send_the_key_as_x_api_key(exposed):
    """/v1/messages takes the key as Anthropic's clients send it, and answers a missing or
    wrong one in Anthropic's error shape."""
    import anthropic

    claude = anthropic.Anthropic(base_url=exposed.url, api_key=KEYS[1], max_retries=0,
                                 timeout=120)
    message = claude.messages.create(model=MODEL_NAME, max_tokens=2,
                                     messages=[{"role": "user", "content": "Hi"}])
    assert message.usage.output_tokens == 2
    for headers in (None, {"x-api-key": "wrong"}):
        response = post(exposed, "/v1/messages", {"model": MODEL_NAME, "max_tokens": 2,
                                                  "messages": [{"role": "user",
                                                                "content": "Hi"}]},
                        headers=headers)
        assert response.status_code == 401
        assert response.json()["type"] == "error"
        assert response.json()["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=exposed.url, api_key="nope", max_retries=0).messages.create(
            model=MODEL_NAME, max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
