"""The `pagedserve chat` REPL and the streaming of one answer, cancellable with Ctrl-C.

Ctrl-C while an answer streams must not interrupt the engine in the middle of a step (a
half-updated scheduler or block table would poison every later turn), so during generation
SIGINT only sets a flag; between steps the request is aborted, which frees its blocks, and
the conversation goes on without that turn. At the prompt Ctrl-C clears the line, as shells
do; Ctrl-D or /exit ends the session.

The REPL installs its own SIGINT handling rather than relying on Python's: a process started
with SIGINT ignored (the children of a background job in a non-interactive shell) would
otherwise never see Ctrl-C; and at the prompt no handler raises, so that a burst of Ctrl-C
cannot end the session (`LineReader`).
"""

from __future__ import annotations

import os
import select
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

COMMANDS = {
    "/help": "show this help",
    "/reset": "forget the conversation (the system message stays)",
    "/exit": "end the session (so does Ctrl-D)",
}
HELP = "\n".join([*(f"  {name:<8} {text}" for name, text in COMMANDS.items()),
                  "  Ctrl-C   stop the answer being written (at the prompt: clear the line)",
                  "  A line starting with // is sent as text, without its first slash."])


@dataclass
class Answer:
    text: str
    finish_reason: str | None  # "stop", "length", or "abort" when cancelled


@contextmanager
def sigint_as_flag() -> Iterator[threading.Event]:
    """While inside, SIGINT sets the returned event instead of raising KeyboardInterrupt."""
    pressed = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield pressed  # signal handlers belong to the main thread; nothing to redirect
        return
    previous = signal.signal(signal.SIGINT, lambda *_: pressed.set())
    try:
        yield pressed
    finally:
        signal.signal(signal.SIGINT, previous)


def stream_answer(engine, request_id: str, prompt_ids: list[int], params,
                  write: Callable[[str], None], cancel: threading.Event) -> Answer:
    """Run one request to its end, writing its text as it comes; `cancel` (set by Ctrl-C
    under `sigint_as_flag`) aborts it between two steps."""
    engine.add_request(request_id, None, params, prompt_token_ids=prompt_ids)
    answer = Answer("", None)
    while engine.has_unfinished_requests():
        if cancel.is_set():
            engine.abort_request(request_id)
            cancel.clear()
        for output in engine.step():
            if output.request_id == request_id:
                write(output.outputs[0].text_delta)
                answer = Answer(output.outputs[0].text, output.outputs[0].finish_reason)
    return answer


def end_marker(answer: Answer, max_tokens: int) -> str | None:
    """What to show after an answer that did not end by itself."""
    if answer.finish_reason == "length":
        return f"[cut at --max-tokens {max_tokens}]"
    if answer.finish_reason == "abort":
        return "[cancelled]"
    return None


def _do_nothing(signum: int, frame: object) -> None:
    """SIGINT at the prompt: the wakeup fd reports it (see `LineReader`)."""


class LineReader:
    """Lines typed at the prompt; Ctrl-C abandons the line being typed and asks again.

    `input()` can only be left on Ctrl-C by an exception raised in the SIGINT handler, and a
    burst of Ctrl-C breaks that: a second SIGINT lands while the first KeyboardInterrupt is
    being handled and escapes the loop (or, inside `input()`, CPython calls the handler again
    with the first exception still set and fails with SystemError). Here no handler raises:
    SIGINT wakes a `select()` through the signal module's wakeup fd, however many arrive. The
    terminal itself drops the partial line on Ctrl-C (canonical mode), as it edits the line.
    """

    def __init__(self, fd: int = 0) -> None:
        self._fd = fd
        self._pending = b""  # read past the last line returned
        self._eof = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    @contextmanager
    def installed(self) -> Iterator[LineReader]:
        """SIGINT handled by this reader while inside (installed explicitly: a process
        started with SIGINT ignored, as a background job's children are, still gets it)."""
        main = threading.current_thread() is threading.main_thread()
        if main:  # signal handlers and the wakeup fd belong to the main thread
            previous_handler = signal.signal(signal.SIGINT, _do_nothing)
            previous_fd = signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        try:
            yield self
        finally:
            if main:
                signal.set_wakeup_fd(previous_fd)
                signal.signal(signal.SIGINT, previous_handler)
            os.close(self._wake_r)
            os.close(self._wake_w)

    def read_line(self, prompt: str) -> str | None:
        """A line without its newline; None at end of input. Ctrl-C pressed before the
        prompt (at the end of an answer) is not held against the new line."""
        self._interrupted()
        _show(prompt)
        while b"\n" not in self._pending and not self._eof:
            ready, _, _ = select.select([self._fd, self._wake_r], [], [])
            if self._wake_r in ready and self._interrupted():
                self._pending = b""
                _show("\n" + prompt)
            elif self._fd in ready:
                data = os.read(self._fd, 65536)
                self._pending += data
                self._eof = not data
        if not self._pending:
            _show("\n")  # the shell's prompt starts on a line of its own
            return None
        line, _, self._pending = self._pending.partition(b"\n")
        return line.decode("utf-8", errors="replace")

    def _interrupted(self) -> bool:
        """Whether a SIGINT came since the last look (reading the wakeup fd empty)."""
        seen = b""
        while True:
            try:
                chunk = os.read(self._wake_r, 512)
            except BlockingIOError:
                return signal.SIGINT in seen
            if not chunk:
                return signal.SIGINT in seen
            seen += chunk


def _show(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def run_chat(engine, params, system: str | None, write: Callable[[str], None],
             encode: Callable[[list[dict]], list[int]]) -> int:
    """The REPL; `encode` renders the conversation to prompt ids (the chat template)."""
    with LineReader().installed() as reader:
        return _repl(engine, params, system, write, encode, reader)


def _repl(engine, params, system: str | None, write: Callable[[str], None],
          encode: Callable[[list[dict]], list[int]], reader: LineReader) -> int:
    base = [{"role": "system", "content": system}] if system else []
    messages = list(base)
    print("pagedserve chat: type a message; /help lists the commands, Ctrl-D quits.",
          file=sys.stderr)
    turn = 0
    while (line := reader.read_line("> ")) is not None:
        text = line.strip()
        if text.startswith("/") and not text.startswith("//"):
            command = text.split()[0]
            if command == "/exit":
                break
            if command == "/reset":
                messages = list(base)
                print("[conversation cleared]", file=sys.stderr)
            elif command == "/help":
                print(HELP, file=sys.stderr)
            else:
                print(f"unknown command {command}; /help lists the commands", file=sys.stderr)
            continue
        if not text:
            continue
        messages.append({"role": "user", "content": line.removeprefix("/")})
        with sigint_as_flag() as cancel:  # from Enter on, Ctrl-C cancels this turn only
            prompt_ids = encode(messages)
            hits_before = engine.get_stats().prefix_cache_hits
            answer = stream_answer(engine, f"chat-{turn}", prompt_ids, params, write, cancel)
        turn += 1
        write("\n")
        marker = end_marker(answer, params.max_tokens)
        if answer.finish_reason == "abort":
            messages.pop()  # the turn is dropped: the next one continues from before it
        else:
            messages.append({"role": "assistant", "content": answer.text})
        reused = engine.get_stats().prefix_cache_hits - hits_before
        print(" ".join(filter(None, [marker, f"[{len(prompt_ids)} prompt tokens, {reused} from "
                                     "the prefix cache]"])), file=sys.stderr)
    return 0
