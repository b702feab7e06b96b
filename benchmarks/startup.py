"""Start-up time: `pagedserve serve` until /health answers, cold and warm, and where it goes.

    PYTHONPATH=. python benchmarks/startup.py --out DIR [--model FOLDER | --shape SHAPE]
                                              [--warm-runs N] [--serve-args "..."]

Runs on the CPU or a GPU alike. The model is FOLDER, else a folder made for SHAPE (a file of
benchmarks/configs, e.g. qwen3-0.6b: config.json and a byte-level tokenizer, served with
--load-format dummy), else the default model (the embedded GGUF).

Parts, in this order:
  cold     serve -> /health with empty Triton and pagedserve kernel caches (fresh folders)
  warm     the same, N more times over the caches the cold run filled (min and median)
  phases   the engine core's own start-up line ("engine core started in ...": device init,
           kernels, weights, tokenizer, memory profile, KV cache + sampler warm-up + CUDA
           graphs, grammar backend) from each run's log, and the API process's ("beside
           the engine core": its tokenizer's load, then its wait for the core's READY)
  imports  `python -X importtime` of what each process imports (the API process's server
           module, the engine core's module), summed by top-level package
  engine   an in-process `LLMEngine` build over the warm caches: import and build seconds

Python's bytecode goes to a folder of the run (PYTHONPYCACHEPREFIX) that the cold run fills, as
an install's own .pyc files would: a read-only install (a device image's site-packages) would
otherwise compile every module in every run, which no user's warm start pays.
Writes DIR/startup.json and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CORE_LINE = re.compile(r"engine core started in ([\d.]+) s \((.*)\)")
API_LINE = re.compile(r"beside the engine core: ([\d.]+) s here, then ([\d.]+) s waiting")
PHASE = re.compile(r"(.+?) ([\d.]+)$")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(caches: Path) -> dict:
    env = dict(os.environ, TRITON_CACHE_DIR=str(caches / "triton"),
               PAGEDSERVE_CACHE=str(caches / "pagedserve"),
               PYTHONPYCACHEPREFIX=str(caches / "pycache"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def core_phases(log: str) -> dict:
    """{"total": s, phase: s, ...} from the engine core's start-up line, or {}."""
    match = CORE_LINE.search(log)
    if match is None:
        return {}
    phases = {"total": float(match.group(1))}
    for part in match.group(2).split(", "):
        name = PHASE.match(part)
        if name:
            phases[name.group(1)] = float(name.group(2))
    return phases


def serve_to_health(model_args: list[str], caches: Path, timeout: float) -> dict:
    """Start `pagedserve serve`, poll /health, stop it; seconds to the first 200 and phases."""
    port = free_port()
    command = [sys.executable, "-m", "pagedserve.entrypoints.server", "--port",
               str(port), *model_args]
    with tempfile.TemporaryFile("w+") as log:
        start = time.perf_counter()
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                env=child_env(caches), cwd=ROOT)
        try:
            seconds = wait_health(proc, port, start, timeout)
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.seek(0)
        text = log.read()
    if seconds is None:
        return {"error": text[-3000:]}
    return {"health_s": round(seconds, 2), "core": core_phases(text), "api": api_beside(text)}


def api_beside(log: str) -> dict:
    """The API process's own work beside the core's start-up (its tokenizer) and how long it
    then waited for READY (0: the API process, not the core, was the critical path)."""
    match = API_LINE.search(log)
    if match is None:
        return {}
    return {"tokenizer_s": float(match.group(1)), "waited_for_core_s": float(match.group(2))}


def wait_health(proc: subprocess.Popen, port: int, start: float, timeout: float) -> float | None:
    url = f"http://127.0.0.1:{port}/health"
    while time.perf_counter() - start < timeout and proc.poll() is None:
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                if response.status == 200:
                    return time.perf_counter() - start
        except OSError:
            time.sleep(0.05)
    return None


