"""MoE experts kept quantized on a CUDA GPU: the fused MoE kernels (`kernels/triton/moe.py`) on
one MoE layer's experts in bf16, W4A16 group 128 (symmetric, and with zero points as GPTQ /
AWQ / asymmetric compressed-tensors load) and GGUF blocks (Q4_K gate/up, Q6_K down: a
Q4_K_M file's more-bits layers), same run.

    PYTHONPATH=. python benchmarks/moe_int4.py --out DIR

Shapes: Mixtral-8x7B's layer (8 experts, hidden 4096, intermediate 14336, top 2) and
Qwen3-30B-A3B's (128 experts, hidden 2048, intermediate 768, top 8), at 1, 16 and 256 tokens.
Each call is timed in a CUDA graph rotating over 8 routings (random router logits), so a
decode-sized call reads its experts' weights from memory, not L2; GB/s counts the bytes of
the experts each routing touches. The GGUF rows need the `gguf` package (skipped without it).
About 2 minutes on an H100 with a cold Triton cache.

Rows go to DIR/int4.json (docs/results style, `part` "moe"; rows of other parts are kept).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import sys
from pathlib import Path

# this folder holds kernels.py, which would shadow the `kernels` package transformers probes for
HERE = Path(__file__).resolve().parent
sys.path = [p for p in sys.path if Path(p or ".").resolve() != HERE]

import torch  # noqa: E402

from pagedserve.kernels.triton.moe import fused_moe  # noqa: E402
from pagedserve.kernels.weight_formats import IntWeight, stacked  # noqa: E402
from pagedserve.model.moe import route  # noqa: E402


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


kernels = _module("kernels")
int4 = _module("int4")

SHAPES = {"mixtral-8x7b": (8, 4096, 14336, 2), "qwen3-30b-a3b": (128, 2048, 768, 8)}
TOKENS = (1, 16, 256)
ROUTINGS = 8


class Results:
    """Rows in DIR/int4.json; rows there of other parts stay."""

    def __init__(self, out: Path) -> None:
        self.path = out / "int4.json"
        old = json.loads(self.path.read_text()) if self.path.exists() else []
        self.rows = [r for r in old if r.get("part") != "moe"]

    def add(self, **row) -> None:
        row = {"part": "moe", **row, "device": torch.cuda.get_device_name(),
               "date": datetime.date.today().isoformat()}
        self.rows.append(row)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.rows, indent=1) + "\n")
        print(json.dumps(row), flush=True)


def _bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def int_experts(w: torch.Tensor, zeros: bool, parts: list[tuple[int, int]]):
    """bf16 experts [E, N, K] -> W4A16 group 128, one `Stacked` per range of output rows in
    `parts`, and the bytes one expert's whole weight takes."""
    quantized = [int4.quantize(w[e], 4, 128, zeros) for e in range(w.shape[0])]
    q = torch.stack([p.qweight for p in quantized])
    s = torch.stack([p.scales for p in quantized])
    z = torch.stack([p.zeros for p in quantized]) if zeros else None
    del quantized
    out = [stacked(IntWeight(q[e, lo:hi], s[e, lo:hi], None if z is None else z[e, lo:hi],
                             None, 4, 128, w.shape[2]) for e in range(w.shape[0]))
           for lo, hi in parts]
    return out, (_bytes(q) + _bytes(s) + _bytes(z)) // w.shape[0]


def gguf_experts(e: int, n: int, k: int, qtype_name: str):
    """Random rows quantized to `qtype` (a tile repeated), [E, N, row bytes] as `Stacked`."""
    import numpy as np
    from gguf import GGMLQuantizationType as T

    from pagedserve.kernels.gguf_format import GgufWeight

    quantizer = _module("gguf_quantize")
    qtype = T[qtype_name]
    x = np.random.default_rng(0).standard_normal((256, k), dtype=np.float32) * 0.02
    tile = torch.from_numpy(quantizer.quantize(x, qtype)).cuda()
    blocks = tile.repeat(e * -(-n // 256), 1)[:e * n].reshape(e, n, -1).contiguous()
    return stacked(GgufWeight(b, int(qtype), k) for b in blocks), blocks[0].numel()


def formats(e: int, h: int, i: int):
    """Format -> ((gate, up), down, bytes of one expert's three projections)."""
    w13 = torch.randn(e, 2 * i, h, device="cuda", dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(e, h, i, device="cuda", dtype=torch.bfloat16) * 0.02
    out = {"bf16": (w13, w2, 3 * h * i * 2)}
    for label, zeros in (("w4a16 g128", False), ("w4a16 g128 zeros", True)):
        (gate, up), w13_bytes = int_experts(w13, zeros, [(0, i), (i, 2 * i)])
        (down,), w2_bytes = int_experts(w2, zeros, [(0, h)])
        out[label] = ((gate, up), down, w13_bytes + w2_bytes)
    try:
        import gguf  # noqa: F401
    except ImportError:
        print("no gguf package: GGUF rows skipped", flush=True)
        return out
    gate, gate_bytes = gguf_experts(e, i, h, "Q4_K")
    up, _ = gguf_experts(e, i, h, "Q4_K")
    down, down_bytes = gguf_experts(e, h, i, "Q6_K")
    out["gguf q4_k/q6_k"] = ((gate, up), down, 2 * gate_bytes + down_bytes)
    return out


def run(res: Results, name: str, e: int, h: int, i: int, top_k: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    for label, (w13, w2, expert_bytes) in formats(e, h, i).items():
        for tokens in TOKENS:
            calls, touched = [], 0
            for _ in range(ROUTINGS):
                x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16, generator=gen)
                logits = torch.randn(tokens, e, device="cuda", generator=gen)
                weights, ids = route(logits, top_k, True, None)
                touched += ids.unique().numel()
                calls.append(lambda x=x, w=weights, ids=ids: fused_moe(x, w13, w2, w, ids))
            us = kernels.graph_us(calls)
            nbytes = touched / ROUTINGS * expert_bytes
            res.add(shape=name, experts=e, hidden=h, intermediate=i, top_k=top_k,
                    tokens=tokens, method=label, us=round(us, 2),
                    expert_mb=round(expert_bytes / 2**20, 3),
                    touched_mb=round(nbytes / 2**20, 2),
                    gb_per_s=round(nbytes / (us * 1e-6) / 1e9, 1))
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for int4.json")
    args = parser.parse_args()
    res = Results(args.out)
    for name, shape in SHAPES.items():
        run(res, name, *shape)
    print("summary:", flush=True)
    for row in res.rows:
        if row["part"] == "moe":
            print({k: row[k] for k in ("shape", "tokens", "method", "us", "gb_per_s")},
                  flush=True)


if __name__ == "__main__":
    main()
