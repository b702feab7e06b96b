"""Scheduler policy on a real KVCacheManager, no model: the runner is simulated by feeding
back one sampled token per request whose chunk reached the end of its tokens, and by keeping
block-table rows from the step messages alone (after a msgpack round trip), which must match
the manager's blocks for every scheduled request at every step."""

from __future__ import annotations

from pagedserve.config import EngineConfig
from pagedserve.device.input_batch import BlockTableRows
from pagedserve.engine.request import Request, RequestStatus
from pagedserve.engine.scheduler import Scheduler
from pagedserve.kv_cache.kv_cache_manager import KVCacheManager
from pagedserve.messages import ModelRunnerOutput, SchedulerOutput, decode, encode
from pagedserve.sampling_params import SamplingParams

BLOCK = 4
_ROWS: dict[int, BlockTableRows] = {}  # id(scheduler) -> the simulated runner's rows


def make(num_blocks=64, window=None, **options) -> Scheduler:
    options = {"max_num_seqs": 64, "max_num_batched_tokens": 2048} | options
    config = EngineConfig(block_size=BLOCK, **options)
    manager = KVCacheManager(num_blocks, BLOCK, sliding_window=window)
    scheduler = Scheduler(config, manager, max_model_len=1000)
    _ROWS[id(scheduler)] = BlockTableRows(max_blocks_per_seq=1000 // BLOCK, capacity=4)
    return scheduler


def request(i: int, prompt_len: int, max_tokens: int = 8, first_token: int = 0) -> Request:
    prompt = [first_token + i * 1000 + t for t in range(prompt_len)]
    return Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens), max_tokens)


def apply_blocks(rows: BlockTableRows, out: SchedulerOutput) -> None:
    """What the runner does with a step's block news."""
    rows.release(out.finished_req_ids)
    rows.release(out.preempted_req_ids)
    for new in out.scheduled_new_reqs:
        rows.add(new.req_id, new.block_ids)
    cached = out.scheduled_cached_reqs
    for req_id, resumed, block_ids, num_nulled in zip(
            cached.req_ids, cached.resumed, cached.new_block_ids, cached.num_nulled_blocks):
        if resumed:
            rows.add(req_id, block_ids)
        else:
            rows.append(req_id, block_ids, num_nulled)


def run_step(scheduler: Scheduler):
    out = scheduler.schedule()
    received = decode(encode(out), SchedulerOutput)
    assert received == out
    rows = _ROWS[id(scheduler)]
    apply_blocks(rows, received)
    for req_id, row in zip(out.req_ids, rows.rows(out.req_ids).tolist()):
        block_ids = scheduler.kv_cache_manager.get_block_ids(req_id)
        assert rows.table[row, :len(block_ids) + 1].tolist() == block_ids + [0]
    sampled = [r for r, s in zip(out.req_ids, out.samples) if s]
    scheduler.update_from_output(out, ModelRunnerOutput(sampled, [7] * len(sampled)))
    return out


def batch(out) -> list[tuple[str, int]]:
    return list(zip(out.req_ids, out.num_scheduled_tokens))


def test_budget_chunked_prefill_and_decodes_first():
    scheduler = make(max_num_batched_tokens=10)
    scheduler.add_request(request(0, 6))
    out = run_step(scheduler)
    assert batch(out) == [("r0", 6)]
    scheduler.add_request(request(1, 20))
    out = run_step(scheduler)
    # r0 decodes (1 token, listed first), r1 gets the rest of the budget as a chunk
    assert batch(out) == [("r0", 1), ("r1", 9)]
    assert out.num_decodes == 1
    out = run_step(scheduler)
    assert batch(out) == [("r0", 1), ("r1", 9)]
    out = run_step(scheduler)
    assert batch(out) == [("r0", 1), ("r1", 2)]
    assert scheduler.requests["r1"].num_output_tokens == 1  # sampled at the end of its prompt
    while scheduler.has_unfinished_requests():
        run_step(scheduler)
    assert scheduler.kv_cache_manager.get_num_free_blocks() == 63


def test_max_num_seqs_limits_admission():
    scheduler = make(max_num_seqs=2)
    for i in range(3):
        scheduler.add_request(request(i, 5))
    out = run_step(scheduler)
    assert out.req_ids == ["r0", "r1"]
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
        victims = [scheduler.requests[r] for r in out.preempted_req_ids]
        preempted += out.preempted_req_ids
        if victims:  # no admission in a step that preempted: victims wait in front
            assert list(scheduler.waiting)[:len(victims)] == victims[::-1]
            assert all(v.num_computed_tokens == 0 and v.status == RequestStatus.PREEMPTED
                       for v in victims)
    assert preempted and preempted[0] == "r2"  # the latest admitted of the three
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


