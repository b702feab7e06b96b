"""The `pagedserve` console script: generate, chat, bench, serve.

generate and chat drive an LLMEngine directly so tokens stream as they are sampled; bench
runs an offline batch through the same engine and, with --compare-transformers, the same
prompts through transformers' batched `generate` in the same process for a fair ratio.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import asdict, dataclass

from pagedserve.entrypoints.chat import end_marker, run_chat, sigint_as_flag, stream_answer
from pagedserve.entrypoints.engine_args import add_engine_args, engine_options

DEFAULT_BENCH_QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.",
    "Explain what a hash table is.", "List three uses of copper.", "Why is the sky blue?",
    "Give me a short recipe for pancakes.", "What does a CPU cache do?",
    "Translate 'good morning' into Spanish.", "Tell me a fun fact about octopuses.",
    "How do vaccines work?", "Name the planets of the solar system.",
    "What is photosynthesis?", "Suggest a name for a black cat.",
    "How far is the Moon from the Earth?", "What is a prime number?",
    "Describe a rainbow to a child.", "Why do leaves change colour in autumn?",
    "What is the boiling point of water?", "How do I make a paper plane?",
    "What is the Pythagorean theorem?",
]


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int = 256) -> None:
    group = parser.add_argument_group("sampling options")
    group.add_argument("--max-tokens", type=int, default=max_tokens,
                       help="max new tokens per answer")
    group.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    group.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    group.add_argument("--top-k", type=int, default=0, help="sample among the k most likely "
                       "tokens; 0 = all")
    group.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p times "
                       "the most likely token's probability")
    group.add_argument("--repetition-penalty", type=float, default=1.0,
                       help="> 1 discourages repeating prompt or output tokens")
    group.add_argument("--seed", type=int, default=None, help="sampling seed (reproducible)")


def cli_engine_options(args: argparse.Namespace) -> dict:
    """The engine group's options; a command's --seed also seeds the engine's generator."""
    options = engine_options(args)
    if getattr(args, "seed", None) is not None:
        options["seed"] = args.seed
    return options


def sampling_params(args: argparse.Namespace):
    from pagedserve.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                          repetition_penalty=args.repetition_penalty, seed=args.seed)


def _build_engine(args: argparse.Namespace):
    from pagedserve.frontend.llm_engine import LLMEngine

    return LLMEngine.from_options(**cli_engine_options(args))


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


# -- generate -----------------------------------------------------------------------------------

def cmd_generate(args: argparse.Namespace) -> int:
    from pagedserve.entrypoints.chat_template import encode_chat

    engine = _build_engine(args)
    tokenizer = engine.tokenizer
    if args.no_chat_template or getattr(tokenizer, "chat_template", None) is None:
        prompt_ids = tokenizer.encode(args.prompt)
    else:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        messages.append({"role": "user", "content": args.prompt})
        prompt_ids = encode_chat(tokenizer, messages)
    params = sampling_params(args)
    with sigint_as_flag() as cancel:
        answer = stream_answer(engine, "generate", prompt_ids, params, _write, cancel)
    _write("\n")
    marker = end_marker(answer, params.max_tokens)
    if marker:
        print(marker, file=sys.stderr)
    return 130 if answer.finish_reason == "abort" else 0


# -- chat ---------------------------------------------------------------------------------------

def cmd_chat(args: argparse.Namespace) -> int:
    from pagedserve.entrypoints.chat_template import encode_chat

    engine = _build_engine(args)
    return run_chat(engine, sampling_params(args), args.system, _write,
                    lambda messages: encode_chat(engine.tokenizer, messages))


# -- bench --------------------------------------------------------------------------------------

@dataclass
class BenchResult:
    engine: str
    num_requests: int
    output_tokens: int
    elapsed_s: float
    requests_per_s: float
    output_tokens_per_s: float
    ttft_ms: dict[str, float] | None = None
    tpot_ms: dict[str, float] | None = None
    prefix_hit_rate: float | None = None


def _percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))] * 1000

    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99)}


def bench_prompts(args: argparse.Namespace, tokenizer) -> list[list[int]]:
    """Chat prompts (distinct questions through the chat template) or random token ids."""
    from pagedserve.entrypoints.chat_template import encode_chat

    rng = random.Random(args.seed if args.seed is not None else 0)
    if args.dataset == "random":
        vocab = len(tokenizer)
        return [[rng.randrange(100, vocab - 100) for _ in range(args.input_len)]
                for _ in range(args.num_requests)]
    prompts = []
    for i in range(args.num_requests):
        question = DEFAULT_BENCH_QUESTIONS[i % len(DEFAULT_BENCH_QUESTIONS)]
        if i >= len(DEFAULT_BENCH_QUESTIONS):
            question += f" (variant {i // len(DEFAULT_BENCH_QUESTIONS)})"
        ids = encode_chat(tokenizer, [{"role": "user", "content": question}])
        prompts.append(ids[:args.input_len] if args.input_len else ids)
    return prompts


