"""StructuredOutputManager: the engine core's matchers and each step's grammar bitmask.

It sits beside the scheduler, as vLLM's manager of the same name does. A constrained request
gets a matcher over its compiled grammar when it is added; the manager advances a matcher
with every token its request receives and fills one bitmask row per constrained row that
samples in a step. The matcher's state is a function of the request's output tokens alone,
which survive preemption (by recompute or swap), so a preempted request resumes with its
matcher as it left it; each child of an n > 1 request is a request with its own matcher.

A grammar that starts after a marker (`StructuredOutputsParams.starts_after`: a reasoning
model's output that begins inside its think block) has its matcher made fresh and set aside
while the output is free; the manager watches that request's tokens (`marker.py`, on the
calling thread, as it handles stop tokens) and constrains it from the token after the
marker, which the matcher never sees. With a token in flight (async scheduling) such a row
may be constrained by the time it samples: `is_constrained(id, num_unseen=1)` says so, and
its row is filled once that token is known, all ones if the block is still open.

The grammar work is host work in the engine's step, so it runs on worker threads while the
engine thread does its own: `submit` queues a job (advance these matchers by their requests'
last tokens, then fill these rows) and returns at once; `take_bitmask` waits for it. Each
worker makes one xgrammar call per part of the job (`batch_accept_token`, a single-threaded
`batch_fill_next_token_bitmask`); both release the GIL. A matcher always goes to the same
worker (its slot modulo the worker count), and a worker takes its jobs in order, so a row is
only filled after its matcher has accepted every earlier token, with no barrier between jobs.
xgrammar's own threaded batch fill is not used: it starts and joins a new thread pool on
every call.

Grammars compile in the background, never in the engine's step: `add` of a spec not yet
compiled starts its compile on a daemon thread of its own (one per distinct spec in flight;
requests asking for the same spec share it; xgrammar's compile releases the interpreter lock)
and returns. The engine keeps such a request waiting (`WAITING_FOR_GRAMMAR`) and schedules
everyone else; `take_compiled` then hands it the requests whose grammar is ready (each now has
its matcher) and those whose compile failed. A compile cannot be interrupted: one whose
requests all left runs to its end, and its grammar is cached. The threads are daemons, not an
executor's, so a long compile never holds the process's exit.

While a job is outstanding the interpreter's switch interval is lowered (`_GIL_SWITCH_S`): a
worker needs the GIL for a few lines between its xgrammar calls, and at the default 5 ms it
would wait for the engine thread's whole step of Python before it even started.
"""

from __future__ import annotations

import heapq
import logging
import os
import queue
import sys
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pagedserve.structured.grammar import GrammarCache, grammar_vocab_size
from pagedserve.structured.marker import MarkerWatch, split_at_marker
from pagedserve.structured.params import StructuredOutputsParams

if TYPE_CHECKING:  # xgrammar is imported with the first grammar: it pulls in transformers
    import xgrammar as xgr

logger = logging.getLogger(__name__)

_GIL_SWITCH_S = 2e-4  # while grammar jobs are outstanding (see the module docstring)
_MAX_DEFAULT_THREADS = 4


