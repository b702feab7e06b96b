"""Offline throughput on a GPU: pagedserve against the roofline and transformers, one run.

Workloads (random prompt token ids, `ignore_eos`, temperature 0.6, seed 0):
  A        256 requests, prompt and output lengths uniform in [100, 1024] (nano-vllm's)
  B        A's prompts with 512 output tokens each; with --peer also through transformers'
           continuous batching (`generate_batch`) on the same weights, after pagedserve's
           runs, stopped at --peer-deadline seconds and then recorded as partial
  prefix   256 requests sharing a 2,048-token system prompt (+64 own tokens, 128 out):
           throughput and TTFT with prefix caching on vs off
  preempt  A under a KV budget that forces preemptions: recompute vs swap (prefix caching
           off, so a recomputed request really recomputes)
  profile  torch.profiler over 10 decode steps at batch 256: GPU time per kernel family

Every run records the step-time breakdown (scheduler, input preparation, forward + sampling
launch, the wait for the sampled tokens, output processing) from wrappers around the engine's
methods, and how much of it the GPU overlaps: CUDA events around each launched step give the
GPU's time per step and its idle gaps between steps (with async scheduling, on by default on
CUDA, the CPU prepares step N+1 while the GPU runs step N, so the gaps should vanish).
--sync runs every engine with async scheduling off (run it as a second process for the
comparison: a second engine in one process would size its KV cache from what the first one
left free). The roofline is the bytes a
decode step must read (weights once, every active request's KV) summed over the workload,
over the device-to-device copy bandwidth measured in the same run.

    python benchmarks/throughput.py --config benchmarks/configs/qwen3-0.6b.json \
        --workloads A,B,prefix,preempt,profile --peer --out docs/results/throughput.json
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

# this folder holds kernels.py, which would shadow the `kernels` package transformers probes for
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch  # noqa: E402

from pagedserve import SamplingParams  # noqa: E402
from pagedserve.config import EngineConfig  # noqa: E402
from pagedserve.entrypoints.llm import LLM  # noqa: E402
from pagedserve.frontend.llm_engine import LLMEngine, LoadedModel  # noqa: E402

NUM_REQUESTS = 256
TEMPERATURE = 0.6


def workload_prompts(seed: int = 0, vocab: int = 10_000) -> tuple[list[list[int]], list[int]]:
    """Workload A: prompts and output lengths uniform in [100, 1024]."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(100, 1024))]
               for _ in range(NUM_REQUESTS)]
    out_lens = [rng.randint(100, 1024) for _ in range(NUM_REQUESTS)]
    return prompts, out_lens


def prefix_prompts(seed: int = 1, vocab: int = 10_000) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(vocab) for _ in range(2048)]
    return [system + [rng.randrange(vocab) for _ in range(64)] for _ in range(NUM_REQUESTS)]


