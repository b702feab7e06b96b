import pytest

from pagedserve.kv_cache.block_pool import FreeKVCacheBlockQueue, KVCacheBlock

from .conftest import free_order


def ids(queue: FreeKVCacheBlockQueue) -> list[int]:
    return [b.block_id for b in free_order(queue)]


def make(n: int) -> tuple[list[KVCacheBlock], FreeKVCacheBlockQueue]:
    blocks = [KVCacheBlock(i) for i in range(n)]
    return blocks, FreeKVCacheBlockQueue(blocks)


def test_order_and_counts_through_popleft_append_remove():
    blocks, q = make(5)
    assert ids(q) == [0, 1, 2, 3, 4] and q.num_free_blocks == 5
    assert q.popleft() is blocks[0]
    q.remove(blocks[2])
    assert ids(q) == [1, 3, 4] and q.num_free_blocks == 3
    q.append(blocks[2])
    q.appendleft_n([blocks[0]])
    assert ids(q) == [0, 1, 3, 4, 2] and q.num_free_blocks == 5
    assert [b.block_id for b in q.popleft_n(3)] == [0, 1, 3]
    assert ids(q) == [4, 2] and q.num_free_blocks == 2


def test_removed_block_pointers_are_cleared_and_sentinels_never_leak():
    blocks, q = make(3)
    q.remove(blocks[1])
    assert blocks[1].prev_free_block is None and blocks[1].next_free_block is None
    got = q.popleft_n(2)
    assert [b.block_id for b in got] == [0, 2]
    assert all(b.prev_free_block is None and b.next_free_block is None for b in got)
    assert free_order(q) == [] and q.num_free_blocks == 0
    with pytest.raises(ValueError):
        q.popleft()
    with pytest.raises(ValueError):
        q.popleft_n(1)
    q.append_n(got)
    assert ids(q) == [0, 2]


def test_remove_from_the_middle_keeps_neighbours_linked():
    blocks, q = make(6)
    for i in (3, 1, 4):
        q.remove(blocks[i])
    assert ids(q) == [0, 2, 5]
    assert blocks[2].prev_free_block is blocks[0] and blocks[2].next_free_block is blocks[5]


def test_double_insert_and_removing_absent_block_are_errors():
    blocks, q = make(2)
    with pytest.raises(ValueError):
        q.append(blocks[0])
    q.remove(blocks[0])
    with pytest.raises(ValueError):
        q.remove(blocks[0])
    assert q.num_free_blocks == 1
