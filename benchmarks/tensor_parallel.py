"""Tensor parallelism on two or four GPUs (the lent nvidia-h100-x2 / -x4): the link, the
all-reduce (NCCL against the peer-memory one of pagedserve/model/allreduce.py), and TP sizes
against TP=1 on Llama-3-8B's shape, Qwen3-30B-A3B's (MoE) and Llama-3-70B's.

    PYTHONPATH=. python benchmarks/tensor_parallel.py --out DIR [--ranks N] [--only PARTS]

`--ranks N` (2 by default; 4 on a four-GPU machine): the all-reduce's ranks and the largest TP
size; the engines run TP=1, 2 (and 4 when N is 4), and TP=N once more with NCCL alone
(--peer-all-reduce-max-bytes 0) for the tpot part; `--unfused` adds, for the tpot part, every
TP size above 1 once more with the all-reduce and the RMSNorm after it as two kernels
(--no-fuse-all-reduce-norm), so fused and unfused steps are timed in one run;
`--two-shot-unfused` adds, for the tpot and workload parts, every TP size above 1 once more
with only two-shot's messages unfused (--no-fuse-two-shot-all-reduce-norm); `--push` adds,
for the tpot part, every TP size above 1 once more with the one-shot fused kernel pushing
each rank's partial product into its peers' memory (--all-reduce-push), and to the
allreduce part's fused rows fused_rms_norm_push (the same kernel, per call); `--cublas`
adds, for the tpot part, every TP size once more with the float linears on cuBLAS at every
batch size (--no-dense-gemv), against the default decode GEMV. Parts (all by
default, in this order):
  topo       `nvidia-smi topo -m`: how the GPUs are linked
  allreduce  bf16 all-reduce at 8 KiB-256 MiB over N ranks, each size by NCCL, one-shot and
             two-shot (peer memory), every call captured in a CUDA graph (as decode steps
             run them): time and bus bandwidth; the fastest per size shows where the
             thresholds belong. Up to 2 MiB also the all-reduce followed by the residual
             add + RMSNorm of [bytes / 8 KiB, 4096] rows (a decode step's chain): the
             engine's unfused chain (one-shot up to its limit, two-shot above, then the norm
             kernel) against the fused kernel (which the engine takes up to one-shot's limit:
             the rows above it say whether that limit should move); where the fused kernel
             splits each row over several programs (few rows), also fused_rms_norm_unsplit,
             one program per row. From 512 KiB to 8 MiB also two-shot's chain
             (two_shot+rms_norm) against the fused two-shot kernel (fused_two_shot_rms_norm,
             which the engine takes above one-shot's limit), to place that limit with the
             fused kernels on both sides. Also whether an NCCL all-reduce captured in a
             graph replays right between eager collectives (if not, the TP engines run
             --enforce-eager)
  logits     Llama-3-8B shape, TP=1 and TP=N on the same random weights: the first generated
             token's top-20 logprobs of 16 prompts (largest difference), greedy agreement
  tpot       Llama-3-8B batch-1 decode TPOT at every TP size (targets: TP=2 <= 0.60x TP=1,
             TP=4 <= 0.40x), and TP=N through NCCL alone
  workload   Llama-3-8B workload A (benchmarks/throughput.py's: 256 requests, prompt and
             output lengths uniform in [100, 1024]) at every TP size (TP=2 >= 1.7x TP=1)
  moe        Qwen3-30B-A3B's shape (MoE, experts sharded) workload A at every TP size
  big        Llama-3-70B's shape (141 GB in bf16: two H200s or four H100s) at TP=N:
             start-up time, batch-1 TPOT, workload A
  profile    (not in the default) Llama-3-8B decode steps at batch 1 and 64 at every TP
             size under torch.profiler on rank 0 (Executor.start_profile): per step the
             kernel time and count, the top kernels (in the CUDA graph or eager after it),
             the GPU's idle time, the gaps between kernels and the time outside the graph,
             the launching thread's host time and how far ahead of the GPU it queued the
             uploads and replays (graph_lead_ms: milliseconds when async scheduling
             pipelines); the Chrome traces go to DIR/profile_tp{N}_b{B}.json.gz

logits, tpot, workload and profile share one engine per TP size. Weights are random (load_format
dummy: no checkpoint to write; the same weights at every TP size, see pagedserve/model/
dummy.py); a folder holds only config.json and a byte-level tokenizer. The engines of a part
are built one after another in one process, the engine core in that process, each shut down
before the next starts (issue 27). That process runs apart from this script's, in a session of
its own, so a hung NCCL rank cannot outlive a timeout. A part that fails is recorded as an
`error` row and the run goes on.

Each part fits one device call of under 10 minutes (cold caches); see docs/benchmarks.md for
the commands and their durations. Appends to DIR/tensor_parallel.json: rows of tp, shape,
metric, value, device, date (and the part's details). `--tiny` runs the same logic on the CPU
(gloo, tiny models, a scaled-down workload): a check of the script, not a measurement.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
# this folder holds kernels.py, which would shadow the `kernels` package transformers probes for
sys.path = [p for p in sys.path if Path(p or ".").resolve() != HERE]

PARTS = ("topo", "allreduce", "logits", "tpot", "workload", "moe", "big", "profile")
DEFAULT_PARTS = PARTS[:-1]
ENGINE_PARTS = ("logits", "tpot", "workload", "profile")
CHILD_TIMEOUT_S = 540
BANDWIDTH_TIMEOUT_S = 180  # NCCL and symmetric-memory start-up, then every size and kind
GRAPH_CHECK_TIMEOUT_S = 60  # a captured all-reduce that hangs on replay must not eat the run
ALLREDUCE_TIMEOUT_S = BANDWIDTH_TIMEOUT_S + GRAPH_CHECK_TIMEOUT_S + 60
TOP_LOGPROBS = 20


class Scale:
    """What the run measures: the real thing on GPUs, or a seconds-long check on the CPU."""

    def __init__(self, tiny: bool, ranks: int = 2) -> None:
        self.tiny = tiny
        self.ranks = ranks
        self.tps = [1, 2] + ([4] if ranks >= 4 else [])
        self.device = "cpu" if tiny else "cuda"
        self.shape = "tiny-llama3" if tiny else "llama3-8b"
        self.moe_shape = "tiny-qwen3-moe" if tiny else "qwen3-30b-a3b"
        self.big_shape = "tiny-llama3" if tiny else "llama3-70b"
        self.requests = 8 if tiny else 256
        self.lengths = (10, 40) if tiny else (100, 1024)
        self.tpot_tokens = 16 if tiny else 128
        self.logit_prompts = 4 if tiny else 16
        self.profile_steps = 3 if tiny else 20
        self.profile_batches = (1, 4) if tiny else (1, 64)
        self.allreduce_bytes = ([8 << 10, 1 << 20] if tiny else
                                [8 << 10, 32 << 10, 128 << 10, 512 << 10, 1 << 20, 2 << 20,
                                 4 << 20, 8 << 20, 32 << 20, 256 << 20])
        # TP>1 without CUDA graphs: set when the all-reduce part finds a captured all-reduce
        # that does not replay right (the engines would then hang or compute garbage)
        self.eager_tp = False
        self.child_timeout = CHILD_TIMEOUT_S  # an engine part's child process, in seconds
        self.push = False  # the allreduce part also times the pushing fused kernel

    def engine_options(self, tp: int, peer: bool = True, fuse: bool = True,
                       gemv: bool = True, fuse_two_shot: bool = True,
                       push: bool = False) -> dict:
        fusion = dict(fuse_all_reduce_norm=fuse, fuse_two_shot_all_reduce_norm=fuse_two_shot,
                      all_reduce_push=push)
        if self.tiny:
            return dict(device="cpu", dtype="float32", kv_cache_memory=64 << 20,
                        max_model_len=256, dense_gemv=gemv, **fusion)
        return dict(max_model_len=4096, enforce_eager=self.eager_tp and tp > 1,
                    dense_gemv=gemv, **fusion,
                    **({} if peer else {"peer_all_reduce_max_bytes": 0}))


# ------------------------------------------------------------------------------ workloads
def workload_a(scale: Scale, seed: int = 0, vocab: int = 10_000):
    """throughput.py's workload A (prompts and output lengths uniform in [lo, hi])."""
    rng = random.Random(seed)
    lo, hi = scale.lengths
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))]
               for _ in range(scale.requests)]
    return prompts, [rng.randint(lo, hi) for _ in range(scale.requests)]


