"""A one-shot all-reduce fused with the residual add and the RMSNorm after it: one kernel where
the unfused path runs three (the copy of the partial product into peer memory, the reduction,
the add + norm).

Why: at decode sizes every one of a tensor-parallel layer's two all-reduces is a few KiB,
and its cost is the kernels' latency, not bytes. The row-parallel layer writes its partial
product straight into this rank's buffer of peer-mapped memory (symmetric memory), and this
kernel then, per program:

1. meets the same program on every rank at a barrier of flags in the peers' signal pads
   (each rank raises its flag in every peer's pad, then waits for every peer's flag in its
   own and lowers it: a flag only goes 0 -> 1 by its sender and 1 -> 0 by its owner, so the
   pads are all zero again after every use); one barrier where torch's one-shot kernel has
   two (one on entry, one on exit), and its raise a posted write, not a round trip;
2. reads every rank's partial row through the peers' buffer pointers, in rank order, and
   sums in float32 (the same order on every rank: every rank's sum is the same, bit for bit),
   rounded to the activation dtype as the all-reduce's output would be;
3. adds the residual (written back) and normalises, as `model_ops.rms_norm` does
   (`add_rms_norm_row`: one shared body, so the two round alike).

One program per row. Its reads of the peers' rows are 16-byte vectors (`peer_pointer`); once
they were, splitting a row's slices over several programs at few rows (the last to arrive
normalising) measured slower at 2 and 4 ranks at every size, so that was removed (the
measurement is in docs/benchmarks.md). A launch has at most MAX_PROGRAMS programs, each
meeting its namesakes; more rows are looped over.

There is no barrier at the end: a rank may leave while its peers still read its buffer. So
the callers alternate between two buffers (`slot`): a rank writes a buffer again only after
the other slot's barrier (or another collective in between), which it passes only once every
peer has reached it, and so has left this kernel.

The buffers and pads are given as tables of device addresses (int64, one per rank), which
lets the CPU tests simulate the ranks as tensors of one process under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from pagedserve.kernels.triton import pdl
from pagedserve.kernels.triton.model_ops import add_rms_norm_row, norm_warps
from pagedserve.kernels.triton.precision import round_to

MAX_PROGRAMS = 64  # rows beyond this are looped over: bounds the signal pad a slot needs


def signal_words(world_size: int, slots: int = 2) -> int:
    """The int32 flags of a signal pad that `slots` buffers' barriers use."""
    return slots * MAX_PROGRAMS * world_size


@triton.jit
def barrier(signals_ptr, offset, rank, WORLD: tl.constexpr):
    """Meet the same program of every rank: raise our flag in each pad, then take down each
    rank's flag in ours, one lane per rank (the peers' round trips overlap). The raise is an
    atomic add whose result is unused, which compiles to a posted reduction (`red`): no
    round trip. Release and acquire at system scope: the partial products written before
    are visible to the peers' reads after. A flag is always down when raised (the slots
    alternate, see the module docstring); a lane already done compares against -1, a value
    no flag holds, so its retries change nothing. Shared with the two-shot kernel
    (`allreduce_norm_two_shot.py`)."""
    peers = tl.arange(0, WORLD)
    ours = tl.load(signals_ptr + peers).to(tl.pointer_type(tl.int32)) + offset + rank
    tl.atomic_add(ours, 1, sem="release", scope="sys")
    theirs = tl.load(signals_ptr + rank).to(tl.pointer_type(tl.int32)) + offset + peers
    done = tl.zeros([WORLD], dtype=tl.int32)
    while tl.sum(done, axis=0) < WORLD:
        old = tl.atomic_cas(theirs, tl.where(done == 1, -1, 1), tl.where(done == 1, -1, 0),
                            sem="acquire", scope="sys")
        done = tl.maximum(done, (old == 1).to(tl.int32))


@triton.jit
def peer_pointer(buffers_ptr, peer, dtype: tl.constexpr):
    """Rank `peer`'s buffer as a pointer to `dtype`, declared 16-byte aligned (symmetric memory
    is): an address loaded from a table has no known alignment, and without it the compiler
    reads a row through it two bytes at a time instead of in 16-byte vectors."""
    return tl.multiple_of(tl.load(buffers_ptr + peer).to(tl.pointer_type(dtype)), 16)


@triton.jit
def _all_reduce_add_rms_norm_kernel(buffers_ptr, signals_ptr, res_ptr, w_ptr, out_ptr, rank,
                                    buffer_offset, signal_offset, num_rows, stride_res,
                                    stride_out, eps, N: tl.constexpr, BLOCK: tl.constexpr,
                                    WORLD: tl.constexpr):
    pdl.step_entry()
    program = tl.program_id(0)
    barrier(signals_ptr, signal_offset + program * WORLD, rank, WORLD)
    dtype = out_ptr.dtype.element_ty
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    for row in range(program, num_rows, tl.num_programs(0)):  # int32 offsets
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for peer in tl.static_range(WORLD):
            part = peer_pointer(buffers_ptr, peer, dtype)
            total += tl.load(part + buffer_offset + row * N + offs, mask=mask,
                             other=0.0).to(tl.float32)
        total = round_to(total, dtype)  # the all-reduce's output, in its dtype
        add_rms_norm_row(total, res_ptr + row * stride_res, w_ptr, out_ptr + row * stride_out,
                         offs, mask, eps, N, True)


def grid_size(num_rows: int) -> int:
    """The programs of a launch for `num_rows` rows: each meets its namesake on every rank at
    the barrier, so all must be resident at once (at most MAX_PROGRAMS; more rows are looped
    over)."""
    return min(num_rows, MAX_PROGRAMS)


def all_reduce_add_rms_norm(buffers: Tensor, signals: Tensor, rank: int, slot: int,
                            slot_bytes: int, partial: Tensor, residual: Tensor, weight: Tensor,
                            eps: float) -> tuple[Tensor, Tensor]:
    """(RMSNorm(residual + sum over ranks of partial), that sum), the sum written into
    `residual` in place: `model_ops.rms_norm` of the all-reduced partial products.

    buffers, signals: int64 [world] device addresses of every rank's buffer and signal pad;
    `partial` [T, N] is this rank's product, contiguous at the start of its buffer's `slot`
    (0 or 1: a buffer holds two slots of `slot_bytes`, the first at buffers[r]); every rank
    calls this with the same shapes and slot, in the same order."""
    world = buffers.numel()
    num_rows, n = partial.shape
    assert partial.is_contiguous() and residual.shape == partial.shape
    assert residual.stride(-1) == 1 and weight.is_contiguous() and slot in (0, 1)
    out = torch.empty_like(residual, memory_format=torch.contiguous_format)
    if num_rows == 0:
        return out, residual
    block = triton.next_power_of_2(n)
    _all_reduce_add_rms_norm_kernel[(grid_size(num_rows),)](
        buffers, signals, residual, weight, out, rank,
        slot * slot_bytes // partial.element_size(),
        slot * MAX_PROGRAMS * world, num_rows, residual.stride(0), out.stride(0), eps,
        N=n, BLOCK=block, WORLD=world, num_warps=norm_warps(block), **pdl.launch_options())
    return out, residual
