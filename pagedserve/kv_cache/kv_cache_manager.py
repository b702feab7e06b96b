"""Per-request block tables on top of the block pool, with automatic prefix caching.

The request is duck-typed: `.request_id`, `.all_token_ids` (prompt + output, growing),
`.num_tokens`, `.num_computed_tokens`, and optionally `.cache_salt` and `.lora_request`.

Extra hash keys: `cache_salt` and the LoRA adapter's id (KV computed under an adapter differs
from the base model's everywhere) go only into block 0, because the chain carries them to
every later block anyway: two adapters never share a block, one adapter's requests share
theirs. A request's block hashes are kept and extended incrementally, so a decode step
hashes at most the one block that just filled.

Sliding windows: when every layer of the model attends only to its last `sliding_window`
positions, a request's blocks that lie wholly before the window of its next token are never
read again, so `allocate_slots` returns them to the pool and their entries in the request's
table become the null block (positions keep their index: block i still covers tokens
i * block_size ...). It happens on the next call to `allocate_slots`, so at most when the
request's next block is taken (the scheduler skips the call while a decode stays inside its
block). Prefix caching with a window:
  - a freed block keeps its hash: it waits in the free queue as a cached block (I4), so a
    later request with the same prefix can still hit it until it is evicted;
  - a prefix hit still needs every block of the chain in the cache (each hash covers its
    parents), but the request takes a reference only on the hit blocks inside the window of
    its first new token; the others stay where they are in the free queue and the request's
    table gets the null block for them;
  - likewise a request never takes a new block for positions wholly before its window (a
    request swapped back in, for one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedserve.kv_cache.block_pool import BlockPool, KVCacheBlock
from pagedserve.kv_cache.hashing import BlockHash, get_hash_fn


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups, in tokens: `queries` looked up, `hits` found cached; one lookup
    a request (`record_lookup`), however many steps it waited for room."""

    requests: int = 0
    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def reset(self) -> None:
        self.requests = self.queries = self.hits = 0


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Allocates and frees a request's blocks; the scheduler's only view of KV memory."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 hash_algo: str = "sha256", log_stats: bool = True,
                 hash_seed: int | str | None = None,
                 sliding_window: int | None = None, enable_events: bool = False,
                 record_evictions: bool = False) -> None:
        """sliding_window: set when every layer attends to at most that many last positions
        (the largest window of the model's layers); None keeps every block. enable_events:
        the block pool records its events (see `core.kv_events`). record_evictions: it
        records the cached blocks it evicts, for a host tier (`kv_cache.host_tier`)."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.enable_caching = enable_caching
        self.log_stats = log_stats
        self.block_pool = BlockPool(num_blocks, enable_caching,
                                    get_hash_fn(hash_algo, hash_seed), enable_events,
                                    record_evictions, block_size)
        self.prefix_cache_stats = PrefixCacheStats()
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_to_block_hashes: dict[str, list[BlockHash]] = {}
        self.num_cached_block: dict[str, int] = {}

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def _block_hashes(self, request: Any, num_blocks: int) -> list[BlockHash]:
        """The request's hashes, extended to cover its first `num_blocks` full blocks."""
        hashes = self.req_to_block_hashes.setdefault(request.request_id, [])
        start = len(hashes)
        if start >= num_blocks:
            return hashes
        salt = getattr(request, "cache_salt", None)
        lora = getattr(request, "lora_request", None)
        extras: list[tuple | None] = [None] * (num_blocks - start)
        first = (() if salt is None else (salt,)) + (
            () if lora is None else (("lora", lora.lora_int_id),))
        if start == 0 and first:
            extras[0] = first
        bs = self.block_size
        hashes.extend(self.block_pool.hash_fn.chain(
            hashes[-1] if hashes else None, request.all_token_ids[start * bs:num_blocks * bs],
            bs, extras))
        return hashes

    def get_computed_blocks(self, request: Any) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of the request, in full blocks, as (blocks, num_tokens).

        At most (num_tokens - 1) tokens are reused: the last prompt token must be computed
        to get logits. Stops at the first miss (a later block cannot match without its parent).
        Not counted in the stats: a request that waits for room is looked up again each step
        until admitted, so the caller records the lookup it admits with (`record_lookup`).
        """
        if not self.enable_caching:
            return [], 0
        num_tokens = request.num_tokens
        # hash every full block now: the ones past a miss are cached by allocate_slots anyway
        hashes = self._block_hashes(request, num_tokens // self.block_size)
        computed: list[KVCacheBlock] = []
        for block_hash in hashes[:(num_tokens - 1) // self.block_size]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            computed.append(block)
        return computed, len(computed) * self.block_size

    def record_lookup(self, request: Any, num_hit_tokens: int) -> None:
        """Count the lookup a request was first admitted with: its tokens queried,
        `num_hit_tokens` of them found on the device. Once a request, so that the hit rate
        weighs every prompt once: not a waiting one once per step it was looked up in, nor
        a preempted one again when readmitted (its own blocks, still cached, would count as
        hits), as vLLM's stats keep those apart too."""
        if self.log_stats and self.enable_caching:
            stats = self.prefix_cache_stats
            stats.requests += 1
            stats.queries += request.num_tokens
            stats.hits += num_hit_tokens

    def prefix_hashes(self, request: Any, start: int) -> list[BlockHash]:
        """Hashes of the request's blocks from `start` that a prefix hit may cover (not the
        one holding its last token); after `get_computed_blocks`, for a lower tier's lookup."""
        num_blocks = (request.num_tokens - 1) // self.block_size
        return self._block_hashes(request, num_blocks)[start:num_blocks]

    def take_evicted(self) -> list[tuple[BlockHash, int]]:
        """The cached blocks evicted since the last call (`record_evictions`)."""
        return self.block_pool.take_evicted()

    def allocate_slots(self, request: Any, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] | None = None,
                       num_new_computed_tokens: int = 0) -> list[KVCacheBlock] | None:
        """Make room for the request's next `num_new_tokens`; return the newly taken blocks.

        Call before advancing `request.num_computed_tokens`. `new_computed_blocks` is the
        prefix hit from `get_computed_blocks` (fresh requests only). Returns None, changing
        nothing, when the pool cannot supply the blocks; revived ref_cnt-0 hits count against
        free capacity because touching them takes them out of the free queue. Blocks that
        become full with known tokens (those whose KV this step writes) are cached.
        """
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be > 0, got {num_new_tokens}")
        new_computed_blocks = new_computed_blocks or []
        req_id = request.request_id
        req_blocks = self.req_to_blocks.get(req_id, [])
        self._check_computed_blocks(request, req_blocks, new_computed_blocks,
                                    num_new_computed_tokens)

        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_total = num_computed + num_new_tokens
        # blocks before `first_kept` lie wholly before the window of the first new token
        first_kept = self._first_kept_block(num_computed)
        out_of_window = [b for b in req_blocks[:first_kept] if not b.is_null]
        num_held = len(req_blocks)
        kept_hits = new_computed_blocks[max(0, first_kept - num_held):]
        num_skipped_hits = len(new_computed_blocks) - len(kept_hits)
        num_held += len(new_computed_blocks)
        num_null = max(0, first_kept - num_held)  # new positions before the window
        num_new_blocks = max(0, _cdiv(num_total, self.block_size) - num_held - num_null)
        num_revived = sum(1 for b in kept_hits if b.ref_cnt == 0)
        num_released = sum(1 for b in out_of_window if b.ref_cnt == 1)  # not shared
        if num_new_blocks + num_revived > self.block_pool.get_num_free_blocks() + num_released:
            return None

        self._free_out_of_window(req_blocks, first_kept)
        self.block_pool.touch(kept_hits)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        if req_id not in self.req_to_blocks:
            self.req_to_blocks[req_id] = req_blocks
        null = self.block_pool.null_block
        req_blocks.extend([null] * num_skipped_hits)
        req_blocks.extend(kept_hits)
        req_blocks.extend([null] * num_null)
        req_blocks.extend(new_blocks)

        if self.enable_caching:
            num_cached = self.num_cached_block.get(req_id, 0) + len(new_computed_blocks)
            self.num_cached_block[req_id] = num_cached
            self.cache_blocks(request, num_total)
        return new_blocks

    def _first_kept_block(self, position: int) -> int:
        """Index of the first block a token at `position` can attend to (0 without a
        window): the window covers positions position - window + 1 .. position."""
        if self.sliding_window is None:
            return 0
        return max(0, position - self.sliding_window + 1) // self.block_size

    def _free_out_of_window(self, req_blocks: list[KVCacheBlock], first_kept: int) -> None:
        """Release the held blocks before `first_kept`, tail first as `free` does, nulling
        their table entries."""
        stop = min(first_kept, len(req_blocks))
        released = [b for b in req_blocks[:stop] if not b.is_null]
        if released:
            self.block_pool.free_blocks(reversed(released))
            req_blocks[:stop] = [self.block_pool.null_block] * stop

    def cache_blocks(self, request: Any, num_tokens: int) -> None:
        """Cache the request's blocks that its first `num_tokens` fill with known tokens
        (`all_token_ids`). A block whose last slot is scheduled before its token is known
        (async scheduling) is left out; the caller calls again once the token is known."""
        if not self.enable_caching:
            return
        req_id = request.request_id
        num_cached = self.num_cached_block.get(req_id, 0)
        num_full = min(num_tokens, len(request.all_token_ids)) // self.block_size
        if num_full > num_cached:
            hashes = self._block_hashes(request, num_full)
            self.block_pool.cache_full_blocks(self.req_to_blocks[req_id], hashes, num_cached,
                                              num_full, request.all_token_ids)
            self.num_cached_block[req_id] = num_full

    def _check_computed_blocks(self, request: Any, req_blocks: list[KVCacheBlock],
                               new_computed_blocks: list[KVCacheBlock],
                               num_new_computed_tokens: int) -> None:
        """Reject prefix hits that are misused or went stale (evicted since the lookup)."""
        if num_new_computed_tokens != len(new_computed_blocks) * self.block_size:
            raise ValueError(f"num_new_computed_tokens={num_new_computed_tokens} does not match "
                             f"{len(new_computed_blocks)} computed blocks of {self.block_size}")
        if not new_computed_blocks:
            return
        if req_blocks or request.num_computed_tokens:
            raise ValueError(f"request {request.request_id}: computed blocks are only for a "
                             "request that holds no blocks yet")
        hashes = self.req_to_block_hashes.get(request.request_id, [])
        for i, block in enumerate(new_computed_blocks):
            if block.block_hash is None or i >= len(hashes) or block.block_hash != hashes[i]:
                raise ValueError(f"request {request.request_id}: computed block "
                                 f"{block.block_id} no longer holds prefix block {i}")

    def trim(self, request: Any, num_tokens: int) -> int | None:
        """Release the request's blocks past the first `num_tokens` tokens' (the lookahead
        of rejected drafts, which no hash covers: they never held known tokens), tail first.
        Returns how many blocks it keeps when some went, else None."""
        blocks = self.req_to_blocks.get(request.request_id)
        keep = _cdiv(num_tokens, self.block_size)
        if not blocks or len(blocks) <= keep:
            return None
        released = [b for b in blocks[keep:] if not b.is_null]
        del blocks[keep:]
        self.block_pool.free_blocks(reversed(released))
        return keep

    def free(self, request: Any) -> None:
        """Release the request's blocks tail first; a no-op for unknown requests."""
        req_id = request.request_id
        blocks = self.req_to_blocks.pop(req_id, None)
        self.req_to_block_hashes.pop(req_id, None)
        self.num_cached_block.pop(req_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block; False (nothing changed) while requests hold blocks."""
        return self.block_pool.reset_prefix_cache()
