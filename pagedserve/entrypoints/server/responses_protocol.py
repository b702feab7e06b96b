"""Pydantic models of OpenAI's Responses API (`/v1/responses`): the request and the
response object.

The request follows protocol.py's rule: every field is honored, accepted with no effect, or
refused with a 400 naming it, and unknown fields are refused.
- honored: input (a string, or messages, function_call, function_call_output and
  reasoning items), instructions, max_output_tokens, temperature, top_p, tools (functions),
  tool_choice, parallel_tool_calls, text.format (text, json_object, json_schema: the
  structured outputs), previous_response_id, store (stored responses can be retrieved,
  continued and deleted), metadata (returned with the response), stream; extensions with
  vLLM's names: top_k, min_p, repetition_penalty, presence_penalty, frequency_penalty,
  seed, stop, cache_salt, priority, timeout; reasoning.effort "none" (a reasoning model's
  thinking off: the chat template's enable_thinking false);
- accepted with no effect on the output (they route, bill or monitor on OpenAI's side):
  user, safety_identifier, prompt_cache_key, prompt_cache_retention, service_tier,
  truncation "disabled" (a prompt too long is refused), reasoning without options; in
  input items what an SDK echoes back from an output (ids, status, phase, annotations,
  logprobs);
- refused: background, include, top_logprobs, max_tool_calls, conversation, prompt,
  context_management, moderation, image, access_programs, background_options,
  prompt_cache_options, reasoning effort other than "none", summary, context and mode,
  text.verbosity, truncation "auto", stream_options.include_obfuscation, a reasoning item's
  encrypted_content, item references, and any content but text (images, files, audio).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from pagedserve.entrypoints.server.protocol import (MAX_SEED, MAX_STOP, MIN_SEED, MAX_TOP_K,
                                                    UsageInfo, _Part, _Request,
                                                    _unsupported, _unsupported_unless_empty,
                                                    by_type, now, request_error, text_or)

# ---- request --------------------------------------------------------------------------------


class InputText(_Part):
    type: Literal["input_text"]
    text: str
    prompt_cache_breakpoint: Any = None  # accepted: the prefix cache needs no breakpoints


class OutputText(_Part):
    """An earlier answer's text, sent back as history."""

    type: Literal["output_text"]
    text: str
    annotations: list[Any] | None = None  # echoed from an output: accepted empty
    logprobs: list[Any] | None = None  # echoed from an output: no effect on the prompt

    _refuse_annotations = field_validator("annotations")(_unsupported_unless_empty)


class InputMessage(_Part):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: text_or(list[by_type(InputText, OutputText)])
    id: str | None = None  # an output message's, sent back
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: Literal["commentary", "final_answer"] | None = None  # a label of OpenAI's models

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionCallItem(_Part):
    """A call the model made earlier, sent back as history."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON text
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(_Part):
    """A call's result, for the model to go on from."""

    type: Literal["function_call_output"]
    call_id: str
    output: text_or(list[by_type(InputText)])
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(part.text for part in self.output)


class SummaryText(_Part):
    type: Literal["summary_text"]
    text: str