class StepTimer:
    """Per-step wall times of the engine's parts, by wrapping its methods (no syncs added).

    One engine step schedules and launches a model step, then waits for the tokens of the
    step it completes (with async scheduling the one launched by the previous call) and
    processes them; the parts of a call sum to its wall time. CUDA events recorded around
    each launch time the GPU's side without a sync: from the start event to the end event
    is the step's GPU time, from one step's end event to the next one's start event is time
    the GPU had nothing queued (a start event completes only once all earlier work is done).
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.steps: list[dict] = []
        self._current: dict = {}
        runner, scheduler = engine.model_runner, engine.scheduler
        executor = engine.engine_core.executor
        wrapped = [(scheduler, "schedule", "schedule"), (runner, "prepare_inputs", "prepare"),
                   (executor, "execute_model", "execute"), (executor, "sample_tokens", "execute"),
                   (engine.engine_core, "_update", "complete"),
                   (engine.output_processor, "process_outputs", "process"),
                   (engine, "step", "step")]
        self._wrapped = [(obj, name) for obj, name, _ in wrapped]
        for obj, name, key in wrapped:
            self._wrap(obj, name, key)

    def restore(self) -> None:
        """Drop the instance-level wrappers: the class methods show through again."""
        for obj, name in self._wrapped:
            delattr(obj, name)

    def _wrap(self, obj, name: str, key: str) -> None:
        inner = getattr(obj, name)

        def timed(*args, **kwargs):
            if key == "step":
                self._current = {}
            if name == "execute_model" and torch.cuda.is_available():
                self._current["gpu_start"] = _timing_event()
            t0 = time.perf_counter()
            result = inner(*args, **kwargs)
            self._current[key] = self._current.get(key, 0.0) + time.perf_counter() - t0
            if key == "schedule":
                self._current["batch"] = len(result.req_ids)
                self._current["decodes"] = result.num_decodes
            if name == "sample_tokens":
                if "gpu_start" in self._current:
                    self._current["gpu_end"] = _timing_event()
                self._wrap_wait(result)
            if key == "step" and ("execute" in self._current or "complete" in self._current):
                self.steps.append(self._current)
            return result

        setattr(obj, name, timed)

    def _wrap_wait(self, pending) -> None:
        """Time the wait for the tokens, whichever later engine step it happens in."""
        wait = pending.result

        def timed_wait():
            t0 = time.perf_counter()
            result = wait()
            self._current["wait"] = self._current.get("wait", 0.0) + time.perf_counter() - t0
            return result

        pending.result = timed_wait

    def gpu_times(self, steps: list[dict]) -> tuple[float, float] | None:
        """Mean GPU ms per launched step and mean idle ms before it (call after a sync)."""
        launched = [s for s in self.steps if "gpu_end" in s]
        if not launched:
            return None
        busy, idle = [], []
        previous_end = None
        wanted = {id(s) for s in steps}
        for s in launched:
            if id(s) in wanted:
                busy.append(s["gpu_start"].elapsed_time(s["gpu_end"]))
                if previous_end is not None:
                    idle.append(max(0.0, previous_end.elapsed_time(s["gpu_start"])))
            previous_end = s["gpu_end"]
        if not busy:
            return None
        return statistics.mean(busy), statistics.mean(idle) if idle else 0.0

    def summary(self, batch: int | None = None) -> dict:
        """Mean ms per part over all steps, and over pure-decode steps at `batch` if given."""
        def mean_ms(steps, key):
            return round(1e3 * statistics.mean(s.get(key, 0.0) for s in steps), 3)

        def parts(steps):
            out = {k: mean_ms(steps, k)
                   for k in ("schedule", "prepare", "execute", "wait", "complete", "process",
                             "step")}
            out["launch"] = round(out.pop("execute") - out["prepare"], 3)
            out["forward_sample_wait"] = round(out["launch"] + out["wait"], 3)
            # the core's token bookkeeping, then the frontend's text and RequestOutputs
            out["output_processing"] = round(out.pop("complete") + out.pop("process"), 3)
            out["cpu"] = round(out["schedule"] + out["prepare"] + out["launch"]
                               + out["output_processing"], 3)
            gpu = self.gpu_times(steps)
            if gpu is not None:
                out["gpu_step"], out["gpu_idle_before_step"] = (round(t, 3) for t in gpu)
                out["gpu_busy_fraction"] = round(gpu[0] / (gpu[0] + gpu[1]), 3)
            out["steps"] = len(steps)
            return out

        result = {"all_steps": parts(self.steps)}
        if batch is not None:
            at = [s for s in self.steps if s.get("batch") == batch
                  and s.get("decodes") == batch]
            if at:
                result[f"decode_batch_{batch}"] = parts(at)
        return result


def _timing_event() -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def run_pagedserve(engine: LLMEngine, prompts: list[list[int]], out_lens: list[int],
                   breakdown_batch: int | None = NUM_REQUESTS) -> dict:
    llm = LLM.from_engine(engine)
    params = [SamplingParams(temperature=TEMPERATURE, max_tokens=n, ignore_eos=True)
              for n in out_lens]
    timer = StepTimer(engine)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    timer.restore()
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outputs]
    return {"seconds": round(seconds, 3), "output_tokens": tokens,
            "output_tok_per_s": round(tokens / seconds, 1),
            "ttft_mean_s": round(statistics.mean(ttft), 3),
            "ttft_p50_s": round(statistics.median(ttft), 3),
            "preemptions": engine.scheduler.num_preemptions,
            "async_scheduling": engine.async_scheduling,
            "step_ms": timer.summary(breakdown_batch)}


def run_transformers(model_dir: str, prompts: list[list[int]], max_new_tokens: int,
                     deadline_s: float = 300.0) -> dict:
    """transformers' own continuous batching (`generate_batch`), bf16, same weights.

    `generate_batch` runs in a worker thread; the manager it creates is captured (a wrapper
    around `model.init_continuous_batching`) so that its results are counted as they arrive.
    The clock starts when the requests are submitted (after the manager's set-up and warm-up)
    and stops at the last finished request. If the batch has not finished `deadline_s` after
    submission, the row is marked partial: tokens are those of the finished requests plus
    those generated so far by the requests in flight (read from the manager's scheduler),
    over the time since submission; the caller must then exit without joining the worker.
    """
    import inspect
    import threading

    from transformers import AutoModelForCausalLM, GenerationConfig

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16, attn_implementation="paged|sdpa").to(device).eval()
    gen = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=-1,
                           pad_token_id=0)
    extra = {}
    if "progress_bar" in inspect.signature(model.generate_batch).parameters:
        extra["progress_bar"] = False
    model.generate_batch(prompts[:4], generation_config=gen, max_new_tokens=8, **extra)  # warm-up

    state = {"t0": None, "t_last": None, "finished": 0, "tokens": 0, "manager": None,
             "error": None, "results": None}
    lock = threading.Lock()
    init = model.init_continuous_batching

    def capture(*args, **kwargs):
        manager = init(*args, **kwargs)
        state["manager"] = manager
        for name in ("add_requests", "add_request"):
            submit = getattr(manager, name)

            def timed_submit(*a, _submit=submit, **k):
                if state["t0"] is None:
                    state["t0"] = time.perf_counter()
                return _submit(*a, **k)

            setattr(manager, name, timed_submit)
        get_result = manager.get_result

        def counted_get_result(*a, **k):
            result = get_result(*a, **k)
            done = result is not None and (not hasattr(result, "is_finished")
                                           or result.is_finished())
            if done:
                with lock:
                    state["finished"] += 1
                    state["tokens"] += len(getattr(result, "generated_tokens", None) or ())
                    state["t_last"] = time.perf_counter()
            return result

        manager.get_result = counted_get_result
        return manager

    model.init_continuous_batching = capture

    def work():
        try:
            state["results"] = model.generate_batch(prompts, generation_config=gen, **extra)
        except BaseException as error:  # noqa: BLE001 (reported in the row)
            state["error"] = repr(error)

    worker = threading.Thread(target=work, daemon=True, name="generate_batch")
    started = time.perf_counter()
    worker.start()
    while worker.is_alive():
        worker.join(timeout=1.0)
        # from the submission; at most 60 s more from the start (the manager's set-up)
        now = time.perf_counter()
        if int(now - started) % 30 == 0:
            print(f"generate_batch: {now - started:.0f} s, {state['finished']} finished",
                  flush=True)
        if now - (state["t0"] or started) > deadline_s or now - started > deadline_s + 60:
            break
    now = time.perf_counter()
    if state["t0"] is None:
        if state["error"] is not None:
            raise RuntimeError(f"generate_batch failed: {state['error']}")
        state["t0"] = started
    if state["results"] and not state["tokens"]:  # results never went through get_result
        with lock:
            outputs = list(state["results"].values())
            state["finished"] = len(outputs)
            state["tokens"] = sum(len(r.generated_tokens) for r in outputs)
            state["t_last"] = now
    with lock:
        finished, finished_tokens, t_last = state["finished"], state["tokens"], state["t_last"]
    partial = worker.is_alive() or finished < len(prompts)
    row = {"partial": partial, "requests_finished": finished, "requests": len(prompts),
           "max_new_tokens": max_new_tokens, "attn_implementation": "paged|sdpa"}
    if partial:
        in_flight = 0
        scheduler = getattr(getattr(state["manager"], "batch_processor", None), "scheduler", None)
        for _ in range(10):  # the manager's thread may resize the dict while we read it
            try:
                active = list(getattr(scheduler, "active_requests", {}).values())
                in_flight = sum(len(s.generated_tokens) for s in active)
                break
            except RuntimeError:
                continue
        seconds = now - state["t0"]
        tokens = finished_tokens + in_flight
        row.update(deadline_s=deadline_s, finished_tokens=finished_tokens,
                   in_flight_tokens=in_flight, error=state["error"])
    else:
        seconds = t_last - state["t0"]
        tokens = finished_tokens
    return {"seconds": round(seconds, 3), "output_tokens": tokens,
            "output_tok_per_s": round(tokens / seconds, 1), **row}


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (median of 20)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(23):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() / statistics.median(times[3:])


def roofline(engine: LLMEngine, prompts: list[list[int]], out_lens: list[int],
             bandwidth: float) -> dict:
    """Output tok/s if every decode step only read the weights once and each active
    request's KV once, at the measured copy bandwidth (prefill is not counted)."""
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.model_runner.model.parameters())
    kv_per_token = engine.model_runner.block_bytes // engine.config.block_size
    kv_bytes = sum(n * len(p) + n * (n - 1) // 2 for p, n in zip(prompts, out_lens)) * kv_per_token
    total = weight_bytes * max(out_lens) + kv_bytes
    seconds = total / bandwidth
    return {"copy_bandwidth_GBps": round(bandwidth / 1e9, 1),
            "bytes_read_GB": round(total / 1e9, 1), "seconds": round(seconds, 3),
            "output_tok_per_s": round(sum(out_lens) / seconds, 1)}


def profile_decode(engine: LLMEngine, prompts: list[list[int]], path: Path) -> dict:
    """Profile 10 steps at batch 256 (all admitted, past their prefills)."""
    params = SamplingParams(temperature=TEMPERATURE, max_tokens=200, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"prof{i}", None, params, prompt_token_ids=ids)
    while len(engine.scheduler.waiting) or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running):
        engine.step()
    for _ in range(5):
        engine.step()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(10):
            engine.step()
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    engine.abort_request([f"prof{i}" for i in range(len(prompts))])
    engine.step()
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25)
    path.write_text(table)
    events = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events)
    return {"steps": 10, "wall_ms_per_step": round(wall * 100, 3),
            "gpu_busy_ms_per_step": round(gpu_us / 1e4, 3), "table": path.name}


