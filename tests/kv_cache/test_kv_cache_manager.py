import pytest

from pagedserve.kv_cache.kv_cache_manager import KVCacheManager

from .conftest import FakeRequest, check_manager_invariants, free_order

BS = 4


def admit(mgr: KVCacheManager, req: FakeRequest, num_new: int | None = None):
    """What the scheduler does for a waiting request: lookup, allocate, then advance."""
    hit, num_hit = mgr.get_computed_blocks(req)
    num_new = req.num_tokens - num_hit if num_new is None else num_new
    new = mgr.allocate_slots(req, num_new, hit, num_hit)
    if new is not None:
        mgr.record_lookup(req, num_hit)
        req.num_computed_tokens = num_hit + num_new
    return hit, num_hit, new


def decode(mgr: KVCacheManager, req: FakeRequest, token: int):
    req.all_token_ids.append(token)
    new = mgr.allocate_slots(req, 1)
    if new is not None:
        req.num_computed_tokens += 1
    return new


def test_prefix_hit_shares_full_blocks_and_never_covers_the_whole_prompt():
    mgr = KVCacheManager(32, BS)
    a = FakeRequest("a", list(range(12)))
    admit(mgr, a)
    # exactly 3 full blocks: only 2 may be reused, the last token must be recomputed
    b = FakeRequest("b", list(range(12)))
    hit, num_hit, new = admit(mgr, b)
    assert num_hit == 8 and [x.block_id for x in hit] == mgr.get_block_ids("a")[:2]
    assert len(new) == 1 and new[0].block_id != mgr.get_block_ids("a")[2]
    assert [x.ref_cnt for x in hit] == [2, 2]
    stats = mgr.prefix_cache_stats
    assert (stats.queries, stats.hits) == (24, 8) and stats.hit_rate == pytest.approx(1 / 3)
    stats.reset()
    assert (stats.queries, stats.hits, stats.hit_rate) == (0, 0, 0.0)
    check_manager_invariants(mgr)


def test_lookup_stops_at_first_miss():
    mgr = KVCacheManager(32, BS)
    admit(mgr, FakeRequest("a", [1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 0]))
    # block 1 differs, so block 2 cannot match even though its tokens are equal
    _, num_hit, _ = admit(mgr, FakeRequest("b", [1, 1, 1, 1, 9, 9, 9, 9, 3, 3, 3, 3, 0]))
    assert num_hit == 4


def test_i2_identical_tokens_get_distinct_blocks_until_full_and_cached():
    mgr = KVCacheManager(32, BS)
    a, b = FakeRequest("a", [5, 6]), FakeRequest("b", [5, 6])
    admit(mgr, a)
    _, num_hit, _ = admit(mgr, b)
    assert num_hit == 0 and mgr.get_block_ids("a") != mgr.get_block_ids("b")
    for req in (a, b):
        decode(mgr, req, 7)
        decode(mgr, req, 8)
    ids_a, ids_b = mgr.get_block_ids("a"), mgr.get_block_ids("b")
    assert ids_a[0] != ids_b[0]  # block ids never change under a request
    # a's block filled first and got cached; b's duplicate stays unindexed
    pool = mgr.block_pool
    assert pool.blocks[ids_a[0]].block_hash is not None
    assert pool.blocks[ids_b[0]].block_hash is None
    c = FakeRequest("c", [5, 6, 7, 8, 1])
    hit, _, _ = admit(mgr, c)
    assert [x.block_id for x in hit] == [ids_a[0]]
    check_manager_invariants(mgr)


