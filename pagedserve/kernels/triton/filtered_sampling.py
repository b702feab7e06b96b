"""Fused Triton sampling for rows with filters or penalties: min-p, top-k, top-p and the
repetition / presence / frequency penalties, without sorting the vocabulary.

One program per row. The penalties are applied as each tile of logits is loaded (the
row's token counts live on the device, `penalties.py`), so the logits are read in the
model's dtype and no penalized copy is written. A filtered row then finds its cut-off as
a value threshold: top-k keeps the tokens at or above the largest value c with at least k
surviving tokens >= c, top-p those at or above the largest c whose surviving mass at or
above it reaches top_p of the total. Both are searches for "the largest c with W(>= c) >=
target" over the row's values, W a count or a mass, which is monotone in c: each pass over
the row counts W at PIVOTS evenly spaced candidates of the remaining key interval (keys
are the float32 bit patterns mapped to ordered integers), so a pass narrows the interval
PIVOTS-fold and about eight passes pin the exact value: a radix select by counting. The
result is a value, so tokens tied with the cut-off are all kept: the rule the torch
reference (`sampler.apply_top_k_top_p`) follows.

Order and rules are the reference's: penalties on the raw logits, divide by the
temperature, min-p (keep exp(z - max z) >= min_p), top-k over what min-p kept, top-p over
what top-k kept (its mass renormalised there). The draw is then `sampling`'s
Gumbel-max with the same Philox noise, restricted to the kept tokens, so a row's draw is
the same token whichever kernel serves it. Greedy rows take the argmax of the penalized
logits (torch.argmax's order). In a filtered row a NaN logit counts as -inf and +inf as
the largest float: the filters need a finite maximum.

Those passes cost a row many reads of its whole vocabulary, but a top-k row can only draw
from its k largest values: such rows run the same kernel over a few hundred candidates
picked by one partial selection, the kernel loading each candidate's logit, penalties and
noise by token id (`_sample_candidates` says when a row qualifies).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra import libdevice

from pagedserve.kernels.penalties import PenaltyTensors, apply_penalties, to_device
from pagedserve.kernels.triton.gumbel import (FLOAT32_MAX, LOG2E, best_of, gumbel2,
                                              interpreting, token_gumbel2)

_INT32_MIN = tl.constexpr(-(2**31))


@dataclass(frozen=True)
class FilteredKernelConfig:
    block: int = 512  # tokens per tile: a power of two, at least 4
    pivots: int = 16  # candidates counted per pass: each pass narrows the search this much
    num_warps: int = 8
    philox_rounds: int = 10
    candidates: int = 256  # top-k rows with k below this draw from their top candidates only

    def __post_init__(self) -> None:
        for name, value in (("block", self.block), ("pivots", self.pivots),
                            ("candidates", self.candidates)):
            if value < 4 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 4, got {value}")


DEFAULT_FILTERED_CONFIG = FilteredKernelConfig()


@triton.jit
def _div(a, b, GPU: tl.constexpr):
    """a / b rounded as IEEE (and torch) round it: Triton's `/` is the approximate
    div.full.f32 on the GPU."""
    if GPU:
        return libdevice.div_rn(a, b)
    else:
        return a / b


@triton.jit
def _mul(a, b, GPU: tl.constexpr):
    """a * b rounded on its own: a plain product followed by a subtraction may be fused
    into one FMA, which rounds once where torch rounds twice."""
    if GPU:
        return libdevice.mul_rn(a, b)
    else:
        return a * b


@triton.jit
def _penalized(x, tokens, in_row, slot, counts_ptr, prompt_ptr, stride_slot, repetition,
               presence, frequency, GPU: tl.constexpr):
    """The reference's penalties on float32 logits x, rounded as torch rounds them:
    repetition on tokens seen in the prompt or output, then frequency times the output
    count, then presence."""
    load = in_row & (tokens * 0 + slot >= 0)  # broadcast first: the interpreter needs it
    offset = slot.to(tl.int64) * stride_slot + tokens
    count = tl.load(counts_ptr + offset, mask=load, other=0)
    prompt = tl.load(prompt_ptr + offset, mask=load, other=0)
    seen = (count > 0) | (prompt != 0)
    x = tl.where(seen, tl.where(x > 0, _div(x, repetition, GPU), x * repetition), x)
    x = x - _mul(frequency, count.to(tl.float32), GPU)
    return x - presence * (count > 0).to(tl.float32)  # exact: presence or 0


@triton.jit
def _load_tile(row_ptr, ids_ptr, positions, vocab, slot, counts_ptr, prompt_ptr, stride_slot,
               repetition, presence, frequency, HAS_PENALTIES: tl.constexpr,
               GATHERED: tl.constexpr, GPU: tl.constexpr):
    """Penalized float32 logits of the tokens at `positions` (-inf past the end), the mask
    of positions before the end, and the token ids: the positions themselves, or with
    GATHERED the row's candidate ids there (`vocab` is then the candidate count)."""
    in_row = positions < vocab
    tokens = positions
    if GATHERED:
        tokens = tl.load(ids_ptr + positions, mask=in_row, other=0)
    x = tl.load(row_ptr + tokens, mask=in_row, other=float("-inf")).to(tl.float32)
    if HAS_PENALTIES:
        x = _penalized(x, tokens, in_row, slot, counts_ptr, prompt_ptr, stride_slot,
                       repetition, presence, frequency, GPU)
    return x, in_row, tokens


