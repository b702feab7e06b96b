"""Triton kernels for the paged KV cache. Importing this compiles nothing; on a CPU the
kernels run only if TRITON_INTERPRET=1 was set before this import."""

from pagedserve.attention.kernels.cache_ops import copy_blocks
from pagedserve.attention.kernels.decode import (DecodeConfig, choose_partition, longest_first,
                                                 paged_decode, paged_decode_v1, paged_decode_v2,
                                                 use_v2)
from pagedserve.attention.kernels.prefill import PrefillConfig, paged_prefill
from pagedserve.attention.kernels.store_kv import store_kv

__all__ = ["DecodeConfig", "choose_partition", "copy_blocks", "PrefillConfig", "longest_first",
           "paged_decode", "paged_decode_v1", "paged_decode_v2", "paged_prefill", "store_kv",
           "use_v2"]