def test_i3_partial_blocks_and_unwritten_tokens_are_not_cached():
    mgr = KVCacheManager(32, BS)
    req = FakeRequest("a", list(range(10)))
    admit(mgr, req, num_new=5)  # chunked prefill: KV written for 5 tokens only
    blocks = [mgr.block_pool.blocks[i] for i in mgr.get_block_ids("a")]
    assert [b.block_hash is not None for b in blocks] == [True, False]
    mgr.allocate_slots(req, 5)
    req.num_computed_tokens = 10
    blocks = [mgr.block_pool.blocks[i] for i in mgr.get_block_ids("a")]
    assert [b.block_hash is not None for b in blocks] == [True, True, False]
    decode(mgr, req, 10)
    assert mgr.block_pool.blocks[mgr.get_block_ids("a")[2]].block_hash is None
    decode(mgr, req, 11)
    assert mgr.block_pool.blocks[mgr.get_block_ids("a")[2]].block_hash is not None
    check_manager_invariants(mgr)


def test_cache_salt_separates_tenants():
    mgr = KVCacheManager(64, BS)
    prompt = list(range(9))
    admit(mgr, FakeRequest("base", list(prompt)))
    for i, salt in enumerate(["t1", "t2"]):
        _, num_hit, _ = admit(mgr, FakeRequest(f"r{i}", list(prompt), cache_salt=salt))
        assert num_hit == 0, salt
    _, num_hit, _ = admit(mgr, FakeRequest("same-salt", list(prompt), cache_salt="t1"))
    assert num_hit == 8
    _, num_hit, _ = admit(mgr, FakeRequest("no-salt", list(prompt)))
    assert num_hit == 8


def test_free_is_tail_first_so_suffix_is_evicted_before_shared_prefix():
    mgr = KVCacheManager(8, BS)
    req = FakeRequest("a", list(range(12)) + [99])
    admit(mgr, req)
    ids = mgr.get_block_ids("a")
    hashes = [mgr.block_pool.blocks[i].block_hash for i in ids[:3]]
    mgr.free(req)
    queue = [b.block_id for b in free_order(mgr.block_pool.free_block_queue)]
    # the partial (unhashed) tail block first, then never-used ones, then the cached chain
    # from its deepest block back to its first
    assert queue[0] == ids[3]
    assert queue[-3:] == [ids[2], ids[1], ids[0]]
    # pressure evicts deepest cached blocks first; the shared prefix survives longest
    admit(mgr, FakeRequest("t", [7] * (4 * 6)))  # 6 of the 7 blocks
    cached = [mgr.block_pool.get_cached_block(h) for h in hashes]
    assert cached[0] is mgr.block_pool.blocks[ids[0]] and cached[1:] == [None, None]
    check_manager_invariants(mgr)


def test_allocate_returns_none_without_side_effects_when_short():
    mgr = KVCacheManager(6, BS)
    admit(mgr, FakeRequest("a", list(range(8)) + [50]))  # 3 blocks, 2 cached
    mgr.free(FakeRequest("a"))
    holder = FakeRequest("h", [40, 41])
    admit(mgr, holder)  # takes 1 of 5 free; 2 cached ones remain free
    # needs the 2 revived hits + 3 new blocks = 5 > 4 free
    req = FakeRequest("b", list(range(8)) + list(range(60, 69)))
    pool = mgr.block_pool
    before = ([b.ref_cnt for b in pool.blocks], [b.block_hash for b in pool.blocks],
              [b.block_id for b in free_order(pool.free_block_queue)],
              dict(pool.cached_block_hash_to_block))
    hit, num_hit, new = admit(mgr, req)
    assert num_hit == 8 and new is None and req.num_computed_tokens == 0
    after = ([b.ref_cnt for b in pool.blocks], [b.block_hash for b in pool.blocks],
             [b.block_id for b in free_order(pool.free_block_queue)],
             dict(pool.cached_block_hash_to_block))
    assert before == after and mgr.get_block_ids("b") == []
    # once the holder leaves, the 5 free blocks are enough
    mgr.free(holder)
    _, _, new = admit(mgr, req)
    assert new is not None and len(mgr.get_block_ids("b")) == 5
    check_manager_invariants(mgr)


