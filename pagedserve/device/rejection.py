"""Speculative decoding's verify: which drafts the target accepts, and the token after them.

A verified request's k drafts get k + 1 rows of target logits (the positions after its last
known token and after each draft). Its sampling must stay exactly the target's:

- greedy: a draft is accepted while it is the target's argmax at its position; the token
  after the accepted run is the target's argmax there (the same tokens as without
  speculation).
- random (temperature, min-p, top-k, top-p, logit bias, allowed tokens, seeds): standard
  rejection sampling. Draft i, proposed with probability q(x), is accepted with probability
  min(1, p(x) / q(x)), p the target's processed distribution at its position; at the first
  rejection the token is drawn from the residual max(0, p - q) renormalised, and when every
  draft is accepted the bonus token is drawn from p at the last position. Each emitted
  token is then distributed as p (Leviathan et al., Chen et al. 2023). A proposer that
  drafts deterministically (n-gram lookup) has q one-hot at its draft: acceptance with
  probability p(x), the residual p with x removed.

The draws come from the request's generator when it is seeded (so a seed repeats its output
under speculation, as it does without), else from the device's default one.

Each position is processed as the sampler would process it one token a step: its own rows
of the token restrictions (a grammar's bitmask as of the drafts before it), penalties from
counts that include those drafts (`PenaltyState.through_drafts`), and logprobs of the raw
(restricted, unpenalized) distribution for every token emitted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from pagedserve.device.input_batch import CachedRequestState
from pagedserve.device.sampler import (
    LogprobsTensors, SamplingMetadata, gather_logprobs, random_probs, restrict)
from pagedserve.kernels.penalties import apply_penalties


@dataclass
class VerifyRows:
    """A launched step's verified requests: their rows of target logits, in order, k + 1
    for each (its drafts' count), and their sampling metadata (one row per logits row)."""

    index: list[int]  # each verified request's position among the step's sampling states
    drafts: list[list[int]]
    logits: Tensor  # [sum(k + 1), vocab]
    sampling: SamplingMetadata


@dataclass
class Verified:
    """A verify's outcome per verified request: its accepted drafts and the token after
    them; with logprobs, one row per emitted token (accepted drafts, then the token), in
    request order."""

    accepted: list[list[int]]
    tokens: list[int]
    logprobs: LogprobsTensors | None


def verify(rows: VerifyRows, states: Sequence[CachedRequestState]) -> Verified:
    """Each verified request's accepted drafts and the token sampled after them."""
    meta = rows.sampling
    restricted = restrict(rows.logits, meta).float()
    logits = (apply_penalties(restricted, meta.penalties) if meta.penalties is not None
              else restricted)
    greedy = logits.argmax(-1).tolist()
    probs = random_probs(logits, meta) if not meta.all_greedy else None
    accepted, tokens, emitted = [], [], []
    start = 0
    for drafts, state in zip(rows.drafts, states):
        k = len(drafts)
        if state.sampling_params.is_greedy:
            num, token = _greedy(drafts, greedy[start:start + k + 1])
        else:
            draft_ids = torch.tensor(drafts, device=logits.device)
            num, token = rejection_sample(probs[start:start + k + 1], draft_ids, None,
                                          state.generator_for(logits.device))
        accepted.append(drafts[:num])
        tokens.append(token)
        emitted += [(start + j, t) for j, t in enumerate((*drafts[:num], token))]
        start += k + 1
    logprobs = None
    if meta.max_num_logprobs is not None:
        positions, ids = (torch.tensor(column, device=logits.device)
                          for column in zip(*emitted))
        logprobs = gather_logprobs(restricted[positions].log_softmax(-1), ids,
                                   meta.max_num_logprobs)
    return Verified(accepted, tokens, logprobs)


def _greedy(drafts: list[int], targets: list[int]) -> tuple[int, int]:
    num = 0
    while num < len(drafts) and drafts[num] == targets[num]:
        num += 1
    return num, targets[num]


def rejection_sample(probs: Tensor, drafts: Tensor, draft_probs: Tensor | None,
                     generator: torch.Generator | None) -> tuple[int, int]:
    """(number of drafts accepted, the token after them) for one request.

    probs: float32 [k + 1, vocab], the target's distribution at each position; drafts: int64
    [k]; draft_probs: float32 [k, vocab], the proposer's distribution at each draft's
    position, None for a deterministic proposer (one-hot at its draft)."""
    k = drafts.shape[0]
    positions = torch.arange(k, device=probs.device)
    target = probs[positions, drafts]
    proposed = (draft_probs[positions, drafts] if draft_probs is not None
                else torch.ones_like(target))
    uniform = torch.rand(k, generator=generator, device=probs.device)
    accepted = int((uniform * proposed < target).to(torch.int64).cumprod(0).sum())
    if accepted == k:
        return k, _draw(probs[k], generator)
    if draft_probs is not None:
        residual = (probs[accepted] - draft_probs[accepted]).clamp(min=0)
    else:
        residual = probs[accepted].clone()
        residual[drafts[accepted]] = 0
    if not bool(residual.sum() > 0):  # rejected against p == q (rounding): p itself
        residual = probs[accepted]
    return accepted, _draw(residual, generator)


def _draw(weights: Tensor, generator: torch.Generator | None) -> int:
    """A token with probability proportional to `weights` (the exponential race, as the
    sampler draws)."""
    noise = torch.empty_like(weights).exponential_(generator=generator)
    return int((weights / noise).argmax())
