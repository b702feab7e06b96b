"""Block metadata, the free queue and the block pool: the paged KV cache's bookkeeping.

The KV tensors are just arrays indexed by block id; everything here decides which block id
belongs to whom. Invariants (checked by tests/kv_cache):
  I1 a block is in the free queue exactly when ref_cnt == 0 and it is not the null block;
  I2 block ids never change and blocks are never deduplicated under a request;
  I3 only full blocks get a hash and an index entry;
  I4 a cached block with ref_cnt 0 stays in the free queue: `touch` revives it,
     `get_new_blocks` evicts it (dropping its index entry).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from pagedserve.kv_cache.events import (MEDIUM_POOL, AllBlocksCleared, BlockRemoved, BlockStored,
                                        KVCacheEvent, external_hash)
from pagedserve.kv_cache.hashing import BlockHash, BlockHasher, get_hash_fn


@dataclass(eq=False, slots=True)
class KVCacheBlock:
    """Metadata of one KV block; `block_id` is its fixed address in the KV tensors.

    The free-list pointers belong to `FreeKVCacheBlockQueue`; nothing else touches them.
    Identity equality (eq=False): two blocks are never "equal" by content.
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    is_null: bool = False
    prev_free_block: KVCacheBlock | None = field(default=None, repr=False)
    next_free_block: KVCacheBlock | None = field(default=None, repr=False)


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks threaded through the blocks themselves.

    Not a deque because a prefix hit must pull a block out of the middle in O(1) (`remove`).
    Front = next to be reused; the order is the eviction policy. Head and tail sentinels
    remove every first/last special case.
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        self.num_free_blocks = 0
        self.append_n(blocks)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free_block
        if block is self._tail:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} free blocks, only {self.num_free_blocks} free")
        out = []
        block = self._head.next_free_block
        for _ in range(n):
            out.append(block)
            nxt = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            block = nxt
        self._head.next_free_block = block
        block.prev_free_block = self._head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        self.append_n((block,))

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Append at the back (reused last), in the given order."""
        self._link_after(self._tail.prev_free_block, blocks)

    def appendleft_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Insert at the front (reused first), keeping the given order."""
        self._link_after(self._head, blocks)

    def _link_after(self, anchor: KVCacheBlock, blocks: Iterable[KVCacheBlock]) -> None:
        stop = anchor.next_free_block
        for block in blocks:
            if block.prev_free_block is not None or block.next_free_block is not None:
                raise ValueError(f"block {block.block_id} is already in the free queue")
            block.prev_free_block = anchor
            anchor.next_free_block = block
            anchor = block
            self.num_free_blocks += 1
        anchor.next_free_block = stop
        stop.prev_free_block = anchor