def test_revived_hits_count_against_free_capacity():
    mgr = KVCacheManager(5, BS)
    a = FakeRequest("a", list(range(8)) + [1])
    admit(mgr, a)
    mgr.free(a)
    assert mgr.get_num_free_blocks() == 4
    # 2 hit blocks (free, cached) + 3 new = 5 > 4: would over-commit if hits were free
    b = FakeRequest("b", list(range(8)) + [1] * 9)
    _, num_hit, new = admit(mgr, b)
    assert num_hit == 8 and new is None
    check_manager_invariants(mgr)


def test_free_is_idempotent_and_resets_for_preemption():
    mgr = KVCacheManager(16, BS)
    req = FakeRequest("a", list(range(6)))
    admit(mgr, req)
    mgr.free(req)
    mgr.free(req)
    mgr.free(FakeRequest("unknown"))
    assert mgr.get_num_free_blocks() == 15 and mgr.get_block_ids("a") == []
    req.num_computed_tokens = 0  # preempted: recompute, reusing its own cached block
    _, num_hit, new = admit(mgr, req)
    assert num_hit == 4 and new is not None
    check_manager_invariants(mgr)


def test_bad_arguments_are_rejected_clearly():
    mgr = KVCacheManager(16, BS)
    req = FakeRequest("a", list(range(9)))
    with pytest.raises(ValueError, match="num_new_tokens"):
        mgr.allocate_slots(req, 0)
    admit(mgr, req)
    other = FakeRequest("b", list(range(9)))
    hit, num_hit = mgr.get_computed_blocks(other)
    with pytest.raises(ValueError, match="does not match"):
        mgr.allocate_slots(other, 1, hit, num_hit - 1)
    mgr.free(req)
    mgr.block_pool.get_new_blocks(mgr.get_num_free_blocks())  # evicts the hit blocks
    with pytest.raises(ValueError, match="no longer holds"):
        mgr.allocate_slots(other, 1, hit, num_hit)
    with pytest.raises(ValueError):
        KVCacheManager(16, 0)
    with pytest.raises(ValueError):
        KVCacheManager(16, 4, hash_algo="crc32")


def test_block_ids_and_usage():
    """Each request holds the blocks its tokens need, distinct, never the null block; the
    slot mapping and block tables made from them are the runner's
    (tests/device/test_step_inputs.py)."""
    mgr = KVCacheManager(11, BS)
    a, b = FakeRequest("a", list(range(6))), FakeRequest("b", [9] * 9)
    admit(mgr, a)
    admit(mgr, b)
    ids_a, ids_b = mgr.get_block_ids("a"), mgr.get_block_ids("b")
    assert (len(ids_a), len(ids_b)) == (2, 3)
    assert 0 not in ids_a + ids_b and len(set(ids_a + ids_b)) == 5
    assert mgr.usage == pytest.approx(5 / 10)


def test_caching_disabled_and_stats_off():
    mgr = KVCacheManager(16, BS, enable_caching=False)
    admit(mgr, FakeRequest("a", list(range(9))))
    _, num_hit, _ = admit(mgr, FakeRequest("b", list(range(9))))
    assert num_hit == 0 and mgr.block_pool.cached_block_hash_to_block == {}
    quiet = KVCacheManager(16, BS, log_stats=False)
    admit(quiet, FakeRequest("a", list(range(9))))
    _, num_hit, _ = admit(quiet, FakeRequest("b", list(range(9))))
    assert num_hit == 8 and quiet.prefix_cache_stats.queries == 0


def test_reset_prefix_cache_through_manager():
    mgr = KVCacheManager(16, BS, hash_algo="xxhash")
    req = FakeRequest("a", list(range(9)))
    admit(mgr, req)
    assert not mgr.reset_prefix_cache()
    mgr.free(req)
    assert mgr.reset_prefix_cache()
    _, num_hit, _ = admit(mgr, FakeRequest("b", list(range(9))))
    assert num_hit == 0
