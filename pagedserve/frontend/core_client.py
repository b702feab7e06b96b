"""EngineCoreClient: the API process's handle on the engine-core process (`core_proc.py`).

It binds the two sockets (input PUSH, output PULL; ipc:// in a private temporary folder) and
spawns the core with the `spawn` start method (a fresh interpreter: CUDA cannot be used in a
forked child of a process that touched it, and the core must not inherit the server's
threads); `wait_ready` then waits for its READY, which carries what the frontend needs to know
(the resolved max_model_len, vocabulary size, KV blocks, batch limits). A start-up failure
comes back as the core's own error message (raised as RuntimeError).

Start-up overlaps: the core is started before the caller's own heavy work (the server's
imports, the tokenizer), which runs while the core imports torch and loads the weights
(`wait_ready(beside=...)`). So this module imports nothing heavy itself: the server starts
the core from here before it imports its own code.

Outputs are read on an event loop (`get_outputs`, the server) or blocking (`next_outputs`,
the offline `LLM` through `RemoteEngineCore`, which gives the client the interface of an
in-process `EngineCore`).

Sends never block: the core may be dead, and a PUSH socket with no peer would wait forever;
such a send fails as `EngineDeadError` instead. `shutdown()` asks the core to stop, then
kills it if it has not left in time, so no process is left behind whatever state it is in;
a client that is dropped, or still open when the interpreter exits, is shut down the same
way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing
import multiprocessing.util
import os
import shutil
import sys
import tempfile
import time
import types
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import zmq
import zmq.asyncio

from pagedserve import ipc
from pagedserve.config import EngineConfig
from pagedserve.engine.core_proc import run_engine_core
from pagedserve.messages import (AbortRequests, EngineCoreFailed, EngineCoreOutputs,
                                 EngineCoreReady, EngineCoreRequest, FromEngineCore,
                                 SchedulerStats, ShutdownCore)
from pagedserve.structured.grammar import GrammarCache

if TYPE_CHECKING:
    from pagedserve.model.config import ModelConfig

logger = logging.getLogger(__name__)

_STARTUP_POLL_MS = 500  # how often the start-up wait checks that the core is still alive
_POLL_MS = 500  # how often a blocking read checks that the core is still alive
_SHUTDOWN_TIMEOUT_S = 10.0  # for the core to leave its loop before it is terminated

T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The engine core is gone (it failed, was killed, or the server is shutting down)."""