def test_messages_carry_only_new_blocks_and_the_resumed_flag():
    scheduler = make(num_blocks=10, max_num_batched_tokens=64)
    scheduler.add_request(request(0, 6))
    out = run_step(scheduler)
    assert [(n.req_id, n.block_ids, n.num_computed_tokens) for n in out.scheduled_new_reqs] \
        == [("r0", scheduler.kv_cache_manager.get_block_ids("r0"), 0)]
    assert len(out.scheduled_new_reqs[0].block_ids) == 2 and out.samples == [True]
    # positions 6 and 7 fit the second block: nothing new for the runner but the batch
    for _ in range(2):
        out = run_step(scheduler)
        assert out.req_ids == ["r0"] and not out.scheduled_cached_reqs.req_ids
        assert not out.scheduled_new_reqs
    out = run_step(scheduler)  # position 8 starts a third block
    cached = out.scheduled_cached_reqs
    assert (cached.req_ids, cached.resumed) == (["r0"], [False])
    assert cached.new_block_ids == [scheduler.kv_cache_manager.get_block_ids("r0")[2:]]
    assert out.num_computed_tokens == [8] and out.num_scheduled_tokens == [1]


def test_a_request_resumed_after_preemption_is_not_new_again():
    scheduler = make(num_blocks=10, max_num_batched_tokens=64)
    for i in range(3):
        scheduler.add_request(request(i, 8, max_tokens=12))
    new_ids, resumed_ids, preempted_ids = [], [], []
    while scheduler.has_unfinished_requests():
        out = run_step(scheduler)
        new_ids += [n.req_id for n in out.scheduled_new_reqs]
        cached = out.scheduled_cached_reqs
        resumed_ids += [r for r, resumed in zip(cached.req_ids, cached.resumed) if resumed]
        preempted_ids += out.preempted_req_ids
    assert sorted(new_ids) == ["r0", "r1", "r2"]
    assert preempted_ids and sorted(resumed_ids) == sorted(preempted_ids)


def test_blocks_nulled_out_of_a_sliding_window_reach_the_runner():
    scheduler = make(window=6)
    scheduler.add_request(request(0, 6, max_tokens=30))
    nulled = []
    while scheduler.has_unfinished_requests():
        out = run_step(scheduler)  # checks the runner's row against the manager's blocks
        nulled += out.scheduled_cached_reqs.num_nulled_blocks
    assert max(nulled) >= 5  # 36 tokens, a 6-token window: the early blocks went back


def ranked(i: int, priority: int, prompt_len: int = 5, max_tokens: int = 2) -> Request:
    """A request of the given priority that arrived at time i (so arrival order = i)."""
    prompt = [i * 1000 + t for t in range(prompt_len)]
    return Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, priority=priority),
                   max_tokens, arrival_time=float(i))


def admission_order(scheduler: Scheduler) -> list[str]:
    """Run to the end; the ids in the order the scheduler first admitted them."""
    order = []
    while scheduler.has_unfinished_requests():
        order += [new.req_id for new in run_step(scheduler).scheduled_new_reqs]
    return order


def test_priority_policy_admits_lower_priority_values_first_fcfs_within():
    priorities = {1: 5, 2: 1, 3: 1, 4: 0, 5: 5}
    orders = {}
    for policy in ("fcfs", "priority"):
        scheduler = make(max_num_seqs=1, scheduling_policy=policy)
        scheduler.add_request(ranked(0, 9))  # admitted at once: nothing else is waiting
        run_step(scheduler)
        for i, priority in priorities.items():
            scheduler.add_request(ranked(i, priority))
        orders[policy] = admission_order(scheduler)
    assert orders["fcfs"] == ["r1", "r2", "r3", "r4", "r5"]
    assert orders["priority"] == ["r4", "r2", "r3", "r1", "r5"]


def test_a_running_request_is_not_displaced_by_a_higher_priority_arrival():
    scheduler = make(max_num_seqs=1, scheduling_policy="priority")
    scheduler.add_request(ranked(0, 9, max_tokens=6))
    run_step(scheduler)
    scheduler.add_request(ranked(1, 0))
    steps = 0
    while "r0" in scheduler.requests:  # until it has run to its end
        out = run_step(scheduler)
        assert out.req_ids == ["r0"] and not out.preempted_req_ids
        steps += 1
    assert steps == 5  # its 6 tokens: 1 with the prompt, 5 decodes, none skipped
    assert admission_order(scheduler) == ["r1"]


def test_a_full_kv_cache_preempts_the_lowest_priority_not_the_latest_admitted():
    # 9 usable blocks of 4 tokens: three 8-token prompts take 6, decoding needs more.
    # Under fcfs the latest admitted (r2) goes first; by priority r0, the lowest (9).
    victims = {}
    for policy in ("fcfs", "priority"):
        scheduler = make(num_blocks=10, max_num_batched_tokens=64, scheduling_policy=policy)
        for i, priority in enumerate((9, 0, 1)):
            scheduler.add_request(ranked(i, priority, prompt_len=8, max_tokens=12))
        preempted = []
        while scheduler.has_unfinished_requests():
            preempted += run_step(scheduler).preempted_req_ids
        victims[policy] = preempted[0]
        assert scheduler.kv_cache_manager.get_num_free_blocks() == 9
    assert victims == {"fcfs": "r2", "priority": "r0"}


