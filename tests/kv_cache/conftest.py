"""Shared helpers for core tests: a minimal duck-typed request and an invariant checker."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.kv_cache.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from pagedserve.kv_cache.kv_cache_manager import KVCacheManager


def free_order(queue: FreeKVCacheBlockQueue) -> list[KVCacheBlock]:
    """The free queue front to back, as the queue hands blocks out (`popleft_n`), then put
    back in the same order (`append_n`): what the eviction order is, through the queue's own
    methods."""
    blocks = queue.popleft_n(queue.num_free_blocks)
    queue.append_n(blocks)
    return blocks


@dataclass
class FakeRequest:
    """What KVCacheManager reads from a request; the engine's Request has the same fields."""

    request_id: str
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    cache_salt: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


def slot_mapping(mgr: KVCacheManager, request_id: str, start: int, end: int) -> list[int]:
    """The KV slots of positions [start, end) in the blocks the manager gave the request
    (block_id * block_size + offset), which must cover them. What the runner computes from
    the same blocks is tested in tests/device/test_step_inputs.py."""
    block_ids = mgr.get_block_ids(request_id)
    bs = mgr.block_size
    assert 0 <= start <= end <= len(block_ids) * bs, (
        f"positions [{start}, {end}) outside the {len(block_ids) * bs} allocated slots of "
        f"request {request_id}")
    return [block_ids[p // bs] * bs + p % bs for p in range(start, end)]


def check_pool_invariants(pool: BlockPool) -> None:
    """I1, I3's index side, and exact counts; raises AssertionError on any violation."""
    free = free_order(pool.free_block_queue)
    free_ids = [b.block_id for b in free]
    assert len(free_ids) == len(set(free_ids)), "a block is twice in the free queue"
    assert pool.free_block_queue.num_free_blocks == len(free)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert 0 not in free_ids and pool.null_block.block_hash is None
    free_set = set(free_ids)
    for block in pool.blocks[1:]:
        assert block.ref_cnt >= 0
        assert (block.ref_cnt == 0) == (block.block_id in free_set), f"I1 broken: {block}"
        if block.block_hash is not None:
            assert pool.cached_block_hash_to_block[block.block_hash] is block
    for block_hash, block in pool.cached_block_hash_to_block.items():
        assert block.block_hash == block_hash


def check_manager_invariants(mgr: KVCacheManager) -> None:
    """Pool invariants plus: every ref_cnt equals the number of block tables holding it."""
    check_pool_invariants(mgr.block_pool)
    holders = [0] * mgr.block_pool.num_blocks
    for blocks in mgr.req_to_blocks.values():
        # the null block only ever stands for blocks freed out of a sliding window: a prefix
        num_null = next((i for i, b in enumerate(blocks) if not b.is_null), len(blocks))
        assert all(not b.is_null for b in blocks[num_null:]), "a null block after a real one"
        ids = [b.block_id for b in blocks[num_null:]]
        assert len(ids) == len(set(ids)), "a block appears twice in one block table"
        for i in ids:
            holders[i] += 1
    assert holders[0] == 0, "the null block was handed to a request"
    for block in mgr.block_pool.blocks[1:]:
        assert block.ref_cnt == holders[block.block_id], f"leaked or over-freed: {block}"
