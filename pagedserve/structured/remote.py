"""The grammar work of structured outputs in a process of its own (the default on a GPU).

Why: on a GPU host the engine thread's Python is the step's critical path, and grammar work
on threads of the same process competes with it for the interpreter lock. Each worker needs
the lock a few times per step between its xgrammar calls, and the engine thread pays for
every forced switch, while the workers finish late. Here the matchers live in a child
process that runs the in-process manager (`manager.py`, with its worker threads); the engine
thread only sends each step's new tokens and sampling rows and later receives a buffer
index, and the bitmask rows are written straight into shared memory that is page-locked on
the engine's side, so the upload needs no copy (two buffers of max_num_seqs x vocab / 8
bytes in /dev/shm: 9.7 MB at 256 rows of a 151,936-token vocabulary; a container's /dev/shm
must hold them, as it must for vLLM's shared-memory queues).

`GrammarProcess` offers the engine core what `StructuredOutputManager` does (add and remove
requests, `submit`, `take_bitmask`, `grammar_bitmask`); it mirrors which requests are
constrained, so the engine sends nothing for free rows, and the child reports the requests
it freed itself (a grammar that ended or refused a token). A grammar that starts after a
marker (`starts_after`) is watched on both sides with the same rule (`marker.py`): the
engine sends the watched requests' tokens too, and knows the row is constrained from the
token after the marker without asking. The child starts at the first
constrained request: until it is up, messages wait in the socket's queue, and the first
`take_bitmask` waits for it (its tokenizer table is built there, as the in-process manager
builds it at that request). It leaves when told (`shutdown`, or when the engine is collected
or its process exits), or within a second of its parent's death; it ignores SIGINT and
SIGTERM, which its engine's process group receives.

Grammars compile in the child, in the background (the manager's compile threads): the
child's loop goes on serving the engine's steps meanwhile, and reports each request whose
grammar is ready (its matcher made) or failed in a `_Ready` as soon as it knows. The engine
reads them without waiting at the start of a step (`take_compiled`), and schedules a
constrained request only after its `_Ready`: a request sent to the child is not constrained
until then, even with its grammar cached there (one round trip).

Wire (msgpack, one frame): engine -> child `_Add`, `_Remove`, `_Submit`, `_Threads`,
`_Stop`; child -> engine `_Taken`, once per `_Submit` with rows to fill, sent as soon as they
are filled: the engine's `take_bitmask` finds it waiting rather than asking for it (a round
trip of thread wake-ups in both processes); `_Ready`, whenever compiles have finished.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import subprocess
import tempfile
import weakref
from collections.abc import Iterable, Sequence
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import msgspec
import numpy as np
import zmq

from pagedserve import ipc
from pagedserve.structured.grammar import GrammarCache, grammar_vocab_size
from pagedserve.structured.manager import (
    GrammarOutput, StructuredOutputManager, bitmask_rows, default_num_threads, new_tokens)
from pagedserve.structured.marker import MarkerWatch, split_at_marker
from pagedserve.structured.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

_POLL_MS = 1000  # how often a waiting side checks that the other is still alive
_COMPILE_POLL_MS = 5  # how often the child looks for finished compiles while any runs
_STOP_TIMEOUT_S = 5.0


class _Add(msgspec.Struct, array_like=True, tag="a"):
    request_id: str
    spec: StructuredOutputsParams
    output_token_ids: list[int]


class _Remove(msgspec.Struct, array_like=True, tag="r"):
    request_ids: list[str]


class _Submit(msgspec.Struct, array_like=True, tag="s"):
    tokens: list[tuple[str, int]]  # (request id, its new token)
    sampling_ids: list[str] | None  # the step's sampling rows to fill, in order
    drafts: dict[str, list[int]] | None = None  # speculative verifies' drafts, by request


class _Threads(msgspec.Struct, array_like=True, tag="n"):
    num_threads: int


class _Stop(msgspec.Struct, array_like=True, tag="q"):
    pass


_Message = _Add | _Remove | _Submit | _Threads | _Stop


class _Taken(msgspec.Struct, array_like=True, tag="t"):  # the answer to a fill's _Submit
    buffer: int  # which shared buffer holds the bitmask; -1: no row was constrained
    released: list[str]  # requests the child freed since its last reply
    error: str | None = None


class _Ready(msgspec.Struct, array_like=True, tag="d"):  # compiles that finished
    ready: list[str]  # requests that have their matcher now
    failed: list[tuple[str, str]]  # (request id, why its grammar did not compile)


class GrammarProcess:
    def __init__(self, tokenizer: Any, tokenizer_source: str, vocab_size: int,
                 stop_token_ids: Iterable[int], max_num_seqs: int, pin_memory: bool = False,
                 num_threads: int | None = None) -> None:
        """The arguments of `StructuredOutputManager`, plus where the child loads the
        tokenizer from (`tokenizer_source`: a folder or a .gguf file). `pin_memory`: the
        shared buffers are page-locked for a CUDA upload."""
        self._tokenizer, self._tokenizer_source = tokenizer, tokenizer_source
        self._vocab_size, self._stop_token_ids = vocab_size, sorted(stop_token_ids)
        self._rows, self._pin = max_num_seqs, pin_memory
        self._words = (grammar_vocab_size(tokenizer, vocab_size) + 31) // 32
        self.num_threads = (default_num_threads("cuda") if num_threads is None
                            else num_threads)
        self._grammars: GrammarCache | None = None
        self._constrained: set[str] = set()
        self._compiling: set[str] = set()  # sent to the child, no _Ready for them yet
        # free until their marker (starts_after): watched here as in the child
        self._watched: dict[str, MarkerWatch] = {}
        self._taken: list[_Taken] = []  # a fill's answer read early, by take_compiled
        # the news of the _Ready messages read since the last take_compiled
        self._ready: list[str] = []
        self._failed: list[tuple[str, str]] = []
        self._removed: list[str] = []  # sent before the next message
        self._filling: list[str] | None = None  # the rows of a fill not taken yet
        self._child: _Child | None = None
        self._finalizer: weakref.finalize | None = None

    @property
    def grammars(self) -> GrammarCache:
        """This process's cache, for the frontend's validation (the child has its own)."""
        if self._grammars is None:
            self._grammars = GrammarCache(self._tokenizer, self._vocab_size)
        return self._grammars

    @property
    def stop_token_ids(self) -> list[int]:
        """The matchers' stop tokens, as the child's manager chooses them: the engine's EOS
        ids within the grammar's vocabulary, else those xgrammar detects."""
        width = grammar_vocab_size(self._tokenizer, self._vocab_size)
        return ([t for t in self._stop_token_ids if t < width]
                or list(self.grammars.tokenizer_info.stop_token_ids))

    # -- requests -----------------------------------------------------------------------------

    def add_request(self, request: Any) -> None:
        spec = request.sampling_params.structured_outputs
        if spec is None:
            return
        if self._child is None:
            self._start()
        self._send(_Add(request.request_id, spec, list(request.output_token_ids)))
        self._compiling.add(request.request_id)
        if spec.starts_after is not None:
            watch = MarkerWatch(spec.starts_after)
            if split_at_marker(watch, request.output_token_ids) is None:
                self._watched[request.request_id] = watch

    def remove_request(self, request_id: str) -> None:
        watched = self._watched.pop(request_id, None)
        if request_id in self._constrained or request_id in self._compiling or watched:
            self._constrained.discard(request_id)
            self._compiling.discard(request_id)
            self._removed.append(request_id)

    def has_requests(self) -> bool:
        return bool(self._constrained or self._watched)

    def has_compiles(self) -> bool:
        """Requests sent to the child that it has not reported ready or failed yet, or
        news of them that `take_compiled` has not returned."""
        return bool(self._compiling or self._ready or self._failed)

    def take_compiled(self) -> tuple[list[str], list[tuple[str, str]]]:
        """`StructuredOutputManager.take_compiled`, from the child's `_Ready`s received so
        far (never waits)."""
        child = self._child
        while self._compiling and child.channel.poll(0):
            message = child.receive()
            if isinstance(message, _Taken):
                self._taken.append(message)  # take_bitmask's, read on the way
            else:
                self._note(message)
        ready, failed = self._ready, self._failed
        if self._compiling and not (ready or failed) and child.process.poll() is not None:
            # else its requests would wait for ever
            raise RuntimeError(f"the grammar process exited with code "
                               f"{child.process.returncode}")
        self._ready, self._failed = [], []
        return ready, failed

    def _note(self, message: _Ready) -> None:
        """Take in the child's news in the order it came (a request ready now may be
        released by a later `_Taken`); requests removed meanwhile are dropped."""
        compiling = self._compiling
        ready = [i for i in message.ready if i in compiling]
        self._failed += (f for f in message.failed if f[0] in compiling)
        compiling.difference_update(message.ready)
        compiling.difference_update(i for i, _ in message.failed)
        for request_id, _ in message.failed:
            self._watched.pop(request_id, None)
        self._constrained.update(i for i in ready if i not in self._watched)
        self._ready += ready

    def is_constrained(self, request_id: str, num_unseen: int = 0) -> bool:
        """As the engine knows it (the child may have freed it since its last reply); a
        watched request as `StructuredOutputManager.is_constrained` says."""
        if request_id in self._constrained:
            return True
        watch = self._watched.get(request_id)
        return (watch is not None and request_id not in self._compiling
                and watch.may_end_with(num_unseen))

    # -- the step's work ----------------------------------------------------------------------

    def grammar_bitmask(self, req_ids: Sequence[str],
                        drafts: dict[str, list[int]] | None = None) -> GrammarOutput | None:
        self.submit((), req_ids, drafts)
        return self.take_bitmask()

    def submit(self, requests: Iterable[Any] = (),
               sampling_ids: Sequence[str] | None = None,
               drafts: dict[str, list[int]] | None = None,
               num_new: Sequence[int] | None = None) -> None:
        """`StructuredOutputManager.submit`: only the constrained requests' tokens are sent,
        and nothing when there is nothing to do."""
        if sampling_ids is not None and self._filling is not None:
            raise RuntimeError("a bitmask is being filled: take it before the next one")
        constrained, watched = self._constrained, self._watched
        tokens = [(request_id, token) for request_id, token in new_tokens(requests, num_new)
                  if request_id in constrained or request_id in watched
                  ] if constrained or watched else []
        if watched:
            for request_id, token in tokens:
                watch = watched.get(request_id)
                if watch is not None and watch.feed(token):  # constrained from the next
                    del watched[request_id]
                    constrained.add(request_id)
        fill = None
        if sampling_ids is not None and any(i in constrained for i in sampling_ids):
            fill = list(sampling_ids)
            self._filling = bitmask_rows(fill, drafts)
        if tokens or fill is not None:
            self._send(_Submit(tokens, fill, drafts if fill is not None else None))

    def take_bitmask(self) -> GrammarOutput | None:
        """The bitmask of the last `submit` with constrained rows, as the child filled it in
        shared memory; None if none of its rows was constrained."""
        rows, self._filling = self._filling, None
        if rows is None:
            return None
        taken = self._taken.pop(0) if self._taken else self._receive_taken()
        self._constrained.difference_update(taken.released)
        if taken.error is not None:
            raise RuntimeError(f"the grammar process failed: {taken.error}")
        if taken.buffer < 0:
            return None
        return GrammarOutput(rows, self._child.buffers[taken.buffer][:len(rows)])

    def _receive_taken(self) -> _Taken:
        """Wait for the fill's answer; the `_Ready`s before it are noted on the way."""
        while not isinstance(message := self._child.receive(), _Taken):
            self._note(message)
        return message

    def set_num_threads(self, num_threads: int) -> None:
        """The child's worker count (0: its main thread does the work)."""
        if self._filling is not None:
            raise RuntimeError("a bitmask is being filled: take it first")
        self.num_threads = num_threads
        if self._child is not None:
            self._send(_Threads(num_threads))

    def shutdown(self) -> None:
        """Stop the child (a later constrained request starts a new one)."""
        if self._finalizer is not None:
            self._finalizer()
        self._child = self._finalizer = None
        self._constrained.clear()
        self._compiling.clear()
        self._watched.clear()
        self._taken.clear()
        self._ready.clear()
        self._failed.clear()
        self._removed.clear()
        self._filling = None

    # -- the child ----------------------------------------------------------------------------

    def _start(self) -> None:
        self._child = _Child(self._tokenizer_source, self._vocab_size, self._stop_token_ids,
                             self._rows, self._words, self.num_threads, self._pin)
        self._finalizer = weakref.finalize(self, self._child.stop)

    def _send(self, message: msgspec.Struct) -> None:
        """Send `message`, after the removals queued since the last one."""
        if self._child is None:
            return
        if self._removed:
            removed, self._removed = self._removed, []
            self._child.send(_Remove(removed))
        self._child.send(message)


