"""Anthropic's Messages API (`/v1/messages`) over the chat path (see chat_bridge.py), and
its error shape.

A request becomes a chat request: `system` a system message, text blocks the messages' text,
thinking blocks the assistant's reasoning_content, tool_use blocks its tool calls,
tool_result blocks tool messages, `stop_sequences` the stop strings, `tool_choice` any /
tool the chat's required / named function, `output_config.format` a json_schema
response_format, `thinking` the template's enable_thinking and the thinking budget. A last
assistant message is continued (Anthropic's prefill: continue_final_message). The answer's
items become content blocks (thinking, text, tool_use) and its finish reason the stop_reason
(end_turn, max_tokens, stop_sequence with the sequence, tool_use).
`/v1/messages/count_tokens` renders the same prompt and counts it.

Streamed, the events are Anthropic's: message_start, ping, then per block
content_block_start, content_block_delta (text_delta, input_json_delta, thinking_delta) and
content_block_stop, then message_delta (stop reason and usage) and message_stop; each is
`event: <type>` and its JSON. An engine failure mid-stream is an `error` event.

Errors are Anthropic's `{"type": "error", "error": {"type", "message"}}` with the field at
fault leading the message (`max_tokens: ...`), whatever part of the server raised them
(`AnthropicErrors` rewrites the OpenAI-shaped bodies of every other layer on these paths).
"""

from __future__ import annotations

import json
import re
from typing import Any, AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedserve.entrypoints.server.async_engine import EngineDeadError
from pagedserve.entrypoints.server.chat_bridge import (Finish, ItemEvent, OutputItem,
                                                       chat_request, message_items, renamed,
                                                       stream_items)
from pagedserve.entrypoints.server.errors import SERVER_ERROR, APIError
from pagedserve.entrypoints.server.messages_protocol import (
    MessagesRequest, MessageTokensRequest, TextBlock, ThinkingBlock, ThinkingDisabled,
    ThinkingEnabled, ToolChoiceAny, ToolChoiceAuto, ToolChoiceNone, ToolChoiceTool,
    ToolResultBlock, ToolUseBlock)
from pagedserve.entrypoints.server.protocol import ChatCompletionRequest, UsageInfo
from pagedserve.entrypoints.server.serving import ChatRun, EventStreamResponse, OpenAIServing

MESSAGES_PATHS = frozenset({"/v1/messages", "/v1/messages/count_tokens"})


