"""The prefix cache's events in vLLM's published schema, so KV-aware routers read them as
they read vLLM's (llm-d's KV-cache indexer, Dynamo's KV router, Ray Serve LLM's router).

Every struct is msgpack-encoded as an array (`array_like`), an event's first element its tag
(the class name), its fields in declaration order: positions are the contract, names are
not sent. Block hashes go out as vLLM's default external form, the low 64 bits of the
engine's digest as an unsigned integer (`external_hash`): a router compares them with the
hashes it computes from a prompt (`BlockHasher` rooted at the fleet's shared
`prefix_caching_hash_seed`, then `external_hash`). `medium` names the tier in vLLM's
vocabulary: "GPU" for the engine's own KV pool (whatever the device), "CPU" for the host
tier (`host_tier`), whose stores carry no token ids (it indexes blocks by hash alone), and
"DISK" for the disk tier below it (the same index over files).
"""

from __future__ import annotations

import msgspec

from pagedserve.kv_cache.hashing import BlockHash

MEDIUM_POOL = "GPU"
MEDIUM_HOST = "CPU"
MEDIUM_DISK = "DISK"


def external_hash(block_hash: BlockHash) -> int:
    """The hash as routers see it: the digest's last 8 bytes, big-endian, unsigned."""
    if isinstance(block_hash, int):
        return block_hash & 0xFFFF_FFFF_FFFF_FFFF
    return int.from_bytes(block_hash[-8:], "big")


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True,
                   tag=True):
    """One change to what the cache holds; subclasses are tagged by their class name."""


class BlockStored(KVCacheEvent):
    """Consecutive full blocks entered the cache: `block_hashes` in chain order,
    `parent_block_hash` the hash of the block before the first (None: a prompt's first
    block, or the host tier), `token_ids` the blocks' tokens (`block_size` each)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    """Cached blocks were evicted from `medium`: their hashes no longer find them there."""

    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    """Every cached hash was forgotten (`reset_prefix_cache`)."""


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    """One publish: the events of one engine step. `data_parallel_rank` tells apart the
    engines that share an endpoint's port range (vLLM's DP ranks); a lone engine is 0."""

    ts: float  # time.time() when the batch was published
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None
