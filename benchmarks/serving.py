"""Serving benchmark: the engine offline and behind `pagedserve serve`, in one run.

Without `--base-url` (the suite) it builds one ShareGPT-like synthetic workload and measures,
with the same engine flags for every row but the last:
  offline greedy           LLM.generate over every request, temperature 0
  offline sampled          the same requests; every fourth uses temperature 1, top_p 0.95,
                           top_k 40, repetition_penalty 1.1 and its own seed
  served                   the greedy requests through a `pagedserve serve` process started
                           by this script, `--concurrency` streaming clients (256) spread
                           over `--client-procs` processes; output tokens counted from each
                           stream's usage chunk
  served, Poisson R/s      the same server, requests arriving as a Poisson process at each
                           `--rates` R: TTFT and TPOT p50/p99 against achieved throughput
  offline greedy, default flags   as the first row, with no engine flag given
Workload: `--num-requests` (1,000) requests of random token ids (prompts are ids, so every
path sees the same tokens); prompt and output lengths are lognormal, median
`--prompt-median` (200) and `--output-median` (150) tokens, sigma `--sigma` (0.8), clipped to
[`--min-len`, `--max-prompt-len` / `--max-output-len`]; `ignore_eos`, so each request
produces exactly its output length. Every offline row runs in a fresh process (its memory is
back before the next row starts) after a warm-up generate. Rows go to `--out`/serving.json
(`path`, `output_tok_per_s`, `seconds`, `output_tokens`, `device`, `date`, the core's
`steps` over the row and how many of them replayed a decode graph, `decode_graph_steps`,
...) and the latency plot to `--out`/serving_latency.png.

    python benchmarks/serving.py --model /tmp/qwen3-0.6b-random               # H100
    python benchmarks/serving.py --model /tmp/tiny --num-requests 48 --concurrency 8 \
        --rates 2 4 --max-prompt-len 64 --max-output-len 16 --out /tmp/serving   # CPU smoke

With `--base-url` it is a client against a server that is already running: requests arrive
as a Poisson process at `--request-rate` per second (`inf`: all at once; `--max-concurrency`
caps how many are in flight) and stream from `/v1/completions` with `ignore_eos`, so every
request produces exactly `--max-tokens` tokens. Per request we time, on the client:
  TTFT  time to the first streamed token
  TPOT  (latency - TTFT) / (output tokens - 1): the mean decode pace a user sees
  ITL   every gap between two streamed chunks (a chunk may carry more than one token)
and report p50/p90/p99, request and token throughput, and goodput: completed requests per
second that met both SLOs (`--slo-ttft`, `--slo-tpot`).

`--prefix-words N` runs the prefix-cache comparison instead: every request starts with an
N-word system prompt; half of them (interleaved) share one system prompt, the other half get
their own random one of the same length, so in the same run the shared half can hit the
prefix cache and the unique half cannot. TTFT is reported per half, with the server's own
prefix-cache counters from /metrics.

    pagedserve serve --port 8000 &     # or: python -m pagedserve.entrypoints.server
    python benchmarks/serving.py --base-url http://127.0.0.1:8000 --num-requests 32 \
        --request-rate 2 --max-tokens 32
    python benchmarks/serving.py --base-url http://127.0.0.1:8000 --num-requests 16 \
        --max-concurrency 1 --prefix-words 600
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import datetime
import json
import math
import multiprocessing
import os
import platform
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

# Python puts this script's folder first on sys.path, where benchmarks/kernels.py would shadow
# the `kernels` package that transformers probes for; we import nothing from this folder.
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks.host_timers

import httpx  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

WORDS = ("time year people way day man thing woman life child world school state family "
         "student group country problem hand part place case week company system program "
         "question work government number night point home water room mother area money "
         "story fact month lot right study book eye job word business issue side kind head "
         "house service friend father power hour game line end member law car city name "
         "team minute idea kid body information back parent face others level office door "
         "health person art war history party result change morning reason research girl "
         "guy moment air teacher force education").split()


@dataclass
class Result:
    group: str
    ok: bool = False
    error: str = ""
    ttft: float = math.nan
    latency: float = math.nan
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    chunks: int = 0  # streamed chunks that carried choices (a chunk may hold several tokens)
    itl: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float:
        if self.output_tokens < 2:
            return math.nan
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def random_text(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def build_requests(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(group, prompt) pairs; group is "all", or "shared"/"unique" in the prefix run."""
    rng = random.Random(args.seed)
    # a fresh tag per run, so nothing is cached from an earlier run against the same server
    run_tag = uuid.uuid4().hex[:8]
    if not args.prefix_words:
        return [("all", f"{run_tag}: {random_text(rng, args.prompt_words)}")
                for _ in range(args.num_requests)]
    shared = random_text(rng, args.prefix_words)
    requests = []
    for i in range(args.num_requests):
        group = "shared" if i % 2 == 0 else "unique"
        system = shared if group == "shared" else random_text(rng, args.prefix_words)
        question = random_text(rng, args.prompt_words)
        requests.append((group, f"System {run_tag}: {system}\nUser: {question}\nAssistant:"))
    return requests


