"""Online serving benchmark: streaming requests to a running pagedserve server.

Requests arrive as a Poisson process at `--request-rate` per second (`inf`: all at once;
`--max-concurrency` caps how many are in flight) and stream from `/v1/completions` with
`ignore_eos`, so every request produces exactly `--max-tokens` tokens. Per request we time, on the client:
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
    python benchmarks/serving.py --num-requests 32 --request-rate 2 --max-tokens 32
    python benchmarks/serving.py --num-requests 16 --max-concurrency 1 --prefix-words 600
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import time
import uuid
from dataclasses import asdict, dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

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


async def send(http: httpx.AsyncClient, model: str, prompt: str, group: str,
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
                if chunk.get("usage"):
                    usage = chunk["usage"]
                    result.output_tokens = usage["completion_tokens"]
                    result.prompt_tokens = usage["prompt_tokens"]
                    details = usage.get("prompt_tokens_details") or {}
                    result.cached_tokens = details.get("cached_tokens") or 0
                if not chunk.get("choices") or not chunk["choices"][0].get("text"):
                    continue
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="default: the server's first model")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="Poisson arrivals per second; inf = all at once")
    parser.add_argument("--max-concurrency", type=int, default=0,
                        help="at most this many requests in flight (0 = no limit)")
    parser.add_argument("--prompt-words", type=int, default=48)
    parser.add_argument("--prefix-words", type=int, default=0,
                        help="shared-vs-unique system prompt of this many words")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--slo-ttft", type=float, default=2.0, help="seconds")
    parser.add_argument("--slo-tpot", type=float, default=0.25, help="seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()

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
