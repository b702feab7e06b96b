"""Paged attention kernels (and the dense GEMV) on a CUDA GPU: correctness in bf16/fp16, then
timings.

    PYTHONPATH=. python benchmarks/kernels.py --out DIR [--sweep v1 v2 gemv]
                                              [--only [decode prefill cache gemv]] [--no-grid]

Measures, in one run: device-to-device copy bandwidth (the ceiling), the attention kernels'
correctness (with an attention part or sweep), paged decode v1 / v2 / dispatch against torch
SDPA on contiguous K/V and the naive paged path (gather + SDPA) at Qwen3-0.6B's attention
shape (16 query heads, 8 KV heads, head_dim 128, bf16, block 16), v1 vs v2 by context length,
paged prefill against SDPA's flash path on causal shapes, and copy_blocks / swap_blocks
bandwidth; with `--only gemv`, the dense bf16 GEMV (`kernels/triton/dense_gemv.py`) against
torch.mm at one row (the only row count the models give it: cuBLAS is faster from two) on
Llama-3-8B's projections as one rank holds them at TP=1/2/4 (µs, % of copy bandwidth, in
CUDA graphs). --sweep also times v1's / v2's launch configurations, or the GEMV's tile
candidates at one row. Writes DIR/kernels.json (docs/results format)
and DIR/kernels_raw.json; prints tables.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, replace

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from pagedserve.kernels.triton.attention import (DecodeConfig, PrefillConfig, paged_decode,
                                          paged_decode_v1, paged_decode_v2, paged_prefill,
                                          store_kv, use_v2)
from pagedserve.kernels.triton import dense_gemv
from pagedserve.kernels.triton.fp8_linear import WeightOnlyConfig
from pagedserve.attention.torch_ref import TorchRefBackend
from pagedserve.attention.triton_backend import TritonBackend
from tests.attention.paged_case import make_case

HQ, HKV, D, BS, DTYPE = 16, 8, 128, 16, torch.bfloat16
DECODE_SHAPES = [(1, 1024), (1, 8192), (1, 32768), (16, 2048), (64, 1024), (64, 4096),
                 (256, 1024), (32, 16384)]
ROTATE_BYTES = 256 * 2**20  # 5x the H100's 50 MB L2
PREFILL_SHAPES = [(1, 1024), (1, 4096), (4, 2048), (1, 8192), (8, 1024)]
PARTS = ["decode", "prefill", "cache"]  # the default; "gemv" on request


def bench_us(fn) -> float:
    """Eager time per call, L2 flushed between calls (do_bench), Python launch cost included."""
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def graph_us(fns: list[Callable[[], object]], reps: int = 30) -> float:
    """GPU time per call: the calls captured back to back in one CUDA graph (as the engine
    runs decode), median replay time over len(fns). Each fn touches different memory, so
    rotating through them keeps the KV from being served by L2."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in fns:  # compile and warm up outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return statistics.median(times) * 1e3 / len(fns)


def log(*args) -> None:
    print(*args, flush=True)


# ---------------------------------------------------------------- correctness
def check_correctness() -> list[dict]:
    """Triton backend vs the PyTorch reference on the GPU, production tile sizes."""
    rows = []
    seqs = [(0, 1), (15, 1), (700, 1), (3000, 1), (0, 300), (100, 37), (1000, 129)]
    combos = [(torch.bfloat16, hq, hkv, hd, bs)
              for hq, hkv in ((16, 16), (16, 8), (32, 8), (32, 4))
              for hd, bs in ((64, 16), (128, 16), (128, 32))]
    combos += [(torch.float16, 16, 8, 128, 16), (torch.float16, 32, 4, 64, 32)]
    for dtype, hq, hkv, head_dim, block_size in combos:
        seed = torch.seed() % 2**31
        case = make_case(seqs, hq, hkv, head_dim, block_size, dtype=dtype, seed=seed,
                         prefix_hit_rows=2, device="cuda")
        ref_k, ref_v = case.k_cache.clone(), case.v_cache.clone()
        ref = TorchRefBackend().forward(case.q, case.k, case.v, ref_k, ref_v,
                                        case.meta, case.scale)
        out = TritonBackend().forward(case.q, case.k, case.v, case.k_cache,
                                      case.v_cache, case.meta, case.scale)
        m = case.meta
        v2 = torch.full_like(case.q[:4], float("nan"))
        paged_decode_v2(case.q[:4], case.k_cache, case.v_cache, m.block_tables,
                        m.seq_lens, m.max_seq_len, case.scale, v2,
                        DecodeConfig(partition=256))
        expected = case.expected.cuda()
        rel = lambda x, y: float((x.double() - y).norm() / y.norm())  # noqa: E731
        row = {"dtype": str(dtype), "hq": hq, "hkv": hkv, "head_dim": head_dim,
               "block_size": block_size, "seed": seed,
               "rel_err_vs_dense": rel(out, expected),
               "rel_err_vs_torch_ref": rel(out, ref.double()),
               "rel_err_v2_vs_dense": rel(v2, expected[:4]),
               "nan": bool(out.isnan().any() or v2.isnan().any())}
        rows.append(row)
    rows.append(v2_graph_replays())
    worst = max(max(r["rel_err_vs_dense"], r["rel_err_v2_vs_dense"]) for r in rows)
    ok = worst < 1e-2 and not any(r["nan"] for r in rows)
    log(f"correctness: {len(rows)} cases, worst rel err {worst:.2e}, {'OK' if ok else 'FAIL'}")
    if not ok:
        for r in rows:
            log(r)
    return rows


