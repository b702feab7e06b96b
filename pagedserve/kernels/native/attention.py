"""One layer's K/V store and paged decode attention on the CPU (`attention.c`): float32
arithmetic over float32 or bfloat16 caches.

The C code trusts every pointer, stride and index it is given, so the checks here are its
contract: a tensor that breaks it would be read or written out of bounds instead of raising.
A step's index tensors are the same for every layer, so they are checked once, values
included, into a `StepIndices`; each layer's call checks only its own tensors.
"""

from __future__ import annotations

from ctypes import c_float, c_int, c_int64, c_void_p
from dataclasses import dataclass
from functools import cache

import torch
from torch import Tensor

from pagedserve.kernels.native.build import function

MAX_GROUP = 16  # query heads per kv head (MAX_GROUP in attention.c)
MAX_HEAD_DIM = 256  # MAX_DIM in attention.c
CACHE_DTYPES = (torch.float32, torch.bfloat16)


@cache
def kernel():
    """The C function through ctypes (looked up once), or None where the library is
    missing (no compiler, no AVX2)."""
    return function("pagedserve_store_and_decode", c_void_p, c_int64, c_void_p, c_int64,
                    c_void_p, c_int64, c_void_p, c_int64, c_void_p, c_void_p, c_void_p, c_int64,
                    c_void_p, c_int64, c_int64, c_int64, c_int64, c_int64, c_float, c_int64,
                    c_void_p, c_int, c_int)


def available() -> bool:
    return kernel() is not None


