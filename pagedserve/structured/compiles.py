"""GrammarCompiles: the API server's grammar compiles, apart, bounded in size, time and count.

Compiling a grammar costs milliseconds for an ordinary schema and minutes for a hostile one
(a JSON schema with a 100,000-value enum). On the worker threads that tokenize and apply chat
templates, a few such compiles left a short chat waiting for minutes (docs/benchmarks.md,
"Structured outputs", hostile schemas).
So the server compiles on threads of its own (a few: each compile also runs xgrammar's own
threads), and each spec is bounded twice before it costs anything:
- in size (`max_bytes`, of the spec as its cache key spells it): refused at once;
- in time (`timeout`): a spec waits at most that long for a thread, then gets at most that
  long on it; past either its waiter gets an error. A compile cannot be interrupted once it
  runs, so it goes on in the background and its result is dropped; a spec that ran out its
  time on a thread is refused at once afterwards (it would take as long again, here and in
  the engine core, which compiles it too). A spec that never got a thread is not held
  against it: that is the server being busy (`GrammarBusy`, a 429).

The threads are daemons of this module rather than a `ThreadPoolExecutor`'s: the executor
joins its threads at interpreter exit, and a compile nobody can stop would hold the server's
exit for minutes. Equal specs in flight together share one compile.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedserve.errors import RequestError
from pagedserve.structured.params import StructuredOutputsParams

_MAX_REMEMBERED = 1024  # specs remembered as too slow; the oldest is forgotten first
_PARAM = "structured_outputs"  # the server maps it to the field the client used


class GrammarBusy(Exception):
    """Every compile thread stayed busy until the deadline: retry later."""


@dataclass(eq=False)
class _Job:
    spec: StructuredOutputsParams
    key: tuple[str, str]
    done: asyncio.Future
    waiters: int = 1
    started: float | None = None  # time.monotonic() when a thread took it
    abandoned: bool = False  # every waiter left before a thread took it: skip it
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.get_running_loop)


class GrammarCompiles:
    def __init__(self, compile_spec: Callable[[StructuredOutputsParams], object],
                 threads: int, max_bytes: int, timeout: float) -> None:
        """`compile_spec` compiles (and caches) a spec or raises RequestError; it runs on
        one of `threads` daemon threads."""
        if threads < 1 or max_bytes < 1 or timeout <= 0:
            raise ValueError("grammar compiles need threads >= 1, max_bytes >= 1, timeout > 0")
        self._compile = compile_spec
        self.max_bytes, self.timeout = max_bytes, timeout
        self._inbox: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._jobs: dict[tuple[str, str], _Job] = {}  # in flight, by spec
        self._too_slow: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._counts = threading.Lock()  # guards the two counts below (loop and threads)
        self.num_running = 0  # compiles on a thread now
        self.num_waiting = 0  # compiles queued for a thread (not yet abandoned)
        self.num_threads = threads
        for i in range(threads):
            threading.Thread(target=self._work, name=f"grammar-compile-{i}", daemon=True).start()

    async def compile(self, spec: StructuredOutputsParams, deadline: float | None = None) -> None:
        """Return once `spec` is compiled (and in the cache `compile_spec` fills).

        RequestError naming structured_outputs: too large, invalid, or too slow to compile;
        GrammarBusy: no thread took it in time; asyncio.TimeoutError: `deadline`
        (time.monotonic(), the request's own) came first."""
        key = spec.key()
        self._check(key)
        limit = time.monotonic() + self.timeout
        job = self._jobs.get(key)
        if job is None:
            job = self._jobs[key] = _Job(spec, key, asyncio.get_running_loop().create_future())
            with self._counts:
                self.num_waiting += 1
            self._inbox.put(job)
        else:
            job.waiters += 1
        try:
            while True:
                # a thread within `timeout`, then `timeout` of compile time on it
                until = limit if job.started is None else max(limit, job.started + self.timeout)
                until = until if deadline is None else min(until, deadline)
                try:
                    await asyncio.wait_for(asyncio.shield(job.done),
                                           max(until - time.monotonic(), 0.0))
                    return
                except asyncio.TimeoutError:
                    now = time.monotonic()
                    if deadline is not None and now >= deadline:
                        raise
                    if job.started is None:
                        raise GrammarBusy("every grammar compile thread of the server stayed "
                                          f"busy for {self.timeout:g} s; retry later") from None
                    if now >= job.started + self.timeout:
                        self._remember_too_slow(key)
                        raise self._too_slow_error(key) from None
                    # it got a thread meanwhile: wait for the rest of its compile time
        except BaseException:
            self._leave(job)
            raise

    def _check(self, key: tuple[str, str]) -> None:
        kind, text = key
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > self.max_bytes:
            raise RequestError(f"the {_NAMES[kind]} for {{param}} is {size} bytes, over this "
                               f"server's limit of {self.max_bytes} (--max-grammar-bytes)",
                               _PARAM)
        if key in self._too_slow:
            self._too_slow.move_to_end(key)
            raise self._too_slow_error(key)

    def _too_slow_error(self, key: tuple[str, str]) -> RequestError:
        return RequestError(f"compiling the {_NAMES[key[0]]} for {{param}} takes longer than "
                            f"this server's limit of {self.timeout:g} s "
                            "(--grammar-compile-timeout)", _PARAM)

    def _leave(self, job: _Job) -> None:
        job.waiters -= 1
        if job.waiters == 0 and self._jobs.get(job.key) is job:
            del self._jobs[job.key]  # a later request for it starts afresh (or is refused)
            with self._counts:
                if job.started is None and not job.abandoned:
                    job.abandoned = True
                    self.num_waiting -= 1

    def _remember_too_slow(self, key: tuple[str, str]) -> None:
        self._too_slow[key] = None
        if len(self._too_slow) > _MAX_REMEMBERED:
            self._too_slow.popitem(last=False)

    # ---- the threads ---------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            job = self._inbox.get()
            with self._counts:
                if job.abandoned:
                    continue
                job.started = time.monotonic()
                self.num_waiting -= 1
                self.num_running += 1
            try:
                self._compile(job.spec)
            except BaseException as exc:  # noqa: BLE001 - delivered to the waiters
                job.loop.call_soon_threadsafe(self._settle, job, exc)
            else:
                job.loop.call_soon_threadsafe(self._settle, job, None)
            finally:
                with self._counts:
                    self.num_running -= 1

    def _settle(self, job: _Job, error: BaseException | None) -> None:
        if self._jobs.get(job.key) is job:
            del self._jobs[job.key]
        if job.done.done():
            return
        if error is None:
            job.done.set_result(None)
        else:
            job.done.set_exception(error)
            job.done.exception()  # retrieved: no "never retrieved" warning without waiters


_NAMES = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex",
          "choice": "choice", "grammar": "grammar"}