def v2_graph_replays(replays: int = 4) -> dict:
    """v2 captured in a CUDA graph as the engine runs it (grid sized for a longer context than
    any sequence), replayed into NaN-poisoned outputs: every replay must match, which needs
    the arrival counters left zero by the launch before; then one eager call after them."""
    seed = torch.seed() % 2**31
    case = make_case([(9000, 1), (300, 1), (16, 1), (4000, 1)], HQ, HKV, D, BS, dtype=DTYPE,
                     seed=seed, device="cuda")
    m = case.meta
    store_kv(case.k, case.v, case.k_cache, case.v_cache, m.slot_mapping)
    out = torch.full_like(case.q, float("nan"))
    run = lambda: paged_decode_v2(case.q, case.k_cache, case.v_cache,  # noqa: E731
                                  m.block_tables, m.seq_lens, 16384, case.scale, out,
                                  DecodeConfig(partition=512))
    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    expected = case.expected.cuda()
    errs = []
    for _ in range(replays):
        out.fill_(float("nan"))
        graph.replay()
        errs.append(float((out.double() - expected).norm() / expected.norm()))
    out.fill_(float("nan"))
    run()
    errs.append(float((out.double() - expected).norm() / expected.norm()))
    return {"dtype": str(DTYPE), "hq": HQ, "hkv": HKV, "head_dim": D, "block_size": BS,
            "seed": seed, "case": f"v2 in a CUDA graph, {replays} replays then eager",
            "rel_err_vs_dense": max(errs), "rel_err_vs_torch_ref": None,
            "rel_err_v2_vs_dense": max(errs), "nan": bool(math.isnan(sum(errs)))}


# ---------------------------------------------------------------- dense GEMV
# Llama-3-8B's projections as one rank holds them (N, K) at tensor-parallel size tp: the
# column-parallel q/k/v and gate/up split N, the row-parallel o and down split K
GEMV_LAYERS = {"qkv": (6144, 4096, "n"), "o": (4096, 4096, "k"),
               "gate_up": (28672, 4096, "n"), "down": (4096, 14336, "k")}
GEMV_TPS = (1, 2, 4)