class ReasoningText(_Part):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(_Part):
    """Earlier reasoning, sent back: the reasoning_content of the assistant turn it starts,
    which the chat template renders or leaves out (Qwen3's keeps only the current turn's)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[SummaryText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None  # refused: nothing here encrypts reasoning
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    _refuse_encrypted = field_validator("encrypted_content")(_unsupported)

    def text(self) -> str:
        """Its reasoning text, else its summary."""
        if self.content:
            return "".join(part.text for part in self.content)
        return "\n\n".join(part.text for part in self.summary)


InputItem = by_type(InputMessage, FunctionCallItem, FunctionCallOutputItem, ReasoningItem,
                    default="message")


class FunctionTool(_Part):
    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None  # a forced call always follows the schema


class FunctionToolChoice(_Part):
    type: Literal["function"]
    name: str


class TextFormatText(_Part):
    type: Literal["text"]


class TextFormatJSONObject(_Part):
    type: Literal["json_object"]


class TextFormatJSONSchema(_Part):
    type: Literal["json_schema"]
    name: str | None = None  # a label
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None  # a label
    strict: bool | None = None  # every schema is enforced, which is what strict promises


class TextConfig(_Part):
    format: by_type(TextFormatText, TextFormatJSONObject, TextFormatJSONSchema) | None = None
    verbosity: Any = None

    _refuse_verbosity = field_validator("verbosity")(_unsupported)


class ReasoningConfig(_Part):
    """The reasoning parser splits reasoning whatever the request; effort "none" turns a
    reasoning model's thinking off (the chat template's enable_thinking, Qwen3's switch).
    Other efforts and summaries are not configurable here."""

    effort: Any = None
    summary: Any = None
    generate_summary: Any = None
    context: Any = None
    mode: Any = None

    _refuse_options = field_validator("summary", "generate_summary", "context",
                                      "mode")(_unsupported)

    @field_validator("effort")
    @classmethod
    def _check_effort(cls, value: Any) -> Any:
        if value not in (None, "none"):
            raise request_error("effort", "reasoning effort other than 'none' (thinking off) "
                                "is not supported.")
        return value


class ResponsesStreamOptions(_Part):
    include_obfuscation: bool = False  # refused when true: no padding is ever added

    _refuse_obfuscation = field_validator("include_obfuscation")(_unsupported_unless_empty)


class ResponsesRequest(_Request):
    model: str | None = None  # None = the served model
    input: text_or(list[InputItem])
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    previous_response_id: str | None = None
    store: bool | None = None  # None: true, as OpenAI's default
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    metadata: dict[str, str] | None = None
    # extensions (vLLM's names and meanings, as in chat completions)
    top_k: int | None = Field(None, ge=-1, le=MAX_TOP_K)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=MIN_SEED, le=MAX_SEED)
    stop: str | list[str] | None = None
    cache_salt: str | None = None
    priority: int = Field(0, ge=-(2**63), le=2**63 - 1)
    timeout: float | None = Field(None, gt=0.0)
    # accepted, no effect on the output (see the module docstring)
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    service_tier: str | None = None
    truncation: Literal["disabled", "auto"] | None = None
    # refused (see the module docstring)
    background: bool | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    conversation: Any = None
    prompt: Any = None
    context_management: Any = None
    moderation: Any = None
    image: Any = None
    access_programs: Any = None
    background_options: Any = None
    prompt_cache_options: Any = None

    _refuse_empty = field_validator("background", "include")(_unsupported_unless_empty)
    _refuse = field_validator("top_logprobs", "max_tool_calls", "conversation", "prompt",
                              "context_management", "moderation", "image", "access_programs",
                              "background_options", "prompt_cache_options")(_unsupported)

    @field_validator("truncation")
    @classmethod
    def _check_truncation(cls, value: str | None) -> str | None:
        if value == "auto":
            raise request_error("truncation", "truncation 'auto' is not supported: a prompt "
                                "longer than the model's context is refused.")
        return value

    @model_validator(mode="after")
    def _check(self) -> ResponsesRequest:
        if isinstance(self.input, list) and not self.input \
                and self.previous_response_id is None:
            raise request_error("input", "input must not be empty.")
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > MAX_STOP or any(s == "" for s in stops):
            raise request_error("stop", f"Give at most {MAX_STOP} stop strings, none empty.")
        if self.stream_options is not None and not self.stream:
            raise request_error("stream_options",
                                "stream_options is only allowed when stream is true.")
        return self

    @property
    def stored(self) -> bool:
        return self.store is not False


# ---- response -------------------------------------------------------------------------------


class OutputTextPart(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    content: list[OutputTextPart]


class OutputFunctionCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class ReasoningTextPart(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputReasoning(BaseModel):
    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningTextPart]
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


OutputItemModel = OutputMessage | OutputFunctionCall | OutputReasoning


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int

    @classmethod
    def of(cls, usage: UsageInfo) -> ResponseUsage:
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details \
            else 0
        details = usage.completion_tokens_details
        return cls(input_tokens=usage.prompt_tokens,
                   input_tokens_details=InputTokensDetails(cached_tokens=cached),
                   output_tokens=usage.completion_tokens,
                   output_tokens_details=OutputTokensDetails(
                       reasoning_tokens=details.reasoning_tokens if details else 0),
                   total_tokens=usage.total_tokens)


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens", "content_filter"] | None = None  # None: aborted


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=now)
    completed_at: int | None = None
    status: Literal["completed", "incomplete", "in_progress", "failed", "cancelled"]
    error: dict[str, Any] | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItemModel] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    store: bool = True
    temperature: float | None = None
    text: dict[str, Any] | None = None
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_p: float | None = None
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
