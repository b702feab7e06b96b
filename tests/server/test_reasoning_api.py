"""Reasoning models over HTTP, on a tiny Qwen3 (random weights, a byte-level tokenizer with
`<think>` / `</think>` / `<tool_call>` tokens, a Qwen3-style chat template): the reasoning
split whole and streamed, with and without a tool call after it; `enable_thinking: false`
changes the prompt; the thinking budget closes the block. A random model does not think on
its own, so the output is held to a think block by a regex (structured outputs, on a prompt
without the generation prompt, which the server leaves as it is: on a thinking prompt it
would open the block and start the grammar after it) or by allowed_token_ids and logit_bias.
A second server takes the flags: --chat-template,
--reasoning-parser deepseek_r1, --default-chat-template-kwargs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import openai
import pytest

from benchmarks.make_checkpoint import byte_level_tokenizer
from pagedserve.entrypoints.cli import build_parser
from pagedserve.entrypoints.server.options import serve_settings
from tests.server.conftest import start_server, stop_server

THINK_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
QWEN3_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for tool in tools %}\n"
    "{{ tool | tojson }}{% endfor %}\n</tools>\nFor each function call, return a json object "
    "with function name and arguments within <tool_call></tool_call> XML tags.<|im_end|>\n"
    "{%- endif %}"
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n"
    "{%- if message.reasoning_content %}<think>\n{{ message.reasoning_content }}\n</think>\n\n"
    "{%- endif %}{{ message.content }}"
    "{%- if message.tool_calls %}{% for call in message.tool_calls %}\n<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}'
    "\n</tool_call>{% endfor %}{% endif %}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "<think>\n\n</think>\n\n{% endif %}{%- endif %}")
# DeepSeek-R1's shape: the generation prompt opens the block; a variable from the server's
# --default-chat-template-kwargs
R1_TEMPLATE = ("{{ persona }}{% for m in messages %}<｜User｜>{{ m.content }}{% endfor %}"
               "{% if add_generation_prompt %}<｜Assistant｜><think>\n{% endif %}")
CONFIG = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "bos_token_id": 0,
          "eos_token_id": 2, "head_dim": 16, "hidden_size": 64, "intermediate_size": 128,
          "max_position_embeddings": 1024, "num_attention_heads": 4, "num_hidden_layers": 2,
          "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
          "tie_word_embeddings": True, "torch_dtype": "float32", "vocab_size": 320}
WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object",
                                          "properties": {"city": {"type": "string"}}}}}]
ASK = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-qwen3-think")
    (folder / "config.json").write_text(json.dumps(CONFIG))
    tokenizer = byte_level_tokenizer()
    tokenizer.add_tokens(THINK_TOKENS)  # not special: the text keeps them, as Qwen3's does
    tokenizer.add_tokens(["[TOOL_CALLS]"], special_tokens=True)  # special, as Mistral's is
    tokenizer.chat_template = QWEN3_TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def qwen3(checkpoint):
    srv = start_server("--model", str(checkpoint), "--load-format", "dummy",
                       "--served-model-name", "tiny")
    yield srv
    stop_server(srv)


def chat(server, **body) -> dict:
    body = {"model": "tiny", "messages": ASK, "temperature": 0, "max_tokens": 96, **body}
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def refusal(server, **body) -> dict:
    body = {"model": "tiny", "messages": ASK, "max_tokens": 4, **body}
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=300)
    assert response.status_code == 400, response.text
    return response.json()["error"]


def streamed(server, **body) -> dict:
    """The stream's deltas joined per field: reasoning, content, tool calls, finish reason."""
    body = {"model": "tiny", "messages": ASK, "temperature": 0, "max_tokens": 96,
            "stream": True, **body}
    joined = {"reasoning_content": "", "reasoning": "", "content": "", "tool_calls": {},
              "finish_reason": None}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body,
                      timeout=300) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            delta = choice["delta"]
            for key in ("reasoning_content", "reasoning", "content"):
                joined[key] += delta.get(key) or ""
            for call in delta.get("tool_calls") or []:
                entry = joined["tool_calls"].setdefault(call["index"], {"name": "",
                                                                        "arguments": ""})
                entry["name"] += call["function"].get("name") or ""
                entry["arguments"] += call["function"].get("arguments") or ""
            joined["finish_reason"] = choice["finish_reason"] or joined["finish_reason"]
    return joined


def regex(text: str) -> dict:
    """Structured outputs that hold the whole output to exactly `text` (think block included:
    no generation prompt, so the server opens no block)."""
    escaped = re.sub(r"([\\.^$|?*+()\[\]{}])", r"\\\1", text).replace("\n", "\\n")
    return {"structured_outputs": {"regex": escaped}, "max_tokens": len(text) + 8,
            "add_generation_prompt": False}