class Bench:
    def __init__(self, args: argparse.Namespace, model_dir: str) -> None:
        self.args = args
        self.model_dir = model_dir
        self.loaded = LoadedModel.load(EngineConfig(model=model_dir))
        self.rows: list[dict] = []
        self.extra: dict = {}

    def engine(self, **options) -> LLMEngine:
        opts = dict(model=self.model_dir, max_model_len=4096, max_num_seqs=256,
                    max_num_batched_tokens=16384, enforce_eager=self.args.eager,
                    async_scheduling=False if self.args.sync else None)
        opts.update(options)
        t0 = time.perf_counter()
        engine = LLMEngine(EngineConfig(**opts), self.loaded)
        LLM.from_engine(engine).generate([[1, 2, 3]] * 4, SamplingParams(max_tokens=16,
                                         ignore_eos=True), use_tqdm=False)
        self.extra.setdefault("engine_start_s", []).append(round(time.perf_counter() - t0, 2))
        return engine

    def record(self, workload: str, engine: str, result: dict, **extra) -> None:
        row = {"workload": workload, "engine": engine, **extra, **result,
               "device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat()}
        self.rows.append(row)
        print(json.dumps(row), flush=True)
        self.save()

    def save(self) -> None:
        if self.args.out:
            self.args.out.parent.mkdir(parents=True, exist_ok=True)
            self.args.out.write_text(json.dumps(self.rows, indent=1) + "\n")
        if self.args.extra_out:
            self.args.extra_out.write_text(json.dumps(self.extra, indent=1) + "\n")


def release() -> None:
    """Return the memory of engines the caller has dropped (KV cache, graph pools)."""
    gc.collect()
    torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="HF folder; default: a random checkpoint from --config")
    parser.add_argument("--config", default="benchmarks/configs/qwen3-0.6b.json")
    parser.add_argument("--workloads", default="A,B,prefix,preempt,profile")
    parser.add_argument("--peer", action="store_true", help="run transformers on workload B")
    parser.add_argument("--peer-deadline", type=float, default=300.0,
                        help="seconds after submission at which an unfinished peer run is "
                             "recorded as partial")
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--sync", action="store_true",
                        help="async scheduling off for every engine of the run")
    parser.add_argument("--preempt-kv-gib", type=float, default=8.0,
                        help="KV budget of the preemption runs")
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    parser.add_argument("--extra-out", type=Path, help="roofline, engine sizes, profile")
    args = parser.parse_args()

    model_dir = args.model
    if model_dir is None:
        import importlib.util  # noqa: PLC0415 (this folder is off sys.path, see above)
        spec = importlib.util.spec_from_file_location(
            "make_checkpoint", Path(__file__).with_name("make_checkpoint.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        make_checkpoint = module.make_checkpoint
        model_dir = tempfile.mkdtemp(prefix="pagedserve-ckpt-")
        make_checkpoint(Path(args.config), Path(model_dir), torch.bfloat16, 0, "bytes")

    workloads = args.workloads.split(",")
    prompts, out_lens = workload_prompts()
    bench = Bench(args, model_dir)
    engine = bench.engine()
    bench.extra["num_gpu_blocks"] = engine.num_blocks
    bench.extra["roofline_A"] = roofline(engine, prompts, out_lens, copy_bandwidth())
    bench.extra["roofline_B"] = roofline(engine, prompts, [512] * NUM_REQUESTS,
                                         bench.extra["roofline_A"]["copy_bandwidth_GBps"] * 1e9)
    print(json.dumps(bench.extra), flush=True)
    if "A" in workloads:
        bench.record("A", "pagedserve", run_pagedserve(engine, prompts, out_lens))
    if "B" in workloads:
        bench.record("B", "pagedserve", run_pagedserve(engine, prompts, [512] * NUM_REQUESTS))
    if "profile" in workloads:
        path = (args.extra_out.parent if args.extra_out else Path(".")) / "profile_b256.txt"
        bench.extra["profile_b256"] = profile_decode(engine, prompts, path)
        bench.save()
    if "prefix" in workloads:
        p = prefix_prompts()
        for caching in (True, False):
            engine.kv_cache_manager.reset_prefix_cache()
            engine.kv_cache_manager.enable_caching = caching
            bench.record("prefix", "pagedserve",
                         run_pagedserve(engine, p, [128] * NUM_REQUESTS), prefix_caching=caching)
        engine.kv_cache_manager.enable_caching = True
    del engine
    release()
    if "preempt" in workloads:
        for mode in ("recompute", "swap"):
            engine = bench.engine(kv_cache_memory=int(args.preempt_kv_gib * (1 << 30)),
                                  preemption_mode=mode, swap_space=16 << 30,
                                  enable_prefix_caching=False)
            result = run_pagedserve(engine, prompts, out_lens, breakdown_batch=None)
            result["blocks_swapped_out"] = engine.get_stats().num_blocks_swapped_out
            bench.record("A-preempt", "pagedserve", result, preemption_mode=mode,
                         kv_cache_gib=args.preempt_kv_gib)
            del engine
            release()
    if "B" in workloads and args.peer:
        peer = run_transformers(model_dir, prompts, 512, args.peer_deadline)
        bench.record("B", "transformers", peer)
        mine = [r for r in bench.rows if r["workload"] == "B" and r["engine"] == "pagedserve"]
        if mine and peer["output_tok_per_s"] > 0:
            bench.extra["B_ratio_vs_transformers"] = round(
                mine[-1]["output_tok_per_s"] / peer["output_tok_per_s"], 2)
            bench.save()
            print(json.dumps({"B_ratio_vs_transformers": bench.extra["B_ratio_vs_transformers"]}),
                  flush=True)
        if peer["partial"]:  # transformers' generation thread is still running: do not join it
            sys.stdout.flush()
            os._exit(0)


if __name__ == "__main__":
    main()
