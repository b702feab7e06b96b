"""Every request field is honored or refused (issue 29).

`test_every_field_is_honored_accepted_or_refused` walks every field of every request model
(the bodies and the parts inside them) and fails on a field that is in none of three tables:
HONORED (with the test that checks its effect on a live server: here for the extensions,
elsewhere for OpenAI's own fields), ACCEPTED (no effect on the output, by design: they route,
bill or monitor on OpenAI's side) and REFUSED (a value that asks for what the server lacks,
checked to give a 400 naming the field). A field added to the protocol without a decision
fails here. Unknown fields are refused too.
"""

from __future__ import annotations

import importlib
import json
import re

import httpx
import jsonschema
import pytest
from pydantic import BaseModel

from pagedserve.entrypoints.server import messages_protocol, protocol, responses_protocol
from pagedserve.model.loader import default_model_path, load_tokenizer
from tests.server.conftest import MODEL_NAME

SAY = [{"role": "user", "content": "Name a color."}]
PROMPT = "The capital of France is"
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "pattern": "^[A-Za-z ]{1,12}$"},
                         "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"]}


def post(server, route: str, **body) -> httpx.Response:
    if route == "chat":
        body.setdefault("messages", SAY)
        path = "/v1/chat/completions"
    elif route == "responses":
        body.setdefault("input", SAY)
        body.setdefault("max_output_tokens", body.pop("max_tokens", 16))
        path = "/v1/responses"
    elif route == "messages":
        body.setdefault("messages", SAY)
        body.setdefault("max_tokens", 16)
        path = "/v1/messages"
    else:
        body.setdefault("prompt", PROMPT)
        path = "/v1/completions"
    return httpx.post(server.url + path, json={"model": MODEL_NAME, **body}, timeout=300)


def ok(server, route: str = "completions", **body) -> dict:
    response = post(server, route, **body)
    assert response.status_code == 200, response.text
    return response.json()


def text(server, route: str = "completions", **body) -> str:
    choice = ok(server, route, **body)["choices"][0]
    return choice["message"]["content"] if route == "chat" else choice["text"]


def greedy(server, route: str = "completions", **body) -> str:
    body = {"temperature": 0, "max_tokens": 12, "ignore_eos": True, **body}
    return text(server, route, **body)


def token_strings(server, text_: str) -> list[str]:
    ids = httpx.post(server.url + "/tokenize", json={"prompt": text_,
                                                     "add_special_tokens": False}).json()
    return [httpx.post(server.url + "/detokenize", json={"tokens": [t]}).json()["prompt"]
            for t in ids["tokens"]]


def token_ids(server, text_: str) -> list[int]:
    return httpx.post(server.url + "/tokenize", json={"prompt": text_,
                                                      "add_special_tokens": False}
                      ).json()["tokens"]


def output_tokens(server, **body) -> list[str]:
    """The output's tokens as strings (completions' logprobs name each one)."""
    body = {"temperature": 0, "max_tokens": 12, "ignore_eos": True, "logprobs": 0, **body}
    return ok(server, **body)["choices"][0]["logprobs"]["tokens"]


# ---- effects of the extension fields ---------------------------------------------------------

def check_guided_json(server):
    for route in ("completions", "chat"):
        out = text(server, route, guided_json=PERSON, temperature=0, max_tokens=40,
                   **({"prompt": "A person as JSON:"} if route == "completions" else {}))
        jsonschema.validate(json.loads(out), PERSON)
    as_text = text(server, guided_json=json.dumps(PERSON), temperature=0, max_tokens=40)
    jsonschema.validate(json.loads(as_text), PERSON)


def check_guided_regex(server):
    out = text(server, prompt="A phone number:", guided_regex=r"\d{3}-\d{4}", temperature=0,
               max_tokens=16)
    assert re.fullmatch(r"\d{3}-\d{4}", out)


def check_guided_choice(server):
    for seed in range(3):
        out = text(server, "chat", guided_choice=["red", "green", "blue"], temperature=1.0,
                   seed=seed, max_tokens=8)
        assert out in ("red", "green", "blue")


def check_guided_grammar(server):
    grammar = 'root ::= "yes" | "no" | "maybe"'
    for seed in range(3):
        out = text(server, guided_grammar=grammar, temperature=1.0, seed=seed, max_tokens=8)
        assert out in ("yes", "no", "maybe")


