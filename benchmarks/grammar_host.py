"""Host cost of structured outputs per engine step, without a model: the grammar work
EngineCore hands to its StructuredOutputManager at batch 256, replayed on the real tokenizer
and benchmarks/structured.py's schema, with tokens drawn at random from each row's mask.

Each step replays what the engine's thread does around the grammar (see engine/core.py):
  async (the GPU default): take the bitmask the workers filled (the wait is the exposed cost),
    sample (here: a random allowed token per row, not timed), hand the tokens and the next
    step's rows to the workers (`submit`, timed: the engine thread's share), finish and add
    requests, then `--host-work-ms` of pure Python standing for the engine thread's own work
    that the grammar overlaps (outputs, the frontend, scheduling), which holds the GIL.
  sync: fill the rows now (`grammar_bitmask`), sample, queue the accepts (`submit`), host work.
  legacy: the manager before this benchmark (a Python loop of accept_token with
    is_terminated checks, then xgrammar's threaded batch fill), on the engine thread.
A request whose grammar ends (its row allows only EOS and samples it) finishes and a new one
takes its row, as under continuous batching, so every row stays constrained.

Reported per configuration, ms per step: `submit` and `wait` on the engine thread, the
workers' busy time summed (`worker_cpu`, of which `worker_accept` in batch_accept_token;
legacy: none, its work is in `submit` and `wait`), and `added`: the step's time minus the
host work's time alone (measured right after), i.e. what the grammar costs the engine
thread, GIL and cores taken from its own work included. Lead's H100 host (16 cores):
    python benchmarks/grammar_host.py --model /tmp/ckpt --threads 0,1,2,4,8 --out /tmp/gh
Here (default model's tokenizer; --vocab-size 151936 is Qwen3's LM head over it, the
checkpoint of the H100 runs; --full-width puts its 102,784 padding ids in the token table):
    python benchmarks/grammar_host.py --steps 32 --threads 0,1
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import xgrammar as xgr  # noqa: E402

from benchmarks.structured import SCHEMA  # noqa: E402
from pagedserve.model.loader import load_tokenizer, model_path, read_model_config  # noqa: E402
from pagedserve.structured import manager as manager_module  # noqa: E402
from pagedserve.structured.manager import StructuredOutputManager  # noqa: E402
from pagedserve.structured.params import StructuredOutputsParams  # noqa: E402


class FakeParams:
    structured_outputs = StructuredOutputsParams(json=SCHEMA)


class FakeRequest:
    """What the manager reads of a request."""

    sampling_params = FakeParams()

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.output_token_ids: list[int] = []


class Sampler:
    """A random allowed token per row: random ids tried against the bits, else the row's
    allowed set in full (a grammar position with few choices)."""

    def __init__(self, vocab: int, seed: int) -> None:
        self.vocab, self.rng = vocab, np.random.default_rng(seed)

    def __call__(self, bitmask: np.ndarray | None, rows: int) -> list[int]:
        if bitmask is None:
            return self.rng.integers(0, self.vocab, rows).tolist()
        words = bitmask.view(np.uint32)
        tries = self.rng.integers(0, self.vocab, (rows, 64))
        bits = (words[np.arange(rows)[:, None], tries >> 5] >> (tries & 31).astype(np.uint32)) & 1
        out = []
        for row in range(rows):
            hit = np.flatnonzero(bits[row])
            if len(hit):
                out.append(int(tries[row, hit[0]]))
                continue
            allowed = np.flatnonzero(np.unpackbits(words[row].view(np.uint8),
                                                   bitorder="little")[:self.vocab])
            out.append(int(self.rng.choice(allowed)))
        return out


class HostWork:
    """A fixed amount of pure Python, `ms` long when it runs alone: it holds the GIL as the
    engine thread's own Python does, and whatever the grammar takes from it (the GIL, a
    core) makes it longer, which shows in the step's time."""

    def __init__(self, ms: float) -> None:
        self.rounds = 0
        if ms > 0:
            self.rounds = max(1, round(ms / min(self.time(200) for _ in range(5)) * 200))

    @staticmethod
    def _round() -> int:
        x = 0
        for i in range(100):
            x += i
        return x

    def time(self, rounds: int) -> float:
        start = time.perf_counter()
        for _ in range(rounds):
            self._round()
        return (time.perf_counter() - start) * 1e3

    def __call__(self) -> None:
        for _ in range(self.rounds):
            self._round()


