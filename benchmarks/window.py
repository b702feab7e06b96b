"""What a sliding window saves: KV blocks held and throughput, windowed vs the window ignored.

A Mistral-7B-shaped random checkpoint (benchmarks/configs/mistral-7b.json, window 4096) runs a
workload whose contexts outgrow the window, twice on the same weights: as configured (every
layer windowed, so the block manager frees the blocks that fall out of the window) and with
`sliding_window` removed from a copy of the config (global attention: every block is kept,
as for a model that mixes local and global layers). Each run records the KV blocks held after
every step (peak and mean), the requests running at once, preemptions and output tok/s.

    python benchmarks/window.py --out docs/results/window.json
    python benchmarks/window.py --layers 8 --out /tmp/window.json   # a smaller GPU
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

# this folder holds kernels.py, which would shadow the `kernels` package transformers probes for
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch  # noqa: E402

from pagedserve import SamplingParams  # noqa: E402
from pagedserve.config import EngineConfig  # noqa: E402
from pagedserve.frontend.llm_engine import LLMEngine, LoadedModel  # noqa: E402

CONFIG = Path(__file__).resolve().parent / "configs" / "mistral-7b.json"


def make_folders(root: Path, layers: int | None) -> tuple[Path, Path]:
    """(windowed checkpoint, the same weights with the window removed from config.json)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from make_checkpoint import make_checkpoint  # noqa: E402

    sys.path.pop(0)
    raw = json.loads(CONFIG.read_text())
    if layers:
        raw["num_hidden_layers"] = layers
    (root / "config.json").write_text(json.dumps(raw))
    windowed = root / "windowed"
    make_checkpoint(root / "config.json", windowed, torch.bfloat16, 0, "bytes")
    full = root / "global"
    full.mkdir()
    for item in windowed.iterdir():
        if item.name != "config.json":
            (full / item.name).symlink_to(item)
    config = json.loads((windowed / "config.json").read_text())
    config["sliding_window"] = None
    (full / "config.json").write_text(json.dumps(config))
    return windowed, full


def run(folder: Path, args: argparse.Namespace) -> dict:
    loaded = LoadedModel.load(EngineConfig(model=str(folder)))
    engine = LLMEngine(EngineConfig(model=str(folder), max_model_len=args.prompt + args.output,
                                    max_num_seqs=args.requests,
                                    kv_cache_memory=int(args.kv_gib * (1 << 30))), loaded)
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=args.output, ignore_eos=True)
    for i in range(args.requests):
        engine.add_request(f"r{i}", None, params,
                           prompt_token_ids=[rng.randrange(250) for _ in range(args.prompt)])
    held, running, tokens = [], [], 0
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                tokens += len(output.outputs[0].token_ids)
        pool = engine.kv_cache_manager.block_pool
        held.append(pool.num_blocks - 1 - pool.get_num_free_blocks())
        running.append(len(engine.scheduler.running))
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    return {"kv_window": loaded.model_config.kv_window, "num_blocks": engine.num_blocks,
            "block_size": engine.config.block_size, "peak_blocks_held": max(held),
            "mean_blocks_held": round(statistics.mean(held), 1),
            "peak_running": max(running), "mean_running": round(statistics.mean(running), 1),
            "preemptions": engine.scheduler.num_preemptions, "steps": len(held),
            "seconds": round(seconds, 2), "output_tok_per_s": round(tokens / seconds, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, help="fewer layers than Mistral-7B's 32")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=6144, help="tokens per prompt")
    parser.add_argument("--output", type=int, default=2048, help="tokens generated each")
    parser.add_argument("--kv-gib", type=float, default=16.0, help="KV cache budget, both runs")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="window-bench-"))
    try:
        windowed, full = make_folders(root, args.layers)
        rows = []
        for name, folder in (("windowed", windowed), ("window ignored", full)):
            row = {"run": name, **run(folder, args), "layers": args.layers or 32,
                   "requests": args.requests, "prompt": args.prompt, "output": args.output,
                   "kv_gib": args.kv_gib, "device": torch.cuda.get_device_name(),
                   "date": datetime.date.today().isoformat()}
            print(json.dumps(row), flush=True)
            rows.append(row)
            gc.collect()
            torch.cuda.empty_cache()
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(rows, indent=1) + "\n")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
