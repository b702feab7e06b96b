"""Sampler unit tests against straightforward per-row references (no model needed)."""

from __future__ import annotations

import math

import pytest
import torch

from pagedserve.device.input_batch import CachedRequestState
from pagedserve.device.penalties import PenaltyState
from pagedserve.device.sampler import (
    PlainBatch, Sampler, SamplingMetadata, apply_min_p, apply_penalties, apply_top_k_top_p,
    philox_rows, select_sampling_kernels)
from pagedserve.sampling_params import SamplingParams

VOCAB = 50
CPU = torch.device("cpu")


def make_request(i: int, prompt=(1, 2, 3), output=(), **params) -> CachedRequestState:
    params.setdefault("max_tokens", 100)
    request = CachedRequestState(f"r{i}", list(prompt), SamplingParams(**params))
    for token in output:
        request.append_output_token(token)
    return request


def reference_top_k(row: torch.Tensor, k: int) -> torch.Tensor:
    if k <= 0:
        return row.clone()
    kth = sorted(row.tolist(), reverse=True)[k - 1]
    return torch.where(row >= kth, row, torch.tensor(float("-inf")))


def reference_top_p(row: torch.Tensor, p: float) -> torch.Tensor:
    """Keep a token when the mass of the tokens strictly more likely than it is below p
    (the documented rule in another form: ties with the cut-off stay)."""
    probs = row.double().softmax(-1).tolist()
    return torch.tensor([v if sum(q for q in probs if q > probs[i]) < p else float("-inf")
                         for i, v in enumerate(row.tolist())])


@pytest.mark.parametrize("seed", range(5))
def test_top_k_top_p_match_reference(seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, VOCAB, generator=gen) * 3
    top_k = torch.tensor([0, 1, 5, 17, VOCAB, 3])
    top_p = torch.tensor([1.0, 0.5, 0.9, 0.3, 0.75, 0.05])
    got = apply_top_k_top_p(logits, top_k, top_p)
    for i in range(len(logits)):
        expected = reference_top_p(reference_top_k(logits[i], int(top_k[i])), float(top_p[i]))
        assert torch.equal(torch.isinf(got[i]), torch.isinf(expected)), i
        finite = ~torch.isinf(expected)
        assert torch.equal(got[i][finite], logits[i][finite])


def test_top_k_top_p_keep_every_token_tied_with_the_cut_off():
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 2.0, 0.0, -1.0]] * 3)
    got = apply_top_k_top_p(logits, torch.tensor([2, 4, 0]), torch.tensor([1.0, 1.0, 0.6]))
    kept = (~torch.isinf(got)).tolist()
    assert kept[0] == [True, False, True, True, True, False, False]  # 2nd largest is 2.0
    assert kept[1] == kept[0]  # the 4th largest too: all three 2.0s either way
    # mass above the 2.0s is p(3.0) ~ 0.51 < 0.6: all of them stay, 1.0 goes
    assert kept[2] == kept[0]
    assert torch.equal(got[~torch.isinf(got)], logits[~torch.isinf(got)])


def test_min_p_matches_reference():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0)) * 2
    min_p = torch.tensor([0.0, 0.05, 0.3, 1.0])
    got = apply_min_p(logits, min_p)
    for i in range(4):
        probs = logits[i].double().softmax(-1)
        dropped = probs < float(min_p[i]) * float(probs.max())
        assert torch.equal(torch.isinf(got[i]), dropped)
    assert (~torch.isinf(got[3])).sum() == 1  # min_p = 1 keeps only the argmax


def penalty_state(requests: list[CachedRequestState]) -> PenaltyState:
    state = PenaltyState(VOCAB, CPU, initial_slots=1)
    for r in requests:
        if r.sampling_params.needs_penalties:
            state.add(r.req_id, r.prompt_token_ids, r.output_token_ids)
    return state


def penalties(requests: list[CachedRequestState], state: PenaltyState | None = None) -> dict:
    """from_requests' penalty arguments: a state (by default one made from the requests'
    token lists) and the rows' slots in it."""
    state = penalty_state(requests) if state is None else state
    return {"penalty_state": state,
            "penalty_slots": state.slots([r.req_id for r in requests])}


