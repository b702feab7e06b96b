"""A two-shot all-reduce fused with the residual add and the RMSNorm after it: one kernel where
the unfused path runs two (torch's two-shot reduction, then the add + norm), for the messages
too large for the one-shot fused kernel (`allreduce_norm.py`) to pay.

Why: past a few hundred KiB a one-shot reduction, in which every rank reads every rank's whole
message, is bound by the bytes each rank pulls over the links. Two-shot moves a world-size-th
of them per rank, but torch's kernel for it meets three barriers and then the norm reads and
writes every row again in a kernel of its own. Here, in one launch, every program of rank r:

1. meets its namesake on every rank at a barrier (`allreduce_norm.barrier`): every rank's
   partial product is in its buffer;
2. reduce-scatter by rows: rank r owns a contiguous share of the rows (`row_share`: M rows
   split W ways, the first M % W ranks one more; a rank may own none). For each of its rows
   it reads the row from every rank's buffer, in rank order, sums in float32 and rounds to
   the activation dtype (as the one-shot fused kernel does: every rank's sum is the same,
   bit for bit), adds the residual (`add_residual`: written back to this rank's stream),
   writes the new stream row into every peer's stream region (posted stores: no round
   trip), and normalises it with the norm kernel's own row body (`add_rms_norm_row`);
3. meets its namesakes at a second barrier: the rows they reduced are in its stream region;
4. the gather's second half, local: for every other rank's rows (those its namesake there
   reduced, one from each rank's share at a time, read together) it reads the stream row
   from its own region, writes it into its residual stream and normalises it, with the same
   row body on the same stored values: the same output, bit for bit, as the owner's. (At
   two and four ranks: one or three other ranks, written out.)

Only the stream crosses the links in the gather, not the normalised output, which every rank
derives: the same bytes as an unfused two-shot's gather, and no norm pass over M rows after
it. Pushed rather than pulled: a pull would wait a round trip over the link for each row
after the second barrier; the stores are posted while the owner still normalises, and
the barrier's release waits for them once. The gathered rows land in the caller's
`residual` and a fresh `out`, plain device memory: nothing returned aliases a buffer that the
next call overwrites. A row is whole in one program (16-byte vector loads and stores) so
that its sum of squares is the norm kernel's, in the norm kernel's order; the rows of a
share are spread over the programs (at most `max_programs`, one per SM so all are resident,
as the barriers need).

No barrier at the end, and one buffer, not two alternating slots: the two barriers of a call
order it against the next. The partial region is rewritten (by the next call's producer)
only after this rank's kernel has finished, so after every program here passed the second
barrier, which every peer's namesake raised after its reads of the partials. A rank's
stream region is written by a peer's program only after the first barrier of the next
call, which needs this rank's namesake there, so this rank's whole kernel before, gather
included, done (stream order; PDL waits for the previous kernel before the barrier). The
flags of each barrier are used again at the next call: a peer lowered this rank's flag of
barrier A before it raised its flag of barrier B, which this rank waited for; and lowered
the flag of B before it reached the next call's A, which this rank waits for before it
raises B again.

As for the one-shot fused kernel, the buffers and pads are given as tables of device
addresses (int64, one per rank), which lets the CPU tests simulate the ranks in one process
under TRITON_INTERPRET=1. The interpreter runs a launch's programs in turn and the ranks one
after another; no program waits for another of its own launch, only for its namesakes on
other ranks (see the test for how a rank that has not run yet is stood in for).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from pagedserve.kernels.triton import pdl
from pagedserve.kernels.triton.allreduce_norm import barrier, peer_pointer
from pagedserve.kernels.triton.model_ops import add_residual, add_rms_norm_row, norm_warps
from pagedserve.kernels.triton.precision import round_to

MAX_PROGRAMS = 128  # the most programs of a launch: bounds the signal pad its barriers use
_SECOND_FLAGS = tl.constexpr(MAX_PROGRAMS)  # the second barrier's flags follow the first's


def signal_words(world_size: int) -> int:
    """The int32 flags of a signal pad that the two barriers use."""
    return 2 * MAX_PROGRAMS * world_size


def row_share(rank: int, num_rows: int, world_size: int) -> tuple[int, int]:
    """(first row, row count) that `rank` reduces: M rows split in order, the first M % W
    ranks one more (the kernel's `_row_share`)."""
    base, extra = divmod(num_rows, world_size)
    return rank * base + min(rank, extra), base + (rank < extra)


def grid_size(num_rows: int, world_size: int, max_programs: int = MAX_PROGRAMS) -> int:
    """One program per row of the largest share, at most `max_programs` (a program loops
    over rows beyond that)."""
    return max(1, min(triton.cdiv(num_rows, world_size), max_programs, MAX_PROGRAMS))


@triton.jit
def _row_share(owner, num_rows, WORLD: tl.constexpr):
    base = num_rows // WORLD
    extra = num_rows % WORLD
    return owner * base + tl.minimum(owner, extra), base + (owner < extra).to(tl.int32)


# Not specialised on the row count or the rank: Triton makes an int argument equal to 1 a
# constant, which would compile the kernel again for one row (and for rank 1), and turns the
# row arithmetic into Python on constants.
@triton.jit(do_not_specialize=["rank", "num_rows"])
def _two_shot_add_rms_norm_kernel(buffers_ptr, signals_ptr, res_ptr, w_ptr, out_ptr, rank,
                                  stream_offset, num_rows, stride_res, stride_out, eps,
                                  N: tl.constexpr, BLOCK: tl.constexpr, WORLD: tl.constexpr):
    pdl.step_entry()
    program = tl.program_id(0)
    programs = tl.num_programs(0)
    barrier(signals_ptr, program * WORLD, rank, WORLD)  # A: every partial is in its buffer
    dtype = out_ptr.dtype.element_ty
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    first, count = _row_share(rank, num_rows, WORLD)
    for row in range(first + program, first + count, programs):  # int32 offsets
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for peer in tl.static_range(WORLD):  # rank order: the same sum on every rank
            part = peer_pointer(buffers_ptr, peer, dtype)
            total += tl.load(part + row * N + offs, mask=mask, other=0.0,
                             cache_modifier=".cg").to(tl.float32)
        x = add_residual(round_to(total, dtype), res_ptr + row * stride_res, offs, mask)
        for peer in tl.static_range(WORLD):  # the new stream row, into every peer's region
            if peer != rank:
                theirs = peer_pointer(buffers_ptr, peer, dtype) + stream_offset
                tl.store(theirs + row * N + offs, x.to(dtype), mask=mask)
        add_rms_norm_row(x, res_ptr + row * stride_res, w_ptr, out_ptr + row * stride_out,
                         offs, mask, eps, N, False)
    # Every thread's stores to the peers happen before the barrier, the barrier before the
    # flags' release at system scope: a peer that sees our flag sees our rows.
    tl.debug_barrier()
    barrier(signals_ptr, (_SECOND_FLAGS + program) * WORLD, rank, WORLD)  # B: rows are in
    tl.debug_barrier()
    # The other ranks' rows, a round at a time: the j-th row of this program in each other
    # rank's share. A round's rows are all loaded before any is stored, so that their reads
    # are in flight together (a store between two loads would keep the second waiting).
    ours = peer_pointer(buffers_ptr, rank, dtype) + stream_offset
    largest = tl.cdiv(num_rows, WORLD)
    for j in range(program, largest, programs):
        row1, x1 = _gathered_row(ours, rank, 1, j, num_rows, offs, mask, N, WORLD)
        if WORLD == 4:
            row2, x2 = _gathered_row(ours, rank, 2, j, num_rows, offs, mask, N, WORLD)
            row3, x3 = _gathered_row(ours, rank, 3, j, num_rows, offs, mask, N, WORLD)
        _store_and_norm(x1, row1, res_ptr, w_ptr, out_ptr, stride_res, stride_out, offs, mask,
                        eps, N)
        if WORLD == 4:
            _store_and_norm(x2, row2, res_ptr, w_ptr, out_ptr, stride_res, stride_out, offs,
                            mask, eps, N)
            _store_and_norm(x3, row3, res_ptr, w_ptr, out_ptr, stride_res, stride_out, offs,
                            mask, eps, N)


@triton.jit
def _gathered_row(ours, rank, k: tl.constexpr, j, num_rows, offs, mask, N: tl.constexpr,
                  WORLD: tl.constexpr):
    """(row, its stream values in float32, -1 and zeros where the share has no j-th row)
    for the j-th row of rank (rank + k) % WORLD's share, as that rank wrote it into ours."""
    start, count = _row_share((rank + k) % WORLD, num_rows, WORLD)
    row = tl.where(j < count, start + j, -1)
    # the condition as a vector: the interpreter rejects a mask of a vector and a scalar
    in_share = tl.zeros_like(offs) + j < count
    x = tl.load(ours + row * N + offs, mask=mask & in_share, other=0.0,
                cache_modifier=".cg").to(tl.float32)  # written by that rank
    return row, x


@triton.jit
def _store_and_norm(x, row, res_ptr, w_ptr, out_ptr, stride_res, stride_out, offs, mask, eps,
                    N: tl.constexpr):
    """A gathered stream row into this rank's residual, and normalised (none if `row` < 0)."""
    if row >= 0:
        tl.store(res_ptr + row * stride_res + offs, x.to(res_ptr.dtype.element_ty), mask=mask)
        add_rms_norm_row(x, res_ptr + row * stride_res, w_ptr, out_ptr + row * stride_out,
                         offs, mask, eps, N, False)


def all_reduce_add_rms_norm(buffers: Tensor, signals: Tensor, rank: int, stream_bytes: int,
                            partial: Tensor, residual: Tensor, weight: Tensor, eps: float,
                            max_programs: int = MAX_PROGRAMS) -> tuple[Tensor, Tensor]:
    """(RMSNorm(residual + sum over ranks of partial), that sum), the sum written into
    `residual` in place: `model_ops.rms_norm` of the all-reduced partial products, bit for
    bit.

    buffers, signals: int64 [world] device addresses of every rank's buffer and signal pad;
    a buffer holds the partial product at its start and the stream region from byte
    `stream_bytes` (at least the message's size); `partial` [T, N] is this rank's product,
    contiguous at its buffer's start; every rank calls this with the same shapes, in the
    same order. `max_programs`: the programs that may be resident at once (the SMs)."""
    world = buffers.numel()
    assert world in (2, 4), "the kernel gathers from one or three other ranks"
    num_rows, n = partial.shape
    assert partial.is_contiguous() and residual.shape == partial.shape
    assert residual.dtype == partial.dtype and residual.stride(-1) == 1
    assert weight.is_contiguous() and partial.numel() * partial.element_size() <= stream_bytes
    out = torch.empty_like(residual, memory_format=torch.contiguous_format)
    if num_rows == 0:
        return out, residual
    block = triton.next_power_of_2(n)
    _two_shot_add_rms_norm_kernel[(grid_size(num_rows, world, max_programs),)](
        buffers, signals, residual, weight, out, rank, stream_bytes // partial.element_size(),
        num_rows, residual.stride(0), out.stride(0), eps, N=n, BLOCK=block, WORLD=world,
        num_warps=norm_warps(block), **pdl.launch_options())
    return out, residual