def check_include_stop_str_in_output(server):
    base = greedy(server, max_tokens=16)
    stop = base[len(base) // 2:len(base) // 2 + 3]
    cut = base.index(stop)
    for stream in (False, True):
        without = streamed_or_not(server, stream, stop=[stop])
        with_stop = streamed_or_not(server, stream, stop=[stop], include_stop_str_in_output=True)
        assert without == base[:cut]
        assert with_stop == base[:cut + len(stop)]
    # a stop token id: its text is left out too, unless asked for
    stop_id, = token_ids(server, " Paris")
    assert greedy(server, stop_token_ids=[stop_id]) == ""
    assert greedy(server, stop_token_ids=[stop_id], include_stop_str_in_output=True) == " Paris"


def streamed_or_not(server, stream: bool, **body) -> str:
    body = {"temperature": 0, "max_tokens": 16, "ignore_eos": True, **body}
    if not stream:
        return text(server, **body)
    response = post(server, "completions", stream=True, **body)
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    return "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])


def special_token_text(server) -> str:
    return httpx.post(server.url + "/detokenize", json={"tokens": [1]}).json()["prompt"]


def check_skip_special_tokens(server):
    """Token 1 (<|im_start|>) forced by logit_bias: left out by default, kept on request."""
    forced = dict(prompt="Hello", max_tokens=2, logit_bias={"1": 100})
    special = special_token_text(server)
    assert special and greedy(server, **forced) == ""
    assert greedy(server, skip_special_tokens=False, **forced).split() == [special, special]


def check_spaces_between_special_tokens(server):
    forced = dict(prompt="Hello", max_tokens=2, logit_bias={"1": 100}, skip_special_tokens=False)
    special = special_token_text(server)
    assert greedy(server, **forced) == f" {special} {special}"
    assert greedy(server, spaces_between_special_tokens=False, **forced) == special * 2


def check_truncate_prompt_tokens(server):
    long_prompt = "Paged attention keeps the KV cache in blocks. " * 20
    ids = token_ids(server, long_prompt)
    assert len(ids) > 100
    truncated = ok(server, prompt=long_prompt, truncate_prompt_tokens=7, temperature=0,
                   max_tokens=6, ignore_eos=True)
    assert truncated["usage"]["prompt_tokens"] == 7
    tail = ok(server, prompt=ids[-7:], temperature=0, max_tokens=6, ignore_eos=True)
    assert truncated["choices"][0]["text"] == tail["choices"][0]["text"]
    chat = ok(server, "chat", truncate_prompt_tokens=5, max_tokens=1)
    assert chat["usage"]["prompt_tokens"] == 5


def check_allowed_token_ids(server):
    allowed = token_ids(server, " yes no maybe")
    free = output_tokens(server)
    assert any(t not in (" yes", " no", " maybe") for t in free)
    tokens = output_tokens(server, allowed_token_ids=allowed, temperature=1.0, seed=1)
    assert tokens and set(tokens) <= {" yes", " no", " maybe"}


def check_bad_words(server):
    free = output_tokens(server)
    assert free[0] == " Paris"  # a one-token word the model writes first
    one = output_tokens(server, bad_words=["Paris"])
    assert " Paris" not in one and one != free
    # a two-token word it writes later: the same output up to its first token, then not its
    # second (each word is banned with and without a leading space)
    i = next(i for i in range(1, len(free) - 1)
             if free[i].startswith(" ") and free[i + 1].startswith(" ")
             and (free[i] + free[i + 1]).strip().replace(" ", "").isalpha())
    word = (free[i] + free[i + 1]).strip()
    assert token_strings(server, " " + word) == free[i:i + 2]
    assert len(token_strings(server, word)) == 2
    two = output_tokens(server, bad_words=[word])
    assert two[:i + 1] == free[:i + 1] and two[i + 1] != free[i + 1]
    assert all(two[k:k + 2] != free[i:i + 2] for k in range(len(two)))


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_model_path())


def check_continue_final_message(server, tokenizer):
    """The last (assistant) message is continued: the same tokens as the template's own
    rendering with continue_final_message, sent as a plain prompt."""
    chat = SAY + [{"role": "assistant", "content": "My favorite color is"}]
    rendered = tokenizer.apply_chat_template(chat, tokenize=False, continue_final_message=True,
                                             add_generation_prompt=False)
    assert rendered.endswith("My favorite color is")
    ids = tokenizer.encode(rendered, add_special_tokens=False)
    answer = ok(server, "chat", messages=chat, continue_final_message=True, temperature=0,
                max_tokens=8, ignore_eos=True)
    plain = ok(server, prompt=ids, temperature=0, max_tokens=8, ignore_eos=True)
    assert answer["usage"]["prompt_tokens"] == len(ids)
    assert answer["choices"][0]["message"]["content"] == plain["choices"][0]["text"]
    both = post(server, "chat", messages=chat, continue_final_message=True,
                add_generation_prompt=True)
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"