def test_penalties_match_reference():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(1))
    requests = [
        make_request(0, prompt=(1, 2), output=(2, 5, 5, 7), repetition_penalty=1.3,
                     presence_penalty=0.5, frequency_penalty=0.25),
        make_request(1, prompt=(9,), output=(), repetition_penalty=0.8),
        make_request(2, prompt=(1, 2), output=(2, 5)),  # no penalties: left alone
    ]
    meta = SamplingMetadata.from_requests(requests, VOCAB, CPU, **penalties(requests))
    assert meta.penalties.rows.tolist() == [1, 2, -1]
    got = apply_penalties(logits.clone(), meta.penalties)
    from_lists = SamplingMetadata.from_requests(requests, VOCAB, CPU)  # a state of its own
    assert torch.equal(apply_penalties(logits.clone(), from_lists.penalties), got)
    for row, request in enumerate(requests):
        p = request.sampling_params
        expected = logits[row].clone()
        for token in set(request.prompt_token_ids) | set(request.output_token_ids):
            v = expected[token]
            expected[token] = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
        for token in set(request.output_token_ids):
            count = request.output_token_ids.count(token)
            expected[token] -= p.frequency_penalty * count + p.presence_penalty
        torch.testing.assert_close(got[row], expected)


def test_greedy_is_argmax_and_logprobs_match_log_softmax():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(2))
    requests = [make_request(i, temperature=0.0, logprobs=4) for i in range(3)]
    out = Sampler()(logits, SamplingMetadata.from_requests(requests, VOCAB, CPU))
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    reference = logits.log_softmax(-1)
    top_values, top_ids = reference.topk(4, dim=-1)
    assert torch.equal(out.logprobs.top_token_ids, top_ids)
    torch.testing.assert_close(out.logprobs.top_logprobs, top_values)
    torch.testing.assert_close(out.logprobs.sampled_logprobs, reference.max(-1).values)
    assert out.logprobs.sampled_ranks.tolist() == [1, 1, 1]


def test_sampled_token_logprob_and_rank():
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(3))
    requests = [make_request(0, temperature=5.0, seed=11, logprobs=0)]
    out = Sampler()(logits, SamplingMetadata.from_requests(requests, VOCAB, CPU))
    token = int(out.sampled_token_ids[0])
    reference = logits[0].log_softmax(-1)
    assert math.isclose(float(out.logprobs.sampled_logprobs[0]), float(reference[token]),
                        rel_tol=1e-6)
    assert int(out.logprobs.sampled_ranks[0]) == int((reference > reference[token]).sum()) + 1


def _draw(batch_rows: list[CachedRequestState], logits: torch.Tensor,
          steps: int) -> list[list[int]]:
    sampler, tokens = Sampler(), [[] for _ in batch_rows]
    for _ in range(steps):
        meta = SamplingMetadata.from_requests(batch_rows, VOCAB, CPU)
        for i, t in enumerate(sampler(logits[:len(batch_rows)], meta).sampled_token_ids.tolist()):
            tokens[i].append(t)
    return tokens


def test_seeded_sampling_is_independent_of_batch_composition():
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(4)).expand(4, -1)
    alone = _draw([make_request(0, temperature=1.0, seed=1234)], logits, 20)[0]
    mixed = _draw([make_request(1, temperature=0.7, top_k=5),
                   make_request(2, temperature=1.0, seed=1234),
                   make_request(3, temperature=0.0),
                   make_request(4, temperature=1.0, seed=99)], logits, 20)
    assert mixed[1] == alone
    assert mixed[3] != alone  # another seed draws another sequence
    assert len(set(alone)) > 1  # temperature 1 over 50 tokens really samples


def test_sampling_follows_the_distribution():
    """Empirical frequencies of 4000 draws match softmax(logits / T) after top-k."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0] + [-9.0] * (VOCAB - 5)])
    request = make_request(0, temperature=0.8, top_k=3, seed=0)
    counts = torch.zeros(VOCAB)
    sampler = Sampler()
    for _ in range(4000):
        meta = SamplingMetadata.from_requests([request], VOCAB, CPU)
        counts[int(sampler(logits, meta).sampled_token_ids[0])] += 1
    expected = torch.zeros(VOCAB)
    expected[:3] = (logits[0, :3] / 0.8).softmax(-1)
    assert counts[3:].sum() == 0
    torch.testing.assert_close(counts / 4000, expected, atol=0.03, rtol=0)


def test_cpu_metadata_has_no_fused_inputs():
    requests = [make_request(0, temperature=1.0, seed=3), make_request(1, temperature=0.5)]
    meta = SamplingMetadata.from_requests(requests, VOCAB, CPU)
    assert meta.philox is None
    assert set(meta.generators) == {0}  # every seeded random row draws from its generator


def test_the_cpu_takes_the_torch_path():
    """Off CUDA the runner's sampler gets no fused kernels: its metadata keeps each seeded
    row's own generator and the torch path draws, the same tokens for the same seed."""
    assert select_sampling_kernels(CPU) is None
    sampler = Sampler(select_sampling_kernels(CPU))
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(0))
    draws = []
    for _ in range(2):
        requests = [make_request(i, temperature=1.0, seed=7 + i) for i in range(2)]
        meta = SamplingMetadata.from_requests(requests, VOCAB, CPU, fused=sampler.fused)
        assert meta.philox is None and set(meta.generators) == {0, 1}
        draws.append(sampler(logits, meta).sampled_token_ids)
    assert torch.equal(*draws)