class _Child:
    """The engine's side of one child process: its socket, its shared buffers, its end."""

    def __init__(self, tokenizer_source: str, vocab_size: int, stop_token_ids: list[int],
                 rows: int, words: int, num_threads: int, pin: bool) -> None:
        self.folder = tempfile.mkdtemp(prefix="pagedserve-grammar-")
        self.shm = shared_memory.SharedMemory(create=True, size=2 * rows * words * 4)
        self.buffers = _bitmask_buffers(self.shm, rows, words)
        self.registered = pin and _register_host_memory(self.buffers[0].ctypes.data,
                                                        self.shm.size)
        if pin and not self.registered:
            logger.warning("could not page-lock the grammar bitmask buffers: each upload "
                           "copies them first")
        self.context = zmq.Context()
        socket = self.context.socket(zmq.PAIR)
        # connecting (not binding) queues messages until the child has bound the address
        address = f"ipc://{os.path.join(self.folder, 'grammar')}"
        socket.connect(address)
        self.channel = ipc.Channel(socket, _Taken | _Ready)
        cmd = ipc.module_command(
            "pagedserve.structured.remote", "--address", address,
            "--parent-pid", str(os.getpid()), "--shm", self.shm.name,
            "--tokenizer", tokenizer_source, "--vocab-size", str(vocab_size),
            "--rows", str(rows), "--threads", str(num_threads),
            "--stop-token-ids", ",".join(map(str, stop_token_ids)))
        self.process = subprocess.Popen(cmd, env=ipc.child_env())

    def send(self, message: msgspec.Struct) -> None:
        self.channel.send(message)

    def receive(self) -> _Taken | _Ready:
        while not self.channel.poll(_POLL_MS):
            if self.process.poll() is not None:
                raise RuntimeError(f"the grammar process exited with code "
                                   f"{self.process.returncode}")
        return self.channel.receive()

    def stop(self) -> None:
        """Tell the child to leave, wait for it (kill it if it does not), free the rest."""
        try:
            ipc.stop_process(self.process, lambda: self.send(_Stop()), _STOP_TIMEOUT_S)
        finally:
            self.context.destroy(linger=0)
            if self.registered:
                _unregister_host_memory(self.buffers[0].ctypes.data)
            self.buffers = []
            try:
                self.shm.close()
            except BufferError:  # a bitmask view is still held: the mapping goes with it
                pass
            self.shm.unlink()
            shutil.rmtree(self.folder, ignore_errors=True)


