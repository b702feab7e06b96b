"""Replicas on Ray Serve: 2 against 1, prefix-aware routing against round-robin, same run.

    PYTHONPATH=. python benchmarks/ray_serve.py --out docs/results [--requests 96]
                                                [--concurrency 4] [--kv-cache-memory 53M]

A prefix-heavy chat workload: many users, each request one of 8 shared system prompts
(several KV blocks each) followed by its user's own question, in a seeded random order,
`--concurrency` requests in flight. Three deployments in turn on one local Ray cluster
(`pagedserve.entrypoints.ray_serve.build_app`, the default model): 1 replica; 2 replicas
with prefix-aware routing; 2 replicas round-robin. Each replica's KV cache is made too small
for all 8 system prompts (`--kv-cache-memory`), so where a prompt lands decides whether its
prefix is still cached: one replica, or two that each see every prompt, evict; two that
split the prompts between them keep theirs.

Per deployment: requests/s and output tokens/s over the whole run (the first request of
each prompt included), the prefix-cache hit rate as the replicas report it (cached prompt
tokens / prompt tokens, from each answer's usage), how the requests spread over replicas,
and the machine's load average before and after. Writes DIR/ray_serve.json.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import platform
import random
import socket
import subprocess
import time
from pathlib import Path

import openai
import ray
from ray import serve

from pagedserve.entrypoints.ray_serve import REPLICA_HEADER, build_app

TOPICS = ["astronomy", "cooking", "tax law", "gardening", "chess", "medieval history",
          "plumbing", "jazz"]


def system_prompt(topic: str) -> str:
    return (f"You are a patient expert on {topic}. " +
            f"Answer questions about {topic} briefly, accurately and in plain words; say so "
            "when you are unsure, never invent sources, and keep each answer short. " * 6)


def workload(num_requests: int, seed: int) -> list[list[dict]]:
    rng = random.Random(seed)
    return [[{"role": "system", "content": system_prompt(rng.choice(TOPICS))},
             {"role": "user", "content": f"User {i} asks: what should a beginner learn first, "
                                         f"and why? (question {rng.randrange(10 ** 6)})"}]
            for i in range(num_requests)]


async def drive(url: str, conversations: list[list[dict]], concurrency: int,
                max_tokens: int) -> dict:
    client = openai.AsyncOpenAI(base_url=url, api_key="none", timeout=600, max_retries=0)
    model = (await client.models.list()).data[0].id
    gate = asyncio.Semaphore(concurrency)
    totals = collections.Counter()
    replicas = collections.Counter()

    async def one(messages: list[dict]) -> None:
        async with gate:
            raw = await client.chat.completions.with_raw_response.create(
                model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                extra_body={"ignore_eos": True})
            answer = raw.parse()
            details = answer.usage.prompt_tokens_details
            totals["prompt"] += answer.usage.prompt_tokens
            totals["cached"] += details.cached_tokens if details else 0
            totals["output"] += answer.usage.completion_tokens
            replicas[raw.headers[REPLICA_HEADER]] += 1

    start = time.perf_counter()
    await asyncio.gather(*(one(m) for m in conversations))
    seconds = time.perf_counter() - start
    await client.close()
    return {"seconds": round(seconds, 2),
            "requests_per_s": round(len(conversations) / seconds, 3),
            "output_tokens_per_s": round(totals["output"] / seconds, 2),
            "prefix_cache_hit_rate": round(totals["cached"] / totals["prompt"], 4),
            "prompt_tokens": totals["prompt"], "cached_prompt_tokens": totals["cached"],
            "requests_per_replica": sorted(replicas.values(), reverse=True)}


def run_one(name: str, replicas: int, routing: str, args, url: str,
            conversations: list[list[dict]]) -> dict:
    server_args = ["--max-model-len", "1024", "--max-num-seqs", str(args.concurrency),
                   "--kv-cache-memory", args.kv_cache_memory,
                   "--prefix-caching-hash-seed", "bench"]
    serve.run(build_app(server_args, num_replicas=replicas, routing=routing,
                        replica_cpus=0.5, max_ongoing_requests=args.concurrency),
              name="pagedserve", route_prefix="/")
    load_before = os.getloadavg()
    result = asyncio.run(drive(url, conversations, args.concurrency, args.max_tokens))
    result.update(name=name, replicas=replicas, routing=routing,
                  load_before=[round(x, 2) for x in load_before],
                  load_after=[round(x, 2) for x in os.getloadavg()])
    serve.delete("pagedserve")
    print(json.dumps(result), flush=True)
    return result


def cpu_name() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--kv-cache-memory", default="53M",
                        help="per replica; the default, about 75 blocks of 16 tokens, holds 5 "
                        "or 6 of the 8 system prompts (12 blocks each) besides the requests "
                        "in flight")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    url = f"http://127.0.0.1:{port}/v1"
    conversations = workload(args.requests, args.seed)
    try:
        runs = [run_one("1 replica", 1, "prefix", args, url, conversations),
                run_one("2 replicas, prefix-aware", 2, "prefix", args, url, conversations),
                run_one("2 replicas, round-robin", 2, "round_robin", args, url,
                        conversations)]
    finally:
        serve.shutdown()
        ray.shutdown()
    report = {"benchmark": "ray_serve", "cpu": cpu_name(), "cores": os.cpu_count(),
              "model": "SmolLM2-135M-Instruct (default GGUF)", "requests": args.requests,
              "concurrency": args.concurrency, "max_tokens": args.max_tokens,
              "system_prompts": len(TOPICS), "kv_cache_memory_per_replica":
              args.kv_cache_memory, "runs": runs}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ray_serve.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
