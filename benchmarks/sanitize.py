"""Every GPU path under NVIDIA compute-sanitizer, in one command; a summary row per (target, tool)
appended to docs/results/sanitizer.json.

Why (issue 27): an engine died with "an illegal memory access" after other CUDA work in the
process. The cause was the memory-profiling prefill feeding positions past the RoPE table, a
read out of bounds that only faulted when the allocator put the table at the end of a mapped
segment. A bug like that hides behind luck, so every kernel path (decode v1/v2 with split_short
and the arrival counters, prefill, store-KV in bf16 and FP8, block copy and swap, the decoder's
elementwise kernels, the FP8 GEMVs including the one-row word path and split-K, the MoE kernel,
the sampling kernels, the packed-weight matmuls of every 4-bit/8-bit and GGUF format, the
batched LoRA kernels, CUDA-graph replays, the engine with PDL on and off) runs here under
memcheck, and those with shared memory under racecheck and synccheck, and initcheck where it
can speak.

How to run (the lent H100: compute-sanitizer on PATH):

    PYTHONPATH=. python benchmarks/sanitize.py --out docs/results            # or: make sanitize
    PYTHONPATH=. python benchmarks/sanitize.py --out docs/results --only attention,fp8
    PYTHONPATH=. python benchmarks/sanitize.py --workload attention --device cpu   # self-check

Each (target, tool) pair is a subprocess `compute-sanitizer --tool T ... python
benchmarks/sanitize.py --workload NAME`, run `--jobs` at a time with a per-run `--timeout`,
all inside `--budget` seconds (pairs not started by then are listed as skipped, not recorded).
A workload checks its results against the PyTorch reference and exits non-zero on a mismatch,
so a sanitizer run also checks correctness. A run that timed out or printed no "ERROR SUMMARY"
is recorded as such, never as 0 errors. Full logs go to `--logs` (default: a temporary
folder, printed at the end); the table is printed last; the exit status is 0 only when every
pair is clean. Targets: the workloads attention, model_ops, fp8, moe, sampling, quant, lora,
graphs, engine, engine-eager, engine-fp8kv, and engine-nopdl (the engine workload with
PAGEDSERVE_PDL=0). The engine workloads build their engine core in their own process (LLM(...)
would spawn one), so `--target-processes application-only` sees every kernel they launch.

How long: each pair's seconds are in its row of docs/results/sanitizer.json (on the H100,
a kernel workload under memcheck or racecheck took 10-120 s, sampling under initcheck 214 s,
an engine run 24-50 s). With the default 6 jobs the whole default set (22 pairs) does not fit
one device call limited to 10 minutes: split it in two, each with `--budget 500`:
    --only attention,model_ops,fp8,moe,sampling,graphs      (18 pairs)
    --only quant,lora                                       (7 pairs)
    --only engine,engine-eager,engine-fp8kv,engine-nopdl    (4 pairs)

Memory bounds: memcheck sees an allocation as torch's caching allocator hands it out only when
the allocator is off: inside a cached 2 MiB segment a read past a tensor's end lands in a
neighbour and goes unreported (issue 27's read did, until the table sat at a segment's end).
So every target that captures no CUDA graph runs with PYTORCH_NO_CUDA_MEMORY_CACHING=1, one
cudaMalloc per tensor; graph capture needs the caching allocator (a cudaMalloc inside a
capture invalidates it), so `graphs` and the engine targets with graphs keep it: their bounds
are segment-coarse, and `engine-eager` covers the engine's kernels with exact bounds.

Why initcheck is not run on every path: on Hopper cuBLAS writes GEMM outputs with TMA (bulk
async) stores, which initcheck does not see, so a Triton kernel reading a cuBLAS GEMM's output
is reported as an uninitialized read (on the engine run, _rotate_qk_kernel reading the QKV
projection). initcheck therefore runs on the workloads whose inputs come from torch's
elementwise and random ops (attention, model_ops, moe, sampling, lora; their references are
computed on the CPU), not on the engine, fp8 (`_scaled_mm`), quant (cuBLAS on the dequantized
weight from 64 rows: every such output read back was reported) or graphs targets.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).resolve()
# Python puts this folder first on sys.path, where benchmarks/kernels.py would shadow the
# `kernels` package that transformers probes for; the workloads import from the repo root.
sys.path = [p for p in sys.path if Path(p or ".").resolve() != SCRIPT.parent]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
MEM, RACE, SYNC, INIT = TOOLS
PRINT_LIMIT = 20
# Tools that run the workloads at --quick sizes: every kernel variant still runs, and shared
# memory and barriers are used alike at any problem size, while these tools slow a kernel
# far more than memcheck (each shared-memory access is tracked).
QUICK_TOOLS = (RACE, SYNC)
TINY_CONFIG = ROOT / "benchmarks/configs/tiny-qwen3.json"


# -- targets ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Target:
    name: str
    workload: str
    tools: tuple[str, ...]  # run by default
    graphs: bool = False  # captures CUDA graphs: needs torch's caching allocator
    env: tuple[tuple[str, str], ...] = ()
    exclusive: bool = False  # runs alone, after the others (sizes itself from free memory)


TARGETS = {t.name: t for t in (
    Target("attention", "attention", (MEM, RACE, SYNC, INIT)),
    Target("model_ops", "model_ops", (MEM, INIT)),
    Target("fp8", "fp8", (MEM, RACE, SYNC)),
    Target("moe", "moe", (MEM, RACE, SYNC, INIT)),
    Target("sampling", "sampling", (MEM, RACE, SYNC, INIT)),
    Target("quant", "quant", (MEM, RACE, SYNC)),  # from 64 rows its output is cuBLAS's
    Target("lora", "lora", (MEM, RACE, SYNC, INIT)),
    Target("graphs", "graphs", (MEM,), graphs=True),
    Target("engine", "engine", (MEM,), graphs=True),
    Target("engine-eager", "engine-eager", (MEM,), exclusive=True),
    Target("engine-fp8kv", "engine-fp8kv", (MEM,), graphs=True),
    Target("engine-nopdl", "engine", (MEM,), graphs=True, env=(("PAGEDSERVE_PDL", "0"),)),
)}


def plan(only: list[str] | None, tools: list[str] | None) -> list[tuple[Target, str]]:
    """The (target, tool) pairs to run: each target's default tools; with --tools, those of
    them that are listed; with --only and --tools, exactly those tools on those targets."""
    for name in only or ():
        if name not in TARGETS:
            raise SystemExit(f"unknown target {name!r}; known: {', '.join(TARGETS)}")
    for tool in tools or ():
        if tool not in TOOLS:
            raise SystemExit(f"unknown tool {tool!r}; known: {', '.join(TOOLS)}")
    pairs = []
    for target in (TARGETS[n] for n in (only or TARGETS)):
        chosen = target.tools if tools is None else (
            tools if only else [t for t in target.tools if t in tools])
        pairs += [(target, tool) for tool in chosen]
    return pairs


# -- the sanitizer's report ------------------------------------------------------------------

@dataclass
class Report:
    errors: int | None  # None: no "ERROR SUMMARY" line (crashed, killed, never started)
    first_errors: list[str] = field(default_factory=list)


_SUMMARY = re.compile(r"ERROR SUMMARY: ([\d,]+) errors?\s*$")
# racecheck (2025.3) ends with this line alone, no ERROR SUMMARY
_RACE_SUMMARY = re.compile(r"RACECHECK SUMMARY: [\d,]+ hazards? displayed \(([\d,]+) errors?,")
# "at kernel+0x1d0 in file:line", "at kernel(int*)+0x120", "at 0xda0 in file:line:kernel"; not
# "... backtrace up to driver entry point at error"
_AT = re.compile(r"\bat (.+?\+0x[0-9a-fA-F]+(?: in .+)?|0x[0-9a-fA-F]+ in .+)$")
_NOT_ERRORS = re.compile(r"(COMPUTE-SANITIZER|ERROR SUMMARY|RACECHECK SUMMARY|LEAK SUMMARY|"
                         r"Target application returned|errors were not printed)")


def parse_report(text: str, limit: int = 5) -> Report:
    """The error count of every "ERROR SUMMARY: N errors" line (one per process), and the
    first `limit` distinct errors as "what at kernel (file:line)".

    An error is a headline (`========= Invalid __global__ read of size 4 bytes`) and its
    indented details, the first of which that says "at ..." names where it happened."""
    lines = text.splitlines()
    counts = [int(m.group(1).replace(",", "")) for m in map(_SUMMARY.search, lines) if m]
    if not counts:
        counts = [int(m.group(1).replace(",", "")) for m in map(_RACE_SUMMARY.search, lines)
                  if m]
    entries: list[list[str]] = []
    for line in text.splitlines():
        if not line.startswith("========="):
            continue
        body = line[len("========="):]
        if re.match(r" \S", body) and not _NOT_ERRORS.search(body):
            entries.append([body.strip()])
        elif re.match(r"\s{2,}\S", body) and entries:
            entries[-1].append(body.strip())
    distinct: list[str] = []
    for headline, *details in entries:
        where = next((m.group(1) for m in map(_AT.search, (headline, *details)) if m), None)
        what = re.sub(r"\s+at .*$", "", headline)
        text_ = what if where is None else f"{what} at {location(where)}"
        if text_ not in distinct:
            distinct.append(text_)
    return Report(sum(counts) if counts else None, distinct[:limit])


def location(where: str) -> str:
    """A sanitizer's "at ..." as "kernel (file:line)": it writes `kernel+0x1d0 in
    /path/file.py:97`, `0xda0 in /path/file.py:175:kernel`, `0x3b0 in void kernel(int*)` or
    `kernel(int*)+0x120`."""
    where = re.sub(r"\s*\[[\d,]+ hazards?\]\s*$", "", where.strip())
    address, _, rest = where.partition(" in ")
    if re.fullmatch(r"0x[0-9a-fA-F]+", address):
        m = re.fullmatch(r"(.+?):(\d+):(.+)", rest)
        return f"{m.group(3)} ({_short(m.group(1))}:{m.group(2)})" if m else rest
    kernel = re.sub(r"\+0x[0-9a-fA-F]+$", "", address)
    m = re.fullmatch(r"(.+):(\d+)", rest)
    return f"{kernel} ({_short(m.group(1))}:{m.group(2)})" if m else kernel


def _short(path: str) -> str:
    """A source path from the package or test root (pagedserve/..., tests/...), else its
    name."""
    for root in ("pagedserve/", "tests/", "triton/"):
        if root in path:
            return root + path.rsplit(root, 1)[1]
    return Path(path).name


# -- running the pairs -----------------------------------------------------------------------

@dataclass
class Run:
    target: Target
    tool: str
    argv: list[str]
    env: dict[str, str]  # added to this process's environment

    @property
    def command(self) -> str:
        return " ".join([*(f"{k}={v}" for k, v in self.env.items()), shlex.join(self.argv)])


def make_run(target: Target, tool: str, args: argparse.Namespace,
             checkpoint: str | None) -> Run:
    argv = [args.sanitizer, "--tool", tool, "--print-limit", str(PRINT_LIMIT),
            "--error-exitcode", "0", "--target-processes", "application-only"]
    if tool == RACE:
        argv += ["--racecheck-report", "all"]
    argv += [sys.executable, str(SCRIPT), "--workload", target.workload, "--device", args.device]
    if args.quick or tool in QUICK_TOOLS:
        argv.append("--quick")
    if checkpoint and target.workload.startswith("engine"):
        argv += ["--checkpoint", checkpoint]
    env = dict(target.env)
    if not target.graphs:
        env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
    return Run(target, tool, argv, env)


def execute(run: Run, timeout: float, logs: Path) -> dict:
    """One sanitizer run in its own process group (a timeout kills the sanitizer and the
    workload under it): its row, less the fields common to the whole invocation."""
    env = {**os.environ, **run.env, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    start = time.monotonic()
    proc = subprocess.Popen(run.argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace",
                            start_new_session=True)
    timed_out = False
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
    seconds = time.monotonic() - start
    (logs / f"{run.target.name}.{run.tool}.log").write_text(output)
    report = parse_report(output)
    row = {"target": run.target.name, "tool": run.tool,
           "errors": None if timed_out else report.errors,
           "first_errors": report.first_errors, "seconds": round(seconds, 1),
           "rc": None if timed_out else proc.returncode, "timed_out": timed_out,
           "command": run.command}
    row["status"] = status(row)
    if row["status"] != "clean":
        row["tail"] = output[-2000:]
    return row


def status(row: dict) -> str:
    if row["timed_out"]:
        return "timeout"
    if row["errors"] is None:
        return "no summary"
    if row["errors"] > 0:
        return "errors"
    return "clean" if row["rc"] == 0 else "workload failed"


def run_all(runs: list[Run], args: argparse.Namespace, logs: Path
            ) -> tuple[list[dict], list[Run]]:
    """The shared runs `--jobs` at a time, then the exclusive ones alone, none started once
    `--budget` seconds have passed (and none running past it): (rows, skipped runs)."""
    deadline = time.monotonic() + args.budget
    rows: dict[int, dict] = {}
    skipped: list[Run] = []

    def attempt(i: int, run: Run) -> None:
        left = deadline - time.monotonic()
        if left < 10:
            skipped.append(run)
            return
        print(f"  {run.target.name} / {run.tool} ...", flush=True)
        rows[i] = execute(run, min(args.timeout, left), logs)
        print(f"  {run.target.name} / {run.tool}: {rows[i]['status']} "
              f"({rows[i]['seconds']} s)", flush=True)

    shared = [(i, r) for i, r in enumerate(runs) if not r.target.exclusive]
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for future in [pool.submit(attempt, i, r) for i, r in shared]:
            future.result()
    for i, run in enumerate(runs):
        if run.target.exclusive:
            attempt(i, run)
    return [rows[i] for i in sorted(rows)], skipped


def describe_device(device: str) -> str:
    if device == "cpu":
        return f"cpu ({platform.machine()})"
    import torch
    import triton

    return (f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
            f"triton {triton.__version__}")


def git_commit() -> str:
    def git(*cmd: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True)

    head = git("rev-parse", "--short=12", "HEAD")
    if head.returncode != 0:
        return "unknown"
    dirty = git("diff", "--quiet", "HEAD", "--").returncode != 0
    return head.stdout.strip() + ("+dirty" if dirty else "")


def sanitizer_version(sanitizer: str) -> str:
    try:
        out = subprocess.run([sanitizer, "--version"], capture_output=True, text=True,
                             timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    versions = re.findall(r"Version \S+", out)
    return versions[-1] if versions else (out.strip().splitlines() or ["unknown"])[-1]


def make_checkpoint(folder: Path) -> str:
    """The engine targets' random tiny Qwen3, made once for all of them."""
    subprocess.run([sys.executable, str(ROOT / "benchmarks/make_checkpoint.py"),
                    str(TINY_CONFIG), str(folder), "--tokenizer", "bytes",
                    "--dtype", "bfloat16"], check=True, stdout=subprocess.DEVNULL)
    return str(folder)


def append_rows(path: Path, rows: list[dict]) -> None:
    existing = json.loads(path.read_text()) if path.exists() else []
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(existing + rows, indent=1) + "\n")


def table(rows: list[dict], skipped: list[Run]) -> str:
    """One line per pair, then the first errors of each pair that has any."""
    lines = [f"{'target':<14} {'tool':<10} {'status':<16} {'errors':>6} {'seconds':>8}",
             "-" * 58]
    for r in rows:
        errors = "-" if r["errors"] is None else str(r["errors"])
        lines.append(f"{r['target']:<14} {r['tool']:<10} {r['status']:<16} {errors:>6} "
                     f"{r['seconds']:>8.0f}")
    for run in skipped:
        lines.append(f"{run.target.name:<14} {run.tool:<10} {'skipped (budget)':<16}")
    for r in rows:
        if r["first_errors"]:
            lines += [f"\n{r['target']} / {r['tool']}:", *(f"  {e}" for e in r["first_errors"])]
    return "\n".join(lines)


def orchestrate(args: argparse.Namespace) -> int:
    if shutil.which(args.sanitizer) is None:
        raise SystemExit(f"{args.sanitizer!r} is not on PATH (it comes with the CUDA toolkit)")
    if args.device == "auto":
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    pairs = plan(args.only, args.tools)
    logs = Path(args.logs or tempfile.mkdtemp(prefix="pagedserve-sanitize-"))
    logs.mkdir(parents=True, exist_ok=True)
    common = {"device": describe_device(args.device),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "commit": git_commit(), "sanitizer": sanitizer_version(args.sanitizer),
              "jobs": args.jobs}
    with tempfile.TemporaryDirectory(prefix="pagedserve-sanitize-model-") as tmp:
        checkpoint = None
        if any(t.workload.startswith("engine") for t, _ in pairs):
            checkpoint = make_checkpoint(Path(tmp) / "tiny-qwen3")
        runs = [make_run(t, tool, args, checkpoint) for t, tool in pairs]
        print(f"{len(runs)} sanitizer runs, {args.jobs} at a time; logs in {logs}", flush=True)
        rows, skipped = run_all(runs, args, logs)
    rows = [{**row, **common} for row in rows]
    append_rows(Path(args.out) / "sanitizer.json", rows)
    print(f"\nlogs: {logs}\nappended {len(rows)} rows to {Path(args.out) / 'sanitizer.json'}\n")
    print(table(rows, skipped))
    return 0 if not skipped and all(r["status"] == "clean" for r in rows) else 1


# -- workloads -------------------------------------------------------------------------------

class WorkloadFailure(AssertionError):
    pass


@dataclass
class Ctx:
    """What a workload runs on: CUDA at realistic sizes, or the CPU under the Triton
    interpreter (and with `small` on CUDA) at tiny ones; and the count of checks passed."""

    device: str
    small: bool
    checkpoint: str | None = None
    checks: int = 0

    @property
    def gpu(self) -> bool:
        return self.device == "cuda"

    def check(self, ok, what: str) -> None:
        if not bool(ok):
            raise WorkloadFailure(what)
        self.checks += 1

    def close(self, actual, expected, what: str, tol: float) -> None:
        """Elementwise within tol (absolute and relative), NaN nowhere but where expected."""
        import torch

        a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
        ok = a.shape == e.shape and bool(torch.isclose(a, e, rtol=tol, atol=tol).all())
        err = float((a - e).abs().nan_to_num(float("inf")).max()) if a.shape == e.shape else -1
        self.check(ok, f"{what}: max |error| {err:.3g} > {tol}")

    def rel_close(self, actual, expected, what: str, tol: float) -> None:
        """||actual - expected|| / ||expected|| below tol, all of it finite."""
        a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
        self.check(bool(a.isfinite().all()), f"{what}: non-finite values")
        err = float((a - e).norm() / e.norm())
        self.check(err < tol, f"{what}: relative error {err:.3g} >= {tol}")


def seeded(ctx: Ctx, seed: int):
    import torch

    return torch.Generator(device=ctx.device).manual_seed(seed)


def one_step_apart(a, b) -> bool:
    """e4m3 bytes equal, or neighbours in a few (a division rounded differently)."""
    import torch

    diff = (a.view(torch.uint8).int() - b.view(torch.uint8).int()).abs()
    return bool((diff <= 1).all()) and float((diff == 0).float().mean()) > 0.999


def same_bytes(a, b) -> bool:
    import torch

    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8).cpu(),
                                              b.contiguous().view(torch.uint8).cpu())


def w_attention(ctx: Ctx) -> None:
    """Store-KV (bf16, FP8; alone and rotating q/k as it stores), decode v1 (in order and
    longest first) and v2 (split_short on and off, a grid sized for 4x the longest sequence,
    three launches in a row on the same arrival counters), chunked prefill over a cached
    prefix (with prefix hits written as slot -1, and a sliding window), whole mixed steps
    through the Triton backend (window and score cap), GQA 1-8, ragged contexts crossing
    blocks, tiles and partitions, NaN-filled caches padded with the null block, bf16 (fp32 on
    the interpreter) and FP8 caches; block copy and swap between GPU and pinned CPU caches."""
    import torch

    from pagedserve.attention import kv_quant, torch_ref
    from pagedserve.kernels.triton.attention import (DecodeConfig, PrefillConfig, longest_first,
                                              paged_decode_v1, paged_decode_v2, paged_prefill,
                                              store_kv)
    from pagedserve.kernels.triton.arrivals import arrival_counters
    from pagedserve.kernels.triton.attention.decode import FP8_DECODE
    from pagedserve.attention.triton_backend import TritonBackend
    from tests.attention.paged_case import make_case

    dev = ctx.device
    if ctx.gpu:  # bf16 queries and caches, the engine's tiles
        dtype, tol, head_dim = torch.bfloat16, 2e-2, 128
        gqa = [(4, 4), (8, 4), (16, 4), (8, 1)]
        contexts = [0, 14, 15, 16, 31, 32, 63, 100, 300, 1000, 1500]
        v1_cfg, prefill_cfg = DecodeConfig(), PrefillConfig()
        v2_cfgs = [DecodeConfig(block_n=64, partition=128),
                   DecodeConfig(block_n=32, partition=256, split_short=False)]
        fp8_cfgs = [FP8_DECODE, DecodeConfig(block_n=64, partition=256, bits_k=True,
                                             bits_v=True, fp16_dot=True)]
        prefills = [(0, 17), (0, 70), (16, 16), (17, 30), (33, 100), (45, 3), (500, 17)]
        backend = TritonBackend()
    else:  # the interpreter: its bf16 tl.dot is broken (tests/kernels/test_kernels.py)
        dtype, tol, head_dim = torch.float32, 1e-4, 32
        gqa = [(2, 2), (4, 2), (8, 2), (8, 1)]
        contexts = [0, 14, 15, 16, 33, 70]
        v1_cfg, prefill_cfg = DecodeConfig(block_n=16), PrefillConfig(block_m=16, block_n=16)
        v2_cfgs = [DecodeConfig(block_n=16, partition=32),
                   DecodeConfig(block_n=16, partition=32, split_short=False)]
        fp8_cfgs = [DecodeConfig(block_n=16, partition=32)]
        prefills = [(0, 17), (16, 16), (17, 30), (45, 3)]
        backend = TritonBackend(v1_cfg, prefill_cfg)
    grid = 4 if ctx.gpu else 2  # v2's grid: this many times the longest sequence
    launches = 2 if ctx.small else 3
    if ctx.small:
        gqa = gqa[1::2]

    def scales(num_kv_heads: int, seed: int):
        gen = torch.Generator().manual_seed(seed)
        k, v = (0.004 + 0.026 * torch.rand(num_kv_heads, generator=gen) for _ in range(2))
        return k, v

    def null_block_untouched(case) -> bool:
        return bool(case.k_cache[0].float().isnan().all() and case.v_cache[0].float().isnan().all())

    # store-KV: bf16 bit for bit, FP8 as torch rounds (a step apart at most on the GPU)
    for fp8 in (False, True):
        case = make_case([(5, 1), (0, 20), (40, 9)], 8, 2, head_dim, 16, dtype=dtype, seed=1,
                         prefix_hit_rows=3, device=dev,
                         kv_scales=scales(2, 1) if fp8 else None)
        ref_k, ref_v = case.k_cache.clone(), case.v_cache.clone()
        torch_ref.store_kv(case.k, case.v, ref_k, ref_v, case.meta.slot_mapping, case.kv_scales)
        store_kv(case.k, case.v, case.k_cache, case.v_cache, case.meta.slot_mapping,
                 case.kv_scales)
        for got, ref in ((case.k_cache, ref_k), (case.v_cache, ref_v)):
            ctx.check(one_step_apart(got, ref) if fp8 and ctx.gpu else same_bytes(got, ref),
                      f"store_kv fp8={fp8}: cache differs from torch_ref")
        ctx.check(null_block_untouched(case), "store_kv wrote into the null block")
    rotate_store(ctx, dtype, head_dim, gqa, scales, null_block_untouched)

    for heads, kv_heads in gqa:
        for fp8 in (False, True) if heads == 8 or not ctx.small else (False,):
            case = make_case([(c, 1) for c in contexts], heads, kv_heads, head_dim, 16,
                             dtype=dtype, seed=heads * 10 + kv_heads, device=dev,
                             kv_scales=scales(kv_heads, heads) if fp8 else None)
            m, kv = case.meta, case.kv_scales  # (the scales on the cache's device)
            store_kv(case.k, case.v, case.k_cache, case.v_cache, m.slot_mapping, kv)
            what = f"GQA {heads}/{kv_heads} fp8={fp8}"
            for order in (None, longest_first(m.seq_lens)):
                for cfg in (fp8_cfgs if fp8 else [v1_cfg]):
                    out = torch.full_like(case.q, float("nan"))
                    paged_decode_v1(case.q, case.k_cache, case.v_cache, m.block_tables,
                                    m.seq_lens, case.scale, out, cfg, kv_scales=kv, order=order)
                    ctx.close(out, case.expected, f"{what} v1 {cfg} ordered={order is not None}",
                              tol)
            for cfg in (fp8_cfgs if fp8 else v2_cfgs):
                first = None
                for launch in range(launches):  # each leaves the counters zero for the next
                    out = torch.full_like(case.q, float("nan"))
                    paged_decode_v2(case.q, case.k_cache, case.v_cache, m.block_tables,
                                    m.seq_lens, grid * m.max_seq_len, case.scale, out, cfg,
                                    kv_scales=kv)
                    ctx.close(out, case.expected, f"{what} v2 {cfg} launch {launch}", tol)
                    counters = arrival_counters(len(contexts) * kv_heads, case.q.device)
                    ctx.check(not counters.any(), f"{what} v2 {cfg}: arrival counters left set")
                    first = out if first is None else first
                    ctx.check(torch.equal(out, first), f"{what} v2 {cfg}: launches differ")
            ctx.check(null_block_untouched(case), f"{what}: the null block was written")

        # chunked prefill over cached prefixes (two leading decodes: the first_seq offset),
        # global and windowed, after the step's K/V is stored
        for window in (None, 24):
            case = make_case([(3, 1), (20, 1)] + prefills, heads, kv_heads, head_dim, 16,
                             dtype=dtype, seed=heads + 3, prefix_hit_rows=2, device=dev,
                             window=window,  # the windowed case on an FP8 cache
                             kv_scales=scales(kv_heads, 7) if window else None)
            m, kv = case.meta, case.kv_scales
            store_kv(case.k, case.v, case.k_cache, case.v_cache, m.slot_mapping, kv)
            out = torch.full_like(case.q, float("nan"))
            paged_prefill(case.q, case.k_cache, case.v_cache, m.block_tables, m.seq_lens,
                          m.query_start_loc, 2, len(prefills), m.max_query_len, case.scale,
                          out, prefill_cfg, window, kv_scales=kv)
            ctx.check(out[:2].float().isnan().all(), "prefill wrote the decode rows")
            ctx.close(out[2:], case.expected[2:], f"prefill GQA {heads}/{kv_heads} "
                      f"window={window}", tol)

    # whole mixed steps through the backend: store, decode, prefill; window and score cap
    for fp8, window, softcap in ((False, None, None), (True, None, 20.0), (False, 10, 1.5)):
        case = make_case([(0, 1), (30, 1), (70, 1), (300, 1), (0, 18), (33, 5)], 8, 2,
                         head_dim, 16, dtype=dtype, seed=11, prefix_hit_rows=2, device=dev,
                         window=window, softcap=softcap,
                         kv_scales=scales(2, 5) if fp8 else None)
        kv = case.kv_scales
        out = backend.forward(case.q, case.k, case.v, case.k_cache, case.v_cache, case.meta,
                              case.scale, window=window, softcap=softcap, kv_scales=kv)
        ctx.close(out, case.expected, f"backend fp8={fp8} window={window} softcap={softcap}",
                  tol)
        ctx.check(null_block_untouched(case), "backend step wrote into the null block")

    # block copy (copy-on-write) and swap out to / in from pinned CPU caches
    for cache_dtype in (dtype, kv_quant.FP8_DTYPE):
        gen = seeded(ctx, 3)
        caches = [tuple((torch.randn(9, 16, 2, head_dim, generator=gen, device=dev) * 50)
                        .to(cache_dtype) for _ in range(2)) for _ in range(2)]
        expected = [tuple(c.clone() for c in layer) for layer in caches]
        pairs = torch.tensor([[1, 5], [2, 6], [1, 8]])
        torch_ref.TorchRefBackend().copy_blocks(expected, pairs)
        backend.copy_blocks(caches, pairs)
        ctx.check(all(same_bytes(a, b) for la, lb in zip(caches, expected)
                      for a, b in zip(la, lb)), f"copy_blocks {cache_dtype}")
        pin = ctx.gpu
        host = [tuple(torch.zeros(c.shape, dtype=cache_dtype, pin_memory=pin) for c in layer)
                for layer in caches]
        backend.swap_blocks(caches, host, torch.tensor([[5, 0], [6, 3], [7, 4]]))
        if ctx.gpu:
            torch.cuda.synchronize()
        ctx.check(all(same_bytes(h[[0, 3, 4]], c[[5, 6, 7]].cpu()) for lh, lc in
                      zip(host, caches) for h, c in zip(lh, lc)), f"swap out {cache_dtype}")
        backend.swap_blocks(host, caches, torch.tensor([[3, 1], [0, 2]]))
        ctx.check(all(same_bytes(c[[1, 2]].cpu(), h[[3, 0]]) for lh, lc in zip(host, caches)
                      for h, c in zip(lh, lc)), f"swap in {cache_dtype}")


def rotate_store(ctx: Ctx, dtype, head_dim: int, gqa: list, scales,
                 null_block_untouched) -> None:
    """The K/V store that rotates (`rotate_store_kv_`) against `rotate_qk_` then `store_kv`:
    the same bytes in q and both caches, with and without the q/k norm, bf16 (fp32 on the
    interpreter) and FP8 caches, prefix hits and padding as slot -1, a wider token stride."""
    import torch

    from pagedserve.kernels.triton import model_ops
    from pagedserve.kernels.triton.attention import rotate_store_kv_, store_kv
    from pagedserve.model.config import ModelConfig
    from pagedserve.model.rope import RotaryEmbedding
    from tests.attention.paged_case import make_case

    dev, gen, max_len = ctx.device, seeded(ctx, 5), 4096 if ctx.gpu else 40
    config = ModelConfig(family="llama", vocab_size=8, hidden_size=head_dim, intermediate_size=8,
                         num_layers=1, num_heads=1, num_kv_heads=1, head_dim=head_dim,
                         rms_norm_eps=1e-6, rope_theta=10000.0, max_model_len=max_len,
                         tie_word_embeddings=True)
    cos, sin = RotaryEmbedding(config).tables(torch.device(dev), dtype)
    for heads, kv_heads in gqa:
        for fp8 in (False, True):
            for qk_norm in (False, True):
                case = make_case([(5, 1), (0, 20), (40, 9)], heads, kv_heads, head_dim, 16,
                                 dtype=dtype, seed=heads + kv_heads, prefix_hit_rows=3,
                                 device=dev, kv_scales=scales(kv_heads, 2) if fp8 else None)
                m, kv, width = case.meta, case.kv_scales, heads + 2 * kv_heads
                buffer = torch.zeros(case.q.shape[0], width + 1, head_dim, dtype=dtype,
                                     device=dev)
                qkv = buffer[:, 1:]  # the fused projection's token stride, wider
                qkv.copy_(torch.cat([case.q, case.k, case.v], 1))
                positions = torch.randint(0, max_len, (qkv.shape[0],), generator=gen,
                                          device=dev)
                positions[0] = max_len - 1
                weights = ([(1 + 0.3 * torch.randn(head_dim, generator=gen, device=dev))
                            .to(dtype) for _ in range(2)] if qk_norm else [None, None])
                want, want_k, want_v = qkv.clone(), case.k_cache.clone(), case.v_cache.clone()
                model_ops.rotate_qk_(want, positions, cos, sin, heads, kv_heads, *weights, 1e-6)
                store_kv(want[:, heads:heads + kv_heads], want[:, heads + kv_heads:], want_k,
                         want_v, m.slot_mapping, kv)
                rotate_store_kv_(qkv, kv_heads, positions, cos, sin, *weights, 1e-6,
                                 case.k_cache, case.v_cache, m.slot_mapping, kv)
                what = f"rotate_store_kv_ GQA {heads}/{kv_heads} fp8={fp8} qk_norm={qk_norm}"
                ctx.check(same_bytes(qkv[:, :heads], want[:, :heads]), f"{what}: q differs")
                ctx.check(same_bytes(case.k_cache, want_k) and same_bytes(case.v_cache, want_v),
                          f"{what}: the caches differ from rotate_qk_ then store_kv")
                ctx.check(not buffer[:, 0].any(), f"{what}: wrote outside qkv")
                ctx.check(null_block_untouched(case), f"{what}: wrote into the null block")


def w_model_ops(ctx: Ctx) -> None:
    """The decoder's Triton kernels against the eager PyTorch ops: add + RMSNorm (with and
    without a residual, ragged widths), q/k RMSNorm + RoPE in place on a strided fused QKV
    view (positions up to the table's last row; v and the neighbouring memory untouched),
    SiLU * up over two column blocks, the float linears' one-row GEMV (`dense_gemv`)."""
    import torch

    from pagedserve.kernels.triton import model_ops
    from pagedserve.model import ops
    from pagedserve.model.config import ModelConfig
    from pagedserve.model.rope import RotaryEmbedding

    dev = ctx.device
    dtype = torch.bfloat16 if ctx.gpu else torch.float32
    gen = seeded(ctx, 0)

    def matches(actual, expected, what: str) -> None:
        if dtype == torch.float32:
            ctx.close(actual, expected, what, 1e-5)
            return  # bf16: equal but for a norm's summation order or exp's last bit
        ctx.close(actual, expected, what, 2 ** -6)
        equal = float((actual == expected).float().mean())
        ctx.check(equal > 0.95, f"{what}: only {equal:.3f} of elements equal")

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=dev).to(dtype)

    norms = [(1, 1024), (7, 896), (33, 4096)] if ctx.gpu else [(1, 64), (7, 96), (5, 200)]
    for tokens, hidden in norms:
        for with_residual in (False, True):
            x = 2 * randn(tokens, hidden)
            residual = 3 * randn(tokens, hidden) if with_residual else None
            weight = 1 + 0.3 * randn(hidden)
            ref_res = None if residual is None else residual.clone()
            ref_out, ref_sum = ops.eager_fused_add_rms_norm(x.clone(), ref_res, weight, 1e-6)
            out, total = model_ops.rms_norm(x, weight, 1e-6, residual)
            what = f"rms_norm {tokens}x{hidden} residual={with_residual}"
            ctx.check(torch.equal(total, ref_sum), f"{what}: the residual sum differs")
            matches(out, ref_out, what)

    max_len = 4096 if ctx.gpu else 40
    shapes = ([(64, 32, 8), (128, 16, 8), (128, 16, 2), (128, 8, 1)] if ctx.gpu
              else [(64, 2, 2), (32, 4, 2), (64, 8, 1)])
    for head_dim, heads, kv_heads in shapes:
        config = ModelConfig(family="llama", vocab_size=8, hidden_size=head_dim,
                             intermediate_size=8, num_layers=1, num_heads=1, num_kv_heads=1,
                             head_dim=head_dim, rms_norm_eps=1e-6, rope_theta=10000.0,
                             max_model_len=max_len, tie_word_embeddings=True)
        cos, sin = RotaryEmbedding(config).tables(torch.device(dev), dtype)
        for qk_norm in (False, True):
            tokens = 37 if ctx.gpu else 5
            positions = torch.randint(0, max_len, (tokens,), generator=gen, device=dev)
            positions[0] = max_len - 1  # the table's last row
            width = heads + 2 * kv_heads
            buffer = 2 * randn(tokens, width + 1, head_dim)  # a wider token stride
            qkv = buffer[:, 1:]
            weights = [1 + 0.3 * randn(head_dim) for _ in range(2)] if qk_norm else [None] * 2
            expected = qkv.clone()
            ops.eager_rotate_qk_(expected, positions, cos, sin, heads, kv_heads, *weights,
                                 1e-6)
            before = buffer.clone()
            model_ops.rotate_qk_(qkv, positions, cos, sin, heads, kv_heads, *weights, 1e-6)
            what = f"rotate_qk_ D={head_dim} {heads}/{kv_heads} qk_norm={qk_norm}"
            rotated = heads + kv_heads
            matches(qkv[:, :rotated], expected[:, :rotated], what)
            ctx.check(torch.equal(qkv[:, rotated:], before[:, 1 + rotated:]),
                      f"{what}: v changed")
            ctx.check(torch.equal(buffer[:, 0], before[:, 0]), f"{what}: wrote outside qkv")

    for tokens, inner in ([(1, 3072), (37, 1500), (64, 9728)] if ctx.gpu
                          else [(1, 96), (6, 1500)]):
        gate_up = 3 * randn(tokens, 2 * inner)
        matches(model_ops.silu_and_mul(gate_up), ops.eager_silu_and_mul(gate_up),
                f"silu_and_mul {tokens}x{inner}")

    # the float linears' one-row GEMV (split-K, arrival counters): ragged N and K, a bias,
    # and a row of a wider buffer as `out` (a row-parallel layer's peer memory)
    from pagedserve.kernels.triton import dense_gemv

    for n, k in ([(1536, 4096), (4096, 3584), (37, 300), (1000, 1100)] if ctx.gpu
                 else [(37, 300), (20, 130)]):
        x, weight, bias = randn(1, k), randn(n, k) / k ** 0.5, randn(n)
        want = _linear_reference(x, weight.double().cpu(), bias)
        wide = torch.full((2, n + 8), float("nan"), dtype=dtype, device=dev)
        got = dense_gemv.gemv(x, weight, bias, out=wide[1:, 4:4 + n])
        ctx.close(got.double().cpu(), want, f"dense gemv {n}x{k}", 2 ** -6)
        ctx.check(bool(wide[0].isnan().all() and wide[1, :4].isnan().all()
                       and wide[1, 4 + n:].isnan().all()), f"dense gemv {n}x{k}: wrote outside out")


def _dequantized(w_q, w_scale):
    """An e4m3 weight with per-row scales as float64 on the CPU (the GEMVs' reference)."""
    return w_q.double().cpu() * w_scale.double().cpu()[:, None]


def _linear_reference(x, weight, bias=None):
    want = x.double().cpu() @ weight.t()
    return want if bias is None else want + bias.double().cpu()


def w_fp8(ctx: Ctx) -> None:
    """Per-token activation quantization against torch's; the weight-only GEMVs (1-16 rows
    through tl.dot, K whole and split with arrival counters, e4m3 by casts and by bit moves;
    one row through the e4m3 word path, narrowed and split; a row off words through tl.dot)
    against the dequantized weight in float64; on CUDA the many-token path (quantize, then
    `_scaled_mm`); a norm -> GEMV -> SiLU chain launched back to back (PDL on Hopper)."""
    import torch

    from pagedserve.kernels.triton.arrivals import arrival_counters
    from pagedserve.kernels.triton import model_ops
    from pagedserve.model import fp8
    from pagedserve.kernels.triton.fp8_linear import (WEIGHT_ONLY, WEIGHT_ONLY_ONE_ROW,
                                             WeightOnlyConfig, linear, quantize_tokens,
                                             weight_only_linear)

    dev = ctx.device
    gen = seeded(ctx, 1)
    # the interpreter's bf16 tl.dot is broken: float16 there (e4m3 casts exactly to both)
    dtype = torch.bfloat16 if ctx.gpu else torch.float16

    rows, k = (37, 4096) if ctx.gpu else (5, 100)
    x = torch.randn(rows, k + 4, generator=gen, device=dev)
    x[3] *= 100
    x[2] = 0  # an all-zero token
    x = x.to(dtype)[:, :k]  # a strided view, as of a wider activation
    q, scale = quantize_tokens(x)
    q_ref, scale_ref = fp8.quantize_rows(x)
    if ctx.gpu:  # Triton's division is the approximate one there: an ulp apart at most
        ctx.close(scale[:, 0], scale_ref, "quantize_tokens: scales", 1e-6)
    else:
        ctx.check(torch.equal(scale[:, 0], scale_ref), "quantize_tokens: scales differ")
    ctx.check(one_step_apart(q, q_ref) if ctx.gpu else same_bytes(q, q_ref),
              "quantize_tokens: e4m3 values differ from torch's rounding")

    if ctx.gpu:
        shapes = [(1000, 3000), (4096, 4096), (37, 602)]  # 602: not in words
        row_counts = (1, 7, 16)
        configs = [WEIGHT_ONLY, WeightOnlyConfig(programs_per_sm=0),
                   WeightOnlyConfig(bits=False, programs_per_sm=8),
                   WEIGHT_ONLY_ONE_ROW, WeightOnlyConfig(fma=True, block_n=16, block_k=256),
                   WeightOnlyConfig(fma=True, bits=True, block_n=8, block_k=512,
                                    programs_per_sm=8)]
        tol = 5e-3
    else:  # one program per 16 rows, K in 2-3 slices, words, narrowed (tests/kernels)
        shapes = [(37, 600), (37, 602)]
        row_counts = (1, 3)
        configs = [WeightOnlyConfig(16, 256, 4, 2),
                   WeightOnlyConfig(16, 256, 4, 2, programs_per_sm=64, bits=True),
                   WeightOnlyConfig(16, 256, 4, 2, fma=True),
                   WeightOnlyConfig(16, 256, 4, 2, programs_per_sm=64, bits=True, fma=True),
                   WeightOnlyConfig(16, 256, 4, 2, programs_per_sm=64, fma=True,
                                    min_block_n=4)]
        tol = 2e-3
    if ctx.small:  # every variant still, at fewer shapes
        shapes, row_counts = [shapes[0], shapes[-1]], row_counts[:2]
    for n, k in shapes:
        w = torch.randn(n, k, generator=gen, device=dev) * torch.logspace(
            -3, 0, n, device=dev)[:, None]
        w_q, w_scale = fp8.quantize_rows(w)
        reference = _dequantized(w_q, w_scale)
        bias = torch.randn(n, generator=gen, device=dev).to(dtype)
        for num_rows in row_counts:
            x = torch.randn(num_rows, k, generator=gen, device=dev).to(dtype)
            for cfg in configs:
                for b in (None, bias):
                    got = weight_only_linear(x, w_q, w_scale, b, cfg)
                    what = f"weight_only_linear {num_rows}x{k} @ {n} {cfg} bias={b is not None}"
                    ctx.check(got.dtype == dtype and got.shape == (num_rows, n), what)
                    ctx.rel_close(got, _linear_reference(x, reference, b), what, tol)
                counters = arrival_counters(triton_cdiv(n, cfg.block_n), x.device)
                ctx.check(not counters.any(), f"{what}: arrival counters left set")

    if ctx.gpu:  # many tokens: the Triton quantization feeding torch._scaled_mm
        w_q, w_scale = fp8.quantize_rows(torch.randn(1024, 4096, generator=gen, device=dev) * .02)
        x = torch.randn(37, 4096, generator=gen, device=dev).to(dtype)
        got = linear(x, w_q, w_scale)
        ctx.rel_close(got, fp8.reference_linear(x.float(), w_q, w_scale), "fp8_linear 37 rows",
                      1e-2)

    # norm -> weight-only GEMV -> SiLU * up, back to back: each kernel must wait for its input
    hidden, inter = (4096, 3072) if ctx.gpu else (256, 48)
    w_q, w_scale = fp8.quantize_rows(
        torch.randn(2 * inter, hidden, generator=gen, device=dev) * 0.02)
    norm_w = (torch.rand(hidden, generator=gen, device=dev) + 0.5).to(dtype)
    reference = _dequantized(w_q, w_scale)
    for num_rows in (1, 4):
        for _ in range(3):
            x = torch.randn(num_rows, hidden, generator=gen, device=dev).to(dtype)
            y = model_ops.silu_and_mul(weight_only_linear(model_ops.rms_norm(
                x, norm_w, 1e-5)[0], w_q, w_scale))
            xn = x.double().cpu()
            xn = xn * torch.rsqrt(xn.pow(2).mean(-1, keepdim=True) + 1e-5) * norm_w.double().cpu()
            gate, up = _linear_reference(xn, reference).chunk(2, dim=-1)
            ctx.rel_close(y, torch.nn.functional.silu(gate) * up, f"norm-GEMV-SiLU chain "
                          f"{num_rows} rows", 3e-2)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def w_moe(ctx: Ctx) -> None:
    """The fused MoE kernels (gate/up, then down) against every token through each of its
    experts in float64: 8 and 128 experts, top-k 1 to 8, experts that get no token, ragged
    tiles and widths; then experts kept quantized (`_moe_quantized`)."""
    import torch
    import torch.nn.functional as F

    from pagedserve.model.moe import route
    from pagedserve.kernels.triton.moe import fused_moe

    dev = ctx.device
    if ctx.gpu:
        dtype, tol, hidden, inter = torch.bfloat16, 2e-2, 512, 200
        cases = [(8, 1, 5), (8, 2, 19), (8, 8, 7), (128, 8, 37), (128, 2, 3)]
    else:
        dtype, tol, hidden, inter = torch.float32, 1e-5, 32, 48
        cases = [(8, 1, 5), (8, 2, 19), (128, 8, 9)]
    if ctx.small:
        cases = cases[1::2]
    gen = seeded(ctx, 2)
    for num_experts, top_k, tokens in cases:
        x = torch.randn(tokens, hidden, generator=gen, device=dev).to(dtype)
        w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen, device=dev)
               * 0.2).to(dtype)
        w2 = (torch.randn(num_experts, hidden, inter, generator=gen, device=dev) * 0.2).to(dtype)
        logits = torch.randn(tokens, num_experts, generator=gen, device=dev)
        weights, ids = route(logits, top_k, renormalize=True,
                             weights_dtype=dtype if ctx.gpu else None)
        out = fused_moe(x, w13, w2, weights, ids)
        xc, w13c, w2c, wc, idc = (t.double().cpu() for t in (x, w13, w2, weights, ids))
        want = torch.zeros(tokens, hidden, dtype=torch.float64)
        for t in range(tokens):
            for j in range(top_k):
                e = int(idc[t, j])
                gate, up = (w13c[e] @ xc[t]).chunk(2)
                want[t] += float(wc[t, j]) * (w2c[e] @ (F.silu(gate) * up))
        what = f"fused_moe E={num_experts} top_k={top_k} T={tokens}"
        if ctx.gpu:  # bf16 rounds where transformers rounds
            ctx.rel_close(out, want, what, tol)
        else:
            ctx.close(out, want, what, tol)
    _moe_quantized(ctx, dtype, tol)


def _moe_quantized(ctx: Ctx, dtype, tol: float) -> None:
    """The same kernels on experts kept quantized (each projection a `weight_formats.Stacked`
    unpacked per tile): 4-bit with zero points and g_idx, and GGUF Q4_K / Q8_0 blocks,
    against the loop on the weights the torch reference dequantizes."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    from pagedserve.kernels.gguf_format import BLOCKS, GgufWeight
    from pagedserve.kernels.triton.moe import fused_moe
    from pagedserve.kernels.weight_formats import IntWeight, pack_codes, stacked
    from pagedserve.model.moe import route

    dev, e, top_k = ctx.device, 8, 2
    hidden, inter, tokens = (512, 256, 37) if ctx.gpu else (256, 64, 9)
    gen, rng = torch.Generator().manual_seed(5), np.random.default_rng(5)

    def int_experts(n, k, group=32):
        codes = torch.randint(0, 16, (e, n, k), generator=gen)
        scales = (torch.rand(e, n, k // group, generator=gen) * 0.02 + 0.001).to(dtype)
        zeros = torch.randint(0, 16, (e, n, k // group), generator=gen).to(dtype)
        order = torch.stack([torch.randperm(k, generator=gen) // group for _ in range(e)])
        q, s, z, g = (t.to(dev) for t in (torch.stack([pack_codes(c, 4) for c in codes]),
                                          scales, zeros, order.to(torch.int32)))
        return stacked(IntWeight(q[i], s[i], z[i], g[i], 4, group, k) for i in range(e))

    def gguf_experts(n, k, qtype):
        per_block, size = BLOCKS[qtype]
        blocks = rng.integers(0, 256, (e, n, k // per_block, size), dtype=np.uint8)
        offset, count = GGUF_F16_SCALES[qtype]
        scales = (rng.standard_normal((e, n, k // per_block, count)) * 0.01).astype(np.float16)
        blocks[..., offset:offset + 2 * count] = scales.view(np.uint8)
        b = torch.from_numpy(blocks.reshape(e, n, -1)).to(dev)
        return stacked(GgufWeight(b[i], qtype, k) for i in range(e))

    cases = {"int4 zeros g_idx": (int_experts(inter, hidden), int_experts(inter, hidden),
                                  int_experts(hidden, inter)),
             "gguf q4_k/q8_0": (gguf_experts(inter, hidden, 12), gguf_experts(inter, hidden, 12),
                                gguf_experts(hidden, inter, 8))}
    for name, (gate, up, down) in cases.items():
        x = (torch.randn(tokens, hidden, generator=gen) * 0.1).to(dtype)  # no exp overflow
        weights, ids = route(torch.randn(tokens, e, generator=gen), top_k, True, None)
        out = fused_moe(x.to(dev), (gate, up), down, weights.to(dev), ids.to(dev))
        g, u, d = (torch.stack([w.dequantize(dtype).double().cpu() for w in p.experts])
                   for p in (gate, up, down))
        want = torch.zeros(tokens, hidden, dtype=torch.float64)
        for t in range(tokens):
            for j in range(top_k):
                i, xt = int(ids[t, j]), x[t].double()
                want[t] += float(weights[t, j]) * (d[i] @ (F.silu(g[i] @ xt) * (u[i] @ xt)))
        ctx.rel_close(out, want, f"fused_moe on {name} experts", tol)


def w_sampling(ctx: Ctx) -> None:
    """The plain sampling kernel (greedy rows equal to torch.argmax, ties and NaN/inf
    included; random rows only ever draw a live token, repeat with their seed and do not
    depend on the batch or the split) and the filtered one through the Sampler (penalized
    greedy rows equal the reference's argmax, min-p/top-k/top-p rows draw inside the
    reference's kept set, the top-k candidate path draws the full pass's tokens)."""
    import torch

    from pagedserve.kernels.triton.filtered_sampling import FilteredKernelConfig, filtered_sample
    from pagedserve.device.input_batch import CachedRequestState
    from pagedserve.device.penalties import PenaltyState
    from pagedserve.device.sampler import (Sampler, SamplingMetadata, apply_min_p,
                                           apply_penalties, apply_top_k_top_p,
                                           triton_sampling_kernels)
    from pagedserve.kernels.triton.sampling import SamplingKernelConfig, fused_sample
    from pagedserve.sampling_params import SamplingParams

    dev = torch.device(ctx.device)
    if ctx.gpu:
        vocab, rows = 151936, 64
        tilings = [(SamplingKernelConfig(), None), (SamplingKernelConfig(), 1)]
        filtered_small = FilteredKernelConfig(candidates=1 << 18)  # the full pass only
    else:
        vocab, rows = 75, 6
        tilings = [(SamplingKernelConfig(block=16), None), (SamplingKernelConfig(block=16), 1),
                   (SamplingKernelConfig(block=32), 3)]
        filtered_small = FilteredKernelConfig(block=16, pivots=64)
    gen = seeded(ctx, 4)

    def batch(temps, philox):
        greedy = torch.tensor([t == 0 for t in temps], device=dev)
        temperature = torch.tensor([t if t > 0 else 1.0 for t in temps], device=dev)
        return temperature, greedy, torch.tensor(philox, dtype=torch.int64, device=dev)

    logits = torch.randint(-4, 5, (rows, vocab), generator=gen, device=dev).to(torch.bfloat16)
    logits[1] = 0
    logits[1, [vocab - 3, 9, vocab // 2]] = 7  # a tie across tiles: the lowest id wins
    expected = logits.argmax(-1)
    temps = [0.0 if i % 3 else 0.9 for i in range(rows)]
    random_rows = torch.tensor([t > 0 for t in temps], device=dev)
    live = torch.rand(rows, vocab, generator=gen, device=dev) < 0.5
    masked = logits.masked_fill(~live & random_rows[:, None], float("-inf"))
    philox = [(1000 + i, i) for i in range(rows)]
    draws = []
    for cfg, splits in tilings:
        got = fused_sample(logits, None, None, None, cfg, splits)
        ctx.check(torch.equal(got, expected), f"greedy rows {cfg} splits={splits}")
        got = fused_sample(masked, *batch(temps, philox), cfg, splits)
        ctx.check(torch.equal(got[~random_rows], expected[~random_rows]),
                  f"greedy rows of a mixed batch {cfg} splits={splits}")
        ctx.check(live[random_rows].gather(1, got[random_rows, None]).all(),
                  f"a random row drew a -inf token {cfg} splits={splits}")
        draws.append(got)
    ctx.check(all(torch.equal(d, draws[0]) for d in draws), "draws depend on the tiling")
    i = int(random_rows.nonzero()[0])
    alone = fused_sample(masked[i:i + 1], *batch([temps[i]], [philox[i]]))
    ctx.check(int(alone[0]) == int(draws[0][i]), "a seeded row draws otherwise alone")

    nan_inf = torch.randn(5, 40, generator=gen, device=dev)
    nan_inf[0, [30, 7]] = float("nan")  # the lowest NaN, as torch.argmax
    nan_inf[1] = float("-inf")
    nan_inf[2] = float("-inf")
    nan_inf[2, 33] = -3.0
    nan_inf[3, [20, 25]] = float("inf")
    nan_inf[4, 2], nan_inf[4, 35] = float("inf"), float("nan")
    for cfg, splits in tilings[:2]:
        ctx.check(fused_sample(nan_inf, None, None, None, cfg, splits).tolist() ==
                  [7, 0, 33, 20, 35], "NaN / inf rows against torch.argmax")

    # the Sampler over requests: penalties fused into the loads, filters, seeds
    prompt_gen = torch.Generator().manual_seed(5)
    requests = []
    for r in range(rows):
        greedy = r % 4 == 0
        params = SamplingParams(
            temperature=0.0 if greedy else 1.5, seed=r, max_tokens=100,
            repetition_penalty=2.0 if greedy else 1.0 + (r % 3) * 0.4,
            frequency_penalty=0.1 * (r % 2),
            presence_penalty=0.3 if r % 5 == 0 else 0.0,
            top_k=0 if greedy else [0, 5, 40][r % 3], top_p=1.0 if greedy else [1.0, 0.8][r % 2],
            min_p=0.1 if r % 6 == 3 else 0.0)
        request = CachedRequestState(f"r{r}", torch.randint(vocab, (12,), generator=prompt_gen)
                                     .tolist(), params)
        for token in torch.randint(vocab, (6,), generator=prompt_gen).tolist():
            request.append_output_token(token)
        requests.append(request)
    sampler_logits = (torch.randn(rows, vocab, generator=gen, device=dev) * 3).bfloat16()
    for r in range(0, rows, 4):  # the penalties decide: a greedy row's argmax is among its
        requests[r].append_output_token(int(sampler_logits[r].argmax()))  # tokens

    def metadata():
        state = PenaltyState(vocab, dev)
        for request in requests:
            if request.sampling_params.needs_penalties:
                state.add(request.req_id, request.prompt_token_ids, request.output_token_ids)
        return SamplingMetadata.from_requests(requests, vocab, dev, fused=True,
                                              penalty_state=state,
                                              penalty_slots=state.slots([q.req_id
                                                                         for q in requests]))

    meta = metadata()
    fused = Sampler(triton_sampling_kernels())
    tokens = fused(sampler_logits, meta).sampled_token_ids
    penalized = apply_penalties(sampler_logits.float(), meta.penalties)
    greedy_rows = meta.greedy_mask
    ctx.check(torch.equal(tokens[greedy_rows], penalized.argmax(-1)[greedy_rows]),
              "penalized greedy rows against the reference's argmax")
    z = penalized / meta.temperature[:, None]
    if meta.min_p is not None:
        z = apply_min_p(z, meta.min_p)
    kept = ~torch.isinf(apply_top_k_top_p(z, meta.top_k, meta.top_p))
    ctx.check(kept.gather(1, tokens[:, None]).all(), "a filtered row drew a dropped token")
    again = fused(sampler_logits, metadata()).sampled_token_ids
    ctx.check(torch.equal(again, tokens), "seeded rows did not repeat")
    args = (sampler_logits, meta.temperature, meta.greedy_mask, meta.philox, meta.min_p,
            meta.top_k, meta.top_p, meta.penalties)
    candidates = filtered_sample(*args, config=FilteredKernelConfig(
        **({} if ctx.gpu else dict(block=16, pivots=64, candidates=8))))
    ctx.check(torch.equal(candidates, filtered_sample(*args, config=filtered_small)),
              "the top-k candidate path drew other tokens than the full pass")


def _capture(ctx: Ctx, step):
    """`step` as a CUDA graph's replay (compiled and run once first), or itself off CUDA."""
    if not ctx.gpu:
        return step
    import torch

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def w_graphs(ctx: Ctx) -> None:
    """CUDA-graph replays as the engine runs them: decode steps through the backend captured
    with max_seq_len = max_model_len (v2's grid sized past every sequence at small batch, v1
    longest-first at large), replayed on new lengths, tables and caches written into the
    captured buffers; a norm -> weight-only GEMV -> SiLU chain (PDL on Hopper) replayed on new
    inputs against the same kernels with a sync between each two. Off CUDA the steps run
    eagerly (the checks still hold)."""
    import torch

    from pagedserve.kernels.triton.attention import DecodeConfig, PrefillConfig
    from pagedserve.kernels.triton.arrivals import arrival_counters
    from pagedserve.attention.metadata import AttentionMetadata
    from pagedserve.attention.triton_backend import TritonBackend
    from pagedserve.kernels.triton import model_ops
    from pagedserve.kernels.triton.fp8_linear import (WEIGHT_ONLY, WEIGHT_ONLY_ONE_ROW,
                                                      weight_only_linear)
    from pagedserve.model import fp8
    from tests.attention.paged_case import make_case

    dev = ctx.device
    if ctx.gpu:
        dtype, tol, heads, kv_heads, head_dim = torch.bfloat16, 2e-2, 32, 8, 128
        max_len, batches, backend = 2048, (4, 64), TritonBackend()
    else:
        dtype, tol, heads, kv_heads, head_dim = torch.float32, 1e-4, 4, 2, 32
        max_len, batches = 256, (3,)
        backend = TritonBackend(DecodeConfig(block_n=16, partition=32),
                                PrefillConfig(block_m=16, block_n=16))
    rng = torch.Generator().manual_seed(6)
    for num_seqs in batches:
        cases = []
        for seed in range(3):
            lens = torch.randint(0, max_len - 1, (num_seqs,), generator=rng).tolist()
            cases.append(make_case([(c, 1) for c in lens], heads, kv_heads, head_dim, 16,
                                   dtype=dtype, seed=seed, device=dev))
        num_blocks = max(c.k_cache.shape[0] for c in cases)
        q, k, v = (torch.zeros_like(t) for t in (cases[0].q, cases[0].k, cases[0].v))
        k_cache = torch.empty((num_blocks, *cases[0].k_cache.shape[1:]), dtype=dtype,
                              device=dev)
        v_cache = torch.empty_like(k_cache)
        # the runner's step buffers: written in place before each replay
        slots = torch.zeros(num_seqs, dtype=torch.int64, device=dev)
        tables = torch.zeros(num_seqs, max_len // 16, dtype=torch.int32, device=dev)
        seq_lens = torch.ones(num_seqs, dtype=torch.int32, device=dev)
        starts = torch.arange(num_seqs + 1, dtype=torch.int32, device=dev)
        out = torch.empty_like(q)

        def load(case) -> None:
            for dst, src in ((q, case.q), (k, case.k), (v, case.v),
                             (slots, case.meta.slot_mapping), (seq_lens, case.meta.seq_lens)):
                dst.copy_(src)
            for dst, src in ((k_cache, case.k_cache), (v_cache, case.v_cache)):
                dst.fill_(float("nan"))
                dst[:src.shape[0]].copy_(src)
            width = min(tables.shape[1], case.meta.block_tables.shape[1])
            tables.zero_()  # (a case's last column is null-block padding)
            tables[:, :width].copy_(case.meta.block_tables[:, :width])

        def step() -> None:  # a fresh metadata per forward, as the runner builds one
            meta = AttentionMetadata(num_decodes=num_seqs, num_decode_tokens=num_seqs,
                                     slot_mapping=slots, block_tables=tables,
                                     seq_lens=seq_lens, query_start_loc=starts,
                                     max_query_len=1, max_seq_len=max_len)
            out.copy_(backend.forward(q, k, v, k_cache, v_cache, meta, cases[0].scale))

        load(cases[0])
        replay = _capture(ctx, step)
        for i, case in enumerate(cases):
            load(case)
            replay()
            ctx.close(out, case.expected, f"decode graph batch {num_seqs} replay {i}", tol)
            counters = arrival_counters(num_seqs * kv_heads, q.device)
            ctx.check(not counters.any(), "arrival counters left set after a replay")

    gen = seeded(ctx, 7)
    hidden, inter = (4096, 3072) if ctx.gpu else (256, 48)
    w_q, w_scale = fp8.quantize_rows(
        torch.randn(2 * inter, hidden, generator=gen, device=dev) * 0.02)
    chain_dtype = torch.bfloat16 if ctx.gpu else torch.float16
    norm_w = (torch.rand(hidden, generator=gen, device=dev) + 0.5).to(chain_dtype)
    for num_rows, cfg in ((1, WEIGHT_ONLY_ONE_ROW), (4, WEIGHT_ONLY)):
        x = torch.randn(num_rows, hidden, generator=gen, device=dev).to(chain_dtype)

        def chain(sync: bool):
            y = model_ops.rms_norm(x, norm_w, 1e-5)[0]
            for fn in (lambda t: weight_only_linear(t, w_q, w_scale, None, cfg),
                       model_ops.silu_and_mul):
                if sync and ctx.gpu:
                    torch.cuda.synchronize()
                y = fn(y)
            return y

        y = None

        def step():
            nonlocal y
            y = chain(False)

        replay = _capture(ctx, step)
        captured = y
        for i in range(5):
            x.copy_(torch.randn(num_rows, hidden, generator=gen, device=dev).to(chain_dtype))
            replay()
            result = captured if ctx.gpu else y
            ctx.check(torch.equal(result, chain(True)), f"chain {num_rows} rows replay {i} "
                      "differs from the synced kernels")


def w_engine(ctx: Ctx, variant: str) -> None:
    """A short engine run on a random tiny Qwen3: 16 prompts of 3-240 tokens, half sharing a
    40-token prefix, greedy 16 tokens each, then the same prompts again (prefix-cache hits:
    prefill over cached blocks), then random sampling with top-k/top-p/min-p and penalties.
    "engine" and "engine-fp8kv" (CUDA graphs, decode v2 captured for max_model_len 1024) get
    a KV cache of 80 blocks, too small for the batch, and preempt by swapping to pinned CPU
    memory; "engine-eager" sizes its cache from free memory (the profile run of issue 27)
    and runs without graphs. Checks: every request finishes with 16 sane token ids, the
    graphs were captured (or not), preemptions happened, the block pool is whole after."""
    import torch

    from pagedserve.config import EngineConfig
    from pagedserve.frontend.llm_engine import LLMEngine
    from pagedserve.sampling_params import SamplingParams
    from pagedserve.entrypoints.llm import LLM

    with tempfile.TemporaryDirectory(prefix="pagedserve-sanitize-") as tmp:
        checkpoint = ctx.checkpoint or make_checkpoint(Path(tmp) / "tiny-qwen3")
        config = json.loads((Path(checkpoint) / "config.json").read_text())
        vocab = config["vocab_size"]
        dtype = torch.bfloat16 if ctx.gpu else torch.float32
        element = 1 if variant == "engine-fp8kv" else dtype.itemsize
        block_bytes = (2 * config["num_hidden_layers"] * 16 * config["num_key_value_heads"]
                       * config["head_dim"] * element)
        options = dict(device=ctx.device, dtype=str(dtype).removeprefix("torch."), seed=0,
                       max_model_len=1024, max_num_seqs=16, max_num_batched_tokens=1024,
                       grammar_process=False, enforce_eager=variant == "engine-eager",
                       kv_cache_dtype="fp8" if variant == "engine-fp8kv" else "auto")
        tight = variant != "engine-eager"
        if tight:
            options.update(kv_cache_memory=80 * block_bytes, preemption_mode="swap",
                           swap_space=512 * block_bytes)
        elif ctx.gpu:  # ~2 GiB of KV past what the GPU holds now, after a profile run
            free, total = torch.cuda.mem_get_info()
            options.update(gpu_memory_utilization=min(0.9, (total - free + (2 << 30)) / total))
        # the core in this process (LLM's own runs it in a spawned one), so that the checks
        # can read its scheduler and block pool and the sanitizer sees one process
        engine = LLMEngine(EngineConfig.from_options(model=checkpoint, **options))
        llm = LLM.from_engine(engine)
        rng = torch.Generator().manual_seed(0)
        prefix = torch.randint(3, vocab, (40,), generator=rng).tolist()
        lengths = [3, 17, 33, 64, 100, 150, 200, 240] * 2
        prompts = [(prefix if i % 2 else []) + torch.randint(3, vocab, (n,), generator=rng)
                   .tolist() for i, n in enumerate(lengths)]
        greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        sampled = [SamplingParams(temperature=1.0, top_k=20 if i % 2 else 0,
                                  top_p=0.9 if i % 3 else 1.0, min_p=0.05 if i % 4 == 0 else 0.0,
                                  repetition_penalty=1.2, presence_penalty=0.5 if i % 2 else 0.0,
                                  seed=i, max_tokens=16, ignore_eos=True)
                   for i in range(len(prompts))]
        for name, params in (("greedy", greedy), ("greedy, prefix hits", greedy),
                             ("sampled", sampled)):
            outputs = llm.generate(prompts, params, use_tqdm=False)
            ctx.check(len(outputs) == len(prompts), f"{name}: {len(outputs)} outputs")
            for out in outputs:
                tokens = list(out.outputs[0].token_ids)
                ctx.check(out.finished and out.outputs[0].finish_reason == "length",
                          f"{name}: {out.request_id} finished {out.outputs[0].finish_reason}")
                ctx.check(len(tokens) == 16 and all(0 <= t < vocab for t in tokens),
                          f"{name}: {out.request_id} gave {tokens}")
            print(f"{variant} {name}: {len(outputs)} requests done", flush=True)
        runner = engine.model_runner
        graphs = ctx.gpu and variant != "engine-eager"
        ctx.check((getattr(runner, "graphs", None) is not None) == graphs,
                  f"CUDA graphs captured: expected {graphs}")
        if tight:
            ctx.check(engine.scheduler.num_preemptions > 0,
                      "the tight KV cache preempted no request")
        manager = engine.kv_cache_manager
        pool = manager.block_pool
        ctx.check(not engine.has_unfinished_requests() and not manager.req_to_blocks,
                  "requests still hold blocks")
        ctx.check(pool.get_num_free_blocks() == pool.num_blocks - 1, "blocks leaked")
        print(f"{variant}: {engine.scheduler.num_preemptions} preemptions, "
              f"{pool.num_blocks} blocks", flush=True)
        engine.shutdown()


def w_quant(ctx: Ctx) -> None:
    """The packed-weight matmuls (kernels/triton/int_linear.py) over every format they read:
    integer weights of 4 and 8 bits (symmetric, zero points, g_idx permutations, per channel;
    one in torch's int4 layout, by `int4pack_linear`'s row rule and through the fused GEMM
    `int4pack_gemm.matmul` with a split-K tile besides) and GGUF blocks of each type kept
    quantized, at 1 row (the GEMVs: for a bf16 row of Q4_K/Q6_K both the int8-activation one
    and the float one), a decode batch and a prefill (the GEMMs), N and K ragged
    against the tiles, against x @ the weight that the torch reference dequantizes from the
    same bytes."""
    import numpy as np
    import torch

    from pagedserve.kernels.gguf_format import BLOCKS, GgufWeight
    from pagedserve.kernels.int4pack import Int4Weight
    from pagedserve.kernels.triton import int4pack_gemm
    from pagedserve.kernels.triton.int_linear import FLOAT_GGUF_ACTIVATIONS, for_layer, linear
    from pagedserve.kernels.weight_formats import IntWeight, pack_codes

    dev = ctx.device
    dtype = torch.bfloat16 if ctx.gpu else torch.float32
    tol = 2e-2 if ctx.gpu else 1e-4
    rows_cases = (1, 3, 5, 19, 256) if ctx.gpu and not ctx.small else (1, 5)
    gen = torch.Generator().manual_seed(3)
    n = 200 if ctx.gpu else 40
    fused_split = int4pack_gemm.Int4GemmConfig(16, 64, 256, split_k=2, stages=3)
    int_cases = [(4, 128, True, False, 1000), (4, 32, False, True, 264),
                 (8, 64, False, False, 328), (4, 1 << 20, True, False, 136),
                 (4, 128, False, False, 1024)]  # the last: torch's int4 layout alone
    for bits, group, zeros, g_idx, k in int_cases:
        groups = -(-k // group)
        codes = torch.randint(0, 1 << bits, (n, k), generator=gen)
        scales = (torch.rand(n, groups, generator=gen) * 0.02 + 0.001).to(dtype)
        zero = (torch.randint(0, 1 << bits, (n, groups), generator=gen).to(dtype) if zeros
                else None)
        order = (torch.randperm(k, generator=gen) // group).to(torch.int32) if g_idx else None
        matmul, weight = for_layer(IntWeight(*(None if t is None else t.to(dev) for t in
                                               (pack_codes(codes, bits), scales, zero, order)),
                                             bits, group, k))
        w = weight.dequantize().double().cpu()
        for rows in rows_cases:
            x = torch.randn(rows, k, generator=gen).to(dtype)
            got = matmul(x.to(dev), weight)
            ctx.rel_close(got, x.double() @ w.T, f"int{bits} g{group} zeros={zeros} "
                          f"g_idx={g_idx} rows={rows}", tol)
            if isinstance(weight, Int4Weight):  # the fused GEMM on that layout: its rule's
                for config in (None, fused_split):  # tiles, and split K on 256-column steps
                    got = int4pack_gemm.matmul(x.to(dev), weight, None, config)
                    ctx.rel_close(got, x.double() @ w.T,
                                  f"int4pack fused gemm {config} rows={rows}", tol)
    rng = np.random.default_rng(3)
    for qtype, (per_block, size) in sorted(BLOCKS.items()):
        k = 3 * 256 if per_block == 256 else 21 * 32
        blocks = rng.integers(0, 256, (37, k // per_block, size), dtype=np.uint8)
        offset, count = GGUF_F16_SCALES[qtype]  # random bits there could be inf or NaN
        scales = (rng.standard_normal((37, k // per_block, count)) * 0.01).astype(np.float16)
        blocks[..., offset:offset + 2 * count] = scales.view(np.uint8)
        weight = GgufWeight(torch.from_numpy(blocks.reshape(37, -1)), qtype, k)
        w = weight.dequantize().double()
        weight = GgufWeight(weight.blocks.to(dev), qtype, k)
        for rows in rows_cases:
            x = torch.randn(rows, k, generator=gen).to(dtype)
            got = linear(x.to(dev), weight)
            ctx.rel_close(got, x.double() @ w.T, f"gguf type {qtype} rows={rows}", tol)
            if rows == 1:  # the default took gguf_dp4a (int8 row) where it covers the type
                got = linear(x.to(dev), weight, config=FLOAT_GGUF_ACTIVATIONS)
                ctx.rel_close(got, x.double() @ w.T, f"gguf type {qtype} float row", tol)


# where each GGUF type kept quantized holds its float16 scales in a block: (offset, count)
GGUF_F16_SCALES = {2: (0, 1), 3: (0, 2), 8: (0, 1), 12: (0, 2), 13: (0, 2), 14: (208, 1)}


def w_lora(ctx: Ctx) -> None:
    """The batched LoRA shrink/expand kernels (kernels/triton/lora.py), tiled (prefills and
    large decode batches) and one row at a time, ranks 8 to 64, rows of several adapters and
    of the base model (which must be left alone), against the torch reference."""
    import numpy as np
    import torch

    from pagedserve.kernels.triton.lora import lora_shrink_expand
    from pagedserve.model.lora import (TILE_ROWS, LoRABatch, fill_tiles, max_tiles,
                                       reference_lora)

    dev = ctx.device
    dtype = torch.bfloat16 if ctx.gpu else torch.float32
    tol = 2e-2 if ctx.gpu else 1e-4
    K, N, num_slots = (4096, 1024, 8) if ctx.gpu and not ctx.small else (96, 80, 4)
    cases = [(8, [5, 17, 1, 33], [2, -1, 0, 2], False),
             (64, [40, 3], [1, 3], False),
             (16, [1] * 40, [0, 3, -1, 3, 1, 0, -1, 2] * 5, False),
             (16, [1] * 7, [0, 3, -1, 3, 1, 0, -1], True)]
    gen = torch.Generator().manual_seed(4)
    for rank, lens, slots, one_row in cases:
        token_slots = np.repeat(np.array(slots, dtype=np.int32), lens)
        T, tiles = len(token_slots), max_tiles(len(token_slots), num_slots)
        sorted_rows = np.zeros(T, dtype=np.int32)
        starts, tlens, tslots = (np.zeros(tiles, dtype=np.int32) for _ in range(3))
        count = fill_tiles(token_slots, sorted_rows, starts, tlens, tslots)
        ref_rows = {s: torch.from_numpy(np.flatnonzero(token_slots == s)) for s in set(slots)
                    if s >= 0}
        on = lambda a: torch.from_numpy(a).to(dev)  # noqa: E731
        batch = LoRABatch(on(token_slots), on(sorted_rows), on(starts[:count]),
                          on(tlens[:count]), on(tslots[:count]), one_row, TILE_ROWS)
        ref_batch = LoRABatch(*(torch.from_numpy(a) for a in (
            token_slots, sorted_rows, starts[:count], tlens[:count], tslots[:count])),
            one_row, TILE_ROWS, ref_rows)
        x = torch.randn(T, K, generator=gen).to(dtype)
        a = (torch.randn(num_slots, rank, K, generator=gen) / K**0.5).to(dtype)
        b = torch.randn(num_slots, N, rank, generator=gen).to(dtype)
        y0 = torch.randn(T, N, generator=gen).to(dtype)
        expected = y0.double().clone()
        reference_lora(x.double(), expected, a.double(), b.double(), ref_batch)
        got = y0.clone().to(dev)
        lora_shrink_expand(x.to(dev), got, a.to(dev), b.to(dev), batch)
        what = f"lora rank {rank} rows {T} one_row={one_row}"
        ctx.rel_close(got.double().cpu() - y0.double(), expected - y0.double(), what, tol)
        base = torch.from_numpy(token_slots < 0)
        ctx.check(torch.equal(got.cpu()[base], y0[base]), f"{what}: base rows changed")


KERNEL_WORKLOADS = {"attention": w_attention, "model_ops": w_model_ops, "fp8": w_fp8,
                    "moe": w_moe, "sampling": w_sampling, "graphs": w_graphs,
                    "quant": w_quant, "lora": w_lora}
ENGINE_WORKLOADS = ("engine", "engine-eager", "engine-fp8kv")
WORKLOADS = (*KERNEL_WORKLOADS, *ENGINE_WORKLOADS)


def run_workload(name: str, device: str, small: bool, checkpoint: str | None) -> int:
    """Run one workload in this process; 0 when every check passed. The kernels run on the
    CPU under the Triton interpreter, which must be on before they are imported."""
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if name in KERNEL_WORKLOADS:
        if device == "cpu":
            os.environ["TRITON_INTERPRET"] = "1"
        else:
            os.environ.pop("TRITON_INTERPRET", None)
    ctx = Ctx(device, small, checkpoint)
    start = time.monotonic()
    torch.manual_seed(0)
    with torch.inference_mode():
        if name in KERNEL_WORKLOADS:
            KERNEL_WORKLOADS[name](ctx)
        else:
            w_engine(ctx, name)
        if ctx.gpu:
            torch.cuda.synchronize()
    print(f"workload {name} on {device}: {ctx.checks} checks passed in "
          f"{time.monotonic() - start:.1f} s", flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="folder of sanitizer.json (rows are appended)")
    parser.add_argument("--only", type=lambda s: s.split(","),
                        help=f"targets, comma-separated: {', '.join(TARGETS)}")
    parser.add_argument("--tools", type=lambda s: s.split(","),
                        help=f"tools, comma-separated, of {', '.join(TOOLS)} (default: each "
                        "target's own; with --only, exactly these on those targets)")
    parser.add_argument("--quick", action="store_true",
                        help="the workloads at their smallest sizes (as on the CPU)")
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    parser.add_argument("--jobs", type=int, default=6, help="sanitizer runs at once")
    parser.add_argument("--timeout", type=float, default=240, help="seconds per run")
    parser.add_argument("--budget", type=float, default=3600,
                        help="seconds for the whole invocation: no run starts or runs past it")
    parser.add_argument("--logs", help="folder for each run's full output (default: a "
                        "temporary one)")
    parser.add_argument("--sanitizer", default="compute-sanitizer")
    parser.add_argument("--workload", choices=WORKLOADS,
                        help="run one workload in this process (what the sanitizer runs)")
    parser.add_argument("--checkpoint", help="the engine workloads' model folder (default: "
                        "one made from benchmarks/configs/tiny-qwen3.json)")
    args = parser.parse_args()
    if args.workload:
        return run_workload(args.workload, args.device, args.quick, args.checkpoint)
    if not args.out:
        parser.error("--out is required (or --workload)")
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
