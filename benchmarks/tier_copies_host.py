"""The host time of the host tier's per-step copy calls (`device/tier_copies.py`), measured on
the CPU: what the runner spends queuing a step's offload and recall on CUDA, where each torch
op is a kernel launch or a cudaMemcpyAsync queued from Python. The CUDA path runs here over
CPU tensors, with the copy stream, its events and `record_stream` as host no-ops; the blocks
are tiny, so the time is the ops' dispatch, not the bytes. Reported per call: the aten ops
dispatched (the same count on a GPU) and the host milliseconds on this machine.

    PYTHONPATH=. python benchmarks/tier_copies_host.py --layers 28

The workloads: an offload of a step's 8 evicted blocks into fresh, consecutive slots (one
run), and a recall of a 64-block chain that sits in descending slots, 4 runs of 16 (the pool
evicts a conversation tail first: docs/benchmarks.md, issue 34).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

# this folder holds kernels.py, which would shadow the `kernels` package transformers probes for
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402


class HostStream:
    def wait_stream(self, *args) -> None:
        pass

    def wait_event(self, *args) -> None:
        pass


class HostEvent:
    def __init__(self, *args, **kwargs) -> None:
        pass

    def record(self, *args) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: HostEvent) -> float:
        return 0.0


class HostStreamContext:
    def __init__(self, stream) -> None:
        pass

    def __enter__(self) -> None:
        pass

    def __exit__(self, *args) -> bool:
        return False


class CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def on_host_streams() -> None:
    """CUDA's stream and event calls as host no-ops, so the CUDA path runs on CPU tensors."""
    torch.cuda.Stream = lambda *args, **kwargs: HostStream()
    torch.cuda.Event = HostEvent
    torch.cuda.stream = HostStreamContext
    torch.cuda.current_stream = lambda *args: HostStream()
    torch.Tensor.record_stream = lambda self, stream: None


def measure(call, repeats: int) -> dict:
    call()
    with CountOps() as ops:
        call()
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    return {"aten_ops": ops.count, "host_ms": (time.perf_counter() - start) / repeats * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--out", type=Path, help="append the row to this JSON list")
    args = parser.parse_args()
    on_host_streams()
    torch.set_num_threads(1)  # the dispatch, not a thread pool on a shared box
    from pagedserve.device.tier_copies import TierCopies

    shape = (2048, 16, 1, 1)  # 32-byte pieces: the ops' dispatch, not the bytes
    caches = [(torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.bfloat16))
              for _ in range(args.layers)]
    # a CUDA device by name only: every tensor stays on the CPU
    copies = TierCopies(caches, 4096, torch.device("cpu"), backend=None)
    copies._stream = HostStream()  # the CUDA path (the stream itself is a no-op here)
    offload = [(100 + i, 500 + i) for i in range(8)]
    recall = [(1000 + 40 * run + 15 - i, 1200 + 16 * run + i) for run in range(4)
              for i in range(16)]
    row = {"layers": args.layers, "offload_8_blocks": measure(lambda: copies.offload(offload),
                                                              args.repeats),
           "recall_64_blocks_4_runs": measure(lambda: copies.recall(recall), args.repeats)}
    print(json.dumps(row))
    if args.out is not None:
        rows = json.loads(args.out.read_text()) if args.out.exists() else []
        args.out.write_text(json.dumps(rows + [row], indent=1) + "\n")


if __name__ == "__main__":
    main()
