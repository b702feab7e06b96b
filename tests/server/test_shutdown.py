"""SIGTERM with a stream in flight: the client gets a clean end, the process exits."""

from __future__ import annotations

import json
import signal
import threading

import httpx

from tests.server.conftest import start_server, stop_server


def test_sigterm_aborts_in_flight_stream_cleanly(tmp_path):
    log = (tmp_path / "server.log").open("w+")
    server = start_server("--graceful-timeout", "1", stderr=log)
    try:
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
        server.proc.send_signal(signal.SIGTERM)
        client.join(120)
        assert not client.is_alive()
        server.proc.wait(60)
    finally:
        returncode = stop_server(server)

    # uvicorn re-raises the signal after its graceful shutdown
    assert returncode == -signal.SIGTERM
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["choices"][0]["finish_reason"] == "abort"
    assert len(events) < 2000
    log.seek(0)
    assert "Traceback" not in log.read()