class WorkerClock:
    """Sums the workers' busy time: whole tasks, and the accepts among them (the rest is the
    fill and the lines around, GIL waits included)."""

    def __init__(self) -> None:
        self.task: list[float] = []
        self.accept: list[float] = []
        self._run, self._accept = manager_module._Task.run, manager_module._BATCH_ACCEPT
        manager_module._Task.run = self._timed(self._run, self.task)
        manager_module._BATCH_ACCEPT = self._timed(self._accept, self.accept)

    @staticmethod
    def _timed(inner, into: list[float]):
        def timed(*args):
            start = time.perf_counter()
            try:
                return inner(*args)
            finally:
                into.append(time.perf_counter() - start)
        return timed

    def take(self) -> tuple[float, float]:
        task, accept = sum(self.task), sum(self.accept)
        self.task.clear()
        self.accept.clear()
        return task, accept

    def close(self) -> None:
        manager_module._Task.run, manager_module._BATCH_ACCEPT = self._run, self._accept


def run(tokenizer, vocab: int, eos: list[int], mode: str, threads: int, args,
        grammars=None) -> dict:
    # one token table for all configurations; the spec compiled already, so each request
    # gets its matcher at add_request (no background compile)
    manager = StructuredOutputManager(tokenizer, vocab, eos, args.batch,
                                      num_threads=threads if mode != "legacy" else 0,
                                      grammars=grammars)
    legacy_batch = xgr.BatchGrammarMatcher(max_threads=max(threads, 1)) if mode == "legacy" \
        else None
    sampler = Sampler(min(vocab, len(tokenizer)), args.seed)
    eos_set = set(eos)
    serial = 0

    def new_request() -> FakeRequest:
        nonlocal serial
        serial += 1
        request = FakeRequest(f"r{serial}")
        manager.add_request(request)
        return request

    requests = [new_request() for _ in range(args.batch)]
    host_work = HostWork(args.host_work_ms)
    clock = WorkerClock()
    totals = dict(submit=0.0, wait=0.0, worker_cpu=0.0, worker_accept=0.0, step=0.0,
                  finished=0)
    bitmask_np = None
    if mode == "async":
        manager.submit((), [r.request_id for r in requests])
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            clock.take()
            totals = dict.fromkeys(totals, 0.0)
        ids = [r.request_id for r in requests]
        start = time.perf_counter()
        t0 = time.perf_counter()
        if mode == "async":
            grammar = manager.take_bitmask()
        elif mode == "sync":
            grammar = manager.grammar_bitmask(ids)
        else:
            grammar = legacy_fill(manager, legacy_batch, ids)
        totals["wait"] += time.perf_counter() - t0
        bitmask_np = grammar.bitmask if grammar is not None else None
        pause = time.perf_counter()
        tokens = sampler(bitmask_np, len(ids))
        for request, token in zip(requests, tokens):
            request.output_token_ids.append(token)
        sampling = time.perf_counter() - pause
        finished = [i for i, t in enumerate(tokens) if t in eos_set]
        t0 = time.perf_counter()
        if mode == "legacy":
            legacy_accept(manager, requests)
        elif mode == "sync":
            manager.submit(requests)
        else:  # the next step's rows: a finished request's row goes to a new one
            old, new = list(requests), {i: FakeRequest(f"n{step}-{i}") for i in finished}
            for i, request in new.items():
                manager.add_request(request)
                requests[i] = request
            manager.submit(old, [r.request_id for r in requests])
        totals["submit"] += time.perf_counter() - t0
        if mode != "async":  # the outputs loop: finished requests go, new ones come
            for i in finished:
                manager.remove_request(requests[i].request_id)
                requests[i] = new_request()
        totals["finished"] += len(finished)
        host_work()
        totals["step"] += time.perf_counter() - start - sampling
    manager.take_bitmask()
    totals["worker_cpu"], totals["worker_accept"] = clock.take()
    clock.close()
    manager.shutdown()
    steps = args.steps
    report = {k: round(v * 1e3 / steps, 3) for k, v in totals.items() if k != "finished"}
    report["host_work_alone"] = round(host_work.time(host_work.rounds), 3)
    report["added"] = round(report["step"] - report["host_work_alone"], 3)
    report["finished_per_step"] = round(totals["finished"] / steps, 2)
    return report


