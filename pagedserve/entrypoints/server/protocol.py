"""Pydantic models of the OpenAI wire protocol that the server speaks.

Ranges live on the fields so that FastAPI rejects bad values before any engine work; the
error handlers turn those rejections into OpenAI-style 400 bodies. Unknown fields are
ignored (as OpenAI-compatible servers commonly do) but features we do not implement and
that would silently change the answer (echo, suffix, best_of, logit_bias, tools) are
refused, so a client never gets a plausible-looking wrong result.

Numbers must be finite (JSON parsers accept NaN and Infinity, which no range check catches)
and integers that reach torch must fit its 64-bit types; text must be valid Unicode (JSON's
\ud800 escapes decode to unpaired surrogates, which no tokenizer and no UTF-8 response can
carry). Errors raised by the validators here carry the offending parameter in their context,
so the error body names it (`request_error`).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

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


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingRequest(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

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
    logit_bias: dict[str, float] | None = None

    @model_validator(mode="after")
    def _check_common(self) -> SamplingRequest:
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > MAX_STOP:
            raise request_error("stop", f"At most {MAX_STOP} stop strings are allowed.")
        if any(s == "" for s in stops):
            raise request_error("stop", "Stop strings must be non-empty.")
        if self.logit_bias:
            raise request_error("logit_bias", "logit_bias is not supported.")
        if self.stream_options is not None and not self.stream:
            raise request_error("stream_options",
                                "stream_options is only allowed when stream is true.")
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


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Any] | None = None
    add_generation_prompt: bool = True  # extension

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.tools:
            raise request_error("tools", "tools are not supported.")
        if self.top_logprobs is not None and not self.logprobs:
            raise request_error("top_logprobs", "top_logprobs requires logprobs to be true.")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        """`max_completion_tokens` is OpenAI's newer name; it wins when both are given."""
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens


# ---- responses ----------------------------------------------------------------------------

FinishReason = Literal["stop", "length", "abort"] | None


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


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason = None
    stop_reason: int | str | None = None  # extension: the stop string or token that fired


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


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


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


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
