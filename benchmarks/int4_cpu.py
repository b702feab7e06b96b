"""4-bit weights on the CPU: the Llama-3-8B projections on the native int8-activation kernels
(`model/int_native.py`) against the dequantizing reference, one run.

    PYTHONPATH=. python benchmarks/int4_cpu.py --out DIR [--threads N] [--rows 1,16]

For each projection (K x N: qkv, o, gate_up, down) of a random W4A16 group-128 weight
(symmetric, float16 scales, as the tools write them): the native matmul in the checkpoint's
column order, the same with a desc_act g_idx (the activations gathered into group order per
call), and `int_weights.reference_linear` (dequantize, then a float32 matmul; at 1 row only:
the dequantization dominates at any row count). Also the bytes each keeps per weight (codes,
scales and mins; the reference's scales in float32, as the CPU's model holds them).
Writes DIR/int4_cpu.json (docs/results style: one row per figure) and prints each row.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path = [p for p in sys.path if Path(p or ".").resolve() != HERE]

import torch  # noqa: E402

from pagedserve.kernels.weight_formats import IntWeight, pack_codes  # noqa: E402
from pagedserve.model.int_native import native_matmul  # noqa: E402
from pagedserve.model.int_weights import reference_linear  # noqa: E402

PROJECTIONS = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672),
               "down": (14336, 4096)}
GROUP = 128


def weight(k: int, n: int, desc_act: bool, gen: torch.Generator) -> IntWeight:
    codes = torch.randint(0, 16, (n, k), generator=gen)
    scales = (torch.rand(n, k // GROUP, generator=gen) * 0.02 + 1e-3).half().float()
    g_idx = None
    if desc_act:
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[torch.randperm(k, generator=gen)] = (torch.arange(k) // GROUP).to(torch.int32)
    return IntWeight(pack_codes(codes, 4), scales, None, g_idx, 4, GROUP, k)


def seconds(fn, budget: float) -> float:
    """The median of calls over about `budget` seconds (one call at least, after a warm-up)."""
    fn()
    times, start = [], time.perf_counter()
    while not times or time.perf_counter() - start < budget:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--rows", default="1,16")
    p.add_argument("--budget", type=float, default=0.5, help="seconds per figure")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    gen = torch.Generator().manual_seed(0)
    common = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "threads": a.threads, "load_average": os.getloadavg()[0], "group": GROUP}
    rows_out = []

    def emit(**row):
        row = {**common, **row}
        rows_out.append(row)
        print(json.dumps(row))

    for name, (k, n) in PROJECTIONS.items():
        for desc_act in (False, True):
            w = weight(k, n, desc_act, gen)
            matmul = native_matmul(w)
            blocks = sum(t.numel() * t.element_size() for part in matmul.quantized.parts
                         for t in (part.qs, part.scales, part.mins) if t is not None)
            variant = "native desc_act" if desc_act else "native"
            for rows in map(int, a.rows.split(",")):
                x = torch.randn(rows, k, generator=gen)
                emit(projection=name, k=k, n=n, variant=variant, rows=rows,
                     ms=1e3 * seconds(lambda: matmul(x, None), a.budget),
                     bytes_per_weight=blocks / (k * n))
            if not desc_act:
                x = torch.randn(1, k, generator=gen)
                emit(projection=name, k=k, n=n, variant="reference", rows=1,
                     ms=1e3 * seconds(lambda: reference_linear(x, w), 0.0),
                     bytes_per_weight=(w.qweight.numel() + w.scales.numel()) * 4 / (k * n))
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "int4_cpu.json").write_text(json.dumps(rows_out, indent=1) + "\n")


if __name__ == "__main__":
    main()
