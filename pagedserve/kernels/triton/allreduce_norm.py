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

At few rows (a decode step at small batch) one program per row leaves a single SM to wait
at the barrier and then read every peer's row with few reads in flight, where an unfused
all-reduce spreads those reads over many blocks. So at 4 ranks a row's slices go to several
programs (`programs_per_row`, chosen from the shape and the world size; at 2 ranks one
program a row measured faster): each meets its namesake on every rank
at the barrier, sums its slice of every peer's row and adds it to the residual stream; the
norm needs the whole row's sum of squares, so each then counts its arrival on the row's
counter (`arrivals.py`), and the last to arrive reads the row back and normalises it, with
the norm kernel's arithmetic on the stored stream: the same result, bit for bit, as one
program per row. No program waits for another of its own launch, so nothing depends on the
launch's programs being resident together beyond the barrier's own need (at most
MAX_PROGRAMS programs, each meeting its namesakes).

There is no barrier at the end: a rank may leave while its peers still read its buffer. So
the callers alternate between two buffers (`slot`): a rank writes a buffer again only after
the other slot's barrier (or another collective in between), which it passes only once every
peer has reached it, and so has left this kernel.

Push (`push=True`, the engine's `--all-reduce-push`): the steps above wait for the link
about three times: the flag's raise is posted, but then the barrier waits for the peers'
flags (one crossing) and the reads of their rows are round trips (a request out, the data
back: two more). Pushed instead, each rank first stores its slice of its own partial row
into every peer's buffer (posted writes: nothing waits for an answer), then raises its
flags; the release at system scope, after a CTA barrier that orders every thread's stores
before it, makes the rows visible to any peer that sees the flag. After the barrier (whose
acquire, and a CTA barrier after it, order every thread's reads after the flags) every row
is read from local memory: one link latency in all. For that a slot holds a sub-slot per
rank (sub-slot r: rank r's partial), so the buffers are WORLD times as large (at 512 KiB a
message, 2 MiB a rank at two ranks, 4 MiB at four). The row-parallel layer still writes its
partial product locally, into this rank's own sub-slot (`partial_offset`), and each rank
sums the same WORLD rows in the same rank order in float32 as the pull does: the results are
the pull's, bit for bit. The split over programs is unchanged: a program pushes exactly the
slice of the rows it will sum, so its namesakes' flags cover everything it reads.

The two slots still suffice for the pushed writes. Rank r stores into peer p's slot s (its
sub-slot r, which no one else writes) only in its kernel of a call over s; that kernel
started after r's kernel of the call before (over the other slot) had finished (stream
order; PDL waits for the kernel before), so after r's programs passed that call's barrier,
which needed p's namesake programs there, which started only after p's kernel of the call
before that, the last to read p's slot s, had finished. So no store lands in a sub-slot
that its owner may still read. And what a peer reads in its call over s is what r stored in
the same call: r raises that call's flag only after its stores.

The buffers and pads are given as tables of device addresses (int64, one per rank), which
lets the CPU tests simulate the ranks as tensors of one process under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from pagedserve.kernels.triton import pdl
from pagedserve.kernels.triton.arrivals import arrival_counters
from pagedserve.kernels.triton.model_ops import add_residual, add_rms_norm_row, norm_warps
from pagedserve.kernels.triton.precision import round_to

