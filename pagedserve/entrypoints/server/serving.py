"""OpenAI completions and chat completions on top of AsyncEngine.

Each handler validates and tokenizes up front, submits one engine request per prompt (the
engine fans out `n` itself), and only then answers: so every bad input becomes a 400 before
a stream has started, and a request the engine refused never holds a block. Streaming uses
the engine's per-output deltas (`text_delta` is already held back where a stop string might
still truncate it, so a streamed character is never taken back).

Every engine request is aborted when its HTTP exchange ends for any reason; aborting a
finished request is a no-op, so this is the simple way to guarantee that a client that goes
away mid-request gives its blocks back.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.entrypoints.llm import encode_chat
from pagedserve.entrypoints.server.async_engine import AsyncEngine, EngineDeadError
from pagedserve.entrypoints.server.errors import (SERVER_ERROR, APIError, bad_request,
                                                  model_not_found)
from pagedserve.entrypoints.server.protocol import (
    AssistantMessage, ChatChoice, ChatCompletionChunk, ChatCompletionRequest,
    ChatCompletionResponse, ChatLogprobs, ChatStreamChoice, ChatTokenLogprob, CompletionChoice,
    CompletionLogprobs, CompletionRequest, CompletionResponse, DeltaMessage, PromptTokensDetails,
    TopLogprob, UsageInfo, SamplingRequest, random_id)

_DISCONNECT_POLL_S = 1.0  # how often a non-streaming handler checks that its client is there


@dataclass
class _EngineRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams


class OpenAIServing:
    """Turns protocol requests into engine requests and engine outputs into responses."""

    def __init__(self, engine: AsyncEngine, model_name: str, accepted_names: Iterable[str],
                 tokenizer: Any, max_model_len: int) -> None:
        self.engine = engine
        self.model_name = model_name
        self.accepted_names = {model_name, *accepted_names}
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    # ---- endpoints -------------------------------------------------------------------------

    async def create_completion(self, req: CompletionRequest, raw: Request) -> Response:
        self._check_model(req.model)
        base_id = random_id("cmpl")
        prompts = req.prompts()
        if not prompts:
            raise bad_request("prompt must not be empty", param="prompt")
        requests = []
        for i, prompt in enumerate(prompts):
            token_ids = self._tokenize_prompt(prompt)
            params = self._sampling_params(req, len(token_ids), req.max_tokens, req.logprobs)
            text = prompt if isinstance(prompt, str) else None
            requests.append(_EngineRequest(f"{base_id}-{i}", text, token_ids, params))
        streams = await self._submit(requests, req)
        if req.stream:
            return _SSEResponse(self._completion_events(req, base_id, streams),
                                on_close=lambda: self._abort(requests))
        finals = await _unless_disconnected(_collect(streams), raw, lambda: self._abort(requests))
        return JSONResponse(CompletionResponse(
            id=base_id, model=self.model_name,
            choices=[self._completion_choice(i * req.n + c.index, c, req.logprobs)
                     for i, out in enumerate(finals) for c in out.outputs],
            usage=_usage(finals)).model_dump())

    async def create_chat_completion(self, req: ChatCompletionRequest, raw: Request) -> Response:
        self._check_model(req.model)
        base_id = random_id("chatcmpl")
        token_ids = self._apply_chat_template(req)
        top = (req.top_logprobs or 0) if req.logprobs else None
        params = self._sampling_params(req, len(token_ids), req.max_new_tokens, top)
        requests = [_EngineRequest(base_id, None, token_ids, params)]
        streams = await self._submit(requests, req)
        if req.stream:
            return _SSEResponse(self._chat_events(req, base_id, streams[0]),
                                on_close=lambda: self._abort(requests))
        final, = await _unless_disconnected(_collect(streams), raw, lambda: self._abort(requests))
        return JSONResponse(ChatCompletionResponse(
            id=base_id, model=self.model_name,
            choices=[ChatChoice(index=c.index, message=AssistantMessage(content=c.text),
                                logprobs=self._chat_logprobs(c.logprobs, c.token_ids, top),
                                finish_reason=c.finish_reason, stop_reason=c.stop_reason)
                     for c in final.outputs],
            usage=_usage([final])).model_dump())

    # ---- validation and engine submission ----------------------------------------------------

    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in self.accepted_names:
            raise model_not_found(model)

    def _tokenize_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise bad_request("prompt must not be empty", param="prompt")
            return list(self.tokenizer.encode(prompt))
        if not prompt:
            raise bad_request("prompt must not be empty", param="prompt")
        return list(prompt)  # the engine checks the ids against the vocabulary

    def _apply_chat_template(self, req: ChatCompletionRequest) -> list[int]:
        """The same rendering as `LLM.chat`, so the server and the offline API agree."""
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                    for m in req.messages]
        try:
            return encode_chat(self.tokenizer, messages, req.add_generation_prompt)
        except Exception as exc:  # no template, or one that rejects the roles' order
            raise bad_request(f"cannot apply the chat template: {exc}", param="messages") from exc

    def _sampling_params(self, req: SamplingRequest, num_prompt_tokens: int,
                         max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        room = self.max_model_len - num_prompt_tokens
        if room < 1:
            raise bad_request(
                f"the prompt is {num_prompt_tokens} tokens, which leaves no room to generate "
                f"within the model's limit of {self.max_model_len} tokens",
                param="messages" if isinstance(req, ChatCompletionRequest) else "prompt",
                code="context_length_exceeded")
        if max_tokens is not None and max_tokens > room:
            raise bad_request(
                f"max_tokens is {max_tokens} but the prompt ({num_prompt_tokens} tokens) leaves "
                f"room for at most {room} within the model's limit of {self.max_model_len}",
                param="max_tokens", code="context_length_exceeded")
        try:
            return SamplingParams(
                n=req.n,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=req.top_k or 0,
                min_p=req.min_p or 0.0,
                repetition_penalty=req.repetition_penalty or 1.0,
                presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty,
                seed=req.seed,
                max_tokens=room if max_tokens is None else max_tokens,
                stop=req.stop,
                stop_token_ids=req.stop_token_ids,
                ignore_eos=req.ignore_eos,
                logprobs=logprobs)
        except ValueError as exc:
            raise bad_request(str(exc), param=_param_named_in(str(exc), req)) from exc

    async def _submit(self, requests: list[_EngineRequest],
                      req: SamplingRequest) -> list[AsyncIterator[Any]]:
        """Add every engine request; if one is refused, abort the ones already added."""
        extra = {"cache_salt": req.cache_salt if req.cache_salt is not None else req.user}
        streams = []
        try:
            for r in requests:
                streams.append(await self.engine.add_request(
                    r.request_id, prompt=r.prompt, params=r.params,
                    prompt_token_ids=r.prompt_token_ids, **extra))
        except BaseException as exc:
            self._abort(requests)
            if isinstance(exc, ValueError):  # the engine's checks concern the prompt
                raise bad_request(str(exc), param=_prompt_param(req)) from exc
            if isinstance(exc, EngineDeadError):
                raise APIError(str(exc), 503, SERVER_ERROR) from exc
            raise
        return streams

    def _abort(self, requests: list[_EngineRequest]) -> None:
        for r in requests:
            self.engine.abort(r.request_id)

    # ---- streaming -------------------------------------------------------------------------

    async def _completion_events(self, req: CompletionRequest, base_id: str,
                                 streams: list[AsyncIterator[Any]]) -> AsyncIterator[str]:
        finals: dict[int, Any] = {}
        async for i, out in _merge(streams):
            for c in out.outputs:
                if not (c.text_delta or c.finish_reason or
                        (req.logprobs is not None and c.token_ids_delta)):
                    continue
                delta_lp = _tail(c.logprobs, len(c.token_ids_delta))
                choice = self._completion_choice(i * req.n + c.index, c, req.logprobs,
                                                 text=c.text_delta, logprobs=delta_lp)
                yield _sse(CompletionResponse(id=base_id, model=self.model_name,
                                              choices=[choice]))
            if out.finished:
                finals[i] = out
        if req.stream_options and req.stream_options.include_usage:
            yield _sse(CompletionResponse(id=base_id, model=self.model_name, choices=[],
                                          usage=_usage([finals[i] for i in sorted(finals)])))

    async def _chat_events(self, req: ChatCompletionRequest, base_id: str,
                           stream: AsyncIterator[Any]) -> AsyncIterator[str]:
        top = (req.top_logprobs or 0) if req.logprobs else None

        def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> str:
            return _sse(ChatCompletionChunk(id=base_id, model=self.model_name, choices=choices,
                                            usage=usage))

        for index in range(req.n):
            yield chunk([ChatStreamChoice(index=index,
                                          delta=DeltaMessage(role="assistant", content=""))])
        final = None
        async for out in stream:
            for c in out.outputs:
                if not (c.text_delta or c.finish_reason or (top is not None and c.token_ids_delta)):
                    continue
                new_ids = c.token_ids[len(c.token_ids) - len(c.token_ids_delta):]
                lp = self._chat_logprobs(_tail(c.logprobs, len(new_ids)), new_ids, top)
                yield chunk([ChatStreamChoice(
                    index=c.index, delta=DeltaMessage(content=c.text_delta or None), logprobs=lp,
                    finish_reason=c.finish_reason, stop_reason=c.stop_reason)])
            final = out
        if req.stream_options and req.stream_options.include_usage:
            yield chunk([], usage=_usage([final]))

    # ---- output conversion -----------------------------------------------------------------

    def _completion_choice(self, index: int, c: Any, num_top: int | None, text: str | None = None,
                           logprobs: list | None = None) -> CompletionChoice:
        if text is None:
            text, logprobs = c.text, c.logprobs
        token_ids = c.token_ids[len(c.token_ids) - len(logprobs):] if logprobs else []
        return CompletionChoice(
            index=index, text=text, finish_reason=c.finish_reason, stop_reason=c.stop_reason,
            logprobs=None if num_top is None else
            self._completion_logprobs(logprobs or [], token_ids, num_top))

    def _completion_logprobs(self, logprobs: list[dict], token_ids: list[int],
                             num_top: int) -> CompletionLogprobs:
        result, offset = CompletionLogprobs(), 0
        for token_id, entries in zip(token_ids, logprobs):
            token = self._token_text(token_id, entries)
            result.tokens.append(token)
            result.token_logprobs.append(_sampled_logprob(token_id, entries))
            result.top_logprobs.append({self._token_text(t, entries): lp.logprob
                                        for t, lp in _top(entries, num_top, token_id)})
            result.text_offset.append(offset)
            offset += len(token)
        return result

    def _chat_logprobs(self, logprobs: list[dict] | None, token_ids: list[int],
                       num_top: int | None) -> ChatLogprobs | None:
        if num_top is None:
            return None
        content = []
        for token_id, entries in zip(token_ids, logprobs or []):
            token = self._token_text(token_id, entries)
            content.append(ChatTokenLogprob(
                token=token, logprob=_sampled_logprob(token_id, entries),
                bytes=list(token.encode()),
                top_logprobs=[TopLogprob(token=(t_text := self._token_text(t, entries)),
                                         logprob=lp.logprob, bytes=list(t_text.encode()))
                              for t, lp in _top(entries, num_top, None)]))
        return ChatLogprobs(content=content)

    def _token_text(self, token_id: int, entries: dict) -> str:
        entry = entries.get(token_id)
        if entry is not None and entry.decoded_token is not None:
            return entry.decoded_token
        return self.tokenizer.decode([token_id])


# ---- helpers --------------------------------------------------------------------------------


def _prompt_param(req: SamplingRequest) -> str:
    return "messages" if isinstance(req, ChatCompletionRequest) else "prompt"


def _param_named_in(message: str, req: SamplingRequest) -> str | None:
    """The request field a SamplingParams message starts with ("top_p must be ...")."""
    name = message.split(" ", 1)[0]
    return name if name in type(req).model_fields else None


def _sampled_logprob(token_id: int, entries: dict) -> float:
    entry = entries.get(token_id)
    return entry.logprob if entry is not None else float("-inf")


def _top(entries: dict, num_top: int, also: int | None) -> list[tuple[int, Any]]:
    """The `num_top` most likely alternatives (by rank), plus `also` when given."""
    ranked = sorted(entries.items(), key=lambda kv: kv[1].rank)
    return [(t, lp) for t, lp in ranked if lp.rank <= num_top or t == also]


def _tail(items: list | None, count: int) -> list:
    if not items or count <= 0:
        return []
    return items[-count:]


def _usage(finals: list[Any]) -> UsageInfo:
    prompt = sum(len(out.prompt_token_ids) for out in finals)
    completion = sum(len(c.token_ids) for out in finals for c in out.outputs)
    cached = sum(out.num_cached_tokens or 0 for out in finals)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                     total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def _sse(payload: BaseModel | dict) -> str:
    data = payload.model_dump() if isinstance(payload, BaseModel) else payload
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _merge(streams: list[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """Interleave several output streams as (stream index, output), in arrival order."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[Any]) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
            queue.put_nowait((i, None))
        except Exception as exc:  # noqa: BLE001 - re-raised in the consumer below
            queue.put_nowait((i, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


async def _collect(streams: list[AsyncIterator[Any]]) -> list[Any]:
    """The final output of every stream, in stream order."""
    finals: dict[int, Any] = {}
    async for i, out in _merge(streams):
        finals[i] = out
    return [finals[i] for i in range(len(streams))]


async def _unless_disconnected(work: Awaitable[Any], raw: Request,
                               on_disconnect: Callable[[], None]) -> Any:
    """Await `work`, but give up (and abort) if the client closes the connection meanwhile.

    Nothing cancels a non-streaming handler when its client leaves, so we poll.
    """
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                try:
                    return task.result()
                except EngineDeadError as exc:
                    raise APIError(str(exc), 503, SERVER_ERROR) from exc
            if await raw.is_disconnected():
                on_disconnect()
                raise APIError("client disconnected", 499)
    finally:
        if not task.done():
            task.cancel()


class _SSEResponse(StreamingResponse):
    """Server-sent events ending in `[DONE]`; runs `on_close` however the stream ends.

    Starlette cancels the body iterator when the client disconnects, but a cancellation that
    lands before the iterator starts would skip its cleanup, so the abort hook sits here.
    An engine failure mid-stream becomes an OpenAI error event, since the status is sent.
    """

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(_with_done(events), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def _with_done(events: AsyncIterator[str]) -> AsyncIterator[str]:
    try:
        async for event in events:
            yield event
    except (EngineDeadError, APIError) as exc:
        error = exc if isinstance(exc, APIError) else APIError(str(exc), 503, SERVER_ERROR)
        yield _sse(error.body())
    yield "data: [DONE]\n\n"
