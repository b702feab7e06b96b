"""Pydantic models of Anthropic's Messages API (`/v1/messages`): the request, and the
count_tokens request (its prompt-making part).

The request follows protocol.py's rule: every field is honored, accepted with no effect, or
refused with a 400 naming it, and unknown fields are refused.
- honored: model, messages (text, tool_use and tool_result blocks; a last assistant message
  is continued, Anthropic's prefill), system, max_tokens (required), stop_sequences, stream,
  temperature, top_p, top_k, tools, tool_choice (auto, any, tool, none;
  disable_parallel_tool_use), output_config.format (a JSON schema: structured outputs),
  a tool_result's is_error (the model reads the result as an error), an assistant's thinking
  blocks (its reasoning_content, for the chat template);
- honored for reasoning models: thinking (the chat template's `enable_thinking`: false when
  disabled, true when enabled or adaptive; budget_tokens the thinking budget; display
  "omitted" leaves the thinking out of the answer);
- accepted with no effect on the output: metadata.user_id and service_tier (Anthropic's
  routing and abuse monitoring), cache_control (prefix caching here is automatic), a
  tool's strict (a forced call always follows its schema), a thinking block's signature;
- refused: citations, output_config.effort, thinking display "summarized" (the thinking is
  returned whole, never summarized), and every block but text, tool_use, tool_result and
  thinking (images, documents, redacted thinking, server tools).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from pagedserve.entrypoints.server.protocol import (MAX_STOP, MAX_TOP_K, _Part, _Request,
                                                    _unsupported, _unsupported_unless_empty,
                                                    by_type, request_error, text_or)


class CacheControl(_Part):
    """Accepted: the prefix cache keeps every prompt's blocks without being asked."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(_Part):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[Any] | None = None  # refused unless empty

    _refuse_citations = field_validator("citations")(_unsupported_unless_empty)


class ToolUseBlock(_Part):
    """A call the assistant made earlier."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(_Part):
    type: Literal["tool_result"]
    tool_use_id: str
    content: text_or(list[by_type(TextBlock)]) | None = None
    is_error: bool = False
    cache_control: CacheControl | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(block.text for block in self.content)


class ThinkingBlock(_Part):
    """Earlier reasoning: the assistant turn's reasoning_content, which the chat template
    renders or leaves out (Qwen3's keeps only the current turn's); the signature is not
    checked (nothing here signs thinking)."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


Block = by_type(TextBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock)


class MessageParam(_Part):
    role: Literal["user", "assistant"]
    content: text_or(list[Block])


class ToolDefinition(_Part):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None
    strict: bool | None = None


class ToolChoiceAuto(_Part):
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAny(_Part):
    type: Literal["any"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceTool(_Part):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNone(_Part):
    type: Literal["none"]


class ThinkingDisabled(_Part):
    type: Literal["disabled"]


class ThinkingEnabled(_Part):
    type: Literal["enabled"]
    budget_tokens: int = Field(ge=1)
    display: Literal["summarized", "omitted"] | None = None


class ThinkingAdaptive(_Part):
    type: Literal["adaptive"]
    display: Literal["summarized", "omitted"] | None = None


class Metadata(_Part):
    user_id: str | None = None


class JSONOutputFormat(_Part):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Part):
    format: JSONOutputFormat | None = None
    effort: Any = None

    _refuse_effort = field_validator("effort")(_unsupported)


class MessageTokensRequest(_Request):
    """/v1/messages/count_tokens: what makes the prompt (the output's fields are not here;
    output_config.format holds the output only, so it leaves the count as it is)."""

    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: text_or(list[by_type(TextBlock)]) | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: by_type(ToolChoiceAuto, ToolChoiceAny, ToolChoiceTool, ToolChoiceNone) | None \
        = None
    thinking: by_type(ThinkingDisabled, ThinkingEnabled, ThinkingAdaptive) | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheControl | None = None  # accepted (see the module docstring)

    @field_validator("thinking")
    @classmethod
    def _check_thinking(cls, value: Any) -> Any:
        if getattr(value, "display", None) == "summarized":
            raise request_error("thinking.display", "thinking display 'summarized' is not "
                                "supported: the thinking is returned whole ('omitted' leaves "
                                "it out).")
        return value


class MessagesRequest(MessageTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=MAX_TOP_K)  # 0: no top-k cut
    # accepted, no effect on the output (see the module docstring)
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None

    @model_validator(mode="after")
    def _check(self) -> MessagesRequest:
        stops = self.stop_sequences or []
        if len(stops) > MAX_STOP or any(s == "" for s in stops):
            raise request_error("stop_sequences",
                                f"Give at most {MAX_STOP} stop sequences, none empty.")
        return self
