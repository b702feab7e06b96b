"""Async scheduling (the next step is scheduled and launched before the tokens of the one in
flight are known) generates exactly what the synchronous engine does, on the CPU where the
same code runs: a mixed batch with staggered arrivals, stop strings, stop token ids, EOS,
max_tokens, logprobs, seeded sampling, n > 1, chunked prefill and prefix-cache hits;
preemption by recompute and by swap; abort mid-generation; penalties. Every engine ends with
its blocks all free (`assert_pool_clean`). Runs on a tiny random Qwen3 checkpoint: fast, and
its large random weights give peaked logits, so greedy choices are not near-ties."""

from __future__ import annotations

import dataclasses
import json
import logging
import random

import pytest
import torch

from benchmarks.make_checkpoint import make_checkpoint
from pagedserve.config import EngineConfig
from pagedserve.engine.request import Request
from pagedserve.engine.scheduler import Scheduler
from pagedserve.frontend.llm_engine import LLMEngine, LoadedModel
from pagedserve.kv_cache.kv_cache_manager import KVCacheManager
from pagedserve.messages import ModelRunnerOutput, SchedulerOutput, decode, encode
from pagedserve.sampling_params import SamplingParams
from tests.conftest import assert_pool_clean

VOCAB = 259  # the byte-level tokenizer's: every sampled token decodes to text
CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 32,
    "hidden_size": 128, "intermediate_size": 256, "max_position_embeddings": 512,
    "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": True,
    "vocab_size": VOCAB, "bos_token_id": 1, "eos_token_id": 2, "initializer_range": 0.5,
}
BLOCK = 16


@pytest.fixture(scope="module")
def loaded(tmp_path_factory) -> LoadedModel:
    root = tmp_path_factory.mktemp("tiny-qwen3-async")
    (root / "config.json").write_text(json.dumps(CONFIG))
    make_checkpoint(root / "config.json", root / "ckpt", torch.float32, seed=0,
                    tokenizer="bytes")
    return LoadedModel.load(EngineConfig(model=str(root / "ckpt"), device="cpu",
                                         dtype="float32"))


def make(loaded: LoadedModel, async_scheduling: bool, num_blocks: int = 256,
         **options) -> LLMEngine:
    block_bytes = 2 * 2 * BLOCK * 2 * 32 * 4  # K and V, 2 layers, 2 KV heads of 32, fp32
    options.setdefault("max_num_batched_tokens", 64)  # prompts longer than this are chunked
    engine = LLMEngine(EngineConfig(
        model="tiny", device="cpu", dtype="float32", block_size=BLOCK,
        kv_cache_memory=num_blocks * block_bytes, async_scheduling=async_scheduling,
        **options), loaded)
    assert engine.async_scheduling is async_scheduling
    assert engine.num_blocks == num_blocks
    return engine


@dataclasses.dataclass
class Arrival:
    step: int  # the engine step before which the request is added
    request_id: str
    prompt: list[int]
    params: SamplingParams


def run(engine: LLMEngine, arrivals: list[Arrival], abort_at: dict[int, str] | None = None
        ) -> dict[str, object]:
    """Step until done, adding requests at their steps and aborting at `abort_at` steps.
    Returns each request's final CompletionOutputs, after checking that the streamed deltas
    add up to them and that the engine freed every block."""
    abort_at = abort_at or {}
    pending = sorted(arrivals, key=lambda a: a.step)
    finished, deltas = {}, {}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0].step <= step:
            a = pending.pop(0)
            engine.add_request(a.request_id, None, a.params, prompt_token_ids=a.prompt)
        if step in abort_at:
            engine.abort_request(abort_at[step])
        for output in engine.step():
            for c in output.outputs:
                text, ids = deltas.get((output.request_id, c.index), ("", []))
                deltas[(output.request_id, c.index)] = (text + c.text_delta,
                                                        ids + c.token_ids_delta)
            if output.finished:
                finished[output.request_id] = output.outputs
        step += 1
        assert step < 500, "the engine did not finish"
    for (request_id, index), (text, ids) in deltas.items():
        completion = finished[request_id][index]
        assert (text, ids) == (completion.text, completion.token_ids)
    assert_pool_clean(engine)
    return finished


