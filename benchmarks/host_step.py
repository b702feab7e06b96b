"""Host time of one decode step at a large batch, with the model's cost taken out (issue 33).

At TP=2 on the H100 a batch-256 decode step's GPU time (~6.3 ms) is shorter than the host's
chain around it, so the host work per step is the step. This runs that chain on the CPU
with the forward pass removed, so only Python remains:

- engine side: `LLMEngine.step()` as the offline `LLM` drives it in-process (the frontend's
  output processing, the engine core's schedule and its update from the tokens, the step's
  message encoded once, as `MultiprocExecutor` sends it);
- rank 0's side: what the runner does on the host for the same step (`prepare_step`: the
  request states, the block-table rows, the input buffers; then the placeholders' source
  rows, the sampling inputs, the pending output, its `result()` and the answer encoded),
  with a CPU tensor standing in for the sampled tokens.

A tiny random Llama (configs/tiny-llama3.json, load_format dummy) on the CPU, async
scheduling and admission_interval 16 as on CUDA; `--batch` requests of workload A's prompt
lengths (100-1024 tokens), each generating more tokens than the run lasts, so every
measured step decodes the whole batch.

    PYTHONPATH=. python benchmarks/host_step.py [--batch 256] [--steps 300] [--profile 25]

Prints microseconds per step (this thread's CPU time, the median of 5 blocks of steps) for
each part and, with
`--profile N`, cProfile's N costliest functions (own time) per step.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from pagedserve import SamplingParams  # noqa: E402
from pagedserve.device.executor import InFlightStep  # noqa: E402
from pagedserve.device.model_runner import ModelRunner, PendingRunnerOutput  # noqa: E402
from pagedserve.device.sampler import SamplerOutput, SamplingMetadata  # noqa: E402
from pagedserve.frontend.llm_engine import LLMEngine  # noqa: E402
from pagedserve.messages import (  # noqa: E402
    CollectedOutput, ModelRunnerOutput, SchedulerOutput, decode, encode)

HERE = Path(__file__).resolve().parent
# this thread's CPU time: the box these numbers come from is shared, and wall time would
# count the other processes' turns on its cores
clock = time.thread_time


class Timer:
    """Seconds per named part, per step."""

    def __init__(self) -> None:
        self.samples: dict[str, list[float]] = {}
        self.current: dict[str, float] = {}

    def add(self, name: str, seconds: float) -> None:
        self.current[name] = self.current.get(name, 0.0) + seconds

    def end_step(self) -> None:
        for name, seconds in self.current.items():
            self.samples.setdefault(name, []).append(seconds)
        self.current = {}

    def report(self) -> dict[str, float]:
        """Microseconds per step: the median of 5 blocks' means."""
        out = {}
        for name, values in self.samples.items():
            blocks = [values[i::5] for i in range(5)]
            out[name] = round(1e6 * statistics.median(statistics.mean(b) for b in blocks), 1)
        return out


class RankZero:
    """Rank 0's host work for each step, on the in-process runner, without the device: what
    `worker.py` does between a step's `SchedulerOutput` and its `CollectedOutput`."""

    def __init__(self, runner: ModelRunner, timer: Timer) -> None:
        self.runner, self.timer = runner, timer
        self.previous: PendingRunnerOutput | None = None
        try:  # the trees before issue 33's host work had no PlainBatch
            from pagedserve.device.sampler import PlainBatch
            self.plain = PlainBatch(runner.device, fused=True)
        except ImportError:
            self.plain = None

    def step(self, data: bytes) -> PendingRunnerOutput:
        """One step's host work, from its message to its pending output."""
        start = clock()
        message = decode(data, SchedulerOutput)
        decoded = clock()
        runner = self.runner
        prepared = runner.prepare_step(message)
        prepared_at = clock()
        inputs = prepared.inputs
        if inputs.placeholder_ids:  # what `launch` does on the host before the graph
            runner._copy_last_sampled(inputs, self.previous)
        copied = clock()
        states = inputs.sampling_states
        self.sampling_metadata(states)
        launched = clock()
        tokens = torch.randint(3, 1000, (len(states),), dtype=torch.int64)
        pending = PendingRunnerOutput(states, SamplerOutput(tokens, None))
        sampled = clock()
        self.timer.add("rank0_decode_message", decoded - start)
        self.timer.add("rank0_prepare_step", prepared_at - decoded)
        self.timer.add("rank0_placeholders", copied - prepared_at)
        self.timer.add("rank0_sampling_inputs", launched - copied)
        self.timer.add("rank0_sample_host", sampled - launched)
        self.previous = pending
        return pending

    def sampling_metadata(self, states: list) -> SamplingMetadata:
        """As `ModelRunner._handle` builds it on CUDA (the fused kernels' inputs)."""
        meta = self.plain.metadata(states) if self.plain is not None else None
        if meta is None:
            meta = SamplingMetadata.from_requests(states, self.runner.model_config.vocab_size,
                                                  self.runner.device, fused=True)
        return meta

    def collect(self, pending: PendingRunnerOutput) -> bytes:
        """`result()` (the tokens placed) and the answer encoded, as rank 0 sends it."""
        start = clock()
        output = pending.result()
        data = encode(CollectedOutput(output))
        self.timer.add("rank0_collect", clock() - start)
        return data