def check_chat_echo(server):
    """vLLM's echo: the answer starts with the last message when that is the assistant's."""
    chat = SAY + [{"role": "assistant", "content": "My favorite color is"}]
    body = dict(messages=chat, continue_final_message=True, temperature=0, max_tokens=8,
                ignore_eos=True)
    plain = text(server, "chat", **body)
    assert text(server, "chat", echo=True, **body) == "My favorite color is" + plain
    response = post(server, "chat", echo=True, stream=True, **body)
    events = [json.loads(line[6:]) for line in response.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    streamed = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
    assert streamed == "My favorite color is" + plain
    # after a user message there is nothing to echo
    assert text(server, "chat", echo=True, temperature=0, max_tokens=4) == \
        text(server, "chat", temperature=0, max_tokens=4)


def check_best_of(server):
    out = ok(server, n=2, best_of=2, max_tokens=2)
    assert len(out["choices"]) == 2
    refused = post(server, "completions", n=2, best_of=3, max_tokens=2)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "best_of"


def sampled(server, **body) -> str:
    return text(server, temperature=1.0, seed=5, max_tokens=12, ignore_eos=True, **body)


def check_top_k(server):
    assert sampled(server, top_k=1) == greedy(server)
    assert sampled(server) != greedy(server)


def check_top_p(server):
    assert sampled(server, top_p=1e-6) == greedy(server)


def check_min_p(server):
    assert sampled(server, min_p=1.0) == greedy(server)


def check_penalties(server):
    """Each penalty changes a greedy output that repeats itself."""
    base = greedy(server, prompt="one two one two one two", max_tokens=24)
    for name, value in (("repetition_penalty", 2.0), ("presence_penalty", 2.0),
                        ("frequency_penalty", 2.0)):
        assert greedy(server, prompt="one two one two one two", max_tokens=24,
                      **{name: value}) != base, name


def check_use_beam_search(server):
    assert ok(server, use_beam_search=False, max_tokens=1)
    refused = post(server, "completions", use_beam_search=True, max_tokens=1)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "use_beam_search"


EFFECTS = {
    "guided_json": check_guided_json, "guided_regex": check_guided_regex,
    "guided_choice": check_guided_choice, "guided_grammar": check_guided_grammar,
    "include_stop_str_in_output": check_include_stop_str_in_output,
    "skip_special_tokens": check_skip_special_tokens,
    "spaces_between_special_tokens": check_spaces_between_special_tokens,
    "truncate_prompt_tokens": check_truncate_prompt_tokens,
    "allowed_token_ids": check_allowed_token_ids, "bad_words": check_bad_words,
    "continue_final_message": check_continue_final_message, "echo": check_chat_echo,
    "best_of": check_best_of, "top_k": check_top_k, "top_p": check_top_p,
    "min_p": check_min_p, "penalties": check_penalties, "use_beam_search": check_use_beam_search,
}


@pytest.mark.parametrize("name", sorted(EFFECTS))
def test_field_has_its_effect(server, tokenizer, name):
    check = EFFECTS[name]
    if "tokenizer" in check.__code__.co_varnames[:check.__code__.co_argcount]:
        check(server, tokenizer)
    else:
        check(server)


# ---- the tables --------------------------------------------------------------------------------

HERE = "tests.server.test_fields::test_field_has_its_effect"
OPENAI = "tests.server.test_openai_api::"
STRUCTURED = "tests.server.test_structured_api::"
FINDINGS = "tests.server.test_findings::"
REASONING = "tests.server.test_reasoning_api::"
LORA = "tests.server.test_lora_api::"

# "Model.field" -> the test that checks its effect ("module::function", or HERE[name])
HONORED = {
    "SamplingRequest.model": "tests.server.test_bad_input::test_sdk_maps_errors_to_exceptions",
    "SamplingRequest.n": OPENAI + "test_n2_and_ignore_eos",
    "SamplingRequest.best_of": HERE + "[best_of]",
    "SamplingRequest.temperature": OPENAI + "test_seed_makes_sampling_reproducible",
    "SamplingRequest.top_p": HERE + "[top_p]",
    "SamplingRequest.top_k": HERE + "[top_k]",
    "SamplingRequest.min_p": HERE + "[min_p]",
    "SamplingRequest.repetition_penalty": HERE + "[penalties]",
    "SamplingRequest.presence_penalty": HERE + "[penalties]",
    "SamplingRequest.frequency_penalty": HERE + "[penalties]",
    "SamplingRequest.seed": OPENAI + "test_seed_makes_sampling_reproducible",
    "SamplingRequest.stop": OPENAI + "test_stop_string_truncates_and_reports_stop",
    "SamplingRequest.stop_token_ids": HERE + "[include_stop_str_in_output]",
    "SamplingRequest.include_stop_str_in_output": HERE + "[include_stop_str_in_output]",
    "SamplingRequest.ignore_eos": OPENAI + "test_n2_and_ignore_eos",
    "SamplingRequest.min_tokens": STRUCTURED + "test_logit_bias_and_min_tokens",
    "SamplingRequest.skip_special_tokens": HERE + "[skip_special_tokens]",
    "SamplingRequest.spaces_between_special_tokens": HERE + "[spaces_between_special_tokens]",
    "SamplingRequest.truncate_prompt_tokens": HERE + "[truncate_prompt_tokens]",
    "SamplingRequest.allowed_token_ids": HERE + "[allowed_token_ids]",
    "SamplingRequest.bad_words": HERE + "[bad_words]",
    "SamplingRequest.stream": OPENAI + "test_greedy_completions_equal_llm_generate",
    "SamplingRequest.stream_options": OPENAI + "test_without_include_usage_stream_has_no_usage",
    "SamplingRequest.cache_salt": OPENAI + "test_cache_salt_isolates_the_prefix_cache",
    "SamplingRequest.logit_bias": STRUCTURED + "test_logit_bias_and_min_tokens",
    "SamplingRequest.response_format": STRUCTURED + "test_json_schema_greedy_and_sampled_validate",
    "SamplingRequest.structured_outputs":
        STRUCTURED + "test_structured_outputs_extension_on_completions",
    "SamplingRequest.guided_json": HERE + "[guided_json]",
    "SamplingRequest.guided_regex": HERE + "[guided_regex]",
    "SamplingRequest.guided_choice": HERE + "[guided_choice]",
    "SamplingRequest.guided_grammar": HERE + "[guided_grammar]",
    "SamplingRequest.prompt_logprobs": STRUCTURED + "test_prompt_logprobs",
    "CompletionRequest.prompt": OPENAI + "test_list_of_prompts_gives_a_choice_per_prompt",
    "CompletionRequest.max_tokens": OPENAI + "test_greedy_completions_equal_llm_generate",
    "CompletionRequest.logprobs": OPENAI + "test_logprobs_present_and_consistent",
    "ChatCompletionRequest.messages": OPENAI + "test_greedy_chat_equals_llm_chat",
    "ChatCompletionRequest.max_tokens": OPENAI + "test_greedy_chat_equals_llm_chat",
    "ChatCompletionRequest.max_completion_tokens": OPENAI + "test_greedy_chat_equals_llm_chat",
    "ChatCompletionRequest.logprobs": OPENAI + "test_logprobs_present_and_consistent",
    "ChatCompletionRequest.top_logprobs": OPENAI + "test_logprobs_present_and_consistent",
    "ChatCompletionRequest.tools": STRUCTURED + "test_required_tool_call_and_auto_round_trip",
    "ChatCompletionRequest.tool_choice": STRUCTURED + "test_named_tool_call_plain_and_streamed",
    "ChatCompletionRequest.parallel_tool_calls":
        FINDINGS + "test_required_tool_call_is_bounded_and_the_same_streamed_or_not",
    "ChatCompletionRequest.add_generation_prompt": HERE + "[continue_final_message]",
    "ChatCompletionRequest.continue_final_message": HERE + "[continue_final_message]",
    "ChatCompletionRequest.echo": HERE + "[echo]",
    "ChatCompletionRequest.chat_template_kwargs":
        REASONING + "test_enable_thinking_false_changes_the_prompt",
    "ChatCompletionRequest.thinking_token_budget":
        REASONING + "test_thinking_budget_closes_the_block",
    "ChatCompletionRequest.include_reasoning": REASONING + "test_reasoning_split_whole_and_streamed",
    "ChatCompletionRequest.modalities": STRUCTURED + "test_refused_fields_get_a_400_naming_them",
    "TokenizeRequest.model": FINDINGS + "test_tokenize_and_detokenize_refuse_bad_unicode",
    "TokenizeRequest.prompt": STRUCTURED + "test_tokenize_and_detokenize",
    "TokenizeRequest.messages": STRUCTURED + "test_tokenize_and_detokenize",
    "TokenizeRequest.add_special_tokens": FINDINGS + "test_tokenize_add_special_tokens",
    "TokenizeRequest.add_generation_prompt": FINDINGS + "test_tokenize_add_generation_prompt",
    "TokenizeRequest.chat_template_kwargs":
        REASONING + "test_enable_thinking_false_changes_the_prompt",
    "DetokenizeRequest.model": FINDINGS + "test_tokenize_and_detokenize_refuse_bad_unicode",
    "DetokenizeRequest.tokens": STRUCTURED + "test_tokenize_and_detokenize",
    "LoadLoRAAdapterRequest.lora_name": LORA + "test_load_use_unload_reload",
    "LoadLoRAAdapterRequest.lora_path": LORA + "test_load_use_unload_reload",
    "UnloadLoRAAdapterRequest.lora_name": LORA + "test_load_use_unload_reload",
    # the parts of a body
    "StreamOptions.include_usage": OPENAI + "test_greedy_completions_equal_llm_generate",
    "StructuredOutputsRequest.json_": FINDINGS + "test_structured_outputs_kinds",
    "StructuredOutputsRequest.json_object": FINDINGS + "test_structured_outputs_kinds",
    "StructuredOutputsRequest.regex":
        STRUCTURED + "test_structured_outputs_extension_on_completions",
    "StructuredOutputsRequest.choice":
        STRUCTURED + "test_structured_outputs_extension_on_completions",
    "StructuredOutputsRequest.grammar": FINDINGS + "test_structured_outputs_kinds",
    "ResponseFormat.type": STRUCTURED + "test_json_object_parses",
    "ResponseFormat.json_schema": STRUCTURED + "test_json_schema_greedy_and_sampled_validate",
    "JSONSchemaFormat.schema_": STRUCTURED + "test_json_schema_greedy_and_sampled_validate",
    "ChatMessage.role": OPENAI + "test_greedy_chat_equals_llm_chat",
    "ChatMessage.content": OPENAI + "test_greedy_chat_equals_llm_chat",
    "ChatMessage.tool_calls": STRUCTURED + "test_required_tool_call_and_auto_round_trip",
    "ChatMessage.tool_call_id": STRUCTURED + "test_required_tool_call_and_auto_round_trip",
    "ChatMessage.reasoning_content": REASONING + "test_reasoning_sent_back_reaches_the_template",
    "ChatMessage.reasoning": REASONING + "test_reasoning_sent_back_reaches_the_template",
    "TextPart.type": FINDINGS + "test_text_parts_equal_plain_content",
    "TextPart.text": FINDINGS + "test_text_parts_equal_plain_content",
    "ToolCall.id": STRUCTURED + "test_required_tool_call_and_auto_round_trip",
    "ToolCall.type": STRUCTURED + "test_required_tool_call_and_auto_round_trip",
    "ToolCall.function": STRUCTURED + "test_required_tool_call_and_auto_round_trip",
    "FunctionCall.name": STRUCTURED + "test_required_tool_call_and_auto_round_trip",
    "FunctionCall.arguments": STRUCTURED + "test_required_tool_call_and_auto_round_trip",
    "ChatTool.type": STRUCTURED + "test_named_tool_call_plain_and_streamed",
    "ChatTool.function": STRUCTURED + "test_named_tool_call_plain_and_streamed",
    "FunctionDefinition.name": STRUCTURED + "test_named_tool_call_plain_and_streamed",
    "FunctionDefinition.description": STRUCTURED + "test_required_tool_call_and_auto_round_trip",
    "FunctionDefinition.parameters": STRUCTURED + "test_named_tool_call_plain_and_streamed",
    "NamedToolChoice.type": STRUCTURED + "test_named_tool_call_plain_and_streamed",
    "NamedToolChoice.function": STRUCTURED + "test_named_tool_call_plain_and_streamed",
    "NamedFunction.name": STRUCTURED + "test_named_tool_call_plain_and_streamed",
}
RESPONSES = "tests.server.test_responses_api::"
MESSAGES = "tests.server.test_messages_api::"
REASONING = "tests.server.test_agent_reasoning::"
HONORED |= {
    **{f"ResponsesRequest.{name}": RESPONSES + "test_create_answers_as_chat_completions_do"
       for name in ("model", "input", "instructions", "max_output_tokens")},
    **{f"ResponsesRequest.{name}": RESPONSES + "test_sampling_fields_reach_the_engine"
       for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                    "presence_penalty", "frequency_penalty", "seed", "stop")},
    "ResponsesRequest.cache_salt": RESPONSES + "test_cache_salt_isolates_the_prefix_cache",
    "ResponsesRequest.tools": RESPONSES + "test_tool_round_trip_and_previous_response_id",
    "ResponsesRequest.tool_choice": RESPONSES + "test_tool_round_trip_and_previous_response_id",
    "ResponsesRequest.parallel_tool_calls": RESPONSES + "test_parallel_tool_calls",
    "ResponsesRequest.previous_response_id":
        RESPONSES + "test_tool_round_trip_and_previous_response_id",
    "ResponsesRequest.text": RESPONSES + "test_text_format_json_schema_and_json_object",
    "ResponsesRequest.store": RESPONSES + "test_store_retrieve_delete_and_store_false",
    "ResponsesRequest.stream": RESPONSES + "test_stream_sends_the_responses_event_sequence",
    "ResponsesRequest.metadata": RESPONSES + "test_metadata_is_returned_and_stored",
    **{f"InputMessage.{name}": RESPONSES + "test_create_answers_as_chat_completions_do"
       for name in ("type", "role", "content")},
    **{f"InputText.{name}": RESPONSES + "test_create_answers_as_chat_completions_do"
       for name in ("type", "text")},
    **{f"OutputText.{name}": RESPONSES + "test_history_renders_as_the_chat_messages"
       for name in ("type", "text")},
    **{f"FunctionCallItem.{name}": RESPONSES + "test_tool_round_trip_and_previous_response_id"
       for name in ("type", "call_id", "name", "arguments")},
    **{f"FunctionCallOutputItem.{name}":
       RESPONSES + "test_tool_round_trip_and_previous_response_id"
       for name in ("type", "call_id", "output")},
    **{f"FunctionTool.{name}": RESPONSES + "test_tool_round_trip_and_previous_response_id"
       for name in ("type", "name", "description", "parameters")},
    **{f"FunctionToolChoice.{name}": RESPONSES + "test_tool_round_trip_and_previous_response_id"
       for name in ("type", "name")},
    "TextConfig.format": RESPONSES + "test_text_format_json_schema_and_json_object",
    "TextFormatText.type": RESPONSES + "test_text_format_json_schema_and_json_object",
    "TextFormatJSONObject.type": RESPONSES + "test_text_format_json_schema_and_json_object",
    "TextFormatJSONSchema.type": RESPONSES + "test_text_format_json_schema_and_json_object",
    "TextFormatJSONSchema.schema_": RESPONSES + "test_text_format_json_schema_and_json_object",
    **{f"MessageTokensRequest.{name}": MESSAGES + "test_create_answers_as_chat_completions_do"
       for name in ("model", "messages", "system")},
    "MessagesRequest.max_tokens": MESSAGES + "test_create_answers_as_chat_completions_do",
    **{f"MessagesRequest.{name}": MESSAGES + "test_sampling_fields_reach_the_engine"
       for name in ("temperature", "top_p", "top_k")},
    "MessagesRequest.stop_sequences": MESSAGES + "test_stop_sequences",
    "MessagesRequest.stream": MESSAGES + "test_stream_sends_anthropics_event_sequence",
    "MessageTokensRequest.tools": MESSAGES + "test_tool_round_trip",
    "MessageTokensRequest.tool_choice": MESSAGES + "test_tool_round_trip",
    "MessageTokensRequest.output_config": MESSAGES + "test_output_config_format",
    "OutputConfig.format": MESSAGES + "test_output_config_format",
    "JSONOutputFormat.type": MESSAGES + "test_output_config_format",
    "JSONOutputFormat.schema_": MESSAGES + "test_output_config_format",
    "MessageParam.role": MESSAGES + "test_a_last_assistant_message_is_continued",
    "MessageParam.content": MESSAGES + "test_create_answers_as_chat_completions_do",
    "TextBlock.type": MESSAGES + "test_create_answers_as_chat_completions_do",
    "TextBlock.text": MESSAGES + "test_create_answers_as_chat_completions_do",
    **{f"ToolUseBlock.{name}": MESSAGES + "test_tool_round_trip"
       for name in ("type", "id", "name", "input")},
    **{f"ToolResultBlock.{name}": MESSAGES + "test_tool_round_trip"
       for name in ("type", "tool_use_id", "content", "is_error")},
    **{f"ToolDefinition.{name}": MESSAGES + "test_tool_round_trip"
       for name in ("name", "description", "input_schema")},
    "ToolChoiceTool.type": MESSAGES + "test_tool_round_trip",
    "ToolChoiceTool.name": MESSAGES + "test_tool_round_trip",
    # a named tool is one call, whatever this says
    "ToolChoiceTool.disable_parallel_tool_use": MESSAGES + "test_tool_round_trip",
    "ToolChoiceAuto.type": MESSAGES + "test_tool_round_trip",
    "ToolChoiceNone.type": MESSAGES + "test_tool_round_trip",
    "ToolChoiceAny.type": MESSAGES + "test_streamed_tool_use",
    "ToolChoiceAny.disable_parallel_tool_use": MESSAGES + "test_streamed_tool_use",
    "ToolChoiceAuto.disable_parallel_tool_use": MESSAGES + "test_streamed_tool_use",
    "ReasoningConfig.effort": REASONING + "test_thinking_switches_reach_the_template",
    **{f"{model}.{name}": REASONING + "test_reasoning_sent_back_reaches_the_template"
       for model, names in (("ReasoningItem", ("type", "summary", "content")),
                            ("SummaryText", ("type", "text")), ("ReasoningText", ("type", "text")),
                            ("ThinkingBlock", ("type", "thinking"))) for name in names},
    "MessageTokensRequest.thinking": REASONING + "test_thinking_switches_reach_the_template",
    "ThinkingDisabled.type": REASONING + "test_thinking_switches_reach_the_template",
    "ThinkingAdaptive.type": REASONING + "test_thinking_switches_reach_the_template",
    "ThinkingAdaptive.display": REASONING + "test_thinking_budget_and_display",
    **{f"ThinkingEnabled.{name}": REASONING + "test_thinking_budget_and_display"
       for name in ("type", "budget_tokens", "display")},
}

