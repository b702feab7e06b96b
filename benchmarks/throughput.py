"""Offline throughput on a GPU: pagedserve against the roofline and transformers, one run.

Workloads (random prompt token ids, `ignore_eos`, seed 0):
  A       256 requests, prompt and output lengths uniform in [100, 1024] (nano-vllm's workload)
  B       A's prompts with 512 output tokens each; also run through transformers'
          continuous batching (`generate_batch`) on the same weights when `--peer` is given
  prefix  256 requests sharing a 2,048-token system prompt (+64 own tokens, 128 out),
          prefix caching on vs off
  preempt A under a KV budget small enough to force preemptions: recompute vs swap

    python benchmarks/throughput.py --config benchmarks/configs/qwen3-0.6b.json \
        --workloads A,B,prefix --peer --out docs/results/throughput.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

# this folder holds kernels.py, which would shadow the `kernels` package transformers probes for
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch  # noqa: E402

from pagedserve import LLM, SamplingParams  # noqa: E402

NUM_REQUESTS = 256


def workload_prompts(seed: int = 0, vocab: int = 10_000) -> tuple[list[list[int]], list[int]]:
    """Workload A: prompts and output lengths uniform in [100, 1024]."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(100, 1024))]
               for _ in range(NUM_REQUESTS)]
    out_lens = [rng.randint(100, 1024) for _ in range(NUM_REQUESTS)]
    return prompts, out_lens


def run_pagedserve(llm: LLM, prompts: list[list[int]], out_lens: list[int]) -> dict:
    params = [SamplingParams(temperature=0.6, max_tokens=n, ignore_eos=True) for n in out_lens]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outputs]
    return {"seconds": seconds, "output_tokens": tokens, "output_tok_per_s": tokens / seconds,
            "ttft_mean_s": statistics.mean(ttft), "ttft_p50_s": statistics.median(ttft)}


def run_transformers(model_dir: str, prompts: list[list[int]], max_new_tokens: int) -> dict:
    """transformers' own continuous batching (`generate_batch`), bf16, same weights."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16, attn_implementation="sdpa_paged").cuda().eval()
    gen = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=-1,
                           pad_token_id=0)
    model.generate_batch(prompts[:4], generation_config=gen, max_new_tokens=8)  # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    results = model.generate_batch(prompts, generation_config=gen)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    tokens = sum(len(r.generated_tokens) for r in results.values())
    del model
    torch.cuda.empty_cache()
    return {"seconds": seconds, "output_tokens": tokens, "output_tok_per_s": tokens / seconds}


def prefix_prompts(seed: int = 1, vocab: int = 10_000) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(vocab) for _ in range(2048)]
    return [system + [rng.randrange(vocab) for _ in range(64)] for _ in range(NUM_REQUESTS)]


def make_llm(model_dir: str, **options) -> LLM:
    opts = dict(max_model_len=4096, max_num_seqs=256, max_num_batched_tokens=16384)
    opts.update(options)
    llm = LLM(model=model_dir, **opts)
    llm.generate([[1, 2, 3]] * 4, SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
    return llm


def record(rows: list[dict], workload: str, engine: str, result: dict, **extra) -> None:
    row = {"workload": workload, "engine": engine, **extra, **result,
           "device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat()}
    rows.append(row)
    print(json.dumps(row), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="HF folder; default: a random checkpoint from --config")
    parser.add_argument("--config", default="benchmarks/configs/qwen3-0.6b.json")
    parser.add_argument("--workloads", default="A,B,prefix")
    parser.add_argument("--peer", action="store_true", help="run transformers on workload B")
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = parser.parse_args()

    model_dir = args.model
    if model_dir is None:
        from make_checkpoint import make_checkpoint  # noqa: PLC0415 (benchmarks/ script)
        model_dir = tempfile.mkdtemp(prefix="pagedserve-ckpt-")
        make_checkpoint(Path(args.config), Path(model_dir), torch.bfloat16, 0, "auto")

    workloads = args.workloads.split(",")
    prompts, out_lens = workload_prompts()
    rows: list[dict] = []
    llm = make_llm(model_dir, enforce_eager=args.eager)
    if "A" in workloads:
        record(rows, "A", "pagedserve", run_pagedserve(llm, prompts, out_lens))
    if "B" in workloads:
        record(rows, "B", "pagedserve", run_pagedserve(llm, prompts, [512] * NUM_REQUESTS))
    if "prefix" in workloads:
        p = prefix_prompts()
        for caching in (True, False):
            llm.llm_engine.reset_prefix_cache()
            llm.llm_engine.scheduler.kv_cache_manager.enable_caching = caching
            record(rows, "prefix", "pagedserve", run_pagedserve(llm, p, [128] * NUM_REQUESTS),
                   prefix_caching=caching)
    del llm
    torch.cuda.empty_cache()
    if "B" in workloads and args.peer:
        record(rows, "B", "transformers", run_transformers(model_dir, prompts, 512))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