def summary(finished: dict[str, object]) -> dict[str, list[tuple]]:
    """What must match between the engines, logprobs included (same math, same values)."""
    def logprobs(c):
        if c.logprobs is None:
            return None
        return [{t: (round(lp.logprob, 4), lp.rank) for t, lp in entry.items()}
                for entry in c.logprobs]

    return {rid: [(c.token_ids, c.text, c.finish_reason, c.stop_reason, logprobs(c))
                  for c in outs] for rid, outs in finished.items()}


def prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


@pytest.fixture(scope="module")
def free_run(loaded) -> dict[str, list[int]]:
    """Unstopped greedy tokens and text of the mixed batch's prompts: stop conditions are
    picked from them, so that they fire in the middle of a generation."""
    engine = make(loaded, async_scheduling=False)
    ps = prompts(0, [5, 30, 80, 17, 44, 9])
    out = run(engine, [Arrival(0, f"p{i}", p, greedy(24)) for i, p in enumerate(ps)])
    return {f"p{i}": out[f"p{i}"][0] for i in range(len(ps))} | {"prompts": ps}


def mixed_batch(free_run) -> list[Arrival]:
    ps = free_run["prompts"]
    shared = ps[2][:48] + prompts(1, [20])[0]  # 3 full blocks of p2's prompt: a prefix hit
    p0, p1, p3 = free_run["p0"], free_run["p1"], free_run["p3"]
    stop_token = p1.token_ids[6]
    stop_text = p3.text[len(p3.text) // 2:len(p3.text) // 2 + 2]
    assert stop_text and stop_text in p3.text
    return [
        Arrival(0, "p0", ps[0], greedy(24)),
        Arrival(0, "p1-stop-token", ps[1], greedy(24, stop_token_ids=[stop_token])),
        Arrival(0, "p2-chunked", ps[2], greedy(20, logprobs=2)),
        Arrival(2, "p3-stop-string", ps[3], greedy(24, stop=[stop_text])),
        Arrival(3, "p4-seeded", ps[4], SamplingParams(temperature=0.9, seed=11, max_tokens=15,
                                                      ignore_eos=True)),
        Arrival(3, "p5-one-token", ps[5], greedy(1)),
        Arrival(5, "p6-n2", ps[0] + ps[5], SamplingParams(n=2, temperature=1.0, seed=3,
                                                          max_tokens=10, ignore_eos=True)),
        Arrival(7, "p7-prefix-hit", shared, greedy(12)),
        Arrival(9, "p8-eos", ps[1], SamplingParams(temperature=0.0, max_tokens=24,
                                                   min_tokens=2)),
        Arrival(9, "p9-late", p0.token_ids[:8] + ps[3], greedy(7)),
    ]


def test_mixed_batch_matches_the_synchronous_engine(loaded, free_run):
    arrivals = mixed_batch(free_run)
    eos = free_run["p1"].token_ids[9]  # the tiny model's EOS would hardly ever be sampled
    results = []
    for async_scheduling in (False, True):
        engine = make(loaded, async_scheduling)
        engine.engine_core.eos_token_ids = frozenset({eos})
        results.append(run(engine, arrivals))
        assert engine.get_stats().prefix_cache_hits >= 48
    sync, async_ = (summary(r) for r in results)
    assert async_ == sync
    # the stop conditions fired mid-generation, with a step already in flight
    assert sync["p1-stop-token"][0][2:4] == ("stop", free_run["p1"].token_ids[6])
    assert sync["p3-stop-string"][0][2] == "stop"
    assert sync["p8-eos"][0][0][-1] == eos and sync["p8-eos"][0][2] == "stop"
    assert all(len(sync[r][0][0]) < 24 for r in ("p1-stop-token", "p3-stop-string", "p8-eos"))
    assert len(sync["p6-n2"]) == 2 and sync["p6-n2"][0][0] != sync["p6-n2"][1][0]


def through_msgpack(engine: LLMEngine) -> list[SchedulerOutput]:
    """Make every message of the engine cross msgpack, as it would between processes: core
    requests in, scheduler outputs to the runner, runner outputs back, core outputs out.
    Returns the list the scheduler outputs the runner received will be appended to."""
    core, executor = engine.engine_core, engine.engine_core.executor
    received = []

    def round_trip(message):
        return decode(encode(message), type(message))

    def execute_model(scheduler_output, previous=None):
        received.append(round_trip(scheduler_output))
        return execute(received[-1], previous)

    def sample_tokens(step, grammar=None):
        pending = sample(step, grammar)
        result = pending.result
        pending.result = lambda: round_trip(result())
        return pending

    add, step = core.add_request, core.step
    execute, sample = executor.execute_model, executor.sample_tokens
    core.add_request = lambda request: add(round_trip(request))
    executor.execute_model = execute_model
    executor.sample_tokens = sample_tokens
    core.step = lambda: round_trip(step())
    return received


def test_messages_through_msgpack_give_the_same_outputs(loaded, free_run):
    arrivals = mixed_batch(free_run)
    reference = make(loaded, async_scheduling=True)
    serialized = make(loaded, async_scheduling=True)
    received = through_msgpack(serialized)
    assert summary(run(serialized, arrivals)) == summary(run(reference, arrivals))
    assert any(out.scheduled_new_reqs for out in received)
    assert any(out.scheduled_cached_reqs.req_ids for out in received)
    assert any(out.finished_req_ids for out in received)


@pytest.mark.parametrize("mode, caching", [("recompute", True), ("recompute", False),
                                           ("swap", True), ("swap", False)])
def test_preemption_matches_the_synchronous_engine(loaded, mode, caching):
    ps = prompts(2, [20, 27, 34, 41, 48, 55])
    arrivals = [Arrival(i // 2, f"s{i}", p, greedy(24) if i % 3 else SamplingParams(
        temperature=0.8, seed=i, max_tokens=24, ignore_eos=True)) for i, p in enumerate(ps)]
    reference = summary(run(make(loaded, async_scheduling=False), arrivals))
    small = make(loaded, async_scheduling=True, num_blocks=12, preemption_mode=mode,
                 swap_space=64 * 2 * 2 * BLOCK * 2 * 32 * 4, enable_prefix_caching=caching)
    assert summary(run(small, arrivals)) == reference
    assert small.scheduler.num_preemptions > 0
    if mode == "swap":
        assert small.get_stats().num_blocks_swapped_out > 0
        assert small.scheduler.swap_space.num_free_blocks == small.scheduler.swap_space.num_blocks