def _bitmask_buffers(shm: shared_memory.SharedMemory, rows: int,
                     words: int) -> list[np.ndarray]:
    """The two int32 [rows, words] bitmask buffers, one after the other in `shm`: the
    same views on both sides of the wire."""
    return [np.ndarray((rows, words), np.int32, shm.buf, i * rows * words * 4)
            for i in range(2)]


def _register_host_memory(address: int, size: int) -> bool:
    """Page-lock memory torch did not allocate, so a non-blocking upload reads it directly."""
    import torch

    if not torch.cuda.is_available():
        return False
    return int(torch.cuda.cudart().cudaHostRegister(address, size, 0)) == 0


def _unregister_host_memory(address: int) -> None:
    import torch

    torch.cuda.cudart().cudaHostUnregister(address)


# -- the child process --------------------------------------------------------------------------

def serve(channel: ipc.Channel, manager: StructuredOutputManager, buffers: list[np.ndarray],
          released: list[str], parent_pid: int) -> None:
    """Apply the engine's messages in order until told to stop or the parent is gone; report
    finished compiles between them (looking every few ms while one runs)."""
    while True:
        if channel.poll(_COMPILE_POLL_MS if manager.has_compiles() else _POLL_MS):
            if not _apply(channel.receive(), channel, manager, buffers, released):
                return
        elif ipc.parent_gone(parent_pid):
            return
        if manager.has_compiles():
            ready, failed = manager.take_compiled()
            if ready or failed:
                channel.send(_Ready(ready, failed))


