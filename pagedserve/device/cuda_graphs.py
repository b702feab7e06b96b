"""CUDA graphs of the decode forward pass, one per batch size of a ladder.

A decode step of a 28-layer model is hundreds of kernel launches, and from Python each costs
more than the kernel itself at small batch (a Triton launch far more than a torch op's;
docs/benchmarks.md, "Host-side costs behind the engine's choices"). A graph replays them all
with one launch. A graph replays fixed addresses and fixed launch
grids, so:

- inputs are the runner's `StepBuffers` device tensors, written in place every step, and a
  batch runs in the smallest captured size >= its size, padded with rows that write nothing
  (slot -1) and attend to one position of the null block;
- attention is captured with `max_seq_len` = max_model_len. v1's grid ignores it; v2's grid
  is then sized for the longest possible context, and its programs past a sequence's
  length exit at once while the reduce only reads the partitions that the sequence has
  (see kernels/triton/attention/decode.py), so one graph serves every context length.

With LoRA on, each size is captured twice (as vLLM's `cudagraph_specialize_lora`): with the
adapters' kernels, which read each row's slot from its buffer (-1, the base model, for
padding), so one graph serves any mix of adapters; and without them, for steps whose rows
are all the base model's, which then cost what they cost without LoRA. The runner picks by
whether the step has a `LoRABatch`.

Only decode-only steps replay a graph; steps with a prefill chunk run eagerly.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import Any

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


class DecodeGraphs:
    def __init__(self, model: Callable[[Tensor, Tensor], Any], backend: AttentionBackend,
                 buffers: StepBuffers, max_batch: int, max_model_len: int,
                 lora: LoRASlots | None = None) -> None:
        """`model`: the forward a graph captures, of the step's input ids and positions (the
        runner's `Decoder`, or a drafter's step, which may read buffers of its own); its
        output, whatever its structure, is what `replay` returns."""
        self.model = model
        self.backend = backend
        self.buffers = buffers
        self.max_model_len = max_model_len
        self.sizes = batch_size_ladder(max_batch)
        self.lora = lora
        # (size, with LoRA) -> the graph and its output
        self._graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self._hidden: dict[tuple[int, bool], Any] = {}

    def padded_size(self, batch: int) -> int | None:
        """The captured size that runs `batch` decodes, or None when it is too large."""
        index = bisect.bisect_left(self.sizes, batch)
        return self.sizes[index] if index < len(self.sizes) else None

    def _meta(self, size: int) -> AttentionMetadata:
        b = self.buffers
        return AttentionMetadata(
            num_decodes=size, num_decode_tokens=size,
            slot_mapping=b.slot_mapping.device[:size], block_tables=b.block_tables.device[:size],
            seq_lens=b.seq_lens.device[:size], query_start_loc=b.query_start_loc.device[:size + 1],
            max_query_len=1, max_seq_len=self.max_model_len)

    def _forward(self, size: int, with_lora: bool) -> Any:
        b = self.buffers
        lora = self.lora.graph_batch(size) if with_lora else None
        with set_forward_context(self._meta(size), self.backend), lora_context(lora):
            return self.model(b.input_ids.device[:size], b.positions.device[:size])

    @torch.inference_mode()
    def capture(self) -> None:
        """Largest first, all in one memory pool: smaller graphs reuse the largest's memory."""
        b = self.buffers
        # harmless inputs: every row reads position 0 of the null block and writes nothing
        b.input_ids.device.zero_()
        b.positions.device.zero_()
        b.slot_mapping.device.fill_(-1)
        b.seq_lens.device.fill_(1)
        b.block_tables.device.zero_()
        b.query_start_loc.device.copy_(torch.arange(b.query_start_loc.device.numel(),
                                                    dtype=torch.int32))
        pool = torch.cuda.graph_pool_handle()
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
        decoder's: hidden states [size, H])."""
        self._graphs[size, with_lora and self.lora is not None].replay()
        return self._hidden[size, with_lora and self.lora is not None]