def test_abort_mid_generation_frees_everything(loaded):
    ps = prompts(3, [12, 40, 25])
    arrivals = [Arrival(0, f"a{i}", p, greedy(20)) for i, p in enumerate(ps)]
    reference = summary(run(make(loaded, async_scheduling=False), arrivals))
    engine = make(loaded, async_scheduling=True)
    out = summary(run(engine, arrivals, abort_at={4: "a1", 6: "a0"}))
    for request_id in ("a0", "a1"):
        tokens, _, reason, _, _ = out[request_id][0]
        assert reason == "abort" and 0 < len(tokens) < 20
        assert tokens == reference[request_id][0][0][:len(tokens)]
    assert out["a2"] == reference["a2"]


def test_penalties_keep_a_step_in_flight_and_match(loaded):
    """The runner counts penalized tokens on its device, so requests with penalties leave
    the overlap on: a step stays in flight across them, and the tokens (seeded draws with
    top-k / top-p included) are the synchronous engine's. Slots are freed."""
    ps = prompts(4, [10, 30, 12])
    arrivals = [Arrival(0, "pen", ps[0], greedy(16, repetition_penalty=1.5,
                                                frequency_penalty=0.5)),
                Arrival(1, "plain", ps[1], greedy(16)),
                Arrival(1, "seeded", ps[2], SamplingParams(
                    temperature=1.0, seed=3, max_tokens=16, ignore_eos=True,
                    presence_penalty=1.0, top_k=20, top_p=0.9))]
    reference = summary(run(make(loaded, async_scheduling=False), arrivals))
    engine = make(loaded, async_scheduling=True)
    in_flight, step = [], engine.step

    def recording_step():
        outputs = step()
        in_flight.append(engine.engine_core.in_flight is not None)
        return outputs

    engine.step = recording_step
    assert summary(run(engine, arrivals)) == reference
    assert sum(in_flight) >= len(in_flight) - 2  # all but the last steps overlap
    # the runner hears of finished requests with the next step: their slots go then
    run(engine, [Arrival(0, "next", ps[1], greedy(2))])
    assert len(engine.model_runner.penalties) == 0


