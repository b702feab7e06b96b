"""Sliding-window freeing in the KV cache manager: blocks wholly before a request's window go
back to the pool as the request advances, their table entries become the null block, every
pool invariant holds, and prefix caching still finds (and shares only the in-window part of)
a freed prefix."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize

from pagedserve.kv_cache.kv_cache_manager import KVCacheManager

from .conftest import FakeRequest, check_manager_invariants, slot_mapping
from .test_stateful import ManagerMachine

BS = 4


def run(mgr: KVCacheManager, req: FakeRequest, chunk: int, hit=None, num_hit: int = 0):
    new = mgr.allocate_slots(req, chunk, hit, num_hit)
    assert new is not None
    req.num_computed_tokens += num_hit + chunk
    check_manager_invariants(mgr)
    return new


def test_blocks_behind_the_window_are_freed_and_nulled():
    mgr = KVCacheManager(32, BS, sliding_window=6)
    req = FakeRequest("a", list(range(40)))
    run(mgr, req, 10)  # positions 0..9; the first new token (0) sees from 0: nothing freed
    assert 0 not in mgr.get_block_ids("a")
    for _ in range(20):  # decodes 10..29
        run(mgr, req, 1)
        pos = req.num_computed_tokens - 1  # the token just scheduled saw pos - 5 .. pos
        ids = mgr.get_block_ids("a")
        first_kept = max(0, pos - 6 + 1) // BS
        assert ids[:first_kept] == [0] * first_kept
        assert 0 not in ids[first_kept:]
    # 30 tokens in blocks of 4 with a window of 6: at most 3 blocks held
    assert sum(i != 0 for i in mgr.get_block_ids("a")) <= 3
    assert mgr.get_num_free_blocks() == 31 - sum(i != 0 for i in mgr.get_block_ids("a"))
    mgr.free(req)
    check_manager_invariants(mgr)
    assert mgr.get_num_free_blocks() == 31


def test_freed_blocks_stay_cached_and_a_hit_takes_only_the_window():
    mgr = KVCacheManager(32, BS, sliding_window=5)
    prompt = list(range(100, 124))  # 6 full blocks
    a = FakeRequest("a", list(prompt))
    run(mgr, a, 24)
    a.all_token_ids.append(7)
    run(mgr, a, 1)  # the decode at 24 sees 20..24: blocks 0..4 are freed
    freed = [b for b in mgr.block_pool.blocks if b.ref_cnt == 0 and b.block_hash is not None]
    assert len(freed) == 5  # cached-free, still in the index (I4)
    b = FakeRequest("b", prompt + [1, 2])
    hit, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 24  # the whole chain is still cached
    run(mgr, b, 2, hit, num_hit)
    ids = mgr.get_block_ids("b")
    # b's first new token (24) sees 20..24: hit blocks 0..4 are nulled, block 5 is shared
    assert ids[:5] == [0] * 5 and ids[5] == hit[5].block_id
    assert hit[5].ref_cnt == 2 and all(blk.ref_cnt == 0 for blk in hit[:5])
    for r in (a, b):
        mgr.free(r)
    check_manager_invariants(mgr)


def test_freed_blocks_are_evicted_deepest_first():
    """Blocks freed out of the window join the cached free blocks tail first, as a finished
    request's do: eviction eats the chain from its deep end, so the shared start stays a
    hit for longest."""
    mgr = KVCacheManager(9, BS, sliding_window=4)
    prompt = list(range(200, 216))  # 4 full blocks
    a = FakeRequest("a", list(prompt))
    run(mgr, a, 16)
    a.all_token_ids.append(0)
    run(mgr, a, 1)  # position 16 sees 13..16: blocks 0..2 freed, cached
    assert mgr.get_block_ids("a")[:3] == [0, 0, 0]
    run(mgr, FakeRequest("o", list(range(16))), 16)  # 3 never-used blocks, then 1 eviction
    hit, num_hit = mgr.get_computed_blocks(FakeRequest("b", prompt + [1]))
    assert num_hit == 8  # block 2 went first; blocks 0 and 1 are still a hit
    check_manager_invariants(mgr)


def test_no_new_blocks_before_the_window():
    """A request coming back with many computed tokens (a swap-in) takes blocks for its
    window only."""
    mgr = KVCacheManager(16, BS, sliding_window=4, enable_caching=False)
    req = FakeRequest("s", list(range(30)), num_computed_tokens=28)
    new = mgr.allocate_slots(req, 2)
    ids = mgr.get_block_ids("s")
    assert len(ids) == 8 and ids[:6] == [0] * 6 and len(new) == 2
    check_manager_invariants(mgr)


def test_failed_allocation_changes_nothing_and_counts_released_blocks():
    mgr = KVCacheManager(5, BS, sliding_window=2, enable_caching=False)
    req = FakeRequest("a", list(range(20)))
    run(mgr, req, 16)  # all 4 usable blocks
    assert mgr.get_num_free_blocks() == 0
    # position 16 sees 15..16: blocks 0..2 go back, then one is taken for block 4
    run(mgr, req, 1)
    assert mgr.get_block_ids("a")[:3] == [0, 0, 0] and mgr.get_num_free_blocks() == 2


class WindowedManagerMachine(ManagerMachine):
    """The random allocate / prefill / decode / free / preempt / reset machine with a window:
    the context a request can still attend to reads back right, the rest is the null block."""

    @initialize(block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(3, 24),
                hash_algo=st.sampled_from(["sha256", "xxhash"]), window=st.integers(1, 9))
    def setup(self, block_size: int, num_blocks: int, hash_algo: str, window: int) -> None:
        super().setup(block_size, num_blocks, hash_algo)
        self.mgr = KVCacheManager(num_blocks, block_size, hash_algo=hash_algo,
                                  sliding_window=window)

    def check_context(self, req: FakeRequest, upto: int) -> None:
        start = max(0, upto - self.mgr.sliding_window)  # the last token's window
        for pos, slot in zip(range(start, upto),
                             slot_mapping(self.mgr, req.request_id, start, upto)):
            assert slot >= self.mgr.block_size, f"{req} pos {pos} in the null block"
            assert self.kv.get(slot) == self.label(req, pos), f"wrong KV at {req}, pos {pos}"


WindowedManagerMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestWindowedManagerStateMachine = WindowedManagerMachine.TestCase