def _apply(message: _Message, channel: ipc.Channel, manager: StructuredOutputManager,
           buffers: list[np.ndarray], released: list[str]) -> bool:
    """One message of the engine's; False once told to stop."""
    if isinstance(message, _Submit):
        manager.submit_tokens(message.tokens, message.sampling_ids, message.drafts)
        if message.sampling_ids is not None:
            channel.send(_take(manager, buffers, released))
    elif isinstance(message, _Remove):
        for request_id in message.request_ids:
            manager.remove_request(request_id)
    elif isinstance(message, _Add):  # compiled in the background: a _Ready tells the engine
        manager.add(message.request_id, message.spec, message.output_token_ids)
    elif isinstance(message, _Threads):
        manager.set_num_threads(message.num_threads)
    else:
        manager.shutdown()
        return False
    return True


def _take(manager: StructuredOutputManager, buffers: list[np.ndarray],
          released: list[str]) -> _Taken:
    buffer, error = -1, None
    try:
        output = manager.take_bitmask()
        if output is not None:
            address = output.bitmask.ctypes.data
            buffer = next(i for i, b in enumerate(buffers) if b.ctypes.data == address)
    except RuntimeError as exc:  # a worker failed: the engine raises it
        error = f"{exc}: {exc.__cause__!r}"
    taken = _Taken(buffer, list(released), error)
    released.clear()
    return taken


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--shm", required=True)
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--vocab-size", type=int, required=True)
    parser.add_argument("--rows", type=int, required=True)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--stop-token-ids", default="")
    args = parser.parse_args(argv)
    # as the engine-core process does (core_proc.py): a Ctrl-C reaches the whole process
    # group, and the engine decides when this process stops (or it leaves with its parent)
    ipc.ignore_stop_signals()  # no die_with_parent: the engine may start it on any thread
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    context = zmq.Context()
    socket = context.socket(zmq.PAIR)
    socket.bind(args.address)
    shm = shared_memory.SharedMemory(args.shm)
    # the engine owns the segment: this process must not unlink it when it exits
    resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001
    from pagedserve.model.loader import load_tokenizer

    tokenizer = load_tokenizer(args.tokenizer)
    words = (grammar_vocab_size(tokenizer, args.vocab_size) + 31) // 32
    buffers = _bitmask_buffers(shm, args.rows, words)
    released: list[str] = []
    stops = [int(t) for t in args.stop_token_ids.split(",") if t]
    manager = StructuredOutputManager(tokenizer, args.vocab_size, stops, args.rows,
                                      num_threads=args.threads, buffers=buffers,
                                      on_release=released.append)
    manager.grammars  # noqa: B018 - the token table now, before the first request needs it
    try:
        serve(ipc.Channel(socket, _Message), manager, buffers, released, args.parent_pid)
    finally:
        context.destroy(linger=0)


if __name__ == "__main__":
    main()
