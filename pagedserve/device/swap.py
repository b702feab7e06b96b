"""Swap space: block ids of the CPU copy of the KV cache, for preemption by swapping.

A request preempted in "swap" mode keeps the KV it has computed: the scheduler takes CPU
block ids here, the runner copies the GPU blocks into those CPU blocks before the step runs
(the freed GPU blocks may be written by that very step), and on readmission the copy goes
the other way. The CPU tensors themselves belong to the model runner; this module only hands
out ids, so the scheduler stays free of tensors.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SwappedRequest:
    """Where a swapped-out request's KV sits: CPU block i holds its logical block i."""

    cpu_block_ids: list[int]
    num_computed_tokens: int


class SwapSpace:
    """A free list of CPU block ids (no null block, no caching: a plain stack)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int] | None:
        """`count` block ids, or None (taking none) when the swap space is short."""
        if count > len(self._free):
            return None
        taken = self._free[len(self._free) - count:]
        del self._free[len(self._free) - count:]
        return taken[::-1]

    def free(self, block_ids: list[int]) -> None:
        self._free.extend(reversed(block_ids))