class BlockPool:
    """Owns every block's metadata, the free queue and the prefix-cache index.

    Block 0 is the null block: reserved here, padding in block tables, never handed out,
    freed, cached or counted in usage. Freed blocks without a hash go to the front of the
    free queue (they hold nothing worth keeping); cached ones go to the back, so among them
    the least recently freed is evicted first. Events are recorded only when
    `enable_events` is set, and evicted blocks only when `record_evictions` is (a host tier
    copies them out, `kv_cache.host_tier`), so an undrained list cannot grow without bound.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True,
                 hash_fn: BlockHasher | None = None, enable_events: bool = False,
                 record_evictions: bool = False, block_size: int = 16) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.hash_fn = hash_fn or get_hash_fn("sha256")
        self.enable_events = enable_events
        self.block_size = block_size  # tokens per block, as the events report it
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        self.num_evictions = 0  # cached blocks reused for other content, since start
        self._events: list[KVCacheEvent] = []
        self.record_evictions = record_evictions
        self._evicted: list[tuple[BlockHash, int]] = []

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of non-null blocks held by requests (cached free blocks count as free)."""
        return 1.0 - self.get_num_free_blocks() / (self.num_blocks - 1)

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take `n` blocks from the front of the free queue, evicting cached ones in passing."""
        if n > self.get_num_free_blocks():
            raise ValueError(f"cannot allocate {n} blocks: only "
                             f"{self.get_num_free_blocks()} free")
        blocks = self.free_block_queue.popleft_n(n)
        evicted = [self._evict(block) for block in blocks if block.block_hash is not None]
        for block in blocks:
            block.ref_cnt = 1
        if evicted and self.enable_events:
            self._events.append(BlockRemoved([external_hash(h) for h in evicted], MEDIUM_POOL))
        return blocks

    def _evict(self, block: KVCacheBlock) -> BlockHash:
        """Drop the block's hash from the index; returns it."""
        block_hash = block.block_hash
        del self.cached_block_hash_to_block[block_hash]
        self.num_evictions += 1
        if self.record_evictions:
            self._evicted.append((block_hash, block.block_id))
        block.block_hash = None
        return block_hash

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cached blocks (a prefix hit), reviving free ones from the queue."""
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching 0 return to the free queue.

        Cached blocks are appended in the given order, so callers pass a request's blocks
        tail first to make the deep suffix of a chain evictable before its shared prefix.
        """
        blocks = [b for b in ordered_blocks if not b.is_null]
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} freed with ref_cnt {block.ref_cnt}")
        released = []
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                released.append(block)
        self.free_block_queue.appendleft_n(b for b in released if b.block_hash is None)
        self.free_block_queue.append_n(b for b in released if b.block_hash is not None)

    def cache_full_blocks(self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[BlockHash],
                          num_cached_blocks: int, num_full_blocks: int,
                          token_ids: Sequence[int] = ()) -> None:
        """Index blocks[num_cached_blocks:num_full_blocks] under their content hashes.

        Only full blocks may be passed (I3). A block already cached (a prefix hit) is left
        alone; a block whose hash is already indexed by another block (two requests computed
        the same content at once) stays unhashed, so the index maps each hash to one block
        and the duplicate is reused first once freed. `token_ids` (the request's, from its
        first block) go into the stored events, one event per run of newly indexed blocks.
        """
        if not self.enable_caching:
            return
        run: list[int] = []  # indices of consecutive blocks indexed by this call
        for i in range(num_cached_blocks, num_full_blocks):
            if self._index(blocks[i], block_hashes[i]):
                run.append(i)
                continue
            self._record_stored(run, block_hashes, token_ids)
            run = []
        self._record_stored(run, block_hashes, token_ids)

    def _index(self, block: KVCacheBlock, block_hash: BlockHash) -> bool:
        """Index the block under `block_hash` unless it is cached, null, or the hash is
        taken; True if it was indexed."""
        if block.block_hash is not None or block.is_null \
                or block_hash in self.cached_block_hash_to_block:
            return False
        block.block_hash = block_hash
        self.cached_block_hash_to_block[block_hash] = block
        return True

    def _record_stored(self, run: list[int], block_hashes: Sequence[BlockHash],
                       token_ids: Sequence[int]) -> None:
        if not run or not self.enable_events:
            return
        first, size = run[0], self.block_size
        parent = external_hash(block_hashes[first - 1]) if first > 0 else None
        self._events.append(BlockStored(
            [external_hash(block_hashes[i]) for i in run], parent,
            list(token_ids[first * size:(run[-1] + 1) * size]), size, None, MEDIUM_POOL))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is in use."""
        if self.get_num_free_blocks() != self.num_blocks - 1:
            return False
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        if self.enable_events:
            self._events.append(AllBlocksCleared())
        return True

    def take_evicted(self) -> list[tuple[BlockHash, int]]:
        """Return and clear the (hash, block id) of the cached blocks evicted since the last
        call (empty unless `record_evictions`): their KV stays intact until the step that
        reuses them runs."""
        evicted, self._evicted = self._evicted, []
        return evicted

    def take_events(self) -> list[KVCacheEvent]:
        """Return and clear the recorded events (empty unless `enable_events`)."""
        events, self._events = self._events, []
        return events
