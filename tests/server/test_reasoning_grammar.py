"""Structured outputs and forced tool calls on a reasoning model, with Qwen3's own hybrid chat
template (tests/server/data/, from Qwen3's tokenizer_config.json) on the tiny Qwen3 of
test_reasoning_api.py. With thinking on, the template leaves the think block to the model;
the server opens it in the prompt and the grammar holds only after `</think>` (as vLLM's),
whole and streamed, with a forced tool call after the reasoning too; with thinking off the
template closes an empty block and the grammar holds from the first token. Both on a
synchronous server with the matchers on threads and on an async-scheduling one with the
grammar process. A random model does not think on its own: a thinking budget closes the
block after `a`s (logit_bias pushes `</think>` down and `a` up), or a bias makes `</think>`
its first token, which a grammar from the first token would have refused."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from tests.server.conftest import start_server, stop_server
from tests.server.test_reasoning_api import (  # noqa: F401 (fixture)
    ASK, checkpoint, chat, detokenize, refusal, streamed, tokenize)

QWEN3_TEMPLATE = Path(__file__).parent / "data" / "qwen3_chat_template.jinja"
THINKING_OFF = {"chat_template_kwargs": {"enable_thinking": False}}
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "size": {"enum": ["small", "large"]}},
          "required": ["ok", "size"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
        "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}}]


@pytest.fixture(scope="module", params=["sync", "async+grammar-process"])
def server(request, checkpoint):
    flags = ([] if request.param == "sync"
             else ["--async-scheduling", "--grammar-process"])
    srv = start_server("--model", str(checkpoint), "--load-format", "dummy",
                       "--served-model-name", "tiny", "--chat-template", str(QWEN3_TEMPLATE),
                       *flags)
    yield srv
    stop_server(srv)


def ids(server, text: str) -> int:
    response = httpx.post(server.url + "/tokenize", json={"prompt": text,
                                                          "add_special_tokens": False})
    [token_id] = response.json()["tokens"]
    return token_id


def budgeted(server, budget: int = 3) -> dict:
    """A think block of `budget` a's, closed by the thinking budget."""
    a, end = ids(server, "a"), ids(server, "</think>")
    return {"thinking_token_budget": budget,
            "logit_bias": {str(a): 100, str(end): -100}}


def test_the_template_leaves_the_block_to_the_model(server):
    """Thinking on: the prompt ends with the assistant's header; off: with a closed block."""
    assert detokenize(server, tokenize(server)).endswith("<|im_start|>assistant\n")
    off = detokenize(server, tokenize(server, **THINKING_OFF))
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_json_schema_after_the_think_block(server):
    body = {**budgeted(server), "response_format": FORMAT, "max_tokens": 80}
    whole = chat(server, **body)
    # the server opened the block in the prompt: `<think>` and a newline
    assert whole["usage"]["prompt_tokens"] == len(tokenize(server)) + 2
    message = whole["choices"][0]["message"]
    assert message["reasoning_content"] == "aaa"
    jsonschema.validate(json.loads(message["content"]), SCHEMA)
    assert whole["choices"][0]["finish_reason"] == "stop"
    assert whole["usage"]["completion_tokens_details"]["reasoning_tokens"] == 4  # + </think>
    parts = streamed(server, **body)
    assert parts["reasoning_content"] == "aaa" and parts["content"] == message["content"]


def test_the_grammar_waits_for_the_models_own_end(server):
    """No budget: the model closes the block itself, with its first token."""
    end = ids(server, "</think>")
    answer = chat(server, response_format=FORMAT, max_tokens=80, logprobs=True,
                  logit_bias={str(end): 100})
    choice = answer["choices"][0]
    assert choice["logprobs"]["content"][0]["token"] == "</think>"
    assert choice["message"]["reasoning_content"] is None
    jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)


@pytest.mark.parametrize("tool_choice", [
    "required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_call_after_the_think_block(server, tool_choice):
    # one call: the template's tool prompt fills half the tiny model's context
    body = {**budgeted(server), "tools": TOOLS, "tool_choice": tool_choice,
            "parallel_tool_calls": False, "max_tokens": 400}
    choice = chat(server, **body)["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["reasoning_content"] == "aaa" and message["content"] is None
    calls = message["tool_calls"]
    assert calls and all(c["function"]["name"] == "get_weather" for c in calls)
    for call in calls:
        jsonschema.validate(json.loads(call["function"]["arguments"]), CITY)
    parts = streamed(server, **body)
    assert parts["reasoning_content"] == "aaa" and parts["content"] == ""
    assert [c["arguments"] for c in parts["tool_calls"].values()] == \
        [c["function"]["arguments"] for c in calls]


def test_openai_sdk_parses_the_answer_after_thinking(server):
    """The SDK's structured-output helper reads the content; the reasoning is its extra."""
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0,
                           timeout=300)
    extra = budgeted(server)
    answer = client.chat.completions.create(model="tiny", messages=ASK, temperature=0,
                                            max_tokens=80, response_format=FORMAT,
                                            extra_body=extra)
    assert answer.choices[0].message.reasoning_content == "aaa"
    jsonschema.validate(json.loads(answer.choices[0].message.content), SCHEMA)


def test_thinking_off_grammar_from_the_first_token(server):
    """The prompt closed an empty block: no reasoning, the grammar holds from the first token
    (the bias toward `</think>` cannot reach it), and a budget, which would be ignored, is
    refused."""
    end = ids(server, "</think>")
    answer = chat(server, **THINKING_OFF, response_format=FORMAT, max_tokens=80,
                  logprobs=True, logit_bias={str(end): 100})
    choice = answer["choices"][0]
    assert choice["logprobs"]["content"][0]["token"] != "</think>"
    assert choice["message"]["reasoning_content"] is None
    jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
    assert answer["usage"]["prompt_tokens"] == len(tokenize(server, **THINKING_OFF))
    error = refusal(server, **THINKING_OFF, thinking_token_budget=3, response_format=FORMAT)
    assert error["param"] == "thinking_token_budget"


def test_the_agent_apis_format_after_thinking(server):
    """/v1/messages with thinking on (its budget closes the block) and output_config.format:
    the text block is the JSON; /v1/responses with reasoning effort "none" (thinking off)
    and text.format: the JSON from the first token, no reasoning item."""
    thinking = {"type": "enabled", "budget_tokens": 3}
    message = httpx.post(server.url + "/v1/messages", timeout=300, json={
        "model": "tiny", "max_tokens": 80, "temperature": 0, "messages": ASK,
        "thinking": thinking, "output_config": {"format": {"type": "json_schema",
                                                           "schema": SCHEMA}}}).json()
    [text] = [b["text"] for b in message["content"] if b["type"] == "text"]
    jsonschema.validate(json.loads(text), SCHEMA)
    assert message["stop_reason"] == "end_turn"
    response = httpx.post(server.url + "/v1/responses", timeout=300, json={
        "model": "tiny", "max_output_tokens": 80, "temperature": 0, "input": ASK,
        "reasoning": {"effort": "none"},
        "text": {"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA}}}).json()
    assert [item["type"] for item in response["output"]] == ["message"]
    jsonschema.validate(json.loads(response["output"][0]["content"][0]["text"]), SCHEMA)
