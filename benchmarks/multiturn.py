"""Multi-turn conversations against a KV pool too small for their working set: the prefix
cache's tiers (host memory --kv-offload-memory, disk --kv-offload-path) on vs off (issue 34).

Workload: `--conversations` conversations of `--turns` turns; each group of `--group`
conversations shares a system prompt of `--system-tokens` random tokens; every turn sends the
whole history (system prompt, earlier user messages and answers) plus a new user message of
`--user-tokens` tokens and asks for `--answer-tokens` greedy tokens (ignore_eos). Between
turns each user thinks for a time uniform in [--think-min, --think-max] seconds, multiplied
by `--time-scale` (time compressed: the engine runs in real time, only the users wait less).
The same seeded workload runs once per engine, one engine after the other in this process,
each with the device KV pool of `--kv-cache-memory`, or of `--kv-cache-share` of the working
set (the blocks every conversation's whole history needs, its system prompt shared: each row
gives it, `working_set_blocks`, and the pool's and the host tier's share of it): `--tiers`
names the runs (a name may repeat: each tier's run is compared with the last "off" before it,
so off,host,off,host shows the run-to-run spread of this real-time workload), "off" (no
tier), "host" (a host tier of --kv-offload-memory) and "disk" (a disk tier in a fresh
temporary directory under --kv-offload-path, over a host tier of only --disk-host-memory, so
the working set lives on disk). The CPU engine has no host tier of its own (its pool is RAM):
there "host" is refused, "disk" runs.

Per run: TTFT p50/p99 (from the time a turn was due, its user's send time, to its first
token as the engine's output reaches this loop; a turn that falls due while a step runs
waits for that step, as a server's request would, so its TTFT counts that wait: until
2026-11-28 the rows counted from the loop's hand-over after the step instead, which left out
more of the wait where steps are long, i.e. without the tier; that measure is kept as
`ttft_noticed_p50_s`/`_p99_s`), output tokens per second over the run, the prefix-hit rate
per tier (of the prompt tokens, each prompt counted once, as first admitted: those the
device pool held, those recalled from host memory, those read from disk), the blocks each
tier stored and the device pool evicted, the runner's seconds queuing tier copies and in
file I/O; and where the steps go (their count and mean wall time, the scheduler's host time
per step, the runner's host time queuing tier copies per step, the copy stream's time from
CUDA events, the blocks offloaded, recalled and dropped, the requests passed over while
their recall landed). With --workload-a N, the first N requests of workload A
(benchmarks/throughput.py: nothing recalled, the pool large) with the tier off and on: the
cost of the tier's bookkeeping when it does not help. Last, one row per tier and one for
workload A compare the run with the tier to the run without it (`comparisons`). Each row
(with the seconds its engine took to start: the host tier's pinned memory is allocated
there, outside the timed run) is written to --out as soon as it is measured, so a call cut
short keeps the rows it finished.

    # the lent H100, one device call each (docs/benchmarks.md, "Prefix cache tiers"):
    python benchmarks/multiturn.py --config benchmarks/configs/qwen3-0.6b.json \
        --kv-cache-memory 1G --kv-offload-memory 24G --tiers off,host \
        --out docs/results/kv_offload.json
    python benchmarks/multiturn.py --config benchmarks/configs/qwen3-0.6b.json \
        --kv-offload-memory 24G --tiers "" --workload-a 256 --kv-cache-memory 1G \
        --out docs/results/kv_offload.json
    python benchmarks/multiturn.py --config benchmarks/configs/llama3-8b.json \
        --kv-cache-share 0.5 --kv-offload-memory 24G --time-scale 0.3 --tiers off,host \
        --out docs/results/kv_offload.json
    # a quick check on the CPU:
    python benchmarks/multiturn.py --config benchmarks/configs/tiny-qwen3.json --device cpu \
        --conversations 8 --turns 3 --group 4 --system-tokens 256 --user-tokens 32 \
        --answer-tokens 16 --kv-cache-memory 6M --disk-host-memory 1M --time-scale 0.002
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
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
from pagedserve.attention.kv_quant import cache_dtype  # noqa: E402
from pagedserve.config import EngineConfig  # noqa: E402
from pagedserve.device.loading import resolve_dtype  # noqa: E402
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


def working_set_blocks(args: argparse.Namespace, block_size: int) -> int:
    """The KV blocks a pool needs to hold every conversation's whole history at its end
    (system prompt, every user message and answer), so that no turn recomputes a prefix:
    each group's system prompt once, each conversation's own blocks past it. Full blocks
    only (the partial last one of a running request comes and goes)."""
    history = args.system_tokens + args.turns * (args.user_tokens + args.answer_tokens)
    shared = args.system_tokens // block_size
    groups = -(-args.conversations // args.group)
    return groups * shared + args.conversations * (history // block_size - shared)


def pool_bytes(args: argparse.Namespace, loaded: LoadedModel, block_size: int) -> int:
    """--kv-cache-memory, or --kv-cache-share of the working set in bytes: blocks of every
    layer's K and V in the cache's dtype (`kv_quant.cache_dtype`, as the engine picks it)."""
    if args.kv_cache_share is None:
        return args.kv_cache_memory
    mc = loaded.model_config
    model_dtype = resolve_dtype("auto", torch.device(args.device))
    element = cache_dtype(args.kv_cache_dtype, model_dtype).itemsize
    block_bytes = 2 * mc.num_layers * block_size * mc.num_kv_heads * mc.head_dim * element
    usable = round(args.kv_cache_share * working_set_blocks(args, block_size))
    longest = -(-(args.system_tokens + args.turns * (args.user_tokens + args.answer_tokens))
                // block_size)  # a conversation's last turn, its answer included
    if usable < longest:
        raise SystemExit(f"--kv-cache-share {args.kv_cache_share}: {usable} blocks cannot hold "
                         f"a conversation's last turn ({longest} blocks)")
    return (usable + 1) * block_bytes  # + 1: block 0 is the null block, never handed out


def p99(ordered: list[float]) -> float:
    """The 99th percentile of sorted values (the nearest rank below)."""
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def run(engine: LLMEngine, conversations: list[Conversation], answer_tokens: int,
        block_size: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=answer_tokens, ignore_eos=True)
    before = engine.get_stats()
    arrival: dict[str, float] = {}  # when the turn was due: the user's send time
    noticed: dict[str, float] = {}  # when this loop, between steps, handed it to the engine
    ttfts: list[float] = []
    ttfts_noticed: list[float] = []
    owner: dict[str, Conversation] = {}
    num_output, steps, step_s = 0, 0, 0.0
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
                arrival[request_id], owner[request_id] = conv.next_arrival, conv
                noticed[request_id] = now
                conv.in_flight = True
        if not engine.has_unfinished_requests():
            time.sleep(0.001)
            continue
        step_start = time.perf_counter()
        outputs = engine.step()
        step_s += time.perf_counter() - step_start
        steps += 1
        for output in outputs:
            t = time.perf_counter() - start
            request_id = output.request_id
            if request_id in arrival and output.outputs[0].token_ids:
                ttfts.append(t - arrival.pop(request_id))
                ttfts_noticed.append(t - noticed.pop(request_id))
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

    def delta(name: str):
        return getattr(stats, name) - getattr(before, name)

    def rate(blocks: int) -> float:
        return round(blocks * block_size / queries, 4) if queries else 0.0

    # a block read from disk is then recalled through the host tier: counted once, on disk
    host_hits = delta("host_tier_hits") - delta("disk_tier_hits")
    ttfts.sort()
    ttfts_noticed.sort()
    return {
        "turns_measured": len(ttfts), "wall_s": round(wall, 3),
        "ttft_from": "due",
        "ttft_p50_s": round(statistics.median(ttfts), 4),
        "ttft_p99_s": round(p99(ttfts), 4),
        # the measure of the rows before 2026-11-28 (from the loop's hand-over)
        "ttft_noticed_p50_s": round(statistics.median(ttfts_noticed), 4),
        "ttft_noticed_p99_s": round(p99(ttfts_noticed), 4),
        "output_tok_per_s": round(num_output / wall, 2),
        "device_prefix_hit_rate": round(hits / queries, 4) if queries else 0.0,
        "host_tier_hit_rate": rate(host_hits),
        "disk_tier_hit_rate": rate(delta("disk_tier_hits")),
        "host_tier_hit_blocks": host_hits,
        "disk_tier_hit_blocks": delta("disk_tier_hits"),
        "host_tier_stored_blocks": delta("host_tier_stores"),
        "disk_tier_stored_blocks": delta("disk_tier_stores"),
        "disk_tier_load_failures": delta("disk_tier_load_failures"),
        "device_evictions": delta("prefix_cache_evictions"),
        "tier_copy_s": round(delta("tier_copy_seconds"), 3),
        **step_costs(steps, step_s, delta),
    }


def step_costs(steps: int, step_s: float, delta) -> dict:
    """Where a run's steps go, to tell a slow tier's cause from one row: the steps and
    their mean wall time, the scheduler's host time per step, the runner's host time
    queuing tier copies per step, the copy stream's own time (CUDA events), and the
    tier's block traffic (offloaded, recalled, dropped), the steps that offloaded (with
    nothing recalled, the runner's tier time is theirs alone) and recall pass-overs."""
    def per_step_ms(seconds: float) -> float:
        return round(1e3 * seconds / steps, 4) if steps else 0.0

    return {"steps": steps, "step_ms_mean": per_step_ms(step_s),
            "schedule_ms_per_step": per_step_ms(delta("schedule_seconds")),
            "tier_copy_ms_per_step": per_step_ms(delta("tier_copy_seconds")),
            "tier_stream_s": round(delta("tier_stream_seconds"), 3),
            "host_tier_offloaded_blocks": delta("host_tier_stores"),
            "host_tier_offload_steps": delta("tier_offload_steps"),
            "host_tier_recalled_blocks": delta("host_tier_hits"),
            "host_tier_dropped_blocks": delta("host_tier_evictions"),
            "host_tier_declined_blocks": delta("host_tier_declined"),
            "recall_pass_overs": delta("tier_recall_pass_overs")}


