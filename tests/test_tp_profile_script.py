"""benchmarks/tensor_parallel.py's profile summary without a GPU: a Chrome trace shaped as
torch.profiler writes one for CUDA graph replays (kernels under the correlation id of their
`cudaGraphLaunch`) and eager kernels after them, and a CPU trace of nested ops."""

from __future__ import annotations

import gzip
import json

import pytest

from benchmarks.tensor_parallel import summarize_trace


def kernel(name: str, start: float, end: float, correlation: int, cat: str = "kernel") -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": start, "dur": end - start,
            "pid": 0, "tid": 7, "args": {"correlation": correlation}}


def step(t: float, graph: int) -> list[dict]:
    """A replay of A, B, A, then the eager LM head and a copy, from t (µs)."""
    return [
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": t - 90, "dur": 5,
         "pid": 1, "tid": 1, "args": {"correlation": graph}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": t - 80, "dur": 3,
         "pid": 1, "tid": 1, "args": {"correlation": graph + 1}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": t - 81, "dur": 6, "pid": 1,
         "tid": 1, "args": {}},
        kernel("A", t, t + 10, graph), kernel("B", t + 12, t + 22, graph),
        kernel("A", t + 25, t + 35, graph),
        kernel("lm_head", t + 40, t + 64, graph + 1),
        kernel("Memcpy DtoH", t + 65, t + 67, graph + 2, cat="gpu_memcpy"),
        {"ph": "X", "cat": "gpu_user_annotation", "name": "step", "ts": t, "dur": 67,
         "pid": 0, "tid": 8, "args": {}},
    ]


def write(path, events: list[dict]) -> None:
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)


def test_graph_and_eager_kernels_per_step(tmp_path):
    path = tmp_path / "trace.json.gz"
    write(path, step(100, 10) + step(200, 20))
    s = summarize_trace(path, steps=2)
    # per step: 30 µs in the replay's kernels, 26 eager; the timeline runs 100-267 µs
    assert s["kernel_ms"] == pytest.approx(0.056) and s["busy_ms"] == pytest.approx(0.056)
    assert s["kernels"] == 5 and s["eager_kernels"] == 2 and s["graph_launches"] == 1
    assert s["span_ms"] == pytest.approx(0.0835) and s["gap_ms"] == pytest.approx(0.0275)
    assert s["in_graph_ms"] == pytest.approx(0.035)  # each replay: 35 µs first to last
    assert s["outside_graph_ms"] == pytest.approx(0.0485)
    assert s["eager_kernel_ms"] == pytest.approx(0.026)
    top = [(k["name"], k["where"], k["per_step"], k["mean_us"]) for k in s["top"]]
    assert top == [("lm_head", "eager", 1, 24), ("A", "graph", 2, 10), ("B", "graph", 1, 10),
                   ("Memcpy DtoH", "eager", 1, 2)]
    first = s["top_gaps"][0]  # between the steps: the copy's end to the next replay
    assert (first["from"], first["to"]) == ("Memcpy DtoH (eager)", "A (graph)")
    assert first["mean_us"] == 33 and first["per_step"] == 0.5
    assert {(g["from"], g["to"]): g["mean_us"] for g in s["top_gaps"]}[
        ("A (graph)", "lm_head (eager)")] == 5


def test_cpu_trace_counts_outermost_ops(tmp_path):
    path = tmp_path / "trace.json.gz"
    op = {"ph": "X", "cat": "cpu_op", "pid": 1, "tid": 1, "args": {}}
    write(path, [dict(op, name="aten::linear", ts=0, dur=100),
                 dict(op, name="aten::mm", ts=10, dur=20),  # inside aten::linear
                 dict(op, name="aten::argmax", ts=150, dur=10)])
    s = summarize_trace(path, steps=1)
    assert s["kernels"] == 2 and s["busy_ms"] == pytest.approx(0.11)
    assert s["gap_ms"] == pytest.approx(0.05) and s["graph_launches"] == 0
    assert [k["name"] for k in s["top"]] == ["aten::linear", "aten::argmax"]


def test_host_time_per_launch_interval_on_the_launching_thread(tmp_path):
    """Two intervals of 1000 µs on thread 1: its ops (a sync, a collective with an op
    nested inside, the launches), the time between them, and the longest stretch between
    them per interval; thread 2's ops (a watchdog's polls) do not count."""
    def op(name, ts, dur, cat="cpu_op", tid=1):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1,
                "tid": tid, "args": {}}

    events = []
    for t in (0, 1000, 2000):
        events.append(op("cudaGraphLaunch", t, 50, "cuda_runtime"))
    events += [op("c10d::allgather_", 100, 100), op("record_param_comms", 110, 80),
               op("cudaEventSynchronize", 300, 200, "cuda_runtime"),  # 250 µs untraced after
               op("aten::copy_", 1200, 100),  # 150 before, 700 after
               op("cudaEventQuery", 600, 300, "cuda_runtime", tid=2)]
    path = tmp_path / "trace.json.gz"
    write(path, events)
    s = summarize_trace(path, steps=2)
    assert s["host_interval_ms"] == pytest.approx(1.0)
    assert s["host_ops_ms"] == pytest.approx((50 + 100 + 200 + 50 + 100) / 2e3)
    assert s["host_sync_ms"] == pytest.approx(0.1) and s["host_comm_ms"] == pytest.approx(0.05)
    assert s["host_untraced_ms"] == pytest.approx((50 + 100 + 500 + 150 + 700) / 2e3)
    assert s["host_untraced_max_ms"] == pytest.approx((500 + 700) / 2e3)


def test_queue_leads_tell_a_queued_step_from_one_issued_on_an_idle_gpu(tmp_path):
    """The same GPU timeline, two host timelines: the step's upload and replay issued 3 ms
    before the GPU reached them (queued behind the step before: async scheduling as meant),
    or 5 and 30 µs before (the host prepared the step once the previous tokens were back).
    Only the leads tell them apart; the GPU's gaps are the same."""
    def trace(lead_upload: float, lead_graph: float) -> dict:
        events = []
        for i, t in enumerate((10_000, 14_000)):
            upload, graph = 100 * i + 1, 100 * i + 2
            lead_graph -= 10 * i  # the second replay's lead 10 µs shorter
            events += [
                {"ph": "X", "cat": "cuda_runtime", "name": "cudaMemcpyAsync",
                 "ts": t - lead_upload, "dur": 4, "pid": 1, "tid": 1,
                 "args": {"correlation": upload}},
                {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch",
                 "ts": t + 40 - lead_graph, "dur": 10, "pid": 1, "tid": 1,
                 "args": {"correlation": graph}},
                kernel("Memcpy HtoD (Pinned -> Device)", t, t + 1, upload, cat="gpu_memcpy"),
                kernel("A", t + 40, t + 3000, graph), kernel("B", t + 3001, t + 3900, graph),
            ]
        path = tmp_path / f"trace-{lead_upload}.json.gz"
        write(path, events)
        return summarize_trace(path, steps=2)

    queued, serial = trace(3000, 3040), trace(5, 30)
    assert queued["graph_lead_ms"] == pytest.approx(3.035)
    assert queued["graph_lead_min_ms"] == pytest.approx(3.03)
    assert queued["upload_lead_ms"] == pytest.approx(3.0)
    assert serial["graph_lead_ms"] == pytest.approx(0.025)
    assert serial["graph_lead_min_ms"] == pytest.approx(0.02)
    assert serial["upload_lead_ms"] == pytest.approx(0.005)
    assert queued["top_gaps"] == serial["top_gaps"]