class HostOnlyExecutor:
    """The engine's executor with the device taken out: the step's message encoded once
    (as `MultiprocExecutor` sends it), rank 0's host work done in turn when asked
    (`rank0`), whose sampled tokens are random ids (a fixed id without it)."""

    def __init__(self, real, rank0: RankZero | None, timer: Timer) -> None:
        self.real, self.rank0, self.timer = real, rank0, timer
        self.device_type = real.device_type
        self.block_bytes = real.block_bytes

    def execute_model(self, scheduler_output: SchedulerOutput,
                      previous: InFlightStep | None = None):
        start = clock()
        data = encode(scheduler_output)
        self.timer.add("core_encode_message", clock() - start)
        handle = (scheduler_output, data)
        return handle, previous

    def sample_tokens(self, handle, grammar=None):
        scheduler_output, data = handle
        if self.rank0 is not None:
            return Collected(self, self.rank0.step(data))
        return Collected(self, scheduler_output)

    def sample_awaiting(self, step: InFlightStep) -> InFlightStep:
        return step

    def shutdown(self) -> None:
        self.real.shutdown()


class Collected:
    """A step's pending tokens: rank 0's output decoded as the engine does (or a fixed id
    for every row, without rank 0)."""

    def __init__(self, executor: HostOnlyExecutor, pending) -> None:
        self.executor, self.pending = executor, pending

    def result(self) -> ModelRunnerOutput:
        if isinstance(self.pending, SchedulerOutput):
            ids = self.pending.sampling_req_ids
            return ModelRunnerOutput(ids, [7] * len(ids))  # any id: no request stops on one
        data = self.executor.rank0.collect(self.pending)
        start = clock()
        output = decode(data, CollectedOutput).output
        self.executor.timer.add("core_decode_answer", clock() - start)
        return output


def model_folder() -> Path:
    from benchmarks.make_checkpoint import byte_level_tokenizer

    folder = Path(tempfile.mkdtemp(prefix="pagedserve-host-step-"))
    config = json.loads((HERE / "configs" / "tiny-llama3.json").read_text())
    (folder / "config.json").write_text(json.dumps(config))
    byte_level_tokenizer().save_pretrained(folder)
    return folder


def build(batch: int, rank0: bool, timer: Timer) -> LLMEngine:
    engine = LLMEngine.from_options(
        str(model_folder()), load_format="dummy", device="cpu", dtype="float32",
        max_num_seqs=batch, max_num_batched_tokens=16384, max_model_len=4096,
        kv_cache_memory=2 << 30, async_scheduling=True, admission_interval=16,
        enable_prefix_caching=True)
    core = engine.engine_core
    runner = core.executor.model_runner
    core.executor = HostOnlyExecutor(core.executor, RankZero(runner, timer) if rank0 else None,
                                     timer)
    return engine


def run(batch: int, steps: int, profile: int, rank0: bool) -> dict:
    random.seed(0)
    torch.manual_seed(0)
    torch.set_num_threads(1)  # the host's tensors here are a few hundred elements
    timer = Timer()
    engine = build(batch, rank0, timer)
    rng = random.Random(0)
    warmup = 40
    for i in range(batch):
        prompt = [rng.randrange(10_000) for _ in range(rng.randint(100, 1024))]
        engine.add_request(f"cmpl-{i}", None, SamplingParams(
            temperature=0.6, max_tokens=steps + warmup + 50, ignore_eos=True),
            prompt_token_ids=prompt, final_only=True)
    for _ in range(warmup):  # the prefills, and the pipeline full
        engine.step()
    timer.samples, timer.current = {}, {}
    profiler = cProfile.Profile() if profile else None
    for _ in range(steps):
        start = clock()
        if profiler is not None:
            profiler.enable()
        engine.step()
        if profiler is not None:
            profiler.disable()
        timer.add("engine_step", clock() - start)
        timer.end_step()
    running = len(engine.scheduler.running)
    result = {"batch": running, "steps": steps, "us_per_step": timer.report()}
    parts = result["us_per_step"]
    rank0_parts = [k for k in parts if k.startswith("rank0_")]
    if rank0:
        parts["rank0_total"] = round(sum(parts[k] for k in rank0_parts), 1)
        parts["engine_side"] = round(parts["engine_step"] - parts["rank0_total"], 1)
    if profiler is not None:
        result["profile"] = top_functions(profiler, steps, profile)
    engine.shutdown()
    return result


def top_functions(profiler: cProfile.Profile, steps: int, top: int) -> list[str]:
    stats = pstats.Stats(profiler)
    rows = []
    for (path, line, name), (_, calls, own, cumulative, _) in stats.stats.items():
        rows.append((own, cumulative, calls, f"{Path(path).name}:{line}({name})"))
    rows.sort(reverse=True)
    return [f"{1e6 * own / steps:8.1f} us own {1e6 * cum / steps:8.1f} us cum "
            f"{calls / steps:7.1f} calls  {where}" for own, cum, calls, where in rows[:top]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--profile", type=int, default=0,
                        help="print cProfile's N costliest functions per step (own time)")
    parser.add_argument("--engine-only", action="store_true",
                        help="leave rank 0's host work out (the engine side alone)")
    args = parser.parse_args()
    result = run(args.batch, args.steps, args.profile, not args.engine_only)
    for line in result.pop("profile", []):
        print(line)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
