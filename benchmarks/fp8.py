"""FP8 KV cache and FP8 weights on a CUDA GPU (Ada / Hopper): speed and quality, one run.

    PYTHONPATH=. python benchmarks/fp8.py --out DIR [--parts kv,kernel,gemv,quality,8b] [--sweep]

Parts (all but 8b-tpot by default; over 7 minutes on an H100; if one call may not last that
long, run `--parts kv,kernel,gemv,quality` and `--parts 8b` as two):
  kv       workload A (benchmarks/throughput.py's: 256 requests, prompt and output lengths
           uniform in [100, 1024]), Qwen3-0.6B shape: bf16 KV against FP8 KV on the same
           weights in this process; KV blocks for the same memory and each run's roofline;
           with --sweep also FP8 KV under the decode candidates of KV_CANDIDATES
  kernel   paged decode at Qwen3-0.6B's attention shape on a bf16 and an FP8 cache: time and
           effective bandwidth (cache bytes read over time) against the copy bandwidth;
           with --sweep also the FP8 cache under each candidate launch setting
  gemv     FP8 weights at 1, 4 and 16 tokens on Llama-3-8B's projections (and its LM head at
           1): the weight-only kernel against _scaled_mm and against bf16, as weight
           bandwidth; with --sweep also each candidate setting of the weight-only kernel
           (tiles, split-K, e4m3 by bit moves) at 1 token
  quality  Qwen3-0.6B shape, random weights, LM head untied and x25 (sharp distributions):
           first-token agreement, greedy agreement over 48 tokens and the mean KL divergence
           of next-token distributions (teacher-forced on the bf16 engine's tokens) against
           the bf16 engine, for FP8 KV, FP8 weights and both; beside bf16 against
           transformers, measured the same way (the noise floor)
  order    workload A, bf16 and FP8 KV, decode v1 dispatched longest sequence first (the
           default) against program order, alternating (not in the default set)
  8b       Llama-3-8B shape (random weights made on the GPU, `load_format dummy`): batch-1 TPOT,
           bf16 against FP8 weights; workload A, bf16 against FP8 weights + FP8 KV
  8b-tpot  the 8b part's TPOT only (not in the default set), and the GPU time of the step's
           decoder graph and LM head; with --sweep also FP8 weights under the weight-only
           candidates of TPOT_CANDIDATES
  8b-skip  the 8b part's decoder graph time (bf16, FP8 weights) with groups of small kernels
           skipped: their cost on the batch-1 step's critical path (not in the default set)
  profile  where a step's GPU time goes (torch.profiler, 10 decode steps, not in the default
           set): Qwen3-0.6B shape at batch 256 with the bf16 and the FP8 KV cache, and the
           Llama-3-8B shape (random weights generated on the GPU, `load_format dummy`) at
           batch 1 in bf16 and with FP8 weights; a kernel table per engine in DIR

Writes DIR/fp8.json (docs/results style: one row per figure) and prints a summary line each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

# this folder holds kernels.py, which would shadow the `kernels` package transformers probes for
HERE = Path(__file__).resolve().parent
sys.path = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(HERE.parent))  # benchmarks.common, with or without PYTHONPATH=.

import torch  # noqa: E402

from benchmarks.common import (LLAMA3_8B_LM_HEAD, LLAMA3_8B_PROJECTIONS,  # noqa: E402
                               ResultRows, rotation_copies, sibling)
from pagedserve import SamplingParams  # noqa: E402
from pagedserve.attention.backend import set_forward_context  # noqa: E402
from pagedserve.attention.metadata import AttentionMetadata  # noqa: E402
from pagedserve.config import EngineConfig  # noqa: E402
from pagedserve.entrypoints.llm import LLM  # noqa: E402
from pagedserve.frontend.llm_engine import LLMEngine, LoadedModel  # noqa: E402
from pagedserve.kernels.int4pack import Int4Weight  # noqa: E402
from pagedserve.kernels.triton.attention import DecodeConfig, paged_decode  # noqa: E402
from pagedserve.kernels.triton.attention.decode import FP8_DECODE  # noqa: E402
from pagedserve.kernels.triton.fp8_linear import WeightOnlyConfig  # noqa: E402

QUALITY_PROMPTS = 24
QUALITY_TOKENS = 48


throughput = sibling("throughput")


def engine_for(loaded: LoadedModel, model_dir: str, **options) -> LLMEngine:
    opts = dict(model=model_dir, max_model_len=4096, max_num_seqs=256,
                max_num_batched_tokens=16384)
    opts.update(options)
    engine = LLMEngine(EngineConfig(**opts), loaded)
    LLM.from_engine(engine).generate([[1, 2, 3]] * 4, SamplingParams(max_tokens=16,
                                     ignore_eos=True), use_tqdm=False)  # warm-up
    return engine


def num_blocks(engine: LLMEngine) -> int:
    return engine.model_runner.kv_caches[0][0].shape[0]


def weight_bytes(engine: LLMEngine) -> int:
    """The model's parameters, and the 4-bit weights converted at load to torch's int4
    layout, which their matmuls hold instead of parameters (`int_linear.prepare`)."""
    model = engine.model_runner.model
    held = [getattr(getattr(m, "matmul", None), "weight", None) for m in model.modules()]
    held.append(getattr(getattr(model, "lm_head_matmul", None), "weight", None))
    tensors = [*model.parameters()] + [t for w in held if isinstance(w, Int4Weight)
                                       for t in (w.packed, w.scales_and_offsets)]
    return sum(t.numel() * t.element_size() for t in tensors)


def roofline(engine: LLMEngine, prompts: list[list[int]], out_lens: list[int],
             bandwidth: float) -> float:
    """Output tok/s if each decode step read the weights once and each active request's KV
    once at the copy bandwidth (throughput.py's roofline, for any weight and KV dtype)."""
    kv_per_token = engine.model_runner.block_bytes // engine.config.block_size
    kv = sum(n * len(p) + n * (n - 1) // 2 for p, n in zip(prompts, out_lens)) * kv_per_token
    seconds = (weight_bytes(engine) * max(out_lens) + kv) / bandwidth
    return round(sum(out_lens) / seconds, 1)


def workload_a(engine: LLMEngine, prompts: list[list[int]], out_lens: list[int]) -> dict:
    params = [SamplingParams(temperature=throughput.TEMPERATURE, max_tokens=n, ignore_eos=True)
              for n in out_lens]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outputs = LLM.from_engine(engine).generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"seconds": round(seconds, 3), "output_tokens": tokens,
            "output_tok_per_s": round(tokens / seconds, 1),
            "preemptions": scheduler(engine).num_preemptions}


def scheduler(engine: LLMEngine):
    """The engine's scheduler, wherever the engine keeps it (on the engine or its core)."""
    return getattr(engine, "scheduler", None) or engine.engine_core.scheduler


def part_kv(res: ResultRows, loaded: LoadedModel, model_dir: str, bandwidth: float,
            sweep: bool = False) -> None:
    """Workload A with a bf16 and an FP8 KV cache; with `sweep` also the FP8 cache under
    each of `KV_CANDIDATES` (`decode.FP8_DECODE`, read at each launch; "config" says which)."""
    from pagedserve.kernels.triton.attention import decode

    prompts, out_lens = throughput.workload_prompts()
    runs = [("auto", None), ("fp8", None)]
    if sweep:
        candidates = fp8_decode_candidates()
        runs += [("fp8", name) for name in KV_CANDIDATES]
    default = decode.FP8_DECODE
    for kv, config in runs:
        decode.FP8_DECODE = default if config is None else candidates[config]
        try:
            engine = engine_for(loaded, model_dir, kv_cache_dtype=kv)
            row = workload_a(engine, prompts, out_lens)
        finally:
            decode.FP8_DECODE = default
        res.add("kv", workload="A", model="qwen3-0.6b shape, random bf16",
                kv_cache_dtype="bf16" if kv == "auto" else "fp8_e4m3",
                **({} if config is None else {"config": config}), **row,
                kv_blocks=num_blocks(engine), kv_block_bytes=engine.model_runner.block_bytes,
                roofline_tok_per_s=roofline(engine, prompts, out_lens, bandwidth))
        del engine
        throughput.release()


def part_order(res: ResultRows, loaded: LoadedModel, model_dir: str) -> None:
    """Workload A with decode v1's programs dispatched longest first (`triton_backend.
    _decode_order`, the default) and in program order, FP8 KV twice, then bf16."""
    from pagedserve.attention import triton_backend

    prompts, out_lens = throughput.workload_prompts()
    longest_first = triton_backend._decode_order
    runs = [("fp8", True), ("fp8", False), ("fp8", True), ("fp8", False), ("auto", True),
            ("auto", False)]
    try:
        for kv, ordered in runs:
            triton_backend._decode_order = longest_first if ordered else (lambda meta: None)
            engine = engine_for(loaded, model_dir, kv_cache_dtype=kv)
            res.add("order", workload="A", kv_cache_dtype="bf16" if kv == "auto" else "fp8_e4m3",
                    decode_order="longest first" if ordered else "program order",
                    **workload_a(engine, prompts, out_lens))
            del engine
            throughput.release()
    finally:
        triton_backend._decode_order = longest_first


# FP8 decode settings workload A is run with under --sweep (names of `fp8_decode_candidates`)
KV_CANDIDATES = ("bits v fp16 dot", "bits v fp16 dot n64")


# ------------------------------------------------------------------------------- kernel
DECODE_SHAPES = ((256, 1024), (64, 4096), (1, 32768))


def fp8_decode_candidates() -> dict[str, DecodeConfig]:
    """FP8 launch settings `--sweep` times beside the default (`decode.FP8_DECODE`, the rows
    without a "config"), named by what differs from it: nN tokens per tile, wW warps, sS
    stages (5: double-buffered), "fp16 dot" (`DecodeConfig.fp16_dot`: dot products in
    float16, one conversion from e4m3 rather than bf16's two), "bits" (`bits_k` and
    `bits_v`: e4m3 read by bit moves, `e4m3.e4m3_bits`, V converted as loaded rather than
    gathered byte by byte from shared memory), "bits v" (V's only)."""
    base = FP8_DECODE
    bits = replace(base, bits_k=True, bits_v=True)
    v16 = replace(base, bits_v=True, fp16_dot=True)
    return {"n128 w8": replace(base, num_warps=8),
            "fp16 dot": replace(base, fp16_dot=True),
            "bits": bits,
            "bits fp16 dot": replace(bits, fp16_dot=True),
            "bits s3": replace(bits, num_stages=3),
            "bits n64": replace(bits, block_n=64),
            "bits v": replace(base, bits_v=True),
            "bits v fp16 dot": v16,
            "bits v fp16 dot s3": replace(v16, num_stages=3),
            "bits v fp16 dot n64": replace(v16, block_n=64),
            "bits v fp16 dot n64 s3": replace(v16, block_n=64, num_stages=3),
            "bits v fp16 dot w8": replace(v16, num_warps=8)}


def part_kernel(res: ResultRows, bandwidth: float, sweep: bool) -> None:
    """Decode on a bf16 and an FP8 cache at Qwen3-0.6B's attention shape (16 query heads,
    8 KV heads, head_dim 128, block 16), timed in CUDA graphs rotating over > 1 GiB of KV;
    each cache with its default launch settings, and with `sweep` the FP8 cache also with
    each of `fp8_decode_candidates`."""
    kernels = sibling("kernels")
    hq, hkv, d, bs = 16, 8, 128, 16
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    for batch, context in DECODE_SHAPES:
        seqs_per_copy, blocks = batch, context // bs
        for dtype in (torch.bfloat16, torch.float8_e4m3fn):
            element = torch.empty(0, dtype=dtype).element_size()
            kv_bytes = 2 * batch * context * hkv * d * element
            copies = rotation_copies(kv_bytes, least=1)
            total = seqs_per_copy * copies
            k = torch.randn(total * blocks + 1, bs, hkv, d, device="cuda").to(dtype)
            v = torch.randn_like(k, dtype=torch.float32).to(dtype)
            tables = (torch.randperm(total * blocks, device="cuda").int() + 1).view(total,
                                                                                    blocks)
            lens = torch.full((total,), context, dtype=torch.int32, device="cuda")
            q = torch.randn(total, hq, d, device="cuda", dtype=torch.bfloat16)
            out = torch.empty_like(q)
            scales = None
            configs: dict[str, DecodeConfig | None] = {"default": None}
            if dtype == torch.float8_e4m3fn:
                scales = (torch.ones(hkv, device="cuda"), torch.ones(hkv, device="cuda"))
                if sweep:
                    configs.update(fp8_decode_candidates())

            def call(r, cfg):
                p = slice(r * batch, (r + 1) * batch)
                return lambda: paged_decode(q[p], k, v, tables[p], lens[p], context,
                                            d ** -0.5, out[p], num_sms, cfg, kv_scales=scales)

            for name, cfg in configs.items():
                us = kernels.graph_us([call(r, cfg) for r in range(copies)])
                gbps = kv_bytes / (us * 1e-6) / 1e9
                row = {} if cfg is None else {"config": name, **asdict(cfg)}
                res.add("kernel", kernel="paged_decode", batch=batch, context=context,
                        kv_dtype=str(dtype).removeprefix("torch."), **row, us=round(us, 2),
                        gb_per_s=round(gbps, 1),
                        pct_copy_bw=round(100 * gbps * 1e9 / bandwidth, 1),
                        tokens_per_s=round(batch / (us * 1e-6), 1))
            del k, v, q, out, tables
            torch.cuda.empty_cache()


def part_gemv(res: ResultRows, bandwidth: float, sweep: bool) -> None:
    """FP8 weights at decode batch sizes, Llama-3-8B's projections (K x N) and, at one
    token, its LM head (kept bf16 by `quantization="fp8"`: what quantizing it would save):
    the weight-only kernel (`fp8_linear.weight_only_linear`, method "weight_only"; with
    `sweep` also "weight_only <candidate>" at one token for each of
    `weight_only_candidates`; rows carry the launch settings and the split of K) against
    `_scaled_mm` with per-token activation quantization and against the bf16 matmul, timed
    in CUDA graphs rotating over > 1 GiB of weights (as a decode step reads them)."""
    from pagedserve.kernels.triton.fp8_linear import (WEIGHT_ONLY, WEIGHT_ONLY_ONE_ROW,
                                                      one_row_tiles, quantize_tokens, split_k,
                                                      weight_only_linear)
    from pagedserve.model import fp8

    kernels = sibling("kernels")
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    shapes = {**LLAMA3_8B_PROJECTIONS, "lm_head": LLAMA3_8B_LM_HEAD}

    def scaled_mm(x, w, s):
        x_q, x_s = quantize_tokens(x)
        return torch._scaled_mm(x_q, w.t(), scale_a=x_s, scale_b=s.view(1, -1),
                                out_dtype=torch.bfloat16)

    for name, (k_dim, n_dim) in shapes.items():
        copies = rotation_copies(k_dim * n_dim)
        w = torch.randn(copies, n_dim, k_dim, device="cuda", dtype=torch.bfloat16) * 0.02
        w_q, w_s = fp8.quantize_rows(w.view(-1, k_dim))
        w_q, w_s = w_q.view(copies, n_dim, k_dim), w_s.view(copies, n_dim)
        methods = {"bf16 matmul": (lambda x, r: x @ w[r].t(), 2, None),
                   "scaled_mm": (lambda x, r: scaled_mm(x, w_q[r], w_s[r]), 1, None)}
        configs = {"weight_only": None}  # the defaults: one row, 2-16 rows
        if sweep and name != "lm_head":
            configs.update({f"weight_only {k}": c for k, c in weight_only_candidates().items()})
        for label, cfg in configs.items():
            methods[label] = ((lambda c: lambda x, r: weight_only_linear(
                x, w_q[r], w_s[r], None, c))(cfg), 1, cfg)
        for rows in (1, 4, 16):
            x = torch.randn(rows, k_dim, device="cuda", dtype=torch.bfloat16)
            for label, (fn, element, cfg) in methods.items():
                if rows > 1 and label.startswith("weight_only "):
                    continue  # candidates at batch 1 only: the sweep's time
                if rows > 1 and name == "lm_head":
                    continue
                us = kernels.graph_us([(lambda r: lambda: fn(x, r))(r) for r in range(copies)])
                gbps = n_dim * k_dim * element / (us * 1e-6) / 1e9
                if label == "weight_only":
                    cfg = WEIGHT_ONLY_ONE_ROW if rows == 1 else WEIGHT_ONLY
                launch = {}  # the tiles it launches
                if cfg is not None and rows == 1 and cfg.fma:
                    cfg, splits, _ = one_row_tiles(n_dim, k_dim, num_sms, cfg)
                    launch = {**asdict(cfg), "split_k": splits}
                elif cfg is not None:
                    launch = {**asdict(cfg), "split_k": split_k(n_dim, k_dim, num_sms, cfg)[0]}
                res.add("gemv", layer=name, k=k_dim, n=n_dim, rows=rows, method=label,
                        us=round(us, 2), gb_per_s=round(gbps, 1),
                        pct_copy_bw=round(100 * gbps * 1e9 / bandwidth, 1), **launch)
        del w, w_q, w_s
        torch.cuda.empty_cache()


def weight_only_candidates() -> dict[str, WeightOnlyConfig]:
    """Settings `--sweep` times beside the default (method "weight_only") at one token,
    named by what differs: nN kK the tile's rows and columns before `fp8_linear.narrowed`
    narrows it, pP programs per SM. (Earlier sweeps' tile shapes, splits and the "streamed"
    kernel of 2026-11-26 05:27 are in docs/benchmarks.md and in git.)"""
    one_row = replace(WeightOnlyConfig(), fma=True, min_block_n=4)

    def tile(n, k, p):
        return replace(one_row, block_n=n, block_k=k, programs_per_sm=p)

    return {"n16 k256 p4": tile(16, 256, 4),
            "n16 k256 p6": tile(16, 256, 6),
            "n16 k256 p8": tile(16, 256, 8),
            "n16 k512 p6": tile(16, 512, 6),
            "n8 k512 p6": tile(8, 512, 6)}


def quality_prompts() -> list[list[int]]:
    import random

    rng = random.Random(1)
    return [[rng.randrange(10_000) for _ in range(rng.randint(20, 300))]
            for _ in range(QUALITY_PROMPTS)]


def greedy(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=QUALITY_TOKENS, ignore_eos=True)
    outs = LLM.from_engine(engine).generate(prompts, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@torch.inference_mode()
def forced_logprobs(engine: LLMEngine, tokens: list[int], num_next: int) -> torch.Tensor:
    """log-softmax [num_next, vocab] of the next-token distributions at the last num_next
    positions of `tokens`, from one prefill through the engine's model, backend and cache
    format (its own fresh caches, so the engine's blocks are untouched)."""
    runner = engine.model_runner
    device = runner.device
    layers = runner.model.attention_layers()
    saved = [(a.k_cache, a.v_cache, a.kv_scales) for a in layers]
    bs, n = runner.block_size, len(tokens)
    blocks = -(-n // bs) + 1
    try:
        for a, scales in zip(layers, runner.kv_scales):
            shape = (blocks, bs, a.num_kv_heads, a.head_dim)
            a.k_cache = torch.zeros(shape, dtype=runner.kv_cache_dtype, device=device)
            a.v_cache = torch.zeros(shape, dtype=runner.kv_cache_dtype, device=device)
            a.kv_scales = scales
        meta = AttentionMetadata(
            num_decodes=0, num_decode_tokens=0,
            slot_mapping=torch.arange(bs, bs + n, device=device),
            block_tables=torch.arange(1, blocks, dtype=torch.int32, device=device)[None],
            seq_lens=torch.tensor([n], dtype=torch.int32, device=device),
            query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=device),
            max_query_len=n, max_seq_len=n)
        ids = torch.tensor(tokens, device=device)
        with set_forward_context(meta, runner.backend):
            hidden = runner.model(ids, torch.arange(n, device=device))
        logits = runner.model.compute_logits(hidden[n - 1 - num_next:n - 1])
        return logits.float().log_softmax(-1)
    finally:
        for a, (k, v, s) in zip(layers, saved):
            a.k_cache, a.v_cache, a.kv_scales = k, v, s


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> dict:
    first = statistics.mean(t[0] == r[0] for t, r in zip(tokens, reference))
    whole = statistics.mean(t == r for t, r in zip(tokens, reference))
    prefix = statistics.mean(next((i for i, (a, b) in enumerate(zip(t, r)) if a != b), len(r))
                             / len(r) for t, r in zip(tokens, reference))
    return {"first_token_agreement": round(first, 4),
            f"greedy_agreement_{QUALITY_TOKENS}": round(whole, 4),
            "mean_matching_prefix_fraction": round(prefix, 4)}


def mean_kl(reference: list[torch.Tensor], other: list[torch.Tensor]) -> float:
    """Mean over positions of KL(reference || other), nats."""
    kls = [(r.exp() * (r - o)).sum(-1) for r, o in zip(reference, other)]
    return round(float(torch.cat(kls).mean()), 5)


def part_quality(res: ResultRows, model_dir: str, loaded: LoadedModel) -> None:
    prompts = quality_prompts()
    engine = engine_for(loaded, model_dir)
    reference = greedy(engine, prompts)
    sequences = [p + r for p, r in zip(prompts, reference)]
    ref_lp = [forced_logprobs(engine, s, QUALITY_TOKENS) for s in sequences]
    del engine
    throughput.release()
    common = {"model": "qwen3-0.6b shape, random bf16, LM head x25",
              "prompts": len(prompts), "tokens": QUALITY_TOKENS}
    variants = (("fp8_kv", {}, {"kv_cache_dtype": "fp8"}),
                ("fp8_weights", {"quantization": "fp8"}, {}),
                ("fp8_kv+fp8_weights", {"quantization": "fp8"}, {"kv_cache_dtype": "fp8"}))
    quantized = None
    for name, load_opts, engine_opts in variants:
        if load_opts and quantized is None:
            quantized = LoadedModel.load(EngineConfig(model=model_dir, **load_opts))
        engine = engine_for(quantized if load_opts else loaded, model_dir, **engine_opts)
        tokens = greedy(engine, prompts)
        lp = [forced_logprobs(engine, s, QUALITY_TOKENS) for s in sequences]
        res.add("quality", variant=name, against="pagedserve bf16", **common,
                **agreement(tokens, reference), mean_kl_nats=mean_kl(ref_lp, lp))
        del engine
        throughput.release()
    del quantized
    throughput.release()
    hf_tokens, hf_lp = transformers_reference(model_dir, prompts, sequences)
    res.add("quality", variant="bf16 (noise floor)", against="transformers bf16", **common,
            **agreement(reference, hf_tokens), mean_kl_nats=mean_kl(hf_lp, ref_lp))


@torch.inference_mode()
def transformers_reference(model_dir: str, prompts: list[list[int]],
                           sequences: list[list[int]]) -> tuple[list, list]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16, attn_implementation="sdpa").cuda().eval()
    tokens, lps = [], []
    for prompt, seq in zip(prompts, sequences):
        ids = torch.tensor([prompt], device="cuda")
        out = model.generate(ids, max_new_tokens=QUALITY_TOKENS, do_sample=False,
                             eos_token_id=-1, pad_token_id=0)
        tokens.append(out[0, len(prompt):].tolist())
        logits = model(torch.tensor([seq], device="cuda")).logits[0]
        n = len(seq)
        lps.append(logits[n - 1 - QUALITY_TOKENS:n - 1].float().log_softmax(-1))
    del model
    throughput.release()
    return tokens, lps


# ----------------------------------------------------------------------------------- 8B
def config_folder(config_path: Path, out: Path) -> Path:
    """A folder holding only `config_path` and a byte-level tokenizer: loaded with
    `load_format="dummy"`, the weights are generated on the GPU in seconds, where writing and
    reading 16 GB of random safetensors takes minutes."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(config_path.read_text())
    sibling("make_checkpoint").byte_level_tokenizer().save_pretrained(out)
    return out


def load_dummy(folder: Path, quantization: str | None) -> LoadedModel:
    return LoadedModel.load(EngineConfig(model=str(folder), load_format="dummy",
                                         quantization=quantization))


def tpot_batch1(engine: LLMEngine, tokens: int = 128) -> float:
    """Mean ms per output token after the first, one request of 128 prompt tokens (the
    median of 3 requests)."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens + 1, ignore_eos=True)
    times = []
    for seed in range(3):
        prompt = [(seed * 131 + i * 7) % 10_000 for i in range(128)]
        out = LLM.from_engine(engine).generate([prompt], params, use_tqdm=False)[0]
        m = out.metrics
        times.append((m.finished_time - m.first_token_time) / tokens * 1e3)
    return round(statistics.median(times), 3)


def step_parts(engine: LLMEngine, replays: int = 200) -> dict:
    """GPU time of a batch-1 decode step's parts, apart from the host: the decoder's CUDA
    graph replayed back to back (ms, every KV write sent to no slot) and the LM head on its
    output (ms). Their sum against the TPOT is what the host and the sampler add."""
    runner = engine.model_runner
    runner.buffers.slot_mapping.device.fill_(-1)
    hidden = runner.graphs.replay(1)

    def per_call(fn) -> float:
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            fn()
        end.record()
        torch.cuda.synchronize()
        return round(start.elapsed_time(end) / replays, 3)

    with torch.inference_mode():
        return {"graph_ms": per_call(lambda: runner.graphs.replay(1)),
                "lm_head_ms": per_call(lambda: runner.model.compute_logits(hidden))}


def part_8b(res: ResultRows, root: Path, bandwidth: float, workload: bool = True,
            sweep: bool = False) -> None:
    """Batch-1 TPOT bf16 against FP8 weights; with `sweep` also FP8 weights under each of
    `TPOT_CANDIDATES` (variant "fp8_weights <name>"); with `workload` also workload A, bf16
    against FP8 weights + FP8 KV."""
    model_dir = config_folder(HERE / "configs" / "llama3-8b.json", root / "llama3-8b")
    prompts, out_lens = throughput.workload_prompts()
    common = {"model": "llama-3-8b shape, load_format dummy, bf16"}
    tpot = {}
    variants = (("bf16", None, "auto"), ("fp8_weights", "fp8", "auto"),
                ("fp8_weights+fp8_kv", "fp8", "fp8"))
    for name, quantization, kv in variants if workload else variants[:2]:
        if name != "fp8_weights+fp8_kv":
            loaded = load_dummy(model_dir, quantization)
        engine = engine_for(loaded, str(model_dir), kv_cache_dtype=kv)
        if name != "fp8_weights+fp8_kv":
            tpot[name] = tpot_batch1(engine)
            res.add("8b", measure="tpot_batch1_ms", variant=name, tpot_ms=tpot[name],
                    weight_bytes=weight_bytes(engine), **step_parts(engine), **common,
                    **({"ratio_vs_bf16": round(tpot[name] / tpot["bf16"], 3)}
                       if name != "bf16" else {}))
        if name == "fp8_weights" and sweep:
            del engine
            throughput.release()
            engine = None
            tpot_candidates(res, loaded, str(model_dir), tpot["bf16"], common)
        if name != "fp8_weights" and workload:
            row = workload_a(engine, prompts, out_lens)
            res.add("8b", measure="workload_A", variant=name, **common, **row,
                    kv_blocks=num_blocks(engine),
                    roofline_tok_per_s=roofline(engine, prompts, out_lens, bandwidth))
        del engine
        throughput.release()
        if name == "bf16":
            del loaded
            throughput.release()


def part_8b_skip(res: ResultRows, root: Path) -> None:
    """The 8B shape's batch-1 decoder graph (`step_parts`), bf16 and FP8 weights, with each
    group of small kernels skipped (the norms, RoPE + KV store + attention, SiLU, all): what
    each costs on the step's critical path. The skipped steps compute nonsense; only their
    time is kept. Graphs are captured after a short warm-up, so at a context of ~20 tokens."""
    from pagedserve.attention.triton_backend import TritonBackend
    from pagedserve.model.decoder import RMSNorm

    model_dir = config_folder(HERE / "configs" / "llama3-8b.json", root / "llama3-8b")
    kept_forward = TritonBackend.forward_qkv  # what the layers call: RoPE in the store

    def q_only(self, qkv, num_kv_heads, *args, **kwargs):
        return qkv[:, :qkv.shape[1] - 2 * num_kv_heads].contiguous()

    groups = ((), ("norms",), ("rope+kv store+attention",), ("silu",),
              ("norms", "rope+kv store+attention", "silu"))
    try:
        for quantization in (None, "fp8"):
            loaded = load_dummy(model_dir, quantization)
            mlps = [layer.mlp for layer in loaded.model.layers]
            norms = [m for m in loaded.model.modules() if isinstance(m, RMSNorm)]
            act, norm = mlps[0].act_and_mul, norms[0].add_rms_norm
            for skipped in groups:
                for module in norms:
                    module.add_rms_norm = ((lambda x, r, w, eps: (x, x if r is None else r))
                                           if "norms" in skipped else norm)
                TritonBackend.forward_qkv = (q_only if "rope+kv store+attention" in skipped
                                             else kept_forward)
                for mlp in mlps:  # "silu": the gate half as it is
                    mlp.act_and_mul = ((lambda gu: gu[:, :gu.shape[1] // 2])
                                       if "silu" in skipped else act)
                engine = engine_for(loaded, str(model_dir), max_num_seqs=8)
                res.add("8b-skip", variant=quantization or "bf16", skipped=list(skipped),
                        **step_parts(engine), model="llama-3-8b shape, load_format dummy")
                del engine
                throughput.release()
            del loaded, mlps, norms
            throughput.release()
    finally:
        TritonBackend.forward_qkv = kept_forward


def part_profile(res: ResultRows, loaded: LoadedModel | None, model_dir: str | None,
                 out: Path, root: Path) -> None:
    """Kernel tables of 10 decode steps: the 0.6B shape at batch 256 (bf16 and FP8 KV),
    the 8B shape at batch 1 (bf16 and FP8 weights)."""
    runs = []
    if loaded is not None:
        prompts = throughput.workload_prompts()[0][:256]
        runs += [("0.6b_b256_" + kv, loaded, model_dir, {"kv_cache_dtype": kv}, prompts)
                 for kv in ("auto", "fp8")]
    big = config_folder(HERE / "configs" / "llama3-8b.json", root / "llama3-8b")
    prompt = [[(i * 7) % 10_000 for i in range(128)]]
    runs += [("8b_b1_" + (q or "bf16"), None, str(big), {"quantization": q, "max_num_seqs": 8},
              prompt) for q in (None, "fp8")]
    for name, weights, folder, options, batch in runs:
        if weights is None:
            weights = load_dummy(Path(folder), options.get("quantization"))
        engine = engine_for(weights, folder, **{k: v for k, v in options.items()
                                                if k != "quantization"})
        row = throughput.profile_decode(engine, batch, out / f"profile_{name}.txt")
        res.add("profile", variant=name, **row)
        print((out / f"profile_{name}.txt").read_text(), flush=True)
        del engine, weights
        throughput.release()


def tpot_candidates(res: ResultRows, loaded: LoadedModel, model_dir: str, bf16_ms: float,
                    common: dict) -> None:
    """The FP8-weight model's batch-1 TPOT with the weight-only kernel's one-row setting
    (`fp8_linear.WEIGHT_ONLY_ONE_ROW`, read when the engine captures its graphs) changed as
    each of `TPOT_CANDIDATES` says."""
    from pagedserve.kernels.triton import fp8_linear

    default = fp8_linear.WEIGHT_ONLY_ONE_ROW
    try:
        for label, changes in TPOT_CANDIDATES.items():
            fp8_linear.WEIGHT_ONLY_ONE_ROW = cfg = replace(default, **changes)
            engine = engine_for(loaded, model_dir, max_num_seqs=8)  # fewer graphs to capture
            ms = tpot_batch1(engine)
            res.add("8b", measure="tpot_batch1_ms", variant=f"fp8_weights {label}",
                    tpot_ms=ms, ratio_vs_bf16=round(ms / bf16_ms, 3), **step_parts(engine),
                    **asdict(cfg), **common)
            del engine
            throughput.release()
    finally:
        fp8_linear.WEIGHT_ONLY_ONE_ROW = default


# what --sweep times beside the default: label -> what differs from
# `fp8_linear.WEIGHT_ONLY_ONE_ROW`
TPOT_CANDIDATES = {
    "narrowed to 6 programs per SM": {"programs_per_sm": 6},
    "16x512 tiles narrowed to 6 programs per SM": {"block_k": 512, "programs_per_sm": 6},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for fp8.json")
    parser.add_argument("--parts", default="kv,kernel,gemv,quality,8b")
    parser.add_argument("--sweep", action="store_true", help="kernel and gemv: also time the "
                        "candidate launch settings (FP8 decode tiles, weight-only tiles)")
    parser.add_argument("--decode-split-short", choices=["on", "off"], default="on",
                        help="decode v2 spreads a short sequence over the whole grid "
                        "(`DecodeConfig.split_short`, the default) or not: for A/B runs")
    parser.add_argument("--model", help="a Qwen3-0.6B-shaped checkpoint folder (default: made "
                        "here, random, LM head x25)")
    args = parser.parse_args()
    parts = args.parts.split(",")
    from pagedserve.kernels.triton.attention import decode

    split_short = args.decode_split_short == "on"
    decode.BF16_DECODE = replace(decode.BF16_DECODE, split_short=split_short)
    decode.FP8_DECODE = replace(decode.FP8_DECODE, split_short=split_short)
    res = ResultRows(args.out / "fp8.json")
    res.tags["decode_split_short"] = split_short
    root = Path(tempfile.mkdtemp(prefix="pagedserve-fp8-"))
    bandwidth = throughput.copy_bandwidth()
    model_dir = args.model
    if model_dir is None and {"kv", "order", "quality", "profile"} & set(parts):
        model_dir = str(root / "qwen3-0.6b")
        sibling("make_checkpoint").make_checkpoint(
            HERE / "configs" / "qwen3-0.6b.json", Path(model_dir), torch.bfloat16, 0, "bytes",
            25.0)
    loaded = LoadedModel.load(EngineConfig(model=model_dir)) if model_dir else None
    if "kv" in parts:
        part_kv(res, loaded, model_dir, bandwidth, args.sweep)
    if "order" in parts:
        part_order(res, loaded, model_dir)
    if "kernel" in parts:
        part_kernel(res, bandwidth, args.sweep)
    if "gemv" in parts:
        part_gemv(res, bandwidth, args.sweep)
    if "quality" in parts:
        part_quality(res, model_dir, loaded)
    if "profile" in parts:
        part_profile(res, loaded, model_dir, args.out, root)
    del loaded
    throughput.release()
    if "8b" in parts or "8b-tpot" in parts:
        part_8b(res, root, bandwidth, workload="8b" in parts, sweep=args.sweep)
    if "8b-skip" in parts:
        part_8b_skip(res, root)
    print("summary:", flush=True)
    for row in res.rows:
        keys = ("variant", "kv_cache_dtype", "decode_order", "kv_dtype", "batch", "context",
                "config", "layer", "rows", "method", "split_k", "us", "measure",
                "output_tok_per_s", "roofline_tok_per_s", "kv_blocks", "gb_per_s",
                "pct_copy_bw", "tpot_ms", "ratio_vs_bf16", "skipped", "graph_ms",
                "first_token_agreement", f"greedy_agreement_{QUALITY_TOKENS}", "mean_kl_nats")
        print(row["part"], {k: row[k] for k in keys if k in row}, flush=True)
    for line in fastest(res.rows):
        print(line, flush=True)


def fastest(rows: list[dict]) -> list[str]:
    """One line per measured case with the fastest FP8 setting against the default's time:
    decode per (batch, context), weight-only per (layer, tokens), the 8B TPOT, workload A."""
    groups: dict[tuple, list[tuple[float, str]]] = {}
    for r in rows:
        if r["part"] == "kernel" and r["kv_dtype"] == "float8_e4m3fn":
            key, t, name = ("decode", r["batch"], r["context"]), r["us"], r.get("config")
        elif r["part"] == "gemv" and r["method"].startswith("weight_only"):
            key, t, name = ("gemv", r["layer"], r["rows"]), r["us"], r["method"]
        elif r["part"] == "8b" and r["variant"].startswith("fp8_weights") and "tpot_ms" in r:
            key, t, name = ("8b tpot",), r["tpot_ms"], r["variant"]
        elif r["part"] == "kv" and r["kv_cache_dtype"] == "fp8_e4m3":
            key, t, name = ("workload A fp8 kv",), -r["output_tok_per_s"], r.get("config")
        else:
            continue
        groups.setdefault(key, []).append((t, name or "default"))
    lines = []
    for key, timed in groups.items():
        best_t, best = min(timed)
        default_t = next((t for t, n in timed if n in ("default", "weight_only",
                                                         "fp8_weights")), None)
        lines.append(f"fastest {' '.join(map(str, key))}: {best!r} {abs(best_t)} "
                     f"(default {None if default_t is None else abs(default_t)})")
    return lines


if __name__ == "__main__":
    main()
