"""Triton kernels for the paged KV cache: store-KV (and store-KV with q/k's rotation), paged
decode v1/v2, paged prefill and block copies. On a CPU they run only if TRITON_INTERPRET=1 was
set before this import."""

from pagedserve.kernels.triton.attention.cache_ops import copy_blocks
from pagedserve.kernels.triton.attention.decode import (DecodeConfig, choose_partition,
                                                        longest_first, paged_decode,
                                                        paged_decode_v1, paged_decode_v2, use_v2)
from pagedserve.kernels.triton.attention.prefill import PrefillConfig, paged_prefill
from pagedserve.kernels.triton.attention.store_kv import rotate_store_kv_, store_kv

__all__ = ["DecodeConfig", "choose_partition", "copy_blocks", "PrefillConfig", "longest_first",
           "paged_decode", "paged_decode_v1", "paged_decode_v2", "paged_prefill",
           "rotate_store_kv_", "store_kv", "use_v2"]