async def send(http: httpx.AsyncClient, model: str, prompt: str | list[int], group: str,
               max_tokens: int) -> Result:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    result = Result(group)
    start = time.perf_counter()
    last = None
    try:
        async with http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return result
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                now = time.perf_counter()
                if "error" in chunk:
                    result.error = chunk["error"].get("message", "error event")
                    return result
                if chunk.get("usage"):
                    usage = chunk["usage"]
                    result.output_tokens = usage["completion_tokens"]
                    result.prompt_tokens = usage["prompt_tokens"]
                    details = usage.get("prompt_tokens_details") or {}
                    result.cached_tokens = details.get("cached_tokens") or 0
                if not chunk.get("choices"):
                    continue  # the usage chunk
                result.chunks += 1
                if last is None:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
        result.latency = time.perf_counter() - start
        result.ok = result.output_tokens > 0
    except httpx.HTTPError as exc:
        result.error = repr(exc)
    return result


async def run(args: argparse.Namespace) -> tuple[list[Result], float]:
    requests = build_requests(args)
    rng = random.Random(args.seed + 1)
    limits = httpx.Limits(max_connections=len(requests) + 4)
    async with httpx.AsyncClient(base_url=args.base_url, timeout=3600, limits=limits) as http:
        model = args.model or (await http.get("/v1/models")).json()["data"][0]["id"]
        if args.prefix_words:  # one shared-prefix request first, so the cache is warm
            await send(http, model, requests[0][1] + " warm", "warmup", 1)
        slots = asyncio.Semaphore(args.max_concurrency or len(requests))

        async def limited(group: str, prompt: str) -> Result:
            async with slots:
                return await send(http, model, prompt, group, args.max_tokens)

        tasks = []
        start = time.perf_counter()
        for group, prompt in requests:
            tasks.append(asyncio.create_task(limited(group, prompt)))
            if math.isfinite(args.request_rate):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return results, duration


def percentiles(values: list[float]) -> dict[str, float]:
    values = sorted(v for v in values if not math.isnan(v))
    if not values:
        return {}

    def pct(p: float) -> float:
        return values[min(len(values) - 1, max(0, math.ceil(p / 100 * len(values)) - 1))]

    return {"mean": statistics.fmean(values), "p50": pct(50), "p90": pct(90), "p99": pct(99)}


def summarize(results: list[Result], duration: float, args: argparse.Namespace) -> dict:
    done = [r for r in results if r.ok]
    good = [r for r in done if r.ttft <= args.slo_ttft and
            (math.isnan(r.tpot) or r.tpot <= args.slo_tpot)]
    out_tokens = sum(r.output_tokens for r in done)
    summary = {
        "completed": len(done), "failed": len(results) - len(done),
        "duration_s": duration,
        "request_throughput": len(done) / duration,
        "output_token_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + sum(r.prompt_tokens for r in done)) / duration,
        "goodput": len(good) / duration,
        "slo": {"ttft_s": args.slo_ttft, "tpot_s": args.slo_tpot},
        "ttft_s": percentiles([r.ttft for r in done]),
        "tpot_s": percentiles([r.tpot for r in done]),
        "itl_s": percentiles([gap for r in done for gap in r.itl]),
        "e2e_s": percentiles([r.latency for r in done]),
        "errors": sorted({r.error for r in results if r.error})[:5],
    }
    groups = sorted({r.group for r in done} - {"all"})
    for group in groups:
        members = [r for r in done if r.group == group]
        summary[f"group_{group}"] = {
            "requests": len(members),
            "prompt_tokens_mean": statistics.fmean(r.prompt_tokens for r in members),
            "cached_tokens_mean": statistics.fmean(r.cached_tokens for r in members),
            "ttft_s": percentiles([r.ttft for r in members])}
    return summary


