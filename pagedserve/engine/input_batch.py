"""Per-step input buffers that live across steps: staging memory and the block-table rows.

At batch 256 on a GPU a decode step takes ~10 ms, so the CPU side of a step must cost far
less and must never block on the GPU. Two things make that so:

- `StepBuffers`: every input tensor of a step has a fixed-size host buffer (pinned on CUDA)
  and a fixed-size device buffer. The runner writes a step's values into the host buffers
  through numpy views and copies them with `non_blocking=True`: a copy from pinned memory is
  a DMA queued on the stream, while a copy from pageable memory waits for the GPU. Fixed
  device addresses are also what CUDA graphs need: a graph replays reads of the same
  addresses, so its inputs must be written in place.
- `BlockTableRows`: each running request keeps its row of block ids in one numpy table; a
  step appends only the blocks allocated since the last step and gathers the batch's rows
  in one `np.take`, instead of rebuilding every request's list of block ids every step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from pagedserve.core.block_pool import KVCacheBlock


@dataclass
class StagedTensor:
    """A host buffer (numpy view `np`) and its device twin of the same shape."""

    host: Tensor
    device: Tensor
    np: np.ndarray

    @classmethod
    def allocate(cls, shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device) -> StagedTensor:
        on_cuda = device.type == "cuda"
        host = torch.zeros(shape, dtype=dtype, pin_memory=on_cuda)
        twin = torch.zeros(shape, dtype=dtype, device=device) if on_cuda else host
        return cls(host, twin, host.numpy())

    def upload(self, rows: int) -> Tensor:
        """Queue the copy of the first `rows` rows; returns the device view of them."""
        if self.device is not self.host:
            self.device[:rows].copy_(self.host[:rows], non_blocking=True)
        return self.device[:rows]


class StepBuffers:
    """Host and device buffers for the inputs of any step up to the configured limits."""

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int,
                 device: torch.device) -> None:
        def staged(shape, dtype):
            return StagedTensor.allocate(shape, dtype, device)

        self.input_ids = staged((max_tokens,), torch.int64)
        self.positions = staged((max_tokens,), torch.int64)
        self.slot_mapping = staged((max_tokens,), torch.int64)
        self.seq_lens = staged((max_seqs,), torch.int32)
        self.query_start_loc = staged((max_seqs + 1,), torch.int32)
        self.logits_indices = staged((max_seqs,), torch.int64)
        self.block_tables = staged((max_seqs, max_blocks_per_seq), torch.int32)
        # async scheduling: input_ids rows whose token is a row of the last sampled tokens
        self.placeholder_rows = staged((max_seqs,), torch.int64)
        self.placeholder_sources = staged((max_seqs,), torch.int64)
        # The host buffers are rewritten every step: wait for the last step's copies first.
        self._uploaded = torch.cuda.Event() if device.type == "cuda" else None

    def wait_for_uploads(self) -> None:
        if self._uploaded is not None:
            self._uploaded.synchronize()

    def mark_uploaded(self) -> None:
        if self._uploaded is not None:
            self._uploaded.record()


@dataclass
class _Row:
    index: int
    blocks: list[KVCacheBlock]  # the manager's own list: a new list means reallocated
    num_filled: int
    num_nulled: int = 0  # leading entries freed out of a sliding window, zeroed here too


class BlockTableRows:
    """Rows of block ids per request, updated incrementally, padded with the null block 0."""

    def __init__(self, max_blocks_per_seq: int, capacity: int = 64) -> None:
        self.table = np.zeros((capacity, max_blocks_per_seq), dtype=np.int32)
        self._rows: dict[str, _Row] = {}
        self._free = list(range(capacity - 1, -1, -1))

    def rows(self, request_ids: list[str],
             req_to_blocks: dict[str, list[KVCacheBlock]]) -> np.ndarray:
        """Row index of each request, after appending blocks allocated since last time."""
        out = np.empty(len(request_ids), dtype=np.int64)
        for i, request_id in enumerate(request_ids):
            blocks = req_to_blocks[request_id]
            row = self._rows.get(request_id)
            if row is None or row.blocks is not blocks:  # new, or preempted and readmitted
                row = self._assign(request_id, blocks)
            if len(blocks) > row.num_filled:
                self.table[row.index, row.num_filled:len(blocks)] = [
                    b.block_id for b in blocks[row.num_filled:]]
                row.num_filled = len(blocks)
            nulled = row.num_nulled
            while nulled < len(blocks) and blocks[nulled].block_id == 0:  # the null block
                nulled += 1
            if nulled > row.num_nulled:
                self.table[row.index, row.num_nulled:nulled] = 0
                row.num_nulled = nulled
            out[i] = row.index
        return out

    def release(self, request_ids: list[str]) -> None:
        """Forget finished requests; their rows go back to the free list."""
        for request_id in request_ids:
            row = self._rows.pop(request_id, None)
            if row is not None:
                self._free.append(row.index)

    def _assign(self, request_id: str, blocks: list[KVCacheBlock]) -> _Row:
        old = self._rows.get(request_id)
        if old is not None:
            index = old.index
        else:
            if not self._free:
                self._grow()
            index = self._free.pop()
        self.table[index] = 0
        row = self._rows[request_id] = _Row(index, blocks, 0)
        return row

    def _grow(self) -> None:
        capacity = self.table.shape[0]
        self.table = np.concatenate([self.table, np.zeros_like(self.table)])
        self._free.extend(range(2 * capacity - 1, capacity - 1, -1))
