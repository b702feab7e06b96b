"""Run a function on N CPU ranks (processes joined in one gloo group), collect results.

The function must be importable (module level): the ranks import it by name. They are forked
from a fork server that imported torch and the model code once, so a group's start does not
pay for those imports on every rank (a fork of this process instead could hang in torch's
thread pools); the ranks see the environment the server started with, not later changes to
this process's (pass what varies as arguments). Each rank gets one intra-op thread: the ranks
share the machine's cores.
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import queue
import socket
import traceback
from collections.abc import Callable

import torch

RANK_TIMEOUT_S = 300
_PRELOAD = ["torch", "pytest", "pagedserve.model.parallel", "tests.distributed.harness"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, size: int, port: int, fn: Callable, args: tuple,
           results: mp.Queue) -> None:
    from pagedserve.model import parallel

    torch.set_num_threads(1)
    try:
        parallel.init_tensor_parallel(rank, size, torch.device("cpu"),
                                      f"tcp://127.0.0.1:{port}")
        # pickled here, by value: torch's queue reducer would share tensors through file
        # descriptors, which die with this process
        results.put((rank, "ok", pickle.dumps(fn(*args))))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def run_on_ranks(fn: Callable, *args, size: int = 2) -> list:
    """fn(*args) on every rank of a fresh group; the results in rank order."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # takes effect when the server starts (once)
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, size, port, fn, args, results), daemon=True)
             for r in range(size)]
    for p in procs:
        p.start()
    out: dict[int, object] = {}
    try:
        for _ in range(size):
            rank, status, value = results.get(timeout=RANK_TIMEOUT_S)
            if status == "error":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            out[rank] = pickle.loads(value)
    except queue.Empty:
        raise AssertionError(f"ranks {sorted(set(range(size)) - set(out))} gave no result "
                             f"in {RANK_TIMEOUT_S} s") from None
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(size)]
