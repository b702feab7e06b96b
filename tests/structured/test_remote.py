"""The grammar process's life cycle, without a model: its bitmask rows are the in-process
manager's; it leaves when its parent is gone; a child that died is an error at the next
`take_bitmask`, not a hang; shutdown leaves no process and no shared memory behind."""

from __future__ import annotations

import inspect
import os
import signal
import subprocess
import sys
import time
from multiprocessing import shared_memory

import numpy as np
import psutil
import pytest

from benchmarks.make_checkpoint import byte_level_tokenizer
from pagedserve.structured.backend import GrammarBackend
from pagedserve.structured.manager import StructuredOutputManager
from pagedserve.structured.params import StructuredOutputsParams
from pagedserve.structured.remote import GrammarProcess
from tests.structured.test_manager import Request, add_ready

VOCAB, EOS, ROWS = 259, 2, 4
SPEC = StructuredOutputsParams(regex=r"[a-c]{1,3}(-[0-9]{1,2}){1,4}")


def grammar_child() -> psutil.Process:
    """This process's one grammar child, found as the OS lists it (its command line)."""
    (child,) = [p for p in psutil.Process().children()
                if "pagedserve.structured.remote" in p.cmdline()]
    return child


def child_argument(child: psutil.Process, flag: str) -> str:
    cmdline = child.cmdline()
    return cmdline[cmdline.index(flag) + 1]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bytes-tokenizer")
    tokenizer = byte_level_tokenizer()
    tokenizer.save_pretrained(folder)
    return tokenizer, str(folder)