MAX_PROGRAMS = 64  # rows beyond this are looped over: bounds the signal pad a slot needs
MAX_SPLIT = 16  # programs per row at few rows
# the world sizes whose rows are split at few rows: at 4 ranks the split engine decoded faster
# (Llama-3-8B shape, TP=4 TPOT); at 2 ranks one program a row did, once the peers' rows were
# read in 16-byte vectors (docs/benchmarks.md, "The fused all-reduce + norm per call")
SPLIT_WORLD_SIZES = (4,)
MIN_SLICE = 256  # elements of a row a program takes at least


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
def _all_reduce_add_rms_norm_kernel(buffers_ptr, signals_ptr, res_ptr, w_ptr, out_ptr,
                                    arrivals_ptr, rank, buffer_offset, part_stride,
                                    signal_offset, num_rows, stride_res, stride_out, eps,
                                    N: tl.constexpr, BLOCK: tl.constexpr, SPLIT: tl.constexpr,
                                    SLICE: tl.constexpr, SLICE_BLOCK: tl.constexpr,
                                    WORLD: tl.constexpr, PUSH: tl.constexpr):
    pdl.step_entry()
    program = tl.program_id(0)
    dtype = out_ptr.dtype.element_ty
    lanes = tl.arange(0, SLICE_BLOCK)
    offs = (program % SPLIT) * SLICE + lanes  # this program's slice of its rows
    mask = (lanes < SLICE) & (offs < N)
    first_row = program // SPLIT
    row_step = tl.num_programs(0) // SPLIT
    if PUSH:
        _push_rows(buffers_ptr, rank, buffer_offset + rank * part_stride, first_row, row_step,
                   num_rows, offs, mask, N, WORLD, dtype)
        # Every thread's stores to the peers happen before the barrier, the barrier before
        # the flags' release at system scope: a peer that sees our flag sees our rows.
        tl.debug_barrier()
    barrier(signals_ptr, signal_offset + program * WORLD, rank, WORLD)
    if PUSH:
        tl.debug_barrier()  # every thread reads the pushed rows after the flags' acquire
        ours = peer_pointer(buffers_ptr, rank, dtype) + buffer_offset
    for row in range(first_row, num_rows, row_step):  # int32 offsets
        total = tl.zeros([SLICE_BLOCK], dtype=tl.float32)
        for peer in tl.static_range(WORLD):  # rank order: the same sum on every rank
            if PUSH:  # sub-slot `peer` of our own buffer, written there by that rank
                total += tl.load(ours + peer * part_stride + row * N + offs, mask=mask,
                                 other=0.0, cache_modifier=".cg").to(tl.float32)
            else:
                part = peer_pointer(buffers_ptr, peer, dtype)
                total += tl.load(part + buffer_offset + row * N + offs, mask=mask,
                                 other=0.0).to(tl.float32)
        total = round_to(total, dtype)  # the all-reduce's output, in its dtype
        if SPLIT == 1:
            add_rms_norm_row(total, res_ptr + row * stride_res, w_ptr,
                             out_ptr + row * stride_out, offs, mask, eps, N, True)
        else:
            _add_then_norm_when_last(total, res_ptr + row * stride_res, w_ptr,
                                     out_ptr + row * stride_out, arrivals_ptr + row, offs, mask,
                                     eps, N, BLOCK, SPLIT)


@triton.jit
def _push_rows(buffers_ptr, rank, own_offset, first_row, row_step, num_rows, offs, mask,
               N: tl.constexpr, WORLD: tl.constexpr, dtype: tl.constexpr):
    """This program's slice of each of its rows of our partial product (local, in our own
    sub-slot at `own_offset`) stored into the same sub-slot of every peer's buffer: posted
    writes, none waiting for an answer (16-byte vectors at one program a row; a split row's
    slice can leave a thread one element, as the pull's loads then are). Each rank starts
    with the next rank, so that at more than two ranks the first stores do not all go to
    one peer."""
    mine = peer_pointer(buffers_ptr, rank, dtype) + own_offset
    for row in range(first_row, num_rows, row_step):
        x = tl.load(mine + row * N + offs, mask=mask, other=0.0)
        for k in tl.static_range(1, WORLD):
            theirs = peer_pointer(buffers_ptr, (rank + k) % WORLD, dtype) + own_offset
            tl.store(theirs + row * N + offs, x, mask=mask)


@triton.jit
def _add_then_norm_when_last(total, res_row_ptr, w_ptr, out_row_ptr, counter, offs, mask, eps,
                             N: tl.constexpr, BLOCK: tl.constexpr, SPLIT: tl.constexpr):
    """Add this slice's sum to the residual stream (written back); the last of the row's
    SPLIT programs to arrive reads the whole row back and normalises it, as the norm kernel
    does (`add_rms_norm_row` on the stream): the same sum of squares, in the same order."""
    add_residual(total, res_row_ptr, offs, mask)
    # Every thread's stores happen before the barrier, the barrier before the counter's
    # release: the program that sees the last arrival sees the whole row.
    tl.debug_barrier()
    if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == SPLIT - 1:
        row_offs = tl.arange(0, BLOCK)
        row_mask = row_offs < N
        x = tl.load(res_row_ptr + row_offs, mask=row_mask, other=0.0,
                    cache_modifier=".cg").to(tl.float32)  # written by other programs: from L2
        add_rms_norm_row(x, res_row_ptr, w_ptr, out_row_ptr, row_offs, row_mask, eps, N, False)
        tl.store(counter, 0)  # zero again for the next launch (CUDA-graph replays)