def test_reasoning_split_whole_and_streamed(qwen3):
    """The parser is picked from the template (no flag): Qwen3's."""
    held = regex("<think>plan a b</think>\n\nthe answer")
    message = chat(qwen3, **held)["choices"][0]["message"]
    assert message["reasoning_content"] == message["reasoning"] == "plan a b"
    assert message["content"] == "the answer"
    parts = streamed(qwen3, **held)
    assert parts["reasoning_content"] == parts["reasoning"] == "plan a b"
    assert parts["content"] == "the answer"
    hidden = chat(qwen3, include_reasoning=False, **held)["choices"][0]["message"]
    assert hidden["reasoning_content"] is None and hidden["content"] == "the answer"


def test_tool_call_after_the_reasoning(qwen3):
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    held = regex("<think>need the weather</think>\n" + call)
    choice = chat(qwen3, tools=WEATHER, **held)["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["reasoning_content"] == "need the weather"
    assert choice["message"]["content"] is None
    [tool_call] = choice["message"]["tool_calls"]
    assert tool_call["function"]["name"] == "get_weather"
    assert json.loads(tool_call["function"]["arguments"]) == {"city": "Paris"}
    parts = streamed(qwen3, tools=WEATHER, **held)
    assert parts["reasoning_content"] == "need the weather" and parts["content"] == ""
    assert parts["finish_reason"] == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in parts["tool_calls"].values()] \
        == [("get_weather", {"city": "Paris"})]


def test_parallel_tool_calls_false_keeps_one_call(qwen3):
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "%s"}}\n</tool_call>'
    held = regex(call % "Paris" + "\n" + call % "Rome")
    both = chat(qwen3, tools=WEATHER, **held)["choices"][0]["message"]["tool_calls"]
    assert len(both) == 2
    one = chat(qwen3, tools=WEATHER, parallel_tool_calls=False, **held)
    assert [json.loads(c["function"]["arguments"])["city"]
            for c in one["choices"][0]["message"]["tool_calls"]] == ["Paris"]
    parts = streamed(qwen3, tools=WEATHER, parallel_tool_calls=False, **held)
    assert [json.loads(c["arguments"])["city"] for c in parts["tool_calls"].values()] == ["Paris"]