def test_fused_metadata_draws_every_row_from_philox():
    requests = [make_request(0, temperature=0.0),
                make_request(1, temperature=1.0, seed=3),
                make_request(2, temperature=1.0, seed=4, top_k=5),
                make_request(3, temperature=0.7, top_p=0.9),
                make_request(4, temperature=0.7, min_p=0.1, seed=8)]
    meta = SamplingMetadata.from_requests(requests, VOCAB, CPU, fused=True)
    assert meta.generators == {} and meta.philox.shape == (5, 2) and meta.filtered
    assert meta.top_k.tolist() == [0, 0, 5, 0, 0]
    plain = [make_request(i, temperature=1.0, seed=i) for i in range(2)]
    assert not SamplingMetadata.from_requests(plain, VOCAB, CPU, fused=True).filtered
    with pytest.raises(ValueError, match="fused kernels"):
        Sampler()(torch.zeros(5, VOCAB), meta)


def test_penalized_requests_need_a_slot():
    requests = [make_request(0, presence_penalty=0.5), make_request(1, temperature=0.0)]
    with pytest.raises(ValueError, match=r"rows \[0\] have penalties"):
        SamplingMetadata.from_requests(requests, VOCAB, CPU,
                                       **penalties(requests, PenaltyState(VOCAB, CPU)))


def test_penalty_state_counts_follow_the_sampled_tokens():
    """Slots are handed out, grown, updated from a sampled tensor (rows without a slot
    ignored) and reused after removal with fresh contents."""
    state = PenaltyState(VOCAB, CPU, initial_slots=1)
    state.add("a", [1, 2, 2], [7, 7, 3])
    state.add("b", [4])  # grows the slots from 2 to 4
    assert state.slots(["a", "x", "b"]) == [1, -1, 2] and len(state) == 2
    assert state.output_counts.shape == (4, VOCAB)
    state.update(torch.tensor([1, -1, 2, 1]), torch.tensor([7, 9, 4, 0]))
    counts = {t: int(c) for t, c in enumerate(state.output_counts[1].tolist()) if c}
    assert counts == {0: 1, 3: 1, 7: 3}
    assert state.output_counts[2].nonzero().flatten().tolist() == [4]
    assert state.prompt_mask[1].nonzero().flatten().tolist() == [1, 2]
    state.remove("a")
    state.remove("a")  # unknown ids are ignored
    state.add("c", [5])
    assert state.slots(["c"]) == [1] and "a" not in state
    assert state.output_counts[1].sum() == 0
    assert state.prompt_mask[1].nonzero().flatten().tolist() == [5]
    with pytest.raises(ValueError, match="already"):
        state.add("c", [5])


def test_penalties_on_the_device_equal_penalties_from_the_token_lists():
    """Steps of sampling with penalties, the state updated from each step's sampled tensor,
    give the logits the same penalties as the requests' own token lists."""
    gen = torch.Generator().manual_seed(8)
    requests = [make_request(0, temperature=1.0, seed=1, repetition_penalty=1.5,
                             frequency_penalty=0.4, presence_penalty=0.3),
                make_request(1, temperature=0.0, repetition_penalty=2.0),
                make_request(2, temperature=1.0, seed=2)]
    state, sampler = penalty_state(requests), Sampler()
    for _ in range(12):
        logits = torch.randn(3, VOCAB, generator=gen)
        meta = SamplingMetadata.from_requests(requests, VOCAB, CPU, **penalties(requests, state))
        fresh = penalty_state(requests)  # from the host's lists
        expected = apply_penalties(logits, SamplingMetadata.from_requests(
            requests, VOCAB, CPU, **penalties(requests, fresh)).penalties)
        assert torch.equal(apply_penalties(logits, meta.penalties), expected)
        tokens = sampler(logits, meta).sampled_token_ids
        state.update(meta.penalties.rows, tokens)
        for request, token in zip(requests, tokens.tolist()):
            request.append_output_token(token)
    assert len(set(requests[0].output_token_ids)) > 3


