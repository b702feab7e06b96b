"""A grammar the engine core cannot compile reaches the client as the server's own refusal
would (issue 29): a whole answer is a 400 naming the field the client used, in the
compiler's words without its source paths; a stream whose headers are out ends with an
OpenAI-shaped error event and [DONE]. The core frees the request's blocks, and the server
goes on serving.

The server compiles every spec before the core sees it, with the same compiler, so the two
disagree only when one process fails (memory, a compiler fault). This module's server has
its API process's check switched off (`start_server`'s preamble; the core process is
spawned afresh and keeps its own), so that ordinary invalid specs take the core's path. Each
answer is compared with the shared server's, whose own check refuses the same request.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server.conftest import MODEL_NAME, start_server, stop_server
from tests.server.test_findings import INTERNALS, SAY

NO_CHECK = ("from pagedserve.frontend.processor import Processor\n"
            "Processor.check_structured_outputs = lambda self, spec: None")
BAD_SCHEMA = {"type": "array", "minItems": 3, "maxItems": 1}
BAD_TOOL = {"type": "function", "function": {"name": "pick",
                                             "parameters": {"type": "nope"}}}


@pytest.fixture(scope="module")
def unchecked():
    srv = start_server(preamble=NO_CHECK)
    yield srv
    stop_server(srv)


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
CASES = [  # (path, body, the field the error names)
    (CHAT, {"guided_grammar": "root ::= foo"}, "guided_grammar"),
    (CHAT, {"guided_regex": "(unclosed"}, "guided_regex"),
    (CHAT, {"structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
    (CHAT, {"response_format": {"type": "json_schema",
                                "json_schema": {"name": "x", "schema": BAD_SCHEMA}}},
     "response_format"),
    (COMPLETIONS, {"guided_json": {"type": "nope"}, "n": 2}, "guided_json"),
    (COMPLETIONS, {"prompt": ["One", "Two"], "guided_regex": "[a-"}, "guided_regex"),
]


def body_for(path: str, body: dict) -> dict:
    base = {"model": MODEL_NAME, "max_tokens": 4}
    base.update({"messages": SAY} if path == CHAT else {"prompt": "Hello"})
    return {**base, **body}


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body_for(path, body), timeout=300)


def events(server, path: str, body: dict) -> tuple[int, list[str]]:
    with httpx.stream("POST", server.url + path, json={**body_for(path, body), "stream": True},
                      timeout=300) as response:
        return response.status_code, [line[6:] for line in response.iter_lines()
                                      if line.startswith("data: ")]


def finished_with_error(server) -> float:
    return server.metrics().get("pagedserve_request_finished_total{finish_reason=error}", 0)


@pytest.mark.parametrize("path, body, param", CASES,
                         ids=[f"{'chat' if p == CHAT else 'completions'}-{param}"
                              for p, _, param in CASES])
def test_a_core_compile_failure_is_the_servers_own_400(unchecked, server, path, body, param):
    """Not streamed: the 400 the shared server's own check gives, word for word; the core
    finished the request with an error and holds no block."""
    before = finished_with_error(unchecked)
    response = post(unchecked, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert "structured outputs" in error["message"] and not INTERNALS.search(error["message"])
    checked = post(server, path, body)
    assert checked.status_code == 400 and checked.json()["error"] == error
    m = unchecked.wait_idle()
    assert m["pagedserve_kv_cache_usage_perc"] == 0.0
    assert finished_with_error(unchecked) > before


def test_a_forced_tool_names_the_tools(unchecked):
    """The forced call's grammar joins every tool's schema: the core's compile cannot tell
    which one failed (the server's own check, tool by tool, can)."""
    response = post(unchecked, CHAT, {"tools": [BAD_TOOL], "tool_choice": "required"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "tools" and 'Unsupported type "nope"' in error["message"]
    assert unchecked.wait_idle()["pagedserve_kv_cache_usage_perc"] == 0.0


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS], ids=["chat", "completions"])
def test_a_started_stream_ends_with_the_error_event_then_done(unchecked, path):
    body = {"guided_grammar": "root ::= foo"}
    status, sent = events(unchecked, path, body)
    assert status == 200 and sent[-1] == "[DONE]", sent
    error = json.loads(sent[-2])["error"]
    assert error == post(unchecked, path, body).json()["error"]
    assert all("error" not in json.loads(e) for e in sent[:-2])  # no other error, no text
    assert all(not c.get("text") and not (c.get("delta") or {}).get("content")
               for e in sent[:-2] for c in json.loads(e)["choices"])
    assert unchecked.wait_idle()["pagedserve_kv_cache_usage_perc"] == 0.0


def test_the_agent_apis_name_their_own_field(unchecked):
    """/v1/responses: a 400 naming text.format, or streamed an error event naming it, then
    response.failed; /v1/messages: Anthropic's 400 naming output_config.format."""
    body = {"model": MODEL_NAME, "input": "Hi", "max_output_tokens": 4,
            "text": {"format": {"type": "json_schema", "name": "x", "schema": BAD_SCHEMA}}}
    response = httpx.post(unchecked.url + "/v1/responses", timeout=300, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "text.format"
    with httpx.stream("POST", unchecked.url + "/v1/responses", json={**body, "stream": True},
                      timeout=300) as streamed:
        sent = [json.loads(line[6:]) for line in streamed.iter_lines()
                if line.startswith("data: ")]
    assert [e["type"] for e in sent[-2:]] == ["error", "response.failed"], sent
    assert sent[-2]["param"] == "text.format"
    response = httpx.post(unchecked.url + "/v1/messages", timeout=300, json={
        "model": MODEL_NAME, "max_tokens": 4, "messages": SAY,
        "output_config": {"format": {"type": "json_schema", "schema": BAD_SCHEMA}}})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and "output_config.format" in error["message"]


def test_the_server_goes_on_serving_constrained_and_free_requests(unchecked):
    """After the failures: a valid grammar is honored, a free request answers, no block
    is held."""
    constrained = post(unchecked, CHAT, {"guided_choice": ["cat", "dog"]})
    assert constrained.status_code == 200, constrained.text
    assert constrained.json()["choices"][0]["message"]["content"] in ("cat", "dog")
    assert post(unchecked, COMPLETIONS, {}).status_code == 200
    m = unchecked.wait_idle()
    assert m["pagedserve_kv_cache_usage_perc"] == 0.0
    assert m["pagedserve_num_requests_running"] == 0
