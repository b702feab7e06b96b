"""The CPU engine's decode step: its GEMMs on each kernel, and where an engine step goes.

Run from the repo root: `python -m benchmarks.cpu_kernels [--rows 16] [--repeats 15]`.

  gemms   one decode step's 120 layer GEMMs + LM head of the default model (SmolLM2-135M:
          hidden 576, intermediate 1536, 30 layers, vocab 49152) at `--rows` rows, weights
          cold (538 MB in float32, more than any cache), interleaved; min and median:
          float32: oneDNN prepacked (`_linear_pointwise`) and the native kernel;
          quantized (the fast mode's weights: Q4_1 layers, Q8_0 head, as the default GGUF):
          the native kernel (`kernels/native/quant.c`, int8 activations) and torch's own CPU kernels
          on the nearest formats they take, `_weight_int8pack_mm` (int8 weights, a scale per
          row, float activations) and `_weight_int4pack_mm_for_cpu` (4-bit, groups of 32);
          bfloat16 (`--dtype bfloat16`'s weights, 269 MB per copy, bfloat16 activations): the
          native kernel (`kernels/native/linear.c`, AMX-BF16, where this CPU and build have it),
          oneDNN through `F.linear` (what the engine ran before it: `aten::mm`/`addmm`) and
          oneDNN prepacked (`_linear_pointwise`).
          `--kinds` picks some of float32, quantized, bfloat16 (all by default).
  step    the bench's workload (16 chat prompts, greedy; `--dtype auto` is the fast mode,
          `float32` the exact path, `bfloat16` an HF checkpoint's bf16 mode, with `--model
          DIR`) through the engine after a warm-up request: the prefill step,
          then the mean of 20 decode steps, split into the GEMMs (native kernel calls and
          `F.linear`), attention (the backend's forward) and the LM head.

The dev box is shared: compare only figures of one run.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Callable

import torch
import torch.nn.functional as F

from gguf import GGMLQuantizationType as T
from gguf.quants import quantize

from pagedserve.kernels.native import linear as native_linear
from pagedserve.kernels.native.quant import QuantizedLinear
from pagedserve.model.gguf_blocks import from_gguf

HIDDEN, INTERMEDIATE, LAYERS, VOCAB = 576, 1536, 30, 49152
LAYER_SHAPES = [(960, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN),
                (HIDDEN, INTERMEDIATE)]  # (out, in): qkv, o, gate_up, down


KINDS = ("float32", "quantized", "bfloat16")


def bench_gemms(rows: int, repeats: int, kinds: list[str]) -> None:
    shapes = LAYER_SHAPES * LAYERS + [(VOCAB, HIDDEN)]
    weights = [torch.randn(n, k) * 0.05 for n, k in shapes]
    inputs = {k: torch.randn(rows, k) for _, k in shapes}
    runs: dict[str, Callable[[], None]] = {}
    if "float32" in kinds:
        runs.update(_float32_runs(shapes, weights, inputs))
    if "quantized" in kinds:
        runs.update(_quantized_runs(shapes, weights, inputs))
    if "bfloat16" in kinds:
        runs.update(_bfloat16_runs(shapes, weights, inputs))
    times = defaultdict(list)
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - start) * 1000)
    print(f"decode-step GEMMs at {rows} rows, {torch.get_num_threads()} threads:")
    for name, values in times.items():
        print(f"  {name:18s} min {min(values):6.1f} ms   median {statistics.median(values):6.1f} ms")


def _float32_runs(shapes, weights, inputs) -> dict[str, Callable[[], None]]:
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in weights]
    native = [native_linear.pack(w) for w in weights]
    return {
        "f32 oneDNN packed": lambda: [torch.ops.mkldnn._linear_pointwise(
            inputs[k], p, None, "none", [], "") for (_, k), p in zip(shapes, onednn)],
        "f32 native": lambda: [native_linear.linear(inputs[k], p, n)
                               for (n, k), p in zip(shapes, native)],
    }


def _quantized_runs(shapes, weights, inputs) -> dict[str, Callable[[], None]]:
    quantized = [QuantizedLinear([from_gguf(quantize(w.numpy(), kind), kind)])
                 for w, kind in zip(weights, [T.Q4_1] * (len(shapes) - 1) + [T.Q8_0])]
    int8 = [_torch_int8(w) for w in weights]
    int4 = [_torch_int4(w) for w in weights]
    return {
        "quant native": lambda: [q(inputs[k]) for (_, k), q in zip(shapes, quantized)],
        "torch int8pack": lambda: [torch._weight_int8pack_mm(inputs[k], q, s)
                                   for (_, k), (q, s) in zip(shapes, int8)],
        "torch int4pack": lambda: [torch._weight_int4pack_mm_for_cpu(inputs[k], q, 32, sz)
                                   for (_, k), (q, sz) in zip(shapes, int4)],
    }


def _bfloat16_runs(shapes, weights, inputs) -> dict[str, Callable[[], None]]:
    weights = [w.bfloat16() for w in weights]
    inputs = {k: x.bfloat16() for k, x in inputs.items()}
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in weights]
    runs = {
        "bf16 F.linear": lambda: [F.linear(inputs[k], w) for (_, k), w in zip(shapes, weights)],
        "bf16 oneDNN packed": lambda: [torch.ops.mkldnn._linear_pointwise(
            inputs[k], p, None, "none", [], "") for (_, k), p in zip(shapes, onednn)],
    }
    if native_linear.available(torch.bfloat16):
        native = [native_linear.pack(w) for w in weights]
        runs["bf16 native"] = lambda: [native_linear.linear(inputs[k], p, n)
                                       for (n, k), p in zip(shapes, native)]
    else:
        print("no native bfloat16 kernel here (needs the avx512 build and AMX-BF16)")
    return runs


def _torch_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.abs().amax(1) / 127
    return torch.round(w / scale[:, None]).to(torch.int8), scale


def _torch_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w.shape
    groups = w.view(n, k // 32, 32)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = ((high - low) / 15).clamp(min=1e-8)
    q = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
    # torch's zero point is the value at the mid-point code 8
    zeros = low + 8 * scale
    packed = torch._convert_weight_to_int4pack_for_cpu(q.view(n, k), 1)
    return packed, torch.stack([scale.T, zeros.T], -1).contiguous()


def bench_step(dtype: str, model: str | None) -> None:
    from pagedserve.sampling_params import SamplingParams
    from pagedserve.entrypoints.cli import _build_engine, bench_prompts, build_parser

    args = build_parser(["bench"]).parse_args(["bench", "--kv-cache-memory", "256M",
                                               "--dtype", dtype,
                                               *(["--model", model] if model else [])])
    engine = _build_engine(args)
    prompts = bench_prompts(args, engine.tokenizer)
    spent: dict[str, float] = defaultdict(float)

    def timed(owner, name: str, label: str) -> None:
        inner = getattr(owner, name)

        def wrapper(*a, **kw):
            start = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                spent[label] += time.perf_counter() - start
        setattr(owner, name, wrapper)

    runner = engine.model_runner
    timed(native_linear, "linear", "GEMMs (incl. LM head)")
    timed(F, "linear", "GEMMs (incl. LM head)")
    timed(QuantizedLinear, "__call__", "GEMMs (incl. LM head)")
    timed(runner.backend, "forward", "attention")
    timed(runner.model, "compute_logits", "LM head")
    engine.add_request("warmup", None, SamplingParams(max_tokens=2), prompt_token_ids=[1, 2, 3])
    while engine.has_unfinished_requests():  # packs the weights, as the bench's warm-up does
        engine.step()
    engine.kv_cache_manager.reset_prefix_cache()
    spent.clear()
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"bench-{i}", None, params, prompt_token_ids=ids)

    def report(title: str, steps: int) -> None:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        print(f"{title}: {(time.perf_counter() - start) / steps * 1000:.1f} ms "
              f"({type(runner.backend).__name__})")
        for label, seconds in spent.items():
            print(f"  {label:22s} {seconds / steps * 1000:6.1f} ms")
        spent.clear()

    report("prefill step", 1)
    for _ in range(3):
        engine.step()
    spent.clear()
    report("decode step (mean of 20)", 20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16, help="rows of the GEMM inputs")
    parser.add_argument("--repeats", type=int, default=15, help="interleaved timed rounds")
    parser.add_argument("--only", choices=["gemms", "step"], help="run one part")
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS),
                        help="the GEMMs' weight kinds")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="the step's mode: auto = fast (quantized), float32 = exact")
    parser.add_argument("--model", help="the step's model (default: the bench's)")
    args = parser.parse_args()
    if not native_linear.available():
        raise SystemExit("the native kernels are unavailable here "
                         "(see pagedserve.kernels.native.build)")
    if args.only != "step":
        bench_gemms(args.rows, args.repeats, args.kinds)
    if args.only != "gemms":
        bench_step(args.dtype, args.model)


if __name__ == "__main__":
    main()