class MessagesServing:
    """/v1/messages, whole or streamed."""

    def __init__(self, chat: OpenAIServing) -> None:
        self.chat = chat

    async def create(self, req: MessagesRequest, raw: Request,
                     prepare: Callable[[ChatCompletionRequest], None] = lambda _: None
                     ) -> Response:
        """`prepare`: what the server adds to every chat request (the key's cache salt)."""
        chat_req = chat_request(_chat_body(req), _client_field)
        prepare(chat_req)
        try:
            run = await self.chat.submit_chat(chat_req)
        except APIError as exc:
            raise renamed(exc, _client_field) from exc
        message_id = run.base_id.replace("chatcmpl-", "msg_")
        if req.stream:
            return EventStreamResponse(self._events(req, run, message_id), on_close=run.abort)
        try:  # a grammar the engine core could not compile is refused here
            answer = await self.chat.chat_response(run, raw)
        except APIError as exc:
            raise renamed(exc, _client_field) from exc
        choice = answer.choices[0]
        stop_reason, stop_sequence = _stop(req, choice.finish_reason, choice.stop_reason)
        return JSONResponse({
            "id": message_id, "type": "message", "role": "assistant", "model": req.model,
            "content": [_block(item) for item in message_items(choice.message)],
            "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": _usage(answer.usage)})

    async def count_tokens(self, req: MessageTokensRequest) -> dict[str, int]:
        """The prompt's tokens as /v1/messages would render it (template, tools, thinking)."""
        chat_req = chat_request(_prompt_body(req), _client_field)
        try:
            return {"input_tokens": await self.chat.count_prompt_tokens(chat_req)}
        except APIError as exc:
            raise renamed(exc, _client_field) from exc

    async def _events(self, req: MessagesRequest, run: ChatRun, message_id: str
                      ) -> AsyncIterator[str]:
        yield _event("message_start", message={
            "id": message_id, "type": "message", "role": "assistant", "model": req.model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": run.prompt_tokens, "output_tokens": 0}})
        yield _event("ping")
        try:
            async for ev in stream_items(self.chat.chat_chunks(run)):
                if isinstance(ev, Finish):
                    stop_reason, stop_sequence = _stop(req, ev.finish_reason, ev.stop_reason)
                    yield _event("message_delta", delta={"stop_reason": stop_reason,
                                                         "stop_sequence": stop_sequence},
                                 usage=_usage(ev.usage))
                    yield _event("message_stop")
                    return
                yield _block_event(ev)
        except (EngineDeadError, APIError) as exc:
            error = renamed(exc, _client_field) if isinstance(exc, APIError) \
                else APIError(str(exc), 503, SERVER_ERROR)
            yield _event("error", error=_error(error.status, error.message, error.param))


def _event(type_: str, **fields: Any) -> str:
    data = json.dumps({"type": type_, **fields}, ensure_ascii=False)
    return f"event: {type_}\ndata: {data}\n\n"


def _block_event(ev: ItemEvent) -> str:
    if ev.type == "start":
        return _event("content_block_start", index=ev.index, content_block=_block(ev.item, True))
    if ev.type == "end":
        return _event("content_block_stop", index=ev.index)
    kind = ev.item.kind
    delta = {"type": "text_delta", "text": ev.delta} if kind == "text" else \
        {"type": "thinking_delta", "thinking": ev.delta} if kind == "reasoning" else \
        {"type": "input_json_delta", "partial_json": ev.delta}
    return _event("content_block_delta", index=ev.index, delta=delta)


def _block(item: OutputItem, started: bool = False) -> dict[str, Any]:
    """A content block; `started`: as content_block_start sends it, before any delta."""
    if item.kind == "text":
        return {"type": "text", "text": "" if started else item.text}
    if item.kind == "reasoning":
        return {"type": "thinking", "thinking": "" if started else item.text, "signature": ""}
    return {"type": "tool_use", "id": item.call_id, "name": item.name,
            "input": {} if started else json.loads(item.text or "{}")}


def _stop(req: MessagesRequest, finish_reason: str | None,
          stop_reason: int | str | None) -> tuple[str | None, str | None]:
    """Anthropic's stop_reason and stop_sequence for the chat's finish."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(stop_reason, str) and stop_reason in (req.stop_sequences or ()):
        return "stop_sequence", stop_reason
    return "end_turn", None


def _usage(usage: UsageInfo | None) -> dict[str, int]:
    """Anthropic counts cached prompt tokens apart from the rest of the input."""
    usage = usage or UsageInfo()
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return {"input_tokens": usage.prompt_tokens - cached, "output_tokens": usage.completion_tokens,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


# ---- the request as a chat request ----------------------------------------------------------

def _chat_body(req: MessagesRequest) -> dict[str, Any]:
    body = _prompt_body(req)
    body.update({"max_completion_tokens": req.max_tokens, "stop": req.stop_sequences,
                 "stream": req.stream, "temperature": req.temperature, "top_p": req.top_p,
                 "top_k": req.top_k})
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    if req.output_config is not None and req.output_config.format is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "output", "schema": req.output_config.format.schema_}}
    return {k: v for k, v in body.items() if v is not None}


def _prompt_body(req: MessageTokensRequest) -> dict[str, Any]:
    """What makes the prompt: messages, system, tools and their choice, thinking."""
    messages = []
    if req.system is not None:
        messages.append({"role": "system", "content": req.system if isinstance(req.system, str)
                         else "".join(block.text for block in req.system)})
    for message in req.messages:
        messages += _chat_messages(message.role, message.content)
    body: dict[str, Any] = {"model": req.model, "messages": messages}
    last = req.messages[-1]
    if last.role == "assistant" and not _has_tool_use(last.content):
        body.update(continue_final_message=True, add_generation_prompt=False)
    if req.tools:
        body["tools"] = [{"type": "function", "function": {
            "name": t.name, "description": t.description, "parameters": t.input_schema,
            "strict": t.strict}} for t in req.tools]
    body.update(_tool_choice(req))
    body.update(_thinking(req))
    return body


def _tool_choice(req: MessageTokensRequest) -> dict[str, Any]:
    choice = req.tool_choice
    if choice is None:
        return {}
    fields: dict[str, Any] = {}
    if isinstance(choice, ToolChoiceAuto):
        fields["tool_choice"] = "auto"
    elif isinstance(choice, ToolChoiceAny):
        fields["tool_choice"] = "required"
    elif isinstance(choice, ToolChoiceTool):
        fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    elif isinstance(choice, ToolChoiceNone):
        fields["tool_choice"] = "none"
    if getattr(choice, "disable_parallel_tool_use", None) is not None:
        fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    return fields


def _thinking(req: MessageTokensRequest) -> dict[str, Any]:
    """Thinking as the chat path's reasoning fields: the template's enable_thinking (Qwen3's
    switch), the thinking budget, and whether the thinking is returned."""
    thinking = req.thinking
    if thinking is None:
        return {}
    fields: dict[str, Any] = {
        "chat_template_kwargs": {"enable_thinking": not isinstance(thinking, ThinkingDisabled)}}
    if isinstance(thinking, ThinkingEnabled):
        fields["thinking_token_budget"] = thinking.budget_tokens
    if getattr(thinking, "display", None) == "omitted":
        fields["include_reasoning"] = False
    return fields


def _has_tool_use(content: str | list[Any]) -> bool:
    return not isinstance(content, str) and any(isinstance(b, ToolUseBlock) for b in content)


def _chat_messages(role: str, content: str | list[Any]) -> list[dict[str, Any]]:
    """One message's blocks as chat messages: its text (one message per run of text
    blocks), an assistant's thinking (reasoning_content) and calls, and each tool result as a
    tool message, in order."""
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    messages: list[dict[str, Any]] = []

    def current() -> dict[str, Any]:
        if not messages or messages[-1]["role"] != role:
            messages.append({"role": role, "content": ""})
        return messages[-1]

    for block in content:
        if isinstance(block, TextBlock):
            current()["content"] += block.text
        elif isinstance(block, ToolUseBlock):
            current().setdefault("tool_calls", []).append({
                "id": block.id, "type": "function",
                "function": {"name": block.name,
                             "arguments": json.dumps(block.input, ensure_ascii=False)}})
        elif isinstance(block, ToolResultBlock):
            text = block.text()
            messages.append({"role": "tool", "tool_call_id": block.tool_use_id,
                             "content": f"Error: {text}" if block.is_error else text})
        elif isinstance(block, ThinkingBlock):  # the turn's reasoning, for the template
            turn = current()
            turn["reasoning_content"] = turn.get("reasoning_content", "") + block.thinking
    return messages


_TOOL_FIELD = re.compile(r"tools\.(\d+)\.function\.(.+)")
_CHAT_TOOL_FIELDS = {"parameters": "input_schema"}


def _client_field(param: str) -> str:
    """A chat request's field as the Messages request names it."""
    if param == "messages" or param.startswith("messages."):
        return "messages"
    if param in ("max_completion_tokens", "max_tokens"):
        return "max_tokens"
    if param == "stop":
        return "stop_sequences"
    if param.startswith("response_format") or param == "structured_outputs":
        return "output_config.format"
    if param.startswith("tool_choice"):
        return "tool_choice"
    if param == "thinking_token_budget":
        return "thinking.budget_tokens"
    if param.startswith("chat_template_kwargs"):
        return "thinking"
    tool = _TOOL_FIELD.fullmatch(param)
    if tool:
        return f"tools.{tool[1]}.{_CHAT_TOOL_FIELDS.get(tool[2], tool[2])}"
    return param


# ---- errors ---------------------------------------------------------------------------------

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 408: "timeout_error",
                413: "request_too_large", 429: "rate_limit_error", 529: "overloaded_error"}


