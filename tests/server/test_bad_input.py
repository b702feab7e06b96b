"""Every kind of bad input gets the right status and an OpenAI error body; nothing leaks."""

from __future__ import annotations

import re
from dataclasses import dataclass

import httpx
import openai
import pytest

from tests.server.conftest import MODEL_NAME

CHAT_OK = [{"role": "user", "content": "hi"}]
TOO_LONG = object()  # placeholder: a prompt longer than the server's max_model_len
BEYOND = object()  # placeholder: max_tokens beyond the context


@dataclass(frozen=True)
class Raw:
    """A body sent as these bytes with this Content-Type (None: no header)."""

    content: bytes
    content_type: str | None = "application/json"


CASES = [
    # (id, path, body (dict or raw str), status, param)
    ("malformed-json", "/v1/completions", '{"prompt": "hi", ', 400, None),
    ("body-not-object", "/v1/completions", "[1, 2]", 400, None),
    ("unknown-model", "/v1/completions", {"model": "gpt-9", "prompt": "hi"}, 404, "model"),
    ("missing-prompt", "/v1/completions", {"max_tokens": 2}, 400, "prompt"),
    ("missing-messages", "/v1/chat/completions", {"model": MODEL_NAME}, 400, "messages"),
    ("empty-messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("messages-wrong-type", "/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("unknown-role", "/v1/chat/completions",
     {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
    ("prompt-wrong-type", "/v1/completions", {"prompt": 42}, 400, "prompt"),
    ("temperature-wrong-type", "/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400,
     "temperature"),
    ("max-tokens-wrong-type", "/v1/completions", {"prompt": "hi", "max_tokens": "many"}, 400,
     "max_tokens"),
    ("empty-prompt", "/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("empty-token-prompt", "/v1/completions", {"prompt": []}, 400, "prompt"),
    ("empty-prompt-in-list", "/v1/completions", {"prompt": ["ok", ""]}, 400, "prompt"),
    ("token-out-of-vocab", "/v1/completions", {"prompt": [1, 10_000_000]}, 400, "prompt"),
    ("max-tokens-zero", "/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("max-tokens-negative", "/v1/chat/completions", {"messages": CHAT_OK, "max_tokens": -5}, 400,
     "max_tokens"),
    ("max-completion-tokens-zero", "/v1/chat/completions",
     {"messages": CHAT_OK, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("max-tokens-beyond-context", "/v1/completions", BEYOND, 400, "max_tokens"),
    ("prompt-too-long", "/v1/completions", TOO_LONG, 400, "prompt"),
    ("temperature-negative", "/v1/completions", {"prompt": "hi", "temperature": -0.1}, 400,
     "temperature"),
    ("top-p-zero", "/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("top-p-above-one", "/v1/chat/completions", {"messages": CHAT_OK, "top_p": 1.5}, 400,
     "top_p"),
    ("n-too-large", "/v1/completions", {"prompt": "hi", "n": 1000}, 400, "n"),
    ("n-zero", "/v1/chat/completions", {"messages": CHAT_OK, "n": 0}, 400, "n"),
    ("logprobs-too-many", "/v1/completions", {"prompt": "hi", "logprobs": 1000}, 400,
     "logprobs"),
    ("top-logprobs-without-logprobs", "/v1/chat/completions",
     {"messages": CHAT_OK, "top_logprobs": 2}, 400, "top_logprobs"),
    ("empty-stop-string", "/v1/completions", {"prompt": "hi", "stop": [""]}, 400, "stop"),
    ("penalty-out-of-range", "/v1/completions", {"prompt": "hi", "presence_penalty": 3}, 400,
     "presence_penalty"),
    ("echo-unsupported", "/v1/completions", {"prompt": "hi", "echo": True}, 400, "echo"),
    ("tool-without-function", "/v1/chat/completions",
     {"messages": CHAT_OK, "tools": [{"type": "function"}]}, 400, "tools.0.function"),
    # text that is not valid Unicode: JSON's \ud800 escape decodes to an unpaired surrogate
    ("surrogate-in-prompt", "/v1/completions", Raw(b'{"prompt": "hi \\ud800 there"}'), 400,
     "prompt"),
    ("surrogate-in-chat", "/v1/chat/completions",
     Raw(b'{"messages": [{"role": "user", "content": "a\\udfff"}]}'), 400,
     "messages.0.content"),
    ("surrogate-in-model", "/v1/completions", Raw(b'{"prompt": "hi", "model": "\\ud800"}'),
     400, "model"),
    ("empty-body", "/v1/completions", Raw(b""), 400, None),
    ("empty-body-no-content-type", "/v1/chat/completions", Raw(b"", None), 400, None),
    ("text-plain", "/v1/completions", Raw(b'{"prompt": "hi"}', "text/plain"), 400, None),
    ("form-encoded", "/v1/chat/completions",
     Raw(b"messages=hi", "application/x-www-form-urlencoded"), 400, None),
    ("nan-temperature", "/v1/completions", Raw(b'{"prompt": "hi", "temperature": NaN}'), 400,
     "temperature"),
    ("infinite-top-p", "/v1/chat/completions",
     Raw(b'{"messages": [{"role": "user", "content": "hi"}], "top_p": -Infinity}'), 400,
     "top_p"),
    ("seed-beyond-64-bit", "/v1/completions", {"prompt": "hi", "seed": 2**64}, 400, "seed"),
    ("top-k-beyond-int", "/v1/completions", {"prompt": "hi", "top_k": 10**23, "max_tokens": 2},
     400, "top_k"),
]

# what the message must say (the unclear messages, and no leaked internals)
MESSAGES = {
    "surrogate-in-prompt": "not valid Unicode", "surrogate-in-chat": "not valid Unicode",
    "empty-body": "body is empty", "empty-body-no-content-type": "body is empty",
    "text-plain": "Content-Type", "form-encoded": "Content-Type",
    "body-not-object": "must be a JSON object, not an array",
    "nan-temperature": "finite", "infinite-top-p": "finite",
    "seed-beyond-64-bit": str(2**64 - 1), "top-k-beyond-int": str(2**31 - 1),
    "tool-without-function": "tools.0.function",
}
LEAKS = re.compile(r"TextEncodeInput|Union\[|long long|int64_t|uint64|Overflow|Traceback|"
                   r"'None'")


@pytest.fixture(scope="module")
def max_model_len(server) -> int:
    return httpx.get(server.base_url + "/models").json()["data"][0]["max_model_len"]


def _body(body, max_model_len: int):
    if body is TOO_LONG:
        return {"prompt": [1] * (max_model_len + 1), "max_tokens": 1}
    if body is BEYOND:
        return {"prompt": "hi", "max_tokens": max_model_len}
    return body


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_openai_error_then_server_still_serves(server, max_model_len, case):
    _, path, body, status, param = case
    body = _body(body, max_model_len)
    with httpx.Client(base_url=server.url, timeout=120) as http:
        if isinstance(body, str):
            r = http.post(path, content=body, headers={"content-type": "application/json"})
        elif isinstance(body, Raw):
            headers = {"content-type": body.content_type} if body.content_type else {}
            r = http.post(path, content=body.content, headers=headers)
        else:
            r = http.post(path, json=body)
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "invalid_request_error"
        assert isinstance(error["message"], str) and error["message"]
        assert error["param"] == param
        assert MESSAGES.get(case[0], "") in error["message"]
        assert not LEAKS.search(error["message"]), error["message"]
        ok = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
        assert ok.status_code == 200, ok.text
        assert ok.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_streaming_bad_input_is_rejected_before_the_stream(server, max_model_len):
    with httpx.Client(base_url=server.url, timeout=120) as http:
        r = http.post("/v1/completions", json={"prompt": "hi", "stream": True,
                                               "max_tokens": max_model_len})
    assert r.status_code == 400
    assert r.headers["content-type"].startswith("application/json")
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_sdk_maps_errors_to_exceptions(client):
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL_NAME, prompt="hi", temperature=-1)
    assert bad.value.status_code == 400 and "temperature" in bad.value.message
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="nope", messages=CHAT_OK)
    assert missing.value.code == "model_not_found"


def test_unknown_route_and_method_get_error_bodies(server):
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(server.url + "/v1/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_no_block_held_after_bad_inputs(server):
    m = server.wait_idle()
    assert m["pagedserve_num_requests_running"] == 0
    assert m["pagedserve_num_requests_waiting"] == 0
    assert m["pagedserve_kv_cache_usage_perc"] == 0.0
