"""The filtered sampling kernel (min-p, top-k, top-p, penalties) against the torch reference,
under TRITON_INTERPRET=1 (conftest).

The kernel's draw is documented as the plain kernel's Gumbel-max restricted to the tokens
the filters keep, so each row is checked exactly: the token must equal the reference draw
(`reference_draws`, the plain kernel's numpy twin) over the logits with every token the
torch reference (`apply_min_p`, `apply_top_k_top_p`, `apply_penalties`) drops set to
-inf. High temperatures make a wrongly kept token likely to win, and integer-valued
logits put ties on the cut-offs. The interpreter is slow per row, so rows are few and
small; the law of the draw over many seeds is measured on the reference (which the kernel
equals draw for draw) and, for the torch sampler, in tests/device/test_sampler.py.
"""

import numpy as np
import pytest
import torch

from pagedserve.device.input_batch import CachedRequestState
from pagedserve.device.penalties import PenaltyState
from pagedserve.device.sampler import (Sampler, SamplingKernels, SamplingMetadata, apply_min_p,
                                       apply_penalties, apply_top_k_top_p,
                                       triton_sampling_kernels)
from pagedserve.kernels.triton import filtered_sampling
from pagedserve.kernels.triton.filtered_sampling import FilteredKernelConfig, filtered_sample
from pagedserve.kernels.triton.sampling import fused_sample
from pagedserve.sampling_params import SamplingParams
from tests.kernels.test_sampling_kernel import chi_square, fresh_seed, reference_draws

CONFIG = FilteredKernelConfig(block=16, pivots=64)  # 40 tokens: three tiles, one partial
VOCAB = 40
INF = float("inf")


