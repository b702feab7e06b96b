"""The FastAPI app, its routes, and the `serve` command line (`add_serve_args`, `run_server`).

Shutdown on SIGINT/SIGTERM: uvicorn stops accepting connections and waits for in-flight
requests; after `--graceful-timeout` seconds we abort the ones still running in the engine, so
each client gets a last chunk with finish_reason "abort" and `[DONE]` (or a complete JSON
body) instead of a cut connection. Handlers still alive a few seconds later are cancelled by
uvicorn (and abort their requests), then the lifespan hook stops the engine-core process
(see async_engine.py for the process layout and what happens when the core dies).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from pathlib import Path
from typing import AsyncIterator

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedserve.entrypoints.engine_args import engine_options
from pagedserve.entrypoints.server.async_engine import AsyncEngine
from pagedserve.entrypoints.server.errors import APIError, install_error_handlers
from pagedserve.entrypoints.server.protocol import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, DetokenizeResponse, ModelCard,
    ModelList, TokenizeRequest, TokenizeResponse)
from pagedserve.entrypoints.server.tool_parsers import PARSERS
from pagedserve.entrypoints.server.serving import OpenAIServing

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MAX_BODY_BYTES = 2 << 20


def build_app(engine: AsyncEngine, model_name: str, aliases: tuple[str, ...] = (),
              tool_call_parser: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """An app serving `engine` under `model_name` (and `aliases`)."""
    ready = engine.ready
    card = {"max_model_len": ready.max_model_len, "kv_cache_dtype": ready.kv_cache_dtype,
            "quantization": ready.quantization}
    serving = OpenAIServing(
        engine, model_name, aliases, engine.tokenizer, ready.max_model_len, tool_call_parser)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        await engine.shutdown()

    app = FastAPI(title="pagedserve", lifespan=lifespan)
    app.state.async_engine = engine
    install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)

    @app.get("/health")
    async def health() -> Response:
        if engine.is_running:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "engine not running"}, status_code=503)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=model_name, **card)])

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        return await serving.create_completion(req, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        return await serving.create_chat_completion(req, raw)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> TokenizeResponse:
        return await asyncio.to_thread(serving.tokenize, req)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> DetokenizeResponse:
        return await asyncio.to_thread(serving.detokenize, req)

    return app


class BodySizeLimit:
    """413 for a request body over `max_bytes`, decided before anything parses it.

    A declared Content-Length over the limit is refused without reading a byte. A chunked
    body (no length declared) is read here, up to the limit, and refused at the first chunk
    past it; one within the limit is handed on to the app as received. Either way no JSON
    parser or tokenizer ever sees an oversized body.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length")
        if declared is not None:
            if declared.isdigit() and int(declared) > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
        elif headers.get(b"transfer-encoding", b"").lower() == b"chunked":
            messages = await self._read_chunked(receive)
            if messages is None:
                await self._refuse(scope, receive, send)
                return
            receive = _replay(messages, receive)
        await self.app(scope, receive, send)

    async def _read_chunked(self, receive: Receive) -> list[Message] | None:
        """The body's messages, or None once they pass the limit."""
        messages, size = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                return messages  # the client went away; the app will see it
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                return None
            if not message.get("more_body", False):
                return messages

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = APIError(f"The request body is larger than the server's limit of "
                         f"{self.max_bytes} bytes (--max-body-size).", 413,
                         code="request_too_large")
        response = error.response()
        response.headers["Connection"] = "close"  # the unread rest of the body stays unread
        await response(scope, receive, send)


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """A receive that gives `messages` first, then whatever the connection sends next (a
    disconnect, which streaming responses listen for)."""
    pending = list(messages)

    async def replayed() -> Message:
        return pending.pop(0) if pending else await receive()

    return replayed


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The server's own options; the engine's come from `engine_args.add_engine_args`."""
    group = parser.add_argument_group("server options")
    group.add_argument("--host", default="127.0.0.1", help="address to listen on "
                       "(default: %(default)s)")
    group.add_argument("--port", type=int, default=8000, help="port to listen on "
                       "(default: %(default)s)")
    group.add_argument("--served-model-name", default=None, help="name clients pass as "
                       "`model` (default: the model file's or folder's name)")
    group.add_argument("--seed", type=int, default=0, help="seeds the engine's generator for "
                       "requests without a seed (default: %(default)s)")
    group.add_argument("--graceful-timeout", type=float, default=5.0, help="seconds in-flight "
                       "requests get to finish on SIGINT/SIGTERM (default: %(default)s)")
    group.add_argument("--tool-call-parser", choices=PARSERS, default=None,
                       help="how the model writes tool calls (default: from its chat "
                       "template; hermes when the template does not say)")
    group.add_argument("--log-level", default="info", choices=["critical", "error", "warning",
                       "info", "debug"], help="server log verbosity (default: %(default)s)")
    group.add_argument("--max-body-size", type=int, default=DEFAULT_MAX_BODY_BYTES,
                       help="largest request body in bytes; a larger one gets 413 "
                       "(default: %(default)s)")
    return parser


def run_server(args: argparse.Namespace) -> None:
    """Start the engine-core process, then serve until SIGINT/SIGTERM, or until the core
    dies: then every in-flight request gets an error and the server exits non-zero (a
    RuntimeError, which the CLI reports and turns into exit code 1)."""
    from pagedserve.config import EngineConfig
    from pagedserve.engine.core_client import EngineCoreClient
    from pagedserve.model.loader import load_tokenizer

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    client = EngineCoreClient(EngineConfig.from_options(**engine_options(args), seed=args.seed))
    try:
        engine = AsyncEngine(client, load_tokenizer(client.ready.tokenizer))
        name = args.served_model_name or (Path(args.model).stem if args.model
                                          else DEFAULT_MODEL_NAME)
        aliases = (args.model,) if args.model else ()
        app = build_app(engine, name, aliases, args.tool_call_parser, args.max_body_size)
        # uvicorn cancels handlers still running after its own timeout; ours fires first and
        # aborts them in the engine instead, so each client still gets a final chunk and [DONE]
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                timeout_graceful_shutdown=args.graceful_timeout + _CANCEL_AFTER_S)
        server = _Server(config, engine, args.graceful_timeout)
        with contextlib.suppress(KeyboardInterrupt):
            server.run()
    finally:
        client.shutdown()
    if engine.error is not None:
        raise RuntimeError(str(engine.error))


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