def tier_options(tier: str, args: argparse.Namespace) -> dict:
    """The engine options of a run: no tier, the host tier, or the disk tier (a fresh
    directory, a fixed hash seed as a restart would need, a small host tier above it)."""
    if tier == "off":
        return {}
    if tier == "host":
        return {"kv_offload_memory": args.kv_offload_memory}
    path = tempfile.mkdtemp(prefix="pagedserve-kv-", dir=args.kv_offload_path)
    return {"kv_offload_path": path, "kv_offload_memory": args.disk_host_memory,
            "kv_offload_disk": args.kv_offload_disk, "prefix_caching_hash_seed": "bench"}


def workload_a(engine: LLMEngine, count: int) -> dict:
    """The first `count` requests of workload A, timed (nothing recalled: no pool pressure)."""
    spec = importlib.util.spec_from_file_location(
        "bench_throughput", Path(__file__).with_name("throughput.py"))
    throughput = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(throughput)
    prompts, out_lens = throughput.workload_prompts(vocab=engine.model_config.vocab_size)
    prompts, out_lens = prompts[:count], out_lens[:count]
    params = [SamplingParams(temperature=throughput.TEMPERATURE, max_tokens=n, ignore_eos=True)
              for n in out_lens]
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"a{i}", None, p, prompt_token_ids=prompt)
    before = engine.get_stats()
    start, tokens, steps, step_s = time.perf_counter(), 0, 0, 0.0
    while engine.has_unfinished_requests():
        step_start = time.perf_counter()
        outputs = engine.step()
        step_s += time.perf_counter() - step_start
        steps += 1
        for output in outputs:
            if output.finished:
                tokens += len(output.outputs[0].token_ids)
    seconds = time.perf_counter() - start
    stats = engine.get_stats()
    return {"workload": "A", "requests": count, "seconds": round(seconds, 3),
            "output_tok_per_s": round(tokens / seconds, 1),
            **step_costs(steps, step_s,
                         lambda name: getattr(stats, name) - getattr(before, name))}


