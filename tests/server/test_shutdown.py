"""SIGTERM/SIGINT with a stream in flight: the client gets a clean end, the server and its
engine-core process exit."""

from __future__ import annotations

import json
import os
import signal
import threading

import httpx
import pytest

from tests.server.conftest import (descendants, engine_core_pid, start_server, stop_server,
                                   wait_gone)


# A drained SIGTERM is a clean stop (exit 0, issue 29: uvicorn re-raised it, 143); SIGINT ends
# as a handled Ctrl-C. A Ctrl-C in a terminal reaches the engine core too (the whole process
# group), as systemd's SIGTERM reaches every process of a service: the core leaves the stopping
# to the server, so the stream still ends cleanly.
@pytest.mark.parametrize("sig, returncode, to_core", [
    (signal.SIGTERM, 0, False), (signal.SIGINT, 0, True),
    (signal.SIGTERM, 0, True)], ids=["SIGTERM", "ctrl-c", "service-stop"])
def test_signal_aborts_in_flight_stream_cleanly(tmp_path, sig, returncode, to_core):
    log = (tmp_path / "server.log").open("w+")
    server = start_server("--graceful-timeout", "1", stderr=log)
    try:
        core = engine_core_pid(server)
        children = descendants(server.proc.pid)  # the core among them
        first_tokens = threading.Event()
        events: list[str] = []

        def consume() -> None:
            body = {"prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True,
                    "stream": True}
            with httpx.stream("POST", server.url + "/v1/completions", json=body,
                              timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[len("data: "):])
                        if len(events) == 2:
                            first_tokens.set()

        client = threading.Thread(target=consume)
        client.start()
        assert first_tokens.wait(120)
        server.proc.send_signal(sig)
        if to_core:
            os.kill(core, sig)
        client.join(120)
        assert not client.is_alive()
        server.proc.wait(60)
    finally:
        stop_server(server)

    assert server.proc.returncode == returncode
    assert wait_gone(children) == []
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["choices"][0]["finish_reason"] == "abort"
    assert len(events) < 2000
    log.seek(0)
    assert "Traceback" not in log.read()


def test_sigterm_lets_in_flight_requests_finish_then_exits_0():
    """A grace far longer than the request needs: after SIGTERM the stream in flight runs to
    its max_tokens (finish_reason "length", all its tokens counted), then the server exits
    0 and its core with it."""
    server = start_server("--graceful-timeout", "300")
    try:
        children = descendants(server.proc.pid)
        first_token = threading.Event()
        events: list[str] = []

        def consume() -> None:
            body = {"prompt": "Once upon a time", "max_tokens": 600, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}
            with httpx.stream("POST", server.url + "/v1/completions", json=body,
                              timeout=300) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[len("data: "):])
                        first_token.set()

        client = threading.Thread(target=consume)
        client.start()
        assert first_token.wait(120)
        server.proc.send_signal(signal.SIGTERM)
        at_signal = len(events)
        client.join(300)
        assert not client.is_alive()
        server.proc.wait(120)
    finally:
        stop_server(server)

    assert server.proc.returncode == 0
    assert wait_gone(children) == []
    assert events[-1] == "[DONE]"
    finishes = [c["finish_reason"] for e in events[:-1] for c in json.loads(e)["choices"]]
    assert [f for f in finishes if f is not None] == ["length"]
    assert json.loads(events[-2])["usage"]["completion_tokens"] == 600
    assert at_signal <= len(events) - 3  # its finish, usage and [DONE] came after the signal
