"""OpenAI's Responses API (`/v1/responses`) over the chat path (see chat_bridge.py).

A request becomes a chat request: `instructions` a system message, the input items chat
messages (an assistant turn's reasoning, text and function_call items one assistant message
with reasoning_content and tool calls, function_call_output items tool messages),
`text.format` the response_format, `max_output_tokens` max_completion_tokens,
`reasoning.effort` "none" the template's enable_thinking false; the answer's items become
output items (reasoning, message, function_call). With `previous_response_id` the stored
conversation of that response (its input, earlier turns and its output; not its
instructions, which OpenAI does not carry over) comes before the new input. Responses are
stored unless `store` is false (`ResponseStore`: in memory, bounded).

Streamed, the events are the Responses sequence: response.created, response.in_progress,
then per output item output_item.added, content_part.added (messages and reasoning), the
deltas (output_text / reasoning_text / function_call_arguments), their .done events,
content_part.done, output_item.done, and last response.completed (response.incomplete when
max_output_tokens cut the answer). Each event is `event: <type>` and its JSON, numbered by
sequence_number; there is no `[DONE]`. An engine failure mid-stream is an `error` event then
response.failed.
"""

from __future__ import annotations

import itertools
import json
import re
import uuid
from typing import Any, AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagedserve.entrypoints.server.async_engine import EngineDeadError
from pagedserve.entrypoints.server.chat_bridge import (Finish, ItemEvent, OutputItem,
                                                       chat_request, message_items, renamed,
                                                       stream_items)
from pagedserve.entrypoints.server.errors import SERVER_ERROR, APIError
from pagedserve.entrypoints.server.protocol import ChatCompletionRequest, UsageInfo, now
from pagedserve.entrypoints.server.response_store import ResponseStore
from pagedserve.entrypoints.server.responses_protocol import (
    FunctionCallItem, FunctionCallOutputItem, FunctionToolChoice, IncompleteDetails,
    InputMessage, OutputFunctionCall, OutputItemModel, OutputMessage, OutputReasoning,
    OutputTextPart, ReasoningTextPart, ResponseObject, ResponsesRequest, ResponseUsage,
    TextFormatJSONObject, TextFormatJSONSchema)
from pagedserve.entrypoints.server.serving import ChatRun, EventStreamResponse, OpenAIServing

# request fields the chat request takes as they are, when given
_SAME_FIELDS = ("model", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                "presence_penalty", "frequency_penalty", "seed", "stop", "cache_salt",
                "priority", "timeout")


