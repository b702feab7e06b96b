"""Speculative decoding (issue 30): what it buys one user, and what it costs under load.

Parts (each a key of the JSON written to --out, merged into what is there):
  grounded  the default model (or --model), one chat at a time, input-grounded tasks (fix
            the typos of / rewrite a ~300-word passage given in the prompt), greedy:
            output tokens/s with ngram against without, same run, same weights; the outputs
            must be identical (greedy), and the acceptance is reported
  oracle    (GPU) a shape from benchmarks/configs with dummy weights (default Llama-3-8B),
            batch 1, k = 4: TPOT without speculation against a verify of the target's own
            greedy continuation (recorded first) corrupted so that each draft token is
            accepted with probability --acceptance: the engine's own cost of a verify with a
            drafter that costs nothing; then the same with a draft model of --draft-shape
            (default Llama-3.2-1B, dummy weights) running as it would, its proposals
            overridden by the same oracle: what running a draft model costs; each row's
            `graph_steps` counts the steps that replayed a CUDA graph (decode, and verify:
            every request its last token and k drafts), so a TPOT says whether the verifies
            ran as graphs
  load      (GPU) workload A (benchmarks/throughput.py's 256 requests) with ngram against
            without, same run: output tokens/s (speculation switches itself off at this
            batch and the engine pipelines its steps; the synchronous engine is measured
            too)
  crossover (GPU) where speculation stops paying, for `disable_by_batch_size`: --shape
            with dummy weights, B requests decoding together for B in --batches, output
            tokens/s without speculation (synchronous, as a speculative engine runs once
            the rule switches drafting off, and async) against the oracle at k and
            --acceptance with drafting never switched off; `rule` is the largest B at which
            the oracle still beats the synchronous engine

    python benchmarks/speculative.py --parts grounded --out docs/results/speculative.json
    python benchmarks/speculative.py --parts grounded,oracle,load --device cuda \
        --out docs/results/speculative.json
    python benchmarks/speculative.py --parts crossover --device cuda \
        --out docs/results/speculative.json
    # a dry run of every part's path on the CPU (tiny shapes, a small KV pool; no figures):
    python benchmarks/speculative.py --parts oracle,load,crossover --device cpu \
        --shape tiny-llama3 --draft-shape tiny-llama3 --load-shape tiny-qwen3 \
        --oracle-tokens 8 --num-requests 2 --batches 1,2 --kv-cache-memory 256M

A part that fails writes its error as its row and the others still run (exit status 1).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import gc
import random
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
# this folder holds kernels.py, which would shadow the `kernels` package transformers probes for
sys.path = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402

from pagedserve import SamplingParams  # noqa: E402
from pagedserve.config import EngineConfig  # noqa: E402
from pagedserve.entrypoints.chat_template import encode_chat  # noqa: E402
from pagedserve.entrypoints.engine_args import parse_size  # noqa: E402
from pagedserve.frontend.llm_engine import LLMEngine, LoadedModel  # noqa: E402

PASSAGE = (
    "The old lighthouse stood at the edge of the cliff for more then two hundred years, and "
    "in all that time it had never once gone dark. The keepers changed, the paint faded and "
    "was renewed, the great lens was cleaned and polished by hands that grew old and were "
    "replaced by younger ones, but the light itself went on turning every night, sweeping "
    "its long white arm across the water. Sailors who had never seen the tower by day knew "
    "it by its rythm: two short flashes, a pause, and one long one. Fishermen's children "
    "learned to count with it before they could read. When the storm of the winter of the "
    "great frost came, the waves rose higher then anyone living had seen, and the spray "
    "reached the gallery at the top of the tower. The keeper that year was a woman named "
    "Agnes Holloway, who had taken the post after her husband died, and who had been told by "
    "the harbour board that a widow could not be expected to manage the work alone. She "
    "managed it for thirty one years. On the night of the storm the windows of the lantern "
    "room cracked, and the wind came through with such force that it threatened to put out "
    "the flame. Agnes stood in front of the broken pane with a sheet of canvas held against "
    "it, hour after hour, while the lamp burned behind her. In the morning the lifeboat crew "
    "found her still standing there, her hands frozen to the cloth, and the light still "
    "turning. Three ships had come through the narrows that night and all of them had "
    "reached the harbour safely. The harbour board, to its credit, never again said anything "
    "about what a widow could or could not be expected to do. Today the lighthouse is "
    "automatic, and no one lives in the keepers cottage, but there is a small brass plate by "
    "the door with her name on it, and the light still turns: two short flashes, a pause, "
    "and one long one.")
TASKS = (
    "Fix the spelling and grammar mistakes in the following passage. Reply with the "
    "corrected passage only, in full.\n\n" + PASSAGE,
    "Copy the following passage out again exactly, word for word, without any comment."
    "\n\n" + PASSAGE,
)


def engine_over(loaded: LoadedModel, base: dict, speculative: dict | None,
                async_scheduling: bool | None = None) -> LLMEngine:
    """An engine over `loaded` (one copy of the weights for every variant);
    `async_scheduling` None: the engine's choice (on CUDA, on for ngram too: its steps that
    may draft run synchronously)."""
    options = dict(base, speculative_config=speculative)
    if async_scheduling is not None:
        options["async_scheduling"] = async_scheduling
    return LLMEngine(EngineConfig(**options), loaded)


def run_one(engine: LLMEngine, prompt_ids: list[int], params: SamplingParams
            ) -> tuple[list[int], float, float | None]:
    """(output token ids, seconds from the first token to the last, seconds to the first)."""
    engine.add_request("r", None, params, prompt_token_ids=prompt_ids)
    start, first, tokens = time.perf_counter(), None, []
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.outputs[0].token_ids and first is None:
                first = time.perf_counter()
            tokens = output.outputs[0].token_ids
    return list(tokens), time.perf_counter() - (first or start), \
        (first - start) if first else None


def spec_stats(engine: LLMEngine) -> dict:
    stats = engine.get_stats()
    return {"drafts": stats.spec_num_drafts, "draft_tokens": stats.spec_num_draft_tokens,
            "accepted_tokens": stats.spec_num_accepted_tokens,
            "accepted_per_position": stats.spec_accepted_per_position,
            "acceptance_rate": (stats.spec_num_accepted_tokens / stats.spec_num_draft_tokens
                                if stats.spec_num_draft_tokens else 0.0),
            "mean_accepted_length": stats.spec_mean_accepted_length,
            "graph_steps": graph_steps(engine)}


def graph_steps(engine: LLMEngine) -> dict:
    """Sampled steps that replayed a CUDA graph since start: of decodes, of verifies."""
    stats = engine.get_stats()
    return {"decode": stats.num_decode_graph_steps, "verify": stats.num_verify_graph_steps,
            "steps": stats.num_steps}


def grounded(args: argparse.Namespace) -> dict:
    """One chat at a time, ngram against none, alternating per task (same load for both)."""
    base = dict(model=args.model, device=args.device, max_model_len=2048,
                kv_cache_memory=1 << 30, dtype=args.dtype)
    loaded = LoadedModel.load(EngineConfig(**base))
    engines = {"none": engine_over(loaded, base, None),
               "ngram": engine_over(loaded, base, {"method": "ngram",
                                                   "num_speculative_tokens": args.k,
                                                   "prompt_lookup_max": 4})}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    tokenizer = engines["none"].tokenizer
    rows, totals = [], {name: [0, 0.0] for name in engines}
    run_one(engines["none"], encode_chat(tokenizer, [{"role": "user", "content": "Hi"}]),
            SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    for task in TASKS:
        prompt = encode_chat(tokenizer, [{"role": "user", "content": task}])
        row = {"prompt_tokens": len(prompt)}
        outputs = {}
        for name, engine in engines.items():
            tokens, decode_s, ttft = run_one(engine, prompt, params)
            outputs[name] = tokens
            row[name] = {"output_tokens": len(tokens), "decode_s": round(decode_s, 3),
                         "ttft_s": round(ttft or 0.0, 3),
                         "tok_s": round((len(tokens) - 1) / decode_s, 2)}
            totals[name][0] += len(tokens) - 1
            totals[name][1] += decode_s
        row["identical"] = outputs["none"] == outputs["ngram"]
        row["speedup"] = round(row["ngram"]["tok_s"] / row["none"]["tok_s"], 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
    tok_s = {name: n / s for name, (n, s) in totals.items()}
    return {"model": args.model or "default (SmolLM2-135M-Instruct GGUF)", "dtype": args.dtype,
            "device": str(loaded.device) if hasattr(loaded, "device") else args.device,
            "k": args.k, "max_tokens": args.max_tokens, "tasks": rows,
            "tok_s": {n: round(v, 2) for n, v in tok_s.items()},
            "speedup": round(tok_s["ngram"] / tok_s["none"], 3),
            "spec": spec_stats(engines["ngram"]), "load": os.getloadavg()}


class OracleProposer:
    """Drafts the target's own greedy continuation (recorded without speculation), each
    token replaced by another with probability 1 - acceptance: greedy verification then
    accepts each draft token with that probability, and the drafter costs nothing."""

    def __init__(self, continuations: dict[tuple, list[int]], acceptance: float,
                 vocab: int, seed: int = 0) -> None:
        self.continuations = continuations
        self.acceptance, self.vocab = acceptance, vocab
        self.rng = random.Random(seed)

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        for prompt, full in self.continuations.items():
            n = len(prompt)
            if tuple(token_ids[:n]) == prompt and list(token_ids) == full[:len(token_ids)]:
                truth = full[len(token_ids):len(token_ids) + k]
                return [t if self.rng.random() < self.acceptance
                        else (t + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab
                        for t in truth]
        return []


def release(engine: LLMEngine) -> None:
    """Shut an engine down and give its KV cache back before the next is sized (each part
    fixes its KV budget: engines over one copy of the weights would otherwise size theirs
    from what the ones before left free)."""
    engine.shutdown()
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def stable_greedy(loaded: LoadedModel) -> None:
    """Zero every layer's output projections (attention's o_proj, the MLP's down_proj) in
    place. Dummy weights give near-flat logits, so a verify (the prefill kernel over k + 1
    rows) and a decode (its own kernel, one row) round differently and their argmaxes
    disagree within a few tokens: the oracle's recorded continuation then stops matching
    and the acceptance it was set to is not the one measured. With the projections zero the
    residual stream is the current token's embedding, so the next token is a fixed
    function of the current one, far from any tie, while every kernel still runs on the
    same shapes and bytes (a zero weight costs a GEMM what any weight does)."""
    with torch.no_grad():
        for layer in loaded.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()


def shape_folder(root: Path, shape: str) -> Path:
    from benchmarks.tensor_parallel import model_folder

    return model_folder(root, shape)


def oracle(args: argparse.Namespace) -> dict:
    """Batch 1 TPOT: none against the oracle at k and the acceptance asked for."""
    with tempfile.TemporaryDirectory() as root:
        folder = shape_folder(Path(root), args.shape)
        base = dict(model=str(folder), load_format="dummy", device=args.device,
                    max_model_len=4096, kv_cache_memory=args.kv_cache_memory or 4 << 30)
        loaded = LoadedModel.load(EngineConfig(**base))
        stable_greedy(loaded)
        rng = random.Random(0)
        vocab = loaded.model_config.vocab_size
        prompts = [[rng.randrange(3, min(vocab, 10_000)) for _ in range(256)]
                   for _ in range(4)]
        params = SamplingParams(temperature=0.0, max_tokens=args.oracle_tokens,
                                ignore_eos=True)
        none = engine_over(loaded, base, None, async_scheduling=None)
        run_one(none, prompts[0][:16], SamplingParams(max_tokens=8, ignore_eos=True))
        recorded, none_tpot = {}, []
        for p in prompts:
            tokens, decode_s, _ = run_one(none, p, params)
            recorded[tuple(p)] = p + tokens
            none_tpot.append(decode_s / (len(tokens) - 1))
        none_graphs = graph_steps(none)
        release(none)
        draft = shape_folder(Path(root), args.draft_shape)
        result = {"shape": args.shape, "k": 4, "acceptance_set": args.acceptance,
                  "output_tokens": args.oracle_tokens,
                  "tpot_ms_none": round(1e3 * statistics.median(none_tpot), 3),
                  "graph_steps_none": none_graphs}
        for name, config in (("oracle", {"method": "ngram"}),
                             ("draft_model_oracle", {"model": str(draft)})):
            spec = engine_over(loaded, base, config | {"num_speculative_tokens": 4})
            # the oracle's drafts replace the proposer's (a draft model still runs)
            spec.engine_core.scheduler.proposer = OracleProposer(
                recorded, args.acceptance, vocab)
            run_one(spec, prompts[0][:16], SamplingParams(max_tokens=8, ignore_eos=True))
            spec_tpot, identical = [], True
            for p in prompts:
                tokens, decode_s, _ = run_one(spec, p, params)
                identical &= recorded[tuple(p)] == p + tokens
                spec_tpot.append(decode_s / (len(tokens) - 1))
            tpot = round(1e3 * statistics.median(spec_tpot), 3)
            result[name] = {"tpot_ms": tpot, "ratio": round(tpot / result["tpot_ms_none"], 3),
                            "identical": identical, "spec": spec_stats(spec)}
            release(spec)
        result["draft_model_oracle"]["draft_shape"] = args.draft_shape
        return result


def load(args: argparse.Namespace) -> dict:
    """Workload A: none (async, the default on CUDA), none synchronous, ngram."""
    from benchmarks.throughput import workload_prompts

    with tempfile.TemporaryDirectory() as root:
        folder = shape_folder(Path(root), args.load_shape)
        base = dict(model=str(folder), load_format="dummy", device=args.device,
                    kv_cache_memory=args.kv_cache_memory or 24 << 30)
        loaded = LoadedModel.load(EngineConfig(**base))
        prompts, out_lens = workload_prompts()
        prompts, out_lens = prompts[:args.num_requests], out_lens[:args.num_requests]
        result = {"shape": args.load_shape}
        for name, spec, async_ in (("none_async", None, None), ("none_sync", None, False),
                                   ("ngram", {"method": "ngram",
                                              "num_speculative_tokens": args.k}, None)):
            engine = engine_over(loaded, base, spec, async_)
            for i, (p, n) in enumerate(zip(prompts, out_lens)):
                engine.add_request(str(i), None, SamplingParams(
                    temperature=0.6, seed=i, max_tokens=n, ignore_eos=True),
                    prompt_token_ids=p)
            start = time.perf_counter()
            while engine.has_unfinished_requests():
                engine.step()
            seconds = time.perf_counter() - start
            result[name] = {"seconds": round(seconds, 3),
                            "tok_s": round(sum(out_lens) / seconds, 1)}
            if spec:
                result[name]["spec"] = spec_stats(engine)
            release(engine)
        result["ngram_vs_none_async"] = round(result["ngram"]["tok_s"]
                                              / result["none_async"]["tok_s"], 3)
        return result


def decode_tok_s(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams
                 ) -> tuple[float, list[list[int]]]:
    """Output tokens/s of the prompts run together, from the first step that has every
    prompt prefilled (decode only) to the end; and each prompt's output."""
    for i, p in enumerate(prompts):
        engine.add_request(str(i), None, params, prompt_token_ids=p)
    outputs: dict[str, list[int]] = {}
    start, before = None, 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id] = list(output.outputs[0].token_ids)
        if start is None and len(outputs) == len(prompts):
            start, before = time.perf_counter(), sum(map(len, outputs.values()))
    seconds = time.perf_counter() - start
    tokens = [outputs[str(i)] for i in range(len(prompts))]
    return (sum(map(len, tokens)) - before) / seconds, tokens


