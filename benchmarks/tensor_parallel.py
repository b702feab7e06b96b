"""Tensor parallelism on two GPUs (the lent nvidia-h200-x2): the link, the all-reduce, and
TP=2 against TP=1 on Llama-3-8B's shape, then a shape that fits only on two GPUs; one run.

    PYTHONPATH=. python benchmarks/tensor_parallel.py --out DIR [--only PARTS]

Parts (all by default, in this order):
  topo       `nvidia-smi topo -m`: how the two GPUs are linked
  allreduce  NCCL all-reduce of bf16 tensors (8 KiB = one decode token's hidden state of
             Llama-3-8B, 1, 16 and 256 MiB): time and bus bandwidth, 2 ranks; and whether an
             all-reduce captured in a CUDA graph replays right between eager collectives (if
             not, the TP=2 engines run with --enforce-eager, and the rows say so)
  logits     Llama-3-8B shape, TP=1 and TP=2 on the same random weights: the first generated
             token's top-20 logprobs of 16 prompts (largest difference), and greedy agreement
  tpot       batch-1 decode TPOT, TP=2 / TP=1 (target <= 0.65)
  workload   workload A (benchmarks/throughput.py's: 256 requests, prompt and output lengths
             uniform in [100, 1024]), output tokens/s, TP=2 / TP=1 (target >= 1.6)
  big        Llama-3-70B's shape (70.6B parameters, 141 GB in bf16: more than one H200 holds)
             at TP=2 serving workload A

logits, tpot and workload share one engine per TP size. Weights are random (load_format
dummy: no checkpoint to write; the same weights at every TP size, see pagedserve/model/
dummy.py); a folder holds only config.json and a byte-level tokenizer. The TP=1 engine and
then the TP=2 engine are built in one process, the engine core in that process (not in a
process of its own as `LLM(...)` would put it), the first shut down before the second starts:
a process that has run an engine must be able to run another (issue 27; this script once
gave each engine a fresh process because that crashed). The process runs apart from this
script's, in a session of its own, so a hung NCCL rank cannot outlive a timeout. A part that
fails is recorded as an `error` row and the run goes on.

Expected to take 6-7 minutes on the H200 pair. If one device call may not last that long, run
`--only topo,allreduce,logits,tpot,workload`, then `--only allreduce,big` (the all-reduce part
is short and decides whether the TP=2 engines may use CUDA graphs).

Appends to DIR/tensor_parallel.json: rows of tp, shape, metric, value, device, date (and the
part's details). `--tiny` runs the same logic on the CPU (gloo, a tiny Llama, a scaled-down
workload): a check of the script, not a measurement.
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

PARTS = ("topo", "allreduce", "logits", "tpot", "workload", "big")
ENGINE_PARTS = ("logits", "tpot", "workload")
CHILD_TIMEOUT_S = 420
BANDWIDTH_TIMEOUT_S = 120  # NCCL start-up and the bandwidth sizes
GRAPH_CHECK_TIMEOUT_S = 60  # a captured all-reduce that hangs on replay must not eat the run
ALLREDUCE_TIMEOUT_S = BANDWIDTH_TIMEOUT_S + GRAPH_CHECK_TIMEOUT_S + 60
TOP_LOGPROBS = 20


class Scale:
    """What the run measures: the real thing on GPUs, or a seconds-long check on the CPU."""

    def __init__(self, tiny: bool) -> None:
        self.tiny = tiny
        self.device = "cpu" if tiny else "cuda"
        self.shape = "tiny-llama3" if tiny else "llama3-8b"
        self.big_shape = "tiny-llama3" if tiny else "llama3-70b"
        self.requests = 8 if tiny else 256
        self.lengths = (10, 40) if tiny else (100, 1024)
        self.tpot_tokens = 16 if tiny else 128
        self.logit_prompts = 4 if tiny else 16
        self.allreduce_bytes = ([8 << 10, 1 << 20] if tiny
                                else [8 << 10, 1 << 20, 16 << 20, 256 << 20])
        # TP>1 without CUDA graphs: set when the all-reduce part finds a captured all-reduce
        # that does not replay right (the engines would then hang or compute garbage)
        self.eager_tp = False

    def engine_options(self, tp: int) -> dict:
        if self.tiny:
            return dict(device="cpu", dtype="float32", kv_cache_memory=64 << 20,
                        max_model_len=256)
        return dict(max_model_len=4096, enforce_eager=self.eager_tp and tp > 1)


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
    """Each TP size of spec["tps"] in turn, in this process: {tp: results, or {"error"}}."""
    results = {}
    for tp in spec["tps"]:
        try:
            results[str(tp)] = one_engine(spec, tp)
        except Exception:  # noqa: BLE001 - reported to the parent as a row
            results[str(tp)] = {"error": traceback.format_exc()[-3000:]}
    return results


def one_engine(spec: dict, tp: int) -> dict:
    """Build one engine (TP=tp) in this process, run the parts asked for, shut it down and
    give its memory back; results as a dict."""
    import gc

    import torch

    from pagedserve import SamplingParams
    from pagedserve.frontend.llm_engine import LLMEngine
    from pagedserve.entrypoints.llm import LLM

    scale = Scale(spec["tiny"])
    scale.eager_tp = spec["eager_tp"]
    t0 = time.perf_counter()
    llm = LLM.from_engine(LLMEngine.from_options(
        spec["folder"], tensor_parallel_size=tp, load_format="dummy",
        **scale.engine_options(tp)))
    out = {"startup_s": round(time.perf_counter() - t0, 1),
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "kv_blocks": llm.llm_engine.num_blocks}
    try:
        llm.generate([[1, 2, 3]] * 4, SamplingParams(max_tokens=8, ignore_eos=True),
                     use_tqdm=False)  # warm-up
        if "logits" in spec["parts"]:
            params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                                    logprobs=TOP_LOGPROBS)
            outputs = llm.generate(logit_prompts(scale), params, use_tqdm=False)
            out["greedy"] = [o.outputs[0].token_ids for o in outputs]
            out["first_logprobs"] = [{str(t): lp.logprob
                                      for t, lp in o.outputs[0].logprobs[0].items()}
                                     for o in outputs]
        if "tpot" in spec["parts"]:
            out["tpot_ms"] = tpot_batch1(llm, scale.tpot_tokens)
        if "workload" in spec["parts"]:
            out.update(run_workload(llm, scale))
    finally:
        llm.llm_engine.shutdown()
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out


def tpot_batch1(llm, tokens: int) -> float:
    """Mean ms per output token after the first, one request of 128 prompt tokens (the
    median of 3 requests)."""
    from pagedserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens + 1, ignore_eos=True)
    times = []
    for seed in range(3):
        prompt = [(seed * 131 + i * 7) % 10_000 for i in range(128)]
        m = llm.generate([prompt], params, use_tqdm=False)[0].metrics
        times.append((m.finished_time - m.first_token_time) / tokens * 1e3)
    return round(statistics.median(times), 3)


def run_workload(llm, scale: Scale) -> dict:
    from pagedserve import SamplingParams

    prompts, out_lens = workload_a(scale)
    params = [SamplingParams(temperature=0.6, max_tokens=n, ignore_eos=True) for n in out_lens]
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"workload_s": round(seconds, 2), "output_tokens": tokens,
            "output_tok_per_s": round(tokens / seconds, 1),
            "preemptions": llm.llm_engine.get_stats().num_preemptions}


# ------------------------------------------------------------------ children (all-reduce)
def child_allreduce(spec: dict) -> dict:
    """Two ranks; rank 0 sends the bandwidth rows, then the graph check's verdict (a capture
    that hangs on replay costs the verdict, not the rows)."""
    import queue as queues

    import torch.multiprocessing as mp

    from pagedserve.device.executor import WORKER_ENV

    os.environ.update(WORKER_ENV)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_allreduce_rank, args=(rank, 2, port, spec, results))
             for rank in range(2)]
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
    rows = []
    for nbytes in spec["sizes"]:
        x = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
        iters = 20 if nbytes >= 16 << 20 else 200
        for _ in range(5):
            dist.all_reduce(x)
        _sync(cuda)
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        _sync(cuda)
        seconds = (time.perf_counter() - t0) / iters
        rows.append({"bytes": nbytes, "us": round(seconds * 1e6, 2),
                     "bus_gb_per_s": round(2 * (size - 1) / size * nbytes / seconds / 1e9, 2)})
    if rank == 0:
        queue.put({"rows": rows, "device": torch.cuda.get_device_name() if cuda else "cpu"})
    verdict = None
    if cuda:
        try:
            verdict = _graph_check(rank, size, device)
        except Exception:  # noqa: BLE001 - a capture that fails is the answer
            traceback.print_exc()
            verdict = False
    if rank == 0:
        queue.put(verdict)


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
    result = run_child("allreduce", {"tiny": scale.tiny, "sizes": scale.allreduce_bytes},
                       timeout=ALLREDUCE_TIMEOUT_S)
    if "error" in result:
        res.add(2, None, "allreduce_bus_gb_per_s", None, error=result["error"])
        scale.eager_tp = not scale.tiny  # perhaps a captured all-reduce hung: no graphs
        return
    res.device = result["device"]
    if result["graph_allreduce_ok"] is not None:
        res.add(2, None, "cuda_graph_allreduce_ok", result["graph_allreduce_ok"])
        scale.eager_tp = not result["graph_allreduce_ok"]
    for row in result["rows"]:
        res.add(2, None, "allreduce_bus_gb_per_s", row["bus_gb_per_s"], bytes=row["bytes"],
                us=row["us"], dtype="bfloat16")


def engine_runs(res: Results, scale: Scale, root: Path, parts: list[str]) -> dict[int, dict]:
    folder = model_folder(root, scale.shape)
    spec = {"tps": [1, 2], "folder": str(folder), "parts": parts, "tiny": scale.tiny,
            "eager_tp": scale.eager_tp}
    both = run_child("engines", spec, timeout=2 * CHILD_TIMEOUT_S)
    results = {}
    for tp in (1, 2):
        result = results[tp] = both.get(str(tp), {"error": both.get("error", "not run")})
        if "error" in result:
            res.add(tp, scale.shape, "engine", None, error=result["error"])
            continue
        res.device = result["device"]
        res.add(tp, scale.shape, "startup_s", result["startup_s"], kv_blocks=result["kv_blocks"],
                cuda_graphs=not (scale.eager_tp and tp > 1) and not scale.tiny,
                same_process_as="tp1" if tp == 2 else None)
    return results


def report_engines(res: Results, scale: Scale, runs: dict[int, dict]) -> None:
    one, two = runs[1], runs[2]
    ok = "error" not in one and "error" not in two
    if ok and "greedy" in one:
        report_logits(res, scale, one, two)
    for tp, run in runs.items():
        if "tpot_ms" in run:
            res.add(tp, scale.shape, "tpot_batch1_ms", run["tpot_ms"])
        if "output_tok_per_s" in run:
            res.add(tp, scale.shape, "workload_A_output_tok_per_s", run["output_tok_per_s"],
                    seconds=run["workload_s"], output_tokens=run["output_tokens"],
                    preemptions=run["preemptions"], kv_blocks=run["kv_blocks"])
    if ok and "tpot_ms" in one:
        res.add(2, scale.shape, "tpot_ratio_tp2_over_tp1",
                round(two["tpot_ms"] / one["tpot_ms"], 3), target="<= 0.65")
    if ok and "output_tok_per_s" in one:
        res.add(2, scale.shape, "workload_A_speedup_tp2_over_tp1",
                round(two["output_tok_per_s"] / one["output_tok_per_s"], 3), target=">= 1.6")


def report_logits(res: Results, scale: Scale, one: dict, two: dict) -> None:
    """The first generated token's top-20 logprobs (tokens in both lists) and how many
    greedy tokens agree before the first difference (random weights give flat
    distributions, so bf16 rounding may swap near-ties: agreement is reported, not required)."""
    diffs, same_top = [], 0
    for a, b in zip(one["first_logprobs"], two["first_logprobs"]):
        diffs += [abs(a[t] - b[t]) for t in a.keys() & b.keys()]
        same_top += max(a, key=a.get) == max(b, key=b.get)
    prefix = [next((i for i, (x, y) in enumerate(zip(g1, g2)) if x != y), len(g1))
              for g1, g2 in zip(one["greedy"], two["greedy"])]
    n = len(prefix)
    res.add(2, scale.shape, "first_token_logprob_max_abs_diff_vs_tp1", round(max(diffs), 5),
            mean=round(statistics.mean(diffs), 5), prompts=n, top=TOP_LOGPROBS)
    res.add(2, scale.shape, "first_token_argmax_agreement_vs_tp1", same_top / n)
    res.add(2, scale.shape, "greedy_tokens_agreeing_before_first_difference",
            statistics.mean(prefix), of=len(one["greedy"][0]))


def part_big(res: Results, scale: Scale, root: Path) -> None:
    folder = model_folder(root, scale.big_shape)
    both = run_child("engines", {"tps": [2], "folder": str(folder), "parts": ["workload"],
                                 "tiny": scale.tiny, "eager_tp": scale.eager_tp})
    result = both.get("2", {"error": both.get("error", "not run")})
    if "error" in result:
        res.add(2, scale.big_shape, "workload_A_output_tok_per_s", None, error=result["error"])
        return
    res.device = result["device"]
    res.add(2, scale.big_shape, "workload_A_output_tok_per_s", result["output_tok_per_s"],
            seconds=result["workload_s"], output_tokens=result["output_tokens"],
            preemptions=result["preemptions"], kv_blocks=result["kv_blocks"],
            startup_s=result["startup_s"], cuda_graphs=not scale.eager_tp and not scale.tiny)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="folder for tensor_parallel.json")
    parser.add_argument("--only", default=",".join(PARTS), help=f"parts of {PARTS}")
    parser.add_argument("--tiny", action="store_true", help="the CPU check (gloo, tiny)")
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
    scale, res = Scale(args.tiny), Results(args.out)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if "topo" in parts:
            part_topo(res)
        if "allreduce" in parts:
            part_allreduce(res, scale)
        engine_parts = [p for p in ENGINE_PARTS if p in parts]
        if engine_parts:
            report_engines(res, scale, engine_runs(res, scale, root, engine_parts))
        if "big" in parts:
            part_big(res, scale, root)
    print(f"done in {time.perf_counter() - t0:.0f} s; {len(res.rows)} rows in {res.path}")


if __name__ == "__main__":
    main()