def scrape(base_url: str) -> dict[str, float]:
    text = httpx.get(base_url + "/metrics", timeout=30).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if not s.labels}


def print_summary(summary: dict) -> None:
    print(f"completed {summary['completed']}, failed {summary['failed']}, "
          f"in {summary['duration_s']:.1f} s")
    print(f"request throughput {summary['request_throughput']:.3f} req/s, output tokens "
          f"{summary['output_token_throughput']:.1f} tok/s, total tokens "
          f"{summary['total_token_throughput']:.1f} tok/s")
    slo = summary["slo"]
    print(f"goodput {summary['goodput']:.3f} req/s "
          f"(SLO: TTFT <= {slo['ttft_s']} s and TPOT <= {slo['tpot_s']} s)")
    print(f"{'metric (ms)':<14}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        row = summary[key]
        if row:
            print(f"{key[:-2].upper():<14}" + "".join(f"{row[c] * 1000:>10.1f}"
                                                     for c in ("mean", "p50", "p90", "p99")))
    for key, group in summary.items():
        if key.startswith("group_"):
            t = group["ttft_s"]
            print(f"{key[6:]:<8} n={group['requests']:<3} prompt {group['prompt_tokens_mean']:.0f}"
                  f" tok, cached {group['cached_tokens_mean']:.0f} tok, TTFT mean "
                  f"{t['mean'] * 1000:.0f} ms, p50 {t['p50'] * 1000:.0f} ms, "
                  f"p90 {t['p90'] * 1000:.0f} ms")
    if "server_prefix_cache" in summary:
        pc = summary["server_prefix_cache"]
        print(f"server prefix cache: {pc['hits']:.0f} / {pc['queries']:.0f} prompt tokens hit")
    for error in summary["errors"]:
        print("error:", error)


# ---- the suite: offline rows, a server of our own, a Poisson sweep -------------------------

REPO = Path(__file__).resolve().parents[1]
SAMPLED = {"temperature": 1.0, "top_p": 0.95, "top_k": 40, "repetition_penalty": 1.1}


@dataclass
class WorkItem:
    prompt: list[int]
    max_tokens: int
    sampled: bool  # one of the quarter that samples in the "offline sampled" row
    seed: int


def build_workload(args: argparse.Namespace, vocab_size: int) -> list[WorkItem]:
    import numpy as np

    rng = np.random.default_rng(args.seed)

    def lengths(median: int, upper: int) -> list[int]:
        raw = rng.lognormal(math.log(median), args.sigma, args.num_requests)
        return np.clip(np.rint(raw), args.min_len, upper).astype(int).tolist()

    prompts = lengths(args.prompt_median, args.max_prompt_len)
    outputs = lengths(args.output_median, args.max_output_len)
    return [WorkItem(rng.integers(0, vocab_size, p).tolist(), o, i % 4 == 0, args.seed + i)
            for i, (p, o) in enumerate(zip(prompts, outputs))]


def engine_flags(args: argparse.Namespace, tuned: bool) -> dict:
    """Engine options every row shares (and the tuned batch limits, unless `tuned` is off)."""
    flags = {"kv_cache_memory": args.kv_cache_memory, "max_model_len": args.max_model_len}
    if tuned:
        flags.update(max_num_seqs=args.max_num_seqs,
                     max_num_batched_tokens=args.max_num_batched_tokens)
    return {k: v for k, v in flags.items() if v is not None}


def offline_rows(model: str | None, flags: dict, work: list[WorkItem], modes: list[str]
                 ) -> list[tuple[str, float, int, dict]]:
    """(mode, seconds, output tokens, step counts) per mode, from one LLM; runs in a worker
    process."""
    from pagedserve.sampling_params import SamplingParams
    from pagedserve.entrypoints.llm import LLM

    llm = LLM(model, **flags)  # the engine core in its own process, as `serve` runs it
    prompts = [w.prompt for w in work]
    llm.generate(prompts[:16], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                 use_tqdm=False)  # warm-up: first-use compilation and allocations
    rows = []
    for mode in modes:
        params = [SamplingParams(max_tokens=w.max_tokens, ignore_eos=True, seed=w.seed,
                                 **SAMPLED) if mode == "sampled" and w.sampled else
                  SamplingParams(temperature=0, max_tokens=w.max_tokens, ignore_eos=True)
                  for w in work]
        before = llm.llm_engine.get_stats()
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        rows.append((mode, seconds, sum(len(c.token_ids) for o in outs for c in o.outputs),
                     step_counts(before, llm.llm_engine.get_stats())))
    return rows


def step_counts(before, after) -> dict:
    """The core's steps over a row (`EngineStats`, or /metrics samples as a dict): those that
    launched a forward pass, and those of them that replayed a decode graph (the rest ran
    eagerly: a prefill chunk beside the decodes, or the CPU)."""
    def get(stats, name: str, metric: str) -> float:
        return stats[metric] if isinstance(stats, dict) else getattr(stats, name)

    steps = get(after, "num_steps", "pagedserve_engine_steps_total") - get(
        before, "num_steps", "pagedserve_engine_steps_total")
    graphs = get(after, "num_decode_graph_steps", "pagedserve_decode_graph_steps_total") - get(
        before, "num_decode_graph_steps", "pagedserve_decode_graph_steps_total")
    return {"steps": int(steps), "decode_graph_steps": int(graphs)}


def run_offline(model: str | None, flags: dict, work: list[WorkItem], modes: list[str]
                ) -> list[tuple[str, float, int, dict]]:
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        return pool.submit(offline_rows, model, flags, work, modes).result()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(model: str | None, flags: dict) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "pagedserve.entrypoints.cli", "serve", "--port", str(port),
           "--log-level", "warning"]
    if model:
        cmd += ["--model", model]
    for key, value in flags.items():
        cmd += ["--" + key.replace("_", "-"), str(value)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env)
    url = f"http://127.0.0.1:{port}"
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} during startup")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)


