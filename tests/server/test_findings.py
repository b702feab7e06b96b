"""Regression tests for the hostile-input findings of issue 29, through HTTP on a live server:
`user` no longer salts the prefix cache; no 500 for 64-bit overflows or lone surrogates;
tool_choice "required" bounded and the same streamed or not; messages that name the field and
where the body breaks, without internals; strict types; an OpenAPI document that declares the
400s; the validation gaps (tool messages, tool schemas, engine requests per HTTP request); and
the prompt checks made once, by the engine."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

from pagedserve.model.loader import default_model_path, load_tokenizer
from tests.server.conftest import MODEL_NAME

SAY = [{"role": "user", "content": "Name a color."}]
NAME = {"type": "string", "pattern": "^[A-Za-z ]{1,16}$"}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": NAME}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city.",
    "parameters": {"type": "object", "properties": {"city": NAME}, "required": ["city"]}}}
INTERNALS = re.compile(r"\.cc:\d|\.cpp|\[\d\d:\d\d:\d\d\]|Traceback|invalid literal|"
                       r"pydantic|Input should be")


def post(server, route: str, **body) -> httpx.Response:
    if route == "chat":
        body.setdefault("messages", SAY)
        path = "/v1/chat/completions"
    else:
        body.setdefault("prompt", "Hello")
        path = "/v1/completions"
    return httpx.post(server.url + path, json={"model": MODEL_NAME, **body}, timeout=300)


def refused(response: httpx.Response, param: str | None, code: str | None = None) -> dict:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


def raw(server, path: str, content: bytes) -> httpx.Response:
    return httpx.post(server.url + path, content=content,
                      headers={"content-type": "application/json"}, timeout=60)


def test_user_does_not_salt_the_prefix_cache(server):
    system = ("You are the assistant of the pagedserve test suite, session "
              f"{id(server)}-user. " + "Answer briefly and politely. " * 12)

    def cached(user: str, question: str) -> int:
        body = ok(post(server, "chat", user=user, max_tokens=1, messages=[
            {"role": "system", "content": system}, {"role": "user", "content": question}]))
        return body["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("alice", "What is two plus two?") == 0  # a new system prompt
    assert cached("bob", "Name a color.") >= 64  # bob reuses alice's system prompt blocks


def ok(response: httpx.Response) -> dict:
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize("route", ["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True])
def test_stop_token_ids_beyond_64_bits_get_a_400(server, route, stream):
    for ids in ([2**70], [-1], [2**63]):
        error = refused(post(server, route, stop_token_ids=ids, stream=stream, max_tokens=2),
                        "stop_token_ids")
        assert "vocabulary" in error["message"]


def test_tokenize_and_detokenize_refuse_bad_unicode(server):
    lone = b'\\ud800'
    cases = [("/tokenize", b'{"prompt": "a' + lone + b'"}', "prompt"),
             ("/tokenize", b'{"prompt": "a", "model": "' + lone + b'"}', "model"),
             ("/detokenize", b'{"tokens": [1], "model": "' + lone + b'"}', "model")]
    for path, body, param in cases:
        error = refused(raw(server, path, body), param)
        assert "not valid Unicode" in error["message"]
    # a model name is checked as on the other routes
    for path, body in (("/tokenize", {"prompt": "a", "model": "nope"}),
                       ("/detokenize", {"tokens": [1], "model": "nope"})):
        response = httpx.post(server.url + path, json=body)
        assert response.status_code == 404 and response.json()["error"]["param"] == "model"
    assert httpx.post(server.url + "/tokenize", json={"prompt": "a", "model": MODEL_NAME}
                      ).status_code == 200


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_model_path())


def test_tokenize_add_special_tokens(server, tokenizer):
    for add in (True, False):
        got = httpx.post(server.url + "/tokenize", json={"prompt": "Hi there",
                                                         "add_special_tokens": add}).json()
        assert got["tokens"] == tokenizer.encode("Hi there", add_special_tokens=add)


def test_tokenize_add_generation_prompt(server, tokenizer):
    def tokens(add: bool) -> list[int]:
        return httpx.post(server.url + "/tokenize", json={
            "messages": SAY, "add_generation_prompt": add}).json()["tokens"]

    with_prompt, without = tokens(True), tokens(False)
    assert with_prompt[:len(without)] == without and len(with_prompt) > len(without)
    assert tokenizer.decode(with_prompt[len(without):]).strip().startswith("<|im_start|>")


def calls_of(message: dict) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in message["tool_calls"]]


def streamed_calls(response: httpx.Response) -> tuple[list[tuple[str, dict]], str, str]:
    """The streamed tool calls (joined by index), the content and the last finish reason."""
    names, arguments, content, finish = {}, {}, "", None
    for line in response.text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        choice = json.loads(line[6:])["choices"][0]
        content += choice["delta"].get("content") or ""
        finish = choice["finish_reason"] or finish
        for call in choice["delta"].get("tool_calls") or ():
            if call["function"].get("name"):
                names[call["index"]] = call["function"]["name"]
            arguments[call["index"]] = arguments.get(call["index"], "") + \
                (call["function"].get("arguments") or "")
    calls = [(names[i], json.loads(arguments[i])) for i in sorted(names)]
    return calls, content, finish


def test_required_tool_call_is_bounded_and_the_same_streamed_or_not(server, tokenizer):
    """A model that never closes the array of calls on its own (every token holding "]"
    biased away, as a small model repeating its call) still gives complete calls: the
    grammar closes the array after MAX_PARALLEL_CALLS (8), and the whole and streamed
    answers carry the same calls with finish_reason "tool_calls"."""
    closing = {str(i): -100 for i in range(len(tokenizer)) if "]" in tokenizer.decode([i])}
    ask = [{"role": "user", "content": "What is the weather in Paris and in Rome?"}]
    for parallel, count in ((True, 8), (False, 1)):
        body = dict(messages=ask, tools=[WEATHER, TIME], tool_choice="required", temperature=0,
                    parallel_tool_calls=parallel, logit_bias=closing, max_tokens=400)
        choice = ok(post(server, "chat", **body))["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        calls = calls_of(choice["message"])
        assert len(calls) == count and choice["message"]["content"] is None
        for name, arguments in calls:
            tool = WEATHER if name == "get_weather" else TIME
            assert name == tool["function"]["name"]
            jsonschema.validate(arguments, tool["function"]["parameters"])
        assert streamed_calls(post(server, "chat", stream=True, **body)) == \
            (calls, "", "tool_calls")


def test_required_tool_call_cut_short_gives_its_complete_calls(server, tokenizer):
    """max_tokens ends the array mid-way: the calls completed before the cut come back,
    whole and streamed alike, with finish_reason "length"."""
    closing = {str(i): -100 for i in range(len(tokenizer)) if "]" in tokenizer.decode([i])}
    ask = [{"role": "user", "content": "What is the weather in Paris and in Rome?"}]
    body = dict(messages=ask, tools=[WEATHER, TIME], tool_choice="required", temperature=0,
                logit_bias=closing)
    full = calls_of(ok(post(server, "chat", max_tokens=400, **body))["choices"][0]["message"])
    for max_tokens in (30, 60):
        choice = ok(post(server, "chat", max_tokens=max_tokens, **body))["choices"][0]
        streamed, _, finish = streamed_calls(post(server, "chat", stream=True,
                                                  max_tokens=max_tokens, **body))
        assert choice["finish_reason"] == finish == "length"
        assert calls_of(choice["message"]) == streamed == full[:len(streamed)]
        assert 1 <= len(streamed) < len(full)


def test_malformed_bodies_say_what_and_where(server):
    error = refused(raw(server, "/v1/completions", b'{"prompt": "hi",\n  "n": }'), None,
                    "invalid_json")
    assert "line 2, column 8" in error["message"] and "Expecting value" in error["message"]
    error = refused(raw(server, "/v1/chat/completions", b'{"messages": "caf\xe9"}'), None,
                    "invalid_encoding")
    assert "UTF-8" in error["message"] and "0xe9" in error["message"]
    body = json.dumps({"prompt": "hi", "max_tokens": 1})
    for encoding in ("utf-16", "utf-16-le", "utf-16-be", "utf-32"):
        error = refused(raw(server, "/v1/completions", body.encode(encoding)), None,
                        "invalid_encoding")
        assert "UTF-8" in error["message"]
    assert raw(server, "/v1/completions", body.encode()).status_code == 200


def test_structured_outputs_errors_name_the_field_without_internals(server):
    cases = [
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs"),
        ({"structured_outputs": {"json": {"type": "nope"}}}, "structured_outputs"),
        ({"structured_outputs": {"grammar": "root ::= foo"}}, "structured_outputs"),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "schema": {"type": "array", "minItems": 3, "maxItems": 1}}}}, "response_format"),
        ({"guided_json": {"type": "nope"}}, "guided_json"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"structured_outputs": {"regex": "a"}, "guided_grammar": 'root ::= "a"'},
         "guided_grammar"),
    ]
    for body, param in cases:
        error = refused(post(server, "chat", max_tokens=2, **body), param)
        assert not INTERNALS.search(error["message"]), error


def test_structured_outputs_kinds(server):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                     "maximum": 99}}, "required": ["n"]}
    ask = [{"role": "user", "content": 'Give a JSON object with one key "answer" whose value '
            "is 42."}]
    for spec, check in (({"json": schema}, lambda t: jsonschema.validate(json.loads(t), schema)),
                        ({"json_object": True}, lambda t: isinstance(json.loads(t), dict)),
                        ({"grammar": 'root ::= "cat" | "dog"'}, lambda t: t in ("cat", "dog"))):
        body = ok(post(server, "chat", messages=ask, temperature=0, max_tokens=32,
                       structured_outputs=spec))
        assert body["choices"][0]["finish_reason"] == "stop", body
        assert check(body["choices"][0]["message"]["content"]) is not False


def test_logit_bias_keys_are_ascii_token_ids(server):
    for key in ("²", "٣", "1e3", " 1", "0x1", "1" * 30, ""):
        error = refused(post(server, "completions", logit_bias={key: 1}, max_tokens=1),
                        "logit_bias")
        assert "digits 0-9" in error["message"] and not INTERNALS.search(error["message"])
    error = refused(post(server, "completions", logit_bias={"-1": 1}, max_tokens=1),
                    "logit_bias")
    assert "vocabulary" in error["message"]


def test_max_completion_tokens_errors_name_it(server):
    limit = httpx.get(server.base_url + "/models").json()["data"][0]["max_model_len"]
    error = refused(post(server, "chat", max_completion_tokens=limit), "max_completion_tokens",
                    "context_length_exceeded")
    assert error["message"].startswith("max_completion_tokens is")
    error = refused(post(server, "chat", max_tokens=limit), "max_tokens",
                    "context_length_exceeded")
    assert error["message"].startswith("max_tokens is")
    refused(post(server, "chat", max_completion_tokens=0), "max_completion_tokens")


@pytest.mark.parametrize("route, body, param", [
    ("completions", {"prompt": [1, False, 3]}, "prompt"),
    ("completions", {"stop_token_ids": [False]}, "stop_token_ids.0"),
    ("completions", {"allowed_token_ids": [True]}, "allowed_token_ids.0"),
    ("completions", {"n": "3"}, "n"),
    ("completions", {"n": 2.0}, "n"),
    ("completions", {"max_tokens": 2.0}, "max_tokens"),
    ("chat", {"max_completion_tokens": "3"}, "max_completion_tokens"),
    ("completions", {"seed": "1"}, "seed"),
    ("completions", {"logprobs": True}, "logprobs"),
    ("chat", {"logprobs": 1}, "logprobs"),
    ("completions", {"stream": 0}, "stream"),
    ("completions", {"temperature": "0.5"}, "temperature"),
    ("chat", {"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
])
def test_strict_types(server, route, body, param):
    error = refused(post(server, route, max_tokens=1, **body) if "max_tokens" not in body
                    else post(server, route, **body), param)
    assert "got" in error["message"] or param.startswith("prompt"), error


def test_openapi_declares_the_400s_it_sends(server):
    document = httpx.get(server.url + "/openapi.json").json()
    posts = {path: ops["post"] for path, ops in document["paths"].items() if "post" in ops}
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"} <= set(posts)
    for path, operation in posts.items():
        assert "422" not in operation["responses"], path
        # every body is bounded in size and in time (BodyLimits), whatever the route
        assert {"408", "413"} <= set(operation["responses"]), path
        error = operation["responses"]["400"]["content"]["application/json"]["schema"]
        assert error == {"$ref": "#/components/schemas/ErrorResponse"}
    schemas = document["components"]["schemas"]
    assert "HTTPValidationError" not in schemas and "ErrorInfo" in schemas
    assert "422" not in json.dumps(document["paths"])
    # the documented body is the one the server sends
    body = raw(server, "/v1/completions", b"{").json()
    assert set(body["error"]) == set(schemas["ErrorInfo"]["properties"])


def test_tool_message_needs_tool_call_id(server):
    messages = SAY + [{"role": "assistant", "content": "Let me check."},
                      {"role": "tool", "content": "18 degrees"}]
    refused(post(server, "chat", messages=messages, max_tokens=1), "messages.2.tool_call_id",
            "missing_required_parameter")


@pytest.mark.parametrize("tool_choice", [None, "auto", "none", "required",
                                         {"type": "function", "function": {"name": "broken"}}])
def test_invalid_tool_schema_refused_whatever_the_tool_choice(server, tool_choice):
    broken = {"type": "function", "function": {
        "name": "broken", "parameters": {"type": "object",
                                         "properties": {"a": {"type": "nope"}}}}}
    body = {"tools": [WEATHER, broken], "max_tokens": 1}
    if tool_choice is not None:
        body["tool_choice"] = tool_choice
    error = refused(post(server, "chat", **body), "tools.1.function.parameters")
    assert "broken" in error["message"] and not INTERNALS.search(error["message"])


def test_engine_requests_per_http_request_are_bounded(server):
    error = refused(post(server, "completions", prompt=["hi"] * 65, n=16, max_tokens=1),
                    "prompt")
    assert "1040" in error["message"] and "1024" in error["message"]
    refused(post(server, "completions", prompt=[[1]] * 1025, max_tokens=1), "prompt")
    refused(post(server, "completions", prompt=[], max_tokens=1), "prompt")


def test_prompt_checks_are_the_engines(server):
    """Empty and too-long prompts are refused by the engine's checks (after truncation), in
    the client's field names."""
    limit = httpx.get(server.base_url + "/models").json()["data"][0]["max_model_len"]
    error = refused(post(server, "completions", prompt="", max_tokens=1), "prompt")
    assert "empty" in error["message"]
    refused(post(server, "completions", prompt=["fine", ""], max_tokens=1), "prompt")
    refused(post(server, "completions", prompt=[[1], []], max_tokens=1), "prompt")
    too_long = [1] * (limit + 10)
    refused(post(server, "completions", prompt=too_long, max_tokens=1), "prompt",
            "context_length_exceeded")
    fits = ok(post(server, "completions", prompt=too_long, max_tokens=1,
                   truncate_prompt_tokens=limit - 1))
    assert fits["usage"]["prompt_tokens"] == limit - 1
    chat = [{"role": "user", "content": "word " * limit}]
    refused(post(server, "chat", messages=chat, max_tokens=1), "messages",
            "context_length_exceeded")
    refused(post(server, "completions", truncate_prompt_tokens=limit + 1, max_tokens=1),
            "truncate_prompt_tokens")
    refused(post(server, "completions", min_tokens=limit, max_tokens=None), "min_tokens",
            "context_length_exceeded")


def test_text_parts_equal_plain_content(server):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name a "},
                                          {"type": "text", "text": "color."}]}]
    body = dict(temperature=0, max_tokens=8)
    assert ok(post(server, "chat", messages=parts, **body))["choices"][0]["message"] == \
        ok(post(server, "chat", **body))["choices"][0]["message"]
    refused(post(server, "chat", max_tokens=1, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]), "messages.0.content")


def test_server_still_serves_and_holds_no_block(server):
    ok(post(server, "completions", max_tokens=2))
    m = server.wait_idle()
    assert m["pagedserve_num_requests_running"] == 0
    assert m["pagedserve_kv_cache_usage_perc"] == 0.0
