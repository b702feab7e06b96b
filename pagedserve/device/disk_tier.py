"""This rank's disk-tier files (`kv_cache.disk_format`): host-tier slots written to them and
read back from them.

The disk tier sits below the host tier and is reached only through it: a block the host
tier drops is written from its host slot (a spill), and a block found on disk is read into
a host slot (a load), from which the usual recall copies it to the device. So this is plain
file I/O on CPU tensors, the same on the CPU engine and on CUDA (where the host slots are
pinned memory), and each rank keeps its own shard in a directory of its own.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from pagedserve.kv_cache.disk_format import read_block, slot_path, write_block
from pagedserve.kv_cache.hashing import BlockHash

HostCaches = list[tuple[Tensor, Tensor]]


class DiskBlocks:
    def __init__(self, directory: Path, digest: bytes) -> None:
        self.directory = directory
        self.digest = digest
        directory.mkdir(parents=True, exist_ok=True)

    def spill(self, host_caches: HostCaches, spills: list[tuple[int, int, BlockHash]]) -> None:
        """Write each (host slot, disk slot, hash) block to its file."""
        for host_slot, disk_slot, block_hash in spills:
            payload = torch.cat([_bytes_of(t[host_slot]) for pair in host_caches for t in pair])
            write_block(slot_path(self.directory, disk_slot), block_hash, self.digest,
                        memoryview(payload.numpy()))

    def load(self, host_caches: HostCaches, loads: list[tuple[int, int, BlockHash]]
             ) -> list[bool]:
        """Read each (disk slot, host slot, hash) block into its host slot; per load, whether
        its file read back whole (a failed one leaves the slot's content undefined)."""
        views = [_bytes_of(t[0]) for pair in host_caches for t in pair]
        nbytes = sum(view.numel() for view in views)
        done = []
        for disk_slot, host_slot, block_hash in loads:
            payload = read_block(slot_path(self.directory, disk_slot), block_hash, self.digest,
                                 nbytes)
            done.append(payload is not None)
            if payload is None:
                continue
            flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            offset = 0
            for pair in host_caches:
                for t in pair:
                    target = _bytes_of(t[host_slot])
                    target.copy_(flat[offset:offset + target.numel()])
                    offset += target.numel()
        return done


def _bytes_of(block: Tensor) -> Tensor:
    """A contiguous block's storage as a flat uint8 view (any dtype, fp8 included)."""
    return block.reshape(-1).view(torch.uint8)