def logit_prompts(scale: Scale) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(10_000) for _ in range(64)] for _ in range(scale.logit_prompts)]


# ---------------------------------------------------------------------- children (engines)
def model_folder(root: Path, shape: str) -> Path:
    """config.json and a byte-level tokenizer: all load_format dummy needs."""
    folder = root / shape
    if not folder.exists():
        folder.mkdir(parents=True)
        config = json.loads((HERE / "configs" / f"{shape}.json").read_text())
        (folder / "config.json").write_text(json.dumps(config))
        from benchmarks.make_checkpoint import byte_level_tokenizer
        byte_level_tokenizer().save_pretrained(folder)
    return folder


def child_engines(spec: dict) -> dict:
    """Each engine of spec["runs"] in turn, in this process: {label: results, or {"error"}}."""
    results = {}
    for run in spec["runs"]:
        try:
            results[run["label"]] = one_engine(spec, run)
        except Exception:  # noqa: BLE001 - reported to the parent as a row
            results[run["label"]] = {"error": traceback.format_exc()[-3000:]}
    return results


def one_engine(spec: dict, run: dict) -> dict:
    """Build one engine (TP=run["tp"], the peer all-reduce unless run["peer"] is false, fused
    with the norm after it unless run["fuse"] is false (two-shot's messages unless
    run["fuse_two_shot"] is false; one-shot's pushing if run["push"]), the float linears'
    decode GEMV unless run["gemv"] is false) in this process, run its parts, shut it down
    and give its memory back; results as a dict."""
    import gc

    import torch

    from pagedserve import SamplingParams
    from pagedserve.frontend.llm_engine import LLMEngine
    from pagedserve.entrypoints.llm import LLM

    scale = Scale(spec["tiny"])
    scale.eager_tp = spec["eager_tp"]
    scale.profile_batches = spec["profile_batches"]
    tp, parts = run["tp"], run["parts"]
    t0 = time.perf_counter()
    llm = LLM.from_engine(LLMEngine.from_options(
        spec["folder"], tensor_parallel_size=tp, load_format="dummy",
        **scale.engine_options(tp, run.get("peer", True), run.get("fuse", True),
                               run.get("gemv", True), run.get("fuse_two_shot", True),
                               run.get("push", False))))
    out = {"startup_s": round(time.perf_counter() - t0, 1),
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "kv_blocks": llm.llm_engine.num_blocks}
    try:
        llm.generate([[1, 2, 3]] * 4, SamplingParams(max_tokens=8, ignore_eos=True),
                     use_tqdm=False)  # warm-up
        if "logits" in parts:
            params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                                    logprobs=TOP_LOGPROBS)
            outputs = llm.generate(logit_prompts(scale), params, use_tqdm=False)
            out["greedy"] = [o.outputs[0].token_ids for o in outputs]
            out["first_logprobs"] = [{str(t): lp.logprob
                                      for t, lp in o.outputs[0].logprobs[0].items()}
                                     for o in outputs]
        if "tpot" in parts:
            out["tpot_ms"], out["tpot_steps"] = tpot_batch1(llm, scale.tpot_tokens)
        if "workload" in parts:
            out.update(run_workload(llm, scale))
        if "profile" in parts:
            out["profile"] = [
                profile_decode(llm, batch, scale.profile_steps,
                               Path(spec["out"]) / f"profile_tp{run['label']}_b{batch}.json.gz")
                for batch in scale.profile_batches]
    finally:
        llm.llm_engine.shutdown()
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out


def tpot_batch1(llm, tokens: int) -> tuple[float, dict]:
    """Mean ms per output token after the first, one request of 128 prompt tokens (the
    median of 3 requests), and where the 3 requests' steps went (`step_costs`)."""
    from pagedserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens + 1, ignore_eos=True)
    times = []
    before, t0 = llm.llm_engine.get_stats(), time.perf_counter()
    for seed in range(3):
        prompt = [(seed * 131 + i * 7) % 10_000 for i in range(128)]
        m = llm.generate([prompt], params, use_tqdm=False)[0].metrics
        times.append((m.finished_time - m.first_token_time) / tokens * 1e3)
    costs = step_costs(before, llm.llm_engine.get_stats(), time.perf_counter() - t0)
    return round(statistics.median(times), 3), costs


def step_costs(before, after, seconds: float) -> dict:
    """Per step, in ms: its wall time; the GPU's time on it (device: rank 0's CUDA events
    from its launch to its tokens; step less device is the GPU idle between steps, which
    host work causes); the engine core's time blocked on a step's tokens (core_wait: the
    ranks' host work for the next step, the transport, and the device); rank 0's time
    blocked on the device (device_wait: near zero means the step is bound by host work, not
    the GPU); the scheduler's; and the host time outside the core's wait (host: scheduling,
    output processing, messages)."""
    steps = after.num_steps - before.num_steps
    if not steps:
        return {"steps": 0}

    def per_step(field: str) -> float:
        return round(1e3 * (getattr(after, field) - getattr(before, field)) / steps, 4)

    wall = 1e3 * seconds / steps
    return {"steps": steps, "step_ms": round(wall, 4), "device_ms": per_step("device_seconds"),
            "core_wait_ms": per_step("step_wait_seconds"),
            "device_wait_ms": per_step("device_wait_seconds"),
            "schedule_ms": per_step("schedule_seconds"),
            "host_ms": round(wall - per_step("step_wait_seconds"), 4)}


