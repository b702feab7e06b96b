"""Mixture of experts on a GPU: workload A on a Qwen3-30B-A3B-shaped random bf16 model against
transformers' continuous batching (`generate_batch`) on the same weights, in one run, and the
fraction of the MoE roofline reached.

The model is benchmarks/configs/qwen3-30b-a3b.json with --layers layers (default 16 of 48:
pagedserve and transformers each hold a copy of the weights, 61 GB at 48 layers, in one
process). Workloads as in benchmarks/throughput.py: A (256 requests, prompt and output lengths
uniform in [100, 1024]) through pagedserve; B (A's prompts, 512 output tokens each) through
both engines, transformers last and stopped at --peer-deadline seconds (then marked partial).

Roofline: a decode step must read the weights outside the experts once, each expert that at
least one of the step's tokens picked once (with B requests running and uniform routing,
E * (1 - (1 - k/E)^B) experts per layer), and every running request's KV; summed over the
workload's steps (requests finish in order of output length) over the measured copy
bandwidth. Prefill is not counted.

    python benchmarks/moe.py --out docs/results/models.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path

# this folder holds kernels.py, which would shadow the `kernels` package transformers probes for
HERE = Path(__file__).resolve().parent
sys.path = [p for p in sys.path if Path(p or ".").resolve() != HERE]

import torch  # noqa: E402


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def moe_roofline(engine, prompts: list[list[int]], out_lens: list[int],
                 bandwidth: float) -> dict:
    """Output tok/s if each decode step read only what it must (see the module docstring)."""
    config = engine.model_config
    model = engine.model_runner.model
    expert_bytes, other_bytes = 0, 0
    for name, p in model.named_parameters():
        if name.endswith((".mlp.w13", ".mlp.w2")):
            expert_bytes += p.numel() * p.element_size()
        else:
            other_bytes += p.numel() * p.element_size()
    per_expert = expert_bytes / (config.num_experts * config.num_layers)
    kv_per_token = engine.model_runner.block_bytes // engine.config.block_size
    total, kv_total = 0.0, 0
    e, k = config.num_experts, config.num_experts_per_tok
    for step in range(max(out_lens)):
        running = [(p, n) for p, n in zip(prompts, out_lens) if n > step]
        active = e * (1 - (1 - k / e) ** len(running))
        kv = sum(len(p) + step for p, _ in running) * kv_per_token
        kv_total += kv
        total += other_bytes + active * per_expert * config.num_layers + kv
    seconds = total / bandwidth
    return {"copy_bandwidth_GBps": round(bandwidth / 1e9, 1),
            "bytes_read_GB": round(total / 1e9, 1), "kv_bytes_GB": round(kv_total / 1e9, 1),
            "seconds": round(seconds, 3), "output_tok_per_s": round(sum(out_lens) / seconds, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(HERE / "configs" / "qwen3-30b-a3b.json"))
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--model", help="an existing checkpoint folder instead")
    parser.add_argument("--peer-deadline", type=float, default=600.0)
    parser.add_argument("--out", type=Path, default=Path("docs/results/models.json"))
    args = parser.parse_args()
    throughput = _module("throughput")
    model_dir = args.model
    if model_dir is None:
        raw = json.loads(Path(args.config).read_text())
        raw["num_hidden_layers"] = args.layers
        root = Path(tempfile.mkdtemp(prefix="pagedserve-moe-"))
        (root / "config.json").write_text(json.dumps(raw))
        model_dir = str(root / "ckpt")
        _module("make_checkpoint").make_checkpoint(root / "config.json", Path(model_dir),
                                                   torch.bfloat16, 0, "bytes")
    bench_args = argparse.Namespace(eager=False, sync=False, out=args.out, extra_out=None)
    bench = throughput.Bench(bench_args, model_dir)
    engine = bench.engine()
    prompts, out_lens = throughput.workload_prompts()
    bandwidth = throughput.copy_bandwidth()
    rooflines = {"A": moe_roofline(engine, prompts, out_lens, bandwidth),
                 "B": moe_roofline(engine, prompts, [512] * len(prompts), bandwidth)}
    common = {"model": f"qwen3-30b-a3b shape, {args.layers} of 48 layers, random bf16"}
    for workload, lens in (("A", out_lens), ("B", [512] * len(prompts))):
        result = throughput.run_pagedserve(engine, prompts, lens)
        result["roofline_tok_per_s"] = rooflines[workload]["output_tok_per_s"]
        result["roofline_fraction"] = round(
            result["output_tok_per_s"] / rooflines[workload]["output_tok_per_s"], 3)
        bench.record(workload, "pagedserve", result, roofline=rooflines[workload], **common)
    del engine
    throughput.release()
    peer = throughput.run_transformers(model_dir, prompts, 512, args.peer_deadline)
    bench.record("B", "transformers", peer, **common)
    mine = [r for r in bench.rows if r["workload"] == "B" and r["engine"] == "pagedserve"]
    if peer["output_tok_per_s"] > 0:
        print(json.dumps({"B_ratio_vs_transformers": round(
            mine[-1]["output_tok_per_s"] / peer["output_tok_per_s"], 2)}), flush=True)
    if peer["partial"]:  # transformers' generation thread is still running: do not join it
        sys.stdout.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
