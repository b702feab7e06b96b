"""GGUF weights kept in their blocks on CUDA (`model.gguf_weights`) against bf16.

    PYTHONPATH=. python benchmarks/gguf_gpu.py --out docs/results [--parts gemv,sweep,8b]

Parts:
  gemv  Llama-3-8B's projections in the types a Q4_K_M file gives them (Q4_K; Q6_K for the
        down projection's more-bits layers and the LM head): the GGUF kernels
        (`kernels/triton/int_linear.linear` on `GgufWeight`s) at 1, 16 and 256 rows against
        the bf16 matmul, timed in CUDA graphs rotating over > 1 GiB of weights (as a decode
        step reads them); at one row both GEMVs: "gguf int8 act" (`gguf_dp4a`, the row
        quantized to int8, the default) and "gguf bf16 act" (`gguf_gemv`,
        --no-gguf-int8-activations);
        GB/s of the weights' bytes and % of the copy bandwidth
  sweep the one-row GEMVs (`kernels/triton/gguf_gemv.py`, and `gguf_dp4a.py` for Q4_K and
        Q6_K: every shape here) on the same shapes at one row, over
        candidate tiles (each keeps rows x super-blocks x 4 = the program's threads, the
        layout its loop is written for) and programs per SM
  8b    a Llama-3-8B-shaped Q4_K_M GGUF (written by `gguf_quantize.write_llama_q4_k_m`,
        random weights) against bf16 (random weights made on the GPU, `load_format dummy`),
        with int8 activations (the default) and with bf16 ones (--no-gguf-int8-activations):
        batch-1 TPOT (128 prompt, 128 output tokens, median of 3) and the GPU memory the
        weights take

Rows go to DIR/int4.json (docs/results style; rows of other parts of that file are kept, this
script's `part` values start with "gguf").
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

# this folder holds kernels.py, which would shadow the `kernels` package transformers probes for
HERE = Path(__file__).resolve().parent
sys.path = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(HERE.parent))  # benchmarks.common, with or without PYTHONPATH=.

import numpy as np  # noqa: E402
import torch  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402

from benchmarks.common import (LLAMA3_8B_LM_HEAD, LLAMA3_8B_PROJECTIONS,  # noqa: E402
                               ResultRows, rotation_copies, sibling)
from pagedserve.frontend.llm_engine import LoadedModel  # noqa: E402
from pagedserve.kernels.gguf_format import GgufWeight, row_bytes  # noqa: E402
from pagedserve.kernels.triton import gguf_dp4a, gguf_gemv  # noqa: E402
from pagedserve.kernels.triton.int_linear import (DEFAULT, FLOAT_GGUF_ACTIVATIONS,  # noqa: E402
                                                  linear)
from pagedserve.model import load_model  # noqa: E402
from pagedserve.model.gguf_weights import GgufMatmul  # noqa: E402
from pagedserve.model.loader import load_tokenizer  # noqa: E402
from pagedserve.model.ops import select_ops  # noqa: E402


fp8 = sibling("fp8")
kernels = sibling("kernels")
quantizer = sibling("gguf_quantize")


# Llama-3-8B's projections: (K, N, Q4_K_M's type)
SHAPES = {**{name: (*shape, T.Q4_K) for name, shape in LLAMA3_8B_PROJECTIONS.items()
             if name != "down"},
          "down Q4_K": (*LLAMA3_8B_PROJECTIONS["down"], T.Q4_K),
          "down Q6_K": (*LLAMA3_8B_PROJECTIONS["down"], T.Q6_K),
          "lm_head": (*LLAMA3_8B_LM_HEAD, T.Q6_K)}


def random_blocks(n: int, k: int, qtype: T, tile_rows: int = 256) -> torch.Tensor:
    """uint8 [n, row bytes] on the GPU: `tile_rows` quantized random rows, repeated."""
    x = np.random.default_rng(0).standard_normal((tile_rows, k), dtype=np.float32) * 0.02
    tile = torch.from_numpy(quantizer.quantize(x, qtype)).cuda()
    return tile.repeat(math.ceil(n / tile_rows), 1)[:n].contiguous()


def part_gemv(res: ResultRows, bandwidth: float) -> None:
    for name, (k, n, qtype) in SHAPES.items():
        gguf_bytes = n * row_bytes(int(qtype), k)
        copies = rotation_copies(gguf_bytes)
        base = random_blocks(n, k, qtype)
        blocks = [base] + [base.clone() for _ in range(copies - 1)]
        w_copies = rotation_copies(2 * n * k)
        w = torch.randn(w_copies, n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        for rows in (1, 16, 256):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            configs = ({"gguf int8 act": DEFAULT, "gguf bf16 act": FLOAT_GGUF_ACTIVATIONS}
                       if rows == 1 else {"gguf": DEFAULT})
            runs = {method: [(lambda b, c: lambda: linear(x, GgufWeight(b, int(qtype), k),
                                                          config=c))(b, c)
                             for b in blocks] for method, c in configs.items()}
            runs["bf16 matmul"] = [(lambda wr: lambda: x @ wr.t())(wr) for wr in w]
            for method, fns in runs.items():
                us = kernels.graph_us(fns)
                nbytes = 2 * n * k if method == "bf16 matmul" else gguf_bytes
                gbps = nbytes / (us * 1e-6) / 1e9
                res.add("gguf gemv", layer=name, k=k, n=n, type=qtype.name, rows=rows,
                        method=method, us=round(us, 2), gb_per_s=round(gbps, 1),
                        pct_copy_bw=round(100 * gbps * 1e9 / bandwidth, 1))
        del blocks, w
        torch.cuda.empty_cache()


# (block_n, block_k / 256, warps): block_n * block_k / 256 * 4 == 32 * warps
SWEEP_TILES = [(16, 2, 4), (32, 2, 8), (16, 4, 8), (8, 4, 4)]
SWEEP_PROGRAMS = (5, 8)


def part_sweep(res: ResultRows, bandwidth: float) -> None:
    for name, (k, n, qtype) in SHAPES.items():
        nbytes = n * row_bytes(int(qtype), k)
        base = random_blocks(n, k, qtype)
        blocks = [base] + [base.clone() for _ in range(rotation_copies(nbytes) - 1)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        for kernel in (gguf_gemv, gguf_dp4a):
            default = (gguf_gemv.Q6_K_ONE_ROW if kernel is gguf_gemv and qtype == T.Q6_K
                       else gguf_gemv.ONE_ROW)
            for (block_n, steps, warps), programs in itertools.product(SWEEP_TILES,
                                                                       SWEEP_PROGRAMS):
                if kernel is gguf_gemv and qtype == T.Q6_K:  # half a K-quant thread's columns
                    warps, block_n = ((warps * 2, block_n) if warps <= 4
                                      else (warps, block_n // 2))
                cfg = replace(default, block_n=block_n, block_k=256 * steps, num_warps=warps,
                              programs_per_sm=programs)
                fns = [(lambda b: lambda: kernel.gemv(x, b, int(qtype), cfg=cfg))(b)
                       for b in blocks]
                us = kernels.graph_us(fns)
                gbps = nbytes / (us * 1e-6) / 1e9
                res.add("gguf gemv sweep", layer=name, k=k, n=n, type=qtype.name, rows=1,
                        kernel=kernel.__name__.rsplit(".", 1)[-1], block_n=block_n,
                        block_k=256 * steps, num_warps=warps, programs_per_sm=programs,
                        default=cfg == default, us=round(us, 2), gb_per_s=round(gbps, 1),
                        pct_copy_bw=round(100 * gbps * 1e9 / bandwidth, 1))
        del blocks
        torch.cuda.empty_cache()


def weight_bytes(model: torch.nn.Module) -> int:
    """The bytes of the model's float parameters and of the blocks its GGUF matmuls hold."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    matmuls = [getattr(m, "matmul", None) for m in model.modules()] + [model.lm_head_matmul]
    return total + sum(part.blocks.numel() for mm in matmuls if isinstance(mm, GgufMatmul)
                       for part in mm.parts)


