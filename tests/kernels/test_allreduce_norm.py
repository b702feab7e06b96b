"""The fused one-shot all-reduce + residual add + RMSNorm (kernels/triton/allreduce_norm.py)
under TRITON_INTERPRET=1 (conftest), its ranks simulated in one process: each rank's buffer
and signal pad a tensor, their addresses in the tables the kernel reads, the ranks launched
one after another.

A rank's kernel waits at its barrier for every other rank's flag, so before rank r runs, the
flags of the ranks after it (not yet launched) are raised in r's pad on their behalf; the
ranks before it raised theirs when they ran. At the end each rank must have lowered every
flag in its own pad and raised its own in every pad: exactly the flags raised on a later
rank's behalf are up again. Sums against torch's in rank order, then `model_ops.rms_norm`
(the unfused kernel: equal to the bit) and the eager reference (to its tolerance).

At few rows a row's slices go to several programs, the last of which to arrive normalises the
whole row from the stored stream: the norm kernel's sum of squares in the norm kernel's order,
so those cases too must equal `model_ops.rms_norm` to the bit (tolerance zero), and leave the
row counters at zero. The interpreter runs a launch's programs one after another, which the
kernel allows: no program waits for another of its own launch."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels.triton import allreduce_norm, model_ops
from pagedserve.kernels.triton.arrivals import arrival_counters
from pagedserve.model import ops
from tests.kernels.test_model_ops import assert_matches, exact_bf16, fresh_seed  # noqa: F401

SLOT_BYTES = 1 << 16


def unfused_reference(partials: list[torch.Tensor], residual: torch.Tensor,
                      weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """What the fused kernels must give: (the norm kernel's output, its residual stream) and
    (the eager reference's) on the partials summed in rank order in float32, rounded once
    (the kernels' sum)."""
    reduced = torch.zeros(partials[0].shape)
    for partial in partials:
        reduced += partial.float()
    reduced = reduced.to(partials[0].dtype)
    want_out, want_sum = model_ops.rms_norm(reduced, weight, 1e-6, residual.clone())
    ref_out, ref_sum = ops.eager_fused_add_rms_norm(reduced, residual.clone(), weight, 1e-6)
    return want_out, want_sum, ref_out, ref_sum


def simulate(partials: list[torch.Tensor], residual: torch.Tensor, weight: torch.Tensor,
             slot: int, split: int | None = None) -> tuple[list, list, list[torch.Tensor], int]:
    """Each rank's (out, residual) from the kernel, its signal pad after every rank ran, and
    the program count."""
    world = len(partials)
    rows, n = partials[0].shape
    buffers = [torch.zeros(2 * SLOT_BYTES, dtype=torch.uint8) for _ in range(world)]
    pads = [torch.zeros(allreduce_norm.signal_words(world), dtype=torch.int32)
            for _ in range(world)]
    buffer_table = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)
    signal_table = torch.tensor([p.data_ptr() for p in pads], dtype=torch.int64)
    programs = allreduce_norm.grid_size(
        rows, allreduce_norm.programs_per_row(rows, n, world) if split is None else split)
    flags = [slot * allreduce_norm.MAX_PROGRAMS * world + p * world for p in range(programs)]
    views = []
    for rank, partial in enumerate(partials):
        start = slot * SLOT_BYTES
        view = buffers[rank][start:start + partial.numel() * partial.element_size()]
        views.append(view.view(partial.dtype).view(rows, n))
        views[-1].copy_(partial)
    outs, sums = [], []
    for rank in range(world):
        for flag in flags:  # the ranks not yet launched have arrived
            pads[rank][flag + rank + 1:flag + world] = 1
        out, total = allreduce_norm.all_reduce_add_rms_norm(
            buffer_table, signal_table, rank, slot, SLOT_BYTES, views[rank], residual.clone(),
            weight, 1e-6, split)
        outs.append(out)
        sums.append(total)
    return outs, sums, pads, programs


# (world, rows, hidden, slot, split): split None is the shape's own (`programs_per_row`)
CASES = [
    (2, 1, 64, 0, None), (2, 3, 96, 1, None), (4, 5, 128, 0, None),  # rows too narrow to split
    (2, 1, 4096, 0, None),  # a decode token of Llama-3-8B at 2 ranks: one program
    (4, 1, 4096, 1, None),  # at 4 ranks: 16 programs of 256
    (4, 2, 1024, 0, None), (4, 3, 1000, 1, None),  # 4 and 2 programs a row, the last slice short
    (4, 3, 1100, 1, None),  # 4 programs a row of 275, in blocks of 512
    (4, 1, 1024, 0, 1),  # one program for the row, as a benchmark compares
]


@pytest.mark.usefixtures("exact_bf16")
@pytest.mark.parametrize("dtype,world,rows,hidden,slot,split", [
    (dtype, *case) for dtype in (torch.float32, torch.bfloat16) for case in CASES
] + [(torch.float32, 2, 67, 32, 1, None)])  # more rows than programs: each loops (the slow one)
def test_sum_add_and_norm_equal_the_unfused_kernels_on_every_rank(dtype, world, rows, hidden,
                                                                 slot, split):
    seed = fresh_seed()
    partials = [(2 * torch.randn(rows, hidden)).to(dtype) for _ in range(world)]
    residual = (3 * torch.randn(rows, hidden)).to(dtype)
    weight = (1 + 0.3 * torch.randn(hidden)).to(dtype)
    outs, sums, pads, programs = simulate(partials, residual, weight, slot, split)

    want_out, want_sum, ref_out, ref_sum = unfused_reference(partials, residual, weight)
    msg = f"seed {seed}"
    for rank in range(world):
        assert torch.equal(sums[rank], want_sum), f"{msg}: rank {rank}'s residual stream"
        assert torch.equal(outs[rank], want_out), f"{msg}: rank {rank}'s output"
    assert_matches(sums[0], ref_sum, msg, exact=True)
    assert_matches(outs[0], ref_out, msg)

    base = slot * allreduce_norm.MAX_PROGRAMS * world
    for rank, pad in enumerate(pads):
        want = torch.zeros_like(pad)
        for program in range(programs):  # the later ranks' flags, raised by them
            want[base + program * world + rank + 1:base + (program + 1) * world] = 1
        assert torch.equal(pad, want), f"rank {rank}'s signal pad after the barrier"
    counters = arrival_counters(rows, torch.device("cpu"))
    assert not counters.any(), "a row's arrival counter left raised"


def test_few_rows_are_split_over_programs_at_four_ranks_and_many_rows_are_not():
    for n in (1000, 4096, 8192):
        assert allreduce_norm.programs_per_row(1, n, 4) > 1
        assert allreduce_norm.programs_per_row(1, n, 2) == 1  # one program a row measured faster
        assert allreduce_norm.programs_per_row(100, n, 4) == 1
        for rows in range(1, 200):
            split = allreduce_norm.programs_per_row(rows, n, 4)
            assert split & (split - 1) == 0, (rows, n, split)
            assert split == 1 or n // split >= allreduce_norm.MIN_SLICE, (rows, n, split)
            assert allreduce_norm.grid_size(rows, n) <= allreduce_norm.MAX_PROGRAMS
    assert allreduce_norm.programs_per_row(1, 128, 4) == 1  # too narrow to share


def test_an_empty_message_launches_nothing():
    empty = torch.empty(0, 64)
    table = torch.zeros(2, dtype=torch.int64)  # never read
    out, total = allreduce_norm.all_reduce_add_rms_norm(table, table, 0, 0, SLOT_BYTES, empty,
                                                        empty.clone(), torch.ones(64), 1e-6)
    assert out.shape == (0, 64) and total.shape == (0, 64)
