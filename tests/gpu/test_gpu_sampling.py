"""The fused sampling kernels on CUDA at a real vocabulary, against the torch reference.

On the GPU the noise takes the fast log2, so draws are compared in distribution (chi-square
over many rows of a small vocabulary), by support (a drawn token is always one the
reference's filters keep) and by reproducibility; greedy rows, penalized or not, exactly.
Then the engine: with penalties, async scheduling stays on and gives the synchronous
engine's tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedserve.device.input_batch import CachedRequestState
from pagedserve.device.penalties import PenaltyState
from pagedserve.device.sampler import (Sampler, SamplingMetadata, apply_min_p, apply_penalties,
                                       apply_top_k_top_p, triton_sampling_kernels)
from pagedserve.kernels.triton.filtered_sampling import FilteredKernelConfig, filtered_sample
from pagedserve.sampling_params import SamplingParams
from tests.gpu.test_gpu_async_scheduling import sync_and_async
from tests.gpu.test_gpu_engine import prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CUDA = torch.device("cuda")
VOCAB = 151936


def requests_for(params: list[SamplingParams], vocab: int, seed: int = 0
                 ) -> list[CachedRequestState]:
    gen = torch.Generator().manual_seed(seed)
    requests = []
    for i, p in enumerate(params):
        request = CachedRequestState(f"r{i}", torch.randint(vocab, (64,), generator=gen).tolist(),
                                     p)
        for token in torch.randint(vocab, (32,), generator=gen).tolist():
            request.append_output_token(token)
        requests.append(request)
    return requests


def fused_sampler() -> Sampler:
    """The sampler a CUDA runner builds: with the Triton kernels."""
    return Sampler(triton_sampling_kernels())


def metadata(requests: list[CachedRequestState], vocab: int, fused: bool) -> SamplingMetadata:
    state = PenaltyState(vocab, CUDA)
    for r in requests:
        if r.sampling_params.needs_penalties:
            state.add(r.req_id, r.prompt_token_ids, r.output_token_ids)
    return SamplingMetadata.from_requests(requests, vocab, CUDA, fused=fused,
                                          penalty_state=state,
                                          penalty_slots=state.slots([r.req_id
                                                                     for r in requests]))


@torch.inference_mode()
def test_greedy_rows_penalized_or_not_equal_the_reference():
    logits = (torch.randn(64, VOCAB, device=CUDA) * 3).bfloat16()
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.0 + (i % 4) * 0.3,
                             frequency_penalty=0.1 * (i % 3), presence_penalty=0.2 * (i % 2))
              for i in range(64)]
    requests = requests_for(params, VOCAB)
    for r in requests[:8]:  # make the penalties decide: the argmax is among the seen tokens
        r.append_output_token(int(logits[int(r.req_id[1:])].argmax()))
    meta = metadata(requests, VOCAB, fused=True)
    tokens = fused_sampler()(logits, meta).sampled_token_ids
    expected = apply_penalties(logits.float(), meta.penalties).argmax(-1)
    assert torch.equal(tokens, expected)
    plain = SamplingMetadata.from_requests(requests_for([SamplingParams(temperature=0.0)] * 64,
                                                        VOCAB), VOCAB, CUDA, fused=True)
    assert torch.equal(fused_sampler()(logits, plain).sampled_token_ids, logits.argmax(-1))


@torch.inference_mode()
def test_filtered_draws_stay_in_the_reference_support_at_full_vocabulary():
    torch.manual_seed(0)
    logits = (torch.randn(128, VOCAB, device=CUDA) * 3).bfloat16()
    params = [SamplingParams(temperature=1.5, top_k=40 if i % 2 else 0,
                             top_p=0.95 if i % 3 else 1.0, min_p=0.02 if i % 5 == 0 else 0.0,
                             repetition_penalty=1.2 if i % 4 == 0 else 1.0, seed=i)
              for i in range(128)]
    for i, p in enumerate(params):  # every row filtered
        if p.top_k == 0 and p.top_p == 1.0 and p.min_p == 0.0:
            p.top_k = 100
    requests = requests_for(params, VOCAB)
    meta = metadata(requests, VOCAB, fused=True)
    tokens = fused_sampler()(logits, meta).sampled_token_ids
    z = apply_penalties(logits.float(), meta.penalties) / meta.temperature[:, None]
    kept = ~torch.isinf(apply_top_k_top_p(apply_min_p(z, meta.min_p), meta.top_k, meta.top_p))
    assert kept.gather(1, tokens[:, None]).all()
    again = fused_sampler()(logits, metadata(requests, VOCAB, fused=True)).sampled_token_ids
    assert torch.equal(again, tokens)  # seeded rows repeat
    alone = fused_sampler()(logits[5:6], metadata(requests[5:6], VOCAB, fused=True))
    assert int(alone.sampled_token_ids[0]) == int(tokens[5])  # ... in any batch


@torch.inference_mode()
def test_top_k_candidate_path_draws_the_full_pass_tokens():
    """The candidate path (top-k rows drawn from their 256 largest values) against the full
    pass over 151936 tokens, draw for draw, with penalties, top-p and min-p mixed in."""
    torch.manual_seed(1)
    logits = (torch.randn(256, VOCAB, device=CUDA) * 3).bfloat16()
    params = [SamplingParams(temperature=0.8 + (i % 3) * 0.4, top_k=[40, 1, 200, 0][i % 4],
                             top_p=0.95 if i % 3 else 1.0, min_p=0.02 if i % 5 == 0 else 0.0,
                             repetition_penalty=1.1 if i % 4 == 0 else 1.0, seed=i)
              for i in range(256)]
    requests = requests_for(params, VOCAB)
    m = metadata(requests, VOCAB, fused=True)
    args = (logits, m.temperature, m.greedy_mask, m.philox, m.min_p, m.top_k, m.top_p,
            m.penalties)
    fast = filtered_sample(*args)
    full = filtered_sample(*args, config=FilteredKernelConfig(candidates=1 << 18))
    assert torch.equal(fast, full)


@pytest.mark.parametrize("options", [
    {"top_k": 3}, {"top_p": 0.7}, {"min_p": 0.2}, {"top_k": 5, "top_p": 0.9, "min_p": 0.05},
    {"top_p": 0.8, "repetition_penalty": 2.0, "frequency_penalty": 0.5}])
@torch.inference_mode()
def test_fused_draws_follow_the_reference_distribution(options):
    """40000 rows of one 8-token row: the kernel's draws against the reference's filtered
    (and penalized) softmax. Chi-square below 35 (<= 7 dof: the 1e-5 tail is at 35)."""
    n, vocab = 40000, 8
    row = torch.tensor([2.0, 1.0, 0.5, 0.5, 0.0, -1.0, -3.0, 0.25], device=CUDA)
    # one history for every row: token 0 twice, token 3 in the prompt
    requests = [CachedRequestState(f"r{i}", [3], SamplingParams(temperature=0.8, **options))
                for i in range(n)]
    for r in requests:
        r.append_output_token(0)
        r.append_output_token(0)
    meta = metadata(requests, vocab, fused=True)
    tokens = fused_sampler()(row.expand(n, -1).contiguous(), meta).sampled_token_ids
    reference = metadata(requests[:1], vocab, fused=False)
    z = row[None]
    if reference.penalties is not None:
        z = apply_penalties(z, reference.penalties)
    z = z / 0.8
    for apply in (lambda x: apply_min_p(x, reference.min_p) if reference.min_p is not None
                  else x,
                  lambda x: apply_top_k_top_p(x, reference.top_k, reference.top_p)):
        z = apply(z)
    probs = z.softmax(-1)[0].double().cpu().numpy()
    counts = np.bincount(tokens.cpu().numpy(), minlength=vocab)
    assert counts[probs == 0].sum() == 0
    live = probs > 0
    expected = n * probs[live]
    assert float(((counts[live] - expected) ** 2 / expected).sum()) < 35.0


@torch.inference_mode()
def test_async_scheduling_with_penalties_gives_the_synchronous_tokens(loaded):
    prompt_list = prompts(64, seed=7)
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=32,
                             ignore_eos=True, repetition_penalty=1.3,
                             presence_penalty=0.5 if i % 3 else 0.0, top_k=40, top_p=0.95)
              for i in range(64)]
    sync, overlapped = sync_and_async(loaded, prompt_list, params)
    assert overlapped == sync
