"""Pydantic models of the OpenAI wire protocol that the server speaks.

Ranges live on the fields so that FastAPI rejects bad values before any engine work; the
error handlers turn those rejections into OpenAI-style 400 bodies. Every request field is in
one of three groups, so a client never gets a plausible-looking wrong result:
- implemented: sampling (temperature, top_p, n, seed, stop, penalties, logit_bias), lengths,
  logprobs / top_logprobs, streaming with stream_options.include_usage, response_format
  (json_object, json_schema), tools / tool_choice / parallel_tool_calls; for completions
  echo=false; best_of equal to n;
- accepted with no effect on the output, because they route, bill or monitor on OpenAI's side:
  user, service_tier, safety_identifier, prompt_cache_key, prompt_cache_retention, metadata,
  store=false (and, in messages, the fields an SDK echoes back from a response: refusal,
  annotations, audio, function_call, all empty);
- refused with a 400 naming the parameter: audio, modalities other than ["text"], prediction,
  web_search_options, reasoning_effort, verbosity, moderation, prompt_cache_options, the
  deprecated functions / function_call, store=true, stream_options.include_obfuscation=true,
  suffix, completions' echo=true, best_of other than n, prompt_logprobs with stream=true (as
  vLLM), use_beam_search=true, and every field nobody defines here (`extra="forbid"`).
Extensions (vLLM's names and meanings): top_k, min_p, repetition_penalty, min_tokens,
stop_token_ids, include_stop_str_in_output, ignore_eos, skip_special_tokens,
spaces_between_special_tokens, truncate_prompt_tokens, allowed_token_ids, bad_words,
prompt_logprobs, cache_salt, add_generation_prompt, continue_final_message, chat echo,
guided_json / guided_regex / guided_choice / guided_grammar, and `structured_outputs`
(exactly one of json, json_object, regex, choice, grammar: the output must match it);
for reasoning models chat_template_kwargs (e.g. {"enable_thinking": false}),
thinking_token_budget, include_reasoning, and an assistant message's reasoning_content /
reasoning (given to the template).

Types are strict (pydantic's strict mode): "3", 2.0 and false are not integers, 0 is not a
boolean. Numbers must be finite (JSON parsers accept NaN and Infinity, which no range check
catches); text must be valid Unicode (JSON's \\ud800 escapes decode to unpaired surrogates,
which no tokenizer and no UTF-8 response can carry). What needs the model (prompt length,
token ids against the vocabulary, a grammar that compiles) is checked once, by the engine's
Processor. Errors raised by the validators here carry the offending parameter in their
context, so the error body names it (`request_error`).
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Annotated, Any, Literal, Union, get_args

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationInfo, \
    field_validator, model_validator
from pydantic_core import PydanticCustomError

from pagedserve.entrypoints.chat_template import RESERVED_TEMPLATE_KWARGS
from pagedserve.structured.params import StructuredOutputsParams

MAX_N = 16  # choices per prompt; each one occupies a running slot in the engine
MAX_LOGPROBS = 20  # top alternatives per token, as in OpenAI's chat API
MAX_STOP = 16  # stop strings per request
MAX_TOP_K = 2**31 - 1  # beyond any vocabulary; larger values would overflow the sampler
MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1  # what a torch generator's 64-bit seed takes
# engine requests (prompts x n) one HTTP request may start: one client cannot fill the queue
MAX_ENGINE_REQUESTS = 1024
_TOKEN_ID_KEY = re.compile(r"-?[0-9]{1,19}")  # ASCII digits only: int() takes others too


def request_error(param: str | None, message: str,
                  code: str = "invalid_value") -> PydanticCustomError:
    """A validation error about `param` (None: no single parameter); the client gets the
    message as it is, and `code` as the error's code."""
    return PydanticCustomError(code, message.replace("{", "(").replace("}", ")"),
                               {"param": param})


def _bad_char(text: str) -> str | None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return text[exc.start]
    return None


