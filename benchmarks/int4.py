"""4-bit (and 8-bit) integer weights on a CUDA GPU: the Llama-3-8B shape, one run.

    PYTHONPATH=. python benchmarks/int4.py --out DIR [--parts gemv,gemm,memory,8b] [--sweep]
        [--append]

Parts (all by default; about 8 minutes on an H100 with a cold Triton cache):
  gemv    Llama-3-8B's projections (K x N: qkv, o, gate_up, down) at 1 to 256 rows:
          `kernels/triton/int_linear.linear` on W4A16 group 128 (symmetric, and with zero
          points as GPTQ / AWQ / asymmetric compressed-tensors load) and W8A16 group 128,
          against the bf16 matmul; time, packed bytes over time and, at 1 row, % of the copy
          bandwidth. Timed in CUDA graphs rotating over > 1 GiB of weights (as a decode step
          reads them). With --sweep also each GEMV candidate of `GEMV_CANDIDATES` at 1 row.
  gemm    decode batches (1 to 256 rows) on Llama-3-8B's projections, W4A16 group 128 in
          torch's int4 layout as the engine keeps it: the fused GEMM
          (`kernels/triton/int4pack_gemm.matmul`, tiles by its `config_for` rule) against the
          dequantization into a bf16 scratch tensor + cuBLAS, torch's int4 kernel and the bf16
          matmul, in the same graphs as `gemv`; each row's `max_rel_err` is the fused output
          against dequantize + cuBLAS. With --sweep also each of `GEMM_CANDIDATES` (tiles,
          split-K, warps, stages) whose M tile the rows fill, to place the rule.
  memory  the weights' device bytes for the 8B shape per format (bf16, W4A16 g128 sym /
          with zeros, W4A16 per channel, W8A16 g128): the checkpoint's packing (computed)
          and what the engine keeps (a 4-bit weight torch's int4 kernel reads: that layout
          alone), measured on one layer's projections quantized and prepared on the GPU
  8b      the 8B shape (random bf16 weights made on the GPU, `load_format dummy`), its dense
          projections quantized on the GPU by round to nearest to W4A16 group 128 (the
          layout a compressed-tensors / GPTQ / AWQ checkpoint loads to; the values do not
          change the speed): batch-1 TPOT against bf16 in the same run, the decoder graph's
          and the LM head's GPU time, and workload A (256 requests) for both

Writes DIR/int4.json (docs/results style: one row per figure) and prints each row.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import asdict, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(HERE.parent))  # benchmarks.common, with or without PYTHONPATH=.

import torch  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks.common import (LLAMA3_8B_PROJECTIONS, ResultRows,  # noqa: E402
                               rotation_copies, sibling)
from pagedserve.kernels import int4pack  # noqa: E402
from pagedserve.kernels.triton import int4pack_gemm, int_linear  # noqa: E402
from pagedserve.kernels.triton.fp8_linear import num_sms  # noqa: E402
from pagedserve.kernels.triton.int4pack_gemm import Int4GemmConfig  # noqa: E402
from pagedserve.kernels.weight_formats import IntWeight, pack_codes  # noqa: E402
from pagedserve.model.int_weights import IntMatmul  # noqa: E402

SHAPES = LLAMA3_8B_PROJECTIONS
ROWS = (1, 4, 16, 32, 64, 256)
# a weight in torch's int4 layout on torch's kernel at any row count: where it stops paying
# against the fused GEMM and the dequantization for cuBLAS (`int4pack_max_rows`)
ALL_TORCH_KERNEL = replace(int_linear.DEFAULT, int4pack_max_rows=1 << 30)
GEMV_CANDIDATES = {f"gemv n{n} k{k} w{w}": replace(int_linear.DEFAULT, int_gemv_block_n=n,
                                                   int_gemv_block_k=k, int_gemv_warps=w)
                   for n, k, w in [(4, 256, 2), (4, 512, 2), (8, 256, 4), (8, 512, 4),
                                   (4, 1024, 4), (16, 512, 8)]}

GEMM_ROWS = (1, 4, 8, 16, 32, 64, 128, 256)  # below 17: where torch's kernel stops paying
# (block_m, block_n, block_k, split_k, warps, stages); each fits an H100's shared memory
GEMM_CANDIDATES = [Int4GemmConfig(*c) for c in [
    (16, 64, 128, 1, 4, 4), (16, 64, 128, 2, 4, 4), (16, 64, 128, 4, 4, 4),
    (16, 128, 128, 1, 4, 4), (16, 64, 256, 1, 4, 3), (32, 64, 128, 1, 4, 4),
    (32, 64, 128, 2, 4, 4), (32, 128, 128, 1, 4, 3), (64, 64, 128, 1, 4, 3),
    (64, 64, 128, 2, 4, 3), (64, 128, 128, 1, 8, 3), (64, 128, 128, 1, 4, 4),
    (64, 256, 128, 1, 8, 3), (128, 64, 128, 1, 4, 3), (128, 64, 128, 2, 4, 3),
    (128, 128, 128, 1, 8, 3), (128, 128, 128, 1, 8, 4)]]


fp8_bench = sibling("fp8")
kernels = sibling("kernels")
throughput = fp8_bench.throughput


def quantize(w: torch.Tensor, bits: int, group: int, zeros: bool) -> IntWeight:
    """Round to nearest, on w's device: w [N, K] -> an `IntWeight` (group 0: per channel)."""
    n, k = w.shape
    group = group or k
    top = (1 << bits) - 1
    g = w.float().view(n, k // group, group)
    if zeros:
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scale = ((hi - lo) / top).clamp(min=1e-8)
        zero = torch.round(-lo / scale).clamp(0, top)
    else:
        scale = g.abs().amax(-1).clamp(min=1e-8) / ((top - 1) / 2)
        zero = torch.full_like(scale, 1 << (bits - 1))
    codes = (torch.round(g / scale[..., None]) + zero[..., None]).clamp(0, top).view(n, k)
    packed = pack_codes(codes.to(torch.int32), bits)
    return IntWeight(packed, scale.to(w.dtype), zero.to(w.dtype) if zeros else None, None,
                     bits, group, k)


def weight_bytes(w: IntWeight | int4pack.Int4Weight) -> int:
    tensors = ((w.packed, w.scales_and_offsets) if isinstance(w, int4pack.Int4Weight)
               else (w.qweight, w.scales, w.zeros))
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


FORMATS = {"w4a16 g128": (4, 128, False), "w4a16 g128 zeros": (4, 128, True),
           "w8a16 g128": (8, 128, False)}


def part_gemv(res: ResultRows, bandwidth: float, sweep: bool) -> None:
    for name, (k_dim, n_dim) in SHAPES.items():
        weights = {}
        for label, (bits, group, zeros) in FORMATS.items():
            one = quantize(torch.randn(n_dim, k_dim, device="cuda", dtype=torch.bfloat16)
                           * 0.02, bits, group, zeros)
            copies = rotation_copies(weight_bytes(one))
            weights[label] = [one] + [IntWeight(one.qweight.clone(), one.scales.clone(),
                                                None if one.zeros is None else one.zeros.clone(),
                                                None, bits, group, k_dim)
                                      for _ in range(copies - 1)]
        prepared = {label: [int_linear.prepare(w) for w in ws] for label, ws in weights.items()
                    if int4pack.fits(ws[0])}
        copies = rotation_copies(n_dim * k_dim * 2)
        bf16 = torch.randn(copies, n_dim, k_dim, device="cuda", dtype=torch.bfloat16) * 0.02
        for rows in ROWS:
            x = torch.randn(rows, k_dim, device="cuda", dtype=torch.bfloat16)
            methods = {"bf16 matmul": ([lambda r=r: x @ bf16[r].t() for r in range(copies)],
                                       n_dim * k_dim * 2, None)}
            for label, ws in weights.items():
                methods[label] = ([lambda w=w: int_linear.linear(x, w) for w in ws],
                                  weight_bytes(ws[0]), int_linear.DEFAULT)
            for label, ws in prepared.items():  # as the engine loads them (`prepare`)
                methods[f"{label} prepared"] = (
                    [lambda w=w: int_linear.int4pack_linear(x, w) for w in ws],
                    weight_bytes(ws[0]), int_linear.DEFAULT)
                if rows > int_linear.DEFAULT.int4pack_max_rows:  # torch's kernel past it
                    methods[f"{label} prepared torch kernel"] = (
                        [lambda w=w: int_linear.int4pack_linear(x, w, None, ALL_TORCH_KERNEL)
                         for w in ws], weight_bytes(ws[0]), ALL_TORCH_KERNEL)
            if sweep and rows == 1:
                ws = weights["w4a16 g128"]
                for label, cfg in GEMV_CANDIDATES.items():
                    methods[f"w4a16 g128 {label}"] = (
                        [lambda w=w, c=cfg: int_linear.linear(x, w, None, c) for w in ws],
                        weight_bytes(ws[0]), cfg)
            for label, (fns, nbytes, cfg) in methods.items():
                us = kernels.graph_us(fns)
                gbps = nbytes / (us * 1e-6) / 1e9
                row = dict(layer=name, k=k_dim, n=n_dim, rows=rows, method=label,
                           us=round(us, 2), weight_mb=round(nbytes / 2**20, 2),
                           gb_per_s=round(gbps, 1))
                if rows == 1:
                    row["pct_copy_bw"] = round(100 * gbps * 1e9 / bandwidth, 1)
                if cfg is not None:
                    row.update(asdict(cfg))
                res.add("gemv", **row)
        del weights, bf16
        torch.cuda.empty_cache()


def part_gemm(res: ResultRows, sweep: bool) -> None:
    """The fused GEMM on torch's int4 layout against the paths a decode batch has without it
    (module docstring, `gemm`)."""
    for name, (k_dim, n_dim) in SHAPES.items():
        one = int4pack.pack(quantize(torch.randn(n_dim, k_dim, device="cuda",
                                                 dtype=torch.bfloat16) * 0.02, 4, 128, False))
        ws = [one] + [int4pack.Int4Weight(one.packed.clone(), one.scales_and_offsets.clone(),
                                          one.group_size, one.in_features)
                      for _ in range(rotation_copies(weight_bytes(one)) - 1)]
        copies = rotation_copies(n_dim * k_dim * 2)
        bf16 = torch.randn(copies, n_dim, k_dim, device="cuda", dtype=torch.bfloat16) * 0.02
        for rows in GEMM_ROWS:
            x = torch.randn(rows, k_dim, device="cuda", dtype=torch.bfloat16)
            reference = torch.nn.functional.linear(x, int_linear.dequantize(one, x.dtype))
            methods = {
                "bf16 matmul": ([lambda r=r: x @ bf16[r].t() for r in range(copies)], None),
                "w4a16 g128 dequant + cublas": (
                    [lambda w=w: torch.nn.functional.linear(
                        x, int_linear.dequantize(w, x.dtype)) for w in ws], None),
                "w4a16 g128 torch kernel": ([lambda w=w: int4pack.matmul(x, w) for w in ws],
                                            None),
                "w4a16 g128 fused": ([lambda w=w: int4pack_gemm.matmul(x, w) for w in ws],
                                     int4pack_gemm.config_for(
                                         rows, n_dim, k_dim, num_sms(x.device))),
            }
            for cfg in (c for c in GEMM_CANDIDATES if sweep and c.block_m <= max(16, rows)):
                label = (f"w4a16 g128 fused m{cfg.block_m} n{cfg.block_n} k{cfg.block_k} "
                         f"s{cfg.split_k} w{cfg.warps} st{cfg.stages}")
                methods[label] = ([lambda w=w, c=cfg: int4pack_gemm.matmul(x, w, None, c)
                                   for w in ws], cfg)
            bf16_us = None
            for label, (fns, cfg) in methods.items():
                us = kernels.graph_us(fns)
                bf16_us = bf16_us or us
                nbytes = n_dim * k_dim * 2 if label == "bf16 matmul" else weight_bytes(one)
                row = dict(layer=name, k=k_dim, n=n_dim, rows=rows, method=label,
                           us=round(us, 2), ratio_vs_bf16=round(us / bf16_us, 3),
                           gb_per_s=round(nbytes / (us * 1e-6) / 1e9, 1))
                if "fused" in label:
                    got = fns[0]().float()  # ws[0] is `one`
                    err = (got - reference.float()).abs().max() / reference.float().abs().max()
                    row.update(max_rel_err=float(f"{float(err):.2e}"), **asdict(cfg))
                res.add("gemm", **row)
        del ws, bf16, one
        torch.cuda.empty_cache()


def part_memory(res: ResultRows) -> None:
    """Device bytes of the 8B shape's weights per format: the dense projections packed, the
    embedding, LM head and norms in bf16. `weight_gb`: the checkpoint's packing, computed;
    `kept_gb`: what the engine keeps, measured (`kept_layer`) and taken over the layers."""
    config = json.loads((HERE / "configs" / "llama3-8b.json").read_text())
    h, i, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    projections = [(h, h + 2 * kv), (h, h), (h, 2 * i), (i, h)]  # (K, N)
    float_bytes = 2 * (2 * config["vocab_size"] * h + (2 * layers + 1) * h)
    bf16 = float_bytes + 2 * sum(k * n for k, n in projections) * layers
    res.add("memory", format="bf16", weight_gb=round(bf16 / 1e9, 3))
    for label, (bits, group, zeros) in {**FORMATS, "w4a16 channel": (4, 0, False)}.items():
        per_layer = 0
        for k, n in projections:
            groups = 1 if group == 0 else k // group
            per_layer += n * k * bits // 8 + n * groups * 2 * (2 if zeros else 1)
        kept, allocated, layout = kept_layer(projections, bits, group, zeros)
        res.add("memory", format=label,
                weight_gb=round((float_bytes + per_layer * layers) / 1e9, 3),
                kept_gb=round((float_bytes + kept * layers) / 1e9, 3),
                allocated_gb=round((float_bytes + allocated * layers) / 1e9, 3),
                kept_layout=layout, ratio_vs_bf16=round((float_bytes + kept * layers) / bf16, 3))


def kept_layer(projections, bits: int, group: int, zeros: bool) -> tuple[int, int, str]:
    """One decoder layer's projections quantized on the GPU and prepared as the loader
    prepares them (`int_linear.prepare`, the checkpoint's packed tensors then dropped where
    it converted them): (bytes of the tensors kept, the allocator's growth while they are
    held, the layout kept)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    kept = []
    for k, n in projections:
        w = quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02, bits, group,
                     zeros)
        kept.append(int_linear.prepare(w))
        del w
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated() - before
    layout = ("torch int4" if all(isinstance(w, int4pack.Int4Weight) for w in kept)
              else "checkpoint")
    nbytes = sum(weight_bytes(w) for w in kept)
    del kept
    torch.cuda.empty_cache()
    return nbytes, allocated, layout


def pack_model(model, bits: int = 4, group: int = 128) -> None:
    """The dense projections of a loaded bf16 model replaced by their W4A16 round-to-nearest
    packing, as the loader leaves an integer checkpoint's layers (`int_weights`)."""
    for linear in model.dense_linears():
        w = quantize(linear.weight.detach(), bits, group, False)
        matmul, prepared = int_linear.for_layer(w)
        linear.weight = None
        if prepared is w:  # else torch's int4 layout is the only copy, as the loader keeps
            linear.qweight = nn.Parameter(w.qweight, requires_grad=False)
            linear.scales = nn.Parameter(w.scales, requires_grad=False)
        linear.matmul = IntMatmul(matmul, prepared)
        del w
    model.quantization = f"w{bits}a16"
    torch.cuda.empty_cache()


def part_8b(res: ResultRows, root: Path, bandwidth: float, workload: bool) -> None:
    model_dir = fp8_bench.config_folder(HERE / "configs" / "llama3-8b.json", root / "llama3-8b")
    prompts, out_lens = throughput.workload_prompts()
    common = {"model": "llama-3-8b shape, load_format dummy, bf16 activations"}
    tpot = {}
    for name in ("bf16", "w4a16 g128"):
        loaded = fp8_bench.load_dummy(model_dir, None)
        if name != "bf16":
            pack_model(loaded.model)
        engine = fp8_bench.engine_for(loaded, str(model_dir))
        tpot[name] = fp8_bench.tpot_batch1(engine)
        res.add("8b", measure="tpot_batch1_ms", variant=name, tpot_ms=tpot[name],
                weight_bytes=fp8_bench.weight_bytes(engine), **fp8_bench.step_parts(engine),
                **common, **({"ratio_vs_bf16": round(tpot[name] / tpot["bf16"], 3)}
                             if name != "bf16" else {}))
        if workload:
            row = fp8_bench.workload_a(engine, prompts, out_lens)
            res.add("8b", measure="workload_A", variant=name, **common, **row,
                    kv_blocks=fp8_bench.num_blocks(engine),
                    roofline_tok_per_s=fp8_bench.roofline(engine, prompts, out_lens,
                                                          bandwidth))
        del engine, loaded
        throughput.release()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for int4.json")
    parser.add_argument("--parts", default="gemv,gemm,memory,8b")
    parser.add_argument("--sweep", action="store_true",
                        help="gemv: also the GEMV candidates; gemm: the GEMM candidates")
    parser.add_argument("--no-workload", action="store_true", help="8b: TPOT only")
    parser.add_argument("--append", action="store_true", help="keep the other parts' rows "
                        "already in DIR/int4.json (a run split in parts, moe_int4.py's rows); "
                        "the parts run replace their own")
    args = parser.parse_args()
    parts = args.parts.split(",")
    res = ResultRows(args.out / "int4.json",
                     keep=lambda row: args.append and row.get("part") not in parts)
    bandwidth = throughput.copy_bandwidth()
    if "memory" in parts:
        part_memory(res)
    if "gemv" in parts:
        part_gemv(res, bandwidth, args.sweep)
    if "gemm" in parts:
        part_gemm(res, args.sweep)
    if "8b" in parts:
        part_8b(res, Path(tempfile.mkdtemp(prefix="pagedserve-int4-")), bandwidth,
                not args.no_workload)
    print("summary:", flush=True)
    for row in res.rows:
        keys = ("format", "weight_gb", "kept_gb", "allocated_gb", "kept_layout", "layer",
                "rows", "method", "us", "gb_per_s", "pct_copy_bw", "variant", "measure",
                "tpot_ms", "ratio_vs_bf16", "output_tok_per_s", "graph_ms")
        print(row["part"], {k: row[k] for k in keys if k in row}, flush=True)


if __name__ == "__main__":
    main()