def comparisons(rows: list[dict]) -> list[dict]:
    """Each tier's run against the last run without it before it, as the issue states its
    targets (TTFT p50 at least 2x better with the tier; workload A with the tier on at least
    0.98x the throughput without): ratios above 1 favour the tier."""
    def ratio(a: float, b: float) -> float | None:
        return round(a / b, 3) if b else None

    a_runs = {row["tier"]: row for row in rows if row.get("workload") == "A"}
    out = []
    off = None  # repeated runs (--tiers off,host,off,host) show the run-to-run spread
    for row in rows:
        if "ttft_p50_s" not in row:
            continue
        tier = row["tier"]
        if tier == "off":
            off = row
            continue
        if off is None:
            continue
        out.append({"config": row["config"], "device": row["device"],
                    "compare": f"{tier} vs off",
                    "ttft_p50_speedup": ratio(off["ttft_p50_s"], row["ttft_p50_s"]),
                    "ttft_p99_speedup": ratio(off["ttft_p99_s"], row["ttft_p99_s"]),
                    "ttft_noticed_p50_speedup": ratio(off["ttft_noticed_p50_s"],
                                                      row["ttft_noticed_p50_s"]),
                    "throughput_ratio": ratio(row["output_tok_per_s"],
                                              off["output_tok_per_s"])})
    if len(a_runs) == 2:
        (_, a_off), (on, a_on) = sorted(a_runs.items(), key=lambda item: item[0] != "off")
        out.append({"config": a_on["config"], "device": a_on["device"],
                    "compare": f"workload A, {on} vs off",
                    "throughput_ratio": ratio(a_on["output_tok_per_s"],
                                              a_off["output_tok_per_s"])})
    return out


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def random_checkpoint(config: Path, device: str) -> tuple[str, str]:
    """A model of `config`'s shape and its load format: on CUDA a folder of the config and
    a byte-level tokenizer, its weights drawn on the GPU (`load_format` dummy: writing and
    reading an 8B model's random safetensors would take minutes); on the CPU a random
    checkpoint."""
    spec = importlib.util.spec_from_file_location(
        "make_checkpoint", Path(__file__).with_name("make_checkpoint.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model_dir = Path(tempfile.mkdtemp(prefix="pagedserve-ckpt-"))
    if device == "cuda":
        (model_dir / "config.json").write_text(config.read_text())
        module.byte_level_tokenizer().save_pretrained(model_dir)
        return str(model_dir), "dummy"
    module.make_checkpoint(config, model_dir, torch.float32, 0, "bytes")
    return str(model_dir), "auto"


class RecallRuleLog(logging.Handler):
    """The host tier's recall rule as the engine logs it at start-up (its measured inputs
    and what it decided), for the row of the run it governs."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.message: str | None = None
        logger = logging.getLogger("pagedserve.engine.recall_rule")
        logger.setLevel(logging.INFO)
        logger.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.message = record.getMessage()

    def take(self) -> str | None:
        message, self.message = self.message, None
        return message


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
    pool = parser.add_mutually_exclusive_group(required=True)
    pool.add_argument("--kv-cache-memory", type=parse_size,
                      help="the device pool: smaller than the working set")
    pool.add_argument("--kv-cache-share", type=float,
                      help="the device pool as a share of the working set (0.5: half of "
                      "the blocks every conversation's whole history needs)")
    parser.add_argument("--kv-offload-memory", type=parse_size, default=16 << 30,
                        help="the host tier of the \"host\" run")
    parser.add_argument("--tiers", default=None,
                        help="comma-separated runs: off, host, disk (default: off,host,disk on "
                        "CUDA; off,disk on the CPU; \"\" for workload A alone)")
    parser.add_argument("--kv-offload-path", default=None,
                        help="where the \"disk\" run's directory is made (default: the temp dir)")
    parser.add_argument("--kv-offload-disk", type=parse_size, default=16 << 30)
    parser.add_argument("--disk-host-memory", type=parse_size, default=256 << 20,
                        help="the host tier above the disk in the \"disk\" run")
    parser.add_argument("--workload-a", type=int, default=0,
                        help="also run this many requests of workload A, tier off and on")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"),
                        help="the KV cache's dtype in every run (fp8 halves a recall's bytes)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="append the rows (JSON list) to this file, "
                        "each as soon as it is measured")
    args = parser.parse_args()
    tiers = [t for t in (("off,host,disk" if args.device == "cuda" else "off,disk")
                         if args.tiers is None else args.tiers).split(",") if t]
    unknown = set(tiers) - {"off", "host", "disk"}
    if unknown:
        parser.error(f"--tiers: unknown run(s) {sorted(unknown)}; choose from off, host, disk")
    model_dir, load_format = ((args.model, "auto") if args.model
                              else random_checkpoint(Path(args.config), args.device))
    base = EngineConfig(model=model_dir, device=args.device, load_format=load_format)
    loaded = LoadedModel.load(base)
    rows: list[dict] = []
    old = json.loads(args.out.read_text()) if args.out and args.out.exists() else []

    def keep(row: dict) -> None:
        """Print the row and write it to --out at once: a run cut short keeps its rows."""
        print(json.dumps(row), flush=True)
        rows.append(row)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(old + rows, indent=1) + "\n")

    rules = RecallRuleLog()
    working_set = working_set_blocks(args, base.block_size)
    kv_cache_memory = pool_bytes(args, loaded, base.block_size)
    print(json.dumps({"working_set_blocks": working_set, "kv_cache_memory": kv_cache_memory}),
          flush=True)  # before the first run: a call cut short still shows the pool asked for
    for tier in tiers:
        options = tier_options(tier, args)
        started = time.perf_counter()
        engine = LLMEngine(EngineConfig(
            model=model_dir, device=args.device, kv_cache_memory=kv_cache_memory,
            max_model_len=args.max_model_len, kv_cache_dtype=args.kv_cache_dtype, **options),
            loaded)
        started = round(time.perf_counter() - started, 1)
        conversations = make_workload(args, engine.model_config.vocab_size)
        row = {"config": Path(args.config).stem if not args.model else args.model,
               "device": device_name(args.device), "device_blocks": engine.num_blocks,
               "kv_cache_memory": kv_cache_memory, "working_set_blocks": working_set,
               # the blocks a request can hold (not the null block) over the working set
               "pool_share_of_working_set": round((engine.num_blocks - 1) / working_set, 3),
               "host_share_of_working_set": round(options.get("kv_offload_memory", 0)
                                                  // engine.get_stats().kv_block_bytes
                                                  / working_set, 3),
               "tier": tier, "kv_offload_memory": options.get("kv_offload_memory", 0),
               "kv_cache_dtype": args.kv_cache_dtype,
               "conversations": args.conversations, "turns": args.turns,
               "system_tokens": args.system_tokens, "answer_tokens": args.answer_tokens,
               "time_scale": args.time_scale, "engine_start_s": started,
               "recall_rule": rules.take(),
               **run(engine, conversations, args.answer_tokens, base.block_size)}
        keep(row)
        engine.shutdown()
        del engine
    on = "host" if args.device == "cuda" else "disk"
    for tier in ("off", on) if args.workload_a else ():
        options = tier_options(tier, args)
        started = time.perf_counter()
        engine = LLMEngine(EngineConfig(model=model_dir, device=args.device, **options), loaded)
        started = round(time.perf_counter() - started, 1)
        row = {"config": Path(args.config).stem if not args.model else args.model,
               "device": device_name(args.device), "tier": tier, "engine_start_s": started,
               **workload_a(engine, args.workload_a)}
        keep(row)
        engine.shutdown()
        del engine
    for row in comparisons(rows):
        keep(row)


if __name__ == "__main__":
    main()
