"""AsyncEngine: one background thread owns the LLMEngine; asyncio handlers talk to it by queue.

The engine is not thread-safe and its `step()` blocks for a whole forward pass, so it cannot
run on the event loop. Handlers put commands (add, abort, stop) on a thread-safe queue; the
loop thread applies them between steps, so the engine only ever sees one caller. Outputs go
back to each request's own asyncio queue through `loop.call_soon_threadsafe`, the one safe way
to wake a coroutine from another thread.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from pagedserve.entrypoints.server.metrics import RequestTiming, ServerMetrics

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.5  # how long an idle loop blocks on the command queue before re-checking


class EngineDeadError(RuntimeError):
    """The engine loop stopped (shutdown or a failed step); the request cannot finish."""


@dataclass
class _Stream:
    """Loop-thread bookkeeping of one request, plus the handler's queue to deliver to."""

    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue
    arrival: float  # time.monotonic() when the handler submitted it
    first_token: float | None = None
    num_output_tokens: int = 0

    def deliver(self, item: Any) -> None:
        self.loop.call_soon_threadsafe(self.outputs.put_nowait, item)


@dataclass
class _Add:
    request_id: str
    kwargs: dict
    stream: _Stream
    accepted: asyncio.Future = field(repr=False)


class AsyncEngine:
    """Runs `engine.step()` in a daemon thread and streams `RequestOutput`s to coroutines."""

    def __init__(self, engine: Any, metrics: ServerMetrics | None = None) -> None:
        self.engine = engine
        self.metrics = metrics or ServerMetrics()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}  # owned by the loop thread
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    # ---- lifecycle (event-loop side) -------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="pagedserve-engine", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Abort whatever is still in flight and stop the loop thread."""
        if self._thread is None:
            return
        self._commands.put(("stop",))
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, timeout)

    # ---- requests (event-loop side) --------------------------------------------------------

    async def add_request(self, request_id: str, **add_kwargs: Any) -> AsyncIterator[Any]:
        """Submit a request; once the engine accepted it, return its stream of outputs.

        Raises the engine's ValueError (bad input) here, before any output exists, so the
        handler can still answer 400. The returned iterator yields `RequestOutput`s up to the
        finished one; if the consumer stops early the request is aborted. A caller that never
        iterates it must call `abort(request_id)` itself.
        """
        if not self.is_running:
            raise EngineDeadError("the engine loop is not running")
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue(), time.monotonic())
        accepted = loop.create_future()
        self._commands.put(("add", _Add(request_id, add_kwargs, stream, accepted)))
        try:
            await accepted
        except asyncio.CancelledError:
            self.abort(request_id)  # queued after the add, so it always finds the request
            raise
        return self._outputs(request_id, stream)

    async def _outputs(self, request_id: str, stream: _Stream) -> AsyncIterator[Any]:
        finished = False
        try:
            while not finished:
                output = await stream.outputs.get()
                if isinstance(output, BaseException):
                    finished = True
                    raise output
                finished = output.finished
                yield output
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort silently: for a consumer that is gone and wants no more outputs."""
        self._commands.put(("abort", request_id))

    def finish_all(self) -> None:
        """Abort every in-flight request but still deliver its final ("abort") output, so
        handlers end their responses properly; used when a graceful shutdown runs out of time."""
        self._commands.put(("finish_all",))

    # ---- the loop thread -------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                block = not self.engine.has_unfinished_requests()
                if not self._apply_commands(block):
                    break
                if self.engine.has_unfinished_requests():
                    self._step()
                self.metrics.update_engine_stats(self.engine.get_stats())
        except BaseException as exc:  # noqa: BLE001 - any failure must reach the waiters
            logger.exception("engine loop failed")
            self._error = exc
        finally:
            self._fail_all(self._error or EngineDeadError("the server is shutting down"))

    def _apply_commands(self, block: bool) -> bool:
        """Apply queued commands; wait for one when idle. Returns False on stop."""
        try:
            command = self._commands.get(timeout=_IDLE_WAIT_S) if block \
                else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            kind = command[0]
            if kind == "stop":
                return False
            if kind == "add":
                self._add(command[1])
            elif kind == "abort":
                self._abort(command[1])
            elif kind == "finish_all":
                self.engine.abort_request(list(self._streams))
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _add(self, add: _Add) -> None:
        try:
            self.engine.add_request(add.request_id, **add.kwargs)
        except Exception as exc:  # noqa: BLE001 - reported to the handler, which answers 400
            add.stream.loop.call_soon_threadsafe(_settle, add.accepted, exc)
            return
        self._streams[add.request_id] = add.stream
        add.stream.loop.call_soon_threadsafe(_settle, add.accepted, None)

    def _abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return  # finished (or rejected) before the abort arrived
        self.engine.abort_request([request_id])
        self._record_finish(stream, "abort")

    def _step(self) -> None:
        for output in self.engine.step():
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue  # aborted while this step ran
            num_tokens = max((len(c.token_ids) for c in output.outputs), default=0)
            if num_tokens and stream.first_token is None:
                stream.first_token = time.monotonic()
            stream.num_output_tokens = num_tokens
            stream.deliver(output)
            if output.finished:
                del self._streams[output.request_id]
                self._record_finish(stream, _finish_reason(output))

    def _record_finish(self, stream: _Stream, reason: str) -> None:
        done = time.monotonic()
        ttft = None if stream.first_token is None else stream.first_token - stream.arrival
        self.metrics.observe_request(
            RequestTiming(ttft, done - stream.arrival, stream.num_output_tokens), reason)

    def _fail_all(self, exc: BaseException) -> None:
        """Wake every waiter with an error, and free the engine's blocks where possible."""
        streams, self._streams = self._streams, {}
        if streams:
            try:
                self.engine.abort_request(list(streams))
            except Exception:  # noqa: BLE001 - the engine may be the thing that broke
                logger.exception("aborting in-flight requests failed")
        for stream in streams.values():
            stream.deliver(exc)
        while True:  # requests submitted but never added must not wait forever either
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if command[0] == "add":
                command[1].stream.loop.call_soon_threadsafe(_settle, command[1].accepted, exc)


def _settle(future: asyncio.Future, exc: BaseException | None) -> None:
    if future.done():  # the handler was cancelled meanwhile; its abort is already queued
        return
    if exc is None:
        future.set_result(None)
    else:
        future.set_exception(exc)


def _finish_reason(output: Any) -> str:
    """One label per request for the metrics: the "worst" reason over its n choices."""
    reasons = {c.finish_reason for c in output.outputs}
    return next((r for r in ("abort", "stop") if r in reasons), "length")
