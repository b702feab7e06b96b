"""The sampler's bitmask hook: every row samples an allowed token (greedy, random, seeded,
penalized, with logprobs), rows whose mask is all ones sample what they would without it,
and a random row under a mask draws from the renormalized allowed set. On the CPU (torch
path) here; on CUDA (the fused kernel, bf16 logits) where available."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xgrammar as xgr

from pagedserve.device.input_batch import CachedRequestState
from pagedserve.device.sampler import (Sampler, SamplingMetadata, select_sampling_kernels,
                                       to_device)
from pagedserve.sampling_params import SamplingParams
from pagedserve.structured.bitmask import apply_token_bitmask

VOCAB = 100
DEVICES = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])


def requests() -> list[CachedRequestState]:
    params = [dict(temperature=0.0), dict(temperature=1.0, seed=1), dict(temperature=0.8),
              dict(temperature=1.0, seed=2, top_k=20, repetition_penalty=1.3),
              dict(temperature=0.0, logprobs=3)]
    out = []
    for i, p in enumerate(params):
        request = CachedRequestState(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=8, **p))
        request.append_output_token(4)
        out.append(request)
    return out


def bitmask(allowed: dict[int, list[int]], rows: int) -> np.ndarray:
    """Rows not in `allowed` allow everything."""
    mask = np.full(xgr.get_bitmask_shape(rows, VOCAB), -1, dtype=np.int32)  # all allowed
    for row, tokens in allowed.items():
        mask[row] = 0
        for t in tokens:
            mask[row, t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
    return mask


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_masked_rows_sample_allowed_tokens_and_free_rows_are_unchanged(device):
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    allowed = {0: [97], 1: [5, 37, 70], 3: [0, 31, 32, 99], 4: [64, 65]}
    batch = requests()
    sampler = Sampler(select_sampling_kernels(device))  # the runner's for the device
    for trial in range(5):
        torch.manual_seed(trial)
        logits = torch.randn(len(batch), VOCAB, device=device).to(dtype)
        meta = SamplingMetadata.from_requests(batch, VOCAB, device, fused=sampler.fused)
        torch.manual_seed(trial)
        free = sampler(logits.clone(), meta).sampled_token_ids.tolist()
        meta = SamplingMetadata.from_requests(batch, VOCAB, device, fused=sampler.fused)
        meta.allowed_token_bitmask = to_device(torch.from_numpy(bitmask(allowed, len(batch))),
                                               device)
        torch.manual_seed(trial)
        out = sampler(logits.clone(), meta)
        tokens = out.sampled_token_ids.tolist()
        for row, allowed_tokens in allowed.items():
            assert tokens[row] in allowed_tokens
        assert tokens[2] == free[2]  # unmasked rows: the same draw
        assert tokens[0] == 97 and out.logprobs.sampled_logprobs[4] > -1e9


def test_random_row_draws_from_the_renormalized_allowed_set():
    allowed, draws = [3, 40, 77], 4000
    logits = torch.zeros(draws, VOCAB)
    logits[:, allowed] = torch.tensor([0.0, 1.0, 2.0])
    batch = [CachedRequestState(f"r{i}", [1], SamplingParams(temperature=1.0, max_tokens=8))
             for i in range(draws)]
    meta = SamplingMetadata.from_requests(batch, VOCAB, torch.device("cpu"))
    meta.allowed_token_bitmask = torch.from_numpy(bitmask(dict.fromkeys(range(draws), allowed),
                                                          draws))
    torch.manual_seed(0)
    tokens = Sampler()(logits, meta).sampled_token_ids
    expected = torch.tensor([0.0, 1.0, 2.0]).softmax(0).tolist()
    assert set(tokens.tolist()) <= set(allowed)
    for token, p in zip(allowed, expected):
        assert abs((tokens == token).float().mean().item() - p) < 0.03


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_a_bitmask_narrower_than_the_logits_extends_its_last_bit(device):
    """A grammar over fewer ids than the LM head has rows (`grammar_vocab_size`): the ids
    past the bitmask follow its last bit, masked in a constrained row, free in a free one."""
    vocab, covered = 200, 64
    logits = torch.randn(3, vocab, device=device)
    mask = np.full((3, covered // 32), -1, dtype=np.int32)
    mask[0] = 0
    mask[0, 0] = 1 << 5  # row 0 allows id 5 only (its last bit, id 63, is 0)
    mask[2, 1] = 0x7FFFFFFF  # row 2 allows all but id 63, so nothing past it
    out = apply_token_bitmask(logits.clone(), to_device(torch.from_numpy(mask), device)).cpu()
    reference = logits.cpu()
    assert torch.isfinite(out[0]).tolist() == [i == 5 for i in range(vocab)]
    assert torch.equal(out[1], reference[1])
    assert torch.isfinite(out[2]).tolist() == [i < 63 for i in range(vocab)]
