"""CUDA graphs of the steps whose rows all have one query length: decodes (one token each)
and, with speculative decoding, verifies (each request's last token and its k drafts), one
graph per batch size of a ladder.

A decode step of a 28-layer model is hundreds of kernel launches, and from Python each costs
more than the kernel itself at small batch (a Triton launch far more than a torch op's;
docs/benchmarks.md, "Host-side costs behind the engine's choices"). A graph replays them all
with one launch. A verify is the same forward over k + 1 tokens per request, as launch-bound
at the small batches speculation runs at. A graph replays fixed addresses and fixed launch
grids, so:

- inputs are the runner's `StepBuffers` device tensors, written in place every step, and a
  batch runs in the smallest captured size >= its size, padded with rows of the same query
  length that write nothing (slot -1) and attend to the first positions of the null block
  (`StepBuffers.pad_rows`);
- a decode graph's attention is captured with `max_seq_len` = max_model_len. v1's grid
  ignores it; v2's grid is then sized for the longest possible context, and its programs
  past a sequence's length exit at once while the reduce only reads the partitions that
  the sequence has (see kernels/triton/attention/decode.py), so one graph serves every
  context length;
- a verify graph's attention is the prefill path with `max_query_len` = k + 1 and regular
  query starts (request i's tokens at i * (k + 1)): the prefill kernel's grid is fixed by
  the query length and the batch, and it reads each sequence's length and prefix from the
  buffers, so one graph serves every context length too.

With LoRA on, each decode size is captured twice (as vLLM's `cudagraph_specialize_lora`):
with the adapters' kernels, which read each row's slot from its buffer (-1, the base model,
for padding), so one graph serves any mix of adapters; and without them, for steps whose
rows are all the base model's, which then cost what they cost without LoRA. The runner
picks by whether the step has a `LoRABatch`. Verify graphs are captured without them: a
verify with an adapter row runs eagerly.

The forward a graph captures may return more than the final hidden states (EAGLE-3's target
also returns three layers' residual streams: `Decoder.forward_capturing`); whatever it
returns lives in the graphs' memory pool and is overwritten by the next replay of any graph
of that pool, so a caller copies what it keeps past the step's own launches.

Steps that mix query lengths (a prefill chunk, decodes beside verifies, verifies of fewer
drafts) run eagerly (`graph_shape`).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from pagedserve.attention.backend import AttentionBackend, set_forward_context
from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.device.input_batch import StepBuffers
from pagedserve.device.lora_slots import LoRASlots
from pagedserve.model.lora import lora_context


def batch_size_ladder(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16: padding wastes at most 15 rows (~6% at the
    small end of the 16-steps), and ~20 graphs capture in seconds."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch]
    sizes += list(range(16, max_batch, 16))
    return sizes + [max_batch]


def padded(sizes: Sequence[int], batch: int) -> int | None:
    """The smallest of the ascending `sizes` that holds `batch`; None when none does."""
    index = bisect.bisect_left(sizes, batch)
    return sizes[index] if index < len(sizes) else None


def graph_shape(num_new: np.ndarray, num_drafts: np.ndarray,
                ladders: Mapping[int, Sequence[int]]) -> tuple[int, int] | None:
    """(query length, padded batch size) of the captured graph that runs a step whose
    requests have `num_new` tokens each, `num_drafts` of them drafts; `ladders`: the
    captured sizes per query length. A graph runs a step whose rows all have one query
    length: all decodes (1) or all verifies of the same k drafts (k + 1; a request's chunk
    of k + 1 tokens with fewer drafts is a prefill's). None: eager."""
    if num_new.size == 0:
        return None
    query_len = int(num_new[0])
    if not (num_new == query_len).all() or not (num_drafts == query_len - 1).all():
        return None
    sizes = ladders.get(query_len)
    size = padded(sizes, num_new.size) if sizes else None
    return None if size is None else (query_len, size)


def graph_metadata(buffers: StepBuffers, size: int, query_len: int,
                   max_model_len: int) -> AttentionMetadata:
    """What a graph of `size` requests of `query_len` tokens each reads: views of the
    buffers, which each step rewrites in place (padded: `StepBuffers.pad_rows`). Decodes
    go through the decode path (`max_seq_len` the longest possible), verifies through the
    prefill path (`max_query_len` fixed: it sizes the prefill kernel's grid)."""
    b, tokens = buffers, size * query_len
    decodes = size if query_len == 1 else 0
    return AttentionMetadata(
        num_decodes=decodes, num_decode_tokens=decodes,
        slot_mapping=b.slot_mapping.device[:tokens], block_tables=b.block_tables.device[:size],
        seq_lens=b.seq_lens.device[:size], query_start_loc=b.query_start_loc.device[:size + 1],
        max_query_len=query_len, max_seq_len=max_model_len)


class StepGraphs:
    def __init__(self, model: Callable[[Tensor, Tensor], Any], backend: AttentionBackend,
                 buffers: StepBuffers, max_batch: int, max_model_len: int,
                 lora: LoRASlots | None = None, query_len: int = 1) -> None:
        """`model`: the forward a graph captures, of the step's input ids and positions (the
        runner's `Decoder`, or a drafter's step, which may read buffers of its own); its
        output, whatever its structure, is what `replay` returns. `query_len`: the tokens
        of each request (1: decodes; k + 1: verifies)."""
        self.model = model
        self.backend = backend
        self.buffers = buffers
        self.max_model_len = max_model_len
        self.query_len = query_len
        self.sizes = batch_size_ladder(max_batch)
        self.lora = lora
        # (size, with LoRA) -> the graph and its output
        self._graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self._hidden: dict[tuple[int, bool], Any] = {}

    def padded_size(self, batch: int) -> int | None:
        """The captured size that runs `batch` requests, or None when it is too large."""
        return padded(self.sizes, batch)

    def _forward(self, size: int, with_lora: bool) -> Any:
        b, tokens = self.buffers, size * self.query_len
        lora = self.lora.graph_batch(size) if with_lora else None
        meta = graph_metadata(b, size, self.query_len, self.max_model_len)
        with set_forward_context(meta, self.backend), lora_context(lora):
            return self.model(b.input_ids.device[:tokens], b.positions.device[:tokens])

    @torch.inference_mode()
    def capture(self, pool: Any = None) -> None:
        """Largest first, all in one memory pool (`pool`, else a new one): smaller graphs
        reuse the largest's memory."""
        b = self.buffers
        # harmless inputs: every row reads the first positions of the null block and writes
        # nothing
        b.pad_rows(0, 0, self.sizes[-1], self.query_len)
        b.block_tables.device.zero_()
        for staged in (b.input_ids, b.positions, b.slot_mapping, b.seq_lens,
                       b.query_start_loc):
            staged.device.copy_(staged.host)
        pool = torch.cuda.graph_pool_handle() if pool is None else pool
        variants = (True, False) if self.lora is not None else (False,)
        for size in reversed(self.sizes):
            for with_lora in variants:
                self._forward(size, with_lora)  # compiles the Triton kernels' variants
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._hidden[size, with_lora] = self._forward(size, with_lora)
                self._graphs[size, with_lora] = graph
        torch.cuda.synchronize()

    def replay(self, size: int, with_lora: bool = False) -> Any:
        """Run the captured step over the current buffers, with the adapters' kernels or
        without (only steps with an adapter row need them); returns its output (the
        decoder's: hidden states [size * query_len, H])."""
        self._graphs[size, with_lora and self.lora is not None].replay()
        return self._hidden[size, with_lora and self.lora is not None]
