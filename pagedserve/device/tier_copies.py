"""TierCopies: this rank's end of the prefix cache's lower tiers: the host slots, the disk
files below them, and every copy between them and the device's KV cache.

The host slots are one tensor, block-major: a slot holds one block of every layer's K and V
side by side (`slots[slot]`, the pieces in the device caches' order), so a run of consecutive
slots is one contiguous range whatever the number of layers. Each copy call then costs a
few torch ops per run and one per layer, not one per layer and run (each op is a launch or a
cudaMemcpyAsync queued from Python, on the step's host path: docs/benchmarks.md, issue 34).
The disk tier writes and reads a slot's row whole; per-layer views over the slots
(`host_caches`) serve the CPU engine's copies. On
CUDA the slots are page-locked by registering them (`_pin`), not allocated pinned: torch's
pinned allocator rounds a request up to a power of two.

On CUDA the copies between the device and the host slots run on a stream of their own, so
that a step's forward pass never queues behind them; CUDA events order them with the
compute stream, all on the device, so the host waits for none of them:

* offload (device -> host): the evicted blocks are gathered into a contiguous buffer on the
  compute stream (every layer's piece of a block side by side, as the slots hold them),
  after every kernel queued before (the steps in flight that wrote them) and before the
  forward pass that reuses them; the copy stream waits for that gather only, and moves the
  buffer to the host slots, one copy per run, while the step computes. The buffer stays
  allocated until its copy has run (`record_stream`): at most one step's evictions.
* recall (host -> device): queued on the copy stream after the compute stream's kernels so
  far (the steps in flight may still read the blocks it overwrites, freed since), one copy
  per run of consecutive host slots into a staging buffer, then scattered into each layer's
  blocks. Both copy their pairs in host-slot order: a request's blocks come back
  from the pool tail first, so its chain sits in descending slots, and in chain order every
  block would be a run of its own.
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

import weakref

import torch
from torch import Tensor

from pagedserve.attention.backend import AttentionBackend, consecutive_runs
from pagedserve.device.disk_tier import DiskBlocks

Caches = list[tuple[Tensor, Tensor]]


class TierCopies:
    def __init__(self, device_caches: Caches, num_slots: int, device: torch.device,
                 backend: AttentionBackend, disk: DiskBlocks | None = None) -> None:
        """`device_caches`: every layer's K and V cache a block id addresses (fixed for
        the runner's life); `num_slots` host slots of one block each."""
        self.disk = disk
        self._backend = backend
        self._device = device
        self._device_caches = device_caches
        # each cache as [blocks, bytes of a block]: every copy moves bytes, FP8 included
        self._device_bytes = [c.view(c.shape[0], -1).view(torch.uint8)
                              for layer in device_caches for c in layer]
        widths = [b.shape[1] for b in self._device_bytes]
        self._offsets = [sum(widths[:i]) for i in range(len(widths) + 1)]
        self.slots = torch.empty((num_slots, self._offsets[-1]), dtype=torch.uint8)
        if device.type == "cuda":
            _pin(self, self.slots)
        # each layer's K and V over the slots, for the CPU engine's copies
        self.host_caches = [(self._slot_view(k, 2 * n), self._slot_view(v, 2 * n + 1))
                            for n, (k, v) in enumerate(device_caches)]
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._recalled: torch.cuda.Event | None = None  # the last step's recalls, queued
        self._copied: torch.cuda.Event | None = None  # the copy stream's latest work
        self._timed: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # not yet read

    def _slot_view(self, cache: Tensor, index: int) -> Tensor:
        """The slots' bytes of the `index`-th cache, as that cache's blocks."""
        start, stop = self._offsets[index], self._offsets[index + 1]
        return self.slots[:, start:stop].view(cache.dtype).unflatten(1, cache.shape[1:])

    @property
    def num_slots(self) -> int:
        return self.slots.shape[0]

    def await_recalls(self) -> None:
        """Make the compute stream wait for the recalls the step before queued: called first
        in every step, before any kernel of it may read or overwrite their blocks."""
        if self._recalled is not None:
            torch.cuda.current_stream(self._device).wait_event(self._recalled)
            self._recalled = None

    def offload(self, pairs: list[tuple[int, int]]) -> None:
        """Copy (device block, host slot) pairs out before this step's kernels reuse the
        blocks."""
        if not pairs:
            return
        if self._stream is None:
            self._backend.swap_blocks(self._device_caches, self.host_caches, torch.tensor(pairs))
            return
        pairs = sorted(pairs, key=lambda pair: pair[1])  # in slot order: long runs
        # non_blocking: a pageable tensor is staged at once, with no wait for the stream
        block_ids = torch.tensor([b for b, _ in pairs]).to(self._device, non_blocking=True)
        # the blocks as slots are laid out: a block's every layer side by side
        gathered = torch.cat([b.index_select(0, block_ids) for b in self._device_bytes], 1)
        self._stream.wait_stream(torch.cuda.current_stream(self._device))
        started = self._record(timing=True)
        with torch.cuda.stream(self._stream):
            gathered.record_stream(self._stream)
            for start, stop, first in consecutive_runs([slot for _, slot in pairs]):
                self.slots[first:first + stop - start].copy_(gathered[start:stop],
                                                             non_blocking=True)
        self._copied = self._record(timing=True)
        self._timed.append((started, self._copied))

    def recall(self, pairs: list[tuple[int, int]]) -> None:
        """Copy (host slot, device block) pairs in; they land before the next step's
        kernels (`await_recalls`), not this step's."""
        if not pairs:
            return
        if self._stream is None:
            self._backend.swap_blocks(self.host_caches, self._device_caches, torch.tensor(pairs))
            return
        pairs = sorted(pairs)  # in slot order: long runs
        self._stream.wait_stream(torch.cuda.current_stream(self._device))
        started = self._record(timing=True)
        with torch.cuda.stream(self._stream):
            block_ids = torch.tensor([b for _, b in pairs]).to(self._device, non_blocking=True)
            staged = torch.empty((len(pairs), self.slots.shape[1]), dtype=torch.uint8,
                                 device=self._device)
            for start, stop, first in consecutive_runs([slot for slot, _ in pairs]):
                staged[start:stop].copy_(self.slots[first:first + stop - start],
                                         non_blocking=True)
            offsets = self._offsets
            for i, dst in enumerate(self._device_bytes):
                dst.index_copy_(0, block_ids, staged[:, offsets[i]:offsets[i + 1]])
        self._recalled = self._copied = self._record(timing=True)
        self._timed.append((started, self._copied))

    def spill(self, spills: list) -> None:
        """Write (host slot, disk slot, hash) blocks to their files, once the copies into
        those slots have landed."""
        self._host_waits()
        self.disk.spill(self.slots, spills)

    def load(self, loads: list) -> list[bool]:
        """Read (disk slot, host slot, hash) blocks into host slots no queued copy still
        reads; per load, whether its file read back whole."""
        self._host_waits()
        return self.disk.load(self.slots, loads)

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


def _pin(owner: object, slots: Tensor) -> None:
    """Page-lock the slots for DMA copies, for as long as `owner` lives. Registered rather
    than allocated pinned: torch's pinned allocator rounds a request up to a power of two
    (a 24 GiB tier would lock 32 GiB)."""
    error = torch.cuda.cudart().cudaHostRegister(slots.data_ptr(), slots.numel(), 0)
    if int(error) != 0:
        raise RuntimeError(f"kv_offload_memory: page-locking {slots.numel()} bytes of host "
                           f"memory for the host tier failed (CUDA error {int(error)}); "
                           "lower kv_offload_memory or raise the locked-memory limit")
    weakref.finalize(owner, _unpin, slots)


def _unpin(slots: Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(slots.data_ptr())
