"""Content hashes for full KV blocks, chained through the parent block's hash.

A block's KV depends on every token before it (attention is causal), so the key of block i
is hash(parent_hash, tokens of block i, extra_keys): two blocks share a key only if their
whole ancestry matches. The chain starts from a root seed: random per process unless set, so
keys are not predictable across tenants; fixed (an engine's `prefix_caching_hash_seed`, or
`set_hash_algo(seed=...)` for the whole process) where hashes must agree across processes,
e.g. replicas behind a router that sends a prompt to the replica caching its prefix.

Serialization is fixed-width and length-prefixed, so distinct inputs cannot produce the same
byte string: parent digest (always `digest_size` bytes, the root seed included), token count,
tokens as little-endian int64, then `repr(extra_keys)`. No pickle: packing a whole prompt with
`struct` once and slicing per block is what keeps a 4k-token prompt well under a millisecond.

SHA-256 is the default: across a fleet a 64-bit collision means serving another prompt's KV.
xxhash (XXH3-128) is an opt-in fast mode.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Callable, Sequence
from typing import Any

import xxhash

BlockHash = bytes | int
"""Opaque; equal content and ancestry give equal hashes. Ours are always `bytes`."""


def _root_from_seed(seed: int | str | None) -> bytes:
    if seed is None:
        return os.urandom(32)
    return hashlib.sha256(b"pagedserve-root:" + str(seed).encode()).digest()


_default_algo = "sha256"
_root_seed = _root_from_seed(None)
_COUNT = struct.Struct("<I")


class BlockHasher:
    """A block hash function: callable on one block, `chain` for many blocks in one pass.

    `chain` packs all token ids once (struct, little-endian int64) and slices the bytes per
    block: converting Python ints to bytes block by block costs as much as the digest.
    """

    def __init__(self, name: str, new: Callable[[bytes], Any], digest_size: int,
                 root: bytes | None = None) -> None:
        self.name = name
        self._new = new
        self.digest_size = digest_size
        self._root = root  # None: the process-wide root seed, read at each call

    def with_seed(self, seed: int | str) -> BlockHasher:
        """The same algorithm with its own root from `seed` (same seed, same hashes)."""
        return BlockHasher(self.name, self._new, self.digest_size, _root_from_seed(seed))

    def __call__(self, parent_hash: BlockHash | None, token_ids: Sequence[int],
                 extra_keys: tuple | None = None) -> bytes:
        return self.chain(parent_hash, token_ids, len(token_ids), [extra_keys])[0]

    def chain(self, parent_hash: BlockHash | None, token_ids: Sequence[int], block_size: int,
              extra_keys: Sequence[tuple | None]) -> list[bytes]:
        """Hashes of the consecutive blocks of `token_ids`, one per entry of `extra_keys`."""
        num_blocks = len(extra_keys)
        if num_blocks * block_size != len(token_ids):
            raise ValueError(f"{len(token_ids)} tokens are not {num_blocks} blocks of "
                             f"{block_size}")
        if parent_hash is None:
            parent = (self._root or _root_seed)[:self.digest_size]
        elif isinstance(parent_hash, bytes) and len(parent_hash) == self.digest_size:
            parent = parent_hash
        else:
            raise ValueError(f"parent hash must be {self.digest_size} bytes from {self.name}")
        try:
            data = struct.pack(f"<{len(token_ids)}q", *token_ids)
        except struct.error as exc:
            raise ValueError(f"token ids must be 64-bit integers: {exc}") from None
        header = _COUNT.pack(block_size)
        stride = 8 * block_size
        blocks = [header + data[o:o + stride] for o in range(0, num_blocks * stride, stride)]
        new = self._new
        out = []
        if extra_keys.count(None) == num_blocks:
            for block in blocks:
                parent = new(parent + block).digest()
                out.append(parent)
            return out
        encoded = {extra: repr(extra).encode() for extra in set(extra_keys) if extra is not None}
        for block, extra in zip(blocks, extra_keys):
            payload = parent + block if extra is None else parent + block + encoded[extra]
            parent = new(payload).digest()
            out.append(parent)
        return out


_HASHERS = {"sha256": BlockHasher("sha256", hashlib.sha256, 32),
            "xxhash": BlockHasher("xxhash", xxhash.xxh3_128, 16)}


def get_hash_fn(name: str, seed: int | str | None = None) -> BlockHasher:
    """The block hash function for algorithm `name` ("sha256" or "xxhash"), rooted at `seed`
    (None: the process-wide root)."""
    try:
        hasher = _HASHERS[name]
    except KeyError:
        raise ValueError(f"unknown hash algorithm {name!r}; choose one of "
                         f"{sorted(_HASHERS)}") from None
    return hasher if seed is None else hasher.with_seed(seed)


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
    return _HASHERS[_default_algo](parent_hash, token_ids, extra_keys)