def legacy_fill(manager: StructuredOutputManager, batch: xgr.BatchGrammarMatcher,
                ids: list[str]):
    """The pre-overlap manager's fill: per-row is_terminated, xgrammar's threaded fill."""
    rows, matchers = [], []
    for i, req_id in enumerate(ids):
        entry = manager._entries.get(req_id)
        if entry is not None and not entry.matcher.is_terminated():
            rows.append(i)
            matchers.append(entry.matcher)
    if not matchers:
        return None
    buffer = manager._buffers[0]
    batch.batch_fill_next_token_bitmask(matchers, buffer, rows)
    return manager_module.GrammarOutput(ids, buffer[:len(ids)])


def legacy_accept(manager: StructuredOutputManager, requests: list[FakeRequest]) -> None:
    """The pre-overlap manager's accept: a Python loop of accept_token."""
    for request in requests:
        entry = manager._entries.get(request.request_id)
        if entry is not None and not entry.matcher.is_terminated():
            entry.matcher.accept_token(request.output_token_ids[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="HF folder or .gguf whose tokenizer and "
                        "vocabulary size are used (default: the embedded SmolLM2-135M)")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="the logits width (default: the model config's)")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--threads", default="0,1,2,4,8",
                        help="worker counts to try (0: on the engine thread)")
    parser.add_argument("--modes", default="async,sync,legacy")
    parser.add_argument("--host-work-ms", type=float, default=3.0,
                        help="the engine thread's own Python per step, which the grammar "
                             "work overlaps")
    parser.add_argument("--full-width", action="store_true",
                        help="token table over the model's whole vocabulary, padding ids "
                             "included (as before grammar_vocab_size)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="folder for grammar_host.json")
    args = parser.parse_args()

    if args.full_width:
        from pagedserve.structured import grammar as grammar_module

        def full(tokenizer, vocab_size: int) -> int:
            return vocab_size

        grammar_module.grammar_vocab_size = manager_module.grammar_vocab_size = full
    config = read_model_config(args.model)
    tokenizer = load_tokenizer(str(model_path(args.model)))
    vocab = args.vocab_size or config.vocab_size
    eos = sorted({*config.eos_token_ids, *([tokenizer.eos_token_id]
                                          if tokenizer.eos_token_id is not None else [])})
    start = time.perf_counter()
    grammars = StructuredOutputManager(tokenizer, vocab, eos, 1, num_threads=0).grammars
    grammars.get(FakeParams.structured_outputs)
    print(f"token table and compile: {(time.perf_counter() - start) * 1e3:.0f} ms; vocab "
          f"{vocab} (tokenizer {len(tokenizer)}, grammar {grammars.vocab_size}), batch {args.batch}, host work "
          f"{args.host_work_ms} ms, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}",
          flush=True)
    results = []
    for mode in args.modes.split(","):
        for threads in [int(t) for t in args.threads.split(",")]:
            if mode == "legacy" and threads == 0:
                continue
            report = run(tokenizer, vocab, eos, mode, threads, args, grammars)
            results.append({"mode": mode, "threads": threads, **report})
            print(f"{mode:6s} threads={threads}: " + "  ".join(
                f"{k} {v}" for k, v in report.items()), flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "grammar_host.json").write_text(json.dumps({
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "load_before": os.getloadavg(), "vocab_size": vocab,
            "grammar_vocab_size": grammars.vocab_size,
            "args": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=1))


if __name__ == "__main__":
    main()
