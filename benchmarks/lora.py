"""Batched LoRA on a CUDA GPU: throughput with many adapters, and the batch-1 cost of one.

    PYTHONPATH=. python benchmarks/lora.py --out docs/results [--requests 256]
                                           [--parts kernels,engine]

Llama-3-8B shape (random bf16 weights made on the GPU, `load_format dummy`), 8 random PEFT
adapters of rank 16 on all seven projections (q/k/v/o/gate/up/down), written to a temporary
folder. In one process, on the same weights:

  workload A (benchmarks/throughput.py's: prompts and outputs uniform in [100, 1024]) on the
  base model alone, then with every request on one of the 8 adapters (request i on adapter
  i mod 8, all 8 in device slots: --max-loras 8);
  batch-1 TPOT (128-token prompt, 128 tokens) on the base engine, and on the LoRA engine
  without an adapter and with one.

Order matters: the base engine runs first, before the LoRA engine attaches its slots to the
shared weights. Those are the `engine` part (the default). The `kernels` part times
`lora_shrink_expand` against the base projection's matmul at the same shapes (the fused
q/k/v and gate/up modules' stacked ranks, as the engine runs them), at 1, 8, 64, 256 and 8192
rows spread over the 8 adapters: each captured in a CUDA graph (as decode runs), rotating
over copies of the weights larger than L2 together, median over the replays. Writes
OUT/lora.json (one row per figure, the parts asked for) and prints each row.
Targets (issue 35): workload A with adapters >= 0.80x the base; TPOT with one <= 1.15x.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path = [p for p in sys.path if Path(p or ".").resolve() != HERE]  # kernels.py shadowing

import numpy as np  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from pagedserve import LoRARequest, SamplingParams  # noqa: E402
from pagedserve.entrypoints.llm import LLM  # noqa: E402
from pagedserve.kernels.triton.lora import lora_shrink_expand  # noqa: E402
from pagedserve.model.lora import (ONE_ROW_MAX, TILE_ROWS, LoRABatch, fill_tiles,  # noqa: E402
                                   max_tiles)

NUM_ADAPTERS = 8
RANK = 16
PROJECTIONS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
               "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


fp8 = _module("fp8")  # its 8B folder, dummy loading, engine, workload A and TPOT helpers
throughput = fp8.throughput
KERNEL_ROWS = [1, 8, 64, 256, 8192]
COPIES = 4  # of each shape's weights: together larger than L2


def projection_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """(out, in) of each projection."""
    h, inter = config["hidden_size"], config["intermediate_size"]
    d = h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}


def write_adapter(folder: Path, config: dict, seed: int) -> None:
    """A PEFT-format adapter with random A and B (small: outputs stay in range)."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for proj, (out, inp) in projection_shapes(config).items():
            prefix = f"base_model.model.model.layers.{layer}.{PROJECTIONS[proj]}.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(RANK, inp, generator=gen)
                                                  / inp**0.5).to(torch.bfloat16)
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(out, RANK, generator=gen)
                                                  * 0.01).to(torch.bfloat16)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": RANK, "lora_alpha": 2 * RANK,
        "target_modules": list(PROJECTIONS), "bias": "none"}))


def workload(engine, prompts, out_lens, adapters) -> dict:
    params = [SamplingParams(temperature=throughput.TEMPERATURE, max_tokens=n, ignore_eos=True)
              for n in out_lens]
    loras = None if adapters is None else [adapters[i % len(adapters)]
                                           for i in range(len(prompts))]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outputs = LLM.from_engine(engine).generate(prompts, params, use_tqdm=False,
                                               lora_request=loras)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"seconds": round(seconds, 3), "output_tokens": tokens,
            "output_tok_per_s": round(tokens / seconds, 1)}


def tpot(engine, lora: LoRARequest | None, tokens: int = 128) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=tokens + 1, ignore_eos=True)
    times = []
    for seed in range(3):
        prompt = [(seed * 131 + i * 7) % 10_000 for i in range(128)]
        out = LLM.from_engine(engine).generate([prompt], params, use_tqdm=False,
                                               lora_request=lora)[0]
        m = out.metrics
        times.append((m.finished_time - m.first_token_time) / tokens * 1e3)
    return round(statistics.median(times), 3)


def lora_batch(rows: int) -> LoRABatch:
    """The runner's batch for `rows` decode rows (prefill rows when over a graph's) spread
    over the adapters, row i on slot i mod 8; tiles as a graph's (unused ones -1)."""
    token_slots = (np.arange(rows) % NUM_ADAPTERS).astype(np.int32)
    tiles = max_tiles(rows, NUM_ADAPTERS)
    sorted_rows = np.zeros(rows, dtype=np.int32)
    starts, lens = np.zeros(tiles, dtype=np.int32), np.zeros(tiles, dtype=np.int32)
    slots = np.full(tiles, -1, dtype=np.int32)
    fill_tiles(token_slots, sorted_rows, starts, lens, slots)
    tensors = [torch.from_numpy(a).cuda() for a in (token_slots, sorted_rows, starts, lens,
                                                    slots)]
    return LoRABatch(*tensors, rows <= ONE_ROW_MAX, TILE_ROWS)