def test_no_step_is_scheduled_past_max_tokens(loaded):
    engine = make(loaded, async_scheduling=True)
    scheduled = []
    schedule = engine.scheduler.schedule

    def counting():
        out = schedule()
        scheduled.extend(out.num_scheduled_tokens)
        return out

    engine.scheduler.schedule = counting
    prompt = prompts(5, [10])[0]
    out = run(engine, [Arrival(0, "m", prompt, greedy(5))])
    assert len(out["m"][0].token_ids) == 5
    assert scheduled == [10, 1, 1, 1, 1]  # the 5th token is never fed back


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_stats_count_the_steps_and_the_waits_for_their_tokens(loaded, async_scheduling):
    engine = make(loaded, async_scheduling=async_scheduling)
    before = engine.get_stats()
    run(engine, [Arrival(0, "m", prompts(6, [10])[0], greedy(5))])
    after = engine.get_stats()
    assert after.num_steps - before.num_steps == 5  # the prompt, then a token per step
    assert after.step_wait_seconds > before.step_wait_seconds
    assert after.device_wait_seconds == 0.0  # the CPU runs a step before its tokens are asked


def test_scheduler_places_tokens_in_flight_and_caches_blocks_once_known():
    """Two steps scheduled before the first one's token is back: the second decodes the
    placeholder. The block that placeholder completes is cached only when its token is
    known, with the hash of its real tokens."""
    manager = KVCacheManager(16, 4)
    scheduler = Scheduler(EngineConfig(block_size=4, max_num_seqs=8, max_num_batched_tokens=64),
                          manager, max_model_len=100)
    request = Request("r", [5, 6, 7], SamplingParams(max_tokens=8), 8)
    scheduler.add_request(request)
    first = scheduler.schedule()  # the prompt: samples token 3
    second = scheduler.schedule()  # decodes position 3 before token 3 is known
    assert (second.req_ids, second.num_scheduled_tokens) == (["r"], [1])
    assert second.num_computed_tokens == [3] and second.samples == [True]
    assert request.num_output_placeholders == 2 and request.num_computed_tokens == 4
    block = manager.req_to_blocks["r"][0]
    assert block.block_hash is None  # full of scheduled tokens, one of them unknown
    scheduler.update_from_output(first, ModelRunnerOutput(["r"], [9]))
    assert request.all_token_ids == [5, 6, 7, 9] and request.num_output_placeholders == 1
    assert block.block_hash is not None
    # a request with the same first four tokens finds it
    probe = Request("probe", [5, 6, 7, 9, 1], SamplingParams(max_tokens=8), 8)
    assert manager.get_computed_blocks(probe) == ([block], 4)
    scheduler.update_from_output(second, ModelRunnerOutput(["r"], [4]))
    assert request.output_token_ids == [9, 4] and request.num_output_placeholders == 0
    scheduler.finish_requests("r", request.status.FINISHED_ABORTED)
    assert manager.get_num_free_blocks() == 15


