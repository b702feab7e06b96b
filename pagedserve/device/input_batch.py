"""Per-step input buffers that live across steps: staging memory and the block-table rows.

At large batch on a GPU a decode step takes milliseconds, so the CPU side of a step must cost
far less and must never block on the GPU (docs/benchmarks.md, "Host-side costs behind the
engine's choices"). Two things make that so:

- `StepBuffers`: every input tensor of a step has a fixed-size host buffer (pinned on CUDA)
  and a fixed-size device buffer. The runner writes a step's values into the host buffers
  through numpy views and copies them with `non_blocking=True`: a copy from pinned memory is
  a DMA queued on the stream, while a copy from pageable memory waits for the GPU. Fixed
  device addresses are also what CUDA graphs need: a graph replays reads of the same
  addresses, so its inputs must be written in place.
- `BlockTableRows`: each running request keeps its row of block ids in one numpy table; a
  step appends only the blocks allocated since the last step (the scheduler sends just
  those) and gathers the batch's rows in one `np.take`, instead of rebuilding every
  request's list of block ids every step.

`CachedRequestState` is the runner's per-request record, so that a step's message needs to
carry only what changed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from pagedserve.messages import LoRARequest
from pagedserve.sampling_params import SamplingParams
from pagedserve.token_sequence import TokenSequence


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
        # a row per sampling request, k + 1 per verified one (speculative decoding)
        self.logits_indices = staged((max_tokens,), torch.int64)
        self.block_tables = staged((max_seqs, max_blocks_per_seq), torch.int32)
        # async scheduling: input_ids rows whose token is a row of the last sampled tokens
        self.placeholder_rows = staged((max_seqs,), torch.int64)
        self.placeholder_sources = staged((max_seqs,), torch.int64)
        # per block-table row, the columns a step may have left nonzero
        self._table_widths = np.zeros(max_seqs, dtype=np.int64)
        # The host buffers are rewritten every step: wait for the last step's copies first.
        self._uploaded = torch.cuda.Event() if device.type == "cuda" else None

    def fill_block_tables(self, table: np.ndarray, table_rows: np.ndarray, rows: int,
                          width: int) -> None:
        """Rows [0, len(table_rows)) from those rows of `table`, padded with the null block
        to `rows`, all of them zero past their blocks. Only the first `width` columns (the
        step's longest sequence's blocks) are copied, and only the columns an earlier step
        left nonzero are cleared: a row has max_model_len / block_size columns, and copying
        them all was a visible part of a step at large batch and long max_model_len (same
        section of docs/benchmarks.md)."""
        num_seqs = len(table_rows)
        host, widths = self.block_tables.np, self._table_widths
        np.take(table[:, :width], table_rows, axis=0, out=host[:num_seqs, :width])
        stale = widths[:num_seqs] > width
        if stale.any():
            host[np.flatnonzero(stale), width:int(widths[:num_seqs].max())] = 0
        widths[:num_seqs] = width
        padding = widths[num_seqs:rows]
        if padding.any():
            host[num_seqs:rows, :int(padding.max())] = 0
            padding[:] = 0

    def pad_rows(self, num_seqs: int, num_tokens: int, rows: int, query_len: int) -> int:
        """Pad a step of `num_seqs` requests and `num_tokens` tokens, written already, to
        `rows` requests of `query_len` tokens each, the shape a captured graph runs
        (`cuda_graphs.py`); returns the padded step's token rows. A padding request's
        tokens are id 0 at positions 0 .. query_len - 1 that write nothing (slot -1) and
        attend causally to as many positions of its block-table row, which
        `fill_block_tables` fills with the null block: finite rows nothing reads."""
        pad = rows - num_seqs
        token_rows = num_tokens + pad * query_len
        self.query_start_loc.np[0] = 0
        self.query_start_loc.np[num_seqs + 1:rows + 1] = (
            num_tokens + query_len * np.arange(1, pad + 1))
        self.input_ids.np[num_tokens:token_rows] = 0
        self.positions.np[num_tokens:token_rows] = np.tile(np.arange(query_len), pad)
        self.slot_mapping.np[num_tokens:token_rows] = -1
        self.seq_lens.np[num_seqs:rows] = query_len
        return token_rows

    def wait_for_uploads(self) -> None:
        if self._uploaded is not None:
            self._uploaded.synchronize()

    def mark_uploaded(self) -> None:
        if self._uploaded is not None:
            self._uploaded.record()


@dataclass(eq=False)
class CachedRequestState(TokenSequence):
    """The runner's own record of a request, from the `NewRequestData` that introduced it:
    its tokens (`TokenSequence`: the prompt, then each token it sampled, appended when the
    step's result is read) and sampling state. Kept across preemption, dropped when the
    request finishes. The scheduler's `Request` is the engine core's record of the same
    request; the runner keeps its own because it may run in another process (a
    tensor-parallel rank) and reads nothing of the scheduler's.

    The sampler reads it as it reads a request (`sampler.SamplingMetadata.from_requests`).
    """

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator | None = None
    lora_request: LoRARequest | None = None  # the adapter it runs under; None: the base

    def __post_init__(self) -> None:
        self._init_tokens()
        # set for the rows a step samples: its tokens not known yet, the drawn one included
        self.num_output_placeholders = 0
        self.num_prompt_logprobs = 0  # prompt positions whose prompt_logprobs were reported
        seed = self.sampling_params.seed
        if seed is not None:
            self.generator = torch.Generator().manual_seed(seed)

    def generator_for(self, device: torch.device) -> torch.Generator | None:
        """The seeded generator on `device`, made there on first use: noise drawn where the
        logits live costs no copy and no host synchronisation. Seeded draws therefore repeat
        per device type, not across CPU and CUDA."""
        if self.generator is not None and self.generator.device.type != device.type:
            self.generator = torch.Generator(device).manual_seed(self.sampling_params.seed)
        return self.generator


class BlockTableRows:
    """Rows of block ids per request, updated incrementally, padded with the null block 0."""

    def __init__(self, max_blocks_per_seq: int, capacity: int = 64) -> None:
        self.table = np.zeros((capacity, max_blocks_per_seq), dtype=np.int32)
        self._index: dict[str, int] = {}  # request id -> its row
        self._num_filled: dict[str, int] = {}
        self._free = list(range(capacity - 1, -1, -1))

    def add(self, request_id: str, block_ids: list[int]) -> None:
        """A row holding `block_ids` (a new request, or one resumed after preemption)."""
        index = self._index.get(request_id)
        if index is None:
            if not self._free:
                self._grow()
            index = self._index[request_id] = self._free.pop()
        self.table[index] = 0
        self.table[index, :len(block_ids)] = block_ids
        self._num_filled[request_id] = len(block_ids)

    def append(self, request_id: str, block_ids: list[int], num_nulled: int = 0) -> None:
        """Add a running request's new blocks; its first `num_nulled` entries became the
        null block (freed out of a sliding window)."""
        filled = self._num_filled[request_id]
        row = self._index[request_id]
        self.table[row, filled:filled + len(block_ids)] = block_ids
        self.table[row, :num_nulled] = 0
        self._num_filled[request_id] = filled + len(block_ids)

    def truncate(self, request_id: str, num_blocks: int) -> None:
        """Keep a request's first `num_blocks` entries (its rejected drafts' blocks went back
        to the pool); unknown requests are skipped (finished since)."""
        row = self._index.get(request_id)
        if row is not None:
            self.table[row, num_blocks:self._num_filled[request_id]] = 0
            self._num_filled[request_id] = min(num_blocks, self._num_filled[request_id])

    def rows(self, request_ids: list[str]) -> np.ndarray:
        """The row index of each request."""
        index = self._index
        return np.fromiter((index[r] for r in request_ids), dtype=np.int64,
                           count=len(request_ids))

    def release(self, request_ids: list[str]) -> None:
        """Forget finished (or preempted) requests; their rows go back to the free list."""
        for request_id in request_ids:
            index = self._index.pop(request_id, None)
            if index is not None:
                del self._num_filled[request_id]
                self._free.append(index)

    def _grow(self) -> None:
        capacity = self.table.shape[0]
        self.table = np.concatenate([self.table, np.zeros_like(self.table)])
        self._free.extend(range(2 * capacity - 1, capacity - 1, -1))