def test_rows_match_the_in_process_manager_and_shutdown_cleans_up(tokenizer_dir):
    tokenizer, source = tokenizer_dir
    remote = GrammarProcess(tokenizer, source, VOCAB, [EOS], ROWS, num_threads=1)
    local = StructuredOutputManager(tokenizer, VOCAB, [EOS], ROWS, num_threads=0)
    requests = [Request("a", SPEC), Request("free", None), Request("b", SPEC, [ord("a") + 3])]
    for manager in (remote, local):
        for request in requests:
            add_ready(manager, request)
    ids = [r.request_id for r in requests]
    for step in range(4):
        remote.submit([r for r in requests if r.output_token_ids], ids)
        local.submit([r for r in requests if r.output_token_ids], ids)
        got, want = remote.take_bitmask(), local.take_bitmask()
        assert got.req_ids == want.req_ids == ids
        np.testing.assert_array_equal(got.bitmask, want.bitmask)
        for i, request in enumerate(requests):  # the lowest allowed token of each row
            row = want.bitmask[i]
            request.output_token_ids.append(
                next(t for t in range(VOCAB) if t != EOS and row[t // 32] >> (t % 32) & 1))
    # a speculative verify's rows (k + 1 for a row with k drafts), then its tokens at once
    drafts = {"a": [requests[0].output_token_ids[-1]]}  # ROWS: 3 rows and one draft
    got, want = remote.grammar_bitmask(ids, drafts), local.grammar_bitmask(ids, drafts)
    assert got.req_ids == want.req_ids == ["a", "a", "free", "b"]
    np.testing.assert_array_equal(got.bitmask, want.bitmask)
    for request in requests:
        request.output_token_ids += [request.output_token_ids[-1]] * 2
    remote.submit(requests[::2], ids, num_new=[2, 2])
    local.submit(requests[::2], ids, num_new=[2, 2])
    np.testing.assert_array_equal(remote.take_bitmask().bitmask, local.take_bitmask().bitmask)
    child = grammar_child()
    name = child_argument(child, "--shm")
    remote.shutdown()
    assert not child.is_running()
    with pytest.raises(FileNotFoundError):
        shared_memory.SharedMemory(name)


def test_compiles_are_reported_ready_or_failed(tokenizer_dir):
    """The child compiles in the background and says which requests are ready (then
    constrained) and which failed, with the compiler's error; a removed one is forgotten."""
    tokenizer, source = tokenizer_dir
    remote = GrammarProcess(tokenizer, source, VOCAB, [EOS], ROWS, num_threads=0)
    bad = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": 7}}})
    for request in (Request("good", SPEC), Request("bad", bad), Request("gone", SPEC)):
        remote.add_request(request)
    remote.remove_request("gone")
    assert not remote.is_constrained("good")  # not before the child says so
    ready, failed = [], []
    deadline = time.monotonic() + 60
    while remote.has_compiles() and time.monotonic() < deadline:
        more_ready, more_failed = remote.take_compiled()
        ready += more_ready
        failed += more_failed
        time.sleep(0.001)
    assert ready == ["good"] and remote.is_constrained("good")
    assert [request_id for request_id, _ in failed] == ["bad"]
    assert "invalid json" in failed[0][1]
    remote.submit([], ["good", "gone"])
    assert remote.take_bitmask().req_ids == ["good", "gone"]
    remote.shutdown()


def test_a_dead_child_is_an_error_not_a_hang(tokenizer_dir):
    tokenizer, source = tokenizer_dir
    remote = GrammarProcess(tokenizer, source, VOCAB, [EOS], ROWS, num_threads=0)
    add_ready(remote, Request("a", SPEC))
    grammar_child().kill()
    remote.submit([], ["a"])
    with pytest.raises(RuntimeError, match="grammar process exited"):
        remote.take_bitmask()
    remote.shutdown()


def test_the_child_ignores_a_ctrl_c_to_its_process_group(tokenizer_dir):
    """SIGINT and SIGTERM are the engine's to act on: the child still answers after them."""
    tokenizer, source = tokenizer_dir
    remote = GrammarProcess(tokenizer, source, VOCAB, [EOS], ROWS, num_threads=0)
    add_ready(remote, Request("a", SPEC))
    remote.submit([], ["a"])
    assert remote.take_bitmask() is not None  # the child is up
    for sig in (signal.SIGINT, signal.SIGTERM):
        os.kill(grammar_child().pid, sig)
    time.sleep(0.5)
    remote.submit([], ["a"])
    assert remote.take_bitmask() is not None
    remote.shutdown()


def test_the_child_leaves_when_its_parent_is_gone(tokenizer_dir, tmp_path):
    """Started with a parent pid that is not its parent's (as after the engine died and
    the child was re-parented), it exits by itself."""
    _, source = tokenizer_dir
    shm = shared_memory.SharedMemory(create=True, size=2 * ROWS * 9 * 4)
    try:
        child = subprocess.Popen([
            sys.executable, "-m", "pagedserve.structured.remote",
            "--address", f"ipc://{tmp_path / 'g'}", "--parent-pid", str(os.getpid() + 999999),
            "--shm", shm.name, "--tokenizer", source, "--vocab-size", str(VOCAB),
            "--rows", str(ROWS), "--threads", "0"])
        start = time.monotonic()
        assert child.wait(60) == 0
        assert time.monotonic() - start < 60
    finally:
        shm.close()
        shm.unlink()


@pytest.mark.parametrize("backend", [StructuredOutputManager, GrammarProcess])
def test_both_backends_offer_the_protocol(backend):
    """The engine core holds either class as a `GrammarBackend`: each has every member, a
    property where the protocol has one, and a method's parameters by the same names."""
    members = {name: value for name, value in vars(GrammarBackend).items()
               if not name.startswith("_")}
    assert {"submit", "take_bitmask", "take_compiled", "grammars"} <= members.keys()
    for name, expected in members.items():
        actual = getattr(backend, name, None)
        assert actual is not None, f"{backend.__name__} lacks {name}"
        if isinstance(expected, property):
            assert isinstance(actual, property), f"{backend.__name__}.{name} is no property"
        else:
            assert (list(inspect.signature(actual).parameters)
                    == list(inspect.signature(expected).parameters)), name
