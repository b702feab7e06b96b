"""Property-based fuzzing of the HTTP API: whatever a client sends, the server answers with a
4xx OpenAI error (naming the parameter at fault) or a real answer, never a 5xx, and keeps
serving with every KV block returned.

Bodies are JSON objects over the endpoints' fields with values of random types (numbers
beyond 64 bits, NaN and infinities, unpaired surrogates and other odd Unicode, nested junk),
plus raw bytes, non-object JSON and wrong Content-Types. Length fields never go unbounded
(no null `max_tokens`) so that the valid requests that slip through stay short on a CPU.
"""

from __future__ import annotations

import json
import re

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedserve.entrypoints.server.protocol import ChatCompletionRequest, CompletionRequest

EXAMPLES_PER_ENDPOINT = 75
LEAKS = re.compile(r"Traceback|TextEncodeInput|long long|int64_t|uint64|c_long|Overflow|"
                   r"'None'|Internal server error")

# text of any code point, unpaired surrogates included (hypothesis leaves them out by default)
TEXT = st.text(st.characters(exclude_categories=()), max_size=12)
WORDS = st.sampled_from(["hi", "Hello", "Why is the sky blue?", "", " ", "\x00", "é😀"]) | TEXT
BIG_INTS = st.integers(min_value=-(2**80), max_value=2**80)
NUMBERS = (st.integers(-3, 40) | BIG_INTS
           | st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([0, 1, 2, 0.5]))
SCALARS = st.none() | st.booleans() | NUMBERS | WORDS
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(TEXT, inner, max_size=3), max_leaves=6)
# small (answered quickly) or far beyond the context (rejected); never null (= unbounded)
LENGTHS = (st.integers(-2, 4) | st.integers(10**5, 2**80) | st.sampled_from([1.0, 2.5, "3"])
           | JSON.filter(lambda v: v is not None and not isinstance(v, (int, float))))
TOKEN_IDS = st.lists(st.integers(0, 49151) | BIG_INTS, max_size=6)

COMMON = {
    "model": st.sampled_from(["SmolLM2-135M-Instruct", "gpt-9"]) | TEXT | JSON,
    "n": st.integers(-1, 3) | NUMBERS | JSON,
    "temperature": NUMBERS | JSON, "top_p": NUMBERS | JSON, "top_k": NUMBERS | JSON,
    "min_p": NUMBERS | JSON, "repetition_penalty": NUMBERS | JSON,
    "presence_penalty": NUMBERS | JSON, "frequency_penalty": NUMBERS | JSON,
    "seed": BIG_INTS | JSON,
    "stop": WORDS | st.lists(WORDS, max_size=3) | JSON,
    "stop_token_ids": TOKEN_IDS | JSON,
    "ignore_eos": st.booleans() | JSON, "stream": st.booleans() | JSON,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans() | JSON}) | JSON,
    "user": TEXT | JSON, "cache_salt": TEXT | JSON, "logit_bias": JSON,
}
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool"]) | JSON},
    optional={"content": WORDS | st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image_url"]) | JSON, "text": WORDS | JSON}),
        max_size=2) | JSON, "name": TEXT | JSON})
COMPLETION = st.fixed_dictionaries(
    {"max_tokens": LENGTHS},
    optional={"prompt": WORDS | st.lists(WORDS, max_size=3) | TOKEN_IDS
              | st.lists(TOKEN_IDS, max_size=2) | JSON,
              "logprobs": st.integers(-1, 3) | NUMBERS | JSON, "echo": st.booleans() | JSON,
              "suffix": TEXT | JSON, "best_of": NUMBERS | JSON, **COMMON})
CHAT = st.fixed_dictionaries(
    {"max_completion_tokens": LENGTHS},
    optional={"messages": st.lists(MESSAGE, max_size=3) | JSON, "max_tokens": LENGTHS,
              "logprobs": st.booleans() | JSON, "top_logprobs": NUMBERS | JSON,
              "tools": JSON, "add_generation_prompt": st.booleans() | JSON, **COMMON})
CONTENT_TYPES = st.sampled_from(["application/json"] * 6 + [
    "application/json; charset=utf-8", "text/plain", "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=x", None])


def _encode(body) -> bytes:
    # ensure_ascii escapes surrogates as \\udXXX, which is how a client can send them
    return json.dumps(body, ensure_ascii=True, allow_nan=True).encode()


def bodies(fields: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly the endpoint's fields (plus unknown ones), else any JSON or raw bytes."""
    objects = st.tuples(fields, st.dictionaries(TEXT, JSON, max_size=2)).map(
        lambda pair: _encode({**pair[1], **pair[0]}))
    return st.one_of(objects, objects, objects, JSON.map(_encode), st.binary(max_size=40))


def _check_error(response: httpx.Response, body: bytes, model: type) -> None:
    """OpenAI's error shape, no internals in the message; a field-level error names a field
    of the request or one the client sent, or none (param null: no one field is at fault,
    as in "give exactly one of prompt and messages")."""
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["type"] == "invalid_request_error" and error["message"].strip(), error
    try:
        sent = json.loads(body)
    except ValueError:
        sent = None
    named = set(sent) if isinstance(sent, dict) else set()
    # the parameter's name is the client's text and may look like a leak ('None')
    message = error["message"].replace(f"'{error['param']}'", "'...'")
    assert not LEAKS.search(message), error
    if error["param"] is not None and error["code"] in ("invalid_value", "model_not_found",
                                                        "missing_required_parameter"):
        root = str(error["param"]).split(".")[0]
        assert root in model.model_fields or root in named, error


def _check_answer(response: httpx.Response) -> None:
    if response.headers["content-type"].startswith("text/event-stream"):
        events = [line for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        assert not any('"error"' in e for e in events[:-1]), events
    else:
        assert response.json()["choices"]


def _fuzz(server, path: str, body: bytes, content_type: str | None, model: type,
          check_answer=_check_answer) -> None:
    headers = {"content-type": content_type} if content_type else {}
    response = httpx.post(server.url + path, content=body, headers=headers, timeout=120)
    assert response.status_code < 500, (body, response.text)
    if response.status_code >= 400:
        _check_error(response, body, model)
    else:
        check_answer(response)


FUZZ = settings(max_examples=EXAMPLES_PER_ENDPOINT, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@FUZZ
@given(body=bodies(COMPLETION), content_type=CONTENT_TYPES)
def test_fuzz_completions(server, body, content_type):
    _fuzz(server, "/v1/completions", body, content_type, CompletionRequest)


@FUZZ
@given(body=bodies(CHAT), content_type=CONTENT_TYPES)
def test_fuzz_chat_completions(server, body, content_type):
    _fuzz(server, "/v1/chat/completions", body, content_type, ChatCompletionRequest)


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 3}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                              "max_tokens": 3}),
])
def test_still_serves_and_holds_no_block_after_fuzzing(server, path, body):
    response = httpx.post(server.url + path, json=body, timeout=120)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] > 0
    m = server.wait_idle()
    assert m["pagedserve_num_requests_running"] == 0
    assert m["pagedserve_num_requests_waiting"] == 0
    assert m["pagedserve_kv_cache_usage_perc"] == 0.0
