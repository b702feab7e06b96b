"""Random allocate / prefill / decode / free / preempt / reset sequences against a simulated KV.

Besides the pool invariants after every step, each request's context is read back through
its block table from a fake KV store in which every written slot records what produced it
(salt, adapter, whole token prefix). A prefix hit that served KV computed under another
prefix, tenant or adapter, or a block reused while still referenced, shows up as a mismatch.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedserve.kv_cache.kv_cache_manager import KVCacheManager

from .conftest import FakeRequest, check_manager_invariants, free_order, slot_mapping

PREFIXES = [[], [1, 2, 3, 4, 5], [1, 2, 3, 4, 6, 7, 8], [2, 2, 2, 2, 2, 2, 2, 2, 2]]
MAX_LEN = 28


class ManagerMachine(RuleBasedStateMachine):
    @initialize(block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(3, 24),
                hash_algo=st.sampled_from(["sha256", "xxhash"]))
    def setup(self, block_size: int, num_blocks: int, hash_algo: str) -> None:
        self.mgr = KVCacheManager(num_blocks, block_size, hash_algo=hash_algo)
        self.kv: dict[int, tuple] = {}
        self.running: list[FakeRequest] = []
        self.waiting: list[FakeRequest] = []
        self.next_id = 0

    # --- helpers -------------------------------------------------------------------------
    @staticmethod
    def label(req: FakeRequest, pos: int) -> tuple:
        return (req.cache_salt, tuple(req.all_token_ids[:pos + 1]))

    def check_context(self, req: FakeRequest, upto: int) -> None:
        for pos, slot in enumerate(slot_mapping(self.mgr, req.request_id, 0, upto)):
            assert self.kv.get(slot) == self.label(req, pos), f"wrong KV at {req}, pos {pos}"

    def pool_snapshot(self) -> tuple:
        pool = self.mgr.block_pool
        return ([(b.ref_cnt, b.block_hash) for b in pool.blocks],
                [b.block_id for b in free_order(pool.free_block_queue)],
                dict(pool.cached_block_hash_to_block), dict(self.mgr.req_to_blocks))

    def schedule(self, req: FakeRequest, num_new: int, hit=None, num_hit: int = 0) -> bool:
        """allocate_slots, then 'run the model': write KV for the new tokens."""
        before = self.pool_snapshot()
        new = self.mgr.allocate_slots(req, num_new, hit, num_hit)
        if new is None:
            assert self.pool_snapshot() == before, "allocate_slots failed with side effects"
            return False
        start = req.num_computed_tokens + num_hit
        for pos, slot in zip(range(start, start + num_new),
                             slot_mapping(self.mgr, req.request_id, start, start + num_new)):
            self.kv[slot] = self.label(req, pos)
        req.num_computed_tokens = start + num_new
        self.check_context(req, req.num_computed_tokens)
        return True

    def admit(self, req: FakeRequest, chunk: int) -> None:
        hit, num_hit = self.mgr.get_computed_blocks(req)
        assert num_hit < req.num_tokens and num_hit % self.mgr.block_size == 0
        for i, block in enumerate(hit):  # a hit must hold exactly this request's prefix
            for off in range(self.mgr.block_size):
                pos = i * self.mgr.block_size + off
                slot = block.block_id * self.mgr.block_size + off
                assert self.kv.get(slot) == self.label(req, pos)
        if self.schedule(req, min(chunk, req.num_tokens - num_hit), hit, num_hit):
            self.running.append(req)
        else:
            self.mgr.free(req)
            self.waiting.append(req)

    # --- rules ---------------------------------------------------------------------------
    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(0, 2), max_size=8),
          salt=st.sampled_from([None, None, "t1"]), chunk=st.integers(1, 12))
    def add(self, prefix, tail, salt, chunk) -> None:
        tokens = (prefix + tail) or [0]
        req = FakeRequest(f"r{self.next_id}", tokens, cache_salt=salt)
        self.next_id += 1
        self.admit(req, chunk)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), chunk=st.integers(1, 12))
    def resume(self, data, chunk) -> None:
        req = self.waiting.pop(data.draw(st.integers(0, len(self.waiting) - 1)))
        self.admit(req, chunk)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), chunk=st.integers(1, 6), token=st.integers(0, 2))
    def step(self, data, chunk, token) -> None:
        req = self.running[data.draw(st.integers(0, len(self.running) - 1))]
        remaining = req.num_tokens - req.num_computed_tokens
        if remaining == 0:
            if req.num_tokens >= MAX_LEN:
                self.running.remove(req)
                self.mgr.free(req)
                return
            req.all_token_ids.append(token)  # sampled last step, KV written this step
            remaining = 1
        if not self.schedule(req, min(chunk, remaining)):
            self.running.remove(req)  # preempt: drop all blocks, recompute later
            self.mgr.free(req)
            req.num_computed_tokens = 0
            self.waiting.append(req)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data) -> None:
        req = self.running.pop(data.draw(st.integers(0, len(self.running) - 1)))
        self.mgr.free(req)
        self.mgr.free(req)  # idempotent

    @rule()
    def reset(self) -> None:
        ok = self.mgr.reset_prefix_cache()
        assert ok == (not self.running)
        if ok:
            assert self.mgr.block_pool.cached_block_hash_to_block == {}

    # --- invariants ----------------------------------------------------------------------
    @invariant()
    def pool_is_consistent(self) -> None:
        check_manager_invariants(self.mgr)
        assert set(self.mgr.req_to_blocks) == {r.request_id for r in self.running}
        for req in self.running:
            needed = -(-req.num_computed_tokens // self.mgr.block_size)
            assert len(self.mgr.get_block_ids(req.request_id)) == needed

    def teardown(self) -> None:
        for req in self.running:
            self.mgr.free(req)
        assert self.mgr.get_num_free_blocks() == self.mgr.block_pool.num_blocks - 1
        assert self.mgr.usage == 0.0
        check_manager_invariants(self.mgr)


ManagerMachine.TestCase.settings = settings(
    max_examples=80, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestManagerStateMachine = ManagerMachine.TestCase
