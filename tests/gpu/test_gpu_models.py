"""The model families on CUDA: the Triton attention kernels with windows and score caps, the
fused MoE kernel and the Triton elementwise ops, in float32, against transformers on the same
tiny random checkpoints as tests/model/test_families.py (the CPU runs them through the torch
reference and the per-expert path). Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from pagedserve.attention.triton_backend import TritonBackend
from pagedserve.model import load_model
from tests.model.paged import PagedDriver
from tests.model.test_decoder import make_checkpoint
from tests.model.test_families import CASES, SCHEDULE, TINY

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("case", list(CASES))
def test_paged_logits_match_transformers_on_cuda(case, tmp_path):
    hf = make_checkpoint(CASES[case](), tmp_path).cuda()
    model, _, _ = load_model(tmp_path, torch.float32, "cuda")
    gen = torch.Generator().manual_seed(1)
    seqs = {"a": torch.randint(0, TINY["vocab_size"], (13,), generator=gen).tolist(),
            "b": torch.randint(0, TINY["vocab_size"], (12,), generator=gen).tolist()}
    with torch.no_grad():
        ref = {s: hf(torch.tensor([ids], device="cuda")).logits[0].cpu()
               for s, ids in seqs.items()}
    driver = PagedDriver(model, block_size=4)
    driver.backend = TritonBackend()
    for feed_a, feed_b in SCHEDULE:
        spans = {"a": feed_a, "b": feed_b}
        out = driver.step({s: seqs[s][sp[0]:sp[1]] for s, sp in spans.items() if sp})
        for s, sp in spans.items():
            if sp:
                torch.testing.assert_close(out[s], ref[s][sp[0]:sp[1]], atol=2e-4, rtol=2e-4,
                                           msg=f"{case} seq {s} positions {sp}")