@triton.jit
def _filter_values(x, temperature, GPU: tl.constexpr):
    """z = x / T for the filters, NaN as -inf, +inf as the largest float, -0 as +0 (the
    keys order the bit patterns, and -0 == +0)."""
    z = _div(x, temperature, GPU)
    z = tl.where(z != z, float("-inf"), z)
    z = tl.where(z == float("inf"), FLOAT32_MAX, z)
    return tl.where(z == 0.0, 0.0, z)


@triton.jit
def _key(z):
    """float32 -> int64 with the same order: negative floats' magnitude bits flipped."""
    bits = z.to(tl.int32, bitcast=True)
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64)


@triton.jit
def _search(row_ptr, ids_ptr, vocab, slot, counts_ptr, prompt_ptr, stride_slot, repetition,
            presence, frequency, temperature, z_max, min_p, lo, hi, target,
            BY_MASS: tl.constexpr, HAS_PENALTIES: tl.constexpr, GATHERED: tl.constexpr,
            BLOCK: tl.constexpr, PIVOTS: tl.constexpr, GPU: tl.constexpr):
    """The largest key c in [lo, hi) with W(key >= c) >= target over the tokens min-p
    keeps, W a count, or with BY_MASS the mass exp(z - z_max) and target a fraction of the
    mass at or above lo; lo when even W(>= lo) falls short. Needs W(>= hi) < target (hi
    above every key). Each pass counts W at PIVOTS candidates lo + j * step."""
    candidates = tl.arange(0, PIVOTS)
    fraction = target
    if BY_MASS:
        target = fraction * 0.0 - 1.0  # set from the first pass's total mass
    while hi - lo > 1:
        step = (hi - lo + PIVOTS - 1) // PIVOTS
        pivots = lo + candidates.to(tl.int64) * step
        # summed across the block once per pass, not per tile
        partial = tl.zeros([PIVOTS, BLOCK], dtype=tl.float32)
        for start in range(0, vocab, BLOCK):
            x, in_row, _ = _load_tile(row_ptr, ids_ptr, start + tl.arange(0, BLOCK), vocab,
                                      slot, counts_ptr, prompt_ptr, stride_slot, repetition,
                                      presence, frequency, HAS_PENALTIES, GATHERED, GPU)
            z = _filter_values(x, temperature, GPU)
            weight = tl.exp(z - z_max)
            alive = in_row & (weight >= min_p)
            if BY_MASS:
                weight = tl.where(alive, weight, 0.0)
            else:
                weight = alive.to(tl.float32)
            above = _key(z)[None, :] >= pivots[:, None]
            partial += tl.where(above, weight[None, :], 0.0)
        acc = tl.sum(partial, axis=1)
        if BY_MASS:  # the first pass's lowest candidate is lo: its W is the whole mass
            total = tl.max(tl.where(candidates == 0, acc, 0.0))
            target = tl.where(target < 0.0, fraction * total, target)
        reached = tl.max(tl.where(acc >= target, candidates, -1))
        if reached < 0:
            hi = lo + 1
        else:
            lo = lo + reached.to(tl.int64) * step
            hi = tl.minimum(hi, lo + step)
    return lo


