"""Multi-turn conversations against a KV pool too small for their working set: the prefix
cache's host tier (--kv-offload-memory) on vs off (issue 34).

Workload: `--conversations` conversations of `--turns` turns; each group of `--group`
conversations shares a system prompt of `--system-tokens` random tokens; every turn sends the
whole history (system prompt, earlier user messages and answers) plus a new user message of
`--user-tokens` tokens and asks for `--answer-tokens` greedy tokens (ignore_eos). Between
turns each user thinks for a time uniform in [--think-min, --think-max] seconds, multiplied
by `--time-scale` (time compressed: the engine runs in real time, only the users wait less).
The same seeded workload runs once per engine, one engine after the other in this process,
each with the device KV pool of `--kv-cache-memory`, one without and one with the host tier.

Per run: TTFT p50/p99 (from a turn's arrival to its first token, as the engine loop sees
them), output tokens per second over the run, the device prefix-cache hit rate (tokens), the
blocks recalled from the host tier, and the cached blocks the device pool evicted.

    python benchmarks/multiturn.py --config benchmarks/configs/qwen3-0.6b.json \
        --kv-cache-memory 1G --kv-offload-memory 16G --out docs/results/kv_offload.json
    # a quick check on the CPU:
    python benchmarks/multiturn.py --config benchmarks/configs/tiny-qwen3.json --device cpu \
        --conversations 8 --turns 3 --group 4 --system-tokens 256 --user-tokens 32 \
        --answer-tokens 16 --kv-cache-memory 6M --kv-offload-memory 64M --time-scale 0.002
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

# this folder holds kernels.py, which would shadow the `kernels` package transformers probes for
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch  # noqa: E402

from pagedserve import SamplingParams  # noqa: E402
from pagedserve.config import EngineConfig  # noqa: E402
from pagedserve.entrypoints.engine_args import parse_size  # noqa: E402
from pagedserve.frontend.llm_engine import LLMEngine, LoadedModel  # noqa: E402


@dataclass
class Conversation:
    system: list[int]
    user_messages: list[list[int]]
    think_s: list[float]
    history: list[int] = field(default_factory=list)  # system prompt + turns so far
    turn: int = 0
    next_arrival: float = 0.0
    in_flight: bool = False


def make_workload(args: argparse.Namespace, vocab: int) -> list[Conversation]:
    rng = random.Random(args.seed)
    systems = [[rng.randrange(vocab) for _ in range(args.system_tokens)]
               for _ in range(-(-args.conversations // args.group))]
    conversations = []
    for i in range(args.conversations):
        users = [[rng.randrange(vocab) for _ in range(args.user_tokens)]
                 for _ in range(args.turns)]
        think = [rng.uniform(args.think_min, args.think_max) * args.time_scale
                 for _ in range(args.turns)]
        conversations.append(Conversation(systems[i // args.group], users, think,
                                          list(systems[i // args.group]),
                                          next_arrival=rng.uniform(0, think[0])))
    return conversations


def run(engine: LLMEngine, conversations: list[Conversation], answer_tokens: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=answer_tokens, ignore_eos=True)
    before = engine.get_stats()
    arrival: dict[str, float] = {}
    ttfts: list[float] = []
    owner: dict[str, Conversation] = {}
    num_output = 0
    start = time.perf_counter()
    remaining = len(conversations)
    while remaining:
        now = time.perf_counter() - start
        for conv in conversations:
            if not conv.in_flight and conv.turn < len(conv.user_messages) \
                    and conv.next_arrival <= now:
                request_id = f"{id(conv)}-{conv.turn}"
                prompt = conv.history + conv.user_messages[conv.turn]
                engine.add_request(request_id, None, params, prompt_token_ids=prompt)
                arrival[request_id], owner[request_id] = now, conv
                conv.in_flight = True
        if not engine.has_unfinished_requests():
            time.sleep(0.001)
            continue
        for output in engine.step():
            t = time.perf_counter() - start
            request_id = output.request_id
            if request_id in arrival and output.outputs[0].token_ids:
                ttfts.append(t - arrival.pop(request_id))
            if output.finished:
                conv = owner.pop(request_id)
                tokens = list(output.outputs[0].token_ids)
                num_output += len(tokens)
                conv.history += conv.user_messages[conv.turn] + tokens
                conv.next_arrival = t + conv.think_s[conv.turn]
                conv.turn += 1
                conv.in_flight = False
                remaining -= conv.turn == len(conv.user_messages)
    wall = time.perf_counter() - start
    stats = engine.get_stats()
    queries = stats.prefix_cache_queries - before.prefix_cache_queries
    hits = stats.prefix_cache_hits - before.prefix_cache_hits
    ttfts.sort()
    return {
        "turns_measured": len(ttfts), "wall_s": round(wall, 3),
        "ttft_p50_s": round(statistics.median(ttfts), 4),
        "ttft_p99_s": round(ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], 4),
        "output_tok_per_s": round(num_output / wall, 2),
        "device_prefix_hit_rate": round(hits / queries, 4) if queries else 0.0,
        "host_tier_hit_blocks": stats.host_tier_hits - before.host_tier_hits,
        "host_tier_stored_blocks": stats.host_tier_stores - before.host_tier_stores,
        "device_evictions": stats.prefix_cache_evictions - before.prefix_cache_evictions,
    }


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def random_checkpoint(config: Path, device: str) -> str:
    spec = importlib.util.spec_from_file_location(
        "make_checkpoint", Path(__file__).with_name("make_checkpoint.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model_dir = tempfile.mkdtemp(prefix="pagedserve-ckpt-")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    module.make_checkpoint(config, Path(model_dir), dtype, 0, "bytes")
    return model_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="HF folder; default: a random checkpoint from --config")
    parser.add_argument("--config", default="benchmarks/configs/qwen3-0.6b.json")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--group", type=int, default=8, help="conversations per system prompt")
    parser.add_argument("--system-tokens", type=int, default=2000)
    parser.add_argument("--user-tokens", type=int, default=100)
    parser.add_argument("--answer-tokens", type=int, default=200)
    parser.add_argument("--think-min", type=float, default=5.0)
    parser.add_argument("--think-max", type=float, default=30.0)
    parser.add_argument("--time-scale", type=float, default=0.1,
                        help="users' think times are multiplied by this")
    parser.add_argument("--kv-cache-memory", type=parse_size, required=True,
                        help="the device pool: smaller than the working set")
    parser.add_argument("--kv-offload-memory", type=parse_size, required=True,
                        help="the host tier of the run with it on")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="append the rows (JSON list) to this file")
    args = parser.parse_args()

    model_dir = args.model or random_checkpoint(Path(args.config), args.device)
    base = EngineConfig(model=model_dir, device=args.device)
    loaded = LoadedModel.load(base)
    rows = []
    for offload in (0, args.kv_offload_memory):
        engine = LLMEngine(EngineConfig(
            model=model_dir, device=args.device, kv_cache_memory=args.kv_cache_memory,
            kv_offload_memory=offload, max_model_len=args.max_model_len), loaded)
        conversations = make_workload(args, engine.model_config.vocab_size)
        row = {"config": Path(args.config).stem if not args.model else args.model,
               "device": device_name(args.device), "device_blocks": engine.num_blocks,
               "kv_offload_memory": offload, "conversations": args.conversations,
               "turns": args.turns, "system_tokens": args.system_tokens,
               "answer_tokens": args.answer_tokens, "time_scale": args.time_scale,
               **run(engine, conversations, args.answer_tokens)}
        print(json.dumps(row), flush=True)
        rows.append(row)
        engine.shutdown()
        del engine
    if args.out:
        old = json.loads(args.out.read_text()) if args.out.exists() else []
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(old + rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
