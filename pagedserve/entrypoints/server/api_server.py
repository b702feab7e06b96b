"""The FastAPI app, its routes, and `run_server` (the `serve` command; its options: options.py).

Shutdown on SIGINT/SIGTERM: uvicorn stops accepting connections and waits for in-flight
requests; after `--graceful-timeout` seconds we abort the ones still running in the engine, so
each client gets a last chunk with finish_reason "abort" and `[DONE]` (or a complete JSON
body) instead of a cut connection. Handlers still alive a few seconds later are cancelled by
uvicorn (and abort their requests), then the lifespan hook stops the engine-core process
(see async_engine.py for the process layout and what happens when the core dies). A drained
SIGTERM is a clean stop: exit code 0, as for SIGINT (uvicorn re-raises the signal after its
shutdown; our handler for it turns that into a normal return).

On a network (issue 29):
- `--api-key` (or PAGEDSERVE_API_KEY; several keys allowed): every route but /health and
  /metrics (unless `--auth-health-and-metrics`) wants `Authorization: Bearer <key>` (or
  `x-api-key: <key>`, as Anthropic's clients send it), checked before the body is read
  (`APIKeyAuth`); `--cache-salt-from-api-key` gives each key its own prefix cache;
- `--header-timeout`: a connection must finish each request's headers within it, or is
  closed (slow-loris; uvicorn has no such timer of its own, `_HeaderTimeoutProtocol`);
  `--body-timeout`: then its body within that, or gets 408 and is closed (`body.py`);
- the queue bound, the request deadline and the grammar limits (options.Limits);
- /health answers 503 when the engine is gone or when the threads that tokenize and apply
  chat templates do not take a no-op within `--health-timeout` (a server whose requests
  would wait that long cannot serve).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import hmac
import logging
import signal
from pathlib import Path
from typing import Any, AsyncIterator

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.security.utils import get_authorization_scheme_param
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from pagedserve.entrypoints.server.async_engine import AsyncEngine
from pagedserve.entrypoints.server.body import BodyLimits
from pagedserve.entrypoints.server.errors import APIError, install_error_handlers
from pagedserve.entrypoints.server.messages import AnthropicErrors, MessagesServing
from pagedserve.entrypoints.server.messages_protocol import MessagesRequest, MessageTokensRequest
from pagedserve.entrypoints.server.metrics import ServerMetrics
from pagedserve.entrypoints.server.options import (
    DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES, Access, ServeSettings)
from pagedserve.entrypoints.server.protocol import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
    DetokenizeResponse, ErrorResponse, ModelCard, ModelList, SamplingRequest, TokenizeRequest,
    TokenizeResponse)
from pagedserve.entrypoints.server.response_store import ResponseStore
from pagedserve.entrypoints.server.responses import ResponsesServing
from pagedserve.entrypoints.server.responses_protocol import ResponsesRequest
from pagedserve.entrypoints.server.serving import ChatSettings, OpenAIServing
from pagedserve.errors import RequestError
from pagedserve.frontend.core_client import EngineCoreClient
from pagedserve.model.loader import load_tokenizer, tokenizer_source

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI entries for the error statuses a route can answer, in OpenAI's shape."""
    return {status: {"model": ErrorResponse, "description": _ERROR_TEXT[status]}
            for status in statuses}


_ERROR_TEXT = {
    401: "No API key, or not one of the server's (--api-key)",
    404: "The model (or LoRA adapter) is not served here",
    409: "The LoRA adapter is in use by running requests",
    408: "The body did not arrive within --body-timeout; or, for a generation, the "
         "request's timeout (or --request-timeout) passed and it was aborted",
    413: "The body is larger than --max-body-size",
    429: "The waiting queue (--max-queued-requests) or the grammar compile threads are full; "
         "see Retry-After",
    503: "The engine is not running (or, for /health, cannot serve now)",
}


