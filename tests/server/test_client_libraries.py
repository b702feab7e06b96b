"""Agent and client libraries against a live server on the default model, as their users
call them: LangChain's ChatOpenAI (invoke, stream, batch, structured output by JSON schema
and by a forced function call, a tool call bound to a function) and pydantic-ai's Agent
(text, structured output through its output tool and through native JSON schema),
instructor in TOOLS mode (a forced function call read back as the model), and litellm
through its `openai/` provider (completion, stream, a tool call). A grammar holds each
structured answer, so even a small model's answer validates.

instructor is installed without its dependencies (it pins a jiter older than the openai SDK
needs; what it imports is here anyway; the Makefile says how). litellm is not installed by
`make test` (a 240 MB install that downgrades python-dateutil): its test runs where it is
installed (`pip install -e .[litellm]`) and is skipped elsewhere."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import instructor
import langchain_openai
import openai
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


def test_instructor_tools_mode(server, model_name):
    client = instructor.from_openai(openai.OpenAI(base_url=server.base_url, api_key="unused",
                                                  max_retries=0, timeout=300),
                                    mode=instructor.Mode.TOOLS)
    verdict, completion = client.chat.completions.create_with_completion(
        model=model_name, response_model=Verdict, max_retries=1, max_tokens=64,
        temperature=0, messages=[{"role": "user", "content": QUESTION}])
    assert isinstance(verdict, Verdict)
    [call] = completion.choices[0].message.tool_calls
    assert call.function.name == "Verdict"


@pytest.fixture(scope="module")
def litellm():
    """litellm, kept from fetching its model cost map over the network as it loads."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
        return pytest.importorskip("litellm")


def test_litellm_completion_stream_and_tool_call(litellm, server, model_name):
    common = dict(model="openai/" + model_name, api_base=server.base_url, api_key="unused",
                  temperature=0, num_retries=0, timeout=300)
    ask = [{"role": "user", "content": QUESTION}]
    answer = litellm.completion(messages=ask, max_tokens=12, **common)
    text = answer.choices[0].message.content
    assert text and answer.usage.completion_tokens >= 1
    chunks = litellm.completion(messages=ask, max_tokens=12, stream=True, **common)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    weather = {"type": "function", "function": {"name": "Weather",
                                                "parameters": Weather.model_json_schema()}}
    called = litellm.completion(
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[weather], tool_choice={"type": "function", "function": {"name": "Weather"}},
        max_tokens=64, **common)
    [call] = called.choices[0].message.tool_calls
    assert call.function.name == "Weather"
    Weather.model_validate_json(call.function.arguments)