@triton.jit
def _filtered_sample_kernel(
        logits_ptr, stride_row, vocab, temperature_ptr, greedy_ptr, philox_ptr, min_p_ptr,
        top_k_ptr, top_p_ptr, slot_ptr, counts_ptr, prompt_ptr, stride_slot, repetition_ptr,
        presence_ptr, frequency_ptr, ids_ptr, stride_ids, skip_ptr, out_ptr,
        HAS_PENALTIES: tl.constexpr, GATHERED: tl.constexpr, HAS_SKIP: tl.constexpr,
        BLOCK: tl.constexpr, PIVOTS: tl.constexpr, ROUNDS: tl.constexpr, GPU: tl.constexpr):
    row = tl.program_id(0)
    if HAS_SKIP:  # a row served elsewhere: an empty row, every loop runs zero times
        vocab = tl.where(tl.load(skip_ptr + row) != 0, 0, vocab)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    ids_ptr += row.to(tl.int64) * stride_ids
    noisy = tl.load(greedy_ptr + row) == 0
    temperature = tl.load(temperature_ptr + row)
    min_p = tl.load(min_p_ptr + row)
    top_k = tl.load(top_k_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    slot, repetition, presence, frequency = -1, 1.0, 0.0, 0.0
    if HAS_PENALTIES:
        slot = tl.load(slot_ptr + row)
        repetition = tl.load(repetition_ptr + row)
        presence = tl.load(presence_ptr + row)
        frequency = tl.load(frequency_ptr + row)
    by_k = (top_k > 0) & (top_k < vocab)
    filtered = noisy & ((min_p > 0) | by_k | (top_p < 1.0))

    threshold = tl.full([], _INT32_MIN, tl.int64)  # every key is >= it: keep all
    z_max = tl.full([], float("-inf"), tl.float32)
    if filtered:
        z_min = tl.full([], float("inf"), tl.float32)
        for start in range(0, vocab, BLOCK):
            x, in_row, _ = _load_tile(row_ptr, ids_ptr, start + tl.arange(0, BLOCK), vocab,
                                      slot, counts_ptr, prompt_ptr, stride_slot, repetition,
                                      presence, frequency, HAS_PENALTIES, GATHERED, GPU)
            z = _filter_values(x, temperature, GPU)
            z_max = tl.maximum(z_max, tl.max(z))
            z_min = tl.minimum(z_min, tl.min(tl.where(in_row, z, float("inf"))))
        lo = _key(z_min)
        hi = _key(z_max) + 1
        if by_k:
            lo = _search(row_ptr, ids_ptr, vocab, slot, counts_ptr, prompt_ptr, stride_slot,
                         repetition, presence, frequency, temperature, z_max, min_p, lo, hi,
                         top_k.to(tl.float32), False, HAS_PENALTIES, GATHERED, BLOCK, PIVOTS,
                         GPU)
        if top_p < 1.0:
            lo = _search(row_ptr, ids_ptr, vocab, slot, counts_ptr, prompt_ptr, stride_slot,
                         repetition, presence, frequency, temperature, z_max, min_p, lo, hi,
                         top_p, True, HAS_PENALTIES, GATHERED, BLOCK, PIVOTS, GPU)
        threshold = lo

    scale = LOG2E / temperature
    seed = tl.load(philox_ptr + 2 * row)
    stream = tl.load(philox_ptr + 2 * row + 1)
    stream_lo = (stream & 0xFFFFFFFF).to(tl.uint32)
    stream_hi = (stream >> 32).to(tl.uint32)
    # the draw, on [GROUPS, 4] tiles: one Philox call serves a group's four tokens
    groups = tl.arange(0, BLOCK // 4)
    best = tl.full([BLOCK // 4, 4], float("-inf"), tl.float32)
    best_token = tl.full([BLOCK // 4, 4], 2**31 - 1, tl.int32)
    for start in range(0, vocab, BLOCK):
        positions = start + groups[:, None] * 4 + tl.arange(0, 4)[None, :]
        x, in_row, tokens = _load_tile(row_ptr, ids_ptr, positions, vocab, slot, counts_ptr,
                                       prompt_ptr, stride_slot, repetition, presence,
                                       frequency, HAS_PENALTIES, GATHERED, GPU)
        scores = x
        if noisy:
            if GATHERED:
                noise = token_gumbel2(seed, stream_lo, stream_hi, tokens, ROUNDS, GPU)
            else:
                noise = gumbel2(seed, stream_lo, stream_hi, (start // 4 + groups).to(tl.uint32),
                                 ROUNDS, GPU)
            scores = x * scale + noise
        if filtered:
            z = _filter_values(x, temperature, GPU)
            kept = (tl.exp(z - z_max) >= min_p) & (_key(z) >= threshold)
            scores = tl.where(kept, scores, float("-inf"))
        # torch.argmax's order: NaN over +inf over every float; the first tile seeds the
        # state so that an all -inf row still names a real token
        scores = tl.where(scores == float("inf"), FLOAT32_MAX, scores)
        scores = tl.where(scores != scores, float("inf"), scores)
        scores = tl.where(in_row, scores, float("-inf"))
        # a lane meets its tokens in id order unless GATHERED: ties then go to the lower id
        better = (scores > best) | ((start == 0) & in_row)
        if GATHERED:
            better |= (scores == best) & (tokens < best_token) & in_row
        best = tl.where(better, scores, best)
        best_token = tl.where(better, tokens, best_token)
    _, token = best_of(best, best_token)
    tl.store(out_ptr + row, token.to(tl.int64))


def _column(value: Tensor | None, fill: float, dtype: torch.dtype, rows: int,
            device: torch.device) -> Tensor:
    if value is None:
        return torch.full((rows,), fill, dtype=dtype, device=device)
    return value.to(dtype)


def filtered_sample(logits: Tensor, temperature: Tensor, greedy_mask: Tensor, philox: Tensor,
                    min_p: Tensor | None = None, top_k: Tensor | None = None,
                    top_p: Tensor | None = None, penalties: PenaltyTensors | None = None,
                    config: FilteredKernelConfig = DEFAULT_FILTERED_CONFIG) -> Tensor:
    """Sampled token ids, int64 [S], from logits [S, V] of any float dtype.

    temperature (float32 [S]), greedy_mask (bool [S]) and philox (int64 [S, 2]) as in
    `sampling.fused_sample`; min_p / top_k / top_p per row (None: off for every
    row; top_k 0 is off); penalties: None when no row has any.

    With top_k set and a vocabulary wider than config.candidates, rows first take the
    candidate path (`_sample_candidates`); rows it cannot serve exactly take the full one.
    """
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    if top_k is None or logits.shape[1] <= config.candidates or logits.shape[0] == 0:
        return _sample_rows(logits, temperature, greedy_mask, philox, min_p, top_k, top_p,
                            penalties, None, config)
    return _sample_candidates(logits, temperature, greedy_mask, philox, min_p, top_k, top_p,
                              penalties, config)


def _sample_candidates(logits: Tensor, temperature: Tensor, greedy_mask: Tensor,
                       philox: Tensor, min_p: Tensor | None, top_k: Tensor,
                       top_p: Tensor | None, penalties: PenaltyTensors | None,
                       config: FilteredKernelConfig) -> Tensor:
    """Top-k rows drop every token below their k-th largest value, so one partial selection
    (torch.topk of config.candidates tokens, penalized first since penalties reorder the
    row) holds every token such a row can draw, and the kernel runs over those candidates
    only, recomputing their values and noise from their token ids: the same kept set and
    the same Gumbel scores, so the same token as the full pass. A row is served so only
    when the selection provably holds all of its top k, ties at the k-th value included
    (the last candidate lies strictly below it), its maximum is finite and it is not
    greedy; the other rows take the full pass, launched over the whole batch with the served
    rows skipped on the device, so nothing waits for the GPU (a host sync here would stall
    async scheduling every sampled step). The top-p mass is summed in a different order
    here, so only a row whose cut-off falls within float rounding of a token's value can
    differ."""
    values, ids = _candidates(logits, penalties, config.candidates)
    # z = key / T as the kernel's filters see it: monotone in the key, so the candidate
    # order is z's order
    z = values / temperature[:, None]
    z = torch.where(torch.isnan(z), float("-inf"), z).clamp(max=torch.finfo(torch.float32).max)
    k = top_k.long()
    kth = z.gather(1, (k - 1).clamp(0, config.candidates - 1)[:, None]).squeeze(1)
    served = ((k > 0) & (z[:, -1] < kth) & torch.isfinite(z[:, 0]) & ~greedy_mask
              & ~torch.isnan(values).any(1))
    out = _sample_rows(logits, temperature, greedy_mask, philox, min_p, top_k, top_p,
                       penalties, ids.to(torch.int32), config)
    full = _sample_rows(logits, temperature, greedy_mask, philox, min_p, top_k, top_p,
                        penalties, None, config, skip=served)
    return torch.where(served, out, full)


def _candidates(logits: Tensor, penalties: PenaltyTensors | None, count: int
                ) -> tuple[Tensor, Tensor]:
    """The `count` largest (penalized) logits of each row, float32, and their token ids.
    Only the rows with penalties are penalized (the host knows which): the others' order
    is their raw logits'."""
    values, ids = torch.topk(logits, count, dim=1)
    values = values.float()
    if penalties is not None and penalties.penalized_rows:
        rows = to_device(torch.tensor(penalties.penalized_rows, dtype=torch.int64),
                         logits.device)
        penalized = apply_penalties(logits[rows].float(), _penalty_rows(penalties, rows))
        values[rows], ids[rows] = torch.topk(penalized, count, dim=1)
    return values, ids


def _penalty_rows(penalties: PenaltyTensors, rows: Tensor) -> PenaltyTensors:
    p = penalties
    return dataclasses.replace(p, rows=p.rows[rows], repetition=p.repetition[rows],
                               presence=p.presence[rows], frequency=p.frequency[rows],
                               penalized_rows=list(range(rows.numel())))


def _sample_rows(logits: Tensor, temperature: Tensor, greedy_mask: Tensor, philox: Tensor,
                 min_p: Tensor | None, top_k: Tensor | None, top_p: Tensor | None,
                 penalties: PenaltyTensors | None, candidate_ids: Tensor | None,
                 config: FilteredKernelConfig, skip: Tensor | None = None) -> Tensor:
    """One kernel launch: over each row's whole vocabulary, or with candidate_ids (int32
    [S, C]) over those tokens only; rows where `skip` (bool [S]) holds are left unwritten."""
    num_rows, vocab = logits.shape
    device = logits.device
    out = torch.empty(num_rows, dtype=torch.int64, device=device)
    if num_rows == 0:
        return out
    min_p = _column(min_p, 0.0, torch.float32, num_rows, device)
    top_k = _column(top_k, 0, torch.int32, num_rows, device)
    top_p = _column(top_p, 1.0, torch.float32, num_rows, device)
    if penalties is None:  # never read: any tensor stands in for the pointers
        slot = counts = prompt = repetition = presence = frequency = min_p
        stride_slot = 0
    else:
        p = penalties
        slot, counts = p.rows.to(torch.int32), p.output_counts
        prompt = p.prompt_mask.view(torch.uint8)  # bool loads as bytes
        repetition, presence, frequency = p.repetition, p.presence, p.frequency
        stride_slot = counts.stride(0)
        if prompt.stride(0) != stride_slot:
            raise ValueError("output_counts and prompt_mask must have the same row stride")
    ids, stride_ids = min_p, 0  # never read without candidates
    if candidate_ids is not None:
        ids, stride_ids, vocab = candidate_ids, candidate_ids.stride(0), candidate_ids.shape[1]
    _filtered_sample_kernel[(num_rows,)](
        logits, logits.stride(0), vocab, temperature, greedy_mask, philox, min_p, top_k, top_p,
        slot, counts, prompt, stride_slot, repetition, presence, frequency, ids, stride_ids,
        min_p if skip is None else skip, out, HAS_PENALTIES=penalties is not None,
        GATHERED=candidate_ids is not None, HAS_SKIP=skip is not None, BLOCK=config.block, PIVOTS=config.pivots, ROUNDS=config.philox_rounds,
        GPU=logits.is_cuda and not interpreting(), num_warps=config.num_warps)
    return out