class EngineCoreClient:
    def __init__(self, config: EngineConfig) -> None:
        """Start the core process; `wait_ready` waits until its model is loaded."""
        self.config = config  # the options it was started with
        self._folder = tempfile.mkdtemp(prefix="pagedserve-")
        self._context = zmq.Context()
        self._inputs = ipc.Channel(self._bind(zmq.PUSH, "input"))
        self._outputs = ipc.Channel(self._bind(zmq.PULL, "output"), FromEngineCore)
        self._async_outputs: zmq.asyncio.Socket | None = None
        self._failure: EngineDeadError | None = None  # reported by the core, not yet raised
        self.process = multiprocessing.get_context("spawn").Process(
            target=run_engine_core, name="pagedserve-engine-core",
            args=(config, self._address("input"), self._address("output"), os.getpid(),
                  logging.getLogger().getEffectiveLevel()))
        with _without_main_module():
            self.process.start()
        # run at garbage collection or at exit, before multiprocessing joins its children
        self._stop = multiprocessing.util.Finalize(
            self, _stop_core, (self.process, self._context, self._inputs, self._folder),
            exitpriority=10)
        self.ready: EngineCoreReady | None = None  # what the core said once it was ready

    def wait_ready(self, beside: Callable[[], T] | None = None) -> tuple[EngineCoreReady, T]:
        """Run `beside` (this process's own start-up work) while the core starts, then wait
        for the core's READY: (the ready message, what `beside` returned). The core's start-up
        error (RuntimeError) comes first where both fail: a missing model is the core's to
        name. Shuts the core down on any failure."""
        try:
            start = time.perf_counter()
            try:
                value = beside() if beside is not None else None
            except Exception:
                self._wait_ready()  # the core's own error, if it has one, is the story
                raise
            done = time.perf_counter()
            self.ready = self._wait_ready()
        except BaseException:
            self.shutdown()
            raise
        # which of the two was start-up's critical path: no wait means this process's work
        logger.info("start-up beside the engine core: %.2f s here, then %.2f s waiting for it",
                    done - start, time.perf_counter() - done)
        return self.ready, value

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
        message = self._outputs.receive()
        if isinstance(message, EngineCoreFailed):
            self.process.join()
            raise RuntimeError(message.error)
        if not isinstance(message, EngineCoreReady):
            raise RuntimeError(f"the engine core sent {type(message).__name__} before it was "
                               "ready")
        return message

    # -- requests -----------------------------------------------------------------------------

    def add_request(self, request: EngineCoreRequest) -> None:
        _send(self._inputs, request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        _send(self._inputs, AbortRequests(list(request_ids)))

    def next_outputs(self) -> EngineCoreOutputs:
        """`get_outputs`, blocking: the next step's outputs merged with those already waiting.
        EngineDeadError once the core reports a failure or its process is gone."""
        if self._failure is not None:
            raise self._failure
        while not self._outputs.poll(_POLL_MS):
            if not self.process.is_alive():
                raise EngineDeadError(f"the engine core process exited with code "
                                      f"{self.process.exitcode}")
        merged = _step_outputs(self._outputs.receive())
        while self._outputs.poll(0):
            try:
                message = _step_outputs(self._outputs.receive())
            except EngineDeadError as exc:  # deliver what came before it first
                self._failure = exc
                break
            merged.outputs += message.outputs
            merged.scheduler_stats, merged.timestamp = message.scheduler_stats, message.timestamp
        return merged

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
            self._async_outputs = zmq.asyncio.Socket.from_socket(self._outputs.socket)
        return self._async_outputs

    async def _next(self, socket: zmq.asyncio.Socket, flags: int = 0) -> EngineCoreOutputs:
        return _step_outputs(self._outputs.decode(await socket.recv(flags, copy=False)))

    # -- lifecycle ----------------------------------------------------------------------------

    @property
    def sentinel(self) -> int:
        """A file descriptor that becomes readable when the core process exits."""
        return self.process.sentinel

    def shutdown(self) -> None:
        """Stop the core (asking first, then SIGKILL: it ignores SIGTERM) and release the
        sockets. Idempotent."""
        self._stop()


@contextlib.contextmanager
def _without_main_module() -> Iterator[None]:
    """Start a spawned process without the parent's main module: spawn runs it again in the
    child (as `__mp_main__`) so that objects pickled from it resolve there, but the core's
    target and arguments come from pagedserve alone, and running again a script without an
    `if __name__ == "__main__"` guard (or a notebook's or stdin's code, which cannot be) would
    start its engine a second time."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def _step_outputs(message: EngineCoreOutputs | EngineCoreFailed | EngineCoreReady
                  ) -> EngineCoreOutputs:
    if isinstance(message, EngineCoreOutputs):
        return message
    if isinstance(message, EngineCoreFailed):
        raise EngineDeadError(message.error)
    raise EngineDeadError(f"the engine core sent an unexpected {type(message).__name__}")


def _send(inputs: ipc.Channel, message: EngineCoreRequest | AbortRequests | ShutdownCore
          ) -> None:
    try:
        inputs.send(message, block=False)
    except (zmq.Again, zmq.ZMQError) as exc:  # no core to take it, or sockets closed
        raise EngineDeadError("the engine core is not running") from exc


def _stop_core(process: multiprocessing.Process, context: zmq.Context, inputs: ipc.Channel,
               folder: str) -> None:
    if not ipc.stop_process(process, lambda: _send(inputs, ShutdownCore()),
                            _SHUTDOWN_TIMEOUT_S):
        logger.warning("the engine core did not stop in %.0f s; killed it", _SHUTDOWN_TIMEOUT_S)
    if not context.closed:
        context.destroy(linger=0)
    shutil.rmtree(folder, ignore_errors=True)


class RemoteEngineCore:
    """What `LLMEngine` calls of an `EngineCore`, with the core in its own process (as the
    server runs it): requests go to it as they are added, and `step()` returns the outputs
    of the core's next step (or of every step since the last call, merged), so that this
    process's work on them overlaps the core's next steps instead of delaying them.

    It keeps what the frontend needs without the core's objects: the ids of its requests
    not finished yet, the last stats, and its own tokenizer and grammar cache."""

    loaded = None  # the weights are the core process's

    def __init__(self, config: EngineConfig) -> None:
        # the model code (torch) only for the offline engine: the server's start-up imports
        # this module before it has started the core
        from pagedserve.model.loader import load_tokenizer, read_model_config, tokenizer_source

        def tokenizer_and_config() -> tuple[Any, ModelConfig]:
            return (load_tokenizer(tokenizer_source(config.model, config.tokenizer)),
                    read_model_config(config.model))

        self.client = client = EngineCoreClient(config)
        ready, (self.tokenizer, self.model_config) = client.wait_ready(tokenizer_and_config)
        self.config = dataclasses.replace(config, max_num_seqs=ready.max_num_seqs,
                                          max_num_batched_tokens=ready.max_num_batched_tokens)
        self.max_model_len, self.num_blocks = ready.max_model_len, ready.num_gpu_blocks
        self._grammars: GrammarCache | None = None
        self._unfinished: set[str] = set()
        self._stats = SchedulerStats(0, 0, 0.0, 0, 0, 0, ready.num_gpu_blocks)

    @property
    def grammars(self) -> GrammarCache:
        """This process's grammar cache, for the Processor's checks (the core has its own)."""
        if self._grammars is None:
            self._grammars = GrammarCache(self.tokenizer, self.client.ready.vocab_size)
        return self._grammars

    def add_request(self, request: EngineCoreRequest) -> None:
        self.client.add_request(request)
        self._unfinished.add(request.request_id)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        request_ids = list(request_ids)
        self.client.abort_requests(request_ids)
        self._unfinished.difference_update(request_ids)

    def has_unfinished_requests(self) -> bool:
        return bool(self._unfinished)

    def step(self) -> EngineCoreOutputs:
        if not self._unfinished:
            return EngineCoreOutputs([], self._stats, time.time())
        outputs = self.client.next_outputs()
        for out in outputs.outputs:
            if out.finish_reason is not None:
                self._unfinished.discard(out.request_id)
        if outputs.scheduler_stats is not None:
            self._stats = outputs.scheduler_stats
        return outputs

    def make_stats(self) -> SchedulerStats:
        """As of the last step read."""
        return self._stats

    def shutdown(self) -> None:
        self.client.shutdown()