def profile_decode(llm, batch: int, steps: int, trace_path: Path) -> dict:
    """`steps` decode steps of `batch` requests (prompts of 128 tokens, past their prefills
    and 3 more steps under a first trace) traced by the runner's process (rank 0's); the
    trace summarised per step. step_ms is the host's time per step under the profiler (its
    CPU tracing adds host work: the tpot rows give the untraced time)."""
    from pagedserve import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=steps + 16, ignore_eos=True)
    ids = [f"profile-b{batch}-{i}" for i in range(batch)]
    for i, request_id in enumerate(ids):
        prompt = [(i * 131 + j * 7) % 10_000 for j in range(128)]
        engine.add_request(request_id, None, params, prompt_token_ids=prompt)
    scheduler = engine.scheduler
    while len(scheduler.waiting) or any(r.num_computed_tokens < r.num_prompt_tokens
                                        for r in scheduler.running):
        engine.step()
    executor = engine.engine_core.executor
    executor.start_profile()  # a first trace pays the profiler's set-up: thrown away
    for _ in range(3):
        engine.step()
    executor.stop_profile(str(trace_path))
    executor.start_profile()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    step_ms = 1e3 * (time.perf_counter() - t0) / steps
    executor.stop_profile(str(trace_path))
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    summary = summarize_trace(trace_path, steps)
    return {"batch": batch, "steps": steps, "step_ms": round(step_ms, 4),
            "idle_ms": round(step_ms - summary["busy_ms"], 4), **summary,
            "trace": trace_path.name}


DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def summarize_trace(path: Path, steps: int, top: int = 25) -> dict:
    """Per step, in ms: the kernels' summed time (kernel_ms) and count, the time some kernel
    ran (busy_ms: their union over the streams), the first kernel's start to the last's end
    (span_ms) and the gaps inside it (gap_ms = span - busy), the time inside the CUDA graph
    replays (each replay's first kernel start to its last's end) and outside them
    (outside_graph_ms: the eager part of the step and the gaps around it), the eager kernels'
    time and count; the `top` kernels by time (`where`: graph or eager; count per step, mean
    µs) and the largest gaps by the kernel pair around them; the launching thread's host
    time (`summarize_host`) and how far ahead of the GPU it queued (`queue_leads`). On the
    CPU (no kernels) the outermost profiled ops stand in for kernels."""
    import gzip

    with (gzip.open(path, "rt") if path.suffix == ".gz" else open(path)) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    graph_launches = {e["args"]["correlation"] for e in events
                      if "GraphLaunch" in e["name"] and "correlation" in e.get("args", {})}
    kernels = [e for e in events if e.get("cat") in DEVICE_CATEGORIES]
    if not kernels:
        kernels = outermost([e for e in events if e.get("cat") == "cpu_op"])
    if not kernels:
        return {"kernels": 0, "busy_ms": 0.0}

    def where(e: dict) -> str:
        return "graph" if e.get("args", {}).get("correlation") in graph_launches else "eager"

    kernels.sort(key=lambda e: e["ts"])
    per_step = 1e-3 / steps  # trace µs -> ms per step
    busy, gaps = union_and_gaps(kernels)
    span = max(e["ts"] + e["dur"] for e in kernels) - kernels[0]["ts"]
    replays: dict[int, list[float]] = {}
    for e in kernels:
        if where(e) == "graph":
            lo_hi = replays.setdefault(e["args"]["correlation"], [e["ts"], e["ts"] + e["dur"]])
            lo_hi[0], lo_hi[1] = min(lo_hi[0], e["ts"]), max(lo_hi[1], e["ts"] + e["dur"])
    in_graph = sum(hi - lo for lo, hi in replays.values())
    eager = [e for e in kernels if where(e) == "eager"]
    return {"kernel_ms": round(sum(e["dur"] for e in kernels) * per_step, 4),
            "kernels": round(len(kernels) / steps, 1), "busy_ms": round(busy * per_step, 4),
            "span_ms": round(span * per_step, 4), "gap_ms": round((span - busy) * per_step, 4),
            "graph_launches": round(len(replays) / steps, 2),
            "in_graph_ms": round(in_graph * per_step, 4),
            "outside_graph_ms": round((span - in_graph) * per_step, 4),
            "eager_kernel_ms": round(sum(e["dur"] for e in eager) * per_step, 4),
            "eager_kernels": round(len(eager) / steps, 1),
            "top": top_kernels(kernels, where, steps, top),
            "top_gaps": top_gaps(gaps, where, steps), **summarize_host(events),
            **queue_leads(events, kernels, graph_launches)}