def drive_procs(url: str, work: list[WorkItem], concurrency: int, rate: float, seed: int,
                procs: int) -> tuple[list[Result], float]:
    """`drive`, split over `procs` client processes. One Python process parsing every
    stream's chunks saturates its core long before the server does (httpx's pool alone
    rescans every connection per request), and then the client is what gets measured.
    For all-at-once arrivals each process takes every procs-th request and an equal share
    of the concurrency; Poisson arrivals are split at random, which leaves each process a
    Poisson process at rate / procs and their sum one at `rate`. All start at one instant."""
    procs = max(1, min(procs, len(work)))
    if procs == 1:
        return asyncio.run(drive(url, work, concurrency, rate, seed))
    rng = random.Random(seed)
    shares: list[list[WorkItem]] = [[] for _ in range(procs)]
    for i, w in enumerate(work):
        shares[i % procs if math.isinf(rate) else rng.randrange(procs)].append(w)
    start_at = time.monotonic() + 5.0  # after every process has imported and connected
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(procs, mp_context=context) as pool:
        parts = [pool.submit(_drive_share, url, share, -(-concurrency // procs), rate / procs,
                             seed + i, start_at) for i, share in enumerate(shares) if share]
        parts = [part.result() for part in parts]
    results = [Result(**r) for rows, _ in parts for r in rows]
    return results, max(end for _, end in parts) - start_at


def _drive_share(url: str, work: list[WorkItem], concurrency: int, rate: float, seed: int,
                 start_at: float) -> tuple[list[dict], float]:
    """One client process: its results as dicts (the class lives in the script's __main__)
    and the CLOCK_MONOTONIC time, shared by every process, when its last stream ended."""
    results, _ = asyncio.run(drive(url, work, concurrency, rate, seed, start_at))
    return [asdict(r) for r in results], time.monotonic()


async def drive(url: str, work: list[WorkItem], concurrency: int, rate: float,
                seed: int, start_at: float | None = None) -> tuple[list[Result], float]:
    """Every request of `work`, streaming, at most `concurrency` in flight; arrivals are a
    Poisson process at `rate` per second (inf: all at once), from `start_at` (a
    time.monotonic() value) if given."""
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        slots = asyncio.Semaphore(concurrency)

        async def one(w: WorkItem) -> Result:
            async with slots:
                return await send(http, model, w.prompt, "all", w.max_tokens)

        if start_at is not None:
            await asyncio.sleep(max(0.0, start_at - time.monotonic()))
        tasks = []
        start = time.perf_counter()
        for w in work:
            tasks.append(asyncio.create_task(one(w)))
            if math.isfinite(rate):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def served_rows(args: argparse.Namespace, work: list[WorkItem], flags: dict) -> list[dict]:
    proc, url = start_server(args.model, flags)
    try:
        asyncio.run(drive(url, work[:16], 16, math.inf, args.seed))  # warm-up
        rows = []
        for rate in [math.inf, *args.rates]:
            subset = work if math.isinf(rate) else work[:args.rate_requests]
            before = scrape(url)
            results, seconds = drive_procs(
                url, subset, args.concurrency if math.isinf(rate) else len(subset), rate,
                args.seed + 1, args.client_procs)
            done = [r for r in results if r.ok]
            tokens = sum(r.output_tokens for r in done)
            path = (f"served, {args.concurrency} streaming clients" if math.isinf(rate)
                    else f"served, Poisson {rate:g} req/s")
            rows.append({"path": path, "output_tok_per_s": tokens / seconds,
                         "seconds": seconds, "output_tokens": tokens,
                         "requests": len(subset), "failed": len(results) - len(done),
                         **step_counts(before, scrape(url)),
                         "request_rate": None if math.isinf(rate) else rate,
                         "tokens_per_chunk": tokens / max(1, sum(r.chunks for r in done)),
                         "ttft_s": percentiles([r.ttft for r in done]),
                         "tpot_s": percentiles([r.tpot for r in done]),
                         "errors": sorted({r.error for r in results if r.error})[:3]})
            print(f"{path}: {tokens / seconds:,.0f} output tok/s, "
                  f"{rows[-1]['tokens_per_chunk']:.2f} tokens per chunk", flush=True)
        return rows
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)


