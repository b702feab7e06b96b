"""What every child process of pagedserve needs, in one place: the engine-core process
(engine/core_proc.py, started by frontend/core_client.py), the grammar process
(structured/remote.py) and the tensor-parallel ranks (device/executor.py, device/worker.py).

The parent side starts a child running this pagedserve (`module_command`, `child_env`: the
child imports the same tree as its parent, even from a checkout that is not installed),
notices when it has died (`exit_description`), and stops it whatever state it is in
(`stop_process`: ask, wait, then kill), so that no process is left behind.

The child side leaves the stop decision to its parent (`ignore_stop_signals`: a Ctrl-C
reaches the whole process group, and a service manager signals every process of the
service, but the parent stops its children after its own graceful shutdown, so that
requests in flight still end cleanly), and leaves when its parent is gone: `parent_gone`, for
a loop that wakes regularly, and `die_with_parent`, where the kernel can do it at once.

`Channel` is the typed message stream of a pair of processes: msgspec msgpack over one
ZeroMQ socket, each message one frame, decoded into the union of Structs the other side may
send (each with its own `tag`); `RouterChannel` the same on a ROUTER socket, which talks to
several peers by identity (the tensor-parallel ranks).
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import zmq

_PR_SET_PDEATHSIG = 1  # linux/prctl.h

Process = subprocess.Popen | multiprocessing.Process


# -- the parent's side ------------------------------------------------------------------------

def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment (plus `extra`), with this pagedserve first on the child's path."""
    env = dict(os.environ, **(extra or {}))
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def module_command(module: str, *args: str) -> list[str]:
    """`python -m module args...` with this interpreter."""
    return [sys.executable, "-m", module, *args]


def exit_description(process: Process) -> str | None:
    """None while `process` runs; once it has ended, how ("exited with code 1", "was killed
    by signal 9")."""
    code = process.poll() if isinstance(process, subprocess.Popen) else process.exitcode
    if code is None:
        return None
    return f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"


def stop_process(process: Process, ask: Callable[[], Any] | None, timeout: float) -> bool:
    """Stop `process`: `ask` it to leave (a failure to ask is ignored: it may be gone), wait
    up to `timeout` seconds, then SIGKILL it (children ignore SIGTERM) and reap it. True if
    it left by itself."""
    if _running(process) and ask is not None:
        try:
            ask()
        except Exception:  # noqa: BLE001 - a child that cannot be asked is killed below
            pass
    _wait(process, timeout)
    if not _running(process):
        return True
    process.kill()
    _wait(process, None)
    return False


def _running(process: Process) -> bool:
    return exit_description(process) is None


def _wait(process: Process, timeout: float | None) -> None:
    if isinstance(process, subprocess.Popen):
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
    else:
        process.join(timeout)


# -- the child's side -------------------------------------------------------------------------

def ignore_stop_signals() -> None:
    """SIGINT and SIGTERM are the parent's to act on: it stops this process when it is ready."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def die_with_parent() -> None:
    """Linux: have the kernel kill this process when the thread that started it exits, even
    by SIGKILL. Only for a child whose parent starts it from a thread that lives as long as
    the parent (its main thread); `parent_gone` serves the others."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def parent_gone(parent_pid: int | None) -> bool:
    """Whether the process that started this one has exited (this one was re-parented)."""
    return parent_pid is not None and os.getppid() != parent_pid


# -- the wire ---------------------------------------------------------------------------------

class Channel:
    """Typed messages over one ZeroMQ socket: `send` encodes a Struct, `receive` decodes one
    of `incoming` (a Struct type or a union of tagged ones; None for a socket that only
    sends). `decode` serves a frame read elsewhere (an asyncio view of the same socket)."""

    def __init__(self, socket: zmq.Socket, incoming: Any = None) -> None:
        self.socket = socket
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = None if incoming is None else msgspec.msgpack.Decoder(incoming)

    def send(self, message: msgspec.Struct, block: bool = True) -> None:
        """zmq.Again when not `block`ing and the message cannot be queued now."""
        self.socket.send(self._encoder.encode(message), 0 if block else zmq.NOBLOCK,
                         copy=False)

    def poll(self, timeout_ms: int) -> bool:
        return bool(self.socket.poll(timeout_ms))

    def receive(self, block: bool = True) -> Any:
        """The next message; zmq.Again when not `block`ing and none is waiting."""
        return self.decode(self.socket.recv(0 if block else zmq.NOBLOCK, copy=False))

    def decode(self, frame: zmq.Frame) -> Any:
        return self._decoder.decode(frame.buffer)


_SNDMORE, _NOBLOCK = int(zmq.SNDMORE), int(zmq.NOBLOCK)


class RouterChannel(Channel):
    """A Channel on a ROUTER socket, whose peers (DEALERs, each a plain Channel) are named by
    their identities: a message goes to the peers named, encoded once, and comes back with
    the identity of the peer that sent it."""

    def send_to(self, identities: list[bytes], message: msgspec.Struct,
                block: bool = True) -> None:
        """Two plain sends per peer, flags as ints: a step's message goes to every rank,
        and `send_multipart`'s per-call Frame and flag-enum work costs more than the send."""
        data = self._encoder.encode(message)
        flags = 0 if block else _NOBLOCK
        send = self.socket.send
        for identity in identities:
            send(identity, flags | _SNDMORE)
            send(data, flags)

    def receive_from(self) -> tuple[bytes, Any]:
        """(the sender's identity, its message), blocking. A peer's message is its identity
        and one frame (DEALERs send single frames)."""
        identity = self.socket.recv()
        return identity, self._decoder.decode(self.socket.recv())
