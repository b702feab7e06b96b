"""The batched LoRA kernels (kernels/triton/lora.py) against the torch reference
(model/lora.py) under the Triton interpreter: ragged segments of several adapters and the
base model (prefill), and rows of mixed adapters (decode), ranks 8 to 64."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels.triton.lora import lora_shrink_expand
from pagedserve.model.lora import LoRABatch, reference_lora


def batch_of(seg_lens: list[int], seg_slots: list[int]) -> LoRABatch:
    starts = torch.tensor([0] + seg_lens[:-1]).cumsum(0)
    token_slots = torch.repeat_interleave(torch.tensor(seg_slots), torch.tensor(seg_lens))
    rows = {s: torch.nonzero(token_slots == s).squeeze(1) for s in set(seg_slots) if s >= 0}
    i32 = torch.int32
    return LoRABatch(token_slots.to(i32), starts.to(i32), torch.tensor(seg_lens, dtype=i32),
                     torch.tensor(seg_slots, dtype=i32), max(seg_lens), rows)


CASES = {  # (rank, segment lengths, their slots; -1: the base model)
    "prefill-r8-ragged": (8, [5, 17, 1, 33], [2, -1, 0, 2]),
    "prefill-r64-one-long": (64, [40, 3], [1, 3]),
    "decode-r16-mixed": (16, [1] * 7, [0, 3, -1, 3, 1, 0, -1]),
    "decode-r32-all-base": (32, [1] * 3, [-1, -1, -1]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_reference(case, dtype):
    rank, lens, slots = CASES[case]
    gen = torch.Generator().manual_seed(0)
    K, N, num_slots = 96, 80, 4
    x = torch.randn(sum(lens), K, generator=gen).to(dtype)
    a = (torch.randn(num_slots, rank, K, generator=gen) / K**0.5).to(dtype)
    b = torch.randn(num_slots, N, rank, generator=gen).to(dtype)
    y0 = torch.randn(sum(lens), N, generator=gen).to(dtype)
    batch = batch_of(lens, slots)
    expected, got = y0.clone(), y0.clone()
    reference_lora(x, expected, a, b, batch)
    lora_shrink_expand(x, got, a, b, batch)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.1, rtol=0.02)
    torch.testing.assert_close(got, expected, **tol)
    base = torch.tensor([s for s, n in zip(slots, lens) for _ in range(n)]) < 0
    assert torch.equal(got[base], y0[base])  # the base model's rows are left alone