def supports(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the kernel handles this head shape (else the caller uses torch)."""
    return (num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= MAX_GROUP
            and head_dim % 8 == 0 and 0 < head_dim <= MAX_HEAD_DIM)


@dataclass(frozen=True)
class StepIndices:
    """A step's slots and decode block tables, checked against a cache geometry.

    slot_mapping: int64 [T] (-1: skip the row); block_tables: int32 [S, max_blocks] and
    seq_lens: int32 [S] for the S decodes. Build with `check`.
    """

    slot_mapping: Tensor
    block_tables: Tensor
    seq_lens: Tensor
    num_blocks: int
    block_size: int

    @classmethod
    def check(cls, slot_mapping: Tensor, block_tables: Tensor, seq_lens: Tensor,
              num_blocks: int, block_size: int) -> StepIndices:
        """Raise unless the layouts are the kernel's, every slot is -1 or in the cache, and
        every decode's seq_len is at least 1 and covered by its block table row, whose
        entries are in the cache."""
        num_seqs = seq_lens.shape[0]
        _check_index("slot_mapping", slot_mapping, torch.int64, (slot_mapping.shape[0],))
        _check_index("seq_lens", seq_lens, torch.int32, (num_seqs,))
        _check_index("block_tables", block_tables, torch.int32,
                     (num_seqs, block_tables.shape[-1]))
        if slot_mapping.numel() and not (bool(slot_mapping.min() >= -1)
                                         and bool(slot_mapping.max() < num_blocks * block_size)):
            raise ValueError(f"slot_mapping outside the cache's {num_blocks} blocks of "
                             f"{block_size}")
        if num_seqs and not (bool(seq_lens.min() >= 1)
                             and bool(seq_lens.max() <= block_tables.shape[1] * block_size)):
            raise ValueError("a decode's seq_len exceeds its block table (or is below 1)")
        if num_seqs and not (bool(block_tables.min() >= 0)
                             and bool(block_tables.max() < num_blocks)):
            raise ValueError(f"block table entries outside the cache's {num_blocks} blocks")
        return cls(slot_mapping, block_tables, seq_lens, num_blocks, block_size)


def store_and_decode(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                     indices: StepIndices, scale: float, out: Tensor,
                     window: int | None = None) -> None:
    """Write k/v [T, Hkv, D] into their cache slots, then for each of the S decodes:
    out[s] = attention of its one query q[s] [Hq, D] over its first seq_lens[s] cached tokens
    (the last `window` of them with a window; the block table entries before those are not
    read).

    Caches: float32 or bfloat16 [num_blocks, block_size, Hkv, D] as `indices` was checked
    for, contiguous, k and v of their dtype; q: [>= S, Hq, D] and out: contiguous
    [>= S, Hq, D], float32 whatever the caches' dtype.
    """
    _check_caches(k_cache, v_cache, indices)
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_seqs, num_heads = indices.seq_lens.shape[0], q.shape[1]
    if not supports(num_heads, num_kv_heads, head_dim):
        raise ValueError(f"unsupported heads: {num_heads} query / {num_kv_heads} kv heads of "
                         f"dim {head_dim}")
    num_tokens = indices.slot_mapping.shape[0]
    q = _rows("q", q, num_heads, head_dim, num_seqs)
    k = _rows("k", k, num_kv_heads, head_dim, num_tokens, k_cache.dtype)
    v = _rows("v", v, num_kv_heads, head_dim, num_tokens, k_cache.dtype)
    _check_shape("out", out, num_heads, head_dim, num_seqs)
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")
    tables = indices.block_tables
    kernel()(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
              indices.slot_mapping.data_ptr(), num_tokens, k_cache.data_ptr(),
              v_cache.data_ptr(), tables.data_ptr(), tables.stride(0),
              indices.seq_lens.data_ptr(), num_seqs, num_heads, num_kv_heads, head_dim,
              block_size, scale, 0 if window is None else window, out.data_ptr(),
              torch.get_num_threads(), int(k_cache.dtype == torch.bfloat16))


def _check_caches(k_cache: Tensor, v_cache: Tensor, indices: StepIndices) -> None:
    if (k_cache.dtype not in CACHE_DTYPES or v_cache.dtype != k_cache.dtype
            or not k_cache.is_cpu or not v_cache.is_cpu):
        raise ValueError(f"the native attention kernel takes float32 or bfloat16 CPU caches "
                         f"of one dtype, got "
                         f"{k_cache.dtype} on {k_cache.device}, {v_cache.dtype} on "
                         f"{v_cache.device}")
    if (k_cache.dim() != 4 or v_cache.shape != k_cache.shape
            or k_cache.shape[:2] != (indices.num_blocks, indices.block_size)):
        raise ValueError(f"k_cache and v_cache must both be [{indices.num_blocks}, "
                         f"{indices.block_size}, num_kv_heads, head_dim], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the KV caches must be contiguous")


def _check_shape(name: str, x: Tensor, heads: int, head_dim: int, min_rows: int,
                 dtype: torch.dtype = torch.float32) -> None:
    """x: `dtype` [>= min_rows, heads, head_dim] on the CPU."""
    if x.dtype != dtype or not x.is_cpu or x.dim() != 3:
        raise ValueError(f"{name} must be a 3-d {dtype} CPU tensor, got {x.dtype} "
                         f"{tuple(x.shape)} on {x.device}")
    rows, *row_shape = x.shape
    if rows < min_rows or row_shape != [heads, head_dim]:
        raise ValueError(f"{name} must be [>= {min_rows}, {heads}, {head_dim}], got "
                         f"{tuple(x.shape)}")


def _rows(name: str, x: Tensor, heads: int, head_dim: int, min_rows: int,
          dtype: torch.dtype = torch.float32) -> Tensor:
    """x checked, with each row's heads contiguous as the kernel reads them: the q/k/v split
    views of a fused projection already are; anything else is copied."""
    _check_shape(name, x, heads, head_dim, min_rows, dtype)
    return x if x.stride()[1:] == (head_dim, 1) else x.contiguous()


def _check_index(name: str, x: Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    if x.dtype != dtype or not x.is_cpu or x.shape != shape or x.stride(-1) != 1:
        raise ValueError(f"{name} must be {dtype} {list(shape)} on the CPU with a unit last "
                         f"stride, got {x.dtype} {tuple(x.shape)} on {x.device}")