def queue_leads(events: list[dict], kernels: list[dict], graph_launches: set) -> dict:
    """How far ahead of the GPU the host queued each step's work, medians in ms: a graph
    replay's first kernel's start less its `cudaGraphLaunch` call's (graph_lead_ms), and an
    input upload's (a host-to-device copy) start less its `cudaMemcpyAsync` call's
    (upload_lead_ms). A few µs to tens: the GPU was idle until the host issued them (a loop
    that prepares a step once the previous step's tokens are back); about the host's slack
    (ms): queued behind the step before, as async scheduling means to; the least replay
    lead (graph_lead_min_ms) shows a step the host was late for. The gaps between
    queued copies and before a queued replay are the device's own, which a GPU gap alone
    does not tell from the host's. `kernels` sorted by start; {} without runtime calls."""
    calls = {e["args"]["correlation"]: e["ts"] for e in events
             if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    replays: dict = {}
    uploads = []
    for e in kernels:
        call = calls.get(e.get("args", {}).get("correlation"))
        if call is None:
            continue
        if e["args"]["correlation"] in graph_launches:
            replays.setdefault(e["args"]["correlation"], e["ts"] - call)
        elif "HtoD" in e["name"]:
            uploads.append(e["ts"] - call)
    leads = {}
    if replays:
        leads["graph_lead_ms"] = round(statistics.median(replays.values()) / 1e3, 4)
        leads["graph_lead_min_ms"] = round(min(replays.values()) / 1e3, 4)
    if uploads:
        leads["upload_lead_ms"] = round(statistics.median(uploads) / 1e3, 4)
    return leads


HOST_CATEGORIES = ("cpu_op", "cuda_runtime", "user_annotation")


def summarize_host(events: list[dict]) -> dict:
    """Per launch-to-launch interval of the thread that launches the CUDA graphs (the
    runner's), in ms: its outermost traced ops (host_ops_ms), of which blocked on the device
    (host_sync_ms: cudaEventSynchronize, the host's slack: near 0 when the device waits for
    the host instead) and in collectives' host calls (host_comm_ms: c10d ops); the time
    between its ops (host_untraced_ms: Python, and a rank's wait for the engine's next call),
    and the largest such stretch on average (host_untraced_max_ms). {} without a launch."""
    launches = sorted(e["ts"] for e in events
                      if e.get("cat") == "cuda_runtime" and "GraphLaunch" in e["name"])
    if len(launches) < 2:
        return {}
    by_thread: dict = {}
    for e in events:
        if e.get("cat") == "cuda_runtime" and "GraphLaunch" in e["name"]:
            by_thread[e.get("tid")] = by_thread.get(e.get("tid"), 0) + 1
    thread = max(by_thread, key=by_thread.get)
    # the last launch closes the last interval: counted for the stretch before it only
    closed = [e for e in outermost([e for e in events if e.get("tid") == thread
                                    and e.get("cat") in HOST_CATEGORIES])
              if launches[0] <= e["ts"] <= launches[-1]]
    ops = [e for e in closed if e["ts"] < launches[-1]]
    n = len(launches) - 1
    between = [(a["ts"], b["ts"] - (a["ts"] + a["dur"])) for a, b in zip(closed, closed[1:])]
    longest = [max([g for t, g in between if lo <= t < hi] or [0.0])
               for lo, hi in zip(launches, launches[1:])]
    total = launches[-1] - launches[0]
    busy = sum(e["dur"] for e in ops)
    return {"host_interval_ms": round(total / n / 1e3, 4),
            "host_ops_ms": round(busy / n / 1e3, 4),
            "host_sync_ms": round(sum(e["dur"] for e in ops
                                      if e["name"] == "cudaEventSynchronize") / n / 1e3, 4),
            "host_comm_ms": round(sum(e["dur"] for e in ops
                                      if e["name"].startswith("c10d::")) / n / 1e3, 4),
            "host_untraced_ms": round(sum(g for _, g in between if g > 0) / n / 1e3, 4),
            "host_untraced_max_ms": round(statistics.mean(longest) / 1e3, 4)}


def outermost(ops: list[dict]) -> list[dict]:
    """The ops no other op of their thread encloses (nested ops would count twice)."""
    kept, end = [], {}
    for e in sorted(ops, key=lambda e: (e["ts"], -e["dur"])):
        thread = (e.get("pid"), e.get("tid"))
        if e["ts"] >= end.get(thread, float("-inf")):
            kept.append(e)
            end[thread] = e["ts"] + e["dur"]
    return kept


def union_and_gaps(kernels: list[dict]) -> tuple[float, list[tuple[float, dict, dict]]]:
    """The time covered by the kernels (sorted by start), and each gap between them: (µs,
    the kernel that ended last before it, the one after it)."""
    busy, gaps = 0.0, []
    first = kernels[0]
    lo, hi, last = first["ts"], first["ts"] + first["dur"], first
    for e in kernels[1:]:
        end = e["ts"] + e["dur"]
        if e["ts"] > hi:
            busy += hi - lo
            gaps.append((e["ts"] - hi, last, e))
            lo, hi, last = e["ts"], end, e
        elif end > hi:
            hi, last = end, e
    return busy + hi - lo, gaps


def short(name: str) -> str:
    return name if len(name) <= 120 else name[:117] + "..."


def top_kernels(kernels: list[dict], where, steps: int, top: int) -> list[dict]:
    totals: dict[tuple[str, str], list[float]] = {}
    for e in kernels:
        total = totals.setdefault((short(e["name"]), where(e)), [0.0, 0])
        total[0] += e["dur"]
        total[1] += 1
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"name": name, "where": place, "per_step": round(n / steps, 2),
             "mean_us": round(us / n, 2), "ms_per_step": round(us / steps / 1e3, 4)}
            for (name, place), (us, n) in ranked]


def top_gaps(gaps: list[tuple[float, dict, dict]], where, steps: int,
             top: int = 10) -> list[dict]:
    totals: dict[tuple[str, str], list[float]] = {}
    for us, before, after in gaps:
        key = (f"{short(before['name'])} ({where(before)})",
               f"{short(after['name'])} ({where(after)})")
        total = totals.setdefault(key, [0.0, 0])
        total[0] += us
        total[1] += 1
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"from": a, "to": b, "per_step": round(n / steps, 2),
             "mean_us": round(us / n, 2), "ms_per_step": round(us / steps / 1e3, 4)}
            for (a, b), (us, n) in ranked]


def run_workload(llm, scale: Scale) -> dict:
    from pagedserve import SamplingParams

    prompts, out_lens = workload_a(scale)
    params = [SamplingParams(temperature=0.6, max_tokens=n, ignore_eos=True) for n in out_lens]
    before, t0 = llm.llm_engine.get_stats(), time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    after = llm.llm_engine.get_stats()
    return {"workload_s": round(seconds, 2), "output_tokens": tokens,
            "output_tok_per_s": round(tokens / seconds, 1),
            "preemptions": after.num_preemptions,
            "workload_steps": step_costs(before, after, seconds)}


