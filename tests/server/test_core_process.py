"""The engine core in its own process: if it dies mid-request the clients get an error (not a
hang), /health stops answering 200 and the server exits non-zero; if the server dies, the core
goes with it. No process is left either way."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from tests.server.conftest import (Server, descendants, engine_core_pid, start_server,
                                   stop_server, wait_gone)

_WAIT_S = 120


def _health_status(url: str) -> int | None:
    """/health's status code, None once the server no longer accepts connections."""
    try:
        return httpx.get(url + "/health", timeout=_WAIT_S).status_code
    except httpx.TransportError:
        return None


def test_core_killed_mid_stream_fails_requests_and_stops_server(tmp_path):
    log = (tmp_path / "server.log").open("w+")
    server = start_server(stderr=log)
    try:
        core = engine_core_pid(server)
        children = descendants(server.proc.pid)
        streaming, events = threading.Event(), []
        non_streaming: list[httpx.Response] = []
        body = {"prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True}

        def stream() -> None:
            with httpx.stream("POST", server.url + "/v1/completions",
                              json={**body, "stream": True}, timeout=_WAIT_S) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[len("data: "):])
                        if len(events) == 2:
                            streaming.set()

        def complete() -> None:
            non_streaming.append(httpx.post(server.url + "/v1/completions", json=body,
                                            timeout=_WAIT_S))

        clients = [threading.Thread(target=stream), threading.Thread(target=complete)]
        for client in clients:
            client.start()
        assert streaming.wait(_WAIT_S)
        _wait_running(server, 2)  # both requests are in the engine when it dies
        os.kill(core, signal.SIGKILL)
        for client in clients:
            client.join(_WAIT_S)
            assert not client.is_alive()
        assert _health_status(server.url) != 200
        server.proc.wait(_WAIT_S)
    finally:
        stop_server(server)

    assert server.proc.returncode == 1
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "engine core" in error["message"]
    assert len(events) < 2000
    response, = non_streaming
    assert response.status_code == 503
    assert "engine core" in response.json()["error"]["message"]
    assert wait_gone(children) == []
    log.seek(0)
    assert "engine core process exited unexpectedly" in log.read()


def _wait_running(server: Server, count: int) -> None:
    deadline = time.monotonic() + _WAIT_S
    while server.metrics()["pagedserve_num_requests_running"] < count:
        assert time.monotonic() < deadline, f"{count} requests never ran at once"
        time.sleep(0.2)


def test_server_killed_takes_its_core_along():
    server = start_server()
    try:
        engine_core_pid(server)  # there is one
        children = descendants(server.proc.pid)
        server.proc.kill()
        server.proc.wait(_WAIT_S)
    finally:
        stop_server(server)
    assert wait_gone(children) == []


def test_core_start_up_failure_is_reported(tmp_path):
    """The core's own error message, as the CLI prints any bad option, and exit code 1."""
    missing = tmp_path / "missing.gguf"
    log = (tmp_path / "server.log").open("w+")
    with pytest.raises(RuntimeError, match="exited with 1 during startup"):
        start_server("--model", str(missing), stderr=log)
    log.seek(0)
    assert f"pagedserve: error: model path {missing} does not exist" in log.read()
