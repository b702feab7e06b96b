"""OpenAI completions and chat completions on top of AsyncEngine.

Each handler validates and tokenizes up front, submits one engine request per prompt (the
engine fans out `n` itself), and only then answers: so every bad input becomes a 400 before
a stream has started, and a request the engine refused never holds a block. What needs the
model (prompt length, token ids, grammars) is checked by the engine's Processor alone; its
RequestError names the engine's field, which becomes the field the client sent (`prompt` is
`messages` in a chat, `max_tokens` may be `max_completion_tokens`, a grammar is the field
that asked for it). Streaming uses
the engine's per-output deltas (`text_delta` is already held back where a stop string might
still truncate it, so a streamed character is never taken back).

Every engine request is aborted when its HTTP exchange ends for any reason; aborting a
finished request is a no-op, so this is the simple way to guarantee that a client that goes
away mid-request gives its blocks back.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from pagedserve.entrypoints.chat_template import encode_chat
from pagedserve.entrypoints.server import reasoning, tool_parsers
from pagedserve.entrypoints.server.async_engine import AsyncEngine, EngineDeadError
from pagedserve.entrypoints.server.errors import (SERVER_ERROR, APIError, bad_request,
                                                  model_not_found)
from pagedserve.entrypoints.server.protocol import (
    AssistantMessage, ChatChoice, ChatCompletionChunk, ChatCompletionRequest,
    ChatCompletionResponse, ChatLogprobs, ChatStreamChoice, ChatTokenLogprob, CompletionChoice,
    CompletionLogprobs, CompletionTokensDetails, CompletionRequest, CompletionResponse, DeltaFunctionCall, DeltaMessage,
    DeltaToolCall, DetokenizeRequest, DetokenizeResponse, FunctionCall, NamedToolChoice,
    PromptLogprob, PromptLogprobs, PromptTokensDetails, SamplingRequest, TokenizeRequest,
    TokenizeResponse, ToolCall, TopLogprob, UsageInfo, random_id)
from pagedserve.errors import RequestError
from pagedserve.messages import LoRARequest
from pagedserve.sampling_params import SamplingParams
from pagedserve.structured.params import StructuredOutputsParams
from pagedserve.thinking_budget import ThinkingBudget

_DISCONNECT_POLL_S = 1.0  # how often a non-streaming handler checks that its client is there


@dataclass(frozen=True)
class ChatSettings:
    """The server's chat options: how a chat is rendered and how its output is read.
    `tool_call_parser` / `reasoning_parser` None: picked from the chat template when it says
    unambiguously (tool_parsers / reasoning); `chat_template` replaces the tokenizer's;
    `template_kwargs` are every request's template variables (a request's own win)."""

    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    chat_template: str | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class ChatRun:
    """A chat request submitted to the engine: what its answer is read from."""

    req: ChatCompletionRequest
    base_id: str
    tools: list[dict] | None  # what the model was shown (None: no tools, or tool_choice none)
    thinking: reasoning.PromptReasoning | None  # how its output's reasoning is split off
    stream: AsyncIterator[Any]  # the engine's RequestOutputs
    abort: Callable[[], None]  # frees its blocks; a no-op once it has finished
    prompt_tokens: int  # as rendered, before any truncate_prompt_tokens


@dataclass
class _EngineRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    lora_request: LoRARequest | None = None  # the adapter its `model` named


class OpenAIServing:
    """Turns protocol requests into engine requests and engine outputs into responses."""

    def __init__(self, engine: AsyncEngine, model_name: str, accepted_names: Iterable[str],
                 tokenizer: Any, max_model_len: int, chat: ChatSettings = ChatSettings()
                 ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.accepted_names = {model_name, *accepted_names}
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.chat = chat
        template = chat.chat_template or getattr(tokenizer, "chat_template", None)
        self.template_has_tools = tool_parsers.template_supports_tools(template)
        # None: no format to read calls in (an ambiguous template; tool_parsers says why)
        self.tool_call_parser = chat.tool_call_parser or tool_parsers.parser_for_template(
            template)
        name = chat.reasoning_parser or reasoning.parser_for_template(template)
        self.reasoning = reasoning.get_reasoning_parser(name) if name else None

    def answering_model(self, requested: str | None) -> str:
        """The `model` an answer names: the LoRA adapter the request selected (as vLLM answers),
        else the served model's name, also for an alias."""
        return requested if requested and requested not in self.accepted_names else (
            self.model_name)

    # ---- endpoints -------------------------------------------------------------------------

    async def create_completion(self, req: CompletionRequest, raw: Request) -> Response:
        lora = self._check_model(req.model)
        base_id = random_id("cmpl")
        params = self._sampling_params(req, req.max_tokens, req.logprobs)
        requests = []
        for i, prompt in enumerate(req.prompts()):
            token_ids = await asyncio.to_thread(self._tokenize_prompt, prompt)
            text = prompt if isinstance(prompt, str) else None
            requests.append(_EngineRequest(f"{base_id}-{i}", text, token_ids, params, lora))
        streams = await self._submit(requests, req)
        if req.stream:
            return EventStreamResponse(_with_done(self._completion_events(req, base_id, streams)),
                                       on_close=lambda: self._abort(requests))
        finals = await _unless_disconnected(_collect(streams), raw, lambda: self._abort(requests))
        return JSONResponse(CompletionResponse(
            id=base_id, model=self.answering_model(req.model),
            choices=[self._completion_choice(i * req.n + c.index, c, req.logprobs,
                                             prompt_logprobs=_prompt_logprobs(out))
                     for i, out in enumerate(finals) for c in out.outputs],
            usage=_usage(finals)).model_dump())

    async def create_chat_completion(self, req: ChatCompletionRequest, raw: Request) -> Response:
        run = await self.submit_chat(req)
        if req.stream:
            return EventStreamResponse(_with_done(_sse_each(self.chat_chunks(run))),
                                       on_close=run.abort)
        return JSONResponse((await self.chat_response(run, raw)).model_dump())

    # ---- the chat path's seams: the other APIs (/v1/responses, /v1/messages) translate their
    # requests into a ChatCompletionRequest and read its answer through these, so every
    # endpoint shares one validation, template, reasoning, tool and structured-output path

    async def submit_chat(self, req: ChatCompletionRequest) -> ChatRun:
        """Validate, render and submit a chat request: 400s are raised here, before any
        answer starts."""
        lora = self._check_model(req.model)
        base_id = random_id("chatcmpl")
        tools = _tools_for(req)
        top = (req.top_logprobs or 0) if req.logprobs else None
        self._check_tool_parser(req, tools)
        params = self._sampling_params(req, req.max_new_tokens, top,
                                       _forced_tool_outputs(req, tools))
        params = self._chat_output_params(req, tools, params)
        await self._check_tool_schemas(req)
        token_ids = await asyncio.to_thread(self._apply_chat_template, req, tools)
        token_ids = self._open_block_for_grammar(req, params, token_ids)
        thinking = self._prompt_reasoning(req, token_ids)
        params = self._grammar_after_reasoning(params, thinking)
        params = self._with_thinking_budget(req, params, thinking)
        requests = [_EngineRequest(base_id, None, token_ids, params, lora)]
        streams = await self._submit(requests, req)
        return ChatRun(req, base_id, tools, thinking, streams[0],
                       lambda: self._abort(requests), len(token_ids))

    async def count_prompt_tokens(self, req: ChatCompletionRequest) -> int:
        """The tokens of the prompt `submit_chat` would submit (nothing is submitted)."""
        self._check_model(req.model)
        tools = _tools_for(req)
        self._check_tool_parser(req, tools)
        return len(await asyncio.to_thread(self._apply_chat_template, req, tools))

    async def chat_response(self, run: ChatRun, raw: Request) -> ChatCompletionResponse:
        """The whole answer (aborted if the client leaves first)."""
        req = run.req
        top = (req.top_logprobs or 0) if req.logprobs else None
        final, = await _unless_disconnected(_collect([run.stream]), raw, run.abort)
        choices = []
        for c in final.outputs:
            message, finish_reason = self._assistant_message(req, run.tools, c, run.thinking)
            if req.echo:
                message.content = _echo_text(req) + (message.content or "")
            choices.append(ChatChoice(
                index=c.index, message=message, finish_reason=finish_reason,
                logprobs=self._chat_logprobs(c.logprobs, c.token_ids, top),
                stop_reason=c.stop_reason))
        return ChatCompletionResponse(
            id=run.base_id, model=self.answering_model(req.model), choices=choices,
            usage=_usage([final], self._reasoning_tokens(run, final)),
            prompt_logprobs=_prompt_logprobs(final))

    def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        self._check_model(req.model)
        if req.prompt is not None:
            tokens = list(self.tokenizer.encode(req.prompt,
                                                add_special_tokens=req.add_special_tokens))
        else:
            tokens = self._render_chat(req.messages, None, req.add_generation_prompt,
                                       template_kwargs=req.chat_template_kwargs)
        return TokenizeResponse(count=len(tokens), max_model_len=self.max_model_len,
                                tokens=tokens)

    def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        self._check_model(req.model)
        vocab = len(self.tokenizer)
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})",
                              param="tokens")
        return DetokenizeResponse(prompt=self.tokenizer.decode(req.tokens))

    # ---- validation and engine submission ----------------------------------------------------

    def _check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter `model` names, None for the base model; 404 for any other."""
        if model is None or model in self.accepted_names:
            return None
        loras = self.engine.loras
        if loras is not None and model in loras.by_name:
            return loras.by_name[model]
        raise model_not_found(model)

    def _tokenize_prompt(self, prompt: str | list[int]) -> list[int]:
        """Token ids; the engine checks them (empty, vocabulary, length)."""
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt))
        return list(prompt)

    def _apply_chat_template(self, req: ChatCompletionRequest,
                             tools: list[dict] | None) -> list[int]:
        return self._render_chat(req.messages, tools, req.generation_prompt,
                                 req.continue_final_message, req.chat_template_kwargs)

    def _check_tool_parser(self, req: ChatCompletionRequest, tools: list[dict] | None) -> None:
        """Tools under "auto" need a format to read the calls in: never a guessed one."""
        if tools and req.effective_tool_choice == "auto" and self.tool_call_parser is None:
            raise bad_request("This model's chat template matches no known tool-call format, "
                              "so its calls cannot be read: start the server with "
                              "--tool-call-parser (tool_choice 'required' or a named function "
                              "works without it).", param="tools")

    def _chat_output_params(self, req: ChatCompletionRequest, tools: list[dict] | None,
                            params: SamplingParams) -> SamplingParams:
        """What the tool parser needs of the output text: its markers, when they are special
        tokens (Mistral's [TOOL_CALLS]), kept unless the request says otherwise."""
        if tools and req.effective_tool_choice == "auto" \
                and tool_parsers.needs_special_tokens(self.tool_call_parser) \
                and "skip_special_tokens" not in req.model_fields_set:
            return dataclasses.replace(params, skip_special_tokens=False)
        return params

    def _open_block_for_grammar(self, req: ChatCompletionRequest, params: SamplingParams,
                                token_ids: list[int]) -> list[int]:
        """A grammar on a prompt that leaves the think block to the model (Qwen3's hybrid
        template with thinking on) holds after the block, as vLLM's: the prompt gets the
        block's opening, so the model thinks first (reasoning.py says why the server opens it).
        A prompt without the generation prompt (continued, or the caller's own) is left as it
        is."""
        if self.reasoning is None or params.structured_outputs is None \
                or not req.generation_prompt:
            return token_ids
        return self.reasoning.open_block(self.tokenizer, token_ids)

    def _prompt_reasoning(self, req: ChatCompletionRequest, token_ids: list[int]
                          ) -> reasoning.PromptReasoning | None:
        """The reasoning parser bound to this prompt; None when reasoning is not split out.
        An output held by a grammar (structured outputs, a forced tool call) thinks first
        only where the prompt opened the block: its grammar then starts after the block
        (`_grammar_after_reasoning`). Otherwise the grammar holds from the first token, so
        no block is ever opened (a forced call has no reasoning to split)."""
        if self.reasoning is None:
            return None
        bound = self.reasoning.for_prompt(self.tokenizer, token_ids)
        forced_call = req.effective_tool_choice not in ("auto", "none")
        if bound.starts_inside or not (forced_call or req.output_constraint() is not None):
            return bound
        return None if forced_call else reasoning.PromptReasoning(self.reasoning, False)

    def _grammar_after_reasoning(self, params: SamplingParams,
                                 thinking: reasoning.PromptReasoning | None) -> SamplingParams:
        """A grammar on an output that starts inside the think block holds only after the
        block's end marker (as vLLM's), so the model thinks first."""
        spec = params.structured_outputs
        if spec is None or thinking is None or not thinking.starts_inside:
            return params
        after = thinking.parser.end_token_ids(self.tokenizer)
        return dataclasses.replace(
            params, structured_outputs=dataclasses.replace(spec, starts_after=after))

    def _with_thinking_budget(self, req: ChatCompletionRequest, params: SamplingParams,
                              thinking: reasoning.PromptReasoning | None) -> SamplingParams:
        if req.thinking_token_budget is None:
            return params
        if thinking is None:
            why = ("the server has no reasoning parser (--reasoning-parser)"
                   if self.reasoning is None
                   else "a forced tool call has no reasoning unless the prompt opens the block")
            raise bad_request(f"thinking_token_budget needs a thinking block: {why}.",
                              param="thinking_token_budget")
        parser = thinking.parser
        budget = ThinkingBudget(req.thinking_token_budget, parser.start_token_ids(self.tokenizer),
                                parser.end_token_ids(self.tokenizer), thinking.starts_inside)
        try:
            return dataclasses.replace(params, thinking_budget=budget)
        except RequestError as exc:
            raise _refusal(exc, req) from exc

    async def _check_tool_schemas(self, req: ChatCompletionRequest) -> None:
        """Each tool's parameters must compile as a JSON schema, as a forced call's do, so
        a tool is refused or accepted whatever the tool_choice."""
        for i, tool in enumerate(req.tools or ()):
            schema = tool.function.parameters
            if schema is None:
                continue
            try:
                # on the grammar threads, within the server's size and time limits
                await self.engine.check_structured_outputs(StructuredOutputsParams(json=schema))
            except RequestError as exc:
                raise bad_request(f"Invalid parameters schema for tool {tool.function.name!r}: "
                                  f"{exc}", param=f"tools.{i}.function.parameters") from exc

    def _render_chat(self, chat: list, tools: list[dict] | None,
                     add_generation_prompt: bool, continue_final_message: bool = False,
                     template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """The same rendering as `LLM.chat`, so the server and the offline API agree.

        Tools go to the template (transformers' `tools=`); a template that does not use them
        gets them as a system message in the hermes format instead, and past calls as hermes
        text, so that no part of the conversation is dropped."""
        messages = [self._template_message(m) for m in chat]
        if tools and not self.template_has_tools:
            prompt = tool_parsers.fallback_tools_prompt(tools)
            if messages[0]["role"] == "system":
                messages[0]["content"] = messages[0]["content"] + "\n\n" + prompt
            else:
                messages.insert(0, {"role": "system", "content": prompt})
            tools = None
        try:
            return encode_chat(self.tokenizer, messages, add_generation_prompt, tools=tools,
                               continue_final_message=continue_final_message,
                               chat_template=self.chat.chat_template,
                               template_kwargs={**self.chat.template_kwargs,
                                                **(template_kwargs or {})})
        except Exception as exc:  # no template, or one that rejects the roles' order
            raise bad_request(f"cannot apply the chat template: {exc}", param="messages") from exc

    def _template_message(self, m: Any) -> dict:
        message = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.tool_calls:
            calls = [c.model_dump() for c in m.tool_calls]
            if self.template_has_tools:
                message["tool_calls"] = tool_parsers.template_tool_calls(calls)
            else:
                text = tool_parsers.render_tool_calls_text(calls)
                message["content"] = (message["content"] + "\n" + text).strip()
        if m.reasoning_content is not None or m.reasoning is not None:
            message["reasoning_content"] = m.reasoning_content or m.reasoning or ""
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            message["name"] = m.name
        return message

    def _assistant_message(self, req: ChatCompletionRequest, tools: list[dict] | None,
                           c: Any, thinking: reasoning.PromptReasoning | None
                           ) -> tuple[AssistantMessage, str | None]:
        """The choice's message with its reasoning and tool calls parsed out (the calls from
        the text after the reasoning), and its finish reason."""
        calls: list[tool_parsers.ParsedToolCall] = []
        split = thinking.split(c.text) if thinking else reasoning.Split(None, c.text)
        content = split.content
        choice = req.effective_tool_choice
        if tools and choice == "required":  # the complete calls, as streaming sends them
            calls, content = tool_parsers.parse_forced_prefix(content or ""), None
        elif tools and c.finish_reason == "stop":
            if choice == "auto":
                content, calls = tool_parsers.parse_tool_calls(
                    self.tool_call_parser, content or "", tools)
                calls = calls if req.parallel_tool_calls else calls[:1]
            else:  # held by the grammar (after any reasoning), so it parses
                calls = tool_parsers.parse_forced(content or "", _named(choice))
                content = None
        thought = split.reasoning if req.include_reasoning else None
        message = AssistantMessage(content=content, reasoning_content=thought, reasoning=thought,
                                   tool_calls=[_tool_call(t) for t in calls])
        return message, "tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason

    def _sampling_params(self, req: SamplingRequest, max_tokens: int | None,
                         logprobs: int | None,
                         forced_tool: StructuredOutputsParams | None = None) -> SamplingParams:
        """The engine's parameters; max_tokens None: up to the model's limit."""
        constraint = req.output_constraint()
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
                max_tokens=max_tokens,
                stop=req.stop,
                stop_token_ids=req.stop_token_ids,
                include_stop_str_in_output=req.include_stop_str_in_output,
                ignore_eos=req.ignore_eos,
                logprobs=logprobs,
                prompt_logprobs=req.prompt_logprobs,
                min_tokens=req.min_tokens,
                skip_special_tokens=req.skip_special_tokens,
                spaces_between_special_tokens=req.spaces_between_special_tokens,
                truncate_prompt_tokens=req.truncate_prompt_tokens,
                allowed_token_ids=req.allowed_token_ids,
                bad_words=req.bad_words,
                logit_bias={int(k): v for k, v in req.logit_bias.items()}
                if req.logit_bias else None,
                structured_outputs=forced_tool or (constraint[1] if constraint else None),
                priority=req.priority)
        except RequestError as exc:
            raise _refusal(exc, req) from exc

    async def _submit(self, requests: list[_EngineRequest],
                      req: SamplingRequest) -> list[AsyncIterator[Any]]:
        """Add every engine request; if one is refused, abort the ones already added. A
        refusal that comes later, from a stream (the engine core could not compile the
        grammar the server's own compile accepted), names the client's field too."""
        streams = []
        try:
            for r in requests:
                streams.append(await self.engine.add_request(
                    r.request_id, prompt=r.prompt, params=r.params,
                    prompt_token_ids=r.prompt_token_ids, cache_salt=req.cache_salt,
                    timeout=req.timeout, lora_request=r.lora_request))
        except BaseException as exc:
            self._abort(requests)
            if isinstance(exc, RequestError):
                raise _refusal(exc, req) from exc
            if isinstance(exc, EngineDeadError):
                raise APIError(str(exc), 503, SERVER_ERROR) from exc
            raise
        return [_refusing(stream, req) for stream in streams]

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
                yield _sse(CompletionResponse(id=base_id, model=self.answering_model(req.model),
                                              choices=[choice]))
            if out.finished:
                finals[i] = out
        if req.stream_options and req.stream_options.include_usage:
            yield _sse(CompletionResponse(id=base_id, model=self.answering_model(req.model),
                                          choices=[],
                                          usage=_usage([finals[i] for i in sorted(finals)])))

    async def chat_chunks(self, run: ChatRun) -> AsyncIterator[ChatCompletionChunk]:
        """The answer as chat completion chunks, as a stream sends them."""
        req, base_id, stream, tools, thinking = (run.req, run.base_id, run.stream, run.tools,
                                                 run.thinking)
        top = (req.top_logprobs or 0) if req.logprobs else None

        def chunk(choices: list[ChatStreamChoice],
                  usage: UsageInfo | None = None) -> ChatCompletionChunk:
            return ChatCompletionChunk(id=base_id, model=self.answering_model(req.model),
                                       choices=choices, usage=usage)

        for index in range(req.n):
            yield chunk([ChatStreamChoice(index=index,
                                          delta=DeltaMessage(role="assistant", content=""))])
        echo = _echo_text(req)
        if echo:
            for index in range(req.n):
                yield chunk([ChatStreamChoice(index=index, delta=DeltaMessage(content=echo))])
        choices = {i: _ChatStream(req, tools, self.tool_call_parser, thinking)
                   for i in range(req.n)}
        final = None
        async for out in stream:
            for c in out.outputs:
                if not (c.text_delta or c.finish_reason or (top is not None and c.token_ids_delta)):
                    continue
                new_ids = c.token_ids[len(c.token_ids) - len(c.token_ids_delta):]
                lp = self._chat_logprobs(_tail(c.logprobs, len(new_ids)), new_ids, top)
                deltas, finish_reason = choices[c.index].deltas(c)
                for k, delta in enumerate(deltas):
                    last = k == len(deltas) - 1
                    yield chunk([ChatStreamChoice(
                        index=c.index, delta=delta, logprobs=lp if last else None,
                        finish_reason=finish_reason if last else None,
                        stop_reason=c.stop_reason if last else None)])
            final = out
        if req.stream_options and req.stream_options.include_usage:
            yield chunk([], usage=_usage([final], self._reasoning_tokens(run, final)))

    def _reasoning_tokens(self, run: ChatRun, final: Any) -> int | None:
        """The think blocks' tokens over the choices; None without a reasoning parser."""
        if run.thinking is None:
            return None
        return sum(run.thinking.count_tokens(c.text, c.token_ids, self.tokenizer)
                   for c in final.outputs)

    # ---- output conversion -----------------------------------------------------------------

    def _completion_choice(self, index: int, c: Any, num_top: int | None, text: str | None = None,
                           logprobs: list | None = None,
                           prompt_logprobs: PromptLogprobs | None = None) -> CompletionChoice:
        if text is None:
            text, logprobs = c.text, c.logprobs
        token_ids = c.token_ids[len(c.token_ids) - len(logprobs):] if logprobs else []
        return CompletionChoice(
            index=index, text=text, finish_reason=c.finish_reason, stop_reason=c.stop_reason,
            prompt_logprobs=prompt_logprobs,
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


def _client_param(param: str | None, req: SamplingRequest) -> str | None:
    """The request field a RequestError's engine field stands for."""
    if param == "prompt":
        return _prompt_param(req)
    if param == "thinking_budget":
        return "thinking_token_budget"
    if param == "max_tokens" and isinstance(req, ChatCompletionRequest) \
            and req.max_completion_tokens is not None:
        return "max_completion_tokens"
    if param == "structured_outputs":
        if isinstance(req, ChatCompletionRequest) and req.tools \
                and req.effective_tool_choice not in ("auto", "none"):
            return "tools"
        constraint = req.output_constraint()
        return constraint[0] if constraint else param
    return param


def _refusal(exc: RequestError, req: SamplingRequest) -> APIError:
    """A 400 for what the engine refused, in the client's field names."""
    param = _client_param(exc.param, req)
    return bad_request(exc.message_for(param), param=param, code=exc.code)


async def _refusing(stream: AsyncIterator[Any], req: SamplingRequest) -> AsyncIterator[Any]:
    """`stream`, with a RequestError it raises turned into `_refusal`'s 400: a whole answer
    is that 400, a stream that has started sends it as its error event."""
    try:
        async for out in stream:
            yield out
    except RequestError as exc:
        raise _refusal(exc, req) from None
    finally:
        await stream.aclose()  # its end (an abort if unfinished) now, not when collected


def _echo_text(req: ChatCompletionRequest) -> str:
    """vLLM's chat echo: the answer starts with the last message when it is the assistant's
    (the one being continued), and with nothing otherwise."""
    last = req.messages[-1]
    return last.text() if req.echo and last.role == "assistant" else ""


def _tools_for(req: ChatCompletionRequest) -> list[dict] | None:
    """The tools the model sees: none when tool_choice is "none"."""
    if not req.tools or req.effective_tool_choice == "none":
        return None
    return [t.model_dump(exclude_none=True) for t in req.tools]


def _named(choice: str | NamedToolChoice) -> str | None:
    return choice.function.name if isinstance(choice, NamedToolChoice) else None


def _forced_tool_outputs(req: ChatCompletionRequest, tools: list[dict] | None
                         ) -> StructuredOutputsParams | None:
    """`required` and a named function: the output is held to a call by a JSON schema."""
    choice = req.effective_tool_choice
    if not tools or choice == "auto":
        return None
    return StructuredOutputsParams(json=tool_parsers.forced_tool_schema(
        tools, _named(choice), req.parallel_tool_calls))


def _tool_call(call: tool_parsers.ParsedToolCall) -> ToolCall:
    return ToolCall(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments))


class _ChatStream:
    """One streamed choice's deltas: its reasoning split off first (when the server has a
    reasoning parser), then the content (the text after the reasoning) read for tool calls."""

    def __init__(self, req: ChatCompletionRequest, tools: list[dict] | None,
                 parser: str | None, thinking: reasoning.PromptReasoning | None) -> None:
        self.include_reasoning = req.include_reasoning
        self.reasoning = thinking.stream() if thinking else None
        self.tools = _ToolStream(req.effective_tool_choice, parser, tools,
                                 req.parallel_tool_calls) if tools else None
        self.content = ""  # the content so far (the tool parser reads it whole)

    def deltas(self, c: Any) -> tuple[list[DeltaMessage], str | None]:
        """The deltas for this output of the choice (at least one), and its finish reason."""
        thought, text = "", c.text_delta
        if self.reasoning is not None:
            part = self.reasoning.feed(c.text_delta)
            thought, text = part.reasoning, part.content
            if c.finish_reason is not None:
                rest = self.reasoning.finish()
                thought, text = thought + rest.reasoning, text + rest.content
        self.content += text
        out = []
        if thought and self.include_reasoning:
            out.append(DeltaMessage(reasoning_content=thought, reasoning=thought))
        finish_reason = c.finish_reason
        if self.tools is not None:
            out += [d for d in self.tools.deltas(self.content, c.finish_reason)
                    if d != DeltaMessage()]
            if self.tools.num_calls and finish_reason == "stop":
                finish_reason = "tool_calls"
        elif text:
            out.append(DeltaMessage(content=text))
        return out or [DeltaMessage()], finish_reason


class _ToolStream:
    """One streamed choice's text turned into content and tool-call deltas: a named call's
    arguments as they are written, complete calls otherwise (see tool_parsers)."""

    def __init__(self, choice: str | NamedToolChoice, parser: str | None, tools: list[dict],
                 parallel: bool = True) -> None:
        self.named = _named(choice)
        self.required = choice == "required"
        self.parsed = tool_parsers.ToolCallStream(parser, tools) if parser else None
        self.max_calls = None if parallel or self.required else 1  # required: by the grammar
        self.num_calls = 0
        self._sent = 0  # characters of a named call's arguments sent

    def deltas(self, text: str, finish_reason: str | None) -> list[DeltaMessage]:
        if self.named is not None:
            return self._named_deltas(text)
        if self.required:
            calls = tool_parsers.parse_forced_prefix(text)[self.num_calls:]
            content = ""
        elif finish_reason is None:
            content, calls = self.parsed.feed(text)
        else:
            content, calls = self.parsed.finish(text)
        out = [DeltaMessage(content=content)] if content else []
        if self.max_calls is not None:
            calls = calls[:max(self.max_calls - self.num_calls, 0)]
        for call in calls:
            out += self._call_deltas(call)
        return out or [DeltaMessage()]

    def _named_deltas(self, text: str) -> list[DeltaMessage]:
        out = []
        if self.num_calls == 0:
            out += self._call_deltas(tool_parsers.ParsedToolCall(self.named, ""))
        arguments, self._sent = text[self._sent:], len(text)
        if arguments:
            out.append(DeltaMessage(tool_calls=[DeltaToolCall(
                index=0, function=DeltaFunctionCall(arguments=arguments))]))
        return out or [DeltaMessage()]

    def _call_deltas(self, call: tool_parsers.ParsedToolCall) -> list[DeltaMessage]:
        index, self.num_calls = self.num_calls, self.num_calls + 1
        head = DeltaMessage(tool_calls=[DeltaToolCall(
            index=index, id=call.id, type="function",
            function=DeltaFunctionCall(name=call.name, arguments=""))])
        if not call.arguments:
            return [head]
        return [head, DeltaMessage(tool_calls=[DeltaToolCall(
            index=index, function=DeltaFunctionCall(arguments=call.arguments))])]


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


def _prompt_logprobs(out: Any) -> PromptLogprobs | None:
    """The engine's prompt logprobs in the wire shape (ids as keys, vLLM's fields)."""
    if out.prompt_logprobs is None:
        return None
    return [None if entry is None else
            {t: PromptLogprob(logprob=lp.logprob, rank=lp.rank, decoded_token=lp.decoded_token)
             for t, lp in entry.items()}
            for entry in out.prompt_logprobs]


def _usage(finals: list[Any], reasoning_tokens: int | None = None) -> UsageInfo:
    prompt = sum(len(out.prompt_token_ids) for out in finals)
    completion = sum(len(c.token_ids) for out in finals for c in out.outputs)
    cached = sum(out.num_cached_tokens or 0 for out in finals)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                     total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
                     completion_tokens_details=None if reasoning_tokens is None
                     else CompletionTokensDetails(reasoning_tokens=reasoning_tokens))


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


class EventStreamResponse(StreamingResponse):
    """Server-sent events; runs `on_close` however the stream ends.

    Starlette cancels the body iterator when the client disconnects, but a cancellation that
    lands before the iterator starts would skip its cleanup, so the abort hook sits here.
    """

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def _sse_each(chunks: AsyncIterator[BaseModel]) -> AsyncIterator[str]:
    async for chunk in chunks:
        yield _sse(chunk)


async def _with_done(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """OpenAI's ending: `[DONE]`, after an error event if the engine failed mid-stream (the
    status is sent by then)."""
    try:
        async for event in events:
            yield event
    except (EngineDeadError, APIError) as exc:
        error = exc if isinstance(exc, APIError) else APIError(str(exc), 503, SERVER_ERROR)
        yield _sse(error.body())
    yield "data: [DONE]\n\n"
