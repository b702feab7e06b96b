"""The prefix cache's lower tiers: evicted cached blocks kept in host memory (and on disk),
by hash.

When the device pool evicts a cached block, its KV is about to be overwritten; with a host
tier the scheduler first asks the runner to copy it into a host slot (before the step that
reuses the block runs), indexed here under the same block hash. A later lookup that misses
on the device continues the hash chain here; the blocks found are copied back into fresh
device blocks before the step that first attends to them, and cached again on the device
under the same hashes. The hash already covers the ancestry, `cache_salt` and any extra key,
so the identity is the same in both tiers with nothing added.

The disk tier (`--kv-offload-path`) is the same index over file slots (medium "DISK"):
blocks the host tier drops are written there (spilled), and a lookup that misses in host
memory continues on disk; what it finds is loaded into host slots first, which stay
*pending* (invisible to lookups, never dropped) until the runner reports whether each file
read back whole (`resolve`): a corrupt or truncated file is then a miss, never KV.

This module is bookkeeping only (slot ids, no tensors), like `device/swap.py`: the host
tensors and the files belong to the model runner. Invariants (checked by
tests/engine/test_host_tier_stateful.py):
  H1 every slot is either free or indexed under exactly one hash, never both;
  H2 a slot read (looked up) or written (stored) this step is pinned: it is not handed to
     another store in the same step, so the runner may do all spills, then all offloads,
     loads and recalls, and no copy of a step reads a slot another copy of it overwrites;
  H3 the tier never holds more than `num_slots` blocks; the least recently stored or
     recalled block that is neither pinned nor pending goes first.
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
    """An LRU index of block hash -> slot over `num_slots` slots (host memory, or disk files
    with medium "DISK"). With `enable_events` it records what it stores and drops, as the
    block pool does (its `medium`; a stored event carries no tokens: the tier is given
    hashes only)."""

    def __init__(self, num_slots: int, enable_events: bool = False,
                 block_size: int = 16, medium: str = MEDIUM_HOST) -> None:
        if num_slots < 1:
            raise ValueError(f"a {medium} tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self.medium = medium
        self._index: OrderedDict[BlockHash, int] = OrderedDict()  # oldest first
        self._free = list(range(num_slots - 1, -1, -1))
        self._pinned: set[int] = set()
        self._pending: dict[int, BlockHash] = {}  # slot -> hash, until `resolve`
        self._dropped: list[tuple[BlockHash, int]] = []  # for a tier below (`take_dropped`)
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
            if slot is None or slot in self._pending:
                break
            self._index.move_to_end(block_hash)
            self._pinned.add(slot)
            slots.append(slot)
        return slots

    def store(self, block_hash: BlockHash, pending: bool = False) -> int | None:
        """A slot for an evicted block's KV, or None when nothing needs copying: the hash is
        held already (it becomes the most recent), or every slot is pinned or pending. The
        slot is pinned for this step (H2); `pending`: its content is a load whose outcome
        is not known yet (see `resolve`)."""
        if block_hash in self._index:
            self._index.move_to_end(block_hash)
            return None
        slot = self._free.pop() if self._free else self._evict_lru()
        if slot is None:
            return None
        self._index[block_hash] = slot
        self._pinned.add(slot)
        if pending:
            self._pending[slot] = block_hash
        else:
            self._stored(block_hash, slot)
        return slot

    def _stored(self, block_hash: BlockHash, slot: int) -> None:
        self.stats.stores += 1
        if self.enable_events:
            self._events.append(BlockStored([external_hash(block_hash)], None, [],
                                            self.block_size, None, self.medium))

    def _evict_lru(self) -> int | None:
        for block_hash, slot in self._index.items():
            if slot not in self._pinned and slot not in self._pending:
                self._remove(block_hash, slot)
                self.stats.evictions += 1
                self._dropped.append((block_hash, slot))
                return slot
        return None

    def _remove(self, block_hash: BlockHash, slot: int) -> None:
        del self._index[block_hash]
        if self.enable_events:
            self._events.append(BlockRemoved([external_hash(block_hash)], self.medium))

    def is_pending(self, slot: int) -> bool:
        return slot in self._pending

    def pending_slot(self, block_hash: BlockHash) -> int | None:
        """The slot `block_hash` is being loaded into, if it is."""
        slot = self._index.get(block_hash)
        return slot if slot in self._pending else None

    def resolve(self, slot: int, ok: bool) -> BlockHash:
        """The load into pending `slot` is done: its block becomes visible (`ok`), or the
        slot is freed (the file did not read back whole). Returns the block's hash."""
        block_hash = self._pending.pop(slot)
        if ok:
            self._stored(block_hash, slot)
        else:
            del self._index[block_hash]
            self._free.append(slot)
        return block_hash

    def discard(self, block_hash: BlockHash) -> None:
        """Forget a block whose copy here turned out unreadable (its slot becomes free)."""
        slot = self._index.get(block_hash)
        if slot is not None and slot not in self._pending:
            self._remove(block_hash, slot)
            self._free.append(slot)

    def restore(self, held: list[tuple[BlockHash, int]]) -> None:
        """Index blocks already in their slots (files a previous run left), oldest first."""
        for block_hash, slot in held:
            if block_hash in self._index or slot not in self._free:
                continue
            self._free.remove(slot)
            self._index[block_hash] = slot

    def take_dropped(self) -> list[tuple[BlockHash, int]]:
        """Return and clear the (hash, slot) of the blocks evicted since the last call: their
        content stays in the slot until this step's copies run (a tier below may keep it)."""
        dropped, self._dropped = self._dropped, []
        return dropped

    def end_step(self) -> None:
        """The step's copies are queued: pinned slots may be reused from the next step on
        (pending ones only once resolved)."""
        self._pinned.clear()

    def take_events(self) -> list[KVCacheEvent]:
        """Return and clear the recorded events (empty unless `enable_events`)."""
        events, self._events = self._events, []
        return events