class ResponsesServing:
    """/v1/responses: create (whole or streamed), retrieve and delete stored responses."""

    def __init__(self, chat: OpenAIServing, store: ResponseStore) -> None:
        self.chat, self.store = chat, store

    async def create(self, req: ResponsesRequest, raw: Request,
                     prepare: Callable[[ChatCompletionRequest], None] = lambda _: None
                     ) -> Response:
        """`prepare`: what the server adds to every chat request (the key's cache salt)."""
        conversation = self._history(req) + _input_messages(req.input)
        chat_req = chat_request(_chat_body(req, conversation), _client_field)
        prepare(chat_req)
        try:
            run = await self.chat.submit_chat(chat_req)
        except APIError as exc:
            raise renamed(exc, _client_field) from exc
        response_id = _id("resp")
        if req.stream:
            return EventStreamResponse(self._events(req, run, response_id, conversation),
                                       on_close=run.abort)
        try:  # a grammar the engine core could not compile is refused here
            answer = await self.chat.chat_response(run, raw)
        except APIError as exc:
            raise renamed(exc, _client_field) from exc
        choice = answer.choices[0]
        items = [_item_model(item, "completed") for item in message_items(choice.message)]
        response = self._response(req, response_id, items, choice.finish_reason, answer.usage)
        self._store(req, response, conversation, items)
        return JSONResponse(response)

    def retrieve(self, response_id: str) -> dict[str, Any]:
        return self._stored(response_id, "response_id").response

    def delete(self, response_id: str) -> dict[str, Any]:
        if not self.store.delete(response_id):
            raise _not_found(response_id, "response_id")
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    def _history(self, req: ResponsesRequest) -> list[dict[str, Any]]:
        if req.previous_response_id is None:
            return []
        return list(self._stored(req.previous_response_id, "previous_response_id").conversation)

    def _stored(self, response_id: str, param: str) -> Any:
        entry = self.store.get(response_id)
        if entry is None:
            raise _not_found(response_id, param)
        return entry

    def _store(self, req: ResponsesRequest, response: dict[str, Any],
               conversation: list[dict[str, Any]], items: list[OutputItemModel]) -> None:
        if req.stored:
            self.store.put(response, conversation + _output_messages(items))

    def _response(self, req: ResponsesRequest, response_id: str, items: list[OutputItemModel],
                  finish_reason: str | None, usage: UsageInfo | None) -> dict[str, Any]:
        """The response object; finish_reason None: still in progress."""
        status, incomplete = "completed", None
        if finish_reason is None:
            status = "in_progress"
        elif finish_reason in ("length", "abort"):
            status = "incomplete"
            incomplete = IncompleteDetails(
                reason="max_output_tokens" if finish_reason == "length" else None)
        fmt = req.text.format if req.text is not None and req.text.format is not None else None
        return ResponseObject(
            id=response_id, status=status, incomplete_details=incomplete,
            completed_at=now() if status == "completed" else None,
            instructions=req.instructions, max_output_tokens=req.max_output_tokens,
            model=self.chat.answering_model(req.model), output=items,
            parallel_tool_calls=req.parallel_tool_calls is not False,
            previous_response_id=req.previous_response_id,
            reasoning=req.reasoning.model_dump() if req.reasoning is not None else None,
            store=req.stored, temperature=req.temperature, top_p=req.top_p,
            text={"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt
                  else {"type": "text"}},
            tool_choice=req.tool_choice.model_dump() if isinstance(
                req.tool_choice, FunctionToolChoice) else (req.tool_choice or "auto"),
            tools=[t.model_dump(exclude_none=True) for t in req.tools or ()],
            usage=ResponseUsage.of(usage) if usage else None,
            user=req.user, metadata=req.metadata or {}).model_dump()

    async def _events(self, req: ResponsesRequest, run: ChatRun, response_id: str,
                      conversation: list[dict[str, Any]]) -> AsyncIterator[str]:
        numbers = itertools.count()

        def event(type_: str, **fields: Any) -> str:
            data = {"type": type_, "sequence_number": next(numbers), **fields}
            return f"event: {type_}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

        started = self._response(req, response_id, [], None, None)
        yield event("response.created", response=started)
        yield event("response.in_progress", response=started)
        items: list[OutputItemModel] = []
        try:
            async for ev in stream_items(self.chat.chat_chunks(run)):
                if isinstance(ev, Finish):
                    response = self._response(req, response_id, items, ev.finish_reason,
                                              ev.usage)
                    self._store(req, response, conversation, items)
                    done = "response.completed" if response["status"] == "completed" \
                        else "response.incomplete"
                    yield event(done, response=response)
                    return
                for type_, fields in _item_events(ev, items):
                    yield event(type_, **fields)
        except (EngineDeadError, APIError) as exc:
            error = renamed(exc, _client_field) if isinstance(exc, APIError) \
                else APIError(str(exc), 503, SERVER_ERROR)
            yield event("error", code=error.code or error.type, message=error.message,
                        param=error.param)
            failed = self._response(req, response_id, items, None, None)
            failed.update(status="failed", error={"code": error.code or error.type,
                                                  "message": error.message})
            yield event("response.failed", response=failed)


def _item_events(ev: ItemEvent, items: list[OutputItemModel]
                 ) -> list[tuple[str, dict[str, Any]]]:
    """The Responses events of one item event; `items` holds the output so far."""
    if ev.type == "start":
        items.append(_item_model(ev.item, "in_progress"))
    model = items[ev.index]
    where = {"item_id": model.id, "output_index": ev.index}
    part = {"content_index": 0, **where}
    kind = ev.item.kind
    if ev.type == "start":
        added = [("response.output_item.added", {"output_index": ev.index,
                                                 "item": model.model_dump()})]
        if kind == "text":
            added.append(("response.content_part.added",
                          {**part, "part": OutputTextPart(text="").model_dump()}))
        elif kind == "reasoning":
            added.append(("response.content_part.added",
                          {**part, "part": ReasoningTextPart(text="").model_dump()}))
        return added
    if ev.type == "delta":
        if kind == "text":
            return [("response.output_text.delta", {**part, "delta": ev.delta, "logprobs": []})]
        if kind == "reasoning":
            return [("response.reasoning_text.delta", {**part, "delta": ev.delta})]
        return [("response.function_call_arguments.delta", {**where, "delta": ev.delta})]
    items[ev.index] = model = _item_model(ev.item, "completed", model.id)
    item_done = ("response.output_item.done", {"output_index": ev.index,
                                               "item": model.model_dump()})
    if kind == "tool_call":
        return [("response.function_call_arguments.done",
                 {**where, "arguments": ev.item.text}), item_done]
    if kind == "text":
        done = ("response.output_text.done", {**part, "text": ev.item.text, "logprobs": []})
        part_model = OutputTextPart(text=ev.item.text)
    else:
        done = ("response.reasoning_text.done", {**part, "text": ev.item.text})
        part_model = ReasoningTextPart(text=ev.item.text)
    return [done, ("response.content_part.done", {**part, "part": part_model.model_dump()}),
            item_done]


