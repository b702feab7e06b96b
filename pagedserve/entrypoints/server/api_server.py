"""The FastAPI app, its routes, and the `serve` command line (`add_serve_args`, `run_server`).

Shutdown on SIGINT/SIGTERM: uvicorn stops accepting connections and waits for in-flight
requests; after `--graceful-timeout` seconds we abort the ones still running in the engine, so
each client gets a last chunk with finish_reason "abort" and `[DONE]` (or a complete JSON
body) instead of a cut connection. Handlers still alive a few seconds later are cancelled by
uvicorn (and abort their requests), then the lifespan hook stops the engine loop, which
aborts anything left so every block is returned before the process exits.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from pathlib import Path
from typing import Any, AsyncIterator

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from pagedserve.entrypoints.server.async_engine import AsyncEngine
from pagedserve.entrypoints.server.errors import install_error_handlers
from pagedserve.entrypoints.server.metrics import ServerMetrics
from pagedserve.entrypoints.server.protocol import (ChatCompletionRequest, CompletionRequest,
                                                    ModelCard, ModelList)
from pagedserve.entrypoints.server.serving import OpenAIServing

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def build_app(engine: Any, model_name: str, aliases: tuple[str, ...] = ()) -> FastAPI:
    """An app serving `engine` (an LLMEngine) under `model_name` (and `aliases`)."""
    async_engine = AsyncEngine(engine, ServerMetrics())
    max_model_len = _max_model_len(engine)
    serving = OpenAIServing(
        async_engine, model_name, aliases, engine.tokenizer, max_model_len)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        yield
        await async_engine.shutdown()

    app = FastAPI(title="pagedserve", lifespan=lifespan)
    app.state.async_engine = async_engine
    install_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        if async_engine.is_running:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "engine not running"}, status_code=503)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=model_name, max_model_len=max_model_len)])

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(async_engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        return await serving.create_completion(req, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        return await serving.create_chat_completion(req, raw)

    return app


def _max_model_len(engine: Any) -> int:
    """The engine's resolved context limit (the model's, capped by what the KV cache holds)."""
    return int(engine.max_model_len)


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--model", default=None,
                        help="HF folder or .gguf file (default: the embedded SmolLM2-135M)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None,
                        help="name clients pass as `model` (default: from the model path)")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--kv-cache-memory", type=int, default=None,
                        help="bytes for the KV cache (default: sized from free memory)")
    parser.add_argument("--no-prefix-caching", dest="enable_prefix_caching",
                        action="store_false", default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--device", default=None)
    parser.add_argument("--attention-backend", default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--graceful-timeout", type=float, default=5.0,
                        help="seconds in-flight requests get to finish on SIGINT/SIGTERM")
    parser.add_argument("--log-level", default="info")
    return parser


_ENGINE_ARGS = ("model", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
                "block_size", "kv_cache_memory", "enable_prefix_caching", "dtype", "device",
                "attention_backend", "seed")


def run_server(args: argparse.Namespace) -> None:
    """Load the engine, then serve until SIGINT/SIGTERM."""
    from pagedserve.engine.llm_engine import LLMEngine

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    options = {k: getattr(args, k) for k in _ENGINE_ARGS if getattr(args, k) is not None}
    engine = LLMEngine.from_options(**options)
    name = args.served_model_name or (Path(args.model).stem if args.model else DEFAULT_MODEL_NAME)
    aliases = (args.model,) if args.model else ()
    app = build_app(engine, name, aliases)
    # uvicorn cancels handlers still running after its own timeout; ours fires first and
    # aborts them in the engine instead, so each client still gets a final chunk and [DONE]
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.graceful_timeout + _CANCEL_AFTER_S)
    server = _Server(config, app.state.async_engine, args.graceful_timeout)
    with contextlib.suppress(KeyboardInterrupt):
        server.run()


_CANCEL_AFTER_S = 5.0  # after the abort, how long handlers get to send their last bytes


class _Server(uvicorn.Server):
    """uvicorn's server, plus: in-flight requests get `grace` seconds, then are aborted."""

    def __init__(self, config: uvicorn.Config, async_engine: AsyncEngine, grace: float) -> None:
        super().__init__(config)
        self._async_engine, self._grace = async_engine, grace

    async def shutdown(self, sockets: list | None = None) -> None:
        timer = asyncio.get_running_loop().call_later(self._grace, self._async_engine.finish_all)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()