def kernel_rows(config: dict, add) -> None:
    """lora_shrink_expand against the projection's matmul, per module and row count."""
    kernels = _module("kernels")  # graph_us
    shapes = projection_shapes(config)
    modules = {  # name -> (out, in, stacked rank), as `lora.attach` stacks them
        "qkv_proj": (sum(shapes[p][0] for p in ("q_proj", "k_proj", "v_proj")),
                     shapes["q_proj"][1], 3 * RANK),
        "o_proj": (*shapes["o_proj"], RANK),
        "gate_up_proj": (2 * shapes["gate_proj"][0], shapes["gate_proj"][1], 2 * RANK),
        "down_proj": (*shapes["down_proj"], RANK)}
    dev, dtype = torch.device("cuda"), torch.bfloat16
    for name, (N, K, R) in modules.items():
        for rows in KERNEL_ROWS:
            batch = lora_batch(rows)
            sets = [(torch.randn(rows, K, device=dev, dtype=dtype),
                     torch.randn(N, K, device=dev, dtype=dtype) / K**0.5,
                     torch.randn(NUM_ADAPTERS, R, K, device=dev, dtype=dtype) / K**0.5,
                     torch.randn(NUM_ADAPTERS, N, R, device=dev, dtype=dtype) * 0.01,
                     torch.empty(rows, N, device=dev, dtype=dtype)) for _ in range(COPIES)]
            base = kernels.graph_us([lambda x=x, w=w, y=y: torch.matmul(x, w.T, out=y)
                                     for x, w, _, _, y in sets], reps=100)
            lora = kernels.graph_us([lambda x=x, a=a, b=b, y=y: lora_shrink_expand(
                x, y, a, b, batch) for x, _, a, b, y in sets], reps=100)
            add(measure="kernel_us", module=name, rows=rows, K=K, N=N, stacked_rank=R,
                path="one-row" if batch.one_row_kernels else "tiles",
                base_matmul_us=round(base, 2), lora_us=round(lora, 2),
                lora_vs_matmul=round(lora / base, 3))
            del sets
            torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("docs/results"))
    parser.add_argument("--requests", type=int, default=None,
                        help="the first N requests of workload A (default: all)")
    parser.add_argument("--parts", default="engine",
                        help="comma-separated, in order: kernels, engine (default: engine)")
    args = parser.parse_args()
    parts = args.parts.split(",")
    if not parts or set(parts) - {"kernels", "engine"}:
        parser.error(f"--parts: expected kernels and/or engine, got {args.parts!r}")
    rows = []

    def add(**row) -> None:
        row.update(device=torch.cuda.get_device_name(), date=datetime.date.today().isoformat(),
                   model="llama-3-8b shape, load_format dummy, bf16",
                   adapters=f"{NUM_ADAPTERS} x rank {RANK} on q/k/v/o/gate/up/down")
        rows.append(row)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "lora.json").write_text(json.dumps(rows, indent=1) + "\n")
        print(json.dumps(row), flush=True)

    prompts, out_lens = throughput.workload_prompts()
    if args.requests:
        prompts, out_lens = prompts[:args.requests], out_lens[:args.requests]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = fp8.config_folder(HERE / "configs" / "llama3-8b.json", root / "llama3-8b")
        config = json.loads((model_dir / "config.json").read_text())
        for part in parts:
            if part == "kernels":
                kernel_rows(config, add)
            else:
                engine_rows(model_dir, config, root, prompts, out_lens, add)


def engine_rows(model_dir: Path, config: dict, root: Path, prompts, out_lens, add) -> None:
    """Workload A and batch-1 TPOT, base engine then LoRA engine."""
    adapters = []
    for i in range(NUM_ADAPTERS):
        write_adapter(root / f"adapter{i}", config, seed=i)
        adapters.append(LoRARequest(f"adapter{i}", i + 1, str(root / f"adapter{i}")))
    loaded = fp8.load_dummy(model_dir, None)

    engine = fp8.engine_for(loaded, str(model_dir))
    base_tpot = tpot(engine, None)
    add(measure="tpot_batch1_ms", variant="base engine", tpot_ms=base_tpot)
    base = workload(engine, prompts, out_lens, None)
    add(measure="workload_A", variant="base engine", **base)
    del engine
    throughput.release()

    engine = fp8.engine_for(loaded, str(model_dir), enable_lora=True,
                            max_loras=NUM_ADAPTERS, max_lora_rank=RANK)
    for name, lora in (("lora engine, no adapter", None), ("lora engine, adapter",
                                                            adapters[0])):
        ms = tpot(engine, lora)
        add(measure="tpot_batch1_ms", variant=name, tpot_ms=ms,
            ratio_vs_base=round(ms / base_tpot, 3))
    row = workload(engine, prompts, out_lens, adapters)
    add(measure="workload_A", variant=f"every request on one of {NUM_ADAPTERS} adapters",
        **row, ratio_vs_base=round(row["output_tok_per_s"] / base["output_tok_per_s"], 3))


if __name__ == "__main__":
    main()
