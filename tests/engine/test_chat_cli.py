"""`pagedserve chat` and `generate` behave like good command-line tools: driven through a
pseudo-terminal (pexpect), as a person would use them."""

from __future__ import annotations

import io
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pexpect
import pytest

REPO = str(Path(__file__).resolve().parents[2])
ENV = {**os.environ, "PYTHONPATH": REPO, "TERM": "dumb"}
CLI = ["-m", "pagedserve.entrypoints.cli"]
LOAD_TIMEOUT_S = 300


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def spawn(*args: str, preexec_fn=_default_sigint) -> pexpect.spawn:
    """The CLI on a pseudo-terminal. Its SIGINT starts with the default action whatever
    pytest's is: a disposition of "ignore" survives exec, and pytest started in the
    background by a non-interactive shell (`make test &`) ignores SIGINT (issue 27)."""
    child = pexpect.spawn(sys.executable, [*CLI, *args], cwd=REPO, env=ENV, encoding="utf-8",
                          timeout=LOAD_TIMEOUT_S, dimensions=(40, 200), preexec_fn=preexec_fn)
    child.logfile_read = io.StringIO()  # the whole transcript, to look for tracebacks
    return child


def test_chat_session_survives_ctrl_c_and_ends_cleanly_on_ctrl_d():
    chat = spawn("chat", "--kv-cache-memory", "64M", "--max-tokens", "1000")
    try:
        chat.expect_exact("/help lists the commands")
        chat.expect_exact("> ")
        chat.sendline("/help")  # commands are handled, never sent to the model
        chat.expect_exact("/reset")
        chat.expect_exact("/exit")
        chat.expect_exact("> ")
        chat.sendline("/nope")
        chat.expect_exact("unknown command /nope")
        chat.expect_exact("> ")
        chat.send("half a line")  # Ctrl-C at the prompt drops the line, asks again
        chat.sendintr()
        chat.expect_exact("> ")
        chat.sendline("Count from 1 to 400, one number per line.")
        chat.expect_exact("one number per line.\r\n")  # the terminal's echo of the line
        chat.expect(r"\d")  # the answer is streaming
        chat.sendintr()
        chat.expect_exact("[cancelled]")
        chat.expect(r"\[(\d+) prompt tokens")
        cancelled_turn = int(chat.match.group(1))
        chat.expect_exact("> ")
        chat.sendline("Hi!")  # the session goes on, without the cancelled turn
        chat.expect(r"\[(\d+) prompt tokens")
        assert int(chat.match.group(1)) < cancelled_turn
        chat.expect_exact("> ")
        chat.sendeof()
        chat.expect(pexpect.EOF)
        assert chat.before == "\r\n"  # the shell's prompt starts on a new line
        chat.close()
        assert chat.exitstatus == 0
        assert "Traceback" not in chat.logfile_read.getvalue()
    finally:
        chat.close(force=True)


def _turn(chat: pexpect.spawn, line: str) -> int:
    """Send a message; the prompt tokens of its turn once the answer is done."""
    chat.sendline(line)
    chat.expect(r"\[(\d+) prompt tokens")
    tokens = int(chat.match.group(1))
    chat.expect_exact("> ")
    return tokens


def test_ctrl_c_burst_at_the_prompt_keeps_the_session_even_if_sigint_was_ignored():
    """Bursts of Ctrl-C (300 SIGINTs within a few milliseconds) at the prompt only clear the
    line; the conversation goes on. The chat is started with SIGINT ignored, as a
    background job's children are: the REPL installs its own handler, since it relies on
    Ctrl-C (ignored, the ^C would leave the line as it is and no new prompt would come)."""
    chat = spawn("chat", "--kv-cache-memory", "64M", "--max-tokens", "1000",
                 preexec_fn=_ignore_sigint)
    try:
        chat.expect_exact("> ")
        first = _turn(chat, "Say hi.")
        for burst in range(10):
            chat.send("half a line")
            for k in range(300):  # gaps from 0 to ~150 µs: some land mid-handling
                os.kill(chat.pid, signal.SIGINT)
                start = time.perf_counter()
                while time.perf_counter() - start < 3e-6 * (k % 50):
                    pass
            chat.expect_exact("> ", timeout=60)
        assert chat.isalive()
        second = _turn(chat, "Say hi again.")
        assert second > first + 4  # the first turn (question and answer) is still there
        chat.sendeof()
        chat.expect(pexpect.EOF)
        chat.close()
        assert chat.exitstatus == 0
        assert "Traceback" not in chat.logfile_read.getvalue()
    finally:
        chat.close(force=True)


def _ignores_sigint(pid: int) -> bool:
    """From the kernel's view of the process: its SigIgn mask has SIGINT's bit."""
    status = Path(f"/proc/{pid}/status").read_text()
    mask = int(next(line for line in status.splitlines() if line.startswith("SigIgn:"))
               .split()[1], 16)
    return bool(mask & (1 << (signal.SIGINT - 1)))


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc")
def test_spawned_cli_gets_default_sigint_even_when_pytest_ignores_it():
    """Issue 27: pytest run as a background job ignores SIGINT, which its children inherit;
    `spawn` gives them the default action, which Ctrl-C in these tests needs."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        helped, inherited = spawn("chat"), spawn("chat", preexec_fn=None)
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        assert not _ignores_sigint(helped.pid)
        assert _ignores_sigint(inherited.pid)  # what a child gets without the helper
    finally:
        helped.close(force=True)
        inherited.close(force=True)


def _loading(pid: int, timeout: float = LOAD_TIMEOUT_S) -> None:
    """Wait until the process has loaded torch: Python's own SIGINT handler is in place by
    then, and the model load that follows takes seconds."""
    deadline = time.monotonic() + timeout
    while "libtorch" not in Path(f"/proc/{pid}/maps").read_text():
        assert time.monotonic() < deadline, "torch was never loaded"
        time.sleep(0.05)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc")
def test_ctrl_c_while_loading_exits_130_with_one_line():
    chat = spawn("chat")
    try:
        _loading(chat.pid)
        chat.sendintr()
        chat.expect(pexpect.EOF, timeout=60)
        output = chat.before
        chat.close()
        assert chat.exitstatus == 130, output
        assert "Traceback" not in output and "pagedserve: interrupted" in output
    finally:
        chat.close(force=True)


def test_first_run_says_what_it_is_doing_and_marks_a_cut_answer():
    """With nothing cached (PAGEDSERVE_CACHE=0) the slow first-run work is announced; an
    answer cut at --max-tokens says so."""
    generate = pexpect.spawn(
        sys.executable, [*CLI, "generate", "Count from 1 to 100.", "--max-tokens", "3",
                         "--kv-cache-memory", "64M"],
        cwd=REPO, env={**ENV, "PAGEDSERVE_CACHE": "0"}, encoding="utf-8",
        timeout=LOAD_TIMEOUT_S)
    generate.logfile_read = io.StringIO()
    try:
        generate.expect_exact("pagedserve: converting")
        generate.expect_exact("pagedserve: building the tokenizer from")
        generate.expect_exact("[cut at --max-tokens 3]")
        generate.expect(pexpect.EOF)
        generate.close()
        assert generate.exitstatus == 0
        if _builds_native_kernels():
            assert "pagedserve: compiling the native CPU kernels" in \
                generate.logfile_read.getvalue()
    finally:
        generate.close(force=True)


def _builds_native_kernels() -> bool:
    cpu = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return shutil.which(os.environ.get("CC", "cc")) is not None and " avx2 " in cpu \
        and os.environ.get("PAGEDSERVE_NATIVE") != "0"