# ------------------------------------------------------------------ children (all-reduce)
def child_allreduce(spec: dict) -> dict:
    """spec["ranks"] ranks; rank 0 sends the timing rows, then the graph check's verdict (a
    capture that hangs on replay costs the verdict, not the rows)."""
    import queue as queues

    import torch.multiprocessing as mp

    from pagedserve.device.executor import WORKER_ENV

    os.environ.update(WORKER_ENV)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    size = spec["ranks"]
    procs = [ctx.Process(target=_allreduce_rank, args=(rank, size, port, spec, results))
             for rank in range(size)]
    for proc in procs:
        proc.start()
    try:
        out = results.get(timeout=BANDWIDTH_TIMEOUT_S)
        try:
            out["graph_allreduce_ok"] = results.get(timeout=GRAPH_CHECK_TIMEOUT_S)
        except queues.Empty:
            out["graph_allreduce_ok"] = False
            out["graph_check"] = f"no verdict in {GRAPH_CHECK_TIMEOUT_S} s (a hung replay?)"
        return out
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _allreduce_rank(rank: int, size: int, port: int, spec: dict, queue) -> None:
    import torch
    import torch.distributed as dist

    cuda = not spec["tiny"]
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=size,
                            **({"device_id": device} if cuda else {}))
    peer, peer_error = None, None
    if cuda:
        try:
            peer = _peer_all_reduce(size, max(spec["sizes"]), device)
        except Exception:  # noqa: BLE001 - NCCL rows still come
            peer_error = traceback.format_exc()[-1500:]
    rows = []
    for nbytes in spec["sizes"]:
        x = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
        iters = 10 if nbytes >= 16 << 20 else 100
        algorithms = {"nccl": lambda: dist.all_reduce(x)}
        if peer is not None:
            algorithms["one_shot"] = lambda: peer(x, "one_shot")
            algorithms["two_shot"] = lambda: peer(x, "two_shot")
        for name, fn in algorithms.items():
            try:
                seconds = _time_calls(fn, iters, cuda)
                row = {"bytes": nbytes, "algorithm": name, "us": round(seconds * 1e6, 2),
                       "bus_gb_per_s": round(2 * (size - 1) / size * nbytes / seconds / 1e9,
                                             2)}
                if name != "nccl":
                    row["matches_nccl"] = _matches_nccl(peer, name, nbytes, rank, device)
            except Exception:  # noqa: BLE001 - one failing size or kind is a row
                row = {"bytes": nbytes, "algorithm": name, "error":
                       traceback.format_exc()[-1500:]}
            rows.append(row)
    norm_rows = ([] if peer is None else
                 _norm_chain_rows(peer, spec["sizes"], device, spec.get("push", False))
                 + _two_shot_norm_rows(peer, device))
    if rank == 0:
        queue.put({"rows": rows, "norm_rows": norm_rows, "peer_error": peer_error,
                   "device": torch.cuda.get_device_name() if cuda else "cpu"})
    verdict = None
    if cuda:
        try:
            verdict = _graph_check(rank, size, device)
        except Exception:  # noqa: BLE001 - a capture that fails is the answer
            traceback.print_exc()
            verdict = False
    if rank == 0:
        queue.put(verdict)


# the fused one-shot kernel is timed up to this: against the fused two-shot where they overlap
NORM_CHAIN_MAX_BYTES = 4 << 20
# the messages the two-shot chain and the fused two-shot kernel are timed at: from one-shot's
# limit to the peer limit (8 KiB a row: 64 to 1024 rows of 4096 bf16)
TWO_SHOT_NORM_BYTES = [512 << 10, 1 << 20, 2 << 20, 4 << 20, 8 << 20]


