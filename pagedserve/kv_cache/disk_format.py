"""The disk tier's files: one block (one rank's shard of its KV, every layer) per file slot.

Why a header and a checksum: the files outlive the process. A restart must know which block
each file holds (its hash, in the header) without trusting that anything else is left
where it was; and a file cut short by a crash, or damaged on the disk, must read as a miss
(the block is recomputed), never as KV. So each file is `header + payload`, the header
naming the block's hash, the payload's length and its XXH3-64 checksum, and a reader checks
all three against what it expects.

Why a fingerprint: a block hash says which tokens the KV is of, not which model, dtype or
layout computed it. The directory of a run is named by a digest of everything that shapes
a block's bytes and its hash (model, dtypes, block size, KV layout, tensor-parallel size,
hash algorithm and seed), with that description beside it (`fingerprint.json`); a run finds
only the files written under its own fingerprint, and says so when the directory holds
others. With a random hash seed (none set) no later run can find a block again, so nothing
is restored.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
from pathlib import Path

import xxhash

from pagedserve.kv_cache.hashing import BlockHash

logger = logging.getLogger(__name__)

MAGIC = b"PSKVBLK1"
# magic, fingerprint digest, hash kind (0 bytes, 1 int), hash length, payload length, checksum
_HEAD = struct.Struct("<8s16sBHQQ")
FINGERPRINT_FILE = "fingerprint.json"


def fingerprint(fields: dict) -> tuple[str, bytes]:
    """The directory name and the 16-byte digest of a run's block-shaping `fields`."""
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).digest()[:16]
    return digest.hex(), digest


def open_run_dir(root: str | Path, fields: dict) -> Path:
    """The directory of this run's fingerprint under `root`, created with its description;
    other fingerprints' directories are left alone and reported."""
    root = Path(root)
    name, _ = fingerprint(fields)
    for other in sorted(root.glob(f"*/{FINGERPRINT_FILE}")) if root.is_dir() else []:
        if other.parent.name != name:
            logger.warning("kv offload: %s holds blocks written under another model, dtype, "
                           "block size, KV layout or hash seed (%s); they are not used",
                           other.parent, other.read_text().strip())
    run_dir = root / name
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / FINGERPRINT_FILE).write_text(json.dumps(fields, sort_keys=True) + "\n")
    return run_dir


def rank_dir(run_dir: Path, rank: int) -> Path:
    return run_dir / f"rank{rank}"


def slot_path(directory: Path, slot: int) -> Path:
    return directory / f"{slot}.kv"


def _hash_bytes(block_hash: BlockHash) -> tuple[int, bytes]:
    if isinstance(block_hash, bytes):
        return 0, block_hash
    return 1, block_hash.to_bytes((block_hash.bit_length() + 8) // 8, "little", signed=True)


def _hash_of(kind: int, raw: bytes) -> BlockHash:
    return raw if kind == 0 else int.from_bytes(raw, "little", signed=True)


def write_block(path: Path, block_hash: BlockHash, digest: bytes, payload: memoryview) -> None:
    """Write one block's file whole or not at all (a temporary file, then a rename)."""
    kind, raw = _hash_bytes(block_hash)
    head = _HEAD.pack(MAGIC, digest, kind, len(raw), payload.nbytes,
                      xxhash.xxh3_64_intdigest(payload))
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(head + raw)
        f.write(payload)
    os.replace(tmp, path)


def read_header(path: Path, digest: bytes) -> tuple[BlockHash, int, int, int] | None:
    """(hash, payload offset, payload length, checksum) of a file written under `digest`;
    None when missing or not such a file."""
    try:
        with open(path, "rb") as f:
            head = f.read(_HEAD.size)
            if len(head) < _HEAD.size:
                return None
            magic, file_digest, kind, hash_len, length, checksum = _HEAD.unpack(head)
            if magic != MAGIC or file_digest != digest or kind > 1:
                return None
            raw = f.read(hash_len)
    except OSError:
        return None
    if len(raw) != hash_len:
        return None
    return _hash_of(kind, raw), _HEAD.size + hash_len, length, checksum


def read_block(path: Path, block_hash: BlockHash, digest: bytes, nbytes: int) -> bytes | None:
    """The payload of `block_hash`'s file, or None (logged) when it is missing, holds
    another block, is truncated or fails its checksum."""
    header = read_header(path, digest)
    why = None
    if header is None:
        why = "missing or not a block file of this run"
    elif header[0] != block_hash:
        why = "holds another block"
    elif header[2] != nbytes:
        why = f"payload of {header[2]} bytes, expected {nbytes}"
    else:
        try:
            with open(path, "rb") as f:
                f.seek(header[1])
                payload = f.read(nbytes + 1)
        except OSError as e:
            payload, why = b"", f"unreadable ({e})"
        if why is None and len(payload) != nbytes:
            why = f"truncated ({len(payload)} of {nbytes} bytes)"
        elif why is None and xxhash.xxh3_64_intdigest(payload) != header[3]:
            why = "checksum mismatch"
        if why is None:
            return payload
    logger.warning("kv offload: %s: %s; the block is recomputed", path, why)
    return None


def scan(run_dir: Path, digest: bytes, num_ranks: int, num_slots: int
         ) -> list[tuple[BlockHash, int]]:
    """The blocks a previous run left whole in header on every rank, oldest file first, as
    (hash, slot) for the tier's `restore` (payloads are checked when loaded)."""
    found = []
    first = rank_dir(run_dir, 0)
    for path in first.glob("*.kv") if first.is_dir() else []:
        if not path.stem.isdigit() or int(path.stem) >= num_slots:
            continue
        header = read_header(path, digest)
        if header is None:
            continue
        slot = int(path.stem)
        if all((h := read_header(slot_path(rank_dir(run_dir, r), slot), digest)) is not None
               and h[0] == header[0] for r in range(1, num_ranks)):
            found.append((path.stat().st_mtime, slot, header[0]))
    found.sort(key=lambda item: item[:2])
    return [(block_hash, slot) for _, slot, block_hash in found]