def _unpaired_surrogate(value: Any, path: str = "") -> PydanticCustomError | None:
    """An error naming the first text in a JSON value that is not valid Unicode."""
    if isinstance(value, str):
        char = _bad_char(value)
        if char is None:
            return None
        return request_error(path, f"Invalid value for '{path}': the text is not valid "
                             f"Unicode (an unpaired surrogate, U+{ord(char):04X}).")
    if isinstance(value, dict):
        for key, item in value.items():
            char = _bad_char(key)
            if char is not None:  # the name itself cannot be shown
                where = f" in '{path}'" if path else ""
                return request_error(path or None, f"A parameter name{where} is not valid "
                                     f"Unicode (an unpaired surrogate, U+{ord(char):04X}).",
                                     code="invalid_parameter_name")
            found = _unpaired_surrogate(item, f"{path}.{key}" if path else key)
            if found:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = _unpaired_surrogate(item, f"{path}.{i}" if path else str(i))
            if found:
                return found
    return None


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class _Part(BaseModel):
    """A part of a request body: strict types, unknown fields refused."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False,
                              populate_by_name=True)


class _Request(_Part):
    """A request body: a part whose text is all valid Unicode."""

    @model_validator(mode="before")
    @classmethod
    def _check_unicode(cls, data: Any) -> Any:
        error = _unpaired_surrogate(data) if isinstance(data, dict) else None
        if error is not None:
            raise error
        return data


def _unsupported(value: Any, info: ValidationInfo) -> Any:
    """Accepted only when null: any value asks for a feature the server does not have."""
    if value is not None:
        raise request_error(info.field_name, f"{info.field_name} is not supported.")
    return value


def _unsupported_unless_empty(value: Any, info: ValidationInfo) -> Any:
    """Accepted when empty (null, false, "", []): what asks for nothing."""
    if value:
        raise request_error(info.field_name, f"{info.field_name} is not supported.")
    return value


def by_type(*parts: type[_Part], default: str | None = None) -> Any:
    """A union of parts told apart by their `type` field (`default` when it is absent), as
    the Responses and Messages APIs shape their items and blocks: only the matching part's
    errors are reported, and an unknown type gets one error naming the known ones. (The
    tags are bracketed so the error handler leaves them out of the parameter's path.)"""
    names = [get_args(part.model_fields["type"].annotation)[0] for part in parts]

    def tag(value: Any) -> str | None:
        kind = value.get("type", default) if isinstance(value, dict) \
            else getattr(value, "type", None)
        return f"type[{kind}]" if kind in names else None

    known = ", ".join(repr(n) for n in names)
    return Annotated[Union[tuple(Annotated[part, Tag(f"type[{name}]")]
                                 for part, name in zip(parts, names))],
                     Discriminator(tag, custom_error_type="invalid_type",
                                   custom_error_message=f"type must be one of {known}")]


def text_or(list_type: Any) -> Any:
    """A string or a list (of blocks): only the matching side's errors are reported."""
    return Annotated[Union[Annotated[str, Tag("str")], Annotated[list_type, Tag("list[]")]],
                     Discriminator(lambda v: "str" if isinstance(v, str) else "list[]")]


class StreamOptions(_Part):
    include_usage: bool = False
    include_obfuscation: bool = False  # refused when true: no padding is ever added


def _constraint(param: str, **spec: Any) -> StructuredOutputsParams:
    """StructuredOutputsParams, whose own checks (exactly one kind, a non-empty choice, JSON
    text that parses) become a 400 naming `param`."""
    try:
        return StructuredOutputsParams(**spec)
    except ValueError as exc:
        raise request_error(param, f"Invalid {param}: {exc}") from None


class StructuredOutputsRequest(_Part):
    """Extension: exactly one constraint on the output (pagedserve/structured/params.py)."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")  # a JSON schema
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF (llama.cpp GBNF dialect), root rule `root`

    @model_validator(mode="after")
    def _check(self) -> StructuredOutputsRequest:
        self.params()
        return self

    def params(self) -> StructuredOutputsParams:
        return _constraint("structured_outputs", json=self.json_, json_object=self.json_object,
                           regex=self.regex, choice=self.choice, grammar=self.grammar)


class JSONSchemaFormat(_Part):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # every schema is enforced, which is what strict promises


class ResponseFormat(_Part):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _check(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise request_error("response_format",
                                "response_format of type json_schema needs a json_schema.")
        return self


# vLLM's guided decoding fields: the structured_outputs kind each one sets
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}


class SamplingRequest(_Request):
    """Fields shared by completions and chat completions."""

    model: str | None = None  # None = the served model
    n: int = Field(1, ge=1, le=MAX_N)
    best_of: int | None = None  # only equal to n: every sample is returned
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=MAX_TOP_K)  # extension; -1 or 0 = disabled
    min_p: float | None = Field(None, ge=0.0, le=1.0)  # extension
    repetition_penalty: float | None = Field(None, gt=0.0)  # extension
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=MIN_SEED, le=MAX_SEED)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # extension
    include_stop_str_in_output: bool = False  # extension: the stop string ends the text
    ignore_eos: bool = False  # extension
    min_tokens: int = Field(0, ge=0)  # extension: EOS and stop_token_ids ignored before this
    skip_special_tokens: bool = True  # extension: special tokens left out of the text
    spaces_between_special_tokens: bool = True  # extension: see frontend/detokenizer.py
    truncate_prompt_tokens: int | None = Field(None, ge=-1)  # extension: keep the last k
    allowed_token_ids: list[int] | None = None  # extension: only these can be sampled
    bad_words: list[str] | None = None  # extension: never generated
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None  # extension: isolates the prefix cache between tenants
    # extension: with --scheduling-policy priority, lower is admitted first (else only 0)
    priority: int = Field(0, ge=-(2**63), le=2**63 - 1)
    # extension: seconds from arrival until the request is aborted (408), at most the
    # server's --request-timeout
    timeout: float | None = Field(None, gt=0.0)
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None  # extension
    guided_json: dict[str, Any] | str | None = None  # vLLM's names for structured_outputs
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # extension: per prompt position, the prompt token's logprob and this many top ones
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    use_beam_search: bool = False  # refused when true: there is no beam search
    # accepted, no effect on the output (see the module docstring)
    user: str | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None

    _refuse_common = field_validator("use_beam_search")(_unsupported_unless_empty)

    @field_validator("stream_options")
    @classmethod
    def _check_stream_options(cls, value: StreamOptions | None) -> StreamOptions | None:
        if value is not None and value.include_obfuscation:
            raise request_error("stream_options.include_obfuscation",
                                "include_obfuscation is not supported.")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for token, bias in (value or {}).items():
            if not _TOKEN_ID_KEY.fullmatch(token):
                raise request_error("logit_bias", f"logit_bias keys must be token ids (at most "
                                    f"19 digits 0-9), got {token!r}.")
            if not -100.0 <= bias <= 100.0:
                raise request_error("logit_bias", f"logit_bias values must be in [-100, 100], "
                                    f"got {bias} for token {token}.")
        return value

    @field_validator("store")
    @classmethod
    def _check_store(cls, value: bool | None) -> bool | None:
        if value:
            raise request_error("store", "store=true is not supported: completions are not "
                                "stored.")
        return value

    @model_validator(mode="after")
    def _check_common(self) -> SamplingRequest:
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > MAX_STOP:
            raise request_error("stop", f"At most {MAX_STOP} stop strings are allowed.")
        if any(s == "" for s in stops):
            raise request_error("stop", "Stop strings must be non-empty.")
        if self.stream_options is not None and not self.stream:
            raise request_error("stream_options",
                                "stream_options is only allowed when stream is true.")
        if self.prompt_logprobs is not None and self.stream:
            raise request_error("prompt_logprobs",
                                "prompt_logprobs is not available when stream is true.")
        if self.best_of is not None and self.best_of != self.n:
            raise request_error("best_of", "best_of different from n is not supported.")
        self.output_constraint()
        return self

    def output_constraint(self) -> tuple[str, StructuredOutputsParams] | None:
        """The request field that constrains the output, as the engine's structured outputs:
        response_format, structured_outputs or one of vLLM's guided_* fields (at most one)."""
        found = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            found.append(("response_format", StructuredOutputsParams(json_object=True)))
        elif fmt is not None and fmt.type == "json_schema":
            schema = fmt.json_schema.schema_
            found.append(("response_format",
                          StructuredOutputsParams(json=schema) if schema is not None
                          else StructuredOutputsParams(json_object=True)))
        if self.structured_outputs is not None:
            found.append(("structured_outputs", self.structured_outputs.params()))
        for name, kind in GUIDED.items():
            value = getattr(self, name)
            if value is not None:
                found.append((name, _constraint(name, **{kind: value})))
        if len(found) > 1:
            raise request_error(found[1][0], f"Give one of response_format, "
                                f"structured_outputs and {', '.join(GUIDED)}; got "
                                f"{' and '.join(name for name, _ in found)}.")
        return found[0] if found else None


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None

    _refuse_completion = field_validator("echo", "suffix")(_unsupported_unless_empty)

    @model_validator(mode="after")
    def _check_completion(self) -> CompletionRequest:
        count = len(self.prompts())
        if count == 0:
            raise request_error("prompt", "prompt must not be empty: give a text, a list of "
                                "token ids, or a list of either.")
        if count * self.n > MAX_ENGINE_REQUESTS:
            raise request_error("prompt", f"This request asks for {count} prompts x n={self.n} "
                                f"= {count * self.n} completions; the server takes at most "
                                f"{MAX_ENGINE_REQUESTS} per request.")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (text or token ids), one engine request each."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [p]
        return list(p)


class TextPart(_Part):
    type: Literal["text"]
    text: str


class FunctionCall(_Part):
    name: str
    arguments: str  # JSON text


class ToolCall(_Part):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Part):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: the call this is the result of
    # assistant: its reasoning, as a response gave it (vLLM's older and newer names); the
    # template gets it as `reasoning_content` (Qwen3's renders it for the current turn)
    reasoning_content: str | None = None
    reasoning: str | None = None
    # what an SDK's response message carries when it is sent back as history: accepted empty
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: Any = None
    function_call: Any = None

    _refuse_echoed = field_validator("refusal", "annotations", "audio",
                                     "function_call")(_unsupported_unless_empty)

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class FunctionDefinition(_Part):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None  # forced calls always follow the schema


