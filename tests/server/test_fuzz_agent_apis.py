"""The hypothesis HTTP fuzz of test_fuzz_api.py on the agents' APIs: /v1/responses and its
stored responses (GET and DELETE /v1/responses/{id}; errors in OpenAI's shape, naming a
field of the request) and /v1/messages and /v1/messages/count_tokens (errors in Anthropic's
shape). Whatever comes, never a 5xx; the server keeps serving and holds no block."""

from __future__ import annotations

import json
from urllib.parse import quote

import httpx
from hypothesis import given
from hypothesis import strategies as st

from pagedserve.entrypoints.server.responses_protocol import ResponsesRequest
from tests.server.test_fuzz_api import (CONTENT_TYPES, FUZZ, JSON, LEAKS, LENGTHS, NUMBERS, TEXT,
                                        WORDS, _fuzz, bodies)
from tests.server.test_fuzz_endpoints import QUERY_TEXT

MODEL = st.sampled_from(["SmolLM2-135M-Instruct", "gpt-9"]) | TEXT | JSON
SAMPLING = {"temperature": NUMBERS | JSON, "top_p": NUMBERS | JSON, "top_k": NUMBERS | JSON,
            "stream": st.booleans() | JSON}
PART = st.fixed_dictionaries(
    {"type": st.sampled_from(["input_text", "output_text", "input_image"]) | JSON},
    optional={"text": WORDS | JSON})
ITEM = st.fixed_dictionaries({}, optional={
    "type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning",
                             "item_reference"]) | JSON,
    "role": st.sampled_from(["user", "assistant", "system", "developer", "tool"]) | JSON,
    "content": WORDS | st.lists(PART, max_size=2) | JSON, "call_id": TEXT | JSON,
    "name": TEXT | JSON, "arguments": TEXT | JSON, "output": WORDS | JSON,
    "summary": JSON})
RESPONSES = st.fixed_dictionaries(
    {"max_output_tokens": LENGTHS},
    optional={"model": MODEL, "input": WORDS | st.lists(ITEM, max_size=3) | JSON,
              "instructions": WORDS | JSON, "tools": JSON,
              "tool_choice": st.sampled_from(["auto", "none", "required"]) | JSON,
              "text": st.fixed_dictionaries({"format": st.fixed_dictionaries(
                  {"type": st.sampled_from(["text", "json_object", "json_schema"]) | JSON},
                  optional={"schema": JSON})}) | JSON,
              "previous_response_id": TEXT | JSON, "store": st.booleans() | JSON,
              "reasoning": JSON, "metadata": JSON, **SAMPLING})
BLOCK = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "tool_use", "tool_result", "thinking", "image"]) | JSON},
    optional={"text": WORDS | JSON, "id": TEXT | JSON, "name": TEXT | JSON, "input": JSON,
              "tool_use_id": TEXT | JSON, "content": WORDS | JSON, "thinking": WORDS | JSON})
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant"]) | JSON},
    optional={"content": WORDS | st.lists(BLOCK, max_size=2) | JSON})
PROMPT = {"model": MODEL, "messages": st.lists(MESSAGE, max_size=3) | JSON,
          "system": WORDS | JSON, "tools": JSON, "tool_choice": st.fixed_dictionaries(
              {"type": st.sampled_from(["auto", "any", "tool", "none"]) | JSON}) | JSON,
          "thinking": JSON}
MESSAGES = st.fixed_dictionaries(
    {"max_tokens": LENGTHS},
    optional={**PROMPT, "stop_sequences": st.lists(WORDS, max_size=2) | JSON,
              "metadata": JSON, **SAMPLING})
COUNT_TOKENS = st.fixed_dictionaries({}, optional={**PROMPT, "max_tokens": LENGTHS})
# a stored response's id: any text, as a client would put it in the path (percent-encoded)
RESPONSE_IDS = st.sampled_from(["resp_0", "resp_", ".", "..", "a/b", "%00"]) | TEXT.filter(bool)
QUERIES = st.dictionaries(st.sampled_from(["include", "stream", "x"]), QUERY_TEXT, max_size=2)


