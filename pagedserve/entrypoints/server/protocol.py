"""Pydantic models of the OpenAI wire protocol that the server speaks.

Ranges live on the fields so that FastAPI rejects bad values before any engine work; the
error handlers turn those rejections into OpenAI-style 400 bodies. Every request field of
OpenAI's completions and chat completions is in one of three groups, so a client never gets
a plausible-looking wrong result:
- implemented: sampling (temperature, top_p, n, seed, stop, penalties, logit_bias), lengths,
  logprobs / top_logprobs, streaming with stream_options.include_usage, response_format
  (json_object, json_schema), tools / tool_choice / parallel_tool_calls, `user` (also the
  prefix-cache salt), and (vLLM's extension) prompt_logprobs without streaming; for
  completions echo=false, best_of equal to n;
- accepted with no effect on the output, because they route, bill or monitor on OpenAI's side:
  service_tier, safety_identifier, prompt_cache_key, prompt_cache_retention, metadata,
  store=false;
- refused with a 400 naming the parameter: audio, modalities other than ["text"], prediction,
  web_search_options, reasoning_effort, verbosity, moderation, prompt_cache_options, the
  deprecated functions / function_call, store=true, stream_options.include_obfuscation=true,
  suffix, echo=true, best_of other than n, prompt_logprobs with stream=true (as vLLM).
Extensions (vLLM's names): top_k, min_p, repetition_penalty, min_tokens, stop_token_ids,
ignore_eos, cache_salt, add_generation_prompt, and `structured_outputs` (exactly one of json,
json_object, regex, choice, grammar: the output must match it). Fields nobody defines are
ignored and logged once per field name.

Numbers must be finite (JSON parsers accept NaN and Infinity, which no range check catches)
and integers that reach torch must fit its 64-bit types; text must be valid Unicode (JSON's
\ud800 escapes decode to unpaired surrogates, which no tokenizer and no UTF-8 response can
carry). Errors raised by the validators here carry the offending parameter in their context,
so the error body names it (`request_error`).
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, \
    model_validator
from pydantic_core import PydanticCustomError

logger = logging.getLogger(__name__)

MAX_N = 16  # choices per prompt; each one occupies a running slot in the engine
MAX_LOGPROBS = 20  # top alternatives per token, as in OpenAI's chat API
MAX_STOP = 16  # stop strings per request
MAX_TOP_K = 2**31 - 1  # beyond any vocabulary; larger values would overflow the sampler
MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1  # what a torch generator's 64-bit seed takes


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


_logged_extra_fields: set[str] = set()


def _log_unknown_fields(model: BaseModel) -> None:
    for name in model.model_extra or {}:
        if name not in _logged_extra_fields:
            _logged_extra_fields.add(name)
            logger.warning("ignoring the unknown request field %r (logged once)", name)


class StreamOptions(BaseModel):
    include_usage: bool = False
    include_obfuscation: bool = False  # no obfuscation padding is ever added


class StructuredOutputsRequest(BaseModel):
    """Extension: exactly one constraint on the output (pagedserve/structured/params.py)."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | None = Field(None, alias="json")  # a JSON schema
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF (llama.cpp GBNF dialect), root rule `root`


class JSONSchemaFormat(BaseModel):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # every schema is enforced, which is what strict promises


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _check(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise request_error("response_format",
                                "response_format of type json_schema needs a json_schema.")
        return self


def _unsupported(value: Any, info: ValidationInfo) -> Any:
    if value is not None:
        raise request_error(info.field_name, f"{info.field_name} is not supported.")
    return value


class SamplingRequest(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False, populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _check_unicode(cls, data: Any) -> Any:
        error = _unpaired_surrogate(data) if isinstance(data, dict) else None
        if error is not None:
            raise error
        return data

    model: str | None = None  # None = the served model
    n: int = Field(1, ge=1, le=MAX_N)
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
    ignore_eos: bool = False  # extension
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # also the prefix-cache salt unless cache_salt is given
    cache_salt: str | None = None  # extension: isolates the prefix cache between tenants
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    min_tokens: int = Field(0, ge=0)  # extension: EOS and stop_token_ids ignored before this
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None  # extension
    # accepted, no effect on the output (see the module docstring)
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    # extension: per prompt position, the prompt token's logprob and this many top ones
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for token, bias in (value or {}).items():
            if not token.lstrip("-").isdigit():
                raise request_error("logit_bias", f"logit_bias keys must be token ids, got "
                                    f"{token!r}.")
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

    @field_validator("stream_options")
    @classmethod
    def _check_stream_options(cls, value: StreamOptions | None) -> StreamOptions | None:
        if value is not None and value.include_obfuscation:
            raise request_error("stream_options.include_obfuscation",
                                "include_obfuscation is not supported.")
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
        if self.structured_outputs is not None and self.response_format is not None \
                and self.response_format.type != "text":
            raise request_error("structured_outputs", "Give either response_format or "
                                "structured_outputs, not both.")
        _log_unknown_fields(self)
        return self


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _check_completion(self) -> CompletionRequest:
        if self.echo:
            raise request_error("echo", "echo is not supported.")
        if self.suffix:
            raise request_error("suffix", "suffix is not supported.")
        if self.best_of is not None and self.best_of != self.n:
            raise request_error("best_of", "best_of different from n is not supported.")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (text or token ids), one engine request each."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [p]
        return list(p)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: the call this is the result of

    @model_validator(mode="after")
    def _log_extra(self) -> ChatMessage:
        _log_unknown_fields(self)
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class FunctionDefinition(BaseModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None  # forced calls always follow the schema


class ChatTool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True  # extension
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

    @field_validator("modalities")
    @classmethod
    def _check_modalities(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and value != ["text"]:
            raise request_error("modalities", 'modalities other than ["text"] are not '
                                "supported.")
        return value

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise request_error("top_logprobs", "top_logprobs requires logprobs to be true.")
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            raise request_error("tool_choice", "tool_choice needs tools.")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = {t.function.name for t in self.tools}
            if self.tool_choice.function.name not in names:
                raise request_error("tool_choice", f"tool_choice names "
                                    f"{self.tool_choice.function.name!r}, which is not among "
                                    "the tools.")
        forced = self.tool_choice not in (None, "none", "auto")
        if forced and (self.structured_outputs is not None or (
                self.response_format is not None and self.response_format.type != "text")):
            raise request_error("tool_choice", "A forced tool_choice cannot be combined with "
                                "response_format or structured_outputs.")
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


# ---- responses ----------------------------------------------------------------------------

FinishReason = Literal["stop", "length", "abort", "tool_calls"] | None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


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


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages rendered with the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _check(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise request_error(None, "Give exactly one of prompt and messages.")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(BaseModel):
    model: str | None = None
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