def test_philox_rows_seeded_by_request_unseeded_by_step():
    requests = [make_request(0, temperature=1.0, seed=-1, output=(5, 6, 7)),
                make_request(1, temperature=1.0),
                make_request(2, temperature=0.0),
                make_request(3, temperature=1.0, seed=2**63 + 9)]  # int64 keeps 63 bits
    torch.manual_seed(0)
    rows = philox_rows(requests)
    assert rows[0].tolist() == [2**63 - 1, 3]  # seed -1 wraps; stream = index of the token
    assert rows[3].tolist() == [9, 0]
    unseeded = rows[[1, 2]]
    assert unseeded[0, 0] == unseeded[1, 0]  # one seed per step ...
    assert unseeded[:, 1].tolist() == [2**32 + 1, 2**32 + 2]  # ... and a stream per row
    again = philox_rows(requests)
    assert again[1, 0] != rows[1, 0] and torch.equal(again[[0, 3]], rows[[0, 3]])
    torch.manual_seed(0)
    assert torch.equal(philox_rows(requests), rows)


def _columns(meta: SamplingMetadata) -> dict:
    """What a step's metadata holds, tensors as lists (None where unset)."""
    return {name: (value.tolist() if isinstance(value, torch.Tensor) else value)
            for name, value in vars(meta).items() if name != "generators"}


@pytest.mark.parametrize("fused", [True, False])
def test_a_plain_batch_kept_across_steps_equals_its_metadata_built_anew(fused):
    """Step after step (tokens arriving, the batch shrinking, reordered, growing) the kept
    columns give what `from_requests` builds from scratch with the same default generator;
    a batch with a row that is not plain is left to `from_requests` (None)."""
    device = torch.device("cpu")
    requests = [make_request(i, temperature=t, seed=seed, output=(5,) * i)
                for i, (t, seed) in enumerate([(0.6, None), (0.0, None), (1.3, 7),
                                               (0.6, 2**63 + 5), (0.9, None)])]
    plain = PlainBatch(device, fused)
    batches = [requests, requests, requests[1:], requests[1:], requests[::-1],
               requests[::-1] + [make_request(9, temperature=0.2)], requests[::-1]]
    for step, rows in enumerate(batches):
        for request in rows:
            request.append_output_token(step)
        torch.manual_seed(step)
        kept = plain.metadata(rows)
        torch.manual_seed(step)
        fresh = SamplingMetadata.from_requests(rows, 100, device, fused=fused)
        assert _columns(kept) == _columns(fresh)
        assert kept.generators.keys() == fresh.generators.keys()
    greedy = [make_request(i, temperature=0.0) for i in range(3)]
    assert plain.metadata(greedy).all_greedy and plain.metadata(greedy).all_greedy
    for other in (dict(top_k=5), dict(logprobs=2), dict(repetition_penalty=1.2),
                  dict(min_p=0.1), dict(logit_bias={3: 1.0}), dict(allowed_token_ids=[4])):
        mixed = requests + [make_request(8, temperature=0.7, **other)]
        assert plain.metadata(mixed) is None and plain.metadata(mixed) is None
    assert plain.metadata(requests) is not None


def test_philox_stream_is_the_drawn_tokens_index_with_tokens_in_flight():
    """Sync: this step's placeholder only. Async: the previous step's token is in flight
    too, so one fewer token has arrived; the index of the token drawn is the same."""
    request = make_request(0, temperature=1.0, seed=1, output=(5, 6, 7))
    assert philox_rows([request])[0, 1] == 3
    request.num_output_placeholders = 1
    assert philox_rows([request])[0, 1] == 3
    lagging = make_request(1, temperature=1.0, seed=1, output=(5, 6))
    lagging.num_output_placeholders = 2
    assert philox_rows([lagging])[0, 1] == 3


@pytest.mark.parametrize("bad", [
    {"temperature": -0.1}, {"top_p": 0.0}, {"top_p": 1.5}, {"n": 0}, {"max_tokens": 0},
    {"top_k": -2}, {"min_p": 1.5}, {"repetition_penalty": 0.0}, {"presence_penalty": 3.0},
    {"logprobs": -1}, {"stop": [""]}, {"min_tokens": 5, "max_tokens": 2},
    {"top_k": 2**31}, {"seed": 2**64}, {"seed": -(2**63) - 1},  # would overflow the sampler
])
def test_bad_sampling_params_are_rejected(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)
