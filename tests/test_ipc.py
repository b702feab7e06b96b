"""The IPC helper every child process of pagedserve uses (pagedserve/ipc.py): a child leaves
with its parent, a dead child is seen, typed messages arrive as sent, and a stop leaves no
process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import msgspec
import pytest
import zmq

from pagedserve import ipc

# a child that ignores SIGINT/SIGTERM as pagedserve's children do, then waits for its parent
_CHILD = textwrap.dedent("""
    import os, sys, time
    from pagedserve import ipc
    ipc.ignore_stop_signals()
    parent = os.getppid()
    if sys.argv[1] == "kernel":
        ipc.die_with_parent()
    print(os.getpid(), flush=True)
    if sys.argv[1] == "kernel":
        time.sleep(600)  # only the kernel ends it early
    while not ipc.parent_gone(parent):
        time.sleep(0.05)
""")

# a parent that starts that child, reports its pid, and waits to be killed
_PARENT = textwrap.dedent("""
    import subprocess, sys, time
    from pagedserve import ipc
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]],
                             env=ipc.child_env(), stdout=subprocess.PIPE, text=True)
    print(child.stdout.readline().strip(), flush=True)
    time.sleep(600)
""")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has left
    except FileNotFoundError:
        return False


def _wait_gone(pid: int, within_s: float = 30.0) -> bool:
    deadline = time.monotonic() + within_s
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(pid)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("how", ["kernel", "polling"])
def test_a_child_dies_when_its_parent_is_killed(how):
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, _CHILD, how],
                              env=ipc.child_env(), stdout=subprocess.PIPE, text=True)
    try:
        child_pid = int(parent.stdout.readline())
        assert _alive(child_pid)
        parent.kill()  # SIGKILL: the parent cannot stop its child itself
        parent.wait()
        assert _wait_gone(child_pid), f"child {child_pid} outlived its parent"
    finally:
        parent.kill()
        parent.wait()


def test_a_dead_child_is_seen_with_how_it_ended():
    running = subprocess.Popen(ipc.module_command("this_module_does_not_exist"),
                               env=ipc.child_env(), stderr=subprocess.DEVNULL)
    running.wait()
    assert ipc.exit_description(running) == "exited with code 1"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    assert ipc.exit_description(sleeper) is None
    sleeper.send_signal(signal.SIGKILL)
    sleeper.wait()
    assert ipc.exit_description(sleeper) == f"was killed by signal {int(signal.SIGKILL)}"


class _Hello(msgspec.Struct, array_like=True, tag="h"):
    name: str
    ranks: list[int]


class _Bye(msgspec.Struct, array_like=True, tag="b"):
    code: int | None = None


def test_typed_messages_round_trip_over_a_channel():
    context = zmq.Context()
    try:
        left, right = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
        left.bind("inproc://channel")
        right.connect("inproc://channel")
        sender, receiver = ipc.Channel(left, _Hello | _Bye), ipc.Channel(right, _Hello | _Bye)
        sent = [_Hello("rank0", [0, 1]), _Bye(), _Bye(3)]
        for message in sent:
            sender.send(message)
        received = []
        while len(received) < len(sent) and receiver.poll(10_000):
            received.append(receiver.receive())
        assert received == sent
        left.send(msgspec.msgpack.encode(["z", 1]))  # no Struct of the union: refused
        with pytest.raises(msgspec.ValidationError):
            receiver.receive() if receiver.poll(10_000) else pytest.fail("nothing arrived")
    finally:
        context.destroy(linger=0)


def test_a_router_channel_sends_to_the_peers_named_and_hears_who_answered():
    """The engine's side of the ranks' wire: one call to every rank, each answer with its
    rank's identity; a receive that would block raises zmq.Again when asked not to."""
    context = zmq.Context()
    try:
        router = ipc.RouterChannel(context.socket(zmq.ROUTER), _Hello | _Bye)
        router.socket.bind("inproc://router")
        peers = {}
        for identity in (b"rank0", b"rank1"):
            dealer = context.socket(zmq.DEALER)
            dealer.setsockopt(zmq.IDENTITY, identity)
            dealer.connect("inproc://router")
            peers[identity] = ipc.Channel(dealer, _Hello | _Bye)
        peers[b"rank1"].send(_Hello("rank1", [1]))  # the router learns each peer from it
        peers[b"rank0"].send(_Hello("rank0", [0]))
        hellos = dict(router.receive_from() for _ in range(2) if router.poll(10_000))
        assert hellos == {b"rank0": _Hello("rank0", [0]), b"rank1": _Hello("rank1", [1])}
        router.send_to([b"rank0", b"rank1"], _Bye(7))
        for peer in peers.values():
            assert peer.poll(10_000) and peer.receive() == _Bye(7)
        with pytest.raises(zmq.Again):
            peers[b"rank0"].receive(block=False)
    finally:
        context.destroy(linger=0)


def test_stop_asks_first_then_kills_and_leaves_no_process():
    obeys = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    assert ipc.stop_process(obeys, obeys.stdin.close, timeout=30.0)  # EOF: it leaves
    assert obeys.returncode == 0
    stubborn = subprocess.Popen([sys.executable, "-c", _CHILD, "polling"],
                                env=ipc.child_env(), stdout=subprocess.PIPE)
    stubborn.stdout.readline()  # its signals are ignored from here on
    asked = []
    assert not ipc.stop_process(stubborn, lambda: asked.append(stubborn.send_signal(
        signal.SIGTERM)), timeout=0.5)
    assert asked and stubborn.returncode == -signal.SIGKILL
    assert not _alive(stubborn.pid)


def test_stop_of_a_child_already_gone_does_not_ask_it():
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert ipc.stop_process(gone, lambda: pytest.fail("asked a dead child"), timeout=1.0)
