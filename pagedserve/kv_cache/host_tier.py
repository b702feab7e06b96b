"""The prefix cache's second tier: evicted cached blocks kept in host memory, by hash.

When the device pool evicts a cached block, its KV is about to be overwritten; with a host
tier the scheduler first asks the runner to copy it into a host slot (before the step that
reuses the block runs), indexed here under the same block hash. A later lookup that misses
on the device continues the hash chain here; the blocks found are copied back into fresh
device blocks before the step that first attends to them, and cached again on the device
under the same hashes. The hash already covers the ancestry, `cache_salt` and any extra key,
so the identity is the same in both tiers with nothing added.

This module is bookkeeping only (slot ids, no tensors), like `device/swap.py`: the host
tensors belong to the model runner. Invariants (checked by tests/engine/test_host_tier_stateful.py):
  H1 every slot is either free or indexed under exactly one hash, never both;
  H2 a slot read by a recall this step (`pin`) is not handed to an offload in the same
     step, so the runner may do all offloads, then all recalls;
  H3 the tier never holds more than `num_slots` blocks; the least recently stored or
     recalled block goes first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from pagedserve.kv_cache.events import (MEDIUM_HOST, BlockRemoved, BlockStored, KVCacheEvent,
                                        external_hash)
from pagedserve.kv_cache.hashing import BlockHash


@dataclass
class TierStats:
    """Since start: blocks stored in this tier, blocks evicted from it (its hits are the
    scheduler's count of blocks recalled: a lookup may find blocks the pool then has no
    room for)."""

    stores: int = 0
    evictions: int = 0


class HostTier:
    """An LRU index of block hash -> host slot over `num_slots` slots. With `enable_events`
    it records what it stores and drops, as the block pool does (medium "CPU"; a stored
    event carries no tokens: the tier is given hashes only)."""

    def __init__(self, num_slots: int, enable_events: bool = False,
                 block_size: int = 16) -> None:
        if num_slots < 1:
            raise ValueError(f"a host tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._index: OrderedDict[BlockHash, int] = OrderedDict()  # oldest first
        self._free = list(range(num_slots - 1, -1, -1))
        self._pinned: set[int] = set()
        self.stats = TierStats()
        self.enable_events = enable_events
        self.block_size = block_size  # tokens per block, as the events report it
        self._events: list[KVCacheEvent] = []

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._index

    def lookup(self, hashes: Iterable[BlockHash]) -> list[int]:
        """Slots of the longest run of `hashes` held here, from the first; each found block
        becomes the most recent and is pinned for this step (H2)."""
        slots = []
        for block_hash in hashes:
            slot = self._index.get(block_hash)
            if slot is None:
                break
            self._index.move_to_end(block_hash)
            self._pinned.add(slot)
            slots.append(slot)
        return slots

    def store(self, block_hash: BlockHash) -> int | None:
        """A slot for an evicted device block's KV, or None when nothing needs copying: the
        hash is held already (it becomes the most recent), or every slot is pinned."""
        if block_hash in self._index:
            self._index.move_to_end(block_hash)
            return None
        slot = self._free.pop() if self._free else self._evict_lru()
        if slot is None:
            return None
        self._index[block_hash] = slot
        self.stats.stores += 1
        if self.enable_events:
            self._events.append(BlockStored([external_hash(block_hash)], None, [],
                                            self.block_size, None, MEDIUM_HOST))
        return slot

    def _evict_lru(self) -> int | None:
        for block_hash, slot in self._index.items():
            if slot not in self._pinned:
                del self._index[block_hash]
                self.stats.evictions += 1
                if self.enable_events:
                    self._events.append(BlockRemoved([external_hash(block_hash)], MEDIUM_HOST))
                return slot
        return None

    def end_step(self) -> None:
        """The step's copies are queued: pinned slots may be reused from the next step on."""
        self._pinned.clear()

    def take_events(self) -> list[KVCacheEvent]:
        """Return and clear the recorded events (empty unless `enable_events`)."""
        events, self._events = self._events, []
        return events
