"""Each tool-call format on outputs as the models write them, whole and streamed (a call goes
out only once its text is complete, and the stream adds up to the whole parse), and the
format picked from the chat template of every family we serve (never a guess)."""

from __future__ import annotations

import json
import logging

import pytest

from pagedserve.entrypoints.server.tool_parsers import (ToolCallStream, needs_special_tokens,
                                                        parse_tool_calls, parser_for_template)

WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"},
        "units": {"type": ["string", "null"]}, "detailed": {"type": "boolean"}}}}}]

# (parser, output text, expected content, expected [(name, arguments)])
RECORDED = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
     '{"city": "Paris"}}\n</tool_call>', "Let me check.", [("get_weather", {"city": "Paris"})]),
    ("hermes", "No tools needed: it is <b>sunny</b>.", "No tools needed: it is <b>sunny</b>.",
     []),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
     None, [("get_weather", {"city": "Paris"})]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
     '{"name": "get_weather", "parameters": {"city": "Rome"}}', None,
     [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]),
    # Mistral 7B v0.3: a JSON list after [TOOL_CALLS]
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", '
     '"days": 3}}, {"name": "get_weather", "arguments": {"city": "Rome"}}]', None,
     [("get_weather", {"city": "Paris", "days": 3}), ("get_weather", {"city": "Rome"})]),
    # Mistral Small 3.2 / Magistral: name[ARGS]{...} per call
    ("mistral", 'Checking both.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
     '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome", "days": 2}', "Checking both.",
     [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome", "days": 2})]),
    ("mistral", '[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Oslo"}', None,
     [("get_weather", {"city": "Oslo"})]),
    # special tokens decoded with spaces around them (spaces_between_special_tokens)
    ("mistral", '[TOOL_CALLS] get_weather [ARGS] {"city": "Paris"}', None,
     [("get_weather", {"city": "Paris"})]),
    ("mistral", "Just text, [no calls].", "Just text, [no calls].", []),
    # Qwen3-Coder: XML, values typed by the tool's schema
    ("qwen3_coder", "I'll look it up.\n<tool_call>\n<function=get_weather>\n"
     "<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
     "<parameter=units>\nnull\n</parameter>\n<parameter=detailed>\ntrue\n</parameter>\n"
     "</function>\n</tool_call>", "I'll look it up.",
     [("get_weather", {"city": "New York", "days": 3, "units": "null", "detailed": True})]),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
     "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n"
     "<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>", None,
     [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]),
    # Llama 3.2 / 4 pythonic
    ("pythonic", '[get_weather(city="Paris", days=3), get_weather(city=\'Rome\', '
     'detailed=True)]', None,
     [("get_weather", {"city": "Paris", "days": 3}),
      ("get_weather", {"city": "Rome", "detailed": True})]),
    ("pythonic", '<|python_start|>[get_weather(city="Paris")]<|python_end|>', None,
     [("get_weather", {"city": "Paris"})]),
    ("pythonic", "[1] is a footnote, not a call.", "[1] is a footnote, not a call.", []),
    ("pythonic", "Sunny in Paris.", "Sunny in Paris.", []),
]