EXPOSURE = "tests.server.test_exposure::"
HONORED |= {
    "SamplingRequest.priority": EXPOSURE + "test_priority_order_and_429_past_the_queue_bound",
    "SamplingRequest.timeout":
        EXPOSURE + "test_a_request_past_its_timeout_is_aborted_and_frees_its_blocks",
    "ResponsesRequest.priority": EXPOSURE + "test_responses_priority_and_timeout_reach_the_engine",
    "ResponsesRequest.timeout": EXPOSURE + "test_responses_priority_and_timeout_reach_the_engine",
}

# "Model.field" -> a value it is sent with: no effect on the output, by design
ACCEPTED = {
    "SamplingRequest.user": "end-user-1",  # OpenAI's abuse monitoring (not a cache salt)
    "SamplingRequest.service_tier": "default",
    "SamplingRequest.safety_identifier": "hashed-user",
    "SamplingRequest.prompt_cache_key": "key",
    "SamplingRequest.prompt_cache_retention": "24h",
    "SamplingRequest.metadata": {"purpose": "test"},
    "SamplingRequest.store": False,
    "JSONSchemaFormat.name": None, "JSONSchemaFormat.description": None,  # labels
    "JSONSchemaFormat.strict": None,  # every schema is enforced anyway
    "FunctionDefinition.strict": None,  # forced calls always follow the schema
    # given to the chat template, which may render it (the default model's ignores it)
    "ChatMessage.name": "alice",
}