def test_a_request_waiting_for_its_grammar_is_passed_over_and_keeps_its_place():
    """Under either policy: the requests behind it are admitted meanwhile; once its grammar
    is ready it goes before the ones that arrived after it and still wait."""
    for policy in ("fcfs", "priority"):
        scheduler = make(max_num_seqs=2, scheduling_policy=policy)
        waiting = request(0, 6)
        waiting.status = RequestStatus.WAITING_FOR_GRAMMAR
        for r in (waiting, request(1, 6), request(2, 6), request(3, 6)):
            scheduler.add_request(r)
        out = run_step(scheduler)
        assert out.req_ids == ["r1", "r2"], policy
        assert [r.request_id for r in scheduler.waiting] == ["r0", "r3"]
        scheduler.grammars_ready(["r0", "unknown"])
        assert waiting.status == RequestStatus.WAITING
        scheduler.finish_requests(["r1"], RequestStatus.FINISHED_ABORTED)
        out = run_step(scheduler)
        assert [new.req_id for new in out.scheduled_new_reqs] == ["r0"], policy
        scheduler.finish_requests(["r0", "r2", "r3"], RequestStatus.FINISHED_ERROR)
        assert not scheduler.has_unfinished_requests()
        assert scheduler.kv_cache_manager.get_num_free_blocks() == 63


def admissions(admission_interval, max_tokens, steps=6, slots=3) -> list[list[str]]:
    """The requests each step admits, every prompt of 4 tokens."""
    scheduler = make(max_num_seqs=slots, admission_interval=admission_interval)
    for i, tokens in enumerate(max_tokens):
        scheduler.add_request(request(i, 4, tokens))
    return [[new.req_id for new in run_step(scheduler).scheduled_new_reqs]
            for _ in range(steps)]


def test_admission_interval_fills_a_full_batchs_freed_slots_in_one_step():
    # r0 finishes after step 1, r1 after step 2; r3, r4, r5 wait for their slots
    lengths = (2, 3, 20, 20, 20, 20)
    # every step: each freed slot filled at once, one prefill step per slot
    assert admissions(None, lengths) == [["r0", "r1", "r2"], [], ["r3"], ["r4"], [], []]
    # held while the batch decodes (3 steps after the last look): both slots in one step
    assert admissions(4, lengths) == [["r0", "r1", "r2"], [], [], [], ["r3", "r4"], []]


def test_admission_interval_admits_at_once_when_every_waiting_request_fits():
    # one request waits and r0's slot frees: nothing to coalesce, no wait
    assert admissions(4, (2, 20, 20, 20)) == [["r0", "r1", "r2"], [], ["r3"], [], [], []]


def test_admission_interval_holds_only_a_few_free_slots():
    # 4 slots, interval 3: three slots free at once are filled at once, two are held
    assert admissions(3, (2, 2, 2, 20, 20, 20, 20, 20), slots=4) == [
        ["r0", "r1", "r2", "r3"], [], ["r4", "r5", "r6"], [], [], []]
    assert admissions(3, (2, 2, 20, 20, 20, 20, 20, 20), slots=4) == [
        ["r0", "r1", "r2", "r3"], [], [], ["r4", "r5"], [], []]


def test_pipelined_decodes_cache_each_block_once_its_tokens_are_known():
    """Async scheduling: each step is scheduled before the previous one's tokens are back,
    so a decode that completes a block does so with its token in flight (the scheduler
    then leaves the manager alone for it). After every step's tokens arrive, every block
    holding only known, scheduled tokens is cached, and the runner's rows from the
    messages match the manager's blocks."""
    scheduler = make()
    for i in range(3):
        scheduler.add_request(request(i, 5 + 2 * i, max_tokens=13))
    rows, manager = _ROWS[id(scheduler)], scheduler.kv_cache_manager
    in_flight, steps = None, 0
    while True:
        out = scheduler.schedule()
        apply_blocks(rows, decode(encode(out), SchedulerOutput))
        for req_id, row in zip(out.req_ids, rows.rows(out.req_ids).tolist()):
            block_ids = manager.get_block_ids(req_id)
            assert rows.table[row, :len(block_ids) + 1].tolist() == block_ids + [0]
        if in_flight is not None:
            sampled = [r for r, s in zip(in_flight.req_ids, in_flight.samples) if s]
            scheduler.update_from_output(in_flight, ModelRunnerOutput(
                sampled, [100 + steps] * len(sampled)))
        for r in scheduler.running:
            full = min(r.num_computed_tokens, len(r.all_token_ids)) // BLOCK
            assert all(b.block_hash is not None for b in manager.req_to_blocks[r.request_id][:full])
        in_flight = out if out.req_ids else None
        steps += 1
        if in_flight is None and not scheduler.has_unfinished_requests():
            break
    assert steps > 13 and manager.get_num_free_blocks() == 63
