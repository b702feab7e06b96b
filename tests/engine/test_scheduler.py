"""Scheduler policy on a real KVCacheManager, no model: the runner is simulated by feeding
back one sampled token per request whose chunk reached the end of its tokens."""

from __future__ import annotations

from pagedserve.config import EngineConfig
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.engine.request import Request, RequestStatus
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.scheduler import Scheduler

BLOCK = 4


def make(num_blocks=64, **options) -> Scheduler:
    options = {"max_num_seqs": 64, "max_num_batched_tokens": 2048} | options
    config = EngineConfig(block_size=BLOCK, **options)
    return Scheduler(config, KVCacheManager(num_blocks, BLOCK), max_model_len=1000)


def request(i: int, prompt_len: int, max_tokens: int = 8, first_token: int = 0) -> Request:
    prompt = [first_token + i * 1000 + t for t in range(prompt_len)]
    return Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens), max_tokens)


def run_step(scheduler: Scheduler):
    out = scheduler.schedule()
    sampled = {r.request_id: 7 for (r, _), s in zip(out.scheduled, out.samples) if s}
    scheduler.update_from_output(out, sampled)
    return out


def test_budget_chunked_prefill_and_decodes_first():
    scheduler = make(max_num_batched_tokens=10)
    scheduler.add_request(request(0, 6))
    out = run_step(scheduler)
    assert [(r.request_id, n) for r, n in out.scheduled] == [("r0", 6)]
    scheduler.add_request(request(1, 20))
    out = run_step(scheduler)
    # r0 decodes (1 token, listed first), r1 gets the rest of the budget as a chunk
    assert [(r.request_id, n) for r, n in out.scheduled] == [("r0", 1), ("r1", 9)]
    assert out.num_decodes == 1
    out = run_step(scheduler)
    assert [(r.request_id, n) for r, n in out.scheduled] == [("r0", 1), ("r1", 9)]
    out = run_step(scheduler)
    assert [(r.request_id, n) for r, n in out.scheduled] == [("r0", 1), ("r1", 2)]
    assert scheduler.requests["r1"].num_output_tokens == 1  # sampled at the end of its prompt
    while scheduler.has_unfinished_requests():
        run_step(scheduler)
    assert scheduler.kv_cache_manager.get_num_free_blocks() == 63


def test_max_num_seqs_limits_admission():
    scheduler = make(max_num_seqs=2)
    for i in range(3):
        scheduler.add_request(request(i, 5))
    out = run_step(scheduler)
    assert [r.request_id for r, _ in out.scheduled] == ["r0", "r1"]
    assert [r.request_id for r in scheduler.waiting] == ["r2"]


def test_preempts_most_recent_by_recompute_and_requeues_at_front():
    # 9 usable blocks of 4 tokens: three 8-token prompts take 6, decoding needs more
    scheduler = make(num_blocks=10, max_num_batched_tokens=64)
    for i in range(3):
        scheduler.add_request(request(i, 8, max_tokens=12))
    run_step(scheduler)
    scheduler.add_request(request(3, 4))
    preempted = []
    for _ in range(40):
        if not scheduler.has_unfinished_requests():
            break
        out = run_step(scheduler)
        preempted += out.preempted
        if out.preempted:  # no admission in a step that preempted: victims wait in front
            assert list(scheduler.waiting)[:len(out.preempted)] == out.preempted[::-1]
            assert all(v.num_computed_tokens == 0 and v.status == RequestStatus.PREEMPTED
                       for v in out.preempted)
    assert preempted and preempted[0].request_id == "r2"  # the latest admitted of the three
    assert scheduler.num_preemptions == len(preempted)
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache_manager.get_num_free_blocks() == 9


def test_finish_requests_frees_waiting_and_running():
    scheduler = make(max_num_seqs=1)
    scheduler.add_request(request(0, 6))
    scheduler.add_request(request(1, 6))
    run_step(scheduler)
    scheduler.finish_requests(["r0", "r1"], RequestStatus.FINISHED_ABORTED)
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache_manager.get_num_free_blocks() == 63