def tokenize(server, **body) -> list[int]:
    response = httpx.post(server.url + "/tokenize", json={"messages": ASK, **body}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


def detokenize(server, tokens: list[int]) -> str:
    return httpx.post(server.url + "/detokenize", json={"tokens": tokens}).json()["prompt"]


def test_enable_thinking_false_changes_the_prompt(qwen3):
    thinking = tokenize(qwen3)
    plain = tokenize(qwen3, chat_template_kwargs={"enable_thinking": False})
    assert plain[:len(thinking)] == thinking
    assert detokenize(qwen3, plain[len(thinking):]) == "<think>\n\n</think>\n\n"
    on = chat(qwen3, max_tokens=1)["usage"]["prompt_tokens"]
    off = chat(qwen3, max_tokens=1, chat_template_kwargs={"enable_thinking": False})
    assert off["usage"]["prompt_tokens"] == on + len(plain) - len(thinking)
    error = refusal(qwen3, chat_template_kwargs={"add_generation_prompt": False})
    assert error["param"] == "chat_template_kwargs"


def test_reasoning_sent_back_reaches_the_template(qwen3):
    """An assistant message as a response gave it (reasoning_content, or vLLM's newer
    `reasoning`, even null) is taken back, and the template renders its reasoning."""
    turn = {"role": "assistant", "content": "4"}
    plain = detokenize(qwen3, tokenize(qwen3, messages=[*ASK, turn]))
    for name in ("reasoning_content", "reasoning"):
        with_thought = detokenize(qwen3, tokenize(qwen3, messages=[*ASK, {**turn,
                                                                        name: "2 + 2"}]))
        assert "<think>" not in plain
        assert with_thought.replace("<think>\n2 + 2\n</think>", "") == plain
    echoed = chat(qwen3, max_tokens=2, messages=[*ASK, {**turn, "reasoning_content": None,
                                                        "reasoning": None}, *ASK])
    assert echoed["choices"][0]["finish_reason"] == "length"


def test_thinking_budget_closes_the_block(qwen3):
    """The prompt opens the block (continue_final_message after `<think>`); the model may
    write only `a` (its `</think>` is pushed far down), so the block closes only when the
    budget forces it."""
    a, end = (tokenize(qwen3, messages=[{"role": "user", "content": c}],
                       add_generation_prompt=False)[-2] for c in ("a", "</think>"))
    body = dict(messages=[*ASK, {"role": "assistant", "content": "<think>\n"}],
                continue_final_message=True, add_generation_prompt=False,
                allowed_token_ids=[a, end], logit_bias={str(end): -100}, max_tokens=10,
                ignore_eos=True)
    free = chat(qwen3, **body)["choices"][0]["message"]
    assert free["reasoning_content"] == "a" * 10 and free["content"] is None
    budgeted = chat(qwen3, thinking_token_budget=4, **body)["choices"][0]["message"]
    assert budgeted["reasoning_content"] == "a" * 4 and budgeted["content"] == "a" * 5
    parts = streamed(qwen3, thinking_token_budget=4, **body)
    assert parts["reasoning_content"] == "a" * 4 and parts["content"] == "a" * 5


def test_thinking_budget_refusals(qwen3):
    """A grammar from the first token (thinking off: the block closed in the prompt) leaves
    no block for a budget."""
    error = refusal(qwen3, thinking_token_budget=3, response_format={"type": "json_object"},
                    chat_template_kwargs={"enable_thinking": False})
    assert error["param"] == "thinking_token_budget"
    assert refusal(qwen3, thinking_token_budget=-1)["param"] == "thinking_token_budget"


@pytest.fixture(scope="module")
def r1(checkpoint, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "r1.jinja"
    template.write_text(R1_TEMPLATE)
    srv = start_server("--model", str(checkpoint), "--load-format", "dummy",
                       "--served-model-name", "tiny", "--chat-template", str(template),
                       "--reasoning-parser", "deepseek_r1", "--tool-call-parser", "mistral",
                       "--default-chat-template-kwargs", '{"persona": "pirate"}')
    yield srv
    stop_server(srv)


def test_flags_template_parser_and_default_kwargs(r1, qwen3):
    prompt = detokenize(r1, tokenize(r1))
    assert prompt == "pirate<｜User｜>hi<｜Assistant｜><think>\n"
    assert detokenize(r1, tokenize(r1, chat_template_kwargs={"persona": "cat"})).startswith("cat")
    a = tokenize(qwen3, messages=[{"role": "user", "content": "a"}],
                 add_generation_prompt=False)[-2]
    # the prompt opened the block, which the output never closes: all of it is reasoning
    message = chat(r1, allowed_token_ids=[a], max_tokens=3)["choices"][0]["message"]
    assert message["reasoning_content"] == "aaa" and message["content"] is None


def test_openai_sdk_reads_the_reasoning(qwen3):
    """The fields reach an OpenAI client as the extras it keeps (vLLM's names)."""
    client = openai.OpenAI(base_url=qwen3.base_url, api_key="unused", max_retries=0,
                           timeout=300)
    held = regex("<think>hm</think>ok")
    answer = client.chat.completions.create(model="tiny", messages=ASK, temperature=0,
                                            max_tokens=held.pop("max_tokens"), extra_body=held)
    assert answer.choices[0].message.reasoning_content == "hm"
    assert answer.choices[0].message.content == "ok"
    chunks = client.chat.completions.create(model="tiny", messages=ASK, temperature=0,
                                            max_tokens=32, extra_body=held, stream=True)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "hm"
    assert "".join(d.content or "" for d in deltas) == "ok"


def test_mistral_markers_survive_the_decode(r1):
    """[TOOL_CALLS] is a special token: a chat with tools under the mistral parser keeps
    special tokens in its text (else the call's marker would vanish), unless the request
    says otherwise."""
    marker = tokenize(r1, messages=[{"role": "user", "content": "[TOOL_CALLS]"}],
                      add_generation_prompt=False)[-1]
    body = dict(allowed_token_ids=[marker], max_tokens=1, ignore_eos=True)

    def content(**extra) -> str | None:
        message = chat(r1, **body, **extra)["choices"][0]["message"]
        return message["content"] or message["reasoning_content"]

    assert content(tools=WEATHER) == "[TOOL_CALLS]"
    assert content() is None
    assert content(tools=WEATHER, skip_special_tokens=True) is None


@pytest.mark.parametrize("value, message", [("[1]", "JSON object"), ("{bad", "not JSON"),
                                            ('{"tools": []}', "may not set tools")])
def test_bad_default_template_kwargs_are_argparse_errors(value, message, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser(["serve"]).parse_args(["serve", "--default-chat-template-kwargs", value])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_chat_template_flag_reads_a_file_or_takes_the_text(tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text(R1_TEMPLATE)
    for given in (str(template), R1_TEMPLATE):
        args = build_parser(["serve"]).parse_args(["serve", "--chat-template", given])
        assert serve_settings(args).chat_template == R1_TEMPLATE
    args = build_parser(["serve"]).parse_args(["serve", "--chat-template", str(tmp_path / "no")])
    with pytest.raises(ValueError, match="--chat-template"):
        serve_settings(args)
