import pytest

from pagedserve.kv_cache.block_pool import BlockPool
from pagedserve.kv_cache.events import (AllBlocksCleared, BlockRemoved, BlockStored,
                                        external_hash)
from pagedserve.kv_cache.hashing import get_hash_fn

from .conftest import check_pool_invariants, free_order

H = get_hash_fn("sha256")


def chain(*blocks: list[int]) -> list[bytes]:
    out, parent = [], None
    for tokens in blocks:
        parent = H(parent, tokens)
        out.append(parent)
    return out


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in free_order(pool.free_block_queue)]


def test_null_block_is_reserved_and_not_counted():
    pool = BlockPool(5)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert pool.get_num_free_blocks() == 4 and pool.get_usage() == 0.0
    blocks = pool.get_new_blocks(4)
    assert 0 not in [b.block_id for b in blocks] and pool.get_usage() == 1.0
    pool.touch([pool.null_block])
    pool.free_blocks([pool.null_block])
    assert pool.null_block.ref_cnt == 0 and 0 not in free_ids(pool)
    check_pool_invariants(pool)
    with pytest.raises(ValueError):
        BlockPool(1)


def test_i1_allocate_free_round_trip():
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(3)
    assert all(b.ref_cnt == 1 for b in blocks) and pool.get_num_free_blocks() == 2
    check_pool_invariants(pool)
    pool.touch(blocks[:1])
    pool.free_blocks(blocks)
    assert blocks[0].ref_cnt == 1 and pool.get_num_free_blocks() == 4
    check_pool_invariants(pool)
    pool.free_blocks(blocks[:1])
    assert pool.get_num_free_blocks() == 5
    check_pool_invariants(pool)


def test_over_allocation_and_double_free_are_clear_errors_without_side_effects():
    pool = BlockPool(4)
    with pytest.raises(ValueError, match="only 3 free"):
        pool.get_new_blocks(4)
    assert pool.get_num_free_blocks() == 3
    blocks = pool.get_new_blocks(2)
    pool.free_blocks(blocks)
    with pytest.raises(ValueError, match="ref_cnt 0"):
        pool.free_blocks(blocks)
    assert pool.get_num_free_blocks() == 3
    check_pool_invariants(pool)


def test_i3_cache_full_blocks_indexes_only_the_given_full_range():
    pool = BlockPool(8)
    blocks = pool.get_new_blocks(3)
    hashes = chain([1, 2], [3, 4])
    pool.cache_full_blocks(blocks, hashes, 0, 2)
    assert [b.block_hash for b in blocks] == [hashes[0], hashes[1], None]
    assert pool.get_cached_block(hashes[1]) is blocks[1]
    check_pool_invariants(pool)


def test_identical_content_in_two_blocks_indexes_only_the_first():
    pool = BlockPool(8)
    a, b = pool.get_new_blocks(1), pool.get_new_blocks(1)
    hashes = chain([1, 2])
    pool.cache_full_blocks(a, hashes, 0, 1)
    pool.cache_full_blocks(b, hashes, 0, 1)
    assert a[0].block_id != b[0].block_id
    assert pool.get_cached_block(hashes[0]) is a[0] and b[0].block_hash is None
    check_pool_invariants(pool)


def test_i4_touch_revives_cached_block_from_middle_of_queue():
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(5)
    hashes = chain([1], [2], [3])
    pool.cache_full_blocks(blocks, hashes, 0, 3)
    pool.free_blocks(blocks)
    assert blocks[1].block_id in free_ids(pool)
    hit = pool.get_cached_block(hashes[1])
    assert hit is blocks[1]
    pool.touch([hit])
    assert hit.ref_cnt == 1 and hit.block_id not in free_ids(pool)
    assert hit.block_hash == hashes[1]  # revived, not evicted
    check_pool_invariants(pool)


def test_i4_eviction_drops_index_entry_and_uncached_blocks_go_first():
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(4)
    hashes = chain([1], [2])
    pool.cache_full_blocks(blocks, hashes, 0, 2)
    pool.free_blocks(blocks)
    # the two unhashed blocks are reused before the cached ones
    assert free_ids(pool)[:2] == [blocks[2].block_id, blocks[3].block_id]
    first = pool.get_new_blocks(2)
    assert {b.block_id for b in first} == {blocks[2].block_id, blocks[3].block_id}
    assert len(pool.cached_block_hash_to_block) == 2
    evicted = pool.get_new_blocks(1)[0]
    assert evicted is blocks[0] and evicted.block_hash is None
    assert pool.get_cached_block(hashes[0]) is None
    assert pool.get_cached_block(hashes[1]) is blocks[1]
    check_pool_invariants(pool)


def test_reset_prefix_cache_refused_while_in_use_then_clears_everything():
    pool = BlockPool(4, enable_events=True, block_size=1)
    blocks = pool.get_new_blocks(2)
    hashes = chain([1], [2])
    pool.cache_full_blocks(blocks, hashes, 0, 2, [1, 2])
    assert not pool.reset_prefix_cache()
    assert len(pool.cached_block_hash_to_block) == 2
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache()
    assert pool.cached_block_hash_to_block == {}
    assert all(b.block_hash is None for b in pool.blocks)
    check_pool_invariants(pool)
    pool.get_new_blocks(3)
    ext = [external_hash(h) for h in hashes]
    assert pool.take_events() == [BlockStored(ext, None, [1, 2], 1, None, "GPU"),
                                  AllBlocksCleared()]
    assert pool.take_events() == []


def test_events_record_eviction_and_are_off_by_default():
    pool = BlockPool(2, enable_events=True)
    block = pool.get_new_blocks(1)
    pool.cache_full_blocks(block, chain([9]), 0, 1)
    pool.free_blocks(block)
    assert pool.num_evictions == 0
    pool.get_new_blocks(1)
    assert pool.take_events()[-1] == BlockRemoved([external_hash(chain([9])[0])], "GPU")
    assert pool.num_evictions == 1
    quiet = BlockPool(2)
    quiet.cache_full_blocks(quiet.get_new_blocks(1), chain([9]), 0, 1)
    assert quiet.take_events() == []


def test_stored_events_split_where_a_block_was_cached_already():
    """One event per run of newly cached blocks, each run chained to the block before it;
    a block whose hash another block holds is skipped (it breaks the run)."""
    pool = BlockPool(8, enable_events=True, block_size=2)
    hashes = chain([1, 1], [2, 2], [3, 3], [4, 4])
    other = pool.get_new_blocks(1)
    pool.cache_full_blocks(other, hashes[1:2], 0, 1)  # another block holds hash 1
    pool.take_events()
    blocks = pool.get_new_blocks(4)
    pool.cache_full_blocks(blocks, hashes, 0, 4, [1, 1, 2, 2, 3, 3, 4, 4])
    ext = [external_hash(h) for h in hashes]
    assert pool.take_events() == [BlockStored(ext[:1], None, [1, 1], 2, None, "GPU"),
                                  BlockStored(ext[2:], ext[1], [3, 3, 4, 4], 2, None, "GPU")]
    assert blocks[1].block_hash is None


def test_caching_disabled_never_indexes():
    pool = BlockPool(4, enable_caching=False)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, chain([1], [2]), 0, 2)
    assert pool.cached_block_hash_to_block == {} and blocks[0].block_hash is None
