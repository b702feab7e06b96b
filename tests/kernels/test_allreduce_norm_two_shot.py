"""The fused two-shot all-reduce + residual add + RMSNorm (kernels/triton/
allreduce_norm_two_shot.py) under TRITON_INTERPRET=1 (conftest), its ranks simulated in one
process: each rank's buffer and signal pad a tensor, their addresses in the tables the kernel
reads, the ranks launched one after another.

A rank's programs wait twice for their namesakes on every other rank: first for the partial
products, then for the rows of the new residual stream that the others reduced and wrote into
its stream region. So before rank r runs, what the ranks after it (not yet launched) would
have done by then is done on their behalf: their flags of both barriers are raised in r's pad
and their shares of the reference stream written into r's region. Once r has run, those rows
of its region are scrambled again, so that the later ranks' own writes must put them back.
Every rank's output thus checks the rows written for real by the ranks before it, and the
regions at the end check every rank's writes into every peer's.

Sums against torch's in rank order, rounded once, then `model_ops.rms_norm` (the unfused
kernel): equal to the bit. At the end each rank must have lowered every flag in its own pad
and raised its own in every pad: exactly the flags raised on a later rank's behalf are up."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels.triton import allreduce_norm_two_shot as two_shot
from tests.kernels.test_allreduce_norm import unfused_reference
from tests.kernels.test_model_ops import assert_matches, exact_bf16, fresh_seed  # noqa: F401

STREAM_BYTES = 1 << 16  # where a buffer's stream region starts
GARBAGE = 0xFF  # bytes of a buffer nobody wrote: NaN in bf16 and float32


def _buffer(partial: torch.Tensor) -> torch.Tensor:
    """A rank's buffer: its partial product at the start, garbage elsewhere."""
    buf = torch.full((2 * STREAM_BYTES,), GARBAGE, dtype=torch.uint8)
    buf[:partial.numel() * partial.element_size()].view(partial.dtype).copy_(partial.view(-1))
    return buf


def _stream(buf: torch.Tensor, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """The stream region of `buf` as [rows, hidden] (a view: writes go to the buffer)."""
    nbytes = shape[0] * shape[1] * dtype.itemsize
    return buf[STREAM_BYTES:STREAM_BYTES + nbytes].view(dtype).view(shape)


def _later_rows(rank: int, rows: int, world: int) -> slice:
    """The rows that the ranks after `rank` reduce (contiguous: the shares are in order)."""
    first, count = two_shot.row_share(rank, rows, world)
    return slice(first + count, rows)


def simulate(partials, residual, weight, want_stream, max_programs):
    """Each rank's (out, residual), buffer and signal pad after every rank ran, and the
    program count."""
    world = len(partials)
    rows, n = partials[0].shape
    dtype = partials[0].dtype
    buffers = [_buffer(p) for p in partials]
    buffer_table = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)
    pads = [torch.zeros(two_shot.signal_words(world), dtype=torch.int32) for _ in range(world)]
    signal_table = torch.tensor([p.data_ptr() for p in pads], dtype=torch.int64)
    programs = two_shot.grid_size(rows, world, max_programs)
    results = []
    for rank in range(world):
        for program in range(programs):  # the ranks not yet launched passed both barriers
            for phase in (0, 1):
                flag = (phase * two_shot.MAX_PROGRAMS + program) * world
                pads[rank][flag + rank + 1:flag + world] = 1
        later = _later_rows(rank, rows, world)  # ... and wrote their rows into our region
        stream = _stream(buffers[rank], (rows, n), dtype)
        stream[later] = want_stream[later]
        partial = buffers[rank][:rows * n * dtype.itemsize].view(dtype).view(rows, n)
        results.append(two_shot.all_reduce_add_rms_norm(
            buffer_table, signal_table, rank, STREAM_BYTES, partial, residual.clone(), weight,
            1e-6, max_programs))
        stream.view(torch.uint8)[later] = GARBAGE  # theirs to write for real
    return results, buffers, pads, programs