def bench_pagedserve(engine, prompts: list[list[int]], params) -> BenchResult:
    engine.add_request("warmup", None, type(params)(max_tokens=2, temperature=0.0),
                       prompt_token_ids=prompts[0][:8])
    while engine.has_unfinished_requests():
        engine.step()
    engine.kv_cache_manager.reset_prefix_cache()
    before = engine.get_stats()
    start = time.time()
    for i, ids in enumerate(prompts):
        engine.add_request(f"bench-{i}", None, params, prompt_token_ids=ids, arrival_time=start)
    finished = []
    while engine.has_unfinished_requests():
        finished.extend(o for o in engine.step() if o.finished)
    elapsed = time.time() - start
    after = engine.get_stats()
    out_tokens = sum(len(c.token_ids) for o in finished for c in o.outputs)
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in finished]
    tpot = [(o.metrics.finished_time - o.metrics.first_token_time) / (len(o.outputs[0].token_ids) - 1)
            for o in finished if len(o.outputs[0].token_ids) > 1]
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    return BenchResult("pagedserve", len(finished), out_tokens, elapsed, len(finished) / elapsed,
                       out_tokens / elapsed, _percentiles(ttft), _percentiles(tpot) if tpot else None,
                       hits / queries if queries else 0.0)


def load_transformers(model_path: str | None, dtype):
    """The same checkpoint through transformers (GGUF files are dequantized by it)."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from pagedserve.model.loader import default_model_path

    path = Path(model_path) if model_path else default_model_path()
    kwargs = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    return AutoModelForCausalLM.from_pretrained(path.parent if kwargs else path, dtype=dtype,
                                                **kwargs).eval()


def bench_transformers(model, prompts: list[list[int]], tokenizer, params) -> BenchResult:
    """transformers' batched `generate` over the same prompts (left padding, one batch)."""
    import torch

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    gen = {"max_new_tokens": params.max_tokens, "pad_token_id": pad,
           "do_sample": not params.is_greedy}
    if not params.is_greedy:
        gen.update(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k or None)
    if params.ignore_eos:
        model.generation_config.eos_token_id = None
    with torch.inference_mode():
        model.generate(ids[:1, -8:], attention_mask=mask[:1, -8:], **{**gen, "max_new_tokens": 2})
        start = time.time()
        out = model.generate(ids, attention_mask=mask, **gen)
        elapsed = time.time() - start
    eos = set() if params.ignore_eos else {tokenizer.eos_token_id}
    out_tokens = 0
    for row in out[:, width:].tolist():
        out_tokens += next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
    return BenchResult("transformers", len(prompts), out_tokens, elapsed, len(prompts) / elapsed,
                       out_tokens / elapsed)


def _print_result(result: BenchResult) -> None:
    print(f"{result.engine}: {result.num_requests} requests, {result.output_tokens} output "
          f"tokens in {result.elapsed_s:.2f} s")
    print(f"  requests/s {result.requests_per_s:.2f}   output tok/s "
          f"{result.output_tokens_per_s:.1f}")
    for name, values in (("TTFT", result.ttft_ms), ("TPOT", result.tpot_ms)):
        if values:
            print(f"  {name} ms  " + "  ".join(f"{k} {v:.1f}" for k, v in values.items()))
    if result.prefix_hit_rate is not None:
        print(f"  prefix cache hit rate {result.prefix_hit_rate:.1%}")


def cmd_bench(args: argparse.Namespace) -> int:
    import torch

    from pagedserve.sampling_params import SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    engine = _build_engine(args)
    prompts = bench_prompts(args, engine.tokenizer)
    params = SamplingParams(max_tokens=args.output_len, temperature=args.temperature,
                            ignore_eos=args.ignore_eos, seed=args.seed)
    executor = engine.engine_core.executor
    print(f"device {executor.device_name}, torch threads {torch.get_num_threads()}, "
          f"{len(prompts)} {args.dataset} prompts (mean {sum(map(len, prompts)) / len(prompts):.0f}"
          f" tokens) x {args.output_len} new tokens, {engine.num_blocks} KV blocks")
    peer = load_transformers(args.model, getattr(torch, executor.dtype)) \
        if args.compare_transformers else None
    results, speedups = [], []
    for round_ in range(args.repeat):  # alternate the engines: load on a shared box drifts
        if args.repeat > 1:
            print(f"-- round {round_ + 1}/{args.repeat}")
        ours = bench_pagedserve(engine, prompts, params)
        _print_result(ours)
        results.append(ours)
        if peer is not None:
            theirs = bench_transformers(peer, prompts, engine.tokenizer, params)
            _print_result(theirs)
            results.append(theirs)
            speedups.append(ours.output_tokens_per_s / theirs.output_tokens_per_s)
            print(f"speedup (output tok/s): {speedups[-1]:.2f}x")
    if len(speedups) > 1:
        print(f"median speedup over {len(speedups)} rounds: "
              f"{sorted(speedups)[len(speedups) // 2]:.2f}x")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=2)
    return 0