def test_cpu_defaults_async_off_and_batch_limits_logged(loaded, caplog):
    caplog.set_level(logging.INFO, logger="pagedserve.engine.core")
    engine = LLMEngine(EngineConfig(model="tiny", device="cpu", dtype="float32",
                                    kv_cache_memory=1 << 20), loaded)
    assert EngineConfig().async_scheduling is None and engine.async_scheduling is False
    assert EngineConfig().max_num_seqs is None and EngineConfig().max_num_batched_tokens is None
    assert (engine.config.max_num_seqs, engine.config.max_num_batched_tokens) == (64, 2048)
    assert engine.scheduler.max_num_seqs == 64
    # no decode graphs on the CPU: every step is eager, admissions are not held
    assert EngineConfig().admission_interval is None and engine.config.admission_interval == 1
    logged = [r.getMessage() for r in caplog.records if "batch limits" in r.getMessage()]
    assert len(logged) == 1 and "max_num_seqs=64, max_num_batched_tokens=2048" in logged[0]
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(async_scheduling="yes")


def test_an_output_read_early_is_the_result_and_places_no_token(loaded):
    """What a tensor-parallel rank 0 sends the engine before `result()` runs
    (`PendingRunnerOutput.output_if_ready`, `worker.py`): the same output, and no token is
    placed until `result()`."""
    engine = make(loaded, async_scheduling=False)
    core, runner = engine.engine_core, engine.engine_core.model_runner
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=4, logprobs=2)
    engine.add_request("r", None, params, prompt_token_ids=[5, 6, 7, 8])
    out = core.scheduler.schedule()
    pending = runner.sample_tokens(runner.launch(runner.prepare_step(out)))
    state = runner.requests["r"]
    before = list(state.output_token_ids)
    early = pending.output_if_ready()
    assert early is not None and early.req_ids == ["r"] and early.logprobs is not None
    assert state.output_token_ids == before  # nothing placed
    result = pending.result()
    assert result == early
    assert state.output_token_ids == [*before, result.sampled_token_ids[0]]
    core.scheduler.update_from_output(out, result)
    engine.abort_request(["r"])
    while engine.has_unfinished_requests():
        engine.step()


def test_batch_one_launches_each_step_before_reading_the_tokens_in_flight(loaded):
    """The pipelined order at batch 1 through the executor's two verbs: each decode step is
    launched (its host work, its input uploads and its forward pass queued) before the
    tokens of the step in flight are read, so on a GPU the new step waits in the device's
    queue while the host waits for those tokens. A loop that read them first would leave
    the device idle through the engine's whole turnaround every step (docs/benchmarks.md,
    "Is the batch-1 decode loop serialized?")."""
    engine = make(loaded, async_scheduling=True)
    executor = engine.engine_core.executor
    execute, sample = executor.execute_model, executor.sample_tokens
    events = []

    def execute_model(scheduler_output, previous=None):
        events.append(("launch", scheduler_output.num_computed_tokens[0]))
        return execute(scheduler_output, previous)

    def sample_tokens(step, grammar=None):
        pending, position = sample(step, grammar), events[-1][1]
        result = pending.result

        def read():
            events.append(("tokens", position))
            return result()

        pending.result = read
        return pending

    executor.execute_model, executor.sample_tokens = execute_model, sample_tokens
    out = run(engine, [Arrival(0, "b1", prompts(7, [10])[0], greedy(6))])
    assert len(out["b1"][0].token_ids) == 6
    # the prompt (from position 0), then a decode at each of positions 10-14
    assert events == [("launch", 0), ("launch", 10), ("tokens", 0), ("launch", 11),
                      ("tokens", 10), ("launch", 12), ("tokens", 11), ("launch", 13),
                      ("tokens", 12), ("launch", 14), ("tokens", 13), ("tokens", 14)]
