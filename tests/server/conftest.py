"""A real `pagedserve serve` process on 127.0.0.1 and a free port, shared by the server tests.

One server for the whole package: loading the model dominates the run time on a 2-core CI
machine. The KV cache is kept small so that "no block is held" is cheap to reach and to read.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[2]
MODEL_NAME = "SmolLM2-135M-Instruct"
KV_CACHE_BYTES = 128 << 20
_STARTUP_TIMEOUT_S = 300


@dataclass
class Server:
    proc: subprocess.Popen
    url: str  # http://127.0.0.1:PORT
    kv_events_endpoint: str | None = None  # where it publishes KV-cache events, if it does
    headers: dict[str, str] | None = None  # for /health and /metrics (an API key)

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def metrics(self) -> dict[str, float]:
        """Scalar samples of /metrics keyed by name (labels folded in as name{k=v})."""
        text = httpx.get(self.url + "/metrics", headers=self.headers, timeout=30).text
        values = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                values[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return values

    def wait_idle(self, timeout: float = 60.0) -> dict[str, float]:
        """Metrics once nothing runs or waits (aborts are applied by the loop asynchronously)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = m["pagedserve_num_requests_running"] == 0 \
                and m["pagedserve_num_requests_waiting"] == 0
            if idle or time.monotonic() > deadline:
                return m
            time.sleep(0.2)


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children, theirs, ...), from /proc (Linux)."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = (task / "children").read_text().split()
        except OSError:  # the task or the process is gone
            continue
        for child in map(int, children):
            found += [child, *descendants(child)]
    return found


def is_alive(pid: int) -> bool:
    """A process that exists and is not a zombie (an exited process not yet reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def engine_core_pid(server: Server) -> int:
    """The server's engine-core process (its multiprocessing spawn child)."""
    for pid in descendants(server.proc.pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in cmdline:
            return pid
    raise AssertionError("the server has no engine-core process")


def wait_gone(pids: list[int], timeout: float = 60.0) -> list[int]:
    """The pids still alive after waiting up to `timeout` seconds for them to exit."""
    deadline = time.monotonic() + timeout
    while any(map(is_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return [pid for pid in pids if is_alive(pid)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(*extra_args: str, stderr=None, headers: dict[str, str] | None = None,
                 env: dict[str, str] | None = None, preamble: str = "") -> Server:
    """`headers` go with its /health and /metrics requests; `env` adds to its environment;
    `preamble`: Python statements the API process runs first (a fault to inject there; the
    engine-core process, spawned afresh, does not run them)."""
    port = free_port()
    # exactly what `pagedserve serve ...` runs, after the preamble
    cmd = [sys.executable, "-c", f"{preamble}\nfrom pagedserve.entrypoints.cli import main; "
           "raise SystemExit(main())", "serve", "--port", str(port),
           "--kv-cache-memory", str(KV_CACHE_BYTES), "--log-level", "warning", *extra_args]
    env = {**os.environ, **(env or {}), "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stderr=stderr)
    server = Server(proc, f"http://127.0.0.1:{port}", headers=headers)
    deadline = time.monotonic() + _STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} during startup")
        try:
            if httpx.get(server.url + "/health", headers=headers, timeout=5).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    stop_server(server)
    raise RuntimeError("server did not become healthy in time")


def stop_server(server: Server) -> int:
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(60)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait()
    return server.proc.returncode


@pytest.fixture(scope="package")
def server():
    # the shared server also publishes its KV-cache events (tests/server/test_metrics.py)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    srv = start_server("--kv-events-endpoint", endpoint)
    srv.kv_events_endpoint = endpoint
    yield srv
    stop_server(srv)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)