def _events(response: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in response.text.splitlines()
            if line.startswith("data: ")]


def _responses_answer(response: httpx.Response) -> None:
    if response.headers["content-type"].startswith("text/event-stream"):
        events = _events(response)
        assert events[-1]["type"] in ("response.completed", "response.incomplete"), events
        assert not any(e["type"] == "error" for e in events), events
    else:
        assert response.json()["object"] == "response"


@FUZZ
@given(body=bodies(RESPONSES), content_type=CONTENT_TYPES)
def test_fuzz_responses(server, body, content_type):
    _fuzz(server, "/v1/responses", body, content_type, ResponsesRequest,
          check_answer=_responses_answer)


@FUZZ
@given(response_id=RESPONSE_IDS, method=st.sampled_from(["GET", "DELETE"]), params=QUERIES)
def test_fuzz_stored_responses(server, response_id, method, params):
    path = "/v1/responses/" + quote(response_id.encode("utf-8", "surrogatepass"), safe="")
    response = httpx.request(method, server.url + path, params=params, timeout=60)
    # nothing is stored under such ids; 405: a dot segment, which the client resolves
    # ('/v1/responses/.' is '/v1/responses/', the POST route's)
    assert response.status_code in (400, 404, 405), response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["message"].strip() and not LEAKS.search(error["message"]), error


def test_an_empty_stored_response_id_is_not_found(server):
    for method in ("GET", "DELETE"):
        response = httpx.request(method, server.url + "/v1/responses/", timeout=60)
        assert response.status_code == 404, response.text
        assert response.json()["error"]["message"].strip()


def _anthropic_post(server, path: str, body: bytes, content_type: str | None
                    ) -> httpx.Response:
    """The answer, after checking it is no 5xx and an error is Anthropic's, no internals."""
    headers = {"content-type": content_type} if content_type else {}
    response = httpx.post(server.url + path, content=body, headers=headers, timeout=120)
    assert response.status_code < 500, (body, response.text)
    if response.status_code >= 400:
        answer = response.json()
        assert set(answer) == {"type", "error"} and answer["type"] == "error", answer
        assert set(answer["error"]) == {"type", "message"}, answer
        assert answer["error"]["message"].strip() and not LEAKS.search(
            answer["error"]["message"]), answer
    return response


@FUZZ
@given(body=bodies(COUNT_TOKENS), content_type=CONTENT_TYPES)
def test_fuzz_count_tokens(server, body, content_type):
    response = _anthropic_post(server, "/v1/messages/count_tokens", body, content_type)
    if response.status_code < 400:
        assert response.json()["input_tokens"] > 0


@FUZZ
@given(body=bodies(MESSAGES), content_type=CONTENT_TYPES)
def test_fuzz_messages(server, body, content_type):
    response = _anthropic_post(server, "/v1/messages", body, content_type)
    if response.status_code >= 400:
        return
    if response.headers["content-type"].startswith("text/event-stream"):
        events = _events(response)
        assert events[-1]["type"] == "message_stop", events
        assert not any(e["type"] == "error" for e in events), events
    else:
        assert response.json()["type"] == "message"


def test_still_serves_and_holds_no_block_after_fuzzing(server):
    for path, body in (("/v1/responses", {"input": "Hi", "max_output_tokens": 3}),
                       ("/v1/messages", {"model": "SmolLM2-135M-Instruct", "max_tokens": 3,
                                         "messages": [{"role": "user", "content": "Hi"}]})):
        assert httpx.post(server.url + path, json=body, timeout=120).status_code == 200
    m = server.wait_idle()
    assert m["pagedserve_num_requests_running"] == 0
    assert m["pagedserve_kv_cache_usage_perc"] == 0.0
