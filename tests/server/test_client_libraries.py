"""Agent and client libraries against a live server on the default model, as their users
call them: LangChain's ChatOpenAI (invoke, stream, batch, structured output by JSON schema
and by a forced function call, a tool call bound to a function) and pydantic-ai's Agent
(text, structured output through its output tool and through native JSON schema). A
grammar holds each structured answer, so even a small model's answer validates.

litellm and instructor are not among them (why: the `clients` extra in pyproject.toml)."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import langchain_openai
import pydantic_ai
import pytest
from pydantic import BaseModel
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

QUESTION = "Is the sky blue? Answer in one word."


class Verdict(BaseModel):
    answer: Literal["yes", "no"]
    sure: bool


class Weather(BaseModel):
    """Get the weather in a city."""

    city: Literal["Paris", "Rome"]


@pytest.fixture(scope="module")
def model_name(server) -> str:
    return httpx.get(server.url + "/v1/models", timeout=60).json()["data"][0]["id"]


def langchain_model(server, model_name: str, max_tokens: int):
    return langchain_openai.ChatOpenAI(base_url=server.base_url, api_key="unused",
                                       model=model_name, temperature=0, max_tokens=max_tokens,
                                       max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def chat_model(server, model_name):
    return langchain_model(server, model_name, 12)


@pytest.fixture(scope="module")
def json_model(server, model_name):
    """Room for a whole JSON answer."""
    return langchain_model(server, model_name, 64)


@pytest.fixture(scope="module")
def agent_model(server, model_name):
    return OpenAIChatModel(model_name, provider=OpenAIProvider(base_url=server.base_url,
                                                               api_key="unused"))


def test_langchain_invoke_stream_batch(chat_model):
    answer = chat_model.invoke(QUESTION)
    assert isinstance(answer.content, str) and answer.content
    assert answer.response_metadata["finish_reason"] in ("stop", "length")
    assert answer.usage_metadata["output_tokens"] >= 1
    streamed = "".join(chunk.content for chunk in chat_model.stream(QUESTION))
    assert streamed == answer.content  # greedy: the same answer in pieces
    assert [m.content for m in chat_model.batch([QUESTION, QUESTION])] == [answer.content] * 2


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_structured_output(json_model, method):
    structured = json_model.with_structured_output(Verdict, method=method)
    verdict = structured.invoke(QUESTION)
    assert isinstance(verdict, Verdict)


def test_langchain_tool_call(json_model):
    bound = json_model.bind_tools([Weather], tool_choice="Weather")
    message = bound.invoke("What is the weather in Paris?")
    [call] = message.tool_calls
    assert call["name"] == "Weather"
    Weather.model_validate(call["args"])


def test_pydantic_ai_text(agent_model):
    agent = pydantic_ai.Agent(agent_model, model_settings={"max_tokens": 12,
                                                           "temperature": 0})
    result = agent.run_sync(QUESTION)
    assert isinstance(result.output, str) and result.output
    assert result.usage.output_tokens >= 1


@pytest.mark.parametrize("mode", ["tool", "native"])
def test_pydantic_ai_structured_output(agent_model, mode):
    output = Verdict if mode == "tool" else pydantic_ai.NativeOutput(Verdict)
    agent = pydantic_ai.Agent(agent_model, output_type=output,
                              model_settings={"max_tokens": 200, "temperature": 0})
    result = agent.run_sync(QUESTION)
    assert isinstance(result.output, Verdict)
    json.dumps(result.output.model_dump())
