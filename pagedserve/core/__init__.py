"""The paged KV-cache block manager: pure Python, no torch."""

from pagedserve.core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from pagedserve.core.hashing import BlockHash, hash_block_tokens, set_hash_algo
from pagedserve.core.kv_cache_manager import KVCacheManager, PrefixCacheStats

__all__ = [
    "BlockHash",
    "BlockPool",
    "FreeKVCacheBlockQueue",
    "KVCacheBlock",
    "KVCacheManager",
    "PrefixCacheStats",
    "hash_block_tokens",
    "set_hash_algo",
]
