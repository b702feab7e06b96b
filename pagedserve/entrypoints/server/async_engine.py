"""AsyncEngine: the server's engine, its frontend on the event loop and its core in a process.

The API process keeps the frontend halves of the engine: the Processor (validation, n > 1 fan
out) and the OutputProcessor (detokenization, stop strings, logprob strings, RequestOutputs).
The EngineCore runs in its own process (`engine/core_proc.py`) behind `EngineCoreClient`. One
asyncio task reads the core's outputs, one message per model step, runs them through the
OutputProcessor and hands each request's RequestOutput to that request's stream. Everything here
runs on the event loop, so no lock is needed: a request is added, aborted and delivered to
from one thread.

When the core process dies (killed, crashed, or a step raised) every in-flight request gets
`EngineDeadError` (a 503, or an error event in a stream that has started), `is_running`
turns False (so /health answers 503), and `on_dead` tells the server to exit, non-zero. The
server does not restart the core: its KV cache and every request in it are gone, and a
supervisor (systemd, Kubernetes) that restarts the whole server is simpler and cleaner than
a half-restarted one.

Limits a server on a network needs (`Limits`), each answered before the request costs more:
- the waiting queue: past `max_queued_requests` engine requests waiting, a new one gets 429
  with Retry-After (`QueueFull`; an empty queue takes any one request), the time the queue
  would take to make room at its recent drain rate (`drain.py`). Waiting = in flight
  here (samples not finished) minus running in the core, as of the core's last step: exact
  for what was added since, and never stricter than the core's own queue;
- a deadline: `timeout` per request, capped by `request_timeout`, from submission; at the
  deadline the request is aborted in the core (its blocks freed) and its consumer gets
  `RequestTimeout` (408; in a stream that has started, an error event);
- grammars: compiled on threads of their own, bounded in size and time
  (`structured/compiles.py`), never on the threads that tokenize and apply chat templates.
  The core compiles an accepted spec again; should that fail (one process's fault: both use
  one compiler), the request's stream raises the RequestError the server's own compile would
  have, naming structured_outputs, and its other samples are aborted.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from fastapi.responses import JSONResponse

from pagedserve.entrypoints.server.drain import DrainRate
from pagedserve.entrypoints.server.errors import APIError, bad_request
from pagedserve.entrypoints.server.metrics import RequestTiming, ServerMetrics
from pagedserve.entrypoints.server.options import Limits
from pagedserve.errors import RequestError
from pagedserve.frontend.core_client import EngineCoreClient, EngineDeadError
from pagedserve.frontend.output_processor import OutputProcessor
from pagedserve.frontend.outputs import EngineStats, RequestOutput
from pagedserve.frontend.lora_registry import LoRARegistry
from pagedserve.frontend.processor import Processor
from pagedserve.messages import EngineCoreOutputs, LoRARequest, SchedulerStats
from pagedserve.model.config import ModelConfig
from pagedserve.sampling_params import SamplingParams
from pagedserve.structured.compiles import GrammarBusy, GrammarCompiles
from pagedserve.structured.grammar import GrammarCache
from pagedserve.structured.params import StructuredOutputsParams

__all__ = ["AsyncEngine", "EngineDeadError", "QueueFull", "RequestTimeout"]


class QueueFull(APIError):
    """429: the waiting queue (or every grammar compile thread) is full; retry after
    `retry_after` seconds."""

    def __init__(self, message: str, retry_after: int, code: str = "queue_full") -> None:
        super().__init__(message, 429, "rate_limit_error", None, code)
        self.retry_after = retry_after

    def response(self) -> JSONResponse:
        response = super().response()
        response.headers["Retry-After"] = str(self.retry_after)
        return response


class RequestTimeout(APIError):
    """408: the request's deadline passed; it was aborted and its blocks freed."""

    def __init__(self, timeout: float) -> None:
        super().__init__(f"The request did not finish within its timeout of {timeout:g} s "
                         "(the request's `timeout`, at most the server's --request-timeout); "
                         "it was aborted.", 408, "timeout_error", "timeout", "request_timeout")

logger = logging.getLogger(__name__)