def _error(status: int, message: str, param: str | None) -> dict[str, str]:
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    named = param and param not in message  # the message may name it already
    return {"type": kind, "message": f"{param}: {message}" if named else message}


class AnthropicErrors:
    """Error responses on the Messages paths in Anthropic's shape. Every layer of the server
    (key check, body limit, validation, handlers) answers in OpenAI's shape; this outermost
    layer rewrites those bodies on these paths, so no layer needs to know the route."""

    def __init__(self, app: ASGIApp, paths: frozenset[str] = MESSAGES_PATHS) -> None:
        self.app, self.paths = app, paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in self.paths:
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        body = b""

        async def rewrite(message: Message) -> None:
            nonlocal start, body
            if message["type"] == "http.response.start" and message["status"] >= 400:
                start = message
                return
            if start is None or message["type"] != "http.response.body":
                await send(message)
                return
            body += message.get("body", b"")
            if message.get("more_body", False):
                return
            new = _anthropic_body(start["status"], body)
            headers = [(k, v) for k, v in start.get("headers", [])
                       if k.lower() != b"content-length"]
            headers.append((b"content-length", str(len(new)).encode()))
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": new})

        await self.app(scope, receive, rewrite)


def _anthropic_body(status: int, body: bytes) -> bytes:
    try:
        error = json.loads(body)["error"]
        message, param = str(error["message"]), error.get("param")
    except (ValueError, KeyError, TypeError):
        message, param = body.decode("utf-8", "replace") or "error", None
    return json.dumps({"type": "error", "error": _error(status, message, param)},
                      ensure_ascii=False).encode()
