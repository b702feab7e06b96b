"""SIGTERM/SIGINT with a stream in flight: the client gets a clean end, the process exits."""

from __future__ import annotations

import json
import signal
import threading

import httpx
import pytest

from tests.server.conftest import start_server, stop_server


# uvicorn re-raises SIGTERM after its graceful shutdown; SIGINT ends as a handled Ctrl-C
@pytest.mark.parametrize("sig, returncode", [(signal.SIGTERM, -signal.SIGTERM),
                                             (signal.SIGINT, 0)], ids=["SIGTERM", "SIGINT"])
def test_signal_aborts_in_flight_stream_cleanly(tmp_path, sig, returncode):
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
        server.proc.send_signal(sig)
        client.join(120)
        assert not client.is_alive()
        server.proc.wait(60)
    finally:
        stop_server(server)

    assert server.proc.returncode == returncode
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["choices"][0]["finish_reason"] == "abort"
    assert len(events) < 2000
    log.seek(0)
    assert "Traceback" not in log.read()