PART_ROWS = {"gemv": "gguf gemv", "sweep": "gguf gemv sweep", "8b": "gguf 8b"}  # rows' part


def part_8b(res: ResultRows, root: Path) -> None:
    config_path = HERE / "configs" / "llama3-8b.json"
    model_dir = fp8.config_folder(config_path, root / "llama3-8b")
    common = {"model": "llama-3-8b shape, random weights, bf16 activations"}
    tpot = {}
    gguf_path = root / "llama3-8b-q4_k_m.gguf"
    quantizer.write_llama_q4_k_m(json.loads(config_path.read_text()), str(gguf_path))
    variants = {"bf16": None, "gguf Q4_K_M": True, "gguf Q4_K_M bf16 act": False}
    for name, int8 in variants.items():  # int8: the GGUF's one-row GEMVs' activations
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
        if int8 is None:
            loaded = fp8.load_dummy(model_dir, None)
        else:
            ops = select_ops("cuda", torch.bfloat16, gguf_int8_activations=int8)
            model, config, _ = load_model(gguf_path, torch.bfloat16, "cuda", ops=ops)
            loaded = LoadedModel(model, config, load_tokenizer(model_dir), str(model_dir))
        allocated = torch.cuda.memory_allocated() - before
        engine = fp8.engine_for(loaded, str(model_dir))
        tpot[name] = fp8.tpot_batch1(engine)
        res.add("gguf 8b", measure="tpot_batch1_ms", variant=name, tpot_ms=tpot[name],
                ratio_vs_bf16=round(tpot[name] / tpot["bf16"], 3),
                weight_gib=round(weight_bytes(loaded.model) / 2**30, 3),
                allocated_at_load_gib=round(allocated / 2**30, 3), **common)
        del engine, loaded
        fp8.throughput.release()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for int4.json")
    parser.add_argument("--parts", default="gemv,8b")
    args = parser.parse_args()
    parts = args.parts.split(",")
    rerun = {PART_ROWS[part] for part in parts if part in PART_ROWS}
    res = ResultRows(args.out / "int4.json",  # the rows of the parts not run now stay
                     keep=lambda row: row.get("part") not in rerun)
    if "gemv" in parts:
        part_gemv(res, fp8.throughput.copy_bandwidth())
    if "sweep" in parts:
        part_sweep(res, fp8.throughput.copy_bandwidth())
    if "8b" in parts:
        part_8b(res, Path(tempfile.mkdtemp(prefix="pagedserve-gguf-")))


if __name__ == "__main__":
    main()