def calls_of(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("parser, text, content, calls", RECORDED)
def test_whole_output(parser, text, content, calls):
    got_content, got_calls = parse_tool_calls(parser, text, WEATHER)
    assert got_content == content
    assert calls_of(got_calls) == calls


@pytest.mark.parametrize("step", [1, 7, 10_000])
@pytest.mark.parametrize("parser, text, content, calls", RECORDED)
def test_streamed_output(parser, text, content, calls, step):
    """Fed `step` characters at a time: each call goes out once its text is complete (the
    text so far, finished there, already holds it), and the stream adds up to the whole."""
    stream, streamed, emitted = ToolCallStream(parser, WEATHER), "", []
    for end in range(step, len(text) + step, step):
        prefix = text[:end]
        delta, new = stream.feed(prefix) if end < len(text) else stream.finish(prefix)
        streamed += delta
        for call in new:
            assert (call.name, call.arguments) in \
                [(c.name, c.arguments) for c in parse_tool_calls(parser, prefix, WEATHER)[1]]
        emitted += new
    assert (streamed.strip() or None) == content
    assert calls_of(emitted) == calls


def test_unfinished_call_is_content_at_the_end():
    text = '[TOOL_CALLS]get_weather[ARGS]{"city": "Par'
    assert parse_tool_calls("mistral", text) == (text, [])
    stream = ToolCallStream("hermes")
    assert stream.feed("Hi <tool_call>{") == ("Hi ", [])
    assert stream.finish("Hi <tool_call>{") == ("<tool_call>{", [])


def test_only_mistral_needs_special_tokens():
    assert needs_special_tokens("mistral")
    assert not any(map(needs_special_tokens, ["hermes", "llama3_json", "qwen3_coder",
                                              "pythonic", None]))


# The tool-relevant parts of the chat templates of the families we serve (as their
# tokenizer_config.json has them), and of vLLM's Llama 3.2 pythonic template.
TEMPLATES = {
    "llama3.1": ("{%- if tools is not none %}{%- set tools_in_user_message = true %}{% endif %}"
                 "<|start_header_id|>ipython<|end_header_id|>\n"
                 "{{- '<|python_tag|>' + tool_call.name }}"
                 '{{- \'"parameters": \' }}{{- tool_call.arguments | tojson }}'),
    "llama3.2": ('{%- if tools is not none %}Respond in the format {"name": function name, '
                 '"parameters": dictionary of argument name and its value}.{% endif %}'
                 "{%- if message.role == 'ipython' %}<|start_header_id|>ipython"
                 "<|end_header_id|>{% endif %}"),
    "llama3.2-pythonic": ("{%- if tools %}If you decide to invoke any of the function(s), you "
                          "MUST put it in the format of [func_name1(params_name1=params_value1,"
                          " params_name2=params_value2...), func_name2(params)]{% endif %}"
                          "{%- if message.role == 'ipython' %}<|start_header_id|>ipython"
                          '<|end_header_id|>{{ {"parameters": 1} | tojson }}{% endif %}'),
    "smollm2": ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
                "{{ message['content'] }}<|im_end|>\n{% endfor %}"),
    "mistral-v0.3": ("{%- if tools is not none %}[AVAILABLE_TOOLS] {{ tools | tojson }}"
                     "[/AVAILABLE_TOOLS]{% endif %}{%- if message.tool_calls %}[TOOL_CALLS] "
                     "{{ message.tool_calls | tojson }}{% endif %}[TOOL_RESULTS]"),
    "mixtral-8x7b": ("{{ bos_token }}{% for message in messages %}{% if message['role'] == "
                     "'user' %}[INST] {{ message['content'] }} [/INST]{% else %}"
                     "{{ message['content'] }}{{ eos_token }}{% endif %}{% endfor %}"),
    "qwen2.5": ("{%- if tools %}<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}"
                "</tools>\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
                "<args-json-object>}\n</tool_call>{% endif %}"),
    "qwen3": ("{%- if tools %}<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}"
              "</tools><tool_call>{% endif %}<think>\n\n</think>\n\n"),
    "qwen3-coder": ("{%- if tools %}<tools>{% for tool in tools %}<function><name>"
                    "{{ tool.name }}</name></function>{% endfor %}</tools>\n<tool_call>\n"
                    "<function=example_function_name>\n<parameter=example_parameter_1>\n"
                    "value_1\n</parameter>\n</function>\n</tool_call>{% endif %}"),
    "phi3": ("{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}"
             "<|end|>\n{% endfor %}<|assistant|>\n"),
    "gemma2": ("{% for message in messages %}<start_of_turn>{{ message['role'] }}\n"
               "{{ message['content'] | trim }}<end_of_turn>\n{% endfor %}"),
    "gemma3": ("{%- for message in messages -%}<start_of_turn>{{ message['role'] }}\n"
               "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
               "{%- endif -%}<end_of_turn>\n{%- endfor -%}"),
}
EXPECTED = {"llama3.1": "llama3_json", "llama3.2": "llama3_json",
            "llama3.2-pythonic": "pythonic", "smollm2": "hermes", "mistral-v0.3": "mistral",
            "mixtral-8x7b": "hermes", "qwen2.5": "hermes", "qwen3": "hermes",
            "qwen3-coder": "qwen3_coder", "phi3": "hermes", "gemma2": "hermes",
            "gemma3": "hermes"}


@pytest.mark.parametrize("family", sorted(TEMPLATES))
def test_format_from_each_familys_template(family):
    """Templates without tools get hermes: the server's fallback prompt teaches it."""
    assert parser_for_template(TEMPLATES[family]) == EXPECTED[family]


@pytest.mark.parametrize("template", [
    "{% if tools %}Tools: {{ tools | tojson }}{% endif %}",  # no known format
    "{% if tools %}[TOOL_CALLS] or <tool_call>{% endif %}",  # two of them
])
def test_an_ambiguous_template_is_not_guessed(template, caplog):
    with caplog.at_level(logging.WARNING):
        assert parser_for_template(template) is None
    assert "--tool-call-parser" in caplog.text