def gemv_shape(layer: str, tp: int) -> tuple[int, int]:
    n, k, split = GEMV_LAYERS[layer]
    return (n // tp, k) if split == "n" else (n, k // tp)


class GemvSetup:
    """bf16 weight copies of one projection, >= ROTATE_BYTES in all (so L2 serves none of a
    graph's calls), one token's activations and one output buffer per copy (the
    row-parallel layers write into a given buffer)."""

    def __init__(self, n: int, k: int):
        self.weight_bytes = n * k * 2
        self.copies = max(2, math.ceil(ROTATE_BYTES / self.weight_bytes))
        self.weights = [torch.randn(n, k, device="cuda", dtype=DTYPE) * k**-0.5
                        for _ in range(self.copies)]
        self.x = torch.randn(1, k, device="cuda", dtype=DTYPE)
        self.outs = [torch.empty(1, n, device="cuda", dtype=DTYPE)
                     for _ in range(self.copies)]

    def calls(self, fn) -> list[Callable[[], object]]:
        """fn(x, weight, out) for each copy."""
        return [lambda w=w, y=y: fn(self.x, w, y) for w, y in zip(self.weights, self.outs)]

    def rel_err(self, fn) -> float:
        """fn's product on the first copy against float32's."""
        want = self.x.float() @ self.weights[0].float().t()
        got = fn(self.x, self.weights[0], self.outs[0]).float()
        return float((got - want).norm() / want.norm())


def torch_mm(x, w, out):
    return torch.mm(x, w.t(), out=out)


def dense_gemv_call(cfg):
    def call(x, w, out):
        return dense_gemv.gemv(x, w, out=out, cfg=cfg)
    return call


def gemv_table(copy_bw: float) -> list[dict]:
    """The GEMV (its default tiles, as the models take it) against torch.mm (cuBLAS) on each
    projection of each TP size at one row, in CUDA graphs; then the per-step sum over
    Llama-3-8B's 32 layers per TP size."""
    rows = []
    for tp in GEMV_TPS:
        for layer in GEMV_LAYERS:
            n, k = gemv_shape(layer, tp)
            s = GemvSetup(n, k)
            for method, fn in (("gemv", dense_gemv_call(None)), ("torch.mm", torch_mm)):
                us = graph_us(s.calls(fn))
                rows.append({"kernel": f"{method} tp{tp} {layer}", "method": method, "tp": tp,
                             "layer": layer, "n": n, "k": k, "rows": 1, "batch": 1,
                             "context": None, "us": us,
                             "gb_per_s": s.weight_bytes / (us * 1e-6) / 1e9,
                             "pct_copy_bw": 100 * s.weight_bytes / (us * 1e-6) / copy_bw,
                             "rel_err_vs_fp32": s.rel_err(fn)})
            pair = rows[-2:]
            log(f"gemv tp{tp} {layer:7s} [{n:5d} x {k:5d}]: "
                + " ".join(f"{r['method']} {r['us']:7.1f} us {r['pct_copy_bw']:5.1f}%"
                           f" (err {r['rel_err_vs_fp32']:.1e})" for r in pair))
            assert max(r["rel_err_vs_fp32"] for r in pair) < 1e-2, pair
            del s
            torch.cuda.empty_cache()
    sums = []
    for tp in GEMV_TPS:
        per_step = {m: 32 * sum(r["us"] for r in rows if r["method"] == m and r["tp"] == tp)
                    for m in ("gemv", "torch.mm")}
        log(f"gemv step sum tp{tp}: " + " ".join(
            f"{m} {us / 1e3:.3f} ms" for m, us in per_step.items()))
        sums.append({"kernel": f"step sum tp{tp}", "method": "gemv", "tp": tp, "rows": 1,
                     "batch": 1, "context": None, "us": per_step["gemv"],
                     "torch_mm_us": per_step["torch.mm"], "pct_copy_bw": None})
    return rows + sums


def gemv_candidates() -> dict[str, WeightOnlyConfig]:
    """Tiles `--sweep gemv` times: "default" (the one the models take, `dense_gemv.ONE_ROW`),
    then others labelled "bN kK wW sS pP mM" (N rows by K columns, W warps, S stages, P
    programs per SM, narrowed down to M rows; 0: never)."""
    shapes = [(16, 128, 4, 1, 5, 0), (16, 128, 4, 1, 3, 4), (16, 128, 4, 1, 8, 4),
              (16, 256, 4, 1, 5, 4), (32, 128, 4, 1, 5, 4), (8, 256, 4, 1, 5, 4),
              (16, 128, 8, 1, 5, 4), (16, 64, 4, 1, 5, 4), (16, 256, 8, 1, 4, 2),
              (32, 256, 8, 1, 4, 4)]
    default = dense_gemv.ONE_ROW
    return {"default": default, **{
        f"b{n} k{k} w{w} s{st} p{p} m{m}": replace(
            default, block_n=n, block_k=k, num_warps=w, num_stages=st, programs_per_sm=p,
            min_block_n=m) for n, k, w, st, p, m in shapes}}


def gemv_sweep(copy_bw: float) -> dict:
    """Each candidate's time at one row on every TP size's projections (and its product
    checked against float32's); the candidates ranked by their mean slowdown against each
    shape's best (a tile rule serves them all), and the best per shape."""
    cands = gemv_candidates()
    per_shape: dict[str, dict[str, float]] = {}
    for tp in GEMV_TPS:
        for layer in GEMV_LAYERS:
            n, k = gemv_shape(layer, tp)
            s = GemvSetup(n, k)
            times = {label: graph_us(s.calls(dense_gemv_call(cfg)))
                     for label, cfg in cands.items()}
            errs = {label: s.rel_err(dense_gemv_call(cfg)) for label, cfg in cands.items()}
            assert max(errs.values()) < 1e-2, errs
            times["torch.mm"] = graph_us(s.calls(torch_mm))
            per_shape[f"tp{tp} {layer}"] = times
            best = min(times, key=times.get)
            log(f"sweep tp{tp} {layer:7s}: best {best} {times[best]:.1f} us"
                f" ({100 * s.weight_bytes / (times[best] * 1e-6) / copy_bw:.1f}%), "
                f"default {times['default']:.1f}, torch.mm {times['torch.mm']:.1f}")
            del s
            torch.cuda.empty_cache()
    # mean over the shapes of the time over the shape's best: the TP=4 slices count as much
    # as TP=1's projections, whose microseconds would swamp a plain sum
    slowdown = {label: statistics.mean(t[label] / min(t.values()) for t in per_shape.values())
                for label in [*cands, "torch.mm"]}
    ranked = sorted(slowdown.items(), key=lambda kv: kv[1])
    log("sweep ranked by mean time over each shape's best: "
        + ", ".join(f"{label} {x:.3f}" for label, x in ranked))
    return {"rows": 1, "per_shape": per_shape, "ranked": ranked}


# ---------------------------------------------------------------- ceilings
def copy_bandwidth() -> float:
    """Bytes read + written per second for a 1 GiB device-to-device copy."""
    x = torch.randn(2**29, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    us = bench_us(lambda: y.copy_(x))
    bw = 2 * x.numel() * x.element_size() / (us * 1e-6)
    log(f"copy bandwidth: {bw / 1e12:.3f} TB/s")
    return bw


# ---------------------------------------------------------------- decode
class DecodeSetup:
    """Random paged KV (blocks shuffled across the pool) for `copies` independent batches, so
    a timing can rotate through >= ROTATE_BYTES of KV; plus the same K/V contiguous."""

    def __init__(self, batch: int, context: int):
        self.batch, self.context = batch, context
        self.kv_bytes = 2 * batch * context * HKV * D * 2
        self.copies = max(1, math.ceil(ROTATE_BYTES / self.kv_bytes))
        total_seqs = batch * self.copies
        nb = context // BS
        self.k_cache = torch.randn(total_seqs * nb + 1, BS, HKV, D, device="cuda", dtype=DTYPE)
        self.v_cache = torch.randn_like(self.k_cache)
        ids = torch.randperm(total_seqs * nb, device="cuda").int() + 1
        self.block_tables = ids.view(total_seqs, nb).contiguous()
        self.seq_lens = torch.full((total_seqs,), context, dtype=torch.int32, device="cuda")
        self.q = torch.randn(total_seqs, HQ, D, device="cuda", dtype=DTYPE)
        self.out = torch.empty_like(self.q)
        self.scale = D ** -0.5

    def rotated(self, make: Callable[[slice], Callable[[], object]]) -> list:
        return [make(slice(r * self.batch, (r + 1) * self.batch)) for r in range(self.copies)]

    def gather(self, cache: torch.Tensor, p: slice) -> torch.Tensor:
        rows = cache[self.block_tables[p].long()]
        return rows.view(-1, self.context, HKV, D).transpose(1, 2)  # [B, Hkv, L, D]

    def grouped_q(self, p: slice) -> torch.Tensor:
        """[B, Hkv, G, D]: a GQA group's query heads as rows of one KV head, so SDPA reads
        each K/V row once, like our kernel (enable_gqa may fall back to the math path)."""
        return self.q[p].view(self.batch, HKV, HQ // HKV, D)

    def v1(self, cfg: DecodeConfig) -> list:
        return self.rotated(lambda p: lambda: paged_decode_v1(
            self.q[p], self.k_cache, self.v_cache, self.block_tables[p], self.seq_lens[p],
            self.scale, self.out[p], cfg))

    def v2(self, cfg: DecodeConfig) -> list:
        return self.rotated(lambda p: lambda: paged_decode_v2(
            self.q[p], self.k_cache, self.v_cache, self.block_tables[p], self.seq_lens[p],
            self.context, self.scale, self.out[p], cfg))

    def dispatch(self, num_sms: int) -> list:
        return self.rotated(lambda p: lambda: paged_decode(
            self.q[p], self.k_cache, self.v_cache, self.block_tables[p], self.seq_lens[p],
            self.context, self.scale, self.out[p], num_sms))

    def sdpa(self, k: torch.Tensor, v: torch.Tensor) -> list:
        return self.rotated(lambda p: lambda: F.scaled_dot_product_attention(
            self.grouped_q(p), k[p], v[p], scale=self.scale))

    def gather_sdpa(self) -> list:
        return self.rotated(lambda p: lambda: F.scaled_dot_product_attention(
            self.grouped_q(p), self.gather(self.k_cache, p), self.gather(self.v_cache, p),
            scale=self.scale))

    def rel_err(self, ref: torch.Tensor) -> float:
        out = self.out[: self.batch].float()
        return float((out - ref.float()).norm() / ref.float().norm())


def sweep_decode(cfgs: list[DecodeConfig], shapes, version: str, repeats: int = 1) -> dict:
    """Best config per shape; returns {shape: (us, cfg)} and logs all. Each config's output
    is checked against v1's with the default config; `repeats` timings show the noise."""
    best = {}
    for batch, context in shapes:
        s = DecodeSetup(batch, context)
        s.v1(DecodeConfig())[0]()
        ref = s.out[:batch].clone()
        for cfg in cfgs:
            if version == "v2" and cfg.partition >= context:
                continue
            s.out.fill_(float("nan"))
            fns = s.v1(cfg) if version == "v1" else s.v2(cfg)
            fns[0]()
            err = s.rel_err(ref)
            times = [graph_us(fns) for _ in range(repeats)]
            us = min(times)
            log(f"  sweep {version} b={batch} ctx={context} {asdict(cfg)}: "
                + " ".join(f"{t:.1f}" for t in times) + f" us, err vs v1 {err:.1e}")
            assert err < 1e-2, err
            if (batch, context) not in best or us < best[(batch, context)][0]:
                best[(batch, context)] = (us, cfg)
        del s
        torch.cuda.empty_cache()
    return best


def decode_table(cfg: DecodeConfig, copy_bw: float, num_sms: int) -> list[dict]:
    rows = []
    for batch, context in DECODE_SHAPES:
        s = DecodeSetup(batch, context)
        whole = slice(0, batch * s.copies)
        k, v = s.gather(s.k_cache, whole).contiguous(), s.gather(s.v_cache, whole).contiguous()
        times = {"sdpa_contiguous": graph_us(s.sdpa(k, v))}
        ref = s.out[:batch].clone()
        ref.copy_(s.sdpa(k, v)[0]().reshape(batch, HQ, D))
        del k, v
        times["v1"] = graph_us(s.v1(cfg))
        err = {"v1": s.rel_err(ref)}
        s.out.fill_(float("nan"))
        times["v2"] = graph_us(s.v2(cfg))
        err["v2"] = s.rel_err(ref)
        times["dispatch"] = graph_us(s.dispatch(num_sms))
        times["dispatch_eager"] = bench_us(s.dispatch(num_sms)[0])
        times["gather_sdpa"] = graph_us(s.gather_sdpa())
        choice = "v2" if use_v2(batch, HKV, context, num_sms) else "v1"
        for kernel, us in times.items():
            rows.append({"kernel": kernel, "batch": batch, "context": context, "us": us,
                         "gb_per_s": s.kv_bytes / (us * 1e-6) / 1e9,
                         "pct_copy_bw": 100 * s.kv_bytes / (us * 1e-6) / copy_bw,
                         **({"choice": choice} if kernel.startswith("dispatch") else {})})
        log(f"decode b={batch:4d} ctx={context:6d} | " + " ".join(
            f"{k}={t:7.1f}us" for k, t in times.items())
            + f" | err v1 {err['v1']:.1e} v2 {err['v2']:.1e} | dispatch->{choice}")
        assert max(err.values()) < 1e-2, err
        del s
        torch.cuda.empty_cache()
    return rows


def v1_vs_v2(copy_bw: float, partitions: list[int], num_sms: int) -> list[dict]:
    rows = []
    for batch in (1, 4, 8, 16, 32, 64):
        for context in (1024, 2048, 4096, 8192, 16384, 32768):
            if batch * context > 64 * 16384:
                continue
            s = DecodeSetup(batch, context)
            row = {"batch": batch, "context": context, "v1_us": graph_us(s.v1(DecodeConfig())),
                   "dispatch_us": graph_us(s.dispatch(num_sms)),
                   "dispatch_choice": "v2" if use_v2(batch, HKV, context, num_sms) else "v1"}
            for part in partitions:
                if part < context:
                    row[f"v2_p{part}_us"] = graph_us(s.v2(DecodeConfig(partition=part)))
            v2_best = min((t for k, t in row.items() if k.startswith("v2")), default=None)
            row["v1_over_best_v2"] = row["v1_us"] / v2_best if v2_best else None
            row["v1_pct_copy_bw"] = 100 * s.kv_bytes / (row["v1_us"] * 1e-6) / copy_bw
            rows.append(row)
            log("v1vsv2 " + " ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
                                     for k, v in row.items()))
            del s
            torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------- prefill
class PrefillSetup:
    """batch fresh prompts of `length` tokens (prefix 0), paged with shuffled blocks."""

    def __init__(self, batch: int, length: int, prefix: int = 0):
        self.batch, self.length, self.prefix = batch, length, prefix
        seq_len = prefix + length
        nb = triton.cdiv(seq_len, BS)
        self.k_cache = torch.randn(batch * nb + 1, BS, HKV, D, device="cuda", dtype=DTYPE)
        self.v_cache = torch.randn_like(self.k_cache)
        ids = torch.randperm(batch * nb, device="cuda").int() + 1
        self.block_tables = ids.view(batch, nb).contiguous()
        self.seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device="cuda")
        self.qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * length
        self.q = torch.randn(batch * length, HQ, D, device="cuda", dtype=DTYPE)
        self.out = torch.empty_like(self.q)
        self.scale = D ** -0.5
        # causal FLOPs: 4 * D per visible (query, key) pair
        pairs = batch * (length * prefix + length * (length + 1) / 2)
        self.flops = 4 * D * HQ * pairs

    def paged(self, cfg: PrefillConfig):
        return lambda: paged_prefill(self.q, self.k_cache, self.v_cache, self.block_tables,
                                     self.seq_lens, self.qsl, 0, self.batch, self.length,
                                     self.scale, self.out, cfg)

    def sdpa_flash(self):
        """The same prompts contiguous, through SDPA's flash backend (no prefix support)."""
        q = self.q.view(self.batch, self.length, HQ, D).transpose(1, 2)
        kv = self.k_cache[self.block_tables.long()].view(self.batch, -1, HKV, D)
        k = kv.repeat_interleave(HQ // HKV, dim=2).transpose(1, 2).contiguous()
        v = k.clone()

        def run():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                      scale=self.scale)
        return run


def prefill_table(cfgs: list[PrefillConfig]) -> tuple[list[dict], PrefillConfig]:
    rows, totals = [], {cfg: 0.0 for cfg in cfgs}
    for batch, length in PREFILL_SHAPES:
        s = PrefillSetup(batch, length)
        t_sdpa = graph_us([s.sdpa_flash()])
        per_cfg = {cfg: graph_us([s.paged(cfg)]) for cfg in cfgs}
        for cfg, us in per_cfg.items():
            totals[cfg] += us / t_sdpa
            log(f"  prefill b={batch} len={length} {asdict(cfg)}: {us:.1f} us")
        best_cfg = min(per_cfg, key=per_cfg.get)
        rows.append({"kernel": "sdpa_flash_causal", "batch": batch, "context": length,
                     "us": t_sdpa, "tflops": s.flops / (t_sdpa * 1e-6) / 1e12,
                     "pct_copy_bw": None})
        rows.append({"kernel": "prefill", "batch": batch, "context": length,
                     "us": per_cfg[cfgs[0]], "tflops": s.flops / (per_cfg[cfgs[0]] * 1e-6)
                     / 1e12, "pct_copy_bw": None, "config": asdict(cfgs[0]),
                     "best_config": asdict(best_cfg), "best_us": per_cfg[best_cfg]})
        log(f"prefill b={batch} len={length}: sdpa flash {t_sdpa:.1f} us, paged (default) "
            f"{per_cfg[cfgs[0]]:.1f} us ({per_cfg[cfgs[0]] / t_sdpa:.2f}x), best "
            f"{per_cfg[best_cfg]:.1f} us {asdict(best_cfg)}")
        del s
        torch.cuda.empty_cache()
    # chunked prefill: a 1024-token chunk after a cached prefix (SDPA has no such path)
    for prefix in (1024, 7168):
        s = PrefillSetup(1, 1024, prefix)
        us = graph_us([s.paged(cfgs[0])])
        rows.append({"kernel": "prefill_chunk", "batch": 1, "context": prefix + 1024,
                     "us": us, "tflops": s.flops / (us * 1e-6) / 1e12, "pct_copy_bw": None})
        log(f"chunked prefill prefix={prefix} chunk=1024: {us:.1f} us "
            f"{s.flops / (us * 1e-6) / 1e12:.0f} TFLOP/s")
    log("prefill configs, mean time / sdpa: " + "; ".join(
        f"{asdict(c)}={t / len(PREFILL_SHAPES):.2f}" for c, t in totals.items()))
    return rows, min(totals, key=totals.get)


# ---------------------------------------------------------------- copy / swap
def cache_ops(copy_bw: float) -> list[dict]:
    """copy_blocks (torch vs Triton) on one layer; swap_blocks both ways, checked."""
    num_blocks, n = 8192, 1024
    caches = [(torch.randn(num_blocks, BS, HKV, D, device="cuda", dtype=DTYPE),
               torch.randn(num_blocks, BS, HKV, D, device="cuda", dtype=DTYPE))]
    perm = torch.randperm(num_blocks, device="cuda")
    pairs = torch.stack([perm[:n], perm[n:2 * n]], 1)
    block_bytes = BS * HKV * D * 2
    moved = 2 * 2 * n * block_bytes  # K and V, read + write
    rows = []
    for name, backend in (("copy_blocks_torch", TorchRefBackend()),
                          ("copy_blocks_triton", TritonBackend())):
        us = graph_us([lambda: backend.copy_blocks(caches, pairs)])
        rows.append({"kernel": name, "batch": n, "context": None, "us": us,
                     "pct_copy_bw": 100 * moved / (us * 1e-6) / copy_bw})
    check = caches[0][0].clone()
    TritonBackend().copy_blocks(caches, pairs)
    TorchRefBackend().copy_blocks([(check, check)], pairs)
    assert torch.equal(check, caches[0][0]), "copy_blocks kernel differs from torch"
    hosts = [tuple(torch.empty(n, BS, HKV, D, dtype=DTYPE).pin_memory() for _ in range(2))]
    host = hosts[0][0]
    to_host = torch.stack([perm[:n].cpu(), torch.randperm(n)], 1)
    swap = TorchRefBackend().swap_blocks
    us_out = bench_us(lambda: swap(caches, hosts, to_host))
    assert torch.equal(host[to_host[:, 1]], caches[0][0][perm[:n]].cpu()), "swap out"
    back = torch.stack([to_host[:, 1], perm[2 * n:3 * n].cpu()], 1)
    us_in = bench_us(lambda: swap(hosts, caches, back))
    assert torch.equal(caches[0][0][perm[2 * n:3 * n]].cpu(), host[to_host[:, 1]]), "swap in"
    for name, us in (("swap_blocks_out", us_out), ("swap_blocks_in", us_in)):  # K and V
        rows.append({"kernel": name, "batch": n, "context": None, "us": us,
                     "gb_per_s": 2 * n * block_bytes / (us * 1e-6) / 1e9, "pct_copy_bw": None})
    log("cache ops: " + "; ".join(f"{r['kernel']} {r['us']:.1f} us "
                                  f"{r.get('gb_per_s') or r['pct_copy_bw']:.1f}"
                                  f"{' GB/s' if 'gb_per_s' in r else '% copy bw'}"
                                  for r in rows))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--sweep", nargs="+", choices=["v1", "v2", "gemv"], default=[],
                        help="also time these kernels' launch configs (v1/v2: decode, gemv: "
                             "the dense GEMV's tiles at one row)")
    parser.add_argument("--only", nargs="*", choices=[*PARTS, "gemv"], default=PARTS,
                        help="measure these parts only (copy bw always runs, the attention "
                             "kernels' correctness with an attention part or sweep; none: "
                             "only --sweep)")
    parser.add_argument("--no-grid", action="store_true",
                        help="skip the v1-vs-v2 table by context length")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    props = torch.cuda.get_device_properties(0)
    device = f"{props.name}, torch {torch.__version__}, triton {triton.__version__}"
    date = datetime.date.today().isoformat()
    num_sms = props.multi_processor_count
    log(device, date, f"{num_sms} SMs")
    raw: dict = {"device": device, "date": date}
    if set(args.only) & set(PARTS) or {"v1", "v2"} & set(args.sweep):
        raw["correctness"] = check_correctness()  # the attention kernels'
    copy_bw = copy_bandwidth()
    raw["copy_bw_bytes_per_s"] = copy_bw
    cfg = DecodeConfig()
    if "v1" in args.sweep:
        cfgs = [replace(cfg, block_n=bn, num_warps=w, num_stages=st)
                for bn in (64, 128) for w in (4, 8) for st in (2, 3, 4)]
        best = sweep_decode(cfgs, [(64, 4096), (256, 1024), (32, 16384), (16, 2048)], "v1")
        raw["sweep_v1"] = {f"{k}": (us, asdict(c)) for k, (us, c) in best.items()}
    if "v2" in args.sweep:
        # (partition, block_n, warps, stages); from 5 stages on K/V are double-buffered
        # (Triton splits the stages between the block-table load and the K/V loads it feeds)
        v2cfgs = [replace(cfg, partition=p, block_n=bn, num_warps=w, num_stages=st)
                  for p, bn, w, st in ((512, 64, 4, 3), (1024, 64, 4, 3), (256, 64, 4, 3),
                                       (256, 32, 4, 5), (512, 32, 4, 5), (1024, 32, 4, 5),
                                       (2048, 32, 4, 5), (1024, 32, 4, 7), (512, 32, 4, 7),
                                       (768, 64, 4, 5), (1024, 64, 4, 5), (1024, 64, 8, 5),
                                       (2048, 64, 8, 5), (512, 64, 8, 3), (1024, 128, 8, 3),
                                       (2048, 128, 8, 3))]
        best2 = sweep_decode(v2cfgs, [(1, 32768), (1, 8192), (1, 1024), (16, 2048),
                                      (4, 32768)], "v2", repeats=2)
        raw["sweep_v2"] = {f"{k}": (us, asdict(c)) for k, (us, c) in best2.items()}
    rows = []
    if "decode" in args.only:
        rows += decode_table(cfg, copy_bw, num_sms)
        if not args.no_grid:
            raw["v1_vs_v2"] = v1_vs_v2(copy_bw, [256, 512, 1024, 2048], num_sms)
    if "prefill" in args.only:
        prefill_cfgs = [PrefillConfig(), PrefillConfig(128, 64, 8, 3),
                        PrefillConfig(128, 128, 8, 2), PrefillConfig(64, 64, 4, 4),
                        PrefillConfig(64, 64, 8, 3), PrefillConfig(64, 32, 4, 3)]
        prefill_rows, best_prefill = prefill_table(prefill_cfgs)
        raw["best_prefill_config"] = asdict(best_prefill)
        rows += prefill_rows
    if "cache" in args.only:
        rows += cache_ops(copy_bw)
    if "gemv" in args.only:
        rows += gemv_table(copy_bw)
    if "gemv" in args.sweep:
        raw["sweep_gemv"] = gemv_sweep(copy_bw)
    for r in rows:
        r.update(device=device, date=date, decode_config=asdict(cfg))
    raw["rows"] = rows
    with open(os.path.join(args.out, "kernels.json"), "w") as f:
        json.dump(rows, f, indent=1)
    with open(os.path.join(args.out, "kernels_raw.json"), "w") as f:
        json.dump(raw, f, indent=1)
    log("\nkernel               batch context      us   %copyBW")
    for r in rows:
        pct = "" if r["pct_copy_bw"] is None else f"{r['pct_copy_bw']:7.1f}"
        log(f"{r['kernel']:20s} {r['batch']!s:>5} {r['context']!s:>7} {r['us']:9.1f} {pct}")


if __name__ == "__main__":
    sys.exit(main())