def import_breakdown(module: str, caches: Path, top: int = 8) -> dict:
    """Seconds importing `module` in a fresh interpreter, and the packages that took most."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", f"import {module}"],
                          capture_output=True, text=True, env=child_env(caches), cwd=ROOT)
    by_package: dict[str, float] = {}
    for line in proc.stderr.splitlines():
        fields = line.removeprefix("import time:").split("|")
        if len(fields) != 3 or not fields[0].strip().isdigit():
            continue
        package = fields[2].strip().split(".")[0]
        by_package[package] = by_package.get(package, 0.0) + int(fields[0]) / 1e6
    ranked = sorted(by_package.items(), key=lambda item: -item[1])[:top]
    return {"total_s": round(sum(by_package.values()), 2),
            "top": {name: round(s, 2) for name, s in ranked}}


ENGINE_SCRIPT = """
import json, logging, sys, time
logging.basicConfig(level="INFO", format="%(message)s")
start = time.perf_counter()
from pagedserve import LLMEngine
imported = time.perf_counter()
LLMEngine.from_options(**json.loads(sys.argv[1]))
print(json.dumps({"import_s": round(imported - start, 2),
                  "build_s": round(time.perf_counter() - imported, 2)}))
"""


def in_process_engine(options: dict, caches: Path) -> dict:
    proc = subprocess.run([sys.executable, "-c", ENGINE_SCRIPT, json.dumps(options)],
                          capture_output=True, text=True, env=child_env(caches), cwd=ROOT)
    if proc.returncode != 0:
        return {"error": proc.stderr[-3000:]}
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "core": core_phases(proc.stderr)}


def model_args(args: argparse.Namespace, root: Path) -> tuple[list[str], dict]:
    """The serve arguments and the in-process engine's options for the model asked for."""
    folder = args.model
    if folder is None and args.shape is not None:
        sys.path.insert(0, str(ROOT))
        from benchmarks.tensor_parallel import model_folder

        folder = str(model_folder(root, args.shape))
    extra = shlex.split(args.serve_args)
    options: dict = {}
    if folder is not None:
        extra = ["--model", folder, *extra]
        options["model"] = folder
    if args.shape is not None and args.model is None:
        extra += ["--load-format", "dummy"]
        options["load_format"] = "dummy"
    if args.max_model_len:
        extra += ["--max-model-len", str(args.max_model_len)]
        options["max_model_len"] = args.max_model_len
    return extra, options


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--model", default=None, help="a model folder or file")
    parser.add_argument("--shape", default=None, help="a config of benchmarks/configs "
                        "(random weights), e.g. qwen3-0.6b")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--warm-runs", type=int, default=2)
    parser.add_argument("--serve-args", default="", help="more `pagedserve serve` arguments")
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        caches = Path(tmp)
        serve, options = model_args(args, caches / "models")
        results: dict = {"serve_args": serve, "cpu": cpu_name()}
        results["cold"] = serve_to_health(serve, caches, args.timeout)
        print("cold", json.dumps(results["cold"]), flush=True)
        results["warm"] = [serve_to_health(serve, caches, args.timeout)
                           for _ in range(args.warm_runs)]
        for run in results["warm"]:
            print("warm", json.dumps(run), flush=True)
        healthy = [run["health_s"] for run in results["warm"] if "health_s" in run]
        if healthy:
            results["warm_min_s"] = min(healthy)
            results["warm_median_s"] = round(statistics.median(healthy), 2)
        results["imports"] = {
            "api process": import_breakdown("pagedserve.entrypoints.server.api_server", caches),
            "engine core": import_breakdown("pagedserve.engine.core", caches)}
        print("imports", json.dumps(results["imports"]), flush=True)
        results["engine"] = in_process_engine(options, caches)
        print("engine", json.dumps(results["engine"]), flush=True)
    (args.out / "startup.json").write_text(json.dumps(results, indent=1))
    print(f"cold {results['cold'].get('health_s')} s, warm min {results.get('warm_min_s')} s,"
          f" median {results.get('warm_median_s')} s -> {args.out / 'startup.json'}")


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    main()
