"""Anthropic's Messages API (/v1/messages) through the official `anthropic` client, against
the live server on the default model: the same answers as the chat path for the same
conversation (one generation path), the streamed event sequence, a tool round trip,
stop_sequences, prefill, output_config.format, and errors in Anthropic's shape.

The client's `create` no longer takes temperature / top_p / top_k (Anthropic's newer models
refuse them); older clients and other tools send them, so they go in `extra_body` here."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

from tests.server.conftest import MODEL_NAME

SYSTEM = "You are a terse assistant."
ASK = "Name three primary colors."
CITY = {"type": "string", "pattern": "^[A-Za-z ]{1,16}$"}
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": CITY},
                            "required": ["city"]}}
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"extra_body": {"temperature": 0}}


@pytest.fixture
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0,
                               timeout=300)


def chat(client, messages, **body):
    body = {"temperature": 0, "max_completion_tokens": 12, **body}
    return client.chat.completions.create(model=MODEL_NAME, messages=messages, **body)


def text_of(message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def test_create_answers_as_chat_completions_do(claude, client):
    reference = chat(client, [{"role": "system", "content": SYSTEM},
                              {"role": "user", "content": ASK}])
    for system, content in ((SYSTEM, ASK), ([{"type": "text", "text": SYSTEM}],
                                             [{"type": "text", "text": ASK}])):
        message = claude.messages.create(model=MODEL_NAME, max_tokens=12, system=system,
                                         messages=[{"role": "user", "content": content}],
                                         **GREEDY)
        assert message.type == "message" and message.role == "assistant"
        assert message.model == MODEL_NAME and message.id.startswith("msg_")
        assert text_of(message) == reference.choices[0].message.content
        usage = message.usage
        assert usage.input_tokens + usage.cache_read_input_tokens == \
            reference.usage.prompt_tokens
        assert usage.output_tokens == reference.usage.completion_tokens
        expected = "max_tokens" if reference.choices[0].finish_reason == "length" else "end_turn"
        assert message.stop_reason == expected and message.stop_sequence is None


def test_sampling_fields_reach_the_engine(claude):
    """top_k 1, or a top_p that keeps only the likeliest token, make sampling greedy (a field
    left out would leave a sampled answer)."""
    ask = {"model": MODEL_NAME, "max_tokens": 16, "messages": [{"role": "user", "content": ASK}]}
    greedy = text_of(claude.messages.create(**ask, **GREEDY))
    for fields in ({"temperature": 1.0, "top_k": 1}, {"temperature": 1.0, "top_p": 1e-6}):
        assert text_of(claude.messages.create(**ask, extra_body=fields)) == greedy, fields


def test_stream_sends_anthropics_event_sequence(server, claude):
    body = {"model": MODEL_NAME, "max_tokens": 12, "messages": [{"role": "user",
                                                                   "content": ASK}]}
    whole = claude.messages.create(**body, **GREEDY)
    response = httpx.post(server.url + "/v1/messages", json={**body, "temperature": 0,
                                                             "stream": True}, timeout=120)
    assert response.headers["content-type"].startswith("text/event-stream")
    events = []
    for block in response.text.strip().split("\n\n"):
        name, data = block.split("\n")
        events.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    assert all(name == data["type"] for name, data in events)
    names = [name for name, _ in events]
    deltas = names.count("content_block_delta")
    assert deltas > 1
    assert names == ["message_start", "ping", "content_block_start",
                     *["content_block_delta"] * deltas, "content_block_stop", "message_delta",
                     "message_stop"]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] == \
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    assert events[2][1]["content_block"] == {"type": "text", "text": ""}
    text = "".join(data["delta"]["text"] for name, data in events
                   if name == "content_block_delta")
    assert text == text_of(whole)
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] == whole.stop_reason
    assert delta["usage"]["output_tokens"] == whole.usage.output_tokens
    # the SDK's stream helper reads the same events into the same message
    with claude.messages.stream(**body, **GREEDY) as stream:
        final = stream.get_final_message()
    assert text_of(final) == text_of(whole) and final.stop_reason == whole.stop_reason


def check_call(block) -> dict:
    assert block.type == "tool_use" and block.name == "get_weather" and block.id
    jsonschema.validate(block.input, WEATHER["input_schema"])
    return block.input


def test_tool_round_trip(claude, client):
    first = claude.messages.create(model=MODEL_NAME, max_tokens=24, tools=[WEATHER],
                                   tool_choice={"type": "tool", "name": "get_weather"},
                                   messages=WEATHER_ASK, **GREEDY)
    assert first.stop_reason == "tool_use"
    call, = first.content
    check_call(call)
    history = WEATHER_ASK + [
        {"role": "assistant", "content": first.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                      "content": "18 degrees and sunny"}]}]
    answer = claude.messages.create(model=MODEL_NAME, max_tokens=12, tools=[WEATHER],
                                    tool_choice={"type": "auto"}, messages=history, **GREEDY)
    reference = chat(client, [
        *WEATHER_ASK,
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": json.dumps(call.input)}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}],
        tools=[{"type": "function", "function": {
            "name": WEATHER["name"], "description": WEATHER["description"],
            "parameters": WEATHER["input_schema"]}}])
    assert text_of(answer) == (reference.choices[0].message.content or "")
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens == \
        reference.usage.prompt_tokens
    # tool_choice none: the model is not shown the tools (a shorter prompt)
    unseen = claude.messages.create(model=MODEL_NAME, max_tokens=1, tools=[WEATHER],
                                    tool_choice={"type": "none"}, messages=history, **GREEDY)
    assert unseen.usage.input_tokens + unseen.usage.cache_read_input_tokens < \
        reference.usage.prompt_tokens
    # a failed call reads differently to the model: another prompt
    failed = [*history[:2], {"role": "user", "content": [{
        "type": "tool_result", "tool_use_id": call.id, "content": "18 degrees and sunny",
        "is_error": True}]}]
    error = claude.messages.create(model=MODEL_NAME, max_tokens=1, tools=[WEATHER],
                                   messages=failed, **GREEDY)
    assert error.usage.input_tokens + error.usage.cache_read_input_tokens > \
        answer.usage.input_tokens + answer.usage.cache_read_input_tokens


def test_streamed_tool_use(claude):
    with claude.messages.stream(model=MODEL_NAME, max_tokens=40, tools=[WEATHER],
                                tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                messages=WEATHER_ASK,
                                **GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and len(final.content) == 1  # one call: not parallel
    start = next(e for e in events if e.type == "content_block_start")
    assert start.content_block.type == "tool_use" and start.content_block.input == {}
    partial = "".join(e.delta.partial_json for e in events
                      if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
    assert check_call(final.content[0]) == json.loads(partial)
    assert final.content[0].id == start.content_block.id


def test_count_tokens_is_the_prompt_create_would_run(claude):
    """The count of the prompt /v1/messages renders: system, tools, a tool round trip."""
    first = claude.messages.create(model=MODEL_NAME, max_tokens=24, tools=[WEATHER],
                                   tool_choice={"type": "tool", "name": "get_weather"},
                                   messages=WEATHER_ASK, **GREEDY)
    history = WEATHER_ASK + [
        {"role": "assistant", "content": first.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": first.content[0].id,
                                      "content": "18 degrees and sunny"}]}]
    for body in ({"messages": [{"role": "user", "content": ASK}], "system": SYSTEM},
                 {"messages": history, "tools": [WEATHER]}):
        count = claude.messages.count_tokens(model=MODEL_NAME, **body)
        made = claude.messages.create(model=MODEL_NAME, max_tokens=1, **body, **GREEDY)
        assert count.input_tokens == made.usage.input_tokens + made.usage.cache_read_input_tokens
    without_tools = claude.messages.count_tokens(model=MODEL_NAME, messages=history)
    assert without_tools.input_tokens < count.input_tokens
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.count_tokens(model="claude-nope", messages=history)


def test_stop_sequences(claude):
    free = claude.messages.create(model=MODEL_NAME, max_tokens=16,
                                  messages=[{"role": "user", "content": ASK}], **GREEDY)
    words = text_of(free).split()
    stop = words[len(words) // 2]
    cut = claude.messages.create(model=MODEL_NAME, max_tokens=16, stop_sequences=[stop],
                                 messages=[{"role": "user", "content": ASK}], **GREEDY)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert text_of(cut) == text_of(free)[:text_of(free).index(stop)]


def test_a_last_assistant_message_is_continued(claude, client):
    prefill = "My favorite color is"
    chat_messages = [{"role": "user", "content": "Name a color."},
                     {"role": "assistant", "content": prefill}]
    message = claude.messages.create(model=MODEL_NAME, max_tokens=8, messages=chat_messages,
                                     **GREEDY)
    reference = chat(client, chat_messages, max_completion_tokens=8,
                     extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert text_of(message) == reference.choices[0].message.content


def test_output_config_format(claude):
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
              "required": ["color"]}
    message = claude.messages.create(
        model=MODEL_NAME, max_tokens=24, messages=[{"role": "user", "content": "A color?"}],
        output_config={"format": {"type": "json_schema", "schema": schema}}, **GREEDY)
    jsonschema.validate(json.loads(text_of(message)), schema)


@pytest.mark.parametrize("body, status, kind, param", [
    ({"messages": [{"role": "user", "content": ASK}]}, 400, "invalid_request_error",
     "max_tokens"),
    ({"max_tokens": 0}, 400, "invalid_request_error", "max_tokens"),
    ({"max_tokens": 10**6}, 400, "invalid_request_error", "max_tokens"),
    ({"max_tokens": 4, "temperature": 1.5}, 400, "invalid_request_error", "temperature"),
    ({"max_tokens": 4, "stop_sequences": [""]}, 400, "invalid_request_error",
     "stop_sequences"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {}}]}]}, 400, "invalid_request_error",
     "messages.0.content.0"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": ASK * 2000}]}, 400,
     "invalid_request_error", "messages"),
    ({"max_tokens": 4, "tools": [{**WEATHER, "input_schema": {"type": "nonsense"}}]}, 400,
     "invalid_request_error", "tools.0.input_schema"),
    ({"max_tokens": 4, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "f"}}, 400,
     "invalid_request_error", "tool_choice"),
    # the default model has no thinking block to budget
    ({"max_tokens": 4, "thinking": {"type": "enabled", "budget_tokens": 1024}}, 400,
     "invalid_request_error", "thinking.budget_tokens"),
    ({"max_tokens": 4, "thinking": {"type": "adaptive", "display": "summarized"}}, 400,
     "invalid_request_error", "thinking.display"),
    ({"max_tokens": 4, "container": "x"}, 400, "invalid_request_error", "container"),
    ({"max_tokens": 4, "model": "claude-nope"}, 404, "not_found_error", "model"),
])
def test_errors_in_anthropic_shape_name_the_field(server, body, status, kind, param):
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": ASK}], **body}
    response = httpx.post(server.url + "/v1/messages", json=body, timeout=120)
    assert response.status_code == status, response.text
    answer = response.json()
    assert set(answer) == {"type", "error"} and answer["type"] == "error"
    assert answer["error"]["type"] == kind
    assert param in answer["error"]["message"], answer


def test_the_client_raises_its_own_error_classes(claude):
    with pytest.raises(anthropic.BadRequestError) as bad:
        claude.messages.create(model=MODEL_NAME, max_tokens=0,
                               messages=[{"role": "user", "content": ASK}])
    assert bad.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="claude-nope", max_tokens=1,
                               messages=[{"role": "user", "content": ASK}])


@pytest.mark.parametrize("path, body, prompt_usage", [
    ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "user", "content": ASK}]},
     lambda u: u["input_tokens"] + u["cache_read_input_tokens"]),
    ("/v1/responses", {"max_output_tokens": 5, "input": ASK}, lambda u: u["input_tokens"]),
])
def test_the_agent_apis_count_in_the_metrics_and_free_their_blocks(server, path, body,
                                                                    prompt_usage):
    """One generation path: the same engine metrics as chat completions, no block held."""
    label = 'pagedserve_request_finished_total{finish_reason=length}'
    before = server.wait_idle()
    for stream in (False, True):
        response = httpx.post(server.url + path, json={"model": MODEL_NAME, "temperature": 0,
                                                       "stream": stream, **body}, timeout=120)
        assert response.status_code == 200, response.text
    usage = httpx.post(server.url + path, json={"model": MODEL_NAME, "temperature": 0, **body},
                       timeout=120).json()["usage"]
    after = server.wait_idle()
    assert after[label] - before.get(label, 0) == 3
    assert after["pagedserve_prompt_tokens_total"] - before["pagedserve_prompt_tokens_total"] \
        == 3 * prompt_usage(usage)
    assert after["pagedserve_kv_cache_usage_perc"] == 0.0


COUNT = "Count from 1 to 500, separated by commas."  # greedy: over 100 tokens


@pytest.mark.parametrize("path, body", [
    ("/v1/messages", {"max_tokens": 2000, "messages": [{"role": "user", "content": COUNT}]}),
    ("/v1/responses", {"max_output_tokens": 2000, "input": COUNT}),
])
def test_a_client_leaving_mid_stream_frees_its_blocks(server, path, body):
    aborted = "pagedserve_request_finished_total{finish_reason=abort}"
    before = server.wait_idle().get(aborted, 0)
    body = {"model": MODEL_NAME, "stream": True, "temperature": 0, **body}
    with httpx.stream("POST", server.url + path, json=body, timeout=120) as response:
        assert response.status_code == 200
        deltas = 0
        for line in response.iter_lines():
            deltas += "delta" in line
            if deltas >= 3:
                break
    m = server.wait_idle()
    assert m.get(aborted, 0) == before + 1  # it was still running: aborted, not finished
    assert m["pagedserve_num_requests_running"] == 0
    assert m["pagedserve_kv_cache_usage_perc"] == 0.0


def test_every_shape_validates_against_the_sdks_types(server):
    """Strictly, as pydantic validates (the SDK itself builds its objects leniently)."""
    from anthropic.types import Message, MessageTokensCount, RawMessageStreamEvent
    from pydantic import TypeAdapter

    events = TypeAdapter(RawMessageStreamEvent)
    for body in ({"messages": [{"role": "user", "content": ASK}]},
                 {"messages": WEATHER_ASK, "tools": [WEATHER], "tool_choice": {"type": "any"}}):
        body = {"model": MODEL_NAME, "max_tokens": 30, "temperature": 0, **body}
        Message.model_validate(httpx.post(server.url + "/v1/messages", json=body,
                                          timeout=120).json())
        with httpx.stream("POST", server.url + "/v1/messages", json={**body, "stream": True},
                          timeout=120) as response:
            data = [json.loads(line[6:]) for line in response.iter_lines()
                    if line.startswith("data: ")]
        for event in data:
            if event["type"] != "ping":
                events.validate_python(event)
    count = {k: v for k, v in body.items() if k not in ("max_tokens", "temperature")}
    MessageTokensCount.model_validate(httpx.post(
        server.url + "/v1/messages/count_tokens", json=count, timeout=120).json())
