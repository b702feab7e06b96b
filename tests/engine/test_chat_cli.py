"""`pagedserve chat` and `generate` behave like good command-line tools: driven through a
pseudo-terminal (pexpect), as a person would use them."""

from __future__ import annotations

import io
import os
import shutil
import time
import sys
from pathlib import Path

import pexpect
import pytest

REPO = str(Path(__file__).resolve().parents[2])
ENV = {**os.environ, "PYTHONPATH": REPO, "TERM": "dumb"}
CLI = ["-m", "pagedserve.entrypoints.cli"]
LOAD_TIMEOUT_S = 300


def spawn(*args: str) -> pexpect.spawn:
    child = pexpect.spawn(sys.executable, [*CLI, *args], cwd=REPO, env=ENV, encoding="utf-8",
                          timeout=LOAD_TIMEOUT_S, dimensions=(40, 200))
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
