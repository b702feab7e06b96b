"""The per-step cost of structured outputs: the same requests with every one under a JSON
schema against all free, in one run on one engine, plus the first-request compile time.

Each request gets a random prompt (fresh ids per run, prefix caching off, so no run reuses
another's KV) and `max_tokens` output tokens with `ignore_eos`: free and constrained runs
generate the same number of tokens, and throughput is output tokens per second. A grammar
that completes before max_tokens leaves its row free from there on (only EOS would follow,
and EOS is ignored), so the script replays each output through a fresh matcher and reports
the fraction of tokens that were generated under a live grammar. Runs alternate
free / constrained `--repeats` times; the best of each is compared. Host time per step is
recorded by `host_timers.py` (the grammar's share: `grammar_submit`, the engine thread
handing a step's work to the manager's workers, and `grammar_wait`, the time it waits for
them); `benchmarks/grammar_host.py` measures the grammar work alone, without a model.

The grammar compile time is measured on a fresh GrammarCache: the token table
(`TokenizerInfo`, once per tokenizer) and the first compile of each schema (the benchmark's,
any JSON object, and a two-tool "required" call).

On the GPU (random weights from a config, the lead's H100 run):
    python benchmarks/make_checkpoint.py benchmarks/configs/qwen3-0.6b.json /tmp/qwen3-0.6b
    python benchmarks/structured.py --model /tmp/qwen3-0.6b --num-requests 256 \
        --max-tokens 256 --out /tmp/structured-h100
On the CPU (the default model):
    python benchmarks/structured.py --num-requests 16 --max-tokens 32 --out /tmp/structured
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import sys
import time
from importlib.metadata import version
from pathlib import Path

# this folder holds kernels.py, which would shadow the `kernels` package transformers probes for
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks.host_timers

import torch  # noqa: E402
import xgrammar as xgr  # noqa: E402

from benchmarks.host_timers import HostTimers  # noqa: E402
from pagedserve.config import EngineConfig  # noqa: E402
from pagedserve.entrypoints.llm import LLM  # noqa: E402
from pagedserve.entrypoints.server.tool_parsers import forced_tool_schema  # noqa: E402
from pagedserve.frontend.llm_engine import LLMEngine  # noqa: E402
from pagedserve.sampling_params import SamplingParams  # noqa: E402
from pagedserve.structured.grammar import GrammarCache  # noqa: E402
from pagedserve.structured.params import StructuredOutputsParams  # noqa: E402

SCHEMA = {  # an extraction-style schema: nested objects, arrays, enums, required fields
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "year": {"type": "integer"},
        "genre": {"enum": ["drama", "comedy", "documentary", "thriller"]},
        "cast": {"type": "array", "items": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "role": {"type": "string"},
                           "lead": {"type": "boolean"}},
            "required": ["name", "role", "lead"]}},
        "summary": {"type": "string"},
    },
    "required": ["title", "year", "genre", "cast", "summary"],
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def compile_times(engine: LLMEngine) -> dict[str, float]:
    """Milliseconds: the token table, then each first compile, on a fresh cache."""
    vocab = engine.model_config.vocab_size
    start = time.perf_counter()
    cache = GrammarCache(engine.tokenizer, vocab)
    times = {"tokenizer_info_ms": (time.perf_counter() - start) * 1e3}
    specs = {"schema": StructuredOutputsParams(json=SCHEMA),
             "json_object": StructuredOutputsParams(json_object=True),
             "tools_required": StructuredOutputsParams(json=forced_tool_schema(TOOLS, None))}
    for name, spec in specs.items():
        start = time.perf_counter()
        cache.get(spec)
        times[f"{name}_first_compile_ms"] = (time.perf_counter() - start) * 1e3
        start = time.perf_counter()
        cache.get(spec)
        times[f"{name}_cached_ms"] = (time.perf_counter() - start) * 1e3
    return times


def prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(count)]


def run(llm: LLM, ids: list[list[int]], params: SamplingParams, device: torch.device
        ) -> tuple[float, list[list[int]]]:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(ids, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return elapsed, [o.outputs[0].token_ids for o in outputs]


def constrained_fraction(engine: LLMEngine, outputs: list[list[int]]) -> float:
    """The share of tokens generated while the request's grammar was still open."""
    compiled = engine.structured.grammars.get(StructuredOutputsParams(json=SCHEMA))
    live = total = 0
    for tokens in outputs:
        matcher = xgr.GrammarMatcher(compiled,
                                     override_stop_tokens=engine.structured.stop_token_ids)
        for token in tokens:
            total += 1
            if matcher.is_terminated() or matcher.is_completed():
                continue
            live += 1
            matcher.accept_token(token)
    return live / max(total, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="HF folder or .gguf (default: the "
                        "embedded SmolLM2-135M); its tokenizer compiles the grammar")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--kv-cache-memory", type=int, default=None)
    parser.add_argument("--grammar-threads", type=int, default=None,
                        help="the manager's grammar worker threads (0: on the engine thread; "
                             "default: half the CPUs, at most 4; 0 for a model on the CPU)")
    parser.add_argument("--grammar-process", choices=("auto", "on", "off"), default="auto",
                        help="the matchers in a process of their own (auto: on a GPU)")
    parser.add_argument("--out", type=Path, required=True, help="folder for structured.json")
    args = parser.parse_args()

    options = {"max_num_seqs": max(args.num_requests, 1), "enable_prefix_caching": False,
               "grammar_process": {"auto": None, "on": True, "off": False}[args.grammar_process]}
    if args.kv_cache_memory is not None:
        options["kv_cache_memory"] = args.kv_cache_memory
    engine = LLMEngine(EngineConfig(model=args.model, device=args.device, **options))
    device = next(engine.model_runner.model.parameters()).device
    if args.grammar_threads is not None:
        engine.structured.set_num_threads(args.grammar_threads)
    llm = LLM.from_engine(engine)
    vocab = min(engine.model_config.vocab_size, len(engine.tokenizer))
    compile_ms = compile_times(engine)
    print(json.dumps(compile_ms, indent=1))

    free = SamplingParams(temperature=args.temperature, seed=0, ignore_eos=True,
                          max_tokens=args.max_tokens)
    constrained = SamplingParams(temperature=args.temperature, seed=0, ignore_eos=True,
                                 max_tokens=args.max_tokens,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMA))
    run(llm, prompts(min(8, args.num_requests), 16, vocab, 99), free, device)  # warm-up
    run(llm, prompts(min(8, args.num_requests), 16, vocab, 98), constrained, device)
    timers = HostTimers(engine)
    results: dict[str, list[float]] = {"free": [], "json_schema": []}
    breakdown: dict[str, list[dict[str, float]]] = {"free": [], "json_schema": []}
    fractions, seed = [], 0
    for _ in range(args.repeats):
        for name, params in (("free", free), ("json_schema", constrained)):
            seed += 1
            ids = prompts(args.num_requests, args.prompt_len, vocab, seed)
            elapsed, outputs = run(llm, ids, params, device)
            tokens = sum(len(o) for o in outputs)
            results[name].append(tokens / elapsed)
            phases = timers.take()
            breakdown[name].append(phases)
            print(f"{name:12s} {tokens} tokens in {elapsed:.2f} s: {tokens / elapsed:,.1f} tok/s "
                  f"{phases}", flush=True)
            if name == "json_schema":
                fractions.append(constrained_fraction(engine, outputs))
    best_free, best_json = max(results["free"]), max(results["json_schema"])
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda"
        else platform.processor() or platform.machine(),
        "model": args.model or "SmolLM2-135M-Instruct (default)",
        "xgrammar": version("xgrammar"),
        "grammar_threads": engine.structured.num_threads,
        "grammar_where": type(engine.structured).__name__,
        "args": {k: str(v) for k, v in vars(args).items()},
        "compile": compile_ms,
        "throughput_tok_s": results,
        "best_free_tok_s": best_free,
        "best_json_schema_tok_s": best_json,
        "json_schema_vs_free": best_json / best_free,
        "tokens_under_live_grammar": fractions,
        "host_ms_per_step": breakdown,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "structured.json").write_text(json.dumps(report, indent=1))
    print(f"json_schema / free: {best_json / best_free:.3f} "
          f"({(1 - best_json / best_free) * 100:.1f}% lower); tokens under a live grammar "
          f"{[round(f, 3) for f in fractions]}")


if __name__ == "__main__":
    main()