def default_num_threads(device_type: str = "cuda") -> int:
    """Half the CPUs this process may run on, at most 4; none (the work done inline) when
    the model runs on the CPU, whose forward pass keeps every core busy through OpenMP: a
    worker would only take cores from it, and on a small loaded box each hand-off to a worker
    cost the engine thread more than the work itself (docs/benchmarks.md, "The grammar's host
    work per step").

    On a GPU host, a step of 256 rows is a few milliseconds of grammar work (same section): 4
    workers take it in well under the
    engine thread's own work of a step, which is what they overlap, and leave the other
    cores to the engine thread, the API process (tokenizing, detokenizing, HTTP) and the
    CUDA and OpenMP threads. More workers would shorten work already hidden, and each costs
    a few GIL hand-offs per step."""
    if device_type == "cpu":
        return 0
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(_MAX_DEFAULT_THREADS, cpus // 2))


@dataclass
class GrammarOutput:
    """A step's bitmask, one row per sampling row (plain data for the runner): row i of
    `bitmask` (int32, one bit per token id, 1 = allowed) belongs to `req_ids[i]`; an
    unconstrained row allows every token. The array is one of the manager's two buffers
    (pinned memory on CUDA, so its upload does not block), valid until the `take_bitmask`
    after next."""

    req_ids: list[str]
    bitmask: np.ndarray  # int32 [len(req_ids), ceil(vocab_size / 32)]


@dataclass(eq=False)
class _Waiting:
    """A request whose grammar is compiling: what its matcher needs once it is ready."""

    spec: StructuredOutputsParams
    output_token_ids: list[int]


@dataclass(eq=False)
class _Watched:
    """A request whose grammar starts after a marker its output has not written yet."""

    matcher: xgr.GrammarMatcher  # fresh: it sees the tokens after the marker
    watch: MarkerWatch


@dataclass(eq=False)
class _Entry:
    request_id: str
    matcher: xgr.GrammarMatcher
    slot: int  # lowest free first, so slot % workers spreads the live ones evenly
    handle: Any = field(init=False)  # the C++ matcher, as the batch calls take it

    def __post_init__(self) -> None:
        self.handle = self.matcher._handle


@dataclass(eq=False)
class _Task:
    """One worker's part of a job: accept these tokens, then fill these rows.

    It calls xgrammar's bindings on the matchers' handles: the Python wrappers turn the
    accept's result into a list one FFI call per element, and every FFI call gives up the
    GIL, which a worker then waits to get back while the engine thread runs Python. Here a
    task costs two calls; the result is read by the engine thread (`0 in results`, one
    call) when it collects the job."""

    accept_entries: list[_Entry] = field(default_factory=list)
    accept_handles: list[Any] = field(default_factory=list)
    accept_tokens: list[int] = field(default_factory=list)
    fill_handles: list[Any] = field(default_factory=list)
    fill_rows: list[int] = field(default_factory=list)
    # speculative verifies: (entry, its drafts, its first row), k + 1 rows each
    draft_fills: list[tuple[_Entry, list[int], int]] = field(default_factory=list)

    def run(self, filler: Any, bitmask: np.ndarray | None) -> Any:
        """The accept's results (an FFI array of 0/1, one per token), or None."""
        results = None
        if self.accept_handles:
            results = _batch_accept()(self.accept_handles, self.accept_tokens, False)
        if self.fill_handles:
            filler.batch_fill_next_token_bitmask(self.fill_handles, bitmask, self.fill_rows,
                                                 False)
        for entry, drafts, first in self.draft_fills:
            _fill_through_drafts(filler, bitmask, entry, drafts, first)
        return results

    @property
    def empty(self) -> bool:
        return not (self.accept_handles or self.fill_handles or self.draft_fills)


def _fill_through_drafts(filler: Any, bitmask: np.ndarray, entry: _Entry, drafts: list[int],
                         first: int) -> None:
    """A verify's rows: row j is the mask of the state the matcher reaches through the first
    j drafts; the matcher is rolled back after, so the tokens the verify accepts are then
    accepted as any step's are. Past a draft the grammar refuses (the row before masks it
    out, so the verify never gets there) or a stop token (the grammar has ended: the
    request stops, or goes free) the rows allow every token."""
    matcher, num = entry.matcher, 0
    for j in range(len(drafts) + 1):
        if j and (matcher.is_terminated() or not matcher.accept_token(drafts[j - 1])):
            bitmask[first + j:first + len(drafts) + 1] = -1
            break
        num = j
        if matcher.is_terminated():
            bitmask[first + j:first + len(drafts) + 1] = -1
            break
        filler.batch_fill_next_token_bitmask([entry.handle], bitmask, [first + j], False)
    if num:
        matcher.rollback(num)


def _batch_accept() -> Any:
    """xgrammar's batch accept on the matchers' handles (its binding, not the wrapper)."""
    import xgrammar as xgr

    return xgr.base._core.BatchGrammarMatcher.batch_accept_token


def _filler() -> Any:
    """xgrammar's batch fill on the calling thread only (max_threads=1: no thread pool)."""
    import xgrammar as xgr

    return xgr.BatchGrammarMatcher(max_threads=1)._handle


@dataclass(eq=False)
class _Job:
    tasks: list[_Task]
    done: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    pending: int = 0  # tasks handed out and not yet collected by the engine thread
    unrun: int = 0  # tasks handed to workers and not yet run (guarded by _Switch.lock)
    req_ids: list[str] | None = None  # a fill job: the step's sampling rows, in order
    buffer: np.ndarray | None = None  # the whole buffer its rows are filled in
    bitmask: np.ndarray | None = None  # its first len(req_ids) rows; None: no row constrained


class _Switch:
    """The interpreter's switch interval, lowered while any manager's workers have work."""

    lock = threading.Lock()
    outstanding = 0
    saved = 0.0

    @classmethod
    def enter(cls) -> None:
        with cls.lock:
            cls.outstanding += 1
            if cls.outstanding == 1:
                cls.saved = sys.getswitchinterval()
                if cls.saved > _GIL_SWITCH_S:
                    sys.setswitchinterval(_GIL_SWITCH_S)

    @classmethod
    def task_done(cls, job: _Job) -> None:
        """A worker ran one of the job's tasks; the job's last one ends its hold."""
        with cls.lock:
            job.unrun -= 1
            if job.unrun:
                return
            cls.outstanding -= 1
            if cls.outstanding == 0 and cls.saved > _GIL_SWITCH_S:
                sys.setswitchinterval(cls.saved)


def _work(inbox: queue.SimpleQueue) -> None:
    """A worker: run tasks in the order they come, report each to its job's queue."""
    filler = _filler()
    while True:
        item = inbox.get()
        if item is None:
            return
        index, task, job = item
        try:
            report = (index, task.run(filler, job.buffer), None)
        except BaseException as exc:  # noqa: BLE001 - handed to the engine thread
            report = (index, None, exc)
        _Switch.task_done(job)  # first: whoever waits for the report finds it restored
        job.done.put(report)


def new_tokens(requests: Iterable[Any], num_new: Sequence[int] | None
                ) -> Iterable[tuple[str, int]]:
    """(request id, token) of each request's last `num_new` output tokens, in order."""
    if num_new is None:
        return ((r.request_id, r.output_token_ids[-1]) for r in requests)
    return ((r.request_id, token) for r, n in zip(requests, num_new)
            for token in r.output_token_ids[len(r.output_token_ids) - n:])


def bitmask_rows(sampling_ids: Sequence[str], drafts: dict[str, list[int]] | None) -> list[str]:
    """A step's bitmask rows: a sampling row each, k + 1 for a row verifying k drafts."""
    if not drafts:
        return list(sampling_ids)
    return [req_id for req_id in sampling_ids
            for _ in range(len(drafts.get(req_id, ())) + 1)]


def _stop_workers(inboxes: list[queue.SimpleQueue]) -> None:
    for inbox in inboxes:
        inbox.put(None)


class StructuredOutputManager:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int],
                 max_num_seqs: int, pin_memory: bool = False,
                 num_threads: int | None = None, device_type: str = "cuda",
                 buffers: Sequence[np.ndarray] | None = None,
                 on_release: Callable[[str], None] | None = None,
                 grammars: GrammarCache | None = None) -> None:
        """`stop_token_ids`: the engine's EOS ids, the tokens a finished grammar allows (those
        the tokenizer has: a config's EOS may lie past a borrowed tokenizer's ids).
        `pin_memory`: the bitmask goes to a GPU (its buffers are then page-locked). The
        bitmask rows cover `grammar_vocab_size` ids, fewer than `vocab_size` where the LM
        head has many padding rows.
        `num_threads`: grammar worker threads (None: `default_num_threads(device_type)`,
        `device_type` the model's); 0 does the work on the calling thread, in `submit`.
        `buffers`: the two bitmask buffers (int32 [max_num_seqs, words]) to fill, where
        another process reads them (`remote.py`); None allocates them here. `on_release`
        hears of each request the manager frees itself (a grammar that ended or refused a
        token, at `add` or later), for a caller that mirrors which requests are constrained.
        `grammars`: the compiled-grammar cache to use (None: one built on first use)."""
        self._tokenizer, self._vocab_size = tokenizer, vocab_size
        self._grammars = grammars
        self._grammars_lock = threading.Lock()  # built by a compile thread or the caller's
        # background compiles: request id -> what its matcher needs once the grammar is ready
        self._waiting: dict[str, _Waiting] = {}
        self._compiling: dict[tuple[str, str], list[str]] = {}  # spec key -> its request ids
        self._compiled: queue.SimpleQueue = queue.SimpleQueue()  # (key, error) per compile
        self._ready: list[str] = []  # since the last take_compiled
        self._failed: list[tuple[str, str]] = []
        width = grammar_vocab_size(tokenizer, vocab_size)
        # None: no EOS id is the tokenizer's; then those xgrammar detects in its vocabulary
        self._stop_token_ids: list[int] | None = sorted(
            t for t in stop_token_ids if t < width) or None
        self._stop_set = frozenset(self._stop_token_ids or ())
        self._entries: dict[str, _Entry] = {}
        self._watched: dict[str, _Watched] = {}  # free until their marker (starts_after)
        self._free_slots: list[int] = []  # a heap of released slots below _next_slot
        self._next_slot = 0
        self._on_release = on_release
        # two buffers, used in turn: a bitmask being uploaded is never the one being filled
        if buffers is None:
            # xgrammar's layout: int32 words, bit i of word w allows token 32 * w + i
            tensors = [torch.full((max_num_seqs, -(-width // 32)), -1, dtype=torch.int32)
                       for _ in range(2)]
            if pin_memory:
                tensors = [b.pin_memory() for b in tensors]
            self._buffer_tensors = tensors  # owns the (pinned) memory
            buffers = [b.numpy() for b in tensors]
        else:
            for buffer in buffers:
                buffer.fill(-1)  # all allowed, as xgrammar allocates them
        self._buffers = list(buffers)
        # the rows of each buffer that a grammar filled when it was last used; others are -1
        self._dirty = [np.zeros(max_num_seqs, dtype=bool) for _ in range(2)]
        self._next_buffer = 0
        self._jobs: deque[_Job] = deque()
        self._inline_filler: Any = None
        self._inboxes: list[queue.SimpleQueue] = []
        self._finalizer: weakref.finalize | None = None
        self.num_threads = (default_num_threads(device_type) if num_threads is None
                            else num_threads)

    @property
    def grammars(self) -> GrammarCache:
        """Built on first use: its token table costs a second for a large vocabulary."""
        if self._grammars is None:
            with self._grammars_lock:
                if self._grammars is None:
                    self._grammars = GrammarCache(self._tokenizer, self._vocab_size)
        return self._grammars

    # -- requests -----------------------------------------------------------------------------

    def add_request(self, request: Any) -> None:
        """Give an engine request a matcher if it asks for structured outputs (once its
        grammar has compiled: see `add`)."""
        spec = request.sampling_params.structured_outputs
        if spec is not None:
            self.add(request.request_id, spec, request.output_token_ids)

    def add(self, request_id: str, spec: StructuredOutputsParams,
            output_token_ids: Sequence[int] = ()) -> None:
        """Give the request a matcher for `spec` now if its grammar is cached, else once it
        has compiled in the background; either way the next `take_compiled` reports it
        (ready, or failed). Returns at once."""
        key = spec.key()
        if key not in self._compiling and self._grammars is not None:
            compiled = self._grammars.peek(spec)
            if compiled is not None:
                self._add_matcher(request_id, compiled, output_token_ids, spec.starts_after)
                self._ready.append(request_id)
                return
        self._waiting[request_id] = _Waiting(spec, list(output_token_ids))
        if key in self._compiling:
            self._compiling[key].append(request_id)
            return
        self._compiling[key] = [request_id]
        threading.Thread(target=self._compile, args=(key, spec), name="grammar-compile",
                         daemon=True).start()

    def _compile(self, key: tuple[str, str], spec: StructuredOutputsParams) -> None:
        """A compile thread: compile (into the cache) and report to `take_compiled`."""
        error = None
        try:
            self.grammars.get(spec)
        except Exception as exc:  # noqa: BLE001 - the request fails, the engine goes on
            error = str(exc) if isinstance(exc, ValueError) else f"compile failed: {exc!r}"
        self._compiled.put((key, error))

    def has_compiles(self) -> bool:
        """Requests are waiting for their grammar, or `take_compiled` has news for them."""
        return bool(self._waiting or self._ready or self._failed)

    def take_compiled(self) -> tuple[list[str], list[tuple[str, str]]]:
        """The requests whose grammar became ready since the last call (each has its
        matcher, or is free if its grammar had already ended), and (request id, error) for
        those whose compile failed. Never waits."""
        while not self._compiled.empty():
            key, error = self._compiled.get()
            for request_id in self._compiling.pop(key):
                waiting = self._waiting.pop(request_id, None)
                if waiting is None:
                    continue  # removed while its grammar compiled
                if error is not None:
                    self._failed.append((request_id, error))
                    continue
                self._add_matcher(request_id, self.grammars.get(waiting.spec),
                                  waiting.output_token_ids, waiting.spec.starts_after)
                self._ready.append(request_id)
        ready, failed = self._ready, self._failed
        self._ready, self._failed = [], []
        return ready, failed

    def _add_matcher(self, request_id: str, compiled: xgr.CompiledGrammar,
                     output_token_ids: Sequence[int],
                     starts_after: list[int] | None = None) -> None:
        """A matcher over `compiled`, advanced by the tokens the request already has (those
        after `starts_after`'s marker; none yet: the request is watched for it). A request
        whose grammar has already ended, or refuses them, stays free (`on_release`)."""
        if self._stop_token_ids is None:
            self._stop_token_ids = list(self.grammars.tokenizer_info.stop_token_ids)
            self._stop_set = frozenset(self._stop_token_ids)
        import xgrammar as xgr

        matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=self._stop_token_ids)
        if starts_after is not None:
            watch = MarkerWatch(starts_after)
            after = split_at_marker(watch, output_token_ids)
            if after is None:
                self._watched[request_id] = _Watched(matcher, watch)
                return
            output_token_ids = after
        self._constrain(request_id, matcher, output_token_ids)

    def _constrain(self, request_id: str, matcher: xgr.GrammarMatcher,
                   output_token_ids: Sequence[int]) -> None:
        """Hold the request to `matcher`, advanced by `output_token_ids` first."""
        for token_id in output_token_ids:  # a request that arrives with output
            if matcher.is_terminated():
                break  # past the grammar's end: unconstrained
            if not matcher.accept_token(token_id):
                logger.error("request %s: token %d does not match its grammar; its output is "
                             "not constrained", request_id, token_id)
                break
        else:
            if not matcher.is_terminated():
                if self._free_slots:
                    slot = heapq.heappop(self._free_slots)
                else:
                    slot, self._next_slot = self._next_slot, self._next_slot + 1
                self._entries[request_id] = _Entry(request_id, matcher, slot)
                return
        self._release(request_id)

    def remove_request(self, request_id: str) -> None:
        """Forget a finished or aborted request's matcher. A job already queued may still
        use it (the row's token is then discarded); no later job does."""
        entry = self._entries.pop(request_id, None)
        if entry is not None:
            heapq.heappush(self._free_slots, entry.slot)
        self._waiting.pop(request_id, None)
        self._watched.pop(request_id, None)

    def _release(self, request_id: str) -> None:
        """The manager's own decision to free a request (its grammar ended or refused a
        token), which whoever mirrors its requests must learn (`on_release`)."""
        self.remove_request(request_id)
        if self._on_release is not None:
            self._on_release(request_id)

    def has_requests(self) -> bool:
        """Requests with a matcher, held or watched for their marker (their tokens must
        still be submitted)."""
        return bool(self._entries or self._watched)

    def is_constrained(self, request_id: str, num_unseen: int = 0) -> bool:
        """The request's next token is masked by its grammar: it has a matcher, which has
        not accepted a stop token; or, with `num_unseen` (1) of its tokens not submitted yet
        (in flight), that token may end the marker its grammar starts after."""
        if request_id in self._entries:
            return True
        watched = self._watched.get(request_id)
        return watched is not None and watched.watch.may_end_with(num_unseen)

    @property
    def stop_token_ids(self) -> list[int] | None:
        """The matchers' stop tokens: the engine's EOS ids within the grammar's vocabulary
        (None until the first constrained request if none is: xgrammar's own then)."""
        return self._stop_token_ids

    # -- the step's work ----------------------------------------------------------------------

    def grammar_bitmask(self, req_ids: Sequence[str],
                        drafts: dict[str, list[int]] | None = None) -> GrammarOutput | None:
        """The bitmask of a step's sampling rows, now: `submit` then `take_bitmask`."""
        self.submit((), req_ids, drafts)
        return self.take_bitmask()

    def submit(self, requests: Iterable[Any] = (),
               sampling_ids: Sequence[str] | None = None,
               drafts: dict[str, list[int]] | None = None,
               num_new: Sequence[int] | None = None) -> None:
        """Queue a job and return: advance the matchers of `requests` by the tokens each
        just received (its last `num_new` output tokens; None: its last one), then, if
        `sampling_ids` is given (a step's sampling rows, in order), fill their bitmask
        rows, which `take_bitmask` returns: one per row, k + 1 for a row that verifies k
        `drafts` (speculative decoding: the masks of the states its drafts lead to)."""
        self.submit_tokens(new_tokens(requests, num_new), sampling_ids, drafts)

    def submit_tokens(self, tokens: Iterable[tuple[str, int]],
                      sampling_ids: Sequence[str] | None = None,
                      drafts: dict[str, list[int]] | None = None) -> None:
        """`submit` of (request id, its new token) pairs, in order. A matcher is advanced
        and filled by one worker, in the order of the calls.

        A stop token is accepted here, on the calling thread (after the matcher's queued
        work): it ends the grammar, the request goes unconstrained (e.g. under ignore_eos),
        and a terminated matcher must not be filled."""
        if sampling_ids is not None and any(job.req_ids is not None for job in self._jobs):
            raise RuntimeError("a bitmask is being filled: take it before the next one")
        jobs = self._jobs  # collect the accept-only jobs already done (a free step's)
        while jobs and jobs[0].req_ids is None and jobs[0].done.qsize() == jobs[0].pending:
            self._finish([jobs.popleft()])
        workers = max(self.num_threads, 1)
        job = _Job([_Task() for _ in range(workers)])
        tasks, entries, watched = job.tasks, self._entries, self._watched
        if entries or watched:
            stop_set = self._stop_set
            for request_id, token in tokens:
                entry = entries.get(request_id)
                if entry is None:
                    if watched:
                        self._watch(request_id, token)
                    continue
                task = tasks[entry.slot % workers]
                if token in stop_set:
                    self._accept_stop(entry, token, task)
                    continue
                task.accept_entries.append(entry)
                task.accept_handles.append(entry.handle)
                task.accept_tokens.append(token)
        if sampling_ids is not None:
            job.req_ids = bitmask_rows(sampling_ids, drafts)
            self._plan_fill(job, workers, drafts)
        if all(task.empty for task in tasks):
            if job.req_ids is not None:
                self._jobs.append(job)  # nothing to wait for: its rows are all free
            return
        self._jobs.append(job)
        if self.num_threads == 0:
            if self._inline_filler is None:
                self._inline_filler = _filler()
            for index, task in enumerate(tasks):
                if not task.empty:
                    job.pending += 1
                    try:
                        job.done.put((index, task.run(self._inline_filler, job.buffer), None))
                    except Exception as exc:  # noqa: BLE001 - raised by take_bitmask
                        job.done.put((index, None, exc))
            return
        if not self._inboxes:
            self._start_workers()
        handed = [(index, task) for index, task in enumerate(tasks) if not task.empty]
        job.pending = job.unrun = len(handed)
        _Switch.enter()
        for index, task in handed:
            self._inboxes[index].put((index, task, job))

    def _watch(self, request_id: str, token: int) -> None:
        """A watched request's token: the one that ends its marker constrains it from the
        next (the matcher never sees it)."""
        item = self._watched.get(request_id)
        if item is not None and item.watch.feed(token):
            del self._watched[request_id]
            self._constrain(request_id, item.matcher, ())

    def _accept_stop(self, entry: _Entry, token: int, task: _Task) -> None:
        """A stop token ends the grammar if accepted; either way the request goes free. The
        tokens before it in this job (a verify's accepted drafts) are taken out of `task`
        and accepted here first."""
        self.wait()  # its earlier tokens first (in the engine's order, nothing is queued)
        earlier = [t for e, t in zip(task.accept_entries, task.accept_tokens) if e is entry]
        if earlier:
            kept = [i for i, e in enumerate(task.accept_entries) if e is not entry]
            task.accept_entries = [task.accept_entries[i] for i in kept]
            task.accept_handles = [task.accept_handles[i] for i in kept]
            task.accept_tokens = [task.accept_tokens[i] for i in kept]
        if not all(entry.matcher.accept_token(t) for t in (*earlier, token)):
            logger.error("request %s: token %d does not match its grammar; its output is no "
                         "longer constrained", entry.request_id, token)
        self._release(entry.request_id)

    def _plan_fill(self, job: _Job, workers: int,
                   drafts: dict[str, list[int]] | None = None) -> None:
        """Give each constrained row to its matcher's worker (a verify's k + 1 rows
        together). The rows left free are reset to all ones where this buffer last held a
        grammar's row."""
        index = self._next_buffer
        self._next_buffer ^= 1
        buffer, dirty = self._buffers[index], self._dirty[index]
        num_rows = len(job.req_ids)
        filled = np.zeros(num_rows, dtype=bool)
        entries, tasks = self._entries, job.tasks
        if entries:
            row = 0
            while row < num_rows:
                req_id = job.req_ids[row]
                entry = entries.get(req_id)
                verified = drafts.get(req_id) if drafts else None
                if entry is not None:
                    task = tasks[entry.slot % workers]
                    if verified:
                        task.draft_fills.append((entry, verified, row))
                        filled[row:row + len(verified) + 1] = True
                    else:
                        task.fill_handles.append(entry.handle)
                        task.fill_rows.append(row)
                        filled[row] = True
                row += len(verified) + 1 if verified else 1
        reset = np.flatnonzero(dirty[:num_rows] & ~filled)
        if len(reset):
            buffer[reset] = -1
        dirty[:num_rows] = filled  # rows past the step keep theirs until a step covers them
        if filled.any():
            job.buffer, job.bitmask = buffer, buffer[:num_rows]

    def take_bitmask(self) -> GrammarOutput | None:
        """Wait for the bitmask queued by the last `submit` with rows (and every job queued
        before it); None if none of its rows was constrained."""
        jobs, self._jobs = self._jobs, deque()
        taken = None
        for job in jobs:
            if job.req_ids is not None:
                taken = job
        self._finish(jobs)
        if taken is None or taken.bitmask is None:
            return None
        return GrammarOutput(taken.req_ids, taken.bitmask)

    def wait(self) -> None:
        """Wait for every queued job; a bitmask not taken yet stays to be taken."""
        jobs = self._jobs
        self._jobs = deque(job for job in jobs if job.req_ids is not None)
        self._finish(jobs)

    def _finish(self, jobs: Iterable[_Job]) -> None:
        """Collect the jobs' reports (once each); drop the matchers that refused a token;
        raise the first failure once all are collected."""
        error = None
        for job in jobs:
            while job.pending:
                index, results, exc = job.done.get()
                job.pending -= 1
                if exc is not None:
                    error = error or exc
                elif results is not None and 0 in results:
                    self._drop_refused(job.tasks[index], list(results))
        if error is not None:
            raise RuntimeError("a grammar worker failed") from error

    def _drop_refused(self, task: _Task, accepted: list[int]) -> None:
        for entry, ok, token in zip(task.accept_entries, accepted, task.accept_tokens):
            if not ok and self._entries.get(entry.request_id) is entry:
                logger.error("request %s: token %d does not match its grammar; its output is "
                             "no longer constrained", entry.request_id, token)
                self._release(entry.request_id)

    # -- workers ------------------------------------------------------------------------------

    def _start_workers(self) -> None:
        self._inboxes = [queue.SimpleQueue() for _ in range(self.num_threads)]
        for i, inbox in enumerate(self._inboxes):
            threading.Thread(target=_work, args=(inbox,), name=f"grammar-{i}",
                             daemon=True).start()
        # the threads hold only their queues: a manager dropped without shutdown stops them
        self._finalizer = weakref.finalize(self, _stop_workers, self._inboxes)

    def set_num_threads(self, num_threads: int) -> None:
        """Change the worker count (0: inline) between steps."""
        if any(job.req_ids is not None for job in self._jobs):
            raise RuntimeError("a bitmask is being filled: take it first")
        self.shutdown()
        self.num_threads = num_threads

    def shutdown(self) -> None:
        """Finish the queued work and stop the worker threads (a later job starts them)."""
        try:
            self.wait()
        finally:
            if self._finalizer is not None:
                self._finalizer()
                self._finalizer = None
            self._inboxes = []