def device_name() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return f"CPU: {line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    return f"CPU: {platform.processor()}"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = sorted((r for r in rows if r.get("request_rate")), key=lambda r: r["request_rate"])
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, label in ((axes[0], "ttft_s", "TTFT"), (axes[1], "tpot_s", "TPOT")):
        x = [r["output_tok_per_s"] for r in sweep]
        for q, style in (("p50", "o-"), ("p99", "s--")):
            ax.plot(x, [r[key].get(q, math.nan) * 1000 for r in sweep], style,
                    label=f"{label} {q}")
        for r in sweep:
            ax.annotate(f"{r['request_rate']:g}/s", (r["output_tok_per_s"],
                        r[key].get("p50", math.nan) * 1000), fontsize=8)
        ax.set_xlabel("achieved output tokens/s")
        ax.set_ylabel(f"{label} (ms)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("pagedserve serve: Poisson arrivals (labels: request rate)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run_suite(args: argparse.Namespace) -> None:
    from pagedserve.model.loader import default_model_path, load_tokenizer

    vocab = len(load_tokenizer(args.model or default_model_path()))
    work = build_workload(args, vocab)
    tuned = engine_flags(args, tuned=True)
    print(f"{len(work)} requests, {sum(len(w.prompt) for w in work):,} prompt tokens, "
          f"{sum(w.max_tokens for w in work):,} output tokens; flags {tuned}", flush=True)
    measured = [(f"offline {mode}", seconds, tokens, steps) for mode, seconds, tokens, steps
                in run_offline(args.model, tuned, work, ["greedy", "sampled"])]
    rows = [{"path": p, "output_tok_per_s": t / s, "seconds": s, "output_tokens": t,
             "requests": len(work), **steps} for p, s, t, steps in measured]
    rows += served_rows(args, work, tuned)
    (_, seconds, tokens, steps), = run_offline(args.model, engine_flags(args, tuned=False),
                                               work, ["greedy"])
    rows.append({"path": "offline greedy, default flags", "output_tok_per_s": tokens / seconds,
                 "seconds": seconds, "output_tokens": tokens, "requests": len(work), **steps})
    common = {"device": device_name(),
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "model": args.model or "default (SmolLM2-135M-Instruct)",
              "client_procs": args.client_procs,
              "workload": {k: getattr(args, k) for k in (
                  "num_requests", "prompt_median", "output_median", "sigma", "min_len",
                  "max_prompt_len", "max_output_len", "seed")}}
    for row in rows:
        row.update(common, flags=tuned if "default" not in row["path"] else {})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "serving.json").write_text(json.dumps(rows, indent=1) + "\n")
    plot(rows, out / "serving_latency.png")
    base = rows[0]["output_tok_per_s"]
    for row in rows:
        print(f"{row['path']:<40}{row['output_tok_per_s']:>12,.0f} tok/s"
              f"{row['output_tok_per_s'] / base:>8.2f}x  {row['seconds']:>8.1f} s"
              f"  steps {row['steps']:,} (decode graphs {row['decode_graph_steps']:,})")
    print(f"wrote {out / 'serving.json'} and {out / 'serving_latency.png'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", default=None, help="client mode: a running server")
    parser.add_argument("--model", default=None, help="suite: HF folder or .gguf to serve "
                        "(default: the embedded SmolLM2); client: the name to request "
                        "(default: the server's first model)")
    parser.add_argument("--num-requests", type=int, default=None,
                        help="default: 1000 (suite), 32 (client)")
    parser.add_argument("--seed", type=int, default=0)
    suite = parser.add_argument_group("suite")
    suite.add_argument("--prompt-median", type=int, default=200)
    suite.add_argument("--output-median", type=int, default=150)
    suite.add_argument("--sigma", type=float, default=0.8, help="of log(length)")
    suite.add_argument("--min-len", type=int, default=4)
    suite.add_argument("--max-prompt-len", type=int, default=1024)
    suite.add_argument("--max-output-len", type=int, default=1024)
    suite.add_argument("--concurrency", type=int, default=256, help="streaming clients")
    suite.add_argument("--client-procs", type=int,
                       default=min(8, max(1, (os.cpu_count() or 2) // 2)),
                       help="processes the streaming clients are spread over "
                       "(default: half the cores, at most 8)")
    suite.add_argument("--rates", type=float, nargs="*", default=[8, 16, 32, 64],
                       help="Poisson request rates (req/s) of the latency sweep")
    suite.add_argument("--rate-requests", type=int, default=500,
                       help="requests per sweep rate (the workload's first ones)")
    suite.add_argument("--max-num-seqs", type=int, default=256)
    suite.add_argument("--max-num-batched-tokens", type=int, default=16384)
    suite.add_argument("--kv-cache-memory", type=int, default=None, help="bytes")
    suite.add_argument("--max-model-len", type=int, default=None)
    suite.add_argument("--out", default=str(REPO / "docs" / "results"))
    client = parser.add_argument_group("client")
    client.add_argument("--request-rate", type=float, default=math.inf,
                        help="Poisson arrivals per second; inf = all at once")
    client.add_argument("--max-concurrency", type=int, default=0,
                        help="at most this many requests in flight (0 = no limit)")
    client.add_argument("--prompt-words", type=int, default=48)
    client.add_argument("--prefix-words", type=int, default=0,
                        help="shared-vs-unique system prompt of this many words")
    client.add_argument("--max-tokens", type=int, default=32)
    client.add_argument("--slo-ttft", type=float, default=2.0, help="seconds")
    client.add_argument("--slo-tpot", type=float, default=0.25, help="seconds")
    client.add_argument("--json-out", default=None)
    args = parser.parse_args()
    if args.base_url is None:
        args.num_requests = args.num_requests or 1000
        run_suite(args)
        return
    args.num_requests = args.num_requests or 32

    before = scrape(args.base_url)
    results, duration = asyncio.run(run(args))
    after = scrape(args.base_url)
    summary = summarize(results, duration, args)
    summary["server_prefix_cache"] = {
        k: after.get(f"pagedserve_prefix_cache_{k}_total", 0.0)
        - before.get(f"pagedserve_prefix_cache_{k}_total", 0.0) for k in ("queries", "hits")}
    summary["args"] = {k: v for k, v in vars(args).items() if k != "json_out"}
    print_summary(summary)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"summary": summary, "requests": [asdict(r) for r in results]}, f,
                      indent=1, default=str)


if __name__ == "__main__":
    main()