# -- serve and the parser -------------------------------------------------------------------

def cmd_serve(args: argparse.Namespace) -> int:
    """The engine-core process starts first, before this process imports the server (FastAPI,
    the frontend, torch): both processes import side by side, and the tokenizer loads while
    the core loads the weights, instead of one after the other."""
    import logging

    from pagedserve.config import EngineConfig
    from pagedserve.entrypoints.server.options import serve_settings
    from pagedserve.frontend.core_client import EngineCoreClient

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    settings = serve_settings(args)  # bad options are refused before anything starts
    client = EngineCoreClient(EngineConfig.from_options(**engine_options(args), seed=args.seed))
    try:
        from pagedserve.entrypoints.server.api_server import run_server

        run_server(args, client, settings)
    finally:
        client.shutdown()
    return 0


def cmd_serve_ray(argv: list[str]) -> int:
    try:
        from pagedserve.entrypoints.ray_serve import main as serve_ray
    except ImportError as error:
        raise RuntimeError(f"serve-ray needs Ray Serve: pip install 'pagedserve[ray]' "
                           f"({error})") from None
    return serve_ray(argv)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pagedserve")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "(not installed)"


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description="An LLM serving engine "
                                     "built around a paged KV cache.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="answer one prompt, streaming the tokens")
    generate.add_argument("prompt", help="the prompt (a user message for instruct models)")
    generate.add_argument("--no-chat-template", action="store_true",
                          help="send the prompt as raw text, without the chat template")
    generate.add_argument("--system", default=None, help="a system message for the template")
    add_sampling_args(generate)
    add_engine_args(generate)
    generate.set_defaults(func=cmd_generate)

    chat = commands.add_parser("chat", help="interactive chat; the conversation's prefix is "
                               "reused from the KV cache each turn")
    chat.add_argument("--system", default=None, help="a system message")
    add_sampling_args(chat)
    add_engine_args(chat)
    chat.set_defaults(func=cmd_chat)

    bench = commands.add_parser("bench", help="offline throughput benchmark")
    bench.add_argument("--num-requests", type=int, default=16, help="requests, all submitted "
                       "at once")
    bench.add_argument("--dataset", choices=["chat", "random"], default="chat",
                       help="chat: distinct questions through the chat template; "
                       "random: random token ids of --input-len")
    bench.add_argument("--input-len", type=int, default=None, help="prompt tokens (random: "
                       "required length, default 128; chat: truncate to this)")
    bench.add_argument("--output-len", type=int, default=64, help="new tokens per request")
    bench.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    bench.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                       help="generate exactly --output-len tokens (default) or stop at eos")
    bench.add_argument("--compare-transformers", action="store_true", help="also run "
                       "transformers' batched generate on the same model and prompts")
    bench.add_argument("--threads", type=int, default=None, help="torch CPU threads for both "
                       "engines (default: torch's choice, one per core)")
    bench.add_argument("--repeat", type=int, default=1, help="rounds, alternating the "
                       "engines; prints the median speedup")
    bench.add_argument("--seed", type=int, default=None, help="prompt and sampling seed")
    bench.add_argument("--output-json", default=None, help="write the results here")
    add_engine_args(bench)
    bench.set_defaults(func=cmd_bench)

    serve = commands.add_parser("serve", help="OpenAI-compatible HTTP server")
    if len(argv) > 0 and argv[0] == "serve":  # the server's options only when serving
        from pagedserve.entrypoints.server.options import add_serve_args

        add_serve_args(serve)
    add_engine_args(serve)
    serve.set_defaults(func=cmd_serve)

    serve_ray = commands.add_parser("serve-ray", add_help=False, help="replicas on Ray Serve "
                                    "behind one OpenAI endpoint, prefix-aware routing "
                                    "(pagedserve[ray]; serve-ray --help for its options)")
    serve_ray.set_defaults(func=cmd_serve_ray)  # its options: main hands them on unparsed
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve-ray"]:  # Ray Serve's options and each replica's server's
        return _run(cmd_serve_ray, argv[1:])
    args = build_parser(argv).parse_args(argv)
    if args.command == "bench" and args.dataset == "random" and args.input_len is None:
        args.input_len = 128
    return _run(args.func, args)


def _run(command, args) -> int:
    try:
        return command(args)
    except (ValueError, RuntimeError, FileNotFoundError) as error:
        print(f"pagedserve: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # e.g. while the model loads: one line, the shell's code
        print("\npagedserve: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
