"""benchmarks/sanitize.py without a GPU: each kernel workload on the CPU under the Triton
interpreter (its own checks against the PyTorch reference must pass), the report parser on
compute-sanitizer's output as it prints it (memcheck in its current and older formats,
racecheck, initcheck, an API error, several processes, none), and the orchestration end to
end with a stand-in sanitizer that prints canned reports, hangs or crashes."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks/sanitize.py"


@pytest.fixture(scope="module")
def sanitize():
    spec = importlib.util.spec_from_file_location("benchmarks_sanitize", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up)
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def python_env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)  # the workload sets it itself, before its imports
    return env


# (moe and model_ops are small already; the others at --quick sizes)
KERNEL_WORKLOADS = {"attention": True, "model_ops": False, "fp8": True, "moe": False,
                    "sampling": True, "graphs": True}


@pytest.fixture(scope="module")
def workload_runs():
    """Every kernel workload started at once (each is one interpreter-bound process)."""
    procs = {}
    for workload, quick in KERNEL_WORKLOADS.items():
        argv = [sys.executable, str(SCRIPT), "--workload", workload, "--device", "cpu"]
        procs[workload] = subprocess.Popen(argv + ["--quick"] * quick, cwd=ROOT,
                                           env=python_env(), stdout=subprocess.PIPE,
                                           stderr=subprocess.STDOUT, text=True)
    yield procs
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.mark.parametrize("workload", KERNEL_WORKLOADS)
def test_kernel_workload_passes_its_checks_on_the_cpu(workload_runs, workload):
    output, _ = workload_runs[workload].communicate(timeout=300)
    assert workload_runs[workload].returncode == 0, output[-5000:]
    checks = int(output.split(" checks passed")[0].rsplit(" ", 1)[1])
    assert checks > 0


CLEAN = """\
========= COMPUTE-SANITIZER
workload attention on cuda: 166 checks passed in 41.2 s
========= ERROR SUMMARY: 0 errors
"""

MEMCHECK = """\
========= COMPUTE-SANITIZER
========= Invalid __global__ read of size 2 bytes
=========     at _rotate_qk_kernel+0x1d0 in /work/main/pagedserve/model/triton_ops.py:97
=========     by thread (3,0,0) in block (4095,0,0)
=========     Access to 0x7f3a5c000000 is out of bounds
=========     and is 256 bytes after the nearest allocation at 0x7f3a5bf00000 of size 1,048,576 bytes
=========     Saved host backtrace up to driver entry point at kernel launch time
=========         Host Frame:  [0x2f26f0] in libcuda.so.1
=========
========= Invalid __global__ read of size 2 bytes
=========     at _rotate_qk_kernel+0x1d0 in /work/main/pagedserve/model/triton_ops.py:97
=========     by thread (4,0,0) in block (4095,0,0)
=========
========= Invalid __global__ write of size 16 bytes
=========     at 0xda0 in /opt/src/pagedserve/model/moe_kernel.py:65:_gate_up_kernel
=========     by thread (96,0,0) in block (44,0,0)
=========
========= Program hit cudaErrorIllegalAddress (error 700) due to "an illegal memory access was encountered" on CUDA API call to cuStreamSynchronize.
=========     Saved host backtrace up to driver entry point at error
=========
Traceback (most recent call last):
RuntimeError: Triton Error [CUDA]: an illegal memory access was encountered
========= Target application returned an error
========= ERROR SUMMARY: 1,234 errors
========= ERROR SUMMARY: 1214 errors were not printed
"""

RACECHECK = """\
========= COMPUTE-SANITIZER
========= Error: Race reported between Write access at _decode_v2_kernel+0x5a0 in /w/pagedserve/attention/kernels/decode.py:297
=========     and Read access at _decode_v2_kernel+0x640 in /w/pagedserve/attention/kernels/decode.py:301 [248 hazards]
=========
========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)
========= ERROR SUMMARY: 1 error
"""

INITCHECK = """\
========= COMPUTE-SANITIZER
========= Uninitialized __global__ memory read of size 4 bytes
=========     at 0x3b0 in void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16>(Params)
=========     by thread (0,0,0) in block (0,0,0)
=========
========= Uninitialized __global__ memory read of size 2 bytes
=========     at _sample_split_kernel(...)+0x120
=========
========= ERROR SUMMARY: 2 errors
"""


def test_report_of_a_clean_run(sanitize):
    report = sanitize.parse_report(CLEAN)
    assert report.errors == 0 and report.first_errors == []


def test_report_counts_every_error_and_names_each_distinct_one_once(sanitize):
    report = sanitize.parse_report(MEMCHECK)
    assert report.errors == 1234  # not the "were not printed" line's 1214
    assert report.first_errors == [
        "Invalid __global__ read of size 2 bytes at _rotate_qk_kernel "
        "(pagedserve/model/triton_ops.py:97)",
        "Invalid __global__ write of size 16 bytes at _gate_up_kernel "
        "(pagedserve/model/moe_kernel.py:65)",
        'Program hit cudaErrorIllegalAddress (error 700) due to "an illegal memory access '
        'was encountered" on CUDA API call to cuStreamSynchronize.']
    assert len(sanitize.parse_report(MEMCHECK, limit=1).first_errors) == 1


def test_report_of_racecheck_and_initcheck(sanitize):
    race = sanitize.parse_report(RACECHECK)
    assert race.errors == 1
    assert race.first_errors == ["Error: Race reported between Write access at "
                                 "_decode_v2_kernel (pagedserve/attention/kernels/decode.py:297)"]
    init = sanitize.parse_report(INITCHECK)
    assert init.errors == 2
    assert init.first_errors == [
        "Uninitialized __global__ memory read of size 4 bytes at void "
        "cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16>(Params)",
        "Uninitialized __global__ memory read of size 2 bytes at _sample_split_kernel(...)"]


# racecheck as compute-sanitizer 2025.3.1 prints it on the H100: no ERROR SUMMARY line
RACECHECK_2025 = """\
========= COMPUTE-SANITIZER
========= Error: Potential WAW hazard detected at __shared__ 0x404 in block (10,3,18) :
=========     Write Thread (47,0,0) at _decode_v2_kernel+0x6a20 in decode.py:227
=========     Write Thread (48,0,0) at _decode_v2_kernel+0x6a20 in decode.py:227
=========     Current Value : 93, Incoming Value : 94
=========
========= RACECHECK SUMMARY: 20 hazards displayed (366 errors, 0 warnings)
"""


def test_report_of_racecheck_without_an_error_summary(sanitize):
    race = sanitize.parse_report(RACECHECK_2025)
    assert race.errors == 366
    assert race.first_errors[0].startswith("Error: Potential WAW hazard")
    assert "_decode_v2_kernel (decode.py:227)" in race.first_errors[0]
    clean = "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n"
    assert sanitize.parse_report(clean).errors == 0


def test_report_sums_processes_and_knows_when_there_is_no_summary(sanitize):
    assert sanitize.parse_report(CLEAN + RACECHECK).errors == 1
    killed = "========= COMPUTE-SANITIZER\n" + MEMCHECK.split("=========\nTraceback")[0]
    report = sanitize.parse_report(killed)
    assert report.errors is None and len(report.first_errors) == 3
    assert sanitize.parse_report("").errors is None


def test_plan_runs_each_targets_tools_and_keeps_initcheck_off_cublas_paths(sanitize):
    pairs = {(t.name, tool) for t, tool in sanitize.plan(None, None)}
    assert {name for name, _ in pairs} == set(sanitize.TARGETS)
    assert all((name, "memcheck") in pairs for name in sanitize.TARGETS)
    for tool in ("racecheck", "synccheck"):
        assert {n for n, t in pairs if t == tool} == {"attention", "fp8", "moe", "sampling",
                                                      "quant", "lora"}
    # quant reads cuBLAS's outputs from 64 rows (TMA stores initcheck cannot see)
    assert {n for n, t in pairs if t == "initcheck"} == {"attention", "model_ops", "sampling",
                                                         "moe", "lora"}
    # --tools alone narrows the defaults; with --only it is exactly what was asked
    initcheck = {t.name for t, _ in sanitize.plan(None, ["initcheck"])}
    assert initcheck == {"attention", "model_ops", "sampling", "moe", "lora"}
    assert [(t.name, tool) for t, tool in sanitize.plan(["engine"], ["memcheck", "initcheck"])
            ] == [("engine", "memcheck"), ("engine", "initcheck")]
    with pytest.raises(SystemExit, match="unknown target"):
        sanitize.plan(["attn"], None)
    with pytest.raises(SystemExit, match="unknown tool"):
        sanitize.plan(None, ["leakcheck"])


FAKE_SANITIZER = """\
#!{python}
# Stands in for compute-sanitizer: canned reports by workload; model_ops really runs.
import os, subprocess, sys, time
argv = sys.argv[1:]
command = argv[argv.index({python!r}):]
workload = command[command.index("--workload") + 1]
print("========= COMPUTE-SANITIZER", flush=True)
if workload == "model_ops":
    rc = subprocess.run(command).returncode
    print("========= ERROR SUMMARY: 0 errors")
    sys.exit(rc)