def _item_model(item: OutputItem, status: str, item_id: str | None = None) -> OutputItemModel:
    """The output item; in progress, with no content yet."""
    started = status == "in_progress"
    if item.kind == "text":
        return OutputMessage(id=item_id or _id("msg"), status=status,
                             content=[] if started else [OutputTextPart(text=item.text)])
    if item.kind == "reasoning":
        return OutputReasoning(id=item_id or _id("rs"), status=status,
                               content=[] if started else [ReasoningTextPart(text=item.text)])
    return OutputFunctionCall(id=item_id or _id("fc"), call_id=item.call_id, name=item.name,
                              arguments="" if started else item.text, status=status)


def _input_messages(input_: str | list[Any]) -> list[dict[str, Any]]:
    """The input as chat messages. An assistant turn's items (its reasoning, its text, its
    calls) become one assistant message, as chat templates expect: the reasoning as its
    reasoning_content (for the template to render or leave out), the calls as tool_calls."""
    if isinstance(input_, str):
        return [{"role": "user", "content": input_}]
    messages: list[dict[str, Any]] = []
    for item in input_:
        if isinstance(item, InputMessage) and item.role == "assistant":
            _assistant_turn(messages, text=True)["content"] = item.text()
        elif isinstance(item, InputMessage):
            messages.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            _assistant_turn(messages).setdefault("tool_calls", []).append({
                "id": item.call_id, "type": "function",
                "function": {"name": item.name, "arguments": item.arguments}})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": item.text()})
        else:  # reasoning: what the assistant thought before what follows
            turn = _assistant_turn(messages, text=True, reasoning=True)
            turn["reasoning_content"] = (turn.get("reasoning_content") or "") + item.text()
    return messages


def _assistant_turn(messages: list[dict[str, Any]], text: bool = False,
                    reasoning: bool = False) -> dict[str, Any]:
    """The assistant message an item joins: the last message when it is the assistant's
    and has not yet passed the item's place (reasoning, then text, then calls), else a new
    one."""
    last = messages[-1] if messages else None
    fits = last is not None and last["role"] == "assistant" and not last.get("tool_calls") \
        and not (text and last["content"] is not None) \
        and not (reasoning and last.get("reasoning_content") is not None)
    if not fits:
        messages.append({"role": "assistant", "content": None})
    return messages[-1]


def _output_messages(items: list[OutputItemModel]) -> list[dict[str, Any]]:
    """The answer as the assistant's chat message, for a later previous_response_id."""
    reasoning = "".join(part.text for item in items if isinstance(item, OutputReasoning)
                        for part in item.content)
    text = "".join(part.text for item in items if isinstance(item, OutputMessage)
                   for part in item.content)
    calls = [{"id": item.call_id, "type": "function",
              "function": {"name": item.name, "arguments": item.arguments}}
             for item in items if isinstance(item, OutputFunctionCall)]
    if not (reasoning or text or calls):
        return []
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = calls
    return [message]


def _chat_body(req: ResponsesRequest, conversation: list[dict[str, Any]]) -> dict[str, Any]:
    system = [{"role": "system", "content": req.instructions}] \
        if req.instructions is not None else []
    body: dict[str, Any] = {name: getattr(req, name) for name in _SAME_FIELDS
                            if getattr(req, name) is not None}
    body.update(messages=system + conversation, max_completion_tokens=req.max_output_tokens,
                stream=req.stream)
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(
            exclude={"type"}, exclude_none=True)} for t in req.tools]
    if isinstance(req.tool_choice, FunctionToolChoice):
        body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
    elif req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice
    if req.parallel_tool_calls is not None:
        body["parallel_tool_calls"] = req.parallel_tool_calls
    if req.reasoning is not None and req.reasoning.effort == "none":
        body["chat_template_kwargs"] = {"enable_thinking": False}
    fmt = req.text.format if req.text is not None else None
    if isinstance(fmt, TextFormatJSONObject):
        body["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, TextFormatJSONSchema):
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name or "response", "schema": fmt.schema_}}
    return {k: v for k, v in body.items() if v is not None}


_TOOL_FIELD = re.compile(r"tools\.(\d+)\.function\.(.+)")


def _client_field(param: str) -> str:
    """A chat request's field as the Responses request names it."""
    if param == "messages" or param.startswith("messages."):
        return "input"
    if param in ("max_completion_tokens", "max_tokens"):
        return "max_output_tokens"
    if param.startswith("response_format") or param == "structured_outputs":
        return "text.format"
    if param.startswith("tool_choice"):
        return "tool_choice"
    if param.startswith("chat_template_kwargs"):
        return "reasoning.effort"
    tool = _TOOL_FIELD.fullmatch(param)
    if tool:
        return f"tools.{tool[1]}.{tool[2]}"
    return param


def _not_found(response_id: str, param: str) -> APIError:
    return APIError(f"No stored response with id '{response_id}' (never stored, deleted, or "
                    "evicted from the server's bounded store).", 404, param=param,
                    code="response_not_found")


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"