@dataclass
class _Stream:
    """One request's outputs waiting for their consumer, and its timing for the metrics.

    A consumer that falls behind (a slow client, or an event loop busy with other streams)
    takes everything that arrived meanwhile as one output, deltas joined, as vLLM's output
    collector does: under load the server sends fewer, larger chunks instead of a backlog
    that grows step by step. An error replaces whatever is pending: the request is over.
    """

    arrival: float  # time.monotonic() when the handler submitted it
    num_live: int = 1  # its engine requests (n samples) not finished yet
    timer: asyncio.TimerHandle | None = None  # its deadline's, when it has one
    first_token: float | None = None
    num_output_tokens: int = 0
    lora_name: str | None = None  # the LoRA adapter it runs under
    _pending: RequestOutput | BaseException | None = None
    _ready: asyncio.Event = field(default_factory=asyncio.Event)

    def put(self, item: RequestOutput | BaseException) -> None:
        pending = self._pending
        if isinstance(pending, BaseException):
            return
        if isinstance(item, RequestOutput) and pending is not None:
            item.absorb(pending)
        self._pending = item
        self._ready.set()

    async def get(self) -> RequestOutput | BaseException:
        await self._ready.wait()
        self._ready.clear()
        item, self._pending = self._pending, None
        return item


class AsyncEngine:
    """Streams `RequestOutput`s of the core process's steps to coroutines."""

    def __init__(self, client: EngineCoreClient, tokenizer: Any,
                 metrics: ServerMetrics | None = None, limits: Limits = Limits(),
                 scheduling_policy: str = "fcfs") -> None:
        """`scheduling_policy`: the core's (a priority other than 0 is refused under fcfs)."""
        self.client = client
        self.priorities = scheduling_policy == "priority"
        self.ready = ready = client.ready
        self.tokenizer = tokenizer
        self.metrics = metrics or ServerMetrics()
        self.limits = limits
        self.loras = (LoRARegistry(ModelConfig.from_json(ready.model_config),
                                   ready.max_lora_rank) if ready.max_lora_rank else None)
        self.lora_in_flight: Counter[str] = Counter()  # requests per adapter, by name
        self.processor = Processor(tokenizer, ready.vocab_size, ready.max_model_len,
                                   self._grammars, self.loras)
        self.compiles = GrammarCompiles(
            self.processor.check_structured_outputs, limits.grammar_compile_threads,
            limits.max_grammar_bytes, limits.grammar_compile_timeout)
        self.metrics.watch_grammar_compiles(lambda: self.compiles.num_running,
                                            lambda: self.compiles.num_waiting)
        self._num_running = 0  # in the core, as of its last step's stats
        self._drain = DrainRate(time.monotonic())  # engine requests leaving: Retry-After
        self.output_processor = OutputProcessor(tokenizer)
        self.on_dead: Callable[[], None] | None = None  # called once if the core dies
        self.error: EngineDeadError | None = None
        self._grammar_cache: GrammarCache | None = None
        self._grammar_lock = threading.Lock()
        self._streams: dict[str, _Stream] = {}
        self._reader: asyncio.Task | None = None
        self._stopping = False

    @property
    def max_model_len(self) -> int:
        return self.ready.max_model_len

    def _grammars(self) -> GrammarCache:
        """This process's grammar cache (the core compiles its own): built on first use, from
        the worker thread that processes a structured request."""
        with self._grammar_lock:
            if self._grammar_cache is None:
                self._grammar_cache = GrammarCache(self.tokenizer, self.ready.vocab_size)
            return self._grammar_cache

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Start reading the core's outputs and watching its process (on the running loop)."""
        loop = asyncio.get_running_loop()
        loop.add_reader(self.client.sentinel, self._core_exited)
        self._reader = loop.create_task(self._read_outputs(), name="pagedserve-outputs")

    @property
    def is_running(self) -> bool:
        return self._reader is not None and self.error is None and not self._stopping

    async def shutdown(self) -> None:
        """Fail whatever is still in flight and stop the core process."""
        if self._reader is None:
            return
        self._stopping = True
        asyncio.get_running_loop().remove_reader(self.client.sentinel)
        self._reader.cancel()
        self._fail_all(EngineDeadError("the server is shutting down"))
        await asyncio.to_thread(self.client.shutdown)

    # ---- requests ----------------------------------------------------------------------------

    async def add_request(self, request_id: str, prompt: str | None, params: SamplingParams,
                          prompt_token_ids: list[int] | None = None,
                          cache_salt: str | None = None, timeout: float | None = None,
                          lora_request: LoRARequest | None = None
                          ) -> AsyncIterator[RequestOutput]:
        """Submit a request; return its stream of outputs, up to the finished one.

        Raises ValueError (bad input) here, before any output exists, so the handler can still
        answer 400; QueueFull or RequestTimeout likewise. The stream itself raises
        RequestError if the core cannot compile the grammar accepted here. `timeout`
        (seconds, capped by `limits.request_timeout`) bounds the request from now to its last
        token. If the consumer stops early the request is aborted; a caller that never
        iterates the stream must call `abort(request_id)` itself.
        """
        self._check_running()
        if params.priority != 0 and not self.priorities:
            raise bad_request("priority needs a server started with --scheduling-policy "
                              "priority (this one schedules first come, first served), got "
                              f"{params.priority}.", param="priority")
        arrival = time.monotonic()
        timeout = _earliest(timeout, self.limits.request_timeout)
        deadline = None if timeout is None else arrival + timeout
        self._check_queue(params.n)
        if params.structured_outputs is not None:  # before anything else costs: may refuse
            await self._compile(params.structured_outputs, deadline, timeout)
            self._check_running()
            self._check_queue(params.n)
        token_ids, core_requests = self.processor.process(
            request_id, prompt, params, prompt_token_ids, None, cache_salt, lora_request)
        self.output_processor.add_request(request_id, prompt, token_ids, params, core_requests)
        lora_name = None if lora_request is None else lora_request.lora_name
        stream = _Stream(arrival, num_live=len(core_requests), lora_name=lora_name)
        self._streams[request_id] = stream
        if lora_name is not None:
            self.lora_in_flight[lora_name] += 1
            self.metrics.lora_requests.labels(lora_name=lora_name).inc()
        try:
            for core_request in core_requests:
                self.client.add_request(core_request)
        except EngineDeadError:
            self.abort(request_id)
            raise
        if deadline is not None:
            stream.timer = asyncio.get_running_loop().call_later(
                deadline - time.monotonic(), self._expire, request_id, timeout)
        return self._outputs(request_id, stream)

    # ---- LoRA adapters ------------------------------------------------------------------------

    async def load_lora(self, name: str, path: str) -> LoRARequest:
        """Check and name an adapter (read on a thread: it reads the files); RequestError
        when it cannot run here, and then nothing is kept of it."""
        if self.loras is None:
            raise bad_request("LoRA adapters need a server started with --enable-lora",
                              param="lora_name")
        return await asyncio.to_thread(self.loras.add, name, path)

    def unload_lora(self, name: str) -> None:
        """Forget a named adapter. One that requests are still running under is refused
        (409: unload it again once they finish), so none of them loses its adapter midway;
        its weights leave the core's caches as other adapters take their place (LRU)."""
        if self.loras is None or name not in self.loras.by_name:
            raise APIError(f"The LoRA adapter `{name}` is not loaded.", 404,
                           param="lora_name", code="model_not_found")
        if self.lora_in_flight[name] > 0:
            raise APIError(f"The LoRA adapter `{name}` is in use by "
                           f"{self.lora_in_flight[name]} request(s); unload it once they "
                           "finish.", 409, param="lora_name", code="lora_in_use")
        self.loras.remove(name)
        del self.lora_in_flight[name]

    async def check_structured_outputs(self, spec: StructuredOutputsParams) -> None:
        """Compile `spec` on the grammar threads, within the server's limits (RequestError
        naming structured_outputs, or QueueFull when every thread stays busy)."""
        await self._compile(spec, None, None)

    async def _compile(self, spec: StructuredOutputsParams, deadline: float | None,
                       timeout: float | None) -> None:
        try:
            await self.compiles.compile(spec, deadline)
        except GrammarBusy as exc:  # the compiles in the way get as long again at most
            self.metrics.rejected.labels(reason="grammar_busy").inc()
            raise QueueFull(f"{exc}.", math.ceil(self.limits.grammar_compile_timeout),
                            code="grammar_compiles_busy") from None
        except asyncio.TimeoutError:
            self.metrics.rejected.labels(reason="timeout").inc()
            raise RequestTimeout(timeout) from None
        except ValueError:
            self.metrics.rejected.labels(reason="grammar").inc()
            raise

    def _check_queue(self, num_new: int) -> None:
        """QueueFull when `num_new` more waiting engine requests would pass the bound. An
        empty queue takes any one request, so that one with n over the bound can still run."""
        bound = self.limits.max_queued_requests
        if bound is None:
            return
        waiting = sum(s.num_live for s in self._streams.values()) - self._num_running
        if waiting > 0 and waiting + num_new > bound:
            self.metrics.rejected.labels(reason="queue_full").inc()
            retry_after = self._drain.retry_after(waiting + num_new - bound, time.monotonic())
            raise QueueFull(f"The server's queue is full ({waiting} requests waiting, at most "
                            f"{bound}: --max-queued-requests); retry in {retry_after} s (the "
                            "queue's recent drain rate).", retry_after)

    def _expire(self, request_id: str, timeout: float) -> None:
        """The deadline: abort in the core, the consumer gets RequestTimeout."""
        stream = self._streams.get(request_id)
        if stream is None:
            return
        self._finish(request_id, reason="timeout")
        stream.put(RequestTimeout(timeout))

    def _check_running(self) -> None:
        if not self.is_running:
            raise self.error or EngineDeadError("the engine is not running")

    async def _outputs(self, request_id: str, stream: _Stream) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                output = await stream.get()
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
        self._finish(request_id)

    def finish_all(self) -> None:
        """Abort every in-flight request but still deliver its final ("abort") output, so
        handlers end their responses properly; used when a graceful shutdown runs out of time."""
        for request_id in list(self._streams):
            self._finish(request_id, deliver=True)

    def _finish(self, request_id: str, deliver: bool = False, reason: str = "abort") -> None:
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return  # finished (or rejected) before the abort
        if stream.timer is not None:
            stream.timer.cancel()
        self._drain.departed(stream.num_live, time.monotonic())
        output, core_ids = self.output_processor.abort_request(request_id, time.time())
        if core_ids and self.error is None and not self._stopping:
            try:
                self.client.abort_requests(core_ids)
            except EngineDeadError:
                pass  # the core is gone with the request; the process watch reports it
        if deliver and output is not None:
            stream.put(output)
        self._record_finish(stream, reason)

    # ---- the core's outputs ------------------------------------------------------------------

    async def _read_outputs(self) -> None:
        try:
            while True:
                self._process(await self.client.get_outputs())
        except EngineDeadError as exc:
            self._die(exc)
        except Exception as exc:  # noqa: BLE001 - a broken frontend fails like a dead core
            logger.exception("processing the engine core's outputs failed")
            self._die(EngineDeadError(f"processing the engine's outputs failed: {exc}"))

    def _process(self, core_outputs: EngineCoreOutputs) -> None:
        """One step: its outputs to their requests, stop strings' aborts to the core."""
        outputs, stopped = self.output_processor.process_outputs(core_outputs)
        if stopped:
            self.client.abort_requests(stopped)
        now = time.monotonic()
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            error = next((c.error for c in output.outputs if c.error is not None), None)
            if error is not None:  # the core's grammar compile failed: a refusal after all
                self._finish(output.request_id, reason="error")  # its other samples too
                stream.put(RequestError(error, "structured_outputs"))
                continue
            num_tokens = max((len(c.token_ids) for c in output.outputs), default=0)
            if num_tokens and stream.first_token is None:
                stream.first_token = now
            stream.num_output_tokens = num_tokens
            num_live = sum(c.finish_reason is None for c in output.outputs)
            self._drain.departed(stream.num_live - num_live, now)
            stream.num_live = num_live
            stream.put(output)
            if output.finished:
                del self._streams[output.request_id]
                if stream.timer is not None:
                    stream.timer.cancel()
                self._record_finish(stream, _finish_reason(output))
        if core_outputs.scheduler_stats is not None:
            self._num_running = core_outputs.scheduler_stats.num_running
            self.metrics.update_engine_stats(self._engine_stats(core_outputs.scheduler_stats))

    def _engine_stats(self, stats: SchedulerStats) -> EngineStats:
        processed = self.output_processor
        return EngineStats.of(stats, processed.prompt_tokens_total,
                              processed.generation_tokens_total)

    def _record_finish(self, stream: _Stream, reason: str) -> None:
        if stream.lora_name is not None:
            self.lora_in_flight[stream.lora_name] -= 1
        done = time.monotonic()
        ttft = None if stream.first_token is None else stream.first_token - stream.arrival
        self.metrics.observe_request(
            RequestTiming(ttft, done - stream.arrival, stream.num_output_tokens), reason)

    # ---- the core's death --------------------------------------------------------------------

    def _core_exited(self) -> None:
        """The process sentinel became readable: the core is gone."""
        asyncio.get_running_loop().remove_reader(self.client.sentinel)
        self.client.process.join(1)  # reap it, for its exit code
        self._die(EngineDeadError(f"the engine core process exited unexpectedly (exit code "
                                  f"{self.client.process.exitcode})"))

    def _die(self, error: EngineDeadError) -> None:
        if self.error is not None or self._stopping:
            return
        self.error = error
        logger.error("%s; the server stops", error)
        if self._reader is not None and self._reader is not asyncio.current_task():
            self._reader.cancel()
        self._fail_all(error)
        if self.on_dead is not None:
            self.on_dead()

    def _fail_all(self, error: EngineDeadError) -> None:
        """Wake every waiter with the error; the frontend forgets its requests."""
        streams, self._streams = self._streams, {}
        now = time.time()
        for request_id, stream in streams.items():
            self.output_processor.abort_request(request_id, now)
            if stream.timer is not None:
                stream.timer.cancel()
            stream.put(error)


def _finish_reason(output: Any) -> str:
    """One label per request for the metrics: the "worst" reason over its n choices."""
    reasons = {c.finish_reason for c in output.outputs}
    return next((r for r in ("abort", "stop") if r in reasons), "length")


def _earliest(*timeouts: float | None) -> float | None:
    given = [t for t in timeouts if t is not None]
    return min(given) if given else None
