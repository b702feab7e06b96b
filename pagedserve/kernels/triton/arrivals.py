"""Arrival counters for single-launch reductions: the programs that split one output (decode
v2's partitions of a sequence, a split-K product's slices of K) each bump a counter when
their partial is stored, and the last to arrive combines the partials and zeroes the counter
again. No second launch waits for the whole grid to drain, and no memset precedes a launch,
so CUDA graphs replay it as it is."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

_ARRIVALS: dict[torch.device, list[Tensor]] = {}


def arrival_counters(n: int, device: torch.device) -> Tensor:
    """>= n int32 zeros for a launch to count arrivals in; each launch leaves them zero, so
    launches stream-ordered on one device share them.

    Kept per device so a CUDA graph adds no memset; a grown buffer does not free the old
    one, which captured graphs still point at. A buffer first needed while a graph is being
    captured is zeroed by a memset that the graph records, not at once, so it serves only
    that graph and is not kept for eager calls."""
    bufs = _ARRIVALS.setdefault(device, [])
    if bufs and bufs[-1].numel() >= n:
        return bufs[-1]
    buf = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
    if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        bufs.append(buf)
    return buf



def split_buffers(splits: int, size: int, n_tiles: int,
                  unused: Tensor) -> tuple[Tensor, Tensor]:
    """(float32 partials [splits, size], arrival counters for `n_tiles` output tiles) of a
    split-K launch (`sum_slices`), on `unused`'s device; `unused` (never read) for both when
    K is whole."""
    if splits == 1:
        return unused, unused
    parts = torch.empty((splits, size), dtype=torch.float32, device=unused.device)
    return parts, arrival_counters(n_tiles, unused.device)


@triton.jit
def sum_slices(acc, part_ptr, arrivals_ptr, offs, mask, pid_n, pid_k, slice_size,
               SPLIT_K: tl.constexpr):
    """Split K: store this program's partial (float32, slice pid_k of [SPLIT_K, slice_size]);
    the last of the n-tile's SPLIT_K programs to arrive gets (True, the partials added up in
    slice order: the same sum whichever arrives last), the others (False, zeros)."""
    tl.store(part_ptr + pid_k * slice_size + offs, acc, mask=mask)
    # Every thread's partial stores happen before the barrier, the barrier before the
    # counter's release: the program that sees the last arrival sees every partial.
    tl.debug_barrier()
    counter = arrivals_ptr + pid_n
    last = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1
    total = tl.zeros_like(acc)
    if last:
        for s in range(SPLIT_K):  # written by other programs: read from L2 (.cg)
            total += tl.load(part_ptr + s * slice_size + offs, mask=mask, other=0.0,
                             cache_modifier=".cg")
        tl.store(counter, 0)  # zero again for the next launch (CUDA-graph replays)
    return last, total


@triton.jit
def store_row(acc, bias_ptr, y_ptr, offs_n, n_mask, HAS_BIAS: tl.constexpr):
    """y[offs_n] = acc (+ bias), rounded once to y's dtype."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_n, acc.to(y_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def finish_row(total, bias_ptr, y_ptr, part_ptr, arrivals_ptr, offs_n, n_mask, pid_n, pid_k,
               N, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr):
    """A one-row GEMV's output tile: store the program's sums (+ bias), or with SPLIT_K > 1
    only the last of the n-tile's programs to arrive does, the slices' partials
    [SPLIT_K, N] added up (`sum_slices`)."""
    if SPLIT_K == 1:
        store_row(total, bias_ptr, y_ptr, offs_n, n_mask, HAS_BIAS)
    else:
        last, total = sum_slices(total, part_ptr, arrivals_ptr, offs_n, n_mask, pid_n, pid_k,
                                 N, SPLIT_K)
        if last:
            store_row(total, bias_ptr, y_ptr, offs_n, n_mask, HAS_BIAS)