def _norm_chain_rows(peer, sizes: list[int], device, push: bool = False) -> list[dict]:
    """Per size up to NORM_CHAIN_MAX_BYTES, in µs per call: the unfused engine's chain (the
    partial product already in the buffer, one-shot or two-shot as the engine's plan picks,
    into a new tensor, then the residual add + RMSNorm kernel), and the fused kernel (slots
    alternating, as the layers do; where it splits rows over several programs, also with one
    program per row); with `push`, also the fused kernel that pushes the partial products
    (fused_rms_norm_push)."""
    import itertools

    import torch
    import torch.distributed as dist

    from pagedserve.kernels.triton import allreduce_norm, model_ops
    from pagedserve.model.allreduce import ONE_SHOT_MAX_BYTES, FusedAllReduceNorm

    one_shot_limit = ONE_SHOT_MAX_BYTES[dist.get_world_size()]
    rows = []
    try:
        fused = FusedAllReduceNorm(NORM_CHAIN_MAX_BYTES, dist.group.WORLD, device)
    except Exception:  # noqa: BLE001 - the all-reduce rows still come
        return [{"algorithm": "fused_rms_norm", "error": traceback.format_exc()[-1500:]}]
    pushed = None
    if push:
        try:
            pushed = FusedAllReduceNorm(NORM_CHAIN_MAX_BYTES, dist.group.WORLD, device, push=True)
        except Exception:  # noqa: BLE001 - the other rows still come
            rows.append({"algorithm": "fused_rms_norm_push",
                         "error": traceback.format_exc()[-1500:]})
    hidden = 4096
    weight = torch.ones(hidden, dtype=torch.bfloat16, device=device)
    for nbytes in [b for b in sizes
                   if b <= NORM_CHAIN_MAX_BYTES and b % (2 * hidden) == 0]:
        algorithm = "one_shot" if nbytes <= one_shot_limit else "two_shot"
        shape = (nbytes // (2 * hidden), hidden)
        residual = torch.zeros(shape, dtype=torch.bfloat16, device=device)
        peer.target(shape, torch.bfloat16).fill_(0.001)
        for kernel, slot in itertools.product((fused, pushed), (0, 1)):
            if kernel is not None:
                kernel.target(slot, shape, torch.bfloat16).fill_(0.001)
        slots = itertools.cycle((0, 1))

        def unfused():
            total = peer(peer.target(shape, torch.bfloat16), algorithm)
            model_ops.rms_norm(total, weight, 1e-6, residual)

        def fused_call(split=None, kernel=fused):
            slot = next(slots)
            kernel(slot, kernel.target(slot, shape, torch.bfloat16), residual, weight, 1e-6,
                   split)

        split = allreduce_norm.programs_per_row(shape[0], hidden, dist.get_world_size())
        calls = [(f"{algorithm}+rms_norm", unfused, None), ("fused_rms_norm", fused_call, split)]
        if split > 1:  # also one program per row, as the kernel ran before rows were split
            calls.append(("fused_rms_norm_unsplit", lambda: fused_call(1), 1))
        if pushed is not None:
            calls.append(("fused_rms_norm_push", lambda: fused_call(kernel=pushed), split))
        for name, fn, programs_per_row in calls:
            try:
                seconds = _time_calls(fn, 100, True)
                rows.append({"bytes": nbytes, "algorithm": name,
                             "us": round(seconds * 1e6, 2), "rows": shape[0],
                             **({} if programs_per_row is None
                                else {"programs_per_row": programs_per_row})})
            except Exception:  # noqa: BLE001 - one failing size or kind is a row
                rows.append({"bytes": nbytes, "algorithm": name,
                             "error": traceback.format_exc()[-1500:]})
    return rows


def _two_shot_norm_rows(peer, device) -> list[dict]:
    """Per size of TWO_SHOT_NORM_BYTES, in µs per call: two-shot's chain (the partial product
    already in the buffer, then the residual add + RMSNorm kernel) and the fused two-shot
    kernel (the partial product already in its buffer)."""
    import torch
    import torch.distributed as dist

    from pagedserve.kernels.triton import model_ops
    from pagedserve.model.allreduce import FusedTwoShotAllReduceNorm

    try:
        fused = FusedTwoShotAllReduceNorm(max(TWO_SHOT_NORM_BYTES), dist.group.WORLD, device)
    except Exception:  # noqa: BLE001 - the other rows still come
        return [{"algorithm": "fused_two_shot_rms_norm",
                 "error": traceback.format_exc()[-1500:]}]
    hidden, rows = 4096, []
    weight = torch.ones(hidden, dtype=torch.bfloat16, device=device)
    for nbytes in TWO_SHOT_NORM_BYTES:
        shape = (nbytes // (2 * hidden), hidden)
        residual = torch.zeros(shape, dtype=torch.bfloat16, device=device)
        peer.target(shape, torch.bfloat16).fill_(0.001)
        fused.target(shape, torch.bfloat16).fill_(0.001)

        def unfused():
            total = peer(peer.target(shape, torch.bfloat16), "two_shot")
            model_ops.rms_norm(total, weight, 1e-6, residual)

        def fused_call():
            fused(fused.target(shape, torch.bfloat16), residual, weight, 1e-6)

        for name, fn in (("two_shot+rms_norm", unfused), ("fused_two_shot_rms_norm", fused_call)):
            try:
                seconds = _time_calls(fn, 100, True)
                rows.append({"bytes": nbytes, "algorithm": name, "us": round(seconds * 1e6, 2),
                             "rows": shape[0]})
            except Exception:  # noqa: BLE001 - one failing size or kind is a row
                rows.append({"bytes": nbytes, "algorithm": name,
                             "error": traceback.format_exc()[-1500:]})
    return rows


def _peer_all_reduce(size: int, max_bytes: int, device):
    """The peer all-reduce over a buffer large enough for every size measured (the engine's
    threshold is a separate setting: here every algorithm runs at every size)."""
    import torch.distributed as dist

    from pagedserve.model.allreduce import AllReducePlan, PeerAllReduce

    return PeerAllReduce(AllReducePlan(max_bytes, max_bytes, max_bytes), dist.group.WORLD, device)


def _time_calls(fn, iters: int, cuda: bool) -> float:
    """Seconds per call: on CUDA `iters` calls captured in one graph (as decode steps run
    them, without launch overhead), replayed 3 times; on the CPU eager."""
    import torch

    if not cuda:
        for _ in range(3):
            fn()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) / iters
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / (3 * iters)
    del graph
    return seconds


def _matches_nccl(peer, algorithm: str, nbytes: int, rank: int, device) -> bool:
    import torch
    import torch.distributed as dist

    x = torch.arange(nbytes // 2, device=device).remainder_(31).add_(rank).to(torch.bfloat16)
    want = x.clone()
    dist.all_reduce(want)
    return bool(torch.equal(peer(x, algorithm), want))


def _graph_check(rank: int, size: int, device) -> bool:
    """An all-reduce captured in a CUDA graph, replayed between eager all-reduces and
    all-gathers (as the engine's decode graphs run between eager prefills and the LM head's
    gather): right sums every time?"""
    import torch
    import torch.distributed as dist

    x = torch.zeros(4096, device=device)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            y = x * 2
            dist.all_reduce(y)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = x * 2
        dist.all_reduce(y)
    ok = True
    for step in range(5):
        x.fill_(rank + step)
        graph.replay()
        eager = torch.full((1024,), float(rank), device=device)
        dist.all_reduce(eager)
        parts = [torch.empty(8, device=device) for _ in range(size)]
        dist.all_gather(parts, torch.full((8,), float(rank), device=device))
        torch.cuda.synchronize()
        want = 2 * sum(r + step for r in range(size))
        ok &= bool((y == want).all()) and bool((eager == sum(range(size))).all())
    return ok


def _sync(cuda: bool) -> None:
    if cuda:
        import torch
        torch.cuda.synchronize()


def run_child(kind: str, spec: dict, timeout: float = CHILD_TIMEOUT_S) -> dict:
    """`kind` in a fresh interpreter, in a session of its own so that a timeout kills it with
    every process it started (ranks hung in NCCL would hold their GPUs); its result, or
    {"error": ...}."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", kind, json.dumps(spec)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(HERE.parent), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return {"error": f"timed out after {timeout} s"}
    finally:
        try:  # its workers, should any outlive it
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    sys.stderr.write(stderr[-4000:])
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line.removeprefix("RESULT "))
    return {"error": f"exit code {proc.returncode}: {stderr[-2000:]}"}


def child_main(kind: str, spec: str) -> None:
    try:
        result = {"engines": child_engines, "allreduce": child_allreduce}[kind](json.loads(spec))
    except Exception:  # noqa: BLE001 - reported to the parent as a row
        result = {"error": traceback.format_exc()[-3000:]}
    print("RESULT " + json.dumps(result), flush=True)


# ------------------------------------------------------------------------------- the parent
class Results:
    def __init__(self, out: Path) -> None:
        self.path = out / "tensor_parallel.json"
        # appended to an earlier run's rows (a run split over two calls ends in one file)
        self.rows: list[dict] = (json.loads(self.path.read_text()) if self.path.exists()
                                 else [])
        self.device = "unknown"

    def add(self, tp: int | None, shape: str | None, metric: str, value, **details) -> None:
        row = {"tp": tp, "shape": shape, "metric": metric, "value": value,
               "device": self.device, "date": datetime.date.today().isoformat(), **details}
        self.rows.append(row)
        print(json.dumps(row), flush=True)
        self.path.write_text(json.dumps(self.rows, indent=1) + "\n")


def part_topo(res: Results) -> None:
    if shutil.which("nvidia-smi") is None:
        res.add(None, None, "topology", None, error="nvidia-smi not found")
        return
    topo = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True)
    res.add(None, None, "topology", topo.stdout.strip())


def part_allreduce(res: Results, scale: Scale) -> None:
    n = scale.ranks
    result = run_child("allreduce", {"tiny": scale.tiny, "sizes": scale.allreduce_bytes,
                                     "ranks": n, "push": scale.push},
                       timeout=ALLREDUCE_TIMEOUT_S)
    if "error" in result:
        res.add(n, None, "allreduce_bus_gb_per_s", None, error=result["error"])
        scale.eager_tp = not scale.tiny  # perhaps a captured all-reduce hung: no graphs
        return
    res.device = result["device"]
    if result["graph_allreduce_ok"] is not None:
        res.add(n, None, "cuda_graph_allreduce_ok", result["graph_allreduce_ok"])
        scale.eager_tp = not result["graph_allreduce_ok"]
    if result.get("peer_error"):
        res.add(n, None, "peer_allreduce", None, error=result["peer_error"])
    fastest: dict[int, tuple[float, str]] = {}
    for row in result["rows"]:
        row = dict(row)
        value = row.pop("bus_gb_per_s", None)
        res.add(n, None, "allreduce_bus_gb_per_s", value, dtype="bfloat16",
                cuda_graph=not scale.tiny, **row)
        if "us" in row and row.get("matches_nccl", True):
            fastest[row["bytes"]] = min(fastest.get(row["bytes"], (float("inf"), "")),
                                        (row["us"], row["algorithm"]))
    if any(name != "nccl" for _, name in fastest.values()):
        res.add(n, None, "allreduce_fastest_by_bytes",
                {str(b): name for b, (_, name) in sorted(fastest.items())})
    for row in result.get("norm_rows", []):
        row = dict(row)
        res.add(n, None, "allreduce_add_rms_norm_us", row.pop("us", None), dtype="bfloat16",
                hidden=4096, cuda_graph=True, **row)


def engine_runs(res: Results, scale: Scale, root: Path, shape: str,
                runs: list[dict]) -> dict[str, dict]:
    """The engines of `runs` ({label, tp, peer, parts}) on `shape`, one after another in one
    child process; their start-up rows reported here."""
    folder = model_folder(root, shape)
    spec = {"runs": runs, "folder": str(folder), "tiny": scale.tiny, "eager_tp": scale.eager_tp,
            "out": str(res.path.parent), "profile_batches": scale.profile_batches}
    done = run_child("engines", spec, timeout=scale.child_timeout)
    results = {}
    for run in runs:
        label = run["label"]
        result = results[label] = done.get(label, {"error": done.get("error", "not run")})
        if "error" in result:
            res.add(run["tp"], shape, "engine", None, error=result["error"], run=label)
            continue
        res.device = result["device"]
        res.add(run["tp"], shape, "startup_s", result["startup_s"], run=label,
                kv_blocks=result["kv_blocks"], peer_allreduce=run.get("peer", True),
                fused_allreduce_norm=run.get("fuse", True),
                fused_two_shot_allreduce_norm=run.get("fuse_two_shot", True),
                all_reduce_push=run.get("push", False),
                cuda_graphs=not (scale.eager_tp and run["tp"] > 1) and not scale.tiny)
    return results


def dense_runs(scale: Scale, parts: list[str], unfused: bool = False,
               cublas: bool = False, two_shot_unfused: bool = False,
               push: bool = False) -> list[dict]:
    """TP=1, 2 (and 4) with the parts asked for; TP=N through NCCL alone for tpot; with
    `unfused`, every TP size above 1 once more for tpot, its all-reduce and norm apart; with
    `cublas`, every TP size once more for tpot, its float linears on cuBLAS at every row
    count (no decode GEMV); with `two_shot_unfused`, every TP size above 1 once more for
    tpot and workload, two-shot's messages summed, then normalised apart (one-shot's still
    fused); with `push`, every TP size above 1 once more for tpot, one-shot's fused kernel
    pushing the partial products (--all-reduce-push)."""
    runs = [{"label": str(tp), "tp": tp, "peer": True,
             "parts": [p for p in parts if p != "logits" or tp in (1, scale.ranks)]}
            for tp in scale.tps]
    if "tpot" in parts and scale.ranks in scale.tps:
        runs.append({"label": f"{scale.ranks}-nccl", "tp": scale.ranks, "peer": False,
                     "parts": ["tpot"]})
    if "tpot" in parts and unfused:
        runs += [{"label": f"{tp}-unfused", "tp": tp, "peer": True, "fuse": False,
                  "parts": ["tpot"]} for tp in scale.tps if tp > 1]
    if two_shot_unfused and {"tpot", "workload"} & set(parts):
        runs += [{"label": f"{tp}-2shot-unfused", "tp": tp, "peer": True,
                  "fuse_two_shot": False,
                  "parts": [p for p in parts if p in ("tpot", "workload")]}
                 for tp in scale.tps if tp > 1]
    if "tpot" in parts and push:
        runs += [{"label": f"{tp}-push", "tp": tp, "peer": True, "push": True,
                  "parts": ["tpot"]} for tp in scale.tps if tp > 1]
    if "tpot" in parts and cublas:
        runs += [{"label": f"{tp}-cublas", "tp": tp, "peer": True, "gemv": False,
                  "parts": ["tpot"]} for tp in scale.tps]
    return runs


TARGETS = {("tpot", 2): "<= 0.60", ("tpot", 4): "<= 0.40", ("workload", 2): ">= 1.7"}


def report_engines(res: Results, scale: Scale, shape: str, runs: dict[str, dict]) -> None:
    one = runs.get("1", {"error": "not run"})
    for label, run in runs.items():
        tp = int(label.split("-")[0])
        if "tpot_ms" in run:
            res.add(tp, shape, "tpot_batch1_ms", run["tpot_ms"], run=label,
                    **run["tpot_steps"])
        for profile in run.get("profile", []):
            table = res.path.parent / profile["trace"].replace(".json.gz", ".txt")
            table.write_text(profile_table(tp, shape, profile))
            res.add(tp, shape, "profile_decode_kernel_ms", profile.pop("kernel_ms", None),
                    run=label, table=table.name, **profile)
        if "output_tok_per_s" in run:
            res.add(tp, shape, "workload_A_output_tok_per_s", run["output_tok_per_s"],
                    run=label, seconds=run["workload_s"], output_tokens=run["output_tokens"],
                    preemptions=run["preemptions"], kv_blocks=run["kv_blocks"],
                    **run.get("workload_steps", {}))
        gemv = runs.get(label.removesuffix("-cublas"), {})
        if label.endswith("-cublas") and "tpot_ms" in run and "tpot_ms" in gemv:
            res.add(tp, shape, "tpot_gemv_over_cublas", round(gemv["tpot_ms"] / run["tpot_ms"], 3),
                    run=label.removesuffix("-cublas"))
        pulled = runs.get(label.removesuffix("-push"), {})
        if label.endswith("-push") and "tpot_ms" in run and "tpot_ms" in pulled:
            res.add(tp, shape, "tpot_push_over_pull", round(run["tpot_ms"] / pulled["tpot_ms"], 3),
                    run=label.removesuffix("-push"))
        if label == "1" or "error" in run or "error" in one:
            continue
        if "tpot_ms" in run and "tpot_ms" in one:
            res.add(tp, shape, f"tpot_ratio_tp{label}_over_tp1",
                    round(run["tpot_ms"] / one["tpot_ms"], 3),
                    target=TARGETS.get(("tpot", tp)))
        if "output_tok_per_s" in run and "output_tok_per_s" in one:
            res.add(tp, shape, f"workload_A_speedup_tp{label}_over_tp1",
                    round(run["output_tok_per_s"] / one["output_tok_per_s"], 3),
                    target=TARGETS.get(("workload", tp)))
    top = runs.get(str(scale.ranks), {})
    if "greedy" in one and "greedy" in top:
        report_logits(res, scale, one, top)


def profile_table(tp: int, shape: str, p: dict) -> str:
    """A profile row for people: the per-step figures, then the kernels and the gaps."""
    head = (f"{shape} TP={tp} batch {p['batch']}: {p['steps']} decode steps, per step (ms): "
            + ", ".join(f"{k} {p[k]}" for k in (
                "step_ms", "kernel_ms", "kernels", "busy_ms", "idle_ms", "span_ms", "gap_ms",
                "graph_launches", "in_graph_ms", "outside_graph_ms", "eager_kernel_ms",
                "eager_kernels", "host_interval_ms", "host_ops_ms", "host_sync_ms",
                "host_comm_ms", "host_untraced_ms", "host_untraced_max_ms", "graph_lead_ms",
                "graph_lead_min_ms", "upload_lead_ms") if k in p))
    lines = [head, "", f"{'ms/step':>8} {'n/step':>7} {'mean us':>8}  where  kernel"]
    lines += [f"{k['ms_per_step']:8.4f} {k['per_step']:7.2f} {k['mean_us']:8.2f}  "
              f"{k['where']:<5}  {k['name']}" for k in p.get("top", [])]
    lines += ["", f"{'ms/step':>8} {'n/step':>7} {'mean us':>8}  gap from -> to"]
    lines += [f"{g['ms_per_step']:8.4f} {g['per_step']:7.2f} {g['mean_us']:8.2f}  "
              f"{g['from']} -> {g['to']}" for g in p.get("top_gaps", [])]
    return "\n".join(lines) + "\n"


def report_logits(res: Results, scale: Scale, one: dict, other: dict) -> None:
    """The first generated token's top-20 logprobs (tokens in both lists) and how many
    greedy tokens agree before the first difference (random weights give flat
    distributions, so bf16 rounding may swap near-ties: agreement is reported, not required)."""
    diffs, same_top = [], 0
    for a, b in zip(one["first_logprobs"], other["first_logprobs"]):
        diffs += [abs(a[t] - b[t]) for t in a.keys() & b.keys()]
        same_top += max(a, key=a.get) == max(b, key=b.get)
    prefix = [next((i for i, (x, y) in enumerate(zip(g1, g2)) if x != y), len(g1))
              for g1, g2 in zip(one["greedy"], other["greedy"])]
    n, tp = len(prefix), scale.ranks
    res.add(tp, scale.shape, "first_token_logprob_max_abs_diff_vs_tp1", round(max(diffs), 5),
            mean=round(statistics.mean(diffs), 5), prompts=n, top=TOP_LOGPROBS)
    res.add(tp, scale.shape, "first_token_argmax_agreement_vs_tp1", same_top / n)
    res.add(tp, scale.shape, "greedy_tokens_agreeing_before_first_difference",
            statistics.mean(prefix), of=len(one["greedy"][0]))


def part_moe(res: Results, scale: Scale, root: Path) -> None:
    """Qwen3-30B-A3B's shape, workload A at every TP size."""
    runs = [{"label": str(tp), "tp": tp, "parts": ["workload"]} for tp in scale.tps]
    report_engines(res, scale, scale.moe_shape,
                   engine_runs(res, scale, root, scale.moe_shape, runs))


def part_big(res: Results, scale: Scale, root: Path) -> None:
    """Llama-3-70B's shape at TP=N: start-up, batch-1 TPOT, workload A."""
    runs = [{"label": str(scale.ranks), "tp": scale.ranks, "parts": ["tpot", "workload"]}]
    report_engines(res, scale, scale.big_shape,
                   engine_runs(res, scale, root, scale.big_shape, runs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="folder for tensor_parallel.json")
    parser.add_argument("--only", default=",".join(DEFAULT_PARTS),
                        help=f"parts of {PARTS} (default: all but profile)")
    parser.add_argument("--tiny", action="store_true", help="the CPU check (gloo, tiny)")
    parser.add_argument("--ranks", type=int, default=2, choices=(2, 4),
                        help="GPUs: the all-reduce's ranks and the largest TP size")
    parser.add_argument("--tps", default=None,
                        help="the TP sizes the engine parts run, e.g. 1,2 (default: 1, 2 and "
                        "4 with --ranks 4), to split a part over several device calls")
    parser.add_argument("--unfused", action="store_true",
                        help="tpot: also every TP size above 1 with the all-reduce and the "
                        "RMSNorm after it as two kernels (--no-fuse-all-reduce-norm)")
    parser.add_argument("--two-shot-unfused", action="store_true",
                        help="tpot, workload: also every TP size above 1 with two-shot's "
                        "messages summed, then normalised apart "
                        "(--no-fuse-two-shot-all-reduce-norm)")
    parser.add_argument("--push", action="store_true",
                        help="tpot: also every TP size above 1 with one-shot's fused kernel "
                        "pushing the partial products (--all-reduce-push); allreduce: also "
                        "that kernel per call (fused_rms_norm_push)")
    parser.add_argument("--cublas", action="store_true",
                        help="tpot: also every TP size with the float linears on cuBLAS at "
                        "every batch size (--no-dense-gemv), to compare with the GEMV")
    parser.add_argument("--profile-batches", default=None,
                        help="profile: the decode batch sizes traced, e.g. 1,256 (default: "
                        "1 and 64; workload A decodes at up to 256)")
    parser.add_argument("--child-timeout", type=float, default=CHILD_TIMEOUT_S,
                        help="seconds an engine part's child process may run before it is "
                        "killed with its ranks (default %(default)s)")
    parser.add_argument("--child", nargs=2, metavar=("KIND", "SPEC"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child_main(*args.child)
        return
    if args.out is None:
        parser.error("--out is required")
    parts = args.only.split(",")
    unknown = set(parts) - set(PARTS)
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}; choose from {PARTS}")
    args.out.mkdir(parents=True, exist_ok=True)
    scale, res = Scale(args.tiny, args.ranks), Results(args.out)
    scale.child_timeout = args.child_timeout
    scale.push = args.push
    if args.profile_batches:
        scale.profile_batches = tuple(int(b) for b in args.profile_batches.split(","))
    if args.tps:
        scale.tps = [int(tp) for tp in args.tps.split(",")]
        if not set(scale.tps) <= {1, 2, 4} or max(scale.tps) > args.ranks:
            parser.error(f"--tps must be among 1, 2, 4 and at most --ranks ({args.ranks})")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if "topo" in parts:
            part_topo(res)
        if "allreduce" in parts:
            part_allreduce(res, scale)
        engine_parts = [p for p in ENGINE_PARTS if p in parts]
        if engine_parts:
            runs = dense_runs(scale, engine_parts, args.unfused, args.cublas,
                              args.two_shot_unfused, args.push)
            report_engines(res, scale, scale.shape,
                           engine_runs(res, scale, root, scale.shape, runs))
        if "moe" in parts:
            part_moe(res, scale, root)
        if "big" in parts:
            part_big(res, scale, root)
    print(f"done in {time.perf_counter() - t0:.0f} s; {len(res.rows)} rows in {res.path}")


if __name__ == "__main__":
    main()
