"""TierCopies: this rank's end of the prefix cache's lower tiers: the host slots' tensors,
the disk files below them, and every copy between them and the device's KV cache.

On CUDA the copies between the device and the host slots (pinned memory) run on a stream of
their own, so that a step's forward pass never queues behind them; CUDA events order them
with the compute stream, all on the device, so the host waits for none of them:

* offload (device -> host): the evicted blocks are gathered into a contiguous buffer on the
  compute stream, after every kernel queued before (the steps in flight that wrote them) and
  before the forward pass that reuses them; the copy stream waits for that gather only, and
  moves the buffer to the host slots while the step computes. The buffer stays allocated
  until its copy has run (`record_stream`): at most one step's evictions.
* recall (host -> device): queued on the copy stream after the compute stream's kernels so
  far (the steps in flight may still read the blocks it overwrites, freed since), straight
  from runs of consecutive host slots (no gather on the host), then scattered into the
  request's blocks. Both copy their pairs in host-slot order: a request's blocks come back
  from the pool tail first, so its chain sits in descending slots, and in chain order every
  block would be a run of its own (one copy per block and layer instead of one per run).
  The scheduler does not run the request in the step that queues its
  recall (`engine/scheduler.py`); the next step's compute stream waits for the recall's
  event before anything else (`await_recalls`), so the copy overlaps a whole forward pass
  and no other request waits for it. Every tensor-parallel rank does the same from the same
  scheduler output, so no rank polls and no rank decides anything of its own.

One copy stream keeps the tier's copies in order among themselves (a slot recalled is
overwritten by a later offload only after the recall read it). The host touches the host
slots only for the disk tier (writing a file from a slot, reading one into a slot), and
first waits for the copy stream: file I/O is synchronous anyway. On the CPU engine the
"device" is host memory: the copies are plain and immediate, and only the disk tier exists
below the staging slots.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pagedserve.attention.backend import AttentionBackend, as_bytes, consecutive_runs
from pagedserve.device.disk_tier import DiskBlocks

Caches = list[tuple[Tensor, Tensor]]


class TierCopies:
    def __init__(self, host_caches: Caches, device: torch.device, backend: AttentionBackend,
                 disk: DiskBlocks | None = None) -> None:
        self.host_caches = host_caches
        self.disk = disk
        self._backend = backend
        self._device = device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._recalled: torch.cuda.Event | None = None  # the last step's recalls, queued
        self._copied: torch.cuda.Event | None = None  # the copy stream's latest work
        self._timed: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # not yet read

    @property
    def num_slots(self) -> int:
        return self.host_caches[0][0].shape[0]

    def await_recalls(self) -> None:
        """Make the compute stream wait for the recalls the step before queued: called first
        in every step, before any kernel of it may read or overwrite their blocks."""
        if self._recalled is not None:
            torch.cuda.current_stream(self._device).wait_event(self._recalled)
            self._recalled = None

    def offload(self, kv_caches: Caches, pairs: list[tuple[int, int]]) -> None:
        """Copy (device block, host slot) pairs out before this step's kernels reuse the
        blocks."""
        if not pairs:
            return
        if self._stream is None:
            self._backend.swap_blocks(kv_caches, self.host_caches, torch.tensor(pairs))
            return
        pairs = sorted(pairs, key=lambda pair: pair[1])  # in slot order: long runs
        # non_blocking: a pageable tensor is staged at once, with no wait for the stream
        block_ids = torch.tensor([b for b, _ in pairs]).to(kv_caches[0][0].device,
                                                            non_blocking=True)
        gathered = [src.index_select(0, block_ids) for layer in kv_caches
                    for src in as_bytes(layer)]
        self._stream.wait_stream(torch.cuda.current_stream(self._device))
        runs = consecutive_runs([slot for _, slot in pairs])
        started = self._record(timing=True)
        with torch.cuda.stream(self._stream):
            for blocks, dst in zip(gathered, self._host_views()):
                blocks.record_stream(self._stream)
                for start, stop, first in runs:
                    dst[first:first + stop - start].copy_(blocks[start:stop], non_blocking=True)
        self._copied = self._record(timing=True)
        self._timed.append((started, self._copied))

    def recall(self, kv_caches: Caches, pairs: list[tuple[int, int]]) -> None:
        """Copy (host slot, device block) pairs in; they land before the next step's
        kernels (`await_recalls`), not this step's."""
        if not pairs:
            return
        if self._stream is None:
            self._backend.swap_blocks(self.host_caches, kv_caches, torch.tensor(pairs))
            return
        device = kv_caches[0][0].device
        pairs = sorted(pairs)  # in slot order: long runs
        self._stream.wait_stream(torch.cuda.current_stream(self._device))
        runs = consecutive_runs([slot for slot, _ in pairs])
        started = self._record(timing=True)
        with torch.cuda.stream(self._stream):
            block_ids = torch.tensor([b for _, b in pairs]).to(device, non_blocking=True)
            for src, dst in zip(self._host_views(), (c for layer in kv_caches
                                                      for c in as_bytes(layer))):
                staged = torch.empty((len(pairs), *src.shape[1:]), dtype=src.dtype,
                                     device=device)
                for start, stop, first in runs:
                    staged[start:stop].copy_(src[first:first + stop - start], non_blocking=True)
                dst.index_copy_(0, block_ids, staged)
        self._recalled = self._copied = self._record(timing=True)
        self._timed.append((started, self._copied))

    def spill(self, spills: list) -> None:
        """Write (host slot, disk slot, hash) blocks to their files, once the copies into
        those slots have landed."""
        self._host_waits()
        self.disk.spill(self.host_caches, spills)

    def load(self, loads: list) -> list[bool]:
        """Read (disk slot, host slot, hash) blocks into host slots no queued copy still
        reads; per load, whether its file read back whole."""
        self._host_waits()
        return self.disk.load(self.host_caches, loads)

    def _host_views(self) -> list[Tensor]:
        return [c for layer in self.host_caches for c in as_bytes(layer)]

    def take_stream_seconds(self) -> float:
        """The copy stream's time in the offloads and recalls that have finished since the
        last call (read from their events without waiting for any still running)."""
        done = 0
        while done < len(self._timed) and self._timed[done][1].query():
            done += 1
        seconds = sum(start.elapsed_time(end) for start, end in self._timed[:done]) / 1e3
        del self._timed[:done]
        return seconds

    def _record(self, timing: bool = False) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=timing)
        event.record(self._stream)
        return event

    def _host_waits(self) -> None:
        """Wait on the host for the copy stream's work so far (the disk tier's file I/O
        reads and writes host slots)."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
