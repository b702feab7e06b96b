"""The two other ways to run a tensor-parallel engine, on the CPU with gloo: workers started
by torchrun (env:// rendezvous) connecting to an engine that waits for them, and the server
started with --tensor-parallel-size 2. Both must give TP=1's greedy tokens; a worker killed
under an idle server fails its engine core at once, and the server exits 1 naming the worker,
as it does when its engine dies (a killed worker during a step: test_tp_engine.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pagedserve.device.executor import WORKER_ENV
from pagedserve.entrypoints.llm import LLM
from pagedserve.sampling_params import SamplingParams
from tests.server.conftest import start_server, stop_server

REPO = Path(__file__).resolve().parents[2]
OPTIONS = dict(device="cpu", dtype="float32", kv_cache_memory=8 << 20, seed=0)
PROMPTS = ["The paged cache", "Two ranks, one model: "]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def greedy(llm: LLM) -> list[tuple[list[int], str]]:
    """Token ids and text (the byte tokenizer decodes only ids < 259 to text)."""
    return [(o.outputs[0].token_ids, o.outputs[0].text)
            for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def reference(llama) -> list[tuple[list[int], str]]:
    return greedy(LLM(llama, **OPTIONS))


def free_ports(count: int) -> list[int]:
    """Distinct free ports (each socket held open until all are chosen)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def test_torchrun_workers_serve_an_engine_that_waits_for_them(llama, reference):
    engine_port, master_port = free_ports(2)
    address = f"tcp://127.0.0.1:{engine_port}"
    # `python -m torch.distributed.run` is the `torchrun` command
    torchrun = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-addr", "127.0.0.1", "--master-port", str(master_port),
         "-m", "pagedserve.device.worker", "--engine", address],
        env={**os.environ, **WORKER_ENV, "PYTHONPATH": str(REPO)})
    try:
        llm = LLM(llama, tensor_parallel_size=2, tensor_parallel_address=address, **OPTIONS)
        assert greedy(llm) == reference
        llm.llm_engine.shutdown()
        assert torchrun.wait(timeout=60) == 0  # the workers were told to stop, and did
    finally:
        if torchrun.poll() is None:
            torchrun.kill()
            torchrun.wait()


def worker_pids(ancestor: int) -> list[int]:
    """The tensor-parallel workers under `ancestor` (the server's engine-core process starts
    them), from /proc."""
    parents, workers = {}, set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
        if b"pagedserve.device.worker" in cmdline:
            workers.add(int(entry.name))

    def descends(pid: int) -> bool:
        while pid > 1:
            pid = parents.get(pid, 0)
            if pid == ancestor:
                return True
        return False

    return sorted(pid for pid in workers if descends(pid))


def complete(url: str, prompt: str) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=120, json={
        "model": "tiny-llama3", "prompt": prompt, "max_tokens": GREEDY.max_tokens, "temperature": 0.0,
        "ignore_eos": True})


def test_server_with_two_ranks_answers_and_dies_with_a_dead_worker(llama, reference, tmp_path):
    with open(tmp_path / "stderr", "w") as stderr:
        server = start_server("--model", llama, "--tensor-parallel-size", "2", "--device",
                              "cpu", "--dtype", "float32", stderr=stderr)
    try:
        answers = [complete(server.url, p) for p in PROMPTS]
        assert [a.status_code for a in answers] == [200, 200]
        assert [a.json()["choices"][0]["text"] for a in answers] == [t for _, t in reference]
        workers = worker_pids(server.proc.pid)
        assert len(workers) == 2
        os.kill(workers[1], signal.SIGKILL)
        # idle, the engine core checks its workers: it fails and takes the server down
        assert server.proc.wait(timeout=60) == 1
        assert "worker rank 1" in (tmp_path / "stderr").read_text()
        deadline = time.monotonic() + 30  # the orphans' reaping by init may lag
        while any(Path(f"/proc/{pid}").exists() for pid in workers):
            assert time.monotonic() < deadline, "a worker outlived the server"
            time.sleep(0.2)
    finally:
        stop_server(server)