# the Responses and Messages fields accepted with no effect (test_agent_apis_accepted_fields):
# top-level ones with the value sent, the echoed parts of history items in that test
RESPONSES_ACCEPTED = {"user": "end-user-1", "safety_identifier": "hashed-user",
                      "prompt_cache_key": "key", "prompt_cache_retention": "24h",
                      "service_tier": "default", "truncation": "disabled", "reasoning": {}}
MESSAGES_ACCEPTED = {"metadata": {"user_id": "u1"}, "service_tier": "auto",
                     "cache_control": {"type": "ephemeral"}}
ACCEPTED |= {
    **{f"ResponsesRequest.{name}": value for name, value in RESPONSES_ACCEPTED.items()},
    "ResponsesRequest.stream_options": {"include_obfuscation": False},
    **{f"{'MessageTokensRequest' if name == 'cache_control' else 'MessagesRequest'}.{name}":
       value for name, value in MESSAGES_ACCEPTED.items()},
    **{f"InputMessage.{name}": None for name in ("id", "status", "phase")},
    "InputText.prompt_cache_breakpoint": None, "OutputText.logprobs": None,
    **{f"{model}.{name}": None for model in ("FunctionCallItem", "FunctionCallOutputItem")
       for name in ("id", "status")},
    **{f"ReasoningItem.{name}": None for name in ("id", "status")},
    "FunctionTool.strict": None, "TextFormatJSONSchema.name": None,
    "TextFormatJSONSchema.description": None, "TextFormatJSONSchema.strict": None,
    "Metadata.user_id": None, "CacheControl.type": None, "CacheControl.ttl": None,
    **{f"{model}.cache_control": None
       for model in ("TextBlock", "ToolUseBlock", "ToolResultBlock", "ToolDefinition")},
    "ToolDefinition.type": None, "ToolDefinition.strict": None,
    "ThinkingBlock.signature": None,
}