class ChatTool(_Part):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Part):
    name: str


class NamedToolChoice(_Part):
    type: Literal["function"]
    function: NamedFunction


def _template_kwargs(value: dict[str, Any] | None, info: ValidationInfo
                     ) -> dict[str, Any] | None:
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(value or ()))
    if reserved:
        raise request_error(info.field_name, f"{info.field_name} may not set "
                            f"{', '.join(reserved)}: the server passes those itself (use the "
                            "request's own fields).")
    return value


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    # extensions for reasoning models (vLLM's names): variables for the chat template (over
    # the server's --default-chat-template-kwargs), the most tokens inside the think block,
    # and whether the reasoning is returned at all
    chat_template_kwargs: dict[str, Any] | None = None
    thinking_token_budget: int | None = Field(None, ge=0)
    include_reasoning: bool = True
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True  # extension
    # extension: the last message is left open and the answer continues it
    continue_final_message: bool = False
    # extension: the answer starts with the last message's text when that is the assistant's
    echo: bool = False
    modalities: list[str] | None = None
    # refused (see the module docstring)
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    moderation: Any = None
    prompt_cache_options: Any = None
    functions: Any = None
    function_call: Any = None

    _refuse_chat = field_validator("audio", "prediction", "web_search_options",
                                   "reasoning_effort", "verbosity", "moderation",
                                   "prompt_cache_options", "functions",
                                   "function_call")(_unsupported)

    _check_template_kwargs = field_validator("chat_template_kwargs")(_template_kwargs)

    @field_validator("modalities")
    @classmethod
    def _check_modalities(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and value != ["text"]:
            raise request_error("modalities", 'modalities other than ["text"] are not '
                                "supported.")
        return value

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        for i, message in enumerate(self.messages):
            if message.role == "tool" and message.tool_call_id is None:
                raise request_error(f"messages.{i}.tool_call_id", "A message with role 'tool' "
                                    "needs the tool_call_id of the call it answers.",
                                    code="missing_required_parameter")
        if self.top_logprobs is not None and not self.logprobs:
            raise request_error("top_logprobs", "top_logprobs requires logprobs to be true.")
        if self.continue_final_message and self.add_generation_prompt \
                and "add_generation_prompt" in self.model_fields_set:
            raise request_error("continue_final_message", "continue_final_message continues "
                                "the last message, so add_generation_prompt must be false.")
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            raise request_error("tool_choice", "tool_choice needs tools.")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = {t.function.name for t in self.tools}
            if self.tool_choice.function.name not in names:
                raise request_error("tool_choice", f"tool_choice names "
                                    f"{self.tool_choice.function.name!r}, which is not among "
                                    "the tools.")
        forced = self.tool_choice not in (None, "none", "auto")
        if forced and self.output_constraint() is not None:
            raise request_error("tool_choice", "A forced tool_choice cannot be combined with "
                                f"{self.output_constraint()[0]}.")
        return self

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """OpenAI's default: auto with tools, none without."""
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        return self.tool_choice

    @property
    def max_new_tokens(self) -> int | None:
        """`max_completion_tokens` is OpenAI's newer name; it wins when both are given."""
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    @property
    def generation_prompt(self) -> bool:
        """Whether the template adds the assistant's turn: not when continuing the last."""
        return self.add_generation_prompt and not self.continue_final_message


class LoadLoRAAdapterRequest(_Request):
    """vLLM's /v1/load_lora_adapter: a PEFT adapter folder, served as `model` lora_name."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(_Request):
    """vLLM's /v1/unload_lora_adapter (its lora_int_id is ours to give, not the client's)."""

    lora_name: str = Field(min_length=1)


class TokenizeRequest(_Request):
    """vLLM's /tokenize: a prompt, or chat messages rendered with the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    _check_template_kwargs = field_validator("chat_template_kwargs")(_template_kwargs)

    @model_validator(mode="after")
    def _check(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise request_error(None, "Give exactly one of prompt and messages.")
        return self


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


# ---- responses ----------------------------------------------------------------------------

FinishReason = Literal["stop", "length", "abort", "tool_calls"] | None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0  # the think block's tokens, its markers included


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None
    # with a reasoning parser (OpenAI's field for reasoning models)
    completion_tokens_details: CompletionTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's prompt_logprobs entry: one per token id, keyed by the id."""

    logprob: float
    rank: int
    decoded_token: str | None = None


# None for the first prompt token (nothing predicts it), then token id -> entry per position
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason = None
    stop_reason: int | str | None = None  # extension: the stop string or token that fired
    prompt_logprobs: PromptLogprobs | None = None  # extension, as vLLM places it


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    system_fingerprint: str | None = None
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    # the reasoning parser's share of the output, under vLLM's older and newer names
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    system_fingerprint: str | None = None
    usage: UsageInfo | None = None
    prompt_logprobs: PromptLogprobs | None = None  # extension, as vLLM places it


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatStreamChoice]
    system_fingerprint: str | None = None
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "pagedserve"
    max_model_len: int | None = None
    # what runs: the KV cache's element type ("bfloat16", "float32", "fp8_e4m3", ...) and the
    # weights' quantization ("fp8", or None for the model's dtype)
    kv_cache_dtype: str | None = None
    quantization: str | None = None
    # a LoRA adapter: the base model it runs on, and its folder
    parent: str | None = None
    root: str | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
