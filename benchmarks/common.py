"""What the GPU benchmark scripts share: a sibling script loaded as a module, the rows of a
docs/results JSON file, and the Llama-3-8B projections their matmul parts time.

The scripts import this as `benchmarks.common` (they run with the repository on PYTHONPATH),
after taking their own folder off sys.path: its kernels.py would shadow the `kernels` package
that transformers probes for.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import math
from collections.abc import Callable
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent

# Llama-3-8B's projections, (K, N): the fused q/k/v, o, the fused gate/up, down; its LM head
LLAMA3_8B_PROJECTIONS = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672),
                         "down": (14336, 4096)}
LLAMA3_8B_LM_HEAD = (4096, 128256)


def sibling(name: str):
    """benchmarks/<name>.py loaded as a module of its own (bench_<name>): the scripts are
    files, not a package this folder's sys.path entry could import."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rotation_copies(nbytes: int, least: int = 2) -> int:
    """How many copies of a weight of `nbytes` a timing rotates over so that they span more
    than 1 GiB: each call then reads its copy from device memory, as a decode step reads its
    weights, not from the L2 cache the previous call filled."""
    return max(least, math.ceil((1 << 30) / nbytes))


class ResultRows:
    """The rows of one docs/results JSON file. An earlier run's rows that `keep` accepts stay
    (another script's parts, or this script's when appending); each `add` writes the whole
    file and prints the row, so a run cut short keeps what it measured. `tags` go into every
    row after the row's own fields."""

    def __init__(self, path: Path, keep: Callable[[dict], bool] = lambda row: False) -> None:
        self.path = path
        old = json.loads(path.read_text()) if path.exists() else []
        self.rows: list[dict] = [row for row in old if keep(row)]
        self.tags: dict = {}

    def add(self, part: str, **row) -> dict:
        row = {"part": part, **row, **self.tags, "device": torch.cuda.get_device_name(),
               "date": datetime.date.today().isoformat()}
        self.rows.append(row)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.rows, indent=1) + "\n")
        print(json.dumps(row), flush=True)
        return row
