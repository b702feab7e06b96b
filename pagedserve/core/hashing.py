"""Content hashes for full KV blocks, chained through the parent block's hash.

A block's KV depends on every token before it (attention is causal), so the key of block i
is hash(parent_hash, tokens of block i, extra_keys): two blocks share a key only if their
whole ancestry matches. The chain starts from a root seed (random per process unless set,
so keys are not predictable across tenants; fixed when reproducibility is wanted).

Serialization is fixed-width and length-prefixed, so distinct inputs cannot produce the same
byte string: parent digest (always `digest_size` bytes, the root seed included), token count,
tokens as little-endian int64, then `repr(extra_keys)`. We avoid pickle: packing the ids with
`array` is several times faster and the cost of hashing a 4k-token prompt is on the hot path.

SHA-256 is the default: across a fleet a 64-bit collision means serving another prompt's KV.
xxhash (XXH3-128) is an opt-in fast mode.
"""

from __future__ import annotations

import hashlib
import os
import struct
import sys
from array import array
from collections.abc import Callable, Sequence

import xxhash

BlockHash = bytes | int
"""Opaque; equal content and ancestry give equal hashes. Ours are always `bytes`."""

HashFn = Callable[[BlockHash | None, Sequence[int], "tuple | None"], BlockHash]

_DIGEST_SIZE = {"sha256": 32, "xxhash": 16}
_LITTLE_ENDIAN = sys.byteorder == "little"


def _root_from_seed(seed: int | None) -> bytes:
    if seed is None:
        return os.urandom(32)
    return hashlib.sha256(b"pagedserve-root:" + str(seed).encode()).digest()


_default_algo = "sha256"
_root_seed = _root_from_seed(None)


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    packed = array("q", token_ids)
    if not _LITTLE_ENDIAN:
        packed.byteswap()
    return struct.pack("<I", len(packed)) + packed.tobytes()


def _payload(parent: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple | None,
             digest_size: int) -> bytes:
    if parent is None:
        parent = _root_seed[:digest_size]
    elif not isinstance(parent, bytes) or len(parent) != digest_size:
        raise ValueError(f"parent hash must be {digest_size} bytes from the same algorithm")
    data = parent + _token_bytes(token_ids)
    if extra_keys is not None:
        data += repr(extra_keys).encode()
    return data


def _sha256(parent: BlockHash | None, token_ids: Sequence[int],
            extra_keys: tuple | None = None) -> bytes:
    return hashlib.sha256(_payload(parent, token_ids, extra_keys, 32)).digest()


def _xxhash(parent: BlockHash | None, token_ids: Sequence[int],
            extra_keys: tuple | None = None) -> bytes:
    return xxhash.xxh3_128_digest(_payload(parent, token_ids, extra_keys, 16))


_HASH_FNS: dict[str, HashFn] = {"sha256": _sha256, "xxhash": _xxhash}


def get_hash_fn(name: str) -> HashFn:
    """The block hash function for algorithm `name` ("sha256" or "xxhash")."""
    try:
        return _HASH_FNS[name]
    except KeyError:
        raise ValueError(f"unknown hash algorithm {name!r}; choose one of "
                         f"{sorted(_HASH_FNS)}") from None


def set_hash_algo(name: str = "sha256", seed: int | None = None) -> None:
    """Select the process-wide default algorithm and root seed (None = fresh random seed).

    A fixed seed makes hashes reproducible across processes (tests, shared caches); the
    default random seed keeps them unguessable.
    """
    global _default_algo, _root_seed
    get_hash_fn(name)
    _default_algo = name
    _root_seed = _root_from_seed(seed)


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int],
                      extra_keys: tuple | None = None) -> BlockHash:
    """Hash one full block with the process-wide algorithm; `None` parent = first block."""
    return _HASH_FNS[_default_algo](parent_hash, token_ids, extra_keys)