# "Model.field" -> (route, body fields that ask for the missing feature, the param named)
MESSAGE = {"role": "assistant", "content": "Hi"}
REFUSED = {
    "SamplingRequest.use_beam_search": ("completions", {"use_beam_search": True}, None),
    "StreamOptions.include_obfuscation": (
        "completions", {"stream": True, "stream_options": {"include_obfuscation": True}},
        "stream_options.include_obfuscation"),
    "CompletionRequest.echo": ("completions", {"echo": True}, None),
    "CompletionRequest.suffix": ("completions", {"suffix": "x"}, None),
    **{f"ChatCompletionRequest.{name}": ("chat", {name: value}, None) for name, value in {
        "audio": {"voice": "alloy", "format": "wav"}, "prediction": {"type": "content"},
        "web_search_options": {}, "reasoning_effort": "low", "verbosity": "low",
        "moderation": {}, "prompt_cache_options": {}, "functions": [{"name": "f"}],
        "function_call": "auto"}.items()},
    **{f"ChatMessage.{name}": ("chat", {"messages": SAY + [{**MESSAGE, name: value}]},
                               f"messages.1.{name}")
       for name, value in {"refusal": "I cannot", "annotations": [{"type": "url"}],
                           "audio": {"id": "a1"}, "function_call": {"name": "f"}}.items()},
}