def filter_reference(logits: torch.Tensor, temperature: torch.Tensor, min_p: torch.Tensor,
                     top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The logits with every token the torch reference's filters drop set to -inf."""
    z = logits.float() / temperature[:, None]
    z = apply_top_k_top_p(apply_min_p(z, min_p), top_k, top_p)
    return logits.float().masked_fill(torch.isinf(z) & ~torch.isinf(logits.float()), -INF)


def expected_tokens(logits, temperature, greedy, philox, min_p, top_k, top_p) -> list[int]:
    kept = filter_reference(logits, temperature, min_p, top_k, top_p)
    out = []
    for i in range(len(logits)):
        if greedy[i]:
            out.append(int(logits[i].float().argmax()))
        else:
            seed, stream = philox[i].tolist()
            out.append(int(reference_draws(kept[i], float(temperature[i]), [seed],
                                           [stream])[0]))
    return out


def tied_logits(rows: int, seed: int) -> torch.Tensor:
    """Integer values in [-3, 3]: every cut-off falls on a tie."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-3, 4, (rows, VOCAB), generator=gen).float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_filtered_rows_equal_the_reference_draw_over_the_kept_tokens(dtype):
    seed = fresh_seed()
    logits = tied_logits(9, seed).to(dtype)
    logits[8] = torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)).to(dtype)
    #            top-k ties  top-p ties        min-p       all three   greedy  plain
    top_k = torch.tensor([3, 7, 0, 0, 0, 0, 5, 0, 12])
    top_p = torch.tensor([1.0, 1.0, 0.5, 0.8, 1.0, 1.0, 0.7, 1.0, 0.9])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.2, 0.6, 0.1, 0.0, 0.05])
    temperature = torch.tensor([3.0, 2.0, 3.0, 1.5, 2.5, 0.7, 3.0, 1.0, 1.3])
    greedy = torch.tensor([False] * 7 + [True, False])
    top_k[7], top_p[7] = 0, 1.0  # greedy rows carry no filters (SamplingParams resets them)
    philox = torch.tensor([(seed + i, i * 3) for i in range(9)], dtype=torch.int64)
    got = filtered_sample(logits, temperature, greedy, philox, min_p, top_k, top_p,
                          config=CONFIG)
    expected = expected_tokens(logits, temperature, greedy, philox, min_p, top_k, top_p)
    assert got.tolist() == expected, f"seed {seed}"


def test_cut_offs_keep_every_tied_token_and_nothing_below():
    """Many streams of one row each: a kept token must be drawn sometimes, a dropped one
    never. top-k 2 over [5, 4, 4, 4, ...]: the three 4s tie with the 2nd largest; top-p
    0.3 over two equal heads whose first alone reaches 0.3: both stay."""
    streams = 12
    base_k = torch.tensor([5.0, 4.0, 4.0, 4.0] + [3.9] * 6)
    base_p = torch.tensor([3.0, 3.0] + [0.0] * 8)
    logits = torch.cat([base_k.expand(streams, -1), base_p.expand(streams, -1)])
    rows = 2 * streams
    temperature = torch.full((rows,), 4.0)
    top_k = torch.tensor([2] * streams + [0] * streams)
    top_p = torch.tensor([1.0] * streams + [0.3] * streams)
    philox = torch.tensor([(77, s) for s in range(rows)], dtype=torch.int64)
    got = filtered_sample(logits, temperature, torch.zeros(rows, dtype=torch.bool), philox,
                          None, top_k, top_p, config=FilteredKernelConfig(block=16, pivots=256))
    assert got.tolist() == expected_tokens(logits, temperature, [False] * rows, philox,
                                           torch.zeros(rows), top_k, top_p)
    assert set(got[:streams].tolist()) == {0, 1, 2, 3}
    assert set(got[streams:].tolist()) == {0, 1}


def test_plain_and_greedy_rows_draw_what_the_plain_kernel_draws():
    """A row's token does not depend on which kernel serves its batch."""
    seed = fresh_seed()
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2
    logits[0, [3, 30]] = logits[0].max() + 1  # a greedy tie across tiles: the lower id
    temperature = torch.tensor([1.0, 0.8, 2.0, 1.0])
    greedy = torch.tensor([True, False, False, True])
    philox = torch.tensor([(seed, 0), (seed, 1), (5, 2**32 + 7), (0, 0)], dtype=torch.int64)
    got = filtered_sample(logits, temperature, greedy, philox, top_k=torch.zeros(4),
                          config=CONFIG)
    assert torch.equal(got, fused_sample(logits, temperature, greedy, philox))
    assert int(got[0]) == 3


def test_nan_and_inf_in_filtered_rows():
    """NaN counts as -inf and +inf as the largest float: a filtered row with +inf draws
    it, a NaN is never drawn."""
    logits = torch.zeros(2, VOCAB)
    logits[0, 17] = INF
    logits[1, [2, 5]] = float("nan")
    logits[1, 20:] = -INF
    philox = torch.tensor([(1, 0), (2, 0)], dtype=torch.int64)
    draws = [filtered_sample(logits, torch.ones(2), torch.zeros(2, dtype=torch.bool),
                             philox + torch.tensor([0, s]), torch.tensor([0.5, 0.5]),
                             torch.tensor([3, 30]), config=CONFIG).tolist() for s in range(4)]
    assert all(d[0] == 17 for d in draws)
    assert all(d[1] not in (2, 5) and d[1] < 20 for d in draws)


def make_request(i: int, prompt, output=(), **params) -> CachedRequestState:
    params.setdefault("max_tokens", 100)
    request = CachedRequestState(f"r{i}", list(prompt), SamplingParams(**params))
    for token in output:
        request.append_output_token(token)
    return request


def test_penalized_rows_equal_the_reference_on_penalized_logits():
    """Penalties read from a PenaltyState on the device, fused into the loads: greedy rows
    take the argmax of the reference's penalized logits, random rows its filtered draw."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(4, VOCAB, generator=gen) * 2).bfloat16()
    top = logits.float().argmax(-1).tolist()
    requests = [
        make_request(0, prompt=[1, top[0]], temperature=0.0, repetition_penalty=3.0),
        make_request(1, prompt=[4], output=[top[1], top[1], 9], temperature=2.0, seed=3,
                     frequency_penalty=1.5, presence_penalty=0.5, top_k=6),
        make_request(2, prompt=[7], output=[8], temperature=0.0),  # no penalties
        make_request(3, prompt=[2, 3], output=[top[3]], temperature=1.5, seed=4,
                     repetition_penalty=0.5, top_p=0.7, min_p=0.05),
    ]
    state = PenaltyState(VOCAB, torch.device("cpu"))
    for r in requests:
        if r.sampling_params.needs_penalties:
            state.add(r.req_id, r.prompt_token_ids, r.output_token_ids)
    meta = SamplingMetadata.from_requests(requests, VOCAB, torch.device("cpu"), fused=True,
                                          penalty_state=state,
                                          penalty_slots=state.slots([r.req_id
                                                                     for r in requests]))
    got = Sampler(triton_sampling_kernels())(logits, meta).sampled_token_ids
    penalized = apply_penalties(logits.float(), meta.penalties)
    assert int(got[0]) == int(penalized[0].argmax()) != top[0]
    assert int(got[2]) == top[2]
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.05])
    expected = expected_tokens(penalized, meta.temperature, meta.greedy_mask, meta.philox,
                               min_p, meta.top_k, meta.top_p)
    assert got.tolist() == expected, f"seed {seed}"


@pytest.mark.parametrize("params", [
    {"top_k": 3}, {"top_p": 0.75}, {"min_p": 0.2}, {"top_k": 4, "top_p": 0.9, "min_p": 0.1}])
def test_reference_draws_over_the_kept_tokens_follow_the_filtered_softmax(params):
    """The law of the kernel's draw (it equals the reference draw over the kept tokens):
    50000 draws across streams follow softmax(z) renormalised over what the filters keep."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.5, 0.0, -1.0, -3.0, 0.25]])
    temperature = 0.8
    min_p = torch.tensor([params.get("min_p", 0.0)])
    top_k = torch.tensor([params.get("top_k", 0)])
    top_p = torch.tensor([params.get("top_p", 1.0)])
    kept = filter_reference(logits, torch.tensor([temperature]), min_p, top_k, top_p)[0]
    probs = (kept / temperature).double().softmax(-1).numpy()
    n = 50000
    draws = reference_draws(kept, temperature, np.full(n, 9), np.arange(n))
    counts = np.bincount(draws, minlength=8)
    assert counts[probs == 0].sum() == 0
    live = probs > 0
    assert 1 < live.sum() < 8
    assert chi_square(counts[live], probs[live]) < 35.0  # <= 6 dof: the 1e-5 tail is 33


def test_top_k_rows_drawn_from_candidates_equal_the_full_pass(monkeypatch):
    """With 8 candidates per row, top-k rows whose top k (ties included) fit are drawn from
    their candidates alone and the rest take the full pass: every token must still be the
    reference draw. Rows: served (top-k ties, with top-p, with min-p, random values), then
    fallbacks (ties at the k-th value overflowing 8, k above 8, no top-k, greedy)."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randint(-3, 1, (9, VOCAB), generator=gen).float()
    for row in range(3):  # three tokens tie at 2 and two at 1, above the rest
        heads = torch.randperm(VOCAB, generator=gen)[:5]
        logits[row, heads] = torch.tensor([2.0, 2.0, 2.0, 1.0, 1.0])
    logits[3] = torch.randn(VOCAB, generator=gen) * 2
    logits[4] = 0.0  # 40 tokens tie for every rank
    top_k = torch.tensor([3, 2, 4, 7, 2, 12, 0, 0, 5])
    top_p = torch.tensor([1.0, 0.6, 1.0, 0.9, 1.0, 1.0, 0.7, 1.0, 1.0])
    min_p = torch.tensor([0.0, 0.0, 0.3, 0.05, 0.0, 0.0, 0.0, 0.0, 0.0])
    temperature = torch.tensor([3.0, 2.0, 2.5, 1.3, 1.0, 3.0, 2.0, 1.0, 1.0])
    greedy = torch.tensor([False] * 7 + [True, False])
    logits[8, :] = -INF  # a row with no finite value
    logits[8, 0] = float("nan")
    philox = torch.tensor([(seed + i, i * 5) for i in range(9)], dtype=torch.int64)
    launches = []
    sample_rows = filtered_sampling._sample_rows

    def spy(logits, *args, skip=None):
        launches.append((len(logits), args[-2] is not None,
                         None if skip is None else skip.tolist()))
        return sample_rows(logits, *args, skip=skip)

    monkeypatch.setattr(filtered_sampling, "_sample_rows", spy)
    config = FilteredKernelConfig(block=16, pivots=64, candidates=8)
    got = filtered_sample(logits, temperature, greedy, philox, min_p, top_k, top_p,
                          config=config)
    # one launch over the candidates, one full pass in which rows 0 to 3 are skipped: rows
    # 4 to 8 fall back (decided on the device, no host sync)
    assert launches == [(9, True, None), (9, False, [True] * 4 + [False] * 5)]
    reference = logits.clone()
    reference[8, 0] = -INF  # the reference's filters need a NaN-free row
    expected = expected_tokens(reference, temperature, greedy, philox, min_p, top_k, top_p)
    full = filtered_sample(logits, temperature, greedy, philox, min_p, top_k, top_p,
                           config=CONFIG)
    assert got.tolist()[:8] == expected[:8], f"seed {seed}"
    assert torch.equal(got, full), f"seed {seed}"


def test_candidate_rows_with_penalties_equal_the_reference():
    """Penalties reorder a row, so the candidates are chosen on the penalized logits: a
    repetition penalty pushes the largest logit out of the top 2."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(3, VOCAB, generator=gen) * 2).bfloat16()
    top = logits.float().argmax(-1).tolist()
    requests = [
        make_request(0, prompt=[top[0]], temperature=2.0, seed=1, repetition_penalty=8.0,
                     top_k=2),
        make_request(1, prompt=[4], output=[top[1], 9], temperature=1.5, seed=2,
                     frequency_penalty=1.5, presence_penalty=0.5, top_k=4, top_p=0.8),
        make_request(2, prompt=[5], temperature=3.0, seed=3, top_k=3),  # no penalties
    ]
    state = PenaltyState(VOCAB, torch.device("cpu"))
    for r in requests[:2]:
        state.add(r.req_id, r.prompt_token_ids, r.output_token_ids)
    meta = SamplingMetadata.from_requests(requests, VOCAB, torch.device("cpu"), fused=True,
                                          penalty_state=state,
                                          penalty_slots=state.slots([r.req_id
                                                                     for r in requests]))
    got = filtered_sample(logits, meta.temperature, meta.greedy_mask, meta.philox, None,
                          meta.top_k, meta.top_p, meta.penalties,
                          config=FilteredKernelConfig(block=16, pivots=64, candidates=8))
    penalized = apply_penalties(logits.float(), meta.penalties)
    expected = expected_tokens(penalized, meta.temperature, meta.greedy_mask, meta.philox,
                               torch.zeros(3), meta.top_k, meta.top_p)
    assert got.tolist() == expected, f"seed {seed}"


def test_start_up_warm_up_launches_every_kernel_variant_a_step_can(monkeypatch):
    """`warm_up_sampler` (run at engine start on CUDA) must reach each compiled variant: the
    plain kernel's greedy and random rows, the filtered kernel with and without penalties,
    over candidates, as the full pass with skipped rows and as the plain full pass, and the
    grammar bitmask; otherwise the first request needing one compiles it inside a step."""
    from pagedserve.device import sampler as sampler_module

    launched = set()
    sample_rows = filtered_sampling._sample_rows
    apply_bitmask = sampler_module.apply_token_bitmask

    def spy_rows(logits, temperature, greedy_mask, philox, min_p, top_k, top_p, penalties,
                 candidate_ids, config, skip=None):
        launched.add(("filtered", penalties is not None, candidate_ids is not None,
                      skip is not None))
        return sample_rows(logits, temperature, greedy_mask, philox, min_p, top_k, top_p,
                           penalties, candidate_ids, config, skip)

    def spy_plain(logits, temperature, greedy_mask, philox):
        launched.add(("plain", temperature is None))
        return fused_sample(logits, temperature, greedy_mask, philox)

    def spy_bitmask(logits, bitmask):
        launched.add(("bitmask",))
        return apply_bitmask(logits, bitmask)

    monkeypatch.setattr(filtered_sampling, "_sample_rows", spy_rows)
    monkeypatch.setattr(sampler_module, "apply_token_bitmask", spy_bitmask)
    sampler_module.warm_up_sampler(Sampler(SamplingKernels(spy_plain, filtered_sample)), 300,
                                   torch.bfloat16, torch.device("cpu"), max_rows=3)
    assert launched == {("plain", True), ("plain", False), ("bitmask",)} | {
        ("filtered", penalized, gathered, skip) for penalized in (False, True)
        for gathered, skip in ((True, False), (False, True), (False, False))}