# (world, rows, hidden, max_programs)
CASES = [
    (2, 5, 96, 128),  # ragged shares (3 + 2), a row narrower than its block
    (4, 10, 1000, 128),  # shares 3, 3, 2, 2; hidden not a multiple of the block
    (4, 3, 64, 128),  # fewer rows than ranks: rank 3 owns none
    (4, 1, 256, 128),  # one row: three ranks own none, and gather it
    (2, 8, 256, 128),  # even shares
    (2, 9, 64, 2),  # more rows than programs: each program loops over its rows
    (4, 13, 128, 3),  # ragged shares, looping, fewer programs than the largest share
]


@pytest.mark.usefixtures("exact_bf16")
@pytest.mark.parametrize("dtype,world,rows,hidden,max_programs", [
    (dtype, *case) for dtype in (torch.float32, torch.bfloat16) for case in CASES])
def test_sum_add_and_norm_equal_the_unfused_kernels_on_every_rank(dtype, world, rows, hidden,
                                                                 max_programs):
    seed = fresh_seed()
    partials = [(2 * torch.randn(rows, hidden)).to(dtype) for _ in range(world)]
    residual = (3 * torch.randn(rows, hidden)).to(dtype)
    weight = (1 + 0.3 * torch.randn(hidden)).to(dtype)
    want_out, want_sum, ref_out, ref_sum = unfused_reference(partials, residual, weight)

    results, buffers, pads, programs = simulate(partials, residual, weight, want_sum,
                                                max_programs)
    msg = f"seed {seed}"
    for rank, (out, total) in enumerate(results):
        assert torch.equal(total, want_sum), f"{msg}: rank {rank}'s residual stream"
        assert torch.equal(out, want_out), f"{msg}: rank {rank}'s output"
        stream = _stream(buffers[rank], (rows, hidden), dtype)
        for owner in range(world):  # every other rank wrote its rows into ours
            start, share = two_shot.row_share(owner, rows, world)
            if owner != rank:
                assert torch.equal(stream[start:start + share],
                                   want_sum[start:start + share]), (
                    f"{msg}: rank {owner}'s rows in rank {rank}'s stream region")
    assert_matches(results[0][1], ref_sum, msg, exact=True)
    assert_matches(results[0][0], ref_out, msg)

    for rank, pad in enumerate(pads):
        want = torch.zeros_like(pad)
        for program in range(programs):  # the later ranks' flags, raised by them
            for phase in (0, 1):
                flag = (phase * two_shot.MAX_PROGRAMS + program) * world
                want[flag + rank + 1:flag + world] = 1
        assert torch.equal(pad, want), f"rank {rank}'s signal pad after both barriers"


def test_shares_cover_the_rows_in_order_and_differ_by_at_most_one():
    for world in (2, 4):
        for rows in range(0, 40):
            shares = [two_shot.row_share(r, rows, world) for r in range(world)]
            assert [f for f, _ in shares] == [sum(c for _, c in shares[:r])
                                              for r in range(world)]
            assert sum(c for _, c in shares) == rows
            assert max(c for _, c in shares) - min(c for _, c in shares) <= 1
            assert two_shot.grid_size(rows, world) == max(1, max(c for _, c in shares))
    assert two_shot.grid_size(10_000, 2) == two_shot.MAX_PROGRAMS
    assert two_shot.grid_size(10_000, 2, 100) == 100


def test_an_empty_message_launches_nothing():
    empty = torch.empty(0, 64)
    table = torch.zeros(2, dtype=torch.int64)  # never read
    out, total = two_shot.all_reduce_add_rms_norm(table, table, 0, STREAM_BYTES, empty,
                                                  empty.clone(), torch.ones(64), 1e-6)
    assert out.shape == (0, 64) and total.shape == (0, 64)
