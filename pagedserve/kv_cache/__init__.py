"""The paged KV-cache block manager: pure Python, no torch."""

from pagedserve.kv_cache.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from pagedserve.kv_cache.hashing import BlockHash, hash_block_tokens, set_hash_algo
from pagedserve.kv_cache.kv_cache_manager import KVCacheManager, PrefixCacheStats

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