ITEM = {"type": "message", "role": "assistant", "content": [{"type": "output_text",
                                                             "text": "Hi"}]}
REFUSED |= {
    **{f"ResponsesRequest.{name}": ("responses", {name: value}, None) for name, value in {
        "background": True, "include": ["message.output_text.logprobs"], "top_logprobs": 2,
        "max_tool_calls": 1, "conversation": "conv_1", "prompt": {"id": "pmpt_1"},
        "context_management": [{"type": "compaction"}], "moderation": {"model": "m"},
        "image": {"context_compression": "auto"}, "access_programs": {"cyber": "standard"},
        "background_options": {"completion_window": "2h"},
        "prompt_cache_options": {"mode": "explicit"}}.items()},
    "ResponsesStreamOptions.include_obfuscation": (
        "responses", {"stream": True, "stream_options": {"include_obfuscation": True}},
        "stream_options.include_obfuscation"),
    **{f"ReasoningConfig.{name}": ("responses", {"reasoning": {name: value}},
                                   f"reasoning.{name}")
       for name, value in {"summary": "auto", "generate_summary": "auto",
                           "context": "all_turns", "mode": "pro"}.items()},
    "TextConfig.verbosity": ("responses", {"text": {"verbosity": "low"}}, "text.verbosity"),
    "OutputText.annotations": (
        "responses", {"input": [{**ITEM, "content": [{**ITEM["content"][0], "annotations": [
            {"type": "url_citation"}]}]}]}, "input.0.content.0.annotations"),
    "ReasoningItem.encrypted_content": (
        "responses", {"input": [{"type": "reasoning", "summary": [],
                                 "encrypted_content": "x"}, *SAY]},
        "input.0.encrypted_content"),
    "OutputConfig.effort": ("messages", {"output_config": {"effort": "high"}},
                            "output_config.effort"),
    "TextBlock.citations": ("messages", {"messages": [{"role": "user", "content": [{
        "type": "text", "text": "Hi", "citations": [{"type": "char_location"}]}]}]},
        "messages.0.content.0.citations"),
}


def request_models() -> list[type[BaseModel]]:
    """Every model a request body is made of: the parts' subclasses, all the way down."""
    found, todo = [], [protocol._Part]
    while todo:
        model = todo.pop()
        found.append(model)
        todo += model.__subclasses__()
    return [m for m in found if m.model_fields]


def owner(model: type[BaseModel], name: str) -> str:
    """The class that declares the field (shared fields are decided once)."""
    for cls in model.__mro__:
        if name in cls.__dict__.get("__annotations__", {}):
            return cls.__name__
    raise AssertionError(f"{model.__name__}.{name} has no declaring class")


def all_fields() -> set[str]:
    return {f"{owner(m, name)}.{name}" for m in request_models() for name in m.model_fields}


def test_every_field_is_honored_accepted_or_refused():
    fields = all_fields()
    assert {"SamplingRequest.guided_json", "ChatMessage.tool_call_id",
            "CompletionRequest.prompt", "DetokenizeRequest.tokens"} <= fields
    undecided = sorted(f for f in fields if f not in HONORED and f not in ACCEPTED
                       and f not in REFUSED)
    assert not undecided, f"fields neither honored nor refused: {undecided}"
    stale = sorted((set(HONORED) | set(ACCEPTED) | set(REFUSED)) - fields)
    assert not stale, f"tables name fields the protocol does not have: {stale}"
    assert not set(HONORED) & (set(ACCEPTED) | set(REFUSED))


@pytest.mark.parametrize("field", sorted(HONORED))
def test_each_honored_field_names_a_test_that_exists(field):
    module, _, function = HONORED[field].partition("::")
    function, _, case = function.partition("[")
    assert callable(getattr(importlib.import_module(module), function, None)), HONORED[field]
    if case:
        assert case.rstrip("]") in EFFECTS, HONORED[field]


