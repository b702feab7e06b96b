"""Other APIs over the chat path: a request in, a chat request out; the chat answer back as
output items.

`/v1/responses` and `/v1/messages` have no generation path of their own. Each translates its
request into a ChatCompletionRequest (so one validation, chat template, tool parser,
structured-output and metrics path serves every endpoint) and reads the answer as a sequence
of output items, the unit both APIs are built from: a reasoning item, a text item, a tool
call. Streamed, the chat chunks become item events (start, delta, end) and one Finish; whole,
the assistant message becomes the same items. What the chat path refuses comes back in the
client's field names (`chat_request`, `renamed`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Literal

from pydantic import ValidationError

from pagedserve.entrypoints.server.errors import APIError, bad_request
from pagedserve.entrypoints.server.protocol import (AssistantMessage, ChatCompletionChunk,
                                                    ChatCompletionRequest, UsageInfo)

ItemKind = Literal["reasoning", "text", "tool_call"]
Rename = Callable[[str], str]  # a chat request's field path -> the client's


@dataclass
class OutputItem:
    kind: ItemKind
    text: str = ""  # the reasoning, the text, or the call's arguments (JSON text)
    call_id: str | None = None  # tool calls
    name: str | None = None


@dataclass
class ItemEvent:
    """`start` (empty text), `delta` (`delta` added to the item's text) or `end`."""

    type: Literal["start", "delta", "end"]
    index: int  # the item's position in the output
    item: OutputItem
    delta: str = ""


@dataclass
class Finish:
    finish_reason: str | None  # the chat path's: stop, length, tool_calls, abort
    stop_reason: int | str | None  # the stop string (or token id) that ended it
    usage: UsageInfo = field(default_factory=UsageInfo)


def chat_request(body: dict[str, Any], rename: Rename) -> ChatCompletionRequest:
    """The chat request for a translated body; its validation errors name the client's
    fields (the translation is checked by the chat request's own validators)."""
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        ctx = err.get("ctx") or {}
        loc = ".".join(str(p) for p in err.get("loc", ()) if "[" not in str(p))
        param = ctx.get("param", loc) or None
        client = rename(param) if param else None
        message = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        raise bad_request(_renamed_text(message, param, client), param=client,
                          code=err.get("type")) from exc


def renamed(exc: APIError, rename: Rename) -> APIError:
    """The chat path's error with its field named as the client sent it."""
    if exc.param is None:
        return exc
    client = rename(exc.param)
    return APIError(_renamed_text(exc.message, exc.param, client), exc.status, exc.type,
                    client, exc.code)


def _renamed_text(message: str, param: str | None, client: str | None) -> str:
    if not param or not client or param == client:
        return message
    return message.replace(f"'{param}'", f"'{client}'").replace(param, client)


def message_items(message: AssistantMessage) -> list[OutputItem]:
    """A whole answer's items: its reasoning, its text, then its calls."""
    items = []
    if message.reasoning_content:
        items.append(OutputItem("reasoning", message.reasoning_content))
    if message.content:
        items.append(OutputItem("text", message.content))
    items += [OutputItem("tool_call", c.function.arguments, c.id, c.function.name)
              for c in message.tool_calls]
    return items


async def stream_items(chunks: AsyncIterator[ChatCompletionChunk]
                       ) -> AsyncIterator[ItemEvent | Finish]:
    """A streamed answer (one choice) as item events, then its Finish. An item ends when the
    next begins: a text item after a call is a new item, as both APIs allow."""
    items: list[OutputItem] = []
    finish = Finish(None, None)
    async for chunk in chunks:
        if chunk.usage is not None:
            finish.usage = chunk.usage
        for choice in chunk.choices:
            for kind, text, call in _pieces(choice.delta):
                if call is not None or not items or items[-1].kind != kind:
                    if items:
                        yield ItemEvent("end", len(items) - 1, items[-1])
                    items.append(OutputItem(kind, "", *(call or (None, None))))
                    yield ItemEvent("start", len(items) - 1, items[-1])
                if text:
                    items[-1].text += text
                    yield ItemEvent("delta", len(items) - 1, items[-1], text)
            if choice.finish_reason is not None:
                finish.finish_reason, finish.stop_reason = choice.finish_reason, \
                    choice.stop_reason
    if items:
        yield ItemEvent("end", len(items) - 1, items[-1])
    yield finish


def _pieces(delta: Any) -> list[tuple[ItemKind, str, tuple[str, str] | None]]:
    """(kind, text, (call id, name) when a call starts) for each part of a chat delta."""
    pieces: list[tuple[ItemKind, str, tuple[str, str] | None]] = []
    if delta.reasoning_content:
        pieces.append(("reasoning", delta.reasoning_content, None))
    if delta.content:
        pieces.append(("text", delta.content, None))
    for call in delta.tool_calls or ():
        start = (call.id, call.function.name or "") if call.id is not None else None
        pieces.append(("tool_call", call.function.arguments or "", start))
    return pieces