def build_app(engine: AsyncEngine, model_name: str, aliases: tuple[str, ...] = (),
              chat: ChatSettings = ChatSettings(),
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, access: Access = Access(),
              health_timeout: float = 5.0,
              response_store: ResponseStore | None = None,
              body_timeout: float = DEFAULT_BODY_TIMEOUT_S,
              allow_lora_updates: bool = False) -> FastAPI:
    """An app serving `engine` under `model_name` (and `aliases`); `response_store`: where
    /v1/responses keeps its responses (default: the store's default bounds); a body must
    arrive within `body_timeout` seconds of its headers and be at most `max_body_bytes`;
    `allow_lora_updates`: the routes that load and unload LoRA adapters exist."""
    ready = engine.ready
    card = {"max_model_len": ready.max_model_len, "kv_cache_dtype": ready.kv_cache_dtype,
            "quantization": ready.quantization}
    serving = OpenAIServing(
        engine, model_name, aliases, engine.tokenizer, ready.max_model_len, chat)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        await engine.shutdown()

    app = FastAPI(title="pagedserve", lifespan=lifespan)
    app.state.async_engine = engine
    install_error_handlers(app)
    app.add_middleware(BodyLimits, max_bytes=max_body_bytes, timeout=body_timeout)
    open_paths = frozenset() if access.auth_health_and_metrics else OPEN_PATHS
    if access.api_keys:  # nothing else runs for a request without a key
        app.add_middleware(APIKeyAuth, keys=access.api_keys, open_paths=open_paths,
                           metrics=engine.metrics)
    app.add_middleware(AnthropicErrors)  # outermost: every error on /v1/messages
    auth = (401,) if access.api_keys else ()
    status_auth = auth if access.auth_health_and_metrics else ()
    generate = _errors(*auth, 404, 408, 413, 429, 503)

    @app.get("/health", responses=_errors(*status_auth, 503))
    async def health() -> Response:
        if not engine.is_running:
            return JSONResponse({"status": "engine not running"}, status_code=503)
        try:  # the threads every request's tokenization waits for
            await asyncio.wait_for(asyncio.to_thread(_nothing), health_timeout)
        except asyncio.TimeoutError:
            return JSONResponse({"status": f"the tokenizer threads did not answer within "
                                 f"{health_timeout:g} s"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models", responses=_errors(*auth))
    async def models() -> ModelList:
        adapters = engine.loras.by_name.values() if engine.loras is not None else ()
        return ModelList(data=[ModelCard(id=model_name, **card)] + [
            ModelCard(id=a.lora_name, parent=model_name, root=a.lora_path, **card)
            for a in adapters])

    if allow_lora_updates:
        @app.post("/v1/load_lora_adapter", responses=_errors(*auth, 413))
        async def load_lora_adapter(req: LoadLoRAAdapterRequest) -> Response:
            try:
                await engine.load_lora(req.lora_name, req.lora_path)
            except RequestError as exc:
                field = "lora_name" if exc.param == "lora_name" else "lora_path"
                raise APIError(str(exc), 400, param=field) from None
            return Response(f"LoRA adapter {req.lora_name} loaded", media_type="text/plain")

        @app.post("/v1/unload_lora_adapter", responses=_errors(*auth, 404, 409, 413))
        async def unload_lora_adapter(req: UnloadLoRAAdapterRequest) -> Response:
            engine.unload_lora(req.lora_name)
            return Response(f"LoRA adapter {req.lora_name} unloaded", media_type="text/plain")

    @app.get("/metrics", responses=_errors(*status_auth))
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions", responses=generate)
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        _salt(req, raw, access)
        return await serving.create_completion(req, raw)

    @app.post("/v1/chat/completions", responses=generate)
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        _salt(req, raw, access)
        return await serving.create_chat_completion(req, raw)

    responses_api = ResponsesServing(serving, response_store or ResponseStore())

    @app.post("/v1/responses", responses=generate)
    async def create_response(req: ResponsesRequest, raw: Request) -> Response:
        return await responses_api.create(req, raw, lambda chat: _salt(chat, raw, access))

    # ":path" takes the empty id too ("/v1/responses/"): a 404 of ours, not a redirect to the
    # create route
    @app.get("/v1/responses/{response_id:path}", responses=_errors(*auth, 404))
    async def retrieve_response(response_id: str, raw: Request) -> dict:
        _no_query(raw)
        return responses_api.retrieve(response_id)

    @app.delete("/v1/responses/{response_id:path}", responses=_errors(*auth, 404))
    async def delete_response(response_id: str, raw: Request) -> dict:
        _no_query(raw)
        return responses_api.delete(response_id)

    messages_api = MessagesServing(serving)

    @app.post("/v1/messages", responses=generate)
    async def create_message(req: MessagesRequest, raw: Request) -> Response:
        return await messages_api.create(req, raw, lambda chat: _salt(chat, raw, access))

    @app.post("/v1/messages/count_tokens", responses=_errors(*auth, 404, 408, 413))
    async def count_message_tokens(req: MessageTokensRequest) -> dict:
        return await messages_api.count_tokens(req)

    @app.post("/tokenize", responses=_errors(*auth, 404, 408, 413))
    async def tokenize(req: TokenizeRequest) -> TokenizeResponse:
        return await asyncio.to_thread(serving.tokenize, req)

    @app.post("/detokenize", responses=_errors(*auth, 404, 408, 413))
    async def detokenize(req: DetokenizeRequest) -> DetokenizeResponse:
        return await asyncio.to_thread(serving.detokenize, req)

    return app


def _nothing() -> None:
    """/health's probe of the worker threads."""


def _no_query(raw: Request) -> None:
    """Routes that take no query parameter refuse one (OpenAI's retrieve takes `include`,
    `stream`, `starting_after`: none of them is implemented)."""
    for name in raw.query_params:
        raise APIError(f"Unrecognized query parameter: '{name}'. The server does not "
                       "implement it, so it refuses the request rather than ignore it.",
                       param=name, code="unknown_parameter")


def _salt(req: SamplingRequest, raw: Request, access: Access) -> None:
    """With --cache-salt-from-api-key the request's prefix-cache salt starts with its key's:
    tenants never share a cached block, and a tenant's own cache_salt still splits further."""
    if access.cache_salt_from_api_key:
        key_salt = raw.scope["state"][_KEY_SALT]
        req.cache_salt = key_salt if req.cache_salt is None else f"{key_salt}:{req.cache_salt}"


OPEN_PATHS = frozenset({"/health", "/metrics"})  # for probes and scrapers, unless configured
_KEY_SALT = "pagedserve_key_salt"  # where APIKeyAuth leaves the caller's key's salt


class APIKeyAuth:
    """401 (OpenAI's shape) unless `Authorization: Bearer <key>` (or, without it,
    Anthropic's `x-api-key: <key>`) names one of the keys, decided from the headers alone:
    a caller without a key gets no byte of its body read.

    The comparison takes the same time whichever key matches, or none: the presented key and
    each server key are compared as SHA-256 digests (equal lengths, so `compare_digest` does
    not reveal a key's length), every key every time. The matched key's salt goes into the
    request's scope for --cache-salt-from-api-key.
    """

    def __init__(self, app: ASGIApp, keys: tuple[str, ...], open_paths: frozenset[str],
                 metrics: ServerMetrics) -> None:
        self.app, self.open_paths, self.metrics = app, open_paths, metrics
        self._digests = [_digest(key) for key in keys]
        self._salts = [hashlib.sha256(b"pagedserve cache salt\0" + key.encode()).hexdigest()
                       for key in keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        scheme, token = get_authorization_scheme_param(
            headers.get(b"authorization", b"").decode("latin-1"))
        if scheme.lower() != "bearer":  # Anthropic's clients send the key as x-api-key
            scheme, token = "bearer", headers.get(b"x-api-key", b"").decode("latin-1")
        match = None
        if token:
            presented = _digest(token)
            for i, digest in enumerate(self._digests):  # no early exit: constant time
                if hmac.compare_digest(presented, digest):
                    match = i
        if match is None:
            self.metrics.rejected.labels(reason="unauthorized").inc()
            message = ("Incorrect API key provided." if token else "You didn't provide an API "
                       "key: send it as 'Authorization: Bearer <key>' (or 'x-api-key: <key>').")
            response = APIError(message, 401, code="invalid_api_key").response()
            response.headers["WWW-Authenticate"] = "Bearer"
            response.headers["Connection"] = "close"  # its body, if any, stays unread
            await response(scope, receive, send)
            return
        scope.setdefault("state", {})[_KEY_SALT] = self._salts[match]
        await self.app(scope, receive, send)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


class _HeaderTimeoutProtocol(HttpToolsProtocol):
    """uvicorn's HTTP protocol, plus a deadline on each request's headers: from the
    connection's start for the first request, from its first byte for the next ones (idle
    time between requests is uvicorn's keep-alive timeout). A connection that has not sent
    complete headers by then is closed: slow-loris clients hold no connection for long."""

    header_timeout = 10.0  # set per server (`_header_timeout_protocol`)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._arm()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._header_timer is None:
            self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._header_timer = self.loop.call_later(self.header_timeout, self._headers_too_slow)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()


def _header_timeout_protocol(seconds: float) -> type[_HeaderTimeoutProtocol]:
    return type("HeaderTimeoutProtocol", (_HeaderTimeoutProtocol,), {"header_timeout": seconds})


def load_lora_modules(engine: AsyncEngine, modules: list[tuple[str, str]]) -> None:
    """The --lora-modules adapters, checked before the server listens (ValueError: why not)."""
    if modules and engine.loras is None:
        raise ValueError("--lora-modules needs --enable-lora")
    for name, path in modules:
        try:
            engine.loras.add(name, path)
        except RequestError as exc:
            raise ValueError(f"--lora-modules {name}: {exc}") from None


def run_server(args: argparse.Namespace, client: EngineCoreClient,
               settings: ServeSettings) -> None:
    """Serve with the engine core `client` has started (`pagedserve serve` starts it before
    it imports this module, once `settings` were checked), until SIGINT/SIGTERM, or until the
    core dies: then every in-flight request gets an error and the server exits non-zero (a
    RuntimeError, which the CLI reports and turns into exit code 1). The tokenizer loads
    while the core starts."""
    chat = ChatSettings(args.tool_call_parser, args.reasoning_parser, settings.chat_template,
                        args.default_chat_template_kwargs)
    access = settings.access
    try:
        source = tokenizer_source(client.config.model, client.config.tokenizer)
        _, tokenizer = client.wait_ready(lambda: load_tokenizer(source))
        engine = AsyncEngine(client, tokenizer, limits=settings.limits,
                             scheduling_policy=args.scheduling_policy)
        name = args.served_model_name or (Path(args.model).stem if args.model
                                          else DEFAULT_MODEL_NAME)
        aliases = (args.model,) if args.model else ()
        load_lora_modules(engine, args.lora_modules)
        app = build_app(engine, name, aliases, chat, args.max_body_size, access,
                        args.health_timeout,
                        ResponseStore(args.max_stored_responses, args.max_stored_bytes),
                        args.body_timeout, args.allow_runtime_lora_updating)
        # uvicorn cancels handlers still running after its own timeout; ours fires first and
        # aborts them in the engine instead, so each client still gets a final chunk and [DONE]
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                timeout_graceful_shutdown=args.graceful_timeout + _CANCEL_AFTER_S,
                                http=_header_timeout_protocol(args.header_timeout))
        server = _Server(config, engine, args.graceful_timeout)
        previous = signal.signal(signal.SIGTERM, _terminated)
        try:
            with contextlib.suppress(KeyboardInterrupt, _Terminated):
                server.run()
        finally:
            signal.signal(signal.SIGTERM, previous)
    finally:
        client.shutdown()
    if engine.error is not None:
        raise RuntimeError(str(engine.error))


class _Terminated(Exception):
    """SIGTERM, re-raised by uvicorn once its graceful shutdown is done."""


def _terminated(signum: int, frame: object) -> None:
    raise _Terminated


_CANCEL_AFTER_S = 5.0  # after the abort, how long handlers get to send their last bytes


class _Server(uvicorn.Server):
    """uvicorn's server, plus: in-flight requests get `grace` seconds, then are aborted."""

    def __init__(self, config: uvicorn.Config, async_engine: AsyncEngine, grace: float) -> None:
        super().__init__(config)
        self._async_engine, self._grace = async_engine, grace
        async_engine.on_dead = self._engine_died

    def _engine_died(self) -> None:
        """Stop serving: handlers deliver their errors during the graceful shutdown."""
        self.should_exit = True

    async def shutdown(self, sockets: list | None = None) -> None:
        timer = asyncio.get_running_loop().call_later(self._grace, self._async_engine.finish_all)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()
