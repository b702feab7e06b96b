"""Dry-run a CUDA-only benchmark's engine paths on the CPU, before spending device time on it.

    PYTHONPATH=. python benchmarks/cpu_dry_run.py benchmarks/fp8.py --out /tmp/x --parts kv,8b-tpot
    PYTHONPATH=. TRITON_INTERPRET=1 python benchmarks/cpu_dry_run.py benchmarks/int4.py \\
        --out /tmp/x --parts 8b --no-workload

What it changes, so that a script written for one GPU runs its set-up, its engines and its
JSON writing here (none of its figures mean anything):
  - the big shapes become tiny ones: the script's `HERE` points at a copy of configs/ where
    qwen3-0.6b is tiny-qwen3 and llama3-8b / llama3.2-1b are tiny-llama3 (intermediate 768,
    a multiple of the int4 group);
  - workload A is its first 3 requests, 64 prompt tokens and at most 12 output tokens each;
  - CUDA's synchronize / empty_cache / device name / events become host no-ops, the copy
    bandwidth a constant, and `step_parts` (which replays the decode CUDA graph) returns
    nulls where the engine has no graphs.
What it cannot reach: code that makes CUDA tensors itself (the kernel and GEMV parts), CUDA
graphs, the host tier's pinned memory. Works on any tree whose scripts find their siblings
through `HERE` (1ac676a's and main's).
"""

from __future__ import annotations

import importlib.machinery
import json
import runpy
import shutil
import sys
import tempfile
import time
from pathlib import Path

# this folder holds kernels.py, which would shadow the `kernels` package transformers probes for
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch  # noqa: E402

TINY = {"qwen3-0.6b": "tiny-qwen3", "llama3-8b": "tiny-llama3", "llama3.2-1b": "tiny-llama3"}


class HostEvent:
    """torch.cuda.Event's timing interface on the host clock."""

    def __init__(self, *args, **kwargs):
        self.t = 0.0

    def record(self, *args):
        self.t = time.perf_counter()

    def synchronize(self):
        pass

    def elapsed_time(self, other: "HostEvent") -> float:
        return 1e3 * (other.t - self.t)


def fake_here(benchmarks: Path) -> Path:
    """A folder with the benchmarks' modules (links) and configs/ with the big shapes tiny."""
    here = Path(tempfile.mkdtemp(prefix="pagedserve-dry-run-"))
    shutil.copytree(benchmarks / "configs", here / "configs")
    for module in benchmarks.glob("*.py"):
        (here / module.name).symlink_to(module)
    for big, tiny in TINY.items():
        config = json.loads((here / "configs" / f"{tiny}.json").read_text())
        config["intermediate_size"] = 768
        (here / "configs" / f"{big}.json").write_text(json.dumps(config))
    return here


def shrink(namespace) -> None:
    """Workload A, the copy bandwidth and `step_parts` of a benchmark module (or globals)."""
    get = namespace.get if isinstance(namespace, dict) else namespace.__dict__.get
    put = namespace.__setitem__ if isinstance(namespace, dict) else \
        lambda key, value: setattr(namespace, key, value)
    if get("workload_prompts") and not get("_dry_run"):
        full = get("workload_prompts")

        def workload_prompts(*args, **kwargs):
            prompts, out_lens = full(*args, **kwargs)
            return [p[:64] for p in prompts[:3]], [min(n, 12) for n in out_lens[:3]]
        put("workload_prompts", workload_prompts)
    if get("copy_bandwidth"):
        put("copy_bandwidth", lambda: 3e12)
    if get("step_parts") and not get("_dry_run"):
        graphed = get("step_parts")

        def step_parts(engine, *args, **kwargs):
            if engine.model_runner.graphs is None:
                return {"graph_ms": None, "lm_head_ms": None}
            return graphed(engine, *args, **kwargs)
        put("step_parts", step_parts)
    put("_dry_run", True)


def main() -> None:
    script = Path(sys.argv[1]).resolve()
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.empty_cache = lambda *args, **kwargs: None
    torch.cuda.get_device_name = lambda *args, **kwargs: "cpu (dry run)"
    torch.cuda.Event = HostEvent
    loader = importlib.machinery.SourceFileLoader
    exec_module = loader.exec_module

    def exec_and_shrink(self, module):  # the siblings a script loads by path
        exec_module(self, module)
        if str(getattr(module, "__file__", "")).startswith(str(script.parent)):
            shrink(module)
    loader.exec_module = exec_and_shrink
    sys.path.insert(0, str(script.parent.parent))
    sys.argv = sys.argv[1:]
    names = runpy.run_path(str(script), run_name="dry_run")
    for module in list(sys.modules.values()):
        if str(getattr(module, "__file__", "") or "").startswith(str(script.parent)):
            shrink(module)
    script_globals = names["main"].__globals__
    shrink(script_globals)
    script_globals["HERE"] = fake_here(script.parent)
    names["main"]()


if __name__ == "__main__":
    main()