@pytest.mark.parametrize("field", sorted(REFUSED))
def test_refused_fields_get_a_400_naming_them(server, field):
    route, body, param = REFUSED[field]
    response = post(server, route, max_tokens=1, **body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    name = field.split(".")[1]
    if route == "messages":  # Anthropic's shape: the field leads the message
        assert error["type"] == "invalid_request_error" and (param or name) in error["message"]
    else:
        assert error["param"] == (param or name) and name in error["message"]


def test_accepted_fields_change_nothing(server):
    control = greedy(server, max_tokens=6)
    top_level = {f.split(".")[1]: v for f, v in ACCEPTED.items()
                 if f.startswith("SamplingRequest.")}
    assert greedy(server, max_tokens=6, **top_level) == control
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    labelled = {"type": "json_schema", "json_schema": {
        "name": "answer", "description": "an answer", "strict": True, "schema": schema}}
    bare = {"type": "json_schema", "json_schema": {"schema": schema}}
    assert text(server, "chat", response_format=labelled, temperature=0, max_tokens=12) == \
        text(server, "chat", response_format=bare, temperature=0, max_tokens=12)
    named = [{**SAY[0], "name": ACCEPTED["ChatMessage.name"]}]
    assert greedy(server, "chat", messages=named) == greedy(server, "chat")


@pytest.mark.parametrize("route, body, param", [
    ("completions", {"some_unknown_field": 1}, "some_unknown_field"),
    ("chat", {"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
    ("chat", {"messages": [{"role": "user", "content": "hi", "mood": "happy"}]},
     "messages.0.mood"),
    ("completions", {"stream": True, "stream_options": {"continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats"),
    ("chat", {"response_format": {"type": "json_object", "schema": {}}}, "response_format.schema"),
])
def test_unknown_fields_get_a_400_naming_them(server, route, body, param):
    response = post(server, route, max_tokens=1, **body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["code"] == "unknown_parameter"
    assert param in error["message"]


def test_unknown_fields_on_tokenize_and_detokenize(server):
    for path, body in (("/tokenize", {"prompt": "hi", "return_token_strs": True}),
                       ("/detokenize", {"tokens": [1], "extra": 1})):
        response = httpx.post(server.url + path, json=body)
        assert response.status_code == 400 and \
            response.json()["error"]["code"] == "unknown_parameter"


def output_text(server, route: str, **body) -> str:
    """The answer's text on the Responses or Messages API, greedy."""
    response = post(server, route, temperature=0, max_tokens=8, **body)
    assert response.status_code == 200, response.text
    if route == "messages":
        return "".join(b.get("text", "") for b in response.json()["content"])
    return "".join(part["text"] for item in response.json()["output"]
                   if item["type"] == "message" for part in item["content"])


def test_agent_apis_accepted_fields_change_nothing(server):
    """The accepted fields of /v1/responses and /v1/messages, top-level and the parts an SDK
    echoes back in history items: the same answer as without them."""
    assert output_text(server, "responses", **RESPONSES_ACCEPTED) == \
        output_text(server, "responses")
    streamed = [post(server, "responses", temperature=0, max_tokens=8, stream=True, **extra).text
                for extra in ({}, {"stream_options": {"include_obfuscation": False}})]
    deltas = [[json.loads(line[6:]).get("delta") for line in text.splitlines()
               if line.startswith("data: ") and "output_text.delta" in line]
              for text in streamed]
    # how the text splits into deltas follows the steps' timing; the text itself may not move
    assert deltas[0] and "".join(deltas[0]) == "".join(deltas[1])
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather",
            "arguments": '{"city": "Paris"}'}
    result = {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}
    bare = [*SAY, {"role": "assistant", "content": [{"type": "output_text", "text": "Blue."}]},
            call, result, {"role": "user", "content": "Another?"}]
    echoed = [
        {"type": "message", "role": "user", "content": [{
            "type": "input_text", "text": SAY[0]["content"],
            "prompt_cache_breakpoint": {"mode": "explicit"}}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "phase": "final_answer",
         "content": [{"type": "output_text", "text": "Blue.", "annotations": [],
                      "logprobs": []}]},
        {**call, "id": "fc_1", "status": "completed"},
        {**result, "id": "fco_1", "status": "completed"}, {"role": "user", "content": "Another?"}]
    tool = {"type": "function", "name": "get_weather", "parameters": PERSON}
    labels = {"name": "x", "description": "a person", "strict": True}
    schema = {"format": {"type": "json_schema", "schema": PERSON}}
    assert output_text(server, "responses", input=echoed, tools=[{**tool, "strict": True}],
                       text={"format": {**schema["format"], **labels}}) == \
        output_text(server, "responses", input=bare, tools=[tool], text=schema)

    assert output_text(server, "messages", **MESSAGES_ACCEPTED,
                       thinking={"type": "disabled"}) == output_text(server, "messages")
    cache = {"cache_control": {"type": "ephemeral", "ttl": "5m"}}
    use = {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
           "input": {"city": "Paris"}}
    answer = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}
    plain = [*SAY, {"role": "assistant", "content": [use]}, {"role": "user", "content": [answer]}]
    marked = [{"role": "user", "content": [{"type": "text", "text": SAY[0]["content"], **cache}]},
              {"role": "assistant", "content": [{**use, **cache}]},
              {"role": "user", "content": [{**answer, **cache}]}]
    tool = {"name": "get_weather", "input_schema": PERSON}
    assert output_text(server, "messages", messages=marked,
                       tools=[{**tool, "type": "custom", "strict": True, **cache}]) == \
        output_text(server, "messages", messages=plain, tools=[tool])
