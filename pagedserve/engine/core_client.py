"""EngineCoreClient: the API process's handle on the engine-core process (`core_proc.py`).

It binds the two sockets (input PUSH, output PULL; ipc:// in a private temporary folder),
spawns the core with the `spawn` start method (a fresh interpreter: CUDA cannot be used in a
forked child of a process that touched it, and the core must not inherit the server's
threads), and waits for its READY, which carries what the frontend needs to know (the resolved
max_model_len, vocabulary size, KV blocks, batch limits). A start-up failure comes back as the
core's own error message (raised as RuntimeError).

Sends never block: the core may be dead, and a PUSH socket with no peer would wait forever;
such a send fails as `EngineDeadError` instead. `shutdown()` asks the core to stop, then
kills it if it has not left in time, so no process is left behind whatever state it is in.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import tempfile
from collections.abc import Iterable

import zmq
import zmq.asyncio

from pagedserve.config import EngineConfig
from pagedserve.engine.core_proc import (ABORT, ADD, FAILED, OUTPUTS, READY, SHUTDOWN,
                                         run_engine_core)
from pagedserve.engine.messages import (EngineCoreFailed, EngineCoreOutputs, EngineCoreReady,
                                        EngineCoreRequest, decode, encode)

logger = logging.getLogger(__name__)

_STARTUP_POLL_MS = 500  # how often the start-up wait checks that the core is still alive
_SHUTDOWN_TIMEOUT_S = 10.0  # for the core to leave its loop before it is terminated


class EngineDeadError(RuntimeError):
    """The engine core is gone (it failed, was killed, or the server is shutting down)."""


class EngineCoreClient:
    def __init__(self, config: EngineConfig) -> None:
        """Start the core process and wait until its model is loaded (`ready`)."""
        self._folder = tempfile.mkdtemp(prefix="pagedserve-")
        self._context = zmq.Context()
        self._inputs = self._bind(zmq.PUSH, "input")
        self._outputs = self._bind(zmq.PULL, "output")
        self._async_outputs: zmq.asyncio.Socket | None = None
        self._failure: EngineDeadError | None = None  # reported by the core, not yet raised
        self.process = multiprocessing.get_context("spawn").Process(
            target=run_engine_core, name="pagedserve-engine-core",
            args=(config, self._address("input"), self._address("output"), os.getpid(),
                  logging.getLogger().getEffectiveLevel()))
        self.process.start()
        try:
            self.ready = self._wait_ready()
        except BaseException:
            self.shutdown()
            raise

    def _address(self, name: str) -> str:
        return f"ipc://{os.path.join(self._folder, name)}"

    def _bind(self, kind: int, name: str) -> zmq.Socket:
        socket = self._context.socket(kind)
        socket.setsockopt(zmq.SNDHWM if kind == zmq.PUSH else zmq.RCVHWM, 0)  # no message dropped
        socket.bind(self._address(name))
        return socket

    def _wait_ready(self) -> EngineCoreReady:
        while not self._outputs.poll(_STARTUP_POLL_MS):
            if not self.process.is_alive():
                raise RuntimeError(f"the engine core process exited with code "
                                   f"{self.process.exitcode} while starting")
        kind, payload = self._outputs.recv_multipart()
        if kind == FAILED:
            self.process.join()
            raise RuntimeError(decode(payload, EngineCoreFailed).error)
        if kind != READY:
            raise RuntimeError(f"the engine core sent {kind!r} before it was ready")
        return decode(payload, EngineCoreReady)

    # -- requests -----------------------------------------------------------------------------

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(ADD, encode(request))

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        self._send(ABORT, encode(list(request_ids)))

    def _send(self, kind: bytes, payload: bytes) -> None:
        try:
            self._inputs.send_multipart([kind, payload], zmq.NOBLOCK, copy=False)
        except (zmq.Again, zmq.ZMQError) as exc:  # no core to take it, or sockets closed
            raise EngineDeadError("the engine core is not running") from exc

    async def get_outputs(self) -> EngineCoreOutputs:
        """The outputs of the next step, merged with those of every later step already
        waiting, in order. A frontend that falls behind the core (many streams, a fast device)
        then catches up in one pass, one RequestOutput and one SSE chunk per request for
        several steps, instead of paying its per-output work once per step. EngineDeadError,
        with the core's message, once the core reports a failure."""
        socket = self._async_socket()
        merged = await self._next(socket)
        while True:
            try:
                message = await self._next(socket, zmq.NOBLOCK)
            except zmq.Again:
                return merged
            except EngineDeadError as exc:  # deliver what came before it first
                self._failure = exc
                return merged
            merged.outputs += message.outputs
            merged.scheduler_stats, merged.timestamp = message.scheduler_stats, message.timestamp

    def _async_socket(self) -> zmq.asyncio.Socket:
        if self._failure is not None:
            raise self._failure
        if self._async_outputs is None:  # bound to the running loop on first use
            self._async_outputs = zmq.asyncio.Socket.from_socket(self._outputs)
        return self._async_outputs

    @staticmethod
    async def _next(socket: zmq.asyncio.Socket, flags: int = 0) -> EngineCoreOutputs:
        kind, payload = await socket.recv_multipart(flags, copy=False)
        if kind.bytes == OUTPUTS:
            return decode(payload.buffer, EngineCoreOutputs)
        if kind.bytes == FAILED:
            raise EngineDeadError(decode(payload.buffer, EngineCoreFailed).error)
        raise EngineDeadError(f"the engine core sent an unexpected {kind.bytes!r} message")

    # -- lifecycle ----------------------------------------------------------------------------

    @property
    def sentinel(self) -> int:
        """A file descriptor that becomes readable when the core process exits."""
        return self.process.sentinel

    def shutdown(self, timeout: float = _SHUTDOWN_TIMEOUT_S) -> None:
        """Stop the core (asking first, then SIGKILL: it ignores SIGTERM) and release the
        sockets. Idempotent."""
        process = self.process
        if process.is_alive():
            try:
                self._send(SHUTDOWN, b"")
            except EngineDeadError:
                pass
            process.join(timeout)
        if process.is_alive():
            logger.warning("the engine core did not stop in %.0f s; killing it", timeout)
            process.kill()
            process.join()
        if not self._context.closed:
            self._context.destroy(linger=0)
        shutil.rmtree(self._folder, ignore_errors=True)
