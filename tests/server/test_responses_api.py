"""OpenAI's Responses API (/v1/responses) through the official `openai` client's
`client.responses`, against the live server on the default model: the same answers as the
chat path for the same conversation (one generation path), the Responses event sequence, a
tool round trip, previous_response_id over the store, text.format, and errors in the
Responses' field names."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from pagedserve.entrypoints.server.response_store import ResponseStore
from tests.server.conftest import MODEL_NAME

SYSTEM = "You are a terse assistant."
ASK = "Name three primary colors."
CITY = {"type": "string", "pattern": "^[A-Za-z ]{1,16}$"}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": CITY},
                          "required": ["city"]}, "strict": True}
WEATHER_ASK = "What is the weather in Paris?"
GREEDY = {"temperature": 0, "max_output_tokens": 12}


def chat(client, messages, **body) -> openai.types.chat.ChatCompletion:
    body = {"temperature": 0, "max_completion_tokens": 12, **body}
    return client.chat.completions.create(model=MODEL_NAME, messages=messages, **body)


def test_create_answers_as_chat_completions_do(client):
    reference = chat(client, [{"role": "system", "content": SYSTEM},
                              {"role": "user", "content": ASK}])
    for given in (ASK, [{"role": "user", "content": ASK}],
                  [{"type": "message", "role": "user",
                    "content": [{"type": "input_text", "text": ASK}]}]):
        resp = client.responses.create(model=MODEL_NAME, instructions=SYSTEM, input=given,
                                       **GREEDY)
        assert resp.object == "response" and resp.model == MODEL_NAME
        assert resp.output_text == reference.choices[0].message.content
        message, = resp.output
        assert message.type == "message" and message.role == "assistant"
        assert resp.usage.input_tokens == reference.usage.prompt_tokens
        assert resp.usage.output_tokens == reference.usage.completion_tokens
        assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
        assert resp.instructions == SYSTEM and resp.max_output_tokens == 12
        if reference.choices[0].finish_reason == "length":
            assert resp.status == "incomplete"
            assert resp.incomplete_details.reason == "max_output_tokens"
        else:
            assert resp.status == "completed" and resp.incomplete_details is None


def test_sampling_fields_reach_the_engine(client):
    """Each field changes a sampled answer, and changes it as it does in a chat completion."""
    base = {"temperature": 1.0, "seed": 3}
    answers = []
    for extra in ({}, {"top_p": 0.5}, {"temperature": 0.3}, {"seed": 4}, {"top_k": 3},
                  {"min_p": 0.2}, {"repetition_penalty": 1.5}, {"presence_penalty": -2.0},
                  {"frequency_penalty": -2.0}, {"stop": [" "]}):
        fields = {**base, **extra}
        openai_fields = {k: fields.pop(k) for k in ("temperature", "top_p") if k in fields}
        resp = client.responses.create(model=MODEL_NAME, input=ASK, max_output_tokens=16,
                                       extra_body=fields, **openai_fields)
        reference = client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": ASK}],
            max_completion_tokens=16, extra_body=fields, **openai_fields)
        assert resp.output_text == reference.choices[0].message.content, extra
        answers.append(resp.output_text)
    changed = [answer != answers[0] for answer in answers[1:]]
    assert all(changed), str(answers)


def test_stream_sends_the_responses_event_sequence(client):
    whole = client.responses.create(model=MODEL_NAME, input=ASK, **GREEDY)
    events = list(client.responses.create(model=MODEL_NAME, input=ASK, stream=True, **GREEDY))
    types = [e.type for e in events]
    deltas = types.count("response.output_text.delta")
    assert deltas > 1
    last = "response.completed" if whole.status == "completed" else "response.incomplete"
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * deltas,
                     "response.output_text.done", "response.content_part.done",
                     "response.output_item.done", last]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    done = events[-4]
    assert done.text == text and done.item_id == events[2].item.id
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == whole.usage.output_tokens
    assert final.id == events[0].response.id
    # the SDK's stream helper reads the events of a finished answer into the same response
    say_ok = {"model": MODEL_NAME, "input": "Say OK.", "temperature": 0,
              "max_output_tokens": 40}
    finished = client.responses.create(**say_ok)
    assert finished.status == "completed"
    with client.responses.stream(**say_ok) as stream:
        assert stream.get_final_response().output_text == finished.output_text


def check_call(item) -> dict:
    assert item.type == "function_call" and item.name == "get_weather"
    assert item.call_id and item.id and item.status == "completed"
    arguments = json.loads(item.arguments)
    jsonschema.validate(arguments, WEATHER["parameters"])
    return arguments


def test_tool_round_trip_and_previous_response_id(client):
    first = client.responses.create(model=MODEL_NAME, input=WEATHER_ASK, tools=[WEATHER],
                                    tool_choice={"type": "function", "name": "get_weather"},
                                    temperature=0, max_output_tokens=24)
    call, = first.output
    check_call(call)
    result = {"type": "function_call_output", "call_id": call.call_id,
              "output": "18 degrees and sunny"}
    # continued from the store, and with the whole history sent back: the same prompt
    continued = client.responses.create(model=MODEL_NAME, previous_response_id=first.id,
                                        input=[result], tools=[WEATHER], **GREEDY)
    history = [{"role": "user", "content": WEATHER_ASK}, call.model_dump(exclude_none=True),
               result]
    explicit = client.responses.create(model=MODEL_NAME, input=history, tools=[WEATHER],
                                       **GREEDY)
    assert continued.previous_response_id == first.id
    assert continued.output_text == explicit.output_text and continued.output
    assert continued.usage.input_tokens == explicit.usage.input_tokens
    assert continued.usage.input_tokens > first.usage.input_tokens
    # the chat path with the same history answers the same
    reference = chat(client, [
        {"role": "user", "content": WEATHER_ASK},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": call.call_id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "18 degrees and sunny"}],
        tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items()
                                                 if k != "type"}}])
    assert continued.output_text == (reference.choices[0].message.content or "")


def test_history_renders_as_the_chat_messages(client):
    """Earlier turns sent back as items (an assistant's output_text among them): the prompt
    and answer of the same chat messages."""
    turns = [{"role": "user", "content": "Name a color."},
             {"role": "assistant", "content": "Blue."},
             {"role": "user", "content": "Another one?"}]
    items = [turns[0], {"type": "message", "role": "assistant",
                        "content": [{"type": "output_text", "text": "Blue."}]}, turns[2]]
    resp = client.responses.create(model=MODEL_NAME, input=items, **GREEDY)
    reference = chat(client, turns)
    assert resp.output_text == reference.choices[0].message.content
    assert resp.usage.input_tokens == reference.usage.prompt_tokens


def test_cache_salt_isolates_the_prefix_cache(client):
    ask = {"model": MODEL_NAME, "input": ASK * 8, "temperature": 0, "max_output_tokens": 1}
    client.responses.create(**ask)
    assert client.responses.create(**ask).usage.input_tokens_details.cached_tokens > 0
    salted = client.responses.create(**ask, extra_body={"cache_salt": "tenant-a"})
    assert salted.usage.input_tokens_details.cached_tokens == 0


def test_parallel_tool_calls(client):
    """A required call, sampled: the small model sometimes goes on to a second call; with
    parallel_tool_calls false the grammar holds every answer to one."""
    ask = {"model": MODEL_NAME, "input": "What is the weather in Paris and in Rome?",
           "tools": [WEATHER], "tool_choice": "required", "temperature": 1.0,
           "max_output_tokens": 80}
    counts = {True: [], False: []}
    for seed in range(6):
        for parallel in (True, False):
            resp = client.responses.create(**ask, parallel_tool_calls=parallel,
                                           extra_body={"seed": seed})
            assert resp.parallel_tool_calls is parallel
            for item in resp.output:
                check_call(item)
            counts[parallel].append(len(resp.output))
    assert max(counts[True]) > 1 and set(counts[False]) == {1}, counts


def test_streamed_tool_call_events(client):
    events = list(client.responses.create(
        model=MODEL_NAME, input=WEATHER_ASK, tools=[WEATHER], tool_choice="required",
        temperature=0, max_output_tokens=40, stream=True))
    types = [e.type for e in events]
    assert types[:3] == ["response.created", "response.in_progress",
                         "response.output_item.added"]
    added = events[2].item
    assert added.type == "function_call" and added.status == "in_progress"
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    streamed = "".join(e.delta for e in events
                       if e.type == "response.function_call_arguments.delta")
    assert streamed == done.arguments and done.item_id == added.id
    final = events[-1].response
    assert check_call(final.output[0]) == json.loads(done.arguments)
    assert final.output[0].call_id == added.call_id


def test_store_retrieve_delete_and_store_false(client):
    stored = client.responses.create(model=MODEL_NAME, input=ASK, **GREEDY)
    again = client.responses.retrieve(stored.id)
    assert again.id == stored.id and again.output_text == stored.output_text
    unstored = client.responses.create(model=MODEL_NAME, input=ASK, store=False, **GREEDY)
    assert unstored.output_text == stored.output_text
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model=MODEL_NAME, input="And?", previous_response_id=unstored.id,
                                **GREEDY)
    assert missing.value.body["param"] == "previous_response_id"
    client.responses.delete(stored.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(stored.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(stored.id)


def test_metadata_is_returned_and_stored(client):
    resp = client.responses.create(model=MODEL_NAME, input=ASK, metadata={"run": "7"}, **GREEDY)
    assert resp.metadata == {"run": "7"}
    assert client.responses.retrieve(resp.id).metadata == {"run": "7"}


def test_text_format_json_schema_and_json_object(client):
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
              "required": ["color"]}
    resp = client.responses.create(
        model=MODEL_NAME, input="Pick a color as JSON.", temperature=0, max_output_tokens=24,
        text={"format": {"type": "json_schema", "name": "pick", "schema": schema,
                         "strict": True}})
    jsonschema.validate(json.loads(resp.output_text), schema)
    assert resp.text.format.type == "json_schema"
    loose = client.responses.create(model=MODEL_NAME, input="A color as JSON.", temperature=0,
                                    max_output_tokens=24, text={"format": {"type": "json_object"}})
    plain = client.responses.create(model=MODEL_NAME, input="A color as JSON.", temperature=0,
                                    max_output_tokens=24, text={"format": {"type": "text"}})
    assert plain.output_text == client.responses.create(
        model=MODEL_NAME, input="A color as JSON.", temperature=0,
        max_output_tokens=24).output_text != loose.output_text
    reference = chat(client, [{"role": "user", "content": "A color as JSON."}],
                     max_completion_tokens=24, response_format={"type": "json_object"})
    assert loose.output_text.lstrip().startswith("{")
    assert loose.output_text == reference.choices[0].message.content


@pytest.mark.parametrize("body, param", [
    ({"input": ASK, "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": ASK, "temperature": 3}, "temperature"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input.0.content.0"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0"),
    ({"input": ASK, "reasoning": {"effort": "high"}}, "reasoning.effort"),
    ({"input": ASK, "truncation": "auto"}, "truncation"),
    ({"input": ASK, "include": ["message.output_text.logprobs"]}, "include"),
    ({"input": ASK, "tools": [WEATHER], "tool_choice": {"type": "function", "name": "f"}},
     "tool_choice"),
    ({"input": ASK, "tools": [{**WEATHER, "parameters": {"type": "nonsense"}}]},
     "tools.0.parameters"),
    ({"input": ASK * 2000}, "input"),
    ({"input": ASK, "max_output_tokens": 10**6}, "max_output_tokens"),
    ({"input": ASK, "text": {"format": {"type": "json_schema", "name": "x",
                                        "schema": {"type": "nonsense"}}}}, "text.format"),
    ({"input": ASK, "some_field": 1}, "some_field"),
])
def test_errors_name_the_responses_field(server, body, param):
    response = httpx.post(server.url + "/v1/responses", json={"model": MODEL_NAME, **body},
                          timeout=120)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert error["message"].strip()


def test_retrieve_refuses_query_parameters(server, client):
    resp = client.responses.create(model=MODEL_NAME, input=ASK, **GREEDY)
    answer = httpx.get(f"{server.url}/v1/responses/{resp.id}", params={"stream": "true"})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "stream"


def test_store_evicts_the_oldest_past_either_bound():
    def response(i: int) -> dict:
        return {"id": f"resp_{i}", "text": "x" * 100}

    store = ResponseStore(max_entries=2)
    for i in range(3):
        store.put(response(i), [{"role": "user", "content": "hi"}])
    assert store.get("resp_0") is None and store.get("resp_1") and store.get("resp_2")
    assert store.get("resp_2").conversation == [{"role": "user", "content": "hi"}]
    by_size = ResponseStore(max_bytes=300)
    for i in range(3):
        by_size.put(response(i), [])
    assert [by_size.get(f"resp_{i}") is not None for i in range(3)] == [False, True, True]
    assert by_size.delete("resp_2") and not by_size.delete("resp_2")
    by_size.put({"id": "big", "text": "x" * 400}, [])  # larger than the whole store
    assert by_size.get("big") is None and by_size.get("resp_1") is not None


def raw_events(server, **body) -> list[dict]:
    body = {"model": MODEL_NAME, "stream": True, **body}
    with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=120) as response:
        lines = list(response.iter_lines())
    names = [line[7:] for line in lines if line.startswith("event: ")]
    data = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert names == [d["type"] for d in data]
    return data


def test_every_shape_validates_against_the_sdks_types(server):
    """Strictly, as pydantic validates (the SDK itself builds its objects leniently)."""
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    events = TypeAdapter(ResponseStreamEvent)
    for body in ({"input": ASK, **GREEDY},
                 {"input": WEATHER_ASK, "tools": [WEATHER], "tool_choice": "required",
                  "temperature": 0, "max_output_tokens": 40}):
        whole = httpx.post(server.url + "/v1/responses", json={"model": MODEL_NAME, **body},
                           timeout=120).json()
        Response.model_validate(whole, strict=False)
        for event in raw_events(server, **body):
            events.validate_python(event)