if workload == "graphs":
    print("========= ERROR SUMMARY: 0 errors")
elif workload == "moe":
    print({memcheck!r})
elif workload == "sampling":
    time.sleep(120)
else:
    print("Segmentation fault in the sanitizer")
    sys.exit(139)
"""


def run_orchestrator(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    fake = tmp_path / "compute-sanitizer"
    if not fake.exists():
        fake.write_text(FAKE_SANITIZER.format(python=sys.executable, memcheck=MEMCHECK))
        fake.chmod(0o755)
    argv = [sys.executable, str(SCRIPT), "--out", str(tmp_path / "results"), "--sanitizer",
            str(fake), "--device", "cpu", "--logs", str(tmp_path / "logs"), *args]
    return subprocess.run(argv, cwd=ROOT, env=python_env(), capture_output=True, text=True,
                          timeout=300)


def test_orchestrator_records_clean_errors_timeouts_and_crashes(tmp_path):
    result = run_orchestrator(tmp_path, "--only", "graphs,moe,sampling,fp8", "--tools",
                              "memcheck", "--timeout", "3", "--jobs", "4")
    assert result.returncode == 1, result.stdout + result.stderr  # not every pair is clean
    rows = {r["target"]: r for r in json.loads((tmp_path / "results/sanitizer.json")
                                               .read_text())}
    assert set(rows) == {"graphs", "moe", "sampling", "fp8"}
    clean, errors, timeout, crash = (rows[n] for n in ("graphs", "moe", "sampling", "fp8"))
    assert (clean["status"], clean["errors"], clean["rc"], clean["timed_out"]) == (
        "clean", 0, 0, False)
    assert (errors["status"], errors["errors"], errors["rc"]) == ("errors", 1234, 0)
    assert any("_gate_up_kernel (pagedserve/model/moe_kernel.py:65)" in e
               for e in errors["first_errors"])
    assert (timeout["status"], timeout["errors"], timeout["timed_out"]) == ("timeout", None, True)
    assert timeout["seconds"] < 60  # killed with the process group, not waited for
    assert (crash["status"], crash["errors"], crash["rc"]) == ("no summary", None, 139)
    assert "Segmentation fault" in crash["tail"] and "tail" not in clean
    for row in rows.values():
        assert row["device"].startswith("cpu") and row["date"].endswith("+00:00")
        assert row["tool"] == "memcheck" and row["commit"]
        assert "--tool memcheck" in row["command"]
    table = result.stdout[result.stdout.index("target "):]  # the table comes last
    for name, state in (("graphs", "clean"), ("moe", "errors"), ("sampling", "timeout"),
                        ("fp8", "no")):
        assert any(line.split()[:3] == [name, "memcheck", state]
                   for line in table.splitlines()), table
    assert "moe / memcheck:\n  Invalid __global__ read of size 2 bytes at _rotate_qk_kernel" in table


def test_orchestrator_runs_the_workload_and_appends(tmp_path):
    """The stand-in runs model_ops' real command line (the workload's own checks), then a
    second invocation's row is appended to the first's."""
    result = run_orchestrator(tmp_path, "--only", "model_ops", "--tools", "memcheck")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "checks passed" in (tmp_path / "logs/model_ops.memcheck.log").read_text()
    result = run_orchestrator(tmp_path, "--only", "graphs", "--tools", "racecheck")
    assert result.returncode == 0, result.stdout + result.stderr
    rows = json.loads((tmp_path / "results/sanitizer.json").read_text())
    assert [(r["target"], r["tool"], r["status"], r["rc"]) for r in rows] == [
        ("model_ops", "memcheck", "clean", 0), ("graphs", "racecheck", "clean", 0)]
    ops, graphs = (r["command"] for r in rows)
    assert ops.startswith("PYTORCH_NO_CUDA_MEMORY_CACHING=1 ") and "--workload model_ops" in ops
    assert "PYTORCH_NO_CUDA_MEMORY_CACHING" not in graphs  # graph capture needs the cache
    assert "--tool racecheck" in graphs and "--racecheck-report all" in graphs


def test_graph_targets_keep_the_caching_allocator(sanitize):
    args = sanitize.argparse.Namespace(sanitizer="compute-sanitizer", device="cuda",
                                       quick=False)
    engine = sanitize.make_run(sanitize.TARGETS["engine-nopdl"], "memcheck", args, "/m")
    assert engine.env == {"PAGEDSERVE_PDL": "0"}
    assert engine.argv[-4:] == ["--device", "cuda", "--checkpoint", "/m"]
    eager = sanitize.make_run(sanitize.TARGETS["engine-eager"], "memcheck", args, "/m")
    assert eager.env == {"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}
    assert textwrap.dedent(eager.command).startswith("PYTORCH_NO_CUDA_MEMORY_CACHING=1 "
                                                     "compute-sanitizer --tool memcheck")
