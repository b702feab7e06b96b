"""Structured outputs, tool calling and the request fields around them, through the official
`openai` client against the live server on the default model (SmolLM2-135M): json_schema and
json_object outputs parse and validate, greedy and sampled, streamed and not; the
structured_outputs extension; named and required tool calls come back as valid tool_calls
(streamed too); an auto round trip with a tool result in the history; logit_bias,
min_tokens, /tokenize and /detokenize; every refused OpenAI field gets a 400 naming it."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from tests.server.conftest import MODEL_NAME

NAME = {"type": "string", "pattern": "^[A-Za-z ]{1,16}$"}  # bounded: small max_tokens suffice
SCHEMAS = {
    "person": {  # nested object, enum, required fields
        "type": "object",
        "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                       "city": {"type": "object", "properties": {"name": NAME},
                                "required": ["name"]},
                       "role": {"enum": ["student", "teacher", "doctor"]}},
        "required": ["name", "age", "city", "role"],
    },
    "colors": {  # array of enums, bounded
        "type": "object",
        "properties": {"colors": {"type": "array", "minItems": 1, "maxItems": 3,
                                  "items": {"enum": ["red", "green", "blue"]}}},
        "required": ["colors"],
    },
}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": NAME,
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city.",
    "parameters": {"type": "object", "properties": {"city": NAME}, "required": ["city"]}}}
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def json_schema_format(name: str) -> dict:
    return {"type": "json_schema",
            "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_greedy_and_sampled_validate(client, name):
    for temperature, n in ((0.0, 1), (1.0, 2)):
        resp = client.chat.completions.create(
            model=MODEL_NAME, messages=ASK, response_format=json_schema_format(name),
            temperature=temperature, n=n, seed=7, max_tokens=48)
        assert len(resp.choices) == n
        for choice in resp.choices:
            assert choice.finish_reason == "stop", choice.message.content
            jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name])


def test_json_schema_streamed_validates_and_equals_unstreamed(client):
    kwargs = dict(model=MODEL_NAME, messages=ASK, response_format=json_schema_format("person"),
                  temperature=0, max_tokens=48)
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full
    jsonschema.validate(json.loads(text), SCHEMAS["person"])
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_json_object_parses(client):
    resp = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Give a JSON object with one "
                                     'key "answer" whose value is 42.'}],
        response_format={"type": "json_object"}, temperature=0, max_tokens=32)
    assert resp.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(resp.choices[0].message.content), dict)


def test_structured_outputs_extension_on_completions(client):
    regex = client.completions.create(
        model=MODEL_NAME, prompt="A phone number:", temperature=0, max_tokens=16,
        extra_body={"structured_outputs": {"regex": r"\d{3}-\d{4}"}})
    assert re.fullmatch(r"\d{3}-\d{4}", regex.choices[0].text)
    choice = client.completions.create(
        model=MODEL_NAME, prompt="Is the sky blue?", temperature=1.0, seed=3, max_tokens=8,
        extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}})
    assert choice.choices[0].text in ("yes", "no", "maybe")


def check_call(call, tool: dict) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == tool["function"]["name"]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_named_tool_call_plain_and_streamed(client):
    kwargs = dict(model=MODEL_NAME, messages=WEATHER_ASK, tools=[WEATHER, TIME], temperature=0,
                  max_tokens=32, tool_choice={"type": "function",
                                              "function": {"name": "get_time"}})
    resp = client.chat.completions.create(**kwargs)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call, = choice.message.tool_calls
    check_call(call, TIME)
    chunks = [c for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    assert deltas[0].id and deltas[0].function.name == "get_time"
    assert len(deltas) > 2  # the arguments arrive in pieces
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_required_tool_call_and_auto_round_trip(client):
    resp = client.chat.completions.create(
        model=MODEL_NAME, messages=WEATHER_ASK, tools=[WEATHER, TIME], tool_choice="required",
        temperature=0, max_tokens=48)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        check_call(call, WEATHER if call.function.name == "get_weather" else TIME)
    call = choice.message.tool_calls[0]
    history = WEATHER_ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}]
    answer = client.chat.completions.create(model=MODEL_NAME, messages=history,
                                            tools=[WEATHER, TIME], temperature=0,
                                            max_tokens=16)
    message = answer.choices[0].message
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert message.content or message.tool_calls
    none = client.chat.completions.create(model=MODEL_NAME, messages=history,
                                          tools=[WEATHER], tool_choice="none", temperature=0,
                                          max_tokens=4)
    assert not none.choices[0].message.tool_calls


def test_logit_bias_and_min_tokens(server, client):
    token, = httpx.post(server.url + "/tokenize", json={"prompt": " banana",
                                                        "add_special_tokens": False}
                        ).json()["tokens"]
    resp = client.completions.create(model=MODEL_NAME, prompt="Hello", temperature=0,
                                     max_tokens=3, logit_bias={str(token): 100})
    assert resp.choices[0].text == " banana" * 3
    say_ok = [{"role": "user", "content": "Say OK."}]
    short = client.chat.completions.create(model=MODEL_NAME, messages=say_ok, temperature=0,
                                           max_tokens=40)
    assert short.choices[0].finish_reason == "stop"
    wanted = short.usage.completion_tokens + 5
    long = client.chat.completions.create(model=MODEL_NAME, messages=say_ok, temperature=0,
                                          max_tokens=40, extra_body={"min_tokens": wanted})
    assert long.usage.completion_tokens >= wanted


def test_tokenize_and_detokenize(server):
    text = "The capital of France is"
    tokens = httpx.post(server.url + "/tokenize", json={"prompt": text}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] > 0
    back = httpx.post(server.url + "/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert back == {"prompt": text}
    chat = httpx.post(server.url + "/tokenize", json={"messages": ASK}).json()
    assert chat["count"] > tokens["count"]
    bad = httpx.post(server.url + "/detokenize", json={"tokens": [10 ** 9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


CHAT_REFUSED = {
    "audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "x"},
    "web_search_options": {}, "reasoning_effort": "low", "verbosity": "low",
    "moderation": {}, "prompt_cache_options": {"mode": "explicit"},
    "functions": [{"name": "f"}], "function_call": "auto", "store": True,
}
COMPLETION_REFUSED = {"suffix": "x", "echo": True}


@pytest.mark.parametrize("route, field, value", [
    *(("chat/completions", k, v) for k, v in CHAT_REFUSED.items()),
    *(("completions", k, v) for k, v in COMPLETION_REFUSED.items()),
])
def test_refused_fields_get_a_400_naming_them(server, route, field, value):
    body = {"model": MODEL_NAME, "max_tokens": 1, field: value,
            **({"messages": ASK} if route.startswith("chat") else {"prompt": "Hi"})}
    resp = httpx.post(f"{server.base_url}/{route}", json=body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == field and field.split("_")[0] in error["message"]


def check_prompt_logprobs(entries: list, prompt_ids: list[int], top: int) -> None:
    """vLLM's shape: None first, then per position the prompt token (by id) and the top."""
    assert len(entries) == len(prompt_ids) and entries[0] is None
    for entry, token in zip(entries[1:], prompt_ids[1:]):
        ranks = {int(t): e["rank"] for t, e in entry.items()}
        assert token in ranks and all(e["logprob"] <= 0.0 for e in entry.values())
        assert sorted(r for t, r in ranks.items() if r <= top) == list(range(1, top + 1))
        assert len(entry) in (top, top + 1)


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_prompt_logprobs(server, route):
    body = {"model": MODEL_NAME, "max_tokens": 2, "prompt_logprobs": 2}
    if route == "completions":
        body["prompt"] = "The capital of France is"
        prompt_ids = httpx.post(server.url + "/tokenize", json={"prompt": body["prompt"]}
                                ).json()["tokens"]
    else:
        body["messages"] = ASK
        prompt_ids = httpx.post(server.url + "/tokenize", json={"messages": ASK}).json()["tokens"]
    resp = httpx.post(f"{server.base_url}/{route}", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    data = resp.json()
    entries = data["choices"][0]["prompt_logprobs"] if route == "completions" \
        else data["prompt_logprobs"]
    assert data["usage"]["prompt_tokens"] == len(prompt_ids)
    check_prompt_logprobs(entries, prompt_ids, 2)
    streamed = httpx.post(f"{server.base_url}/{route}", json={**body, "stream": True})
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "prompt_logprobs"


def test_bad_structured_requests_get_a_400(client):
    cases = [
        dict(response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}),
        dict(extra_body={"structured_outputs": {"regex": "[a-"}}),
        dict(extra_body={"structured_outputs": {"regex": "a", "choice": ["a"]}}),
        dict(tool_choice="required"),  # no tools
        dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
    ]
    for kwargs in cases:
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=MODEL_NAME, messages=ASK, max_tokens=4,
                                           **kwargs)
