"""This rank's disk-tier files (`kv_cache.disk_format`): host-tier slots written to them and
read back from them.

The disk tier sits below the host tier and is reached only through it: a block the host
tier drops is written from its host slot (a spill), and a block found on disk is read into
a host slot (a load), from which the usual recall copies it to the device. So this is plain
file I/O on CPU tensors, the same on the CPU engine and on CUDA (where the host slots are
page-locked), and each rank keeps its own shard in a directory of its own. A slot is written and
read whole, as one row of bytes (every layer's K and V of the block, in layer order).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from pagedserve.kv_cache.disk_format import read_block, slot_path, write_block
from pagedserve.kv_cache.hashing import BlockHash

class DiskBlocks:
    def __init__(self, directory: Path, digest: bytes) -> None:
        self.directory = directory
        self.digest = digest
        directory.mkdir(parents=True, exist_ok=True)

    def spill(self, row_of: Callable[[int], Tensor],
              spills: list[tuple[int, int, BlockHash]]) -> None:
        """Write each (host slot, disk slot, hash) block to its file: the slot's bytes, every
        layer's K and V in layer order (`tier_copies.TierCopies.slot_row`)."""
        for host_slot, disk_slot, block_hash in spills:
            write_block(slot_path(self.directory, disk_slot), block_hash, self.digest,
                        memoryview(row_of(host_slot).numpy()))

    def load(self, fill: Callable[[int, Tensor], None], slot_bytes: int,
             loads: list[tuple[int, int, BlockHash]]) -> list[bool]:
        """Read each (disk slot, host slot, hash) block into its host slot (`fill`, from the
        bytes `spill` wrote); per load, whether its file read back whole (a failed one
        leaves the slot's content undefined)."""
        done = []
        for disk_slot, host_slot, block_hash in loads:
            payload = read_block(slot_path(self.directory, disk_slot), block_hash, self.digest,
                                 slot_bytes)
            done.append(payload is not None)
            if payload is not None:
                fill(host_slot, torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        return done
