"""The fused one-shot all-reduce + residual add + RMSNorm (kernels/triton/allreduce_norm.py)
under TRITON_INTERPRET=1 (conftest), its ranks simulated in one process: each rank's buffer
and signal pad a tensor, their addresses in the tables the kernel reads, the ranks launched
one after another.

A rank's kernel waits at its barrier for every other rank's flag, so before rank r runs, the
flags of the ranks after it (not yet launched) are raised in r's pad on their behalf (and,
for the pushing variant, their rows stored into r's buffer); the ranks before it raised
theirs when they ran. At the end each rank must have lowered every flag in its own pad and
raised its own in every pad: exactly the flags raised on a later rank's behalf are up
again. Sums against torch's in rank order, then `model_ops.rms_norm`
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


class Ranks:
    """`world` simulated ranks: each one's buffer and signal pad (tensors of this process) and
    the address tables the kernel reads, kept from call to call as the engine keeps them.

    A rank's kernel waits at its barrier for every other rank's flag, so before rank r runs,
    the flags of the ranks after it (not yet launched) are raised in r's pad on their behalf,
    and, pushing, their partial rows stored into r's buffer: stand-ins for what they will do.
    After r ran, those rows are poisoned again, so that only the later ranks' own pushes put
    them back (which `call`'s caller checks in the buffers)."""

    def __init__(self, world: int, push: bool = False) -> None:
        self.world, self.push = world, push
        nbytes = allreduce_norm.buffer_bytes(SLOT_BYTES, world, push)
        self.buffers = [torch.zeros(nbytes, dtype=torch.uint8) for _ in range(world)]
        self.pads = [torch.zeros(allreduce_norm.signal_words(world), dtype=torch.int32)
                     for _ in range(world)]
        self.buffer_table = torch.tensor([b.data_ptr() for b in self.buffers],
                                         dtype=torch.int64)
        self.signal_table = torch.tensor([p.data_ptr() for p in self.pads], dtype=torch.int64)

    def partial(self, owner: int, source: int, slot: int, like: torch.Tensor,
                buffer: torch.Tensor | None = None) -> torch.Tensor:
        """Where `source`'s partial (shaped as `like`) lies in `owner`'s buffer (or in
        `buffer`, laid out as one): its own (owner == source, what the row-parallel layer
        writes) or, pushing, a peer's row."""
        buffer = self.buffers[owner] if buffer is None else buffer
        start = allreduce_norm.partial_offset(slot, source, self.world, SLOT_BYTES, self.push)
        view = buffer[start:start + like.numel() * like.element_size()]
        return view.view(like.dtype).view(like.shape)

    def call(self, partials: list[torch.Tensor], residual: torch.Tensor, weight: torch.Tensor,
             slot: int, split: int | None = None) -> tuple[list, list, int]:
        """Each rank's (out, residual) from the kernel over `slot`, and the program count."""
        world = self.world
        rows, n = partials[0].shape
        programs = allreduce_norm.grid_size(
            rows, allreduce_norm.programs_per_row(rows, n, world) if split is None else split)
        flags = [slot * allreduce_norm.MAX_PROGRAMS * world + p * world
                 for p in range(programs)]
        for rank, partial in enumerate(partials):  # the row-parallel layer's product
            self.partial(rank, rank, slot, partial).copy_(partial)
        outs, sums = [], []
        for rank in range(world):
            later = range(rank + 1, world)
            for flag in flags:  # the ranks not yet launched have arrived
                self.pads[rank][flag + rank + 1:flag + world] = 1
            for source in later if self.push else ():  # ... with their rows pushed
                self.partial(rank, source, slot, partials[source]).copy_(partials[source])
            out, total = allreduce_norm.all_reduce_add_rms_norm(
                self.buffer_table, self.signal_table, rank, slot, SLOT_BYTES,
                self.partial(rank, rank, slot, partials[rank]), residual.clone(), weight,
                1e-6, split, self.push)
            outs.append(out)
            sums.append(total)
            for source in later if self.push else ():  # stand-ins gone: NaN bytes
                self.partial(rank, source, slot, partials[source]).view(torch.uint8).fill_(255)
        return outs, sums, programs

    def assert_flags_then_lower(self, slot: int, programs: int, msg: str) -> None:
        """Each rank lowered every flag in its own pad and raised its own in every pad: after
        the simulation exactly the later ranks' flags are up (their raises, which the owner
        took down early, on their behalf). Then down, as the owner's waits would leave them,
        for the next call."""
        world = self.world
        base = slot * allreduce_norm.MAX_PROGRAMS * world
        for rank, pad in enumerate(self.pads):
            want = torch.zeros_like(pad)
            for program in range(programs):  # the later ranks' flags, raised by them
                want[base + program * world + rank + 1:base + (program + 1) * world] = 1
            assert torch.equal(pad, want), f"{msg}: rank {rank}'s signal pad after the barrier"
            pad.zero_()


def simulate(partials: list[torch.Tensor], residual: torch.Tensor, weight: torch.Tensor,
             slot: int, split: int | None = None) -> tuple[list, list, list[torch.Tensor], int]:
    """Each rank's (out, residual) from the (pulling) kernel, its signal pad after every rank
    ran, and the program count."""
    ranks = Ranks(len(partials))
    outs, sums, programs = ranks.call(partials, residual, weight, slot, split)
    return outs, sums, ranks.pads, programs


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


# (world, rows, hidden, split) for the pushing variant: as CASES, each over several calls
PUSH_CASES = [
    (2, 1, 64, None), (2, 3, 96, None), (2, 1, 4096, None),  # unsplit; a Llama-3-8B token
    (4, 1, 4096, None),  # 16 programs of 256, each pushing its slice
    (4, 3, 1000, None), (4, 3, 1100, None),  # split rows, the last slice short
    (4, 5, 128, None), (4, 1, 1024, 1),  # too narrow to split; one program as asked
]
PUSH_SLOTS = (0, 1, 0, 1)  # calls alternate as the layers do; a slot's last rows are stale


@pytest.mark.usefixtures("exact_bf16")
@pytest.mark.parametrize("dtype,world,rows,hidden,split", [
    (dtype, *case) for dtype in (torch.float32, torch.bfloat16) for case in PUSH_CASES
] + [(torch.float32, 2, 67, 32, None)])  # more rows than programs: each loops (the slow one)
def test_pushing_partials_equals_reading_them_call_after_call(dtype, world, rows, hidden,
                                                               split):
    """Each rank pushes its partial rows into every peer's buffer and sums its own: the same
    bits as the pulling kernel and the unfused kernels, on every rank, call after call (new
    values each call, so a row a push missed is the slot's stale one, or a stand-in's NaN);
    every pushed row where it belongs and nothing else of a buffer touched; the pads and
    the row counters left as the pulling kernel leaves them."""
    seed = fresh_seed()
    pushing = Ranks(world, push=True)
    for call, slot in enumerate(PUSH_SLOTS):
        msg = f"seed {seed}, call {call}"
        partials = [(2 * torch.randn(rows, hidden)).to(dtype) for _ in range(world)]
        residual = (3 * torch.randn(rows, hidden)).to(dtype)
        weight = (1 + 0.3 * torch.randn(hidden)).to(dtype)
        before = [buffer.clone() for buffer in pushing.buffers]
        outs, sums, programs = pushing.call(partials, residual, weight, slot, split)

        pulled_outs, pulled_sums, _, _ = simulate(partials, residual, weight, slot, split)
        want_out, want_sum, _, _ = unfused_reference(partials, residual, weight)
        for rank in range(world):
            assert torch.equal(sums[rank], pulled_sums[rank]), f"{msg}: rank {rank}'s stream"
            assert torch.equal(outs[rank], pulled_outs[rank]), f"{msg}: rank {rank}'s output"
            assert torch.equal(sums[rank], want_sum), f"{msg}: rank {rank}'s stream"
            assert torch.equal(outs[rank], want_out), f"{msg}: rank {rank}'s output"
        for owner, want in enumerate(before):  # every rank's row in its sub-slot, no more
            for source, partial in enumerate(partials):
                pushing.partial(owner, source, slot, partial, want).copy_(partial)
            assert torch.equal(pushing.buffers[owner], want), f"{msg}: rank {owner}'s buffer"
        pushing.assert_flags_then_lower(slot, programs, msg)
        assert not arrival_counters(rows, torch.device("cpu")).any(), f"{msg}: a row counter"


def test_pushing_buffers_hold_a_sub_slot_per_rank_in_each_slot():
    """The row-parallel layer's product goes to this rank's own sub-slot; the slots and
    sub-slots do not overlap; without pushing, the layout is two slots of one partial."""
    for world in (2, 4):
        starts = sorted(allreduce_norm.partial_offset(slot, rank, world, SLOT_BYTES, True)
                        for slot in (0, 1) for rank in range(world))
        assert starts == [i * SLOT_BYTES for i in range(2 * world)]
        assert allreduce_norm.buffer_bytes(SLOT_BYTES, world, True) == 2 * world * SLOT_BYTES
        for rank in range(world):
            assert allreduce_norm.partial_offset(1, rank, world, SLOT_BYTES, False) == SLOT_BYTES
        assert allreduce_norm.buffer_bytes(SLOT_BYTES, world, False) == 2 * SLOT_BYTES
