"""The disk tier's files: a block reads back only whole, as the block it was written as,
under the fingerprint it was written under; a restart's scan finds them, oldest first."""

from __future__ import annotations

import logging
import os

import pytest

from pagedserve.kv_cache import disk_format

FIELDS = {"model": "m", "block_size": 16, "hash_seed": "s"}
PAYLOAD = bytes(range(256)) * 8


@pytest.fixture
def run_dir(tmp_path):
    return disk_format.open_run_dir(tmp_path, FIELDS)


def write(run_dir, rank, slot, block_hash, payload=PAYLOAD):
    directory = disk_format.rank_dir(run_dir, rank)
    directory.mkdir(parents=True, exist_ok=True)
    path = disk_format.slot_path(directory, slot)
    disk_format.write_block(path, block_hash, disk_format.fingerprint(FIELDS)[1],
                            memoryview(payload))
    return path


@pytest.mark.parametrize("block_hash", [b"\x01" * 32, 12345678901234567890, -5])
def test_a_block_reads_back_whole(run_dir, block_hash):
    path = write(run_dir, 0, 3, block_hash)
    digest = disk_format.fingerprint(FIELDS)[1]
    assert disk_format.read_block(path, block_hash, digest, len(PAYLOAD)) == PAYLOAD


@pytest.mark.parametrize("damage, why", [
    (lambda data: data[:len(data) - 100], "truncated"),
    (lambda data: data[:-1] + bytes([data[-1] ^ 1]), "checksum mismatch"),
    (lambda data: data[:10], "missing or not a block file"),
])
def test_a_damaged_file_is_a_logged_miss(run_dir, damage, why, caplog):
    path = write(run_dir, 0, 0, b"h")
    path.write_bytes(damage(path.read_bytes()))
    digest = disk_format.fingerprint(FIELDS)[1]
    with caplog.at_level(logging.WARNING, logger="pagedserve.kv_cache.disk_format"):
        assert disk_format.read_block(path, b"h", digest, len(PAYLOAD)) is None
    assert why in caplog.text and "recomputed" in caplog.text


def test_another_block_or_fingerprint_is_a_miss(run_dir):
    path = write(run_dir, 0, 0, b"h")
    digest = disk_format.fingerprint(FIELDS)[1]
    assert disk_format.read_block(path, b"other", digest, len(PAYLOAD)) is None
    other = disk_format.fingerprint({**FIELDS, "block_size": 32})[1]
    assert disk_format.read_block(path, b"h", other, len(PAYLOAD)) is None


def test_the_scan_finds_blocks_whole_on_every_rank_oldest_first(run_dir):
    digest = disk_format.fingerprint(FIELDS)[1]
    for slot, block_hash in ((0, b"a"), (1, b"b"), (2, b"c"), (9, b"beyond")):
        for rank in (0, 1):
            path = write(run_dir, rank, slot, block_hash if (slot, rank) != (2, 1) else b"x")
            os.utime(path, (100 - slot, 100 - slot))  # slot 1 older than slot 0
    assert disk_format.scan(run_dir, digest, 2, 4) == [(b"b", 1), (b"a", 0)]
    assert [h for h, _ in disk_format.scan(run_dir, digest, 1, 4)] == [b"c", b"b", b"a"]


def test_another_fingerprint_directory_is_reported(tmp_path, caplog):
    disk_format.open_run_dir(tmp_path, FIELDS)
    with caplog.at_level(logging.WARNING, logger="pagedserve.kv_cache.disk_format"):
        disk_format.open_run_dir(tmp_path, {**FIELDS, "hash_seed": "t"})
    assert "they are not used" in caplog.text
