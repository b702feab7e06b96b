"""The batched LoRA kernels (kernels/triton/lora.py) against the torch reference
(model/lora.py) under the Triton interpreter, ranks 8 to 64: ragged prefills of several adapters
and the base model, and decode rows of mixed adapters, through the tiles (rows sorted by
adapter, `fill_tiles`: runs longer than a tile, runs shorter) and the one-row kernels; K
whole, and K split over programs with a ragged last block (the tiles' atomic sums, the
rows' partial sums); stacked ranks over one rank block."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedserve.kernels.triton.lora import lora_shrink_expand
from pagedserve.model.lora import TILE_ROWS, LoRABatch, fill_tiles, max_tiles, reference_lora


def batch_of(seg_lens: list[int], seg_slots: list[int], one_row: bool) -> LoRABatch:
    """The step's rows as the runner gives them: each token's slot, and the rows of adapters
    sorted by slot in tiles (`fill_tiles`)."""
    token_slots = np.repeat(np.array(seg_slots, dtype=np.int32), seg_lens)
    T, tiles = len(token_slots), max_tiles(len(token_slots), 4)
    sorted_rows = np.zeros(T, dtype=np.int32)
    starts, lens, slots = (np.zeros(tiles, dtype=np.int32) for _ in range(3))
    count = fill_tiles(token_slots, sorted_rows, starts, lens, slots)
    rows = {s: torch.from_numpy(np.flatnonzero(token_slots == s)) for s in set(seg_slots)
            if s >= 0}
    t = torch.from_numpy
    return LoRABatch(t(token_slots), t(sorted_rows), t(starts[:count]), t(lens[:count]),
                     t(slots[:count]), one_row, TILE_ROWS, rows)


CASES = {  # (rank, K, request lengths, their slots (-1: the base model), one-row kernels)
    "prefill-r8-ragged": (8, 96, [5, 17, 1, 33], [2, -1, 0, 2], False),
    "prefill-r64-one-long": (64, 96, [40, 3], [1, 3], False),
    "prefill-r16-k-whole": (16, 48, [9, 35], [0, 1], False),  # one K block: no split
    "prefill-r96-k-ragged": (96, 200, [3, 34], [3, 0], False),  # two rank blocks
    "decode-r16-tiles": (16, 96, [1] * 40, [0, 3, -1, 3, 1, 0, -1, 2] * 5, False),
    "decode-r48-tiles-k-ragged": (48, 300, [1] * 12, [1, -1, 2, 1] * 3, False),
    "decode-r16-one-row": (16, 96, [1] * 7, [0, 3, -1, 3, 1, 0, -1], True),
    "decode-r16-one-row-k-split": (16, 1000, [1] * 3, [2, -1, 2], True),
    "decode-r48-one-row-k-ragged": (48, 700, [1] * 5, [1, 0, -1, 3, 1], True),
    "decode-r96-one-row": (96, 136, [1] * 2, [3, 1], True),  # two rank blocks
    "decode-r32-all-base": (32, 96, [1] * 3, [-1, -1, -1], True),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_reference(case, dtype):
    rank, K, lens, slots, one_row = CASES[case]
    gen = torch.Generator().manual_seed(0)
    N, num_slots = 80, 4
    x = torch.randn(sum(lens), K, generator=gen).to(dtype)
    a = (torch.randn(num_slots, rank, K, generator=gen) / K**0.5).to(dtype)
    b = torch.randn(num_slots, N, rank, generator=gen).to(dtype)
    y0 = torch.randn(sum(lens), N, generator=gen).to(dtype)
    batch = batch_of(lens, slots, one_row)
    expected, got = y0.clone(), y0.clone()
    reference_lora(x, expected, a, b, batch)
    lora_shrink_expand(x, got, a, b, batch)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.1, rtol=0.02)
    torch.testing.assert_close(got, expected, **tol)
    base = torch.tensor([s for s, n in zip(slots, lens) for _ in range(n)]) < 0
    assert torch.equal(got[base], y0[base])  # the base model's rows are left alone