def crossover(args: argparse.Namespace) -> dict:
    """Tokens/s at each batch size: none (sync and async) against the oracle, drafting on at
    every size (disable_by_batch_size past the largest batch)."""
    batches = [int(b) for b in args.batches.split(",")]
    with tempfile.TemporaryDirectory() as root:
        folder = shape_folder(Path(root), args.shape)
        base = dict(model=str(folder), load_format="dummy", device=args.device,
                    max_model_len=1024, kv_cache_memory=args.kv_cache_memory or 8 << 30,
                    max_num_seqs=max(batches))
        loaded = LoadedModel.load(EngineConfig(**base))
        stable_greedy(loaded)
        rng = random.Random(0)
        vocab = loaded.model_config.vocab_size
        prompts = [[rng.randrange(3, min(vocab, 10_000)) for _ in range(128)]
                   for _ in range(max(batches))]
        params = SamplingParams(temperature=0.0, max_tokens=args.oracle_tokens,
                                ignore_eos=True)
        warm = SamplingParams(max_tokens=8, ignore_eos=True)
        result = {"shape": args.shape, "k": args.k, "acceptance_set": args.acceptance,
                  "output_tokens": args.oracle_tokens, "batches": {}}
        recorded: dict[int, dict[tuple, list[int]]] = {}  # per batch: the greedy outputs
        for name, spec, async_ in (("none_async", None, None), ("none_sync", None, False),
                                   ("oracle", {"method": "ngram",
                                               "num_speculative_tokens": args.k,
                                               "disable_by_batch_size": max(batches)},
                                    False)):
            engine = engine_over(loaded, base, spec, async_)
            scheduler = engine.engine_core.scheduler
            decode_tok_s(engine, prompts[:2], warm)
            for batch in batches:
                before = None
                if spec is not None:  # the greedy outputs of the same batch, drafted
                    scheduler.proposer = OracleProposer(recorded[batch], args.acceptance,
                                                        vocab)
                    before = spec_stats(engine)
                tok_s, outputs = decode_tok_s(engine, prompts[:batch], params)
                if name == "none_sync":
                    recorded[batch] = {tuple(p): p + o for p, o in zip(prompts, outputs)}
                row = result["batches"].setdefault(str(batch), {})
                row[name] = round(tok_s, 1)
                if spec is not None:
                    after = spec_stats(engine)
                    drafted = after["draft_tokens"] - before["draft_tokens"]
                    row["acceptance"] = round((after["accepted_tokens"]
                                               - before["accepted_tokens"]) / drafted, 3) \
                        if drafted else 0.0
                    row["oracle_vs_none_sync"] = round(tok_s / row["none_sync"], 3)
                print(json.dumps({name: batch, "tok_s": round(tok_s, 1)}), flush=True)
            release(engine)
        paying = [b for b in batches if result["batches"][str(b)]["oracle_vs_none_sync"] > 1.0]
        result["rule"] = max(paying) if paying else 0
        return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default="grounded")
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--dtype", default="auto", help="grounded: the engine's dtype")
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--shape", default="llama3-8b")
    parser.add_argument("--load-shape", default="qwen3-0.6b")
    parser.add_argument("--draft-shape", default="llama3.2-1b",
                        help="oracle: the draft model's shape (the target's vocabulary)")
    parser.add_argument("--acceptance", type=float, default=0.8)
    parser.add_argument("--oracle-tokens", type=int, default=128)
    parser.add_argument("--num-requests", type=int, default=256,
                        help="load: the first N of workload A's requests")
    parser.add_argument("--batches", default="1,2,4,8,16,32,64",
                        help="crossover: the batch sizes")
    parser.add_argument("--kv-cache-memory", type=parse_size, default=None,
                        help="oracle, load, crossover: the KV pool (default 4G, 24G, 8G; "
                             "smaller for a dry run on the CPU)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    parts = {"grounded": grounded, "oracle": oracle, "load": load, "crossover": crossover}
    results = json.loads(args.out.read_text()) if args.out and args.out.exists() else {}
    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device
    unknown = set(args.parts.split(",")) - set(parts)
    if unknown:
        parser.error(f"--parts: unknown {sorted(unknown)}; choose from {sorted(parts)}")
    failed = []
    for part in args.parts.split(","):
        key = f"{part}_{'cuda' if device.startswith('cuda') else 'cpu'}"
        if part == "grounded" and args.dtype != "auto":
            key += f"_{args.dtype}"
        try:  # a part that fails (a missing model, say) leaves the others their run
            row = parts[part](args)
        except Exception:  # noqa: BLE001 - written as the part's row, the run goes on
            failed.append(part)
            row = {"error": traceback.format_exc()[-3000:]}
        results[key] = row | {
            "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
            "cpus": os.cpu_count()}
        print(json.dumps({key: results[key]}, indent=1), flush=True)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(results, indent=1) + "\n")
    if failed:
        sys.exit(f"failed parts: {', '.join(failed)} (their rows hold the error)")


if __name__ == "__main__":
    main()
