"""TierCopies: this rank's end of the prefix cache's lower tiers: the host slots, the disk
files below them, and every copy between them and the device's KV cache.

The host slots are layer-major: one page-locked buffer holds, per layer, a region of
`num_slots` rows, a row being that layer's K and V of one block side by side (`layers[n]`).
A run of consecutive slots is then one contiguous range in each layer's region, so a
recall can be copied layer by layer (below) at one copy per run and layer. A slot's bytes
in layer order (`slot_row`, `fill_slot`) are what the disk tier writes and reads, the same
bytes, in the same order, as the block-major rows this layout replaced; per-layer views
over the slots (`host_caches`) serve the CPU engine's copies. On CUDA the buffer is
page-locked by registering it (`_pin`), not allocated pinned: torch's pinned allocator
rounds a request up to a power of two.

On CUDA the copies between the device and the host slots run on a stream of their own, so
that a step's forward pass never queues behind them; CUDA events order them with the
compute stream, all on the device, so the host waits for none of them:

* offload (device -> host): the evicted blocks are gathered into a device buffer laid out
  as the slots are (each layer's K and V of the blocks in a region of their own) on the
  compute stream, after every kernel queued before (the steps in flight that wrote them)
  and before the forward pass that reuses them; the copy stream waits for that gather
  only, and moves each layer's region to the host slots, one copy per run and layer,
  while the step computes. The buffer stays allocated until its copies have run
  (`record_stream`): at most one step's evictions.
* recall (host -> device): queued on the copy stream after the compute stream's kernels so
  far (the steps in flight may still read the blocks it overwrites, freed since, and the
  offload gather reads blocks it may overwrite), layer by layer: each layer's runs of
  consecutive host slots into a staging buffer, scattered into that layer's K and V
  blocks, then an event (`await_layer`). Both copy their pairs in host-slot order: a
  request's blocks come back from the pool tail first, so its chain sits in descending
  slots, and in chain order every block would be a run of its own.
  The request computes in the very step that queues its recall (`engine/scheduler.py`):
  that step's attention of layer n first makes the compute stream wait for layer n's
  event (the forward context's `kv_ready`, `model/decoder.py`), so layer n's copy
  overlaps the compute of the layers before it, and a recall costs the step the copy's
  excess over its compute, not a step of its own. After the forward pass (before a
  drafter reads its own layers' blocks, and in a step replaying a CUDA graph, which
  cannot wait inside, before it) the compute stream waits for the whole recall
  (`await_recalls`); a recall whose step ran no forward pass is waited for first thing
  in the next step. Every tensor-parallel rank does the same from the same scheduler
  output, so no rank polls and no rank decides anything of its own.

One copy stream keeps the tier's copies in order among themselves (a slot recalled is
overwritten by a later offload only after the recall read it). The host touches the host
slots only for the disk tier (writing a file from a slot, reading one into a slot), and
first waits for the copy stream: file I/O is synchronous anyway. On the CPU engine the
"device" is host memory: the copies are plain and immediate, and only the disk tier exists
below the staging slots.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

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
        # each layer's K and V as [blocks, bytes of a block]: every copy moves bytes, FP8 too
        self._device_bytes = [tuple(c.view(c.shape[0], -1).view(torch.uint8) for c in layer)
                              for layer in device_caches]
        self._k_widths = [k.shape[1] for k, _ in self._device_bytes]
        self._widths = [k.shape[1] + v.shape[1] for k, v in self._device_bytes]
        self.slot_bytes = sum(self._widths)
        self._memory = torch.empty(num_slots * self.slot_bytes, dtype=torch.uint8)
        if device.type == "cuda":
            _pin(self, self._memory)
        self.layers = self._regions(self._memory, num_slots)  # [num_slots, K + V bytes] each
        # each layer's K and V over the slots, for the CPU engine's copies
        self.host_caches = [(self._slot_view(n, k, 0), self._slot_view(n, v, self._k_widths[n]))
                            for n, (k, v) in enumerate(device_caches)]
        # high priority: a recall's scatter kernels run ahead of the compute stream's, which
        # waits for them layer by layer
        self._stream = (torch.cuda.Stream(device, priority=-1) if device.type == "cuda"
                        else None)
        self._recalled: torch.cuda.Event | None = None  # this step's recall, whole
        self._layer_landed: list[torch.cuda.Event] = []  # and per layer, in layer order
        self._copied: torch.cuda.Event | None = None  # the copy stream's latest work
        self._timed: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # not yet read

    def _regions(self, flat: Tensor, rows: int) -> list[Tensor]:
        """`flat` (bytes) cut layer-major: per layer a contiguous [rows, K + V bytes]."""
        regions, start = [], 0
        for width in self._widths:
            regions.append(flat[start:start + rows * width].view(rows, width))
            start += rows * width
        return regions

    def _slot_view(self, layer: int, cache: Tensor, offset: int) -> Tensor:
        """The slots' bytes of one of `layer`'s caches (K at offset 0, V after it), as that
        cache's blocks."""
        width = cache[0].numel() * cache.element_size()
        region = self.layers[layer][:, offset:offset + width]
        return region.view(cache.dtype).unflatten(1, cache.shape[1:])

    @property
    def num_slots(self) -> int:
        return self.layers[0].shape[0]

    def slot_row(self, slot: int) -> Tensor:
        """A slot's bytes, every layer's K and V in layer order (a copy): a disk file's."""
        return torch.cat([region[slot] for region in self.layers])

    def fill_slot(self, slot: int, row: Tensor) -> None:
        """Write a slot from its bytes in layer order (`slot_row`)."""
        start = 0
        for region, width in zip(self.layers, self._widths):
            region[slot].copy_(row[start:start + width])
            start += width

    def await_layer(self, layer: int) -> None:
        """Make the compute stream wait for this step's recall of `layer`'s blocks: called
        by that layer's attention, before it stores or reads its cache."""
        if layer < len(self._layer_landed):
            torch.cuda.current_stream(self._device).wait_event(self._layer_landed[layer])

    def layer_waits(self) -> Callable[[int], None] | None:
        """`await_layer`, when this step queued a recall the forward pass must wait for."""
        return self.await_layer if self._layer_landed else None

    def await_recalls(self) -> None:
        """Make the compute stream wait for the whole recall queued last: after the forward
        pass of the step that queued it (its layers waited for their own parts), before a
        graph replay (which cannot wait inside), or first in the next step (a step with no
        forward pass), before any kernel that may read or overwrite its blocks."""
        if self._recalled is not None:
            torch.cuda.current_stream(self._device).wait_event(self._recalled)
            self._recalled = None
            self._layer_landed = []

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
        # the blocks as the slots are laid out: each layer's K and V in a region of its own
        gathered = torch.empty(len(pairs) * self.slot_bytes, dtype=torch.uint8,
                               device=self._device)
        regions = self._regions(gathered, len(pairs))
        for (k, v), region in zip(self._device_bytes, regions):
            torch.cat([k.index_select(0, block_ids), v.index_select(0, block_ids)], 1,
                      out=region)
        self._stream.wait_stream(torch.cuda.current_stream(self._device))
        started = self._record(timing=True)
        runs = consecutive_runs([slot for _, slot in pairs])
        with torch.cuda.stream(self._stream):
            gathered.record_stream(self._stream)
            for host, region in zip(self.layers, regions):
                for start, stop, first in runs:
                    host[first:first + stop - start].copy_(region[start:stop],
                                                           non_blocking=True)
        self._copied = self._record(timing=True)
        self._timed.append((started, self._copied))

    def recall(self, pairs: list[tuple[int, int]]) -> None:
        """Copy (host slot, device block) pairs in, layer by layer: this step's attention
        of each layer waits for its part (`await_layer`), the step after for all of it."""
        if not pairs:
            return
        if self._stream is None:
            self._backend.swap_blocks(self.host_caches, self._device_caches, torch.tensor(pairs))
            return
        pairs = sorted(pairs)  # in slot order: long runs
        self.await_recalls()  # two recalls in one step (a probe): the first, whole, first
        self._stream.wait_stream(torch.cuda.current_stream(self._device))
        started = self._record(timing=True)
        runs = consecutive_runs([slot for slot, _ in pairs])
        landed = []
        with torch.cuda.stream(self._stream):
            block_ids = torch.tensor([b for _, b in pairs]).to(self._device, non_blocking=True)
            staged = torch.empty(len(pairs) * self.slot_bytes, dtype=torch.uint8,
                                 device=self._device)
            for host, region, (k, v), k_width in zip(
                    self.layers, self._regions(staged, len(pairs)), self._device_bytes,
                    self._k_widths):
                for start, stop, first in runs:
                    region[start:stop].copy_(host[first:first + stop - start],
                                             non_blocking=True)
                k.index_copy_(0, block_ids, region[:, :k_width])
                v.index_copy_(0, block_ids, region[:, k_width:])
                landed.append(self._record())
        self._layer_landed = landed
        self._recalled = self._copied = self._record(timing=True)
        self._timed.append((started, self._copied))

    def spill(self, spills: list) -> None:
        """Write (host slot, disk slot, hash) blocks to their files, once the copies into
        those slots have landed."""
        self._host_waits()
        self.disk.spill(self.slot_row, spills)

    def load(self, loads: list) -> list[bool]:
        """Read (disk slot, host slot, hash) blocks into host slots no queued copy still
        reads; per load, whether its file read back whole."""
        self._host_waits()
        return self.disk.load(self.fill_slot, self.slot_bytes, loads)

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
