"""Rejection sampling keeps the target distribution (device/rejection.py).

Over many seeded draws on small fixed distributions, the tokens a verify emits at each
position are compared with the target's distribution there by a chi-square test. The seed is
fixed, so each test is deterministic; with a fresh seed a correct sampler would fail a check
with probability ALPHA (the stated false-alarm rate). Each distribution of drafts is checked,
including one far from the target's, and a check that the test has power: the drafts
themselves, taken unverified, are refused."""

from __future__ import annotations

import pytest
import torch

from pagedserve.device.input_batch import CachedRequestState
from pagedserve.device.rejection import VerifyRows, rejection_sample, verify
from pagedserve.device.sampler import SamplingMetadata
from pagedserve.sampling_params import SamplingParams

ALPHA = 1e-4  # false-alarm rate of one check
DRAWS = 4000
TARGET = torch.tensor([[0.50, 0.25, 0.15, 0.07, 0.03],
                       [0.05, 0.10, 0.20, 0.25, 0.40],
                       [0.20, 0.20, 0.20, 0.20, 0.20]])  # k = 2 drafts, then the bonus row
NEAR = torch.tensor([[0.45, 0.30, 0.10, 0.10, 0.05],
                     [0.10, 0.10, 0.20, 0.30, 0.30]])
FAR = torch.tensor([[0.01, 0.01, 0.03, 0.15, 0.80],
                    [0.85, 0.10, 0.03, 0.01, 0.01]])


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """P(X >= statistic) for X chi-square with len - 1 degrees of freedom."""
    expected = probs * counts.sum()
    statistic = ((counts - expected) ** 2 / expected).sum()
    dof = torch.tensor((len(probs) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, statistic.double() / 2))


def emitted(draft_probs: torch.Tensor | None, fixed_drafts: list[int] | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Counts of the token emitted at positions 0 and 1 over DRAWS verifies."""
    generator = torch.Generator().manual_seed(1234)
    counts = torch.zeros(2, TARGET.shape[1])
    for _ in range(DRAWS):
        if fixed_drafts is None:
            drafts = torch.multinomial(draft_probs, 1, generator=generator).squeeze(1)
        else:
            drafts = torch.tensor(fixed_drafts)
        accepted, token = rejection_sample(TARGET, drafts, draft_probs, generator)
        tokens = drafts[:accepted].tolist() + [token]
        for position, t in enumerate(tokens[:2]):
            counts[position, t] += 1
    return counts[0], counts[1]


@pytest.mark.parametrize("draft_probs", [NEAR, FAR], ids=["near", "far"])
def test_emitted_tokens_follow_the_target(draft_probs):
    first, second = emitted(draft_probs)
    assert chi_square_p_value(first, TARGET[0]) > ALPHA
    assert chi_square_p_value(second, TARGET[1]) > ALPHA


@pytest.mark.parametrize("fixed", [[0, 4], [4, 0]], ids=["likely", "unlikely"])
def test_deterministic_drafts_follow_the_target(fixed):
    """An n-gram draft is one-hot: accepted with the target's probability of it."""
    first, second = emitted(None, fixed)
    assert chi_square_p_value(first, TARGET[0]) > ALPHA
    assert chi_square_p_value(second, TARGET[1]) > ALPHA


def test_the_check_refuses_unverified_drafts():
    generator = torch.Generator().manual_seed(1234)
    drafts = torch.multinomial(FAR[0], DRAWS, replacement=True, generator=generator)
    counts = torch.bincount(drafts, minlength=TARGET.shape[1]).float()
    assert chi_square_p_value(counts, TARGET[0]) < ALPHA


def test_greedy_accepts_up_to_the_first_mismatch():
    vocab = 6
    logits = torch.full((7, vocab), -5.0)
    for row, best in enumerate([3, 1, 4, 2, 5, 0, 1]):
        logits[row, best] = 5.0
    states = [CachedRequestState("a", [1], SamplingParams(temperature=0.0, logprobs=1)),
              CachedRequestState("b", [1], SamplingParams(temperature=0.0))]
    drafts = [[3, 1, 0], [5, 0]]  # a: two accepted then a miss; b: all accepted
    expanded = [states[0]] * 4 + [states[1]] * 3
    rows = VerifyRows([0, 1], drafts, logits,
                      SamplingMetadata.from_requests(expanded, vocab, torch.device("cpu")))
    result = verify(rows, states)
    assert result.accepted == [[3, 1], [5, 0]] and result.tokens == [4, 1]
    # a row of logprobs per emitted token, at its own position: a's 0-2, b's 4-6
    emitted = torch.tensor([3, 1, 4, 5, 0, 1])
    positions = torch.tensor([0, 1, 2, 4, 5, 6])
    want = logits.log_softmax(-1)[positions, emitted]
    torch.testing.assert_close(result.logprobs.sampled_logprobs, want)
