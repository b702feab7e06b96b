"""Reasoning on the agents' APIs, on the tiny Qwen3 of test_reasoning_api.py: /v1/responses
gives the reasoning parser's split as a reasoning item and /v1/messages as a thinking block,
whole and streamed, the same text as chat completions' reasoning_content; their switches
(reasoning.effort "none", thinking disabled / enabled with a budget / display omitted)
reach the chat template and the engine as chat completions' fields do."""

from __future__ import annotations

import json

import httpx

from tests.server.test_reasoning_api import ASK, checkpoint, qwen3, r1  # noqa: F401 (fixtures)

LENGTH = 8


def post(server, path: str, **body) -> dict:
    response = httpx.post(server.url + path, json={"model": "tiny", "temperature": 0, **body},
                          timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def chat(server, **body) -> dict:
    answer = post(server, "/v1/chat/completions", **{"messages": ASK, "max_tokens": LENGTH,
                                                     **body})
    return {"message": answer["choices"][0]["message"], "usage": answer["usage"]}


def responses(server, **body) -> dict:
    return post(server, "/v1/responses", **{"input": ASK, "max_output_tokens": LENGTH, **body})


def messages(server, **body) -> dict:
    return post(server, "/v1/messages", **{"messages": ASK, "max_tokens": LENGTH, **body})


def events(server, path: str, **body) -> list[dict]:
    body = {"model": "tiny", "temperature": 0, "stream": True, **body}
    with httpx.stream("POST", server.url + path, json=body, timeout=300) as response:
        assert response.status_code == 200
        return [json.loads(line[6:]) for line in response.iter_lines()
                if line.startswith("data: ")]


def split_of_responses(output: list[dict]) -> tuple[str | None, str | None]:
    reasoning = [part["text"] for item in output if item["type"] == "reasoning"
                 for part in item["content"]]
    text = [part["text"] for item in output if item["type"] == "message"
            for part in item["content"]]
    return "".join(reasoning) or None, "".join(text) or None


def split_of_messages(content: list[dict]) -> tuple[str | None, str | None]:
    thinking = "".join(b["thinking"] for b in content if b["type"] == "thinking")
    text = "".join(b["text"] for b in content if b["type"] == "text")
    return thinking or None, text or None


SAMPLED = {"temperature": 1.0, "seed": 5}  # the random model's greedy answer is blank lines
PREFILL = ASK + [{"role": "assistant", "content": "abc"}]  # continued: greedy "cccc..."
CONTINUE = {"messages": PREFILL, "continue_final_message": True, "add_generation_prompt": False}


def test_reasoning_item_whole_and_streamed(r1):
    """The R1 parser: the output is reasoning until the model closes the block."""
    reference = chat(r1, **SAMPLED)["message"]
    assert reference["reasoning_content"]
    expected = (reference["reasoning_content"], reference["content"])
    whole = responses(r1, **SAMPLED)
    assert whole["output"][0]["type"] == "reasoning"
    assert split_of_responses(whole["output"]) == expected
    streamed = events(r1, "/v1/responses", input=ASK, max_output_tokens=LENGTH, **SAMPLED)
    added = next(e for e in streamed if e["type"] == "response.output_item.added")
    assert added["item"]["type"] == "reasoning" and added["output_index"] == 0
    deltas = "".join(e["delta"] for e in streamed if e["type"] == "response.reasoning_text.delta")
    done = next(e for e in streamed if e["type"] == "response.reasoning_text.done")
    assert deltas == done["text"] == reference["reasoning_content"]
    assert split_of_responses(streamed[-1]["response"]["output"]) == expected
    # the reasoning's tokens: the chat usage's count, whole and streamed
    counted = chat(r1, **SAMPLED)["usage"]["completion_tokens_details"]["reasoning_tokens"]
    assert 0 < counted <= whole["usage"]["output_tokens"]
    for usage in (whole["usage"], streamed[-1]["response"]["usage"]):
        assert usage["output_tokens_details"]["reasoning_tokens"] == counted


def test_thinking_block_whole_and_streamed(r1):
    reference = chat(r1, **CONTINUE)["message"]
    assert reference["reasoning_content"]
    expected = (reference["reasoning_content"], reference["content"])
    whole = messages(r1, messages=PREFILL)
    assert whole["content"][0]["type"] == "thinking"
    assert split_of_messages(whole["content"]) == expected
    streamed = events(r1, "/v1/messages", messages=PREFILL, max_tokens=LENGTH)
    start = next(e for e in streamed if e["type"] == "content_block_start")
    assert start["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    thinking = "".join(e["delta"]["thinking"] for e in streamed
                       if e["type"] == "content_block_delta"
                       and e["delta"]["type"] == "thinking_delta")
    assert thinking == reference["reasoning_content"]


def test_thinking_switches_reach_the_template(qwen3):
    """Qwen3's template closes an empty block in the prompt when thinking is off."""
    on = chat(qwen3)["usage"]["prompt_tokens"]
    off = chat(qwen3, chat_template_kwargs={"enable_thinking": False})["usage"]["prompt_tokens"]
    assert off > on
    assert responses(qwen3, reasoning={"effort": "none"})["usage"]["input_tokens"] == off
    for thinking, expected in (({"type": "disabled"}, off), ({"type": "adaptive"}, on)):
        usage = messages(qwen3, thinking=thinking)["usage"]
        assert usage["input_tokens"] + usage["cache_read_input_tokens"] == expected


def test_thinking_budget_and_display(r1):
    """A budget of 2 closes the block after two tokens; the rest is the answer."""
    reference = chat(r1, thinking_token_budget=2, **CONTINUE)["message"]
    assert reference["reasoning_content"] and reference["content"]
    budget = {"type": "enabled", "budget_tokens": 2}
    budgeted = messages(r1, messages=PREFILL, thinking=budget)
    assert split_of_messages(budgeted["content"]) == \
        (reference["reasoning_content"], reference["content"])
    # the block's tokens: two, then the end marker the budget forced (one token here)
    tokens = chat(r1, thinking_token_budget=2, **CONTINUE)["usage"]["completion_tokens_details"]
    assert tokens["reasoning_tokens"] == 3
    omitted = messages(r1, messages=PREFILL, thinking={**budget, "display": "omitted"})
    assert split_of_messages(omitted["content"]) == (None, reference["content"])
    # adaptive: no budget; the R1 block never closes here, so omitted leaves nothing
    adaptive = {"type": "adaptive"}
    assert messages(r1, messages=PREFILL, thinking=adaptive)["content"][0]["type"] == "thinking"
    hidden = messages(r1, messages=PREFILL, thinking={**adaptive, "display": "omitted"})
    assert hidden["content"] == []


def test_reasoning_sent_back_reaches_the_template(qwen3):
    """A reasoning item / thinking block sent back is its assistant turn's reasoning_content,
    which this template renders: the prompt of chat completions with that field."""
    history = [*ASK, {"role": "assistant", "content": "4"}, *ASK]
    thought = [*ASK, {"role": "assistant", "content": "4", "reasoning_content": "2 + 2"}, *ASK]
    plain = chat(qwen3, messages=history, max_tokens=1)["usage"]["prompt_tokens"]
    expected = chat(qwen3, messages=thought, max_tokens=1)["usage"]["prompt_tokens"]
    assert expected > plain
    answer = {"type": "message", "role": "assistant",
              "content": [{"type": "output_text", "text": "4"}]}
    for reasoning in ({"content": [{"type": "reasoning_text", "text": "2 + 2"}]},
                      {"summary": [{"type": "summary_text", "text": "2 + 2"}],
                       "id": "rs_1", "status": "completed"}):  # an output's echo: no effect
        item = {"type": "reasoning", "summary": [], **reasoning}
        usage = responses(qwen3, input=[*ASK, item, answer, *ASK], max_output_tokens=1)["usage"]
        assert usage["input_tokens"] == expected, reasoning
    blocks = [{"type": "thinking", "thinking": "2 + 2", "signature": "unchecked"},
              {"type": "text", "text": "4"}]
    count = httpx.post(qwen3.url + "/v1/messages/count_tokens", json={
        "model": "tiny", "messages": [*ASK, {"role": "assistant", "content": blocks}, *ASK]},
        timeout=60).json()
    assert count["input_tokens"] == expected