def programs_per_row(num_rows: int, n: int, world_size: int) -> int:
    """How many programs share each row: at few rows one program reading a whole row from
    every peer can have too few reads in flight, so at the world sizes where that measured
    slower (SPLIT_WORLD_SIZES) the row's slices go to several programs (up to MAX_SPLIT, a
    slice at least MIN_SLICE elements, the grid at most MAX_PROGRAMS); at many rows, and at
    other world sizes, one program per row."""
    if world_size not in SPLIT_WORLD_SIZES:
        return 1
    most = min(MAX_SPLIT, MAX_PROGRAMS // max(num_rows, 1), n // MIN_SLICE)
    return 1 << (most.bit_length() - 1) if most > 1 else 1


def grid_size(num_rows: int, split: int) -> int:
    """The programs of a launch for `num_rows` rows of `split` programs each: each meets its
    namesake on every rank at the barrier, so all must be resident at once (at most
    MAX_PROGRAMS; more rows are looped over)."""
    return min(num_rows * split, MAX_PROGRAMS)


def partial_offset(slot: int, rank: int, world: int, slot_bytes: int, push: bool) -> int:
    """Where `rank`'s partial product for `slot` lies in its own buffer (bytes): the slot's
    start; with `push`, sub-slot `rank` of the slot, which holds every rank's partial."""
    return (slot * world + rank) * slot_bytes if push else slot * slot_bytes


def buffer_bytes(slot_bytes: int, world: int, push: bool) -> int:
    """A rank's buffer for two slots of partial products of up to `slot_bytes`: `world` times
    as large with `push` (a sub-slot per rank in each slot)."""
    return 2 * slot_bytes * (world if push else 1)


def all_reduce_add_rms_norm(buffers: Tensor, signals: Tensor, rank: int, slot: int,
                            slot_bytes: int, partial: Tensor, residual: Tensor, weight: Tensor,
                            eps: float, split: int | None = None,
                            push: bool = False) -> tuple[Tensor, Tensor]:
    """(RMSNorm(residual + sum over ranks of partial), that sum), the sum written into
    `residual` in place: `model_ops.rms_norm` of the all-reduced partial products.

    buffers, signals: int64 [world] device addresses of every rank's buffer and signal pad;
    `partial` [T, N] is this rank's product, contiguous at `partial_offset(slot, rank, ...)`
    in its buffer (slot 0 or 1; `buffer_bytes` long: two slots of `slot_bytes`, or with
    `push` two slots of a sub-slot of `slot_bytes` per rank); every rank calls this with the
    same shapes, slot and `push`, in the same order. `split`: the programs per row,
    `programs_per_row`'s by default (1 gives one program per row, as a benchmark compares).
    `push`: store our partial into every peer's buffer before the barrier and read all of
    them locally after it, instead of reading the peers' buffers (see the module)."""
    world = buffers.numel()
    num_rows, n = partial.shape
    assert partial.is_contiguous() and residual.shape == partial.shape
    assert residual.stride(-1) == 1 and weight.is_contiguous() and slot in (0, 1)
    assert partial.numel() * partial.element_size() <= slot_bytes
    assert slot_bytes % 16 == 0, "a slot (and a sub-slot) starts on a 16-byte boundary"
    out = torch.empty_like(residual, memory_format=torch.contiguous_format)
    if num_rows == 0:
        return out, residual
    split = programs_per_row(num_rows, n, world) if split is None else split
    assert split == 1 or num_rows * split <= MAX_PROGRAMS, "a split row's programs loop"
    block = triton.next_power_of_2(n)
    slice_size = triton.cdiv(n, split)
    size = partial.element_size()
    # a row's counter, for its programs' arrivals (never read with one program per row)
    arrivals = out if split == 1 else arrival_counters(num_rows, partial.device)
    _all_reduce_add_rms_norm_kernel[(grid_size(num_rows, split),)](
        buffers, signals, residual, weight, out, arrivals, rank,
        partial_offset(slot, 0, world, slot_bytes, push) // size,
        slot_bytes // size if push else 0,
        slot * MAX_PROGRAMS * world, num_rows, residual.stride(0), out.stride(0), eps,
        N=n, BLOCK=block, SPLIT=split, SLICE=slice_size,
        SLICE_BLOCK=triton.next_power_of_2(slice_size), WORLD=world, PUSH=push,
        num_warps=norm_warps(block), **pdl.launch_options())
    return out, residual
