"""The scheduler with a host tier (and a disk tier below it), against a simulated runner
whose KV slots record what produced them (the token prefix and the salt): random arrivals,
follow-up turns of finished conversations, aborts, damaged disk files and steps on a small
device pool (so evictions, preemptions, spills, loads and recalls happen), under recall
rules that recall every hit or decline some (recomputed instead). After every step
each scheduled request's context, read back through its block table, must be its own (a
recall that copied the wrong slot, an offload or load that overwrote a slot being read, or a
damaged file's content taken for KV shows up as a mismatch), and the pool's and tiers'
invariants hold."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedserve.config import EngineConfig
from pagedserve.kv_cache.host_tier import HostTier
from pagedserve.kv_cache.kv_cache_manager import KVCacheManager
from pagedserve.messages import ModelRunnerOutput, SchedulerOutput, TierCosts, decode, encode
from pagedserve.engine.recall_rule import RecallRule
from pagedserve.engine.request import Request, RequestStatus
from pagedserve.sampling_params import SamplingParams
from pagedserve.engine.scheduler import Scheduler
from tests.kv_cache.conftest import check_manager_invariants

SYSTEMS = [[], [1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 9, 9, 9, 9]]
MAX_LEN = 64
# the recall rule's costs (engine/recall_rule.py), per block of `bs` tokens: every hit
# recalled; hits of up to 1 or 2 blocks (a block copies in two blocks' prefill, a step
# hides 1.5 or 2.5 of them); hits deep in a prompt only (a block's recompute grows with
# its position past its copy's)
RULES = {"all": None,
         "up to 1 block": lambda bs: TierCosts(2.0, 1.0 / bs, 0.0, 1.5, 1, bs),
         "up to 2 blocks": lambda bs: TierCosts(2.0, 1.0 / bs, 0.0, 2.5, 1, bs),
         "deep only": lambda bs: TierCosts(1.0, 0.5 / bs, 0.02 / bs**2, 0.0, 1, bs)}


class TierMachine(RuleBasedStateMachine):
    @initialize(block_size=st.sampled_from([2, 4]), num_blocks=st.integers(6, 16),
                num_slots=st.integers(1, 8), budget=st.sampled_from([8, 64]),
                disk_slots=st.sampled_from([0, 6, 40]), rule=st.sampled_from(sorted(RULES)))
    def setup(self, block_size: int, num_blocks: int, num_slots: int, budget: int,
              disk_slots: int, rule: str) -> None:
        self.manager = KVCacheManager(num_blocks, block_size, record_evictions=True)
        if disk_slots:  # small steps, so that blocks pass through a small host tier
            budget = 8
        config = EngineConfig(block_size=block_size, max_num_seqs=4,
                              max_num_batched_tokens=budget)
        self.tier = HostTier(num_slots)
        self.disk_tier = HostTier(disk_slots, medium="DISK") if disk_slots else None
        costs = RULES[rule]
        self.scheduler = Scheduler(
            config, self.manager, MAX_LEN, host_tier=self.tier, disk_tier=self.disk_tier,
            recall_rule=costs and RecallRule(costs(block_size), block_size, MAX_LEN))
        self.block_size = block_size
        self.device: dict[int, tuple] = {}  # slot (block id * block size + offset) -> label
        self.host: dict[int, tuple] = {}  # host slot * block size + offset -> label
        self.disk: dict[int, tuple] = {}  # disk slot * block size + offset -> label
        self.damaged: set[int] = set()  # disk slots whose file no longer reads back whole
        self.finished: list[Request] = []
        self.next_id = 0

    def label(self, request: Request, pos: int) -> tuple:
        return (request.cache_salt, tuple(request.all_token_ids[:pos + 1]))

    def add(self, prompt: list[int], salt: str | None, max_tokens: int) -> None:
        max_tokens = max(1, min(max_tokens, MAX_LEN - len(prompt)))
        request = Request(f"r{self.next_id}", prompt, SamplingParams(max_tokens=max_tokens),
                          max_tokens, cache_salt=salt)
        self.next_id += 1
        self.scheduler.add_request(request)

    @rule(system=st.sampled_from(SYSTEMS), tail=st.lists(st.integers(0, 3), max_size=12),
          salt=st.sampled_from([None, "a"]), max_tokens=st.integers(1, 6))
    def arrive(self, system, tail, salt, max_tokens) -> None:
        prompt = system + tail
        if prompt and len(prompt) < MAX_LEN:
            self.add(prompt, salt, max_tokens)

    @precondition(lambda self: self.finished)
    @rule(data=st.data(), more=st.lists(st.integers(0, 3), min_size=1, max_size=6),
          max_tokens=st.integers(1, 6))
    def follow_up(self, data, more, max_tokens) -> None:
        """The next turn of a finished conversation: its whole text, then more."""
        earlier = data.draw(st.sampled_from(self.finished))
        prompt = earlier.all_token_ids + more
        if len(prompt) < MAX_LEN:
            self.add(prompt, earlier.cache_salt, max_tokens)

    @precondition(lambda self: self.finished)
    @rule(data=st.data(), max_tokens=st.integers(1, 6))
    def again(self, data, max_tokens) -> None:
        """A finished prompt asked again, after whatever pushed it down the tiers."""
        earlier = data.draw(st.sampled_from(self.finished))
        self.add(list(earlier.prompt_token_ids), earlier.cache_salt, max_tokens)

    @precondition(lambda self: self.scheduler.requests)
    @rule(data=st.data())
    def abort(self, data) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.scheduler.requests)))
        self.scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)

    @precondition(lambda self: self.disk)
    @rule(data=st.data())
    def damage_a_file(self, data) -> None:
        self.damaged.add(data.draw(st.sampled_from(sorted(self.disk))) // self.block_size)

    @precondition(lambda self: self.scheduler.has_unfinished_requests())
    @rule()
    def step(self) -> None:
        out = decode(encode(self.scheduler.schedule()), SchedulerOutput)
        failed = self.copy(out)
        chunks = [(self.scheduler.requests[req_id], computed, computed + num_new)
                  for req_id, computed, num_new in zip(out.req_ids, out.num_computed_tokens,
                                                       out.num_scheduled_tokens)]
        for request, start, end in chunks:  # the forward pass writes every chunk ...
            slots = self.slots(request.request_id, start, end)
            for pos, slot in zip(range(start, end), slots):
                self.device[slot] = self.label(request, pos)
        for request, _, end in chunks:  # ... then attends to each context
            for pos, slot in enumerate(self.slots(request.request_id, 0, end)):
                assert self.device.get(slot) == self.label(request, pos), \
                    f"wrong KV for {request.request_id} at {pos}"
        sampled = [r for r, s in zip(out.req_ids, out.samples) if s]
        requests = [self.scheduler.requests[r] for r in sampled]
        tokens = [len(r.all_token_ids) % 4 for r in requests]
        self.scheduler.update_from_output(out, ModelRunnerOutput(sampled, tokens,
                                                                 failed_loads=failed))
        self.finished += [r for r in requests if r.is_finished and r.num_output_tokens]

    def copy(self, out: SchedulerOutput) -> list[int]:
        """The runner's block copies, in its order: spills, offloads, loads, and recalls,
        which read their host slots now and land before this step's forward pass reads
        them (each layer's part before that layer's attention); the loads whose file was
        damaged (they leave garbage in their host slot)."""
        bs = self.block_size
        for slot, disk_slot, _ in out.blocks_to_spill:
            self.damaged.discard(disk_slot)  # the file is written anew
            for o in range(bs):
                self.disk[disk_slot * bs + o] = self.host.get(slot * bs + o)
        for block_id, slot in out.blocks_to_offload:
            for o in range(bs):
                self.host[slot * bs + o] = self.device.get(block_id * bs + o)
        failed = []
        for i, (disk_slot, slot, _) in enumerate(out.blocks_to_load):
            if disk_slot in self.damaged:
                failed.append(i)
            for o in range(bs):
                self.host[slot * bs + o] = (("garbage",) if disk_slot in self.damaged
                                            else self.disk.get(disk_slot * bs + o))
        for slot, block_id in out.blocks_to_recall:
            for o in range(bs):
                self.device[block_id * bs + o] = self.host.get(slot * bs + o)
        return failed

    def slots(self, req_id: str, start: int, end: int) -> list[int]:
        block_ids = self.manager.get_block_ids(req_id)
        bs = self.block_size
        return [block_ids[p // bs] * bs + p % bs for p in range(start, end)]

    @invariant()
    def pool_and_tier_hold(self) -> None:
        if not hasattr(self, "manager"):
            return
        check_manager_invariants(self.manager)
        assert len(self.tier) <= self.tier.num_slots
        if self.disk_tier is not None:
            assert len(self.disk_tier) <= self.disk_tier.num_slots
        for block_hash, block in self.manager.block_pool.cached_block_hash_to_block.items():
            assert block.block_hash == block_hash


TierMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=60, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestTierStateMachine = TierMachine.TestCase


def test_a_full_tier_of_pinned_slots_stores_nothing_and_recall_pins_last_one_step():
    tier = HostTier(2)
    assert tier.store(b"a") is not None and tier.store(b"b") is not None
    assert tier.lookup([b"a", b"b", b"c"]) == tier.lookup([b"a", b"b"])
    assert tier.store(b"c") is None  # both slots are being recalled this step
    tier.end_step()
    slot_c = tier.store(b"c")
    assert slot_c is not None and b"a" not in tier and b"b" in tier
    assert tier.stats.evictions == 1 and tier.stats.stores == 3


def run_to_end(scheduler: Scheduler, request: Request, failing: bool = False) -> list:
    """Step `request` to its end (one token); every load fails when `failing`. The steps'
    outputs, in order."""
    scheduler.add_request(request)
    outs = []
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        outs.append(out)
        sampled = [r for r, s in zip(out.req_ids, out.samples) if s]
        failed = list(range(len(out.blocks_to_load))) if failing else []
        scheduler.update_from_output(out, ModelRunnerOutput(sampled, [1] * len(sampled),
                                                            failed_loads=failed))
    return outs


@pytest.mark.parametrize("failing", [False, True])
def test_a_request_waits_one_step_for_its_loads_and_a_failed_one_is_prefilled(failing):
    """A prompt pushed down to disk is loaded (the request is not scheduled in that step),
    then recalled and prefilled past the recalled blocks in one step (the recall lands
    layer by layer in it); when its files fail, it is admitted at once with the chain as
    far as the host tier held it (prefilled from there) and the disk tier forgets the
    blocks (no second load of them)."""
    config = EngineConfig(block_size=2, max_num_seqs=4, max_num_batched_tokens=64)
    manager = KVCacheManager(8, 2, record_evictions=True)
    host, disk = HostTier(6), HostTier(40, medium="DISK")
    scheduler = Scheduler(config, manager, MAX_LEN, host_tier=host, disk_tier=disk)
    params = SamplingParams(max_tokens=1)
    for i, start in enumerate((0, 100, 200)):  # the first prompt, then two that push it down
        run_to_end(scheduler, Request(f"r{i}", list(range(start, start + 10)), params, 1))
    again = Request("again", list(range(10)), params, 1)
    outs = run_to_end(scheduler, again, failing)
    loading, admitted = outs[0], outs[1]
    assert loading.blocks_to_load and "again" not in loading.req_ids
    assert "again" in admitted.req_ids and len(outs) == 2
    [chunk] = [n for r, n in zip(admitted.req_ids, admitted.num_scheduled_tokens) if r == "again"]
    assert chunk == 10 - again.num_cached_tokens  # the tokens past the recalled blocks
    if failing:
        assert again.num_cached_tokens == 2 * len(admitted.blocks_to_recall) < 8
        assert not run_to_end(scheduler, Request("third", list(range(10)), params, 1))[0] \
            .blocks_to_load
    else:
        assert len(admitted.blocks_to_recall) == 4 and again.num_cached_tokens == 8


def test_a_request_whose_hit_is_landing_is_passed_over_one_step_and_counted():
    """Two requests for a prompt pushed down to the host tier: the first is admitted with
    its recall, the second's device hit is those very blocks, still landing, so it keeps
    its place for one step (counted as a pass-over) and then hits on the device, with no
    second recall."""
    config = EngineConfig(block_size=2, max_num_seqs=4, max_num_batched_tokens=64)
    manager = KVCacheManager(8, 2, record_evictions=True)
    scheduler = Scheduler(config, manager, MAX_LEN, host_tier=HostTier(16))
    params = SamplingParams(max_tokens=1)
    for i, start in enumerate((0, 100)):  # the prompt, then one that pushes it down
        run_to_end(scheduler, Request(f"r{i}", list(range(start, start + 10)), params, 1))
    first, second = (Request(name, list(range(10)), params, 1) for name in ("a", "b"))
    scheduler.add_request(first)
    scheduler.add_request(second)
    recalling = scheduler.schedule()
    admitted = [new.req_id for new in recalling.scheduled_new_reqs]
    assert admitted == ["a"] and recalling.blocks_to_recall
    assert scheduler.num_recall_pass_overs == 1
    assert recalling.req_ids == ["a"]  # computed in the step its recall lands in
    scheduler.update_from_output(recalling, ModelRunnerOutput(["a"], [1]))
    landed = scheduler.schedule()
    assert [new.req_id for new in landed.scheduled_new_reqs] == ["b"]
    assert not landed.blocks_to_recall and second.num_cached_tokens == 8
    assert scheduler.num_recall_pass_overs == 1
