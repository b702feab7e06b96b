"""Sampler: picks one token per sampling sequence, vectorized over the batch.

Order of operations (vLLM v1's): penalties on the raw logits, greedy argmax, then for
random rows temperature, min-p, top-k, top-p and a draw. The draw uses the exponential
race (argmax of p / q with q ~ Exp(1)), which is equivalent to multinomial sampling but
lets each seeded row fill its own noise from its own generator: a seeded request gets the
same tokens whatever else shares its batch. Logprobs are those of the raw model
distribution, before any processing, as the OpenAI API reports them.

Before any path, the rows' token restrictions: the grammar bitmask (structured outputs),
`allowed_token_ids` (every other token at -inf), `bad_words` (a word's last token at -inf
where the output ends with the tokens before it), then logit_bias, then the tokens a thinking
budget forces (`thinking_budget.py`: every other token of the row at -inf).

The filters' rules, which every path follows: min-p keeps the tokens with exp(z - max z)
>= min_p (z the logits over the temperature); top-k keeps the tokens at or above the k-th
largest value; top-p keeps those at or above the largest value c whose mass at or above c
reaches top_p (renormalised over what top-k kept). Each is a value threshold, so tokens
tied with the cut-off are all kept. The penalties read each request's token counts from
a `PenaltyState` on the same device (`penalties.py`).

On CUDA every row goes through fused Triton kernels that read the logits once per pass in
the model's dtype: greedy and plain temperature rows through `kernels/triton/sampling.py`, and a
batch with any filtered or penalized row through `kernels/triton/filtered_sampling.py`, which
draws with the same noise (a row's token does not depend on which kernel served it). The
CPU takes the torch path. The choice is made once, when the runner builds its `Sampler`
(`select_sampling_kernels`); tests pass the kernels explicitly (`triton_sampling_kernels()`
under TRITON_INTERPRET=1). Seeded draws repeat per device type and path, not across them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from torch import Tensor

from pagedserve.device.input_batch import CachedRequestState
from pagedserve.device.penalties import PenaltyState
from pagedserve.kernels.penalties import PenaltyTensors, apply_penalties, to_device
from pagedserve.sampling_params import SamplingParams
from pagedserve.structured.bitmask import apply_token_bitmask
from pagedserve.thinking_budget import ALWAYS, IF_LAST, UNLESS_LAST, forced_token

_SEED_MASK = 2**63 - 1  # Philox takes a 64-bit key; int64 holds the low 63 bits of any seed
_UNSEEDED_STREAM = 2**32  # unseeded rows' streams: a Philox counter word seeded rows never use


@dataclass(frozen=True)
class SamplingKernels:
    """The fused sampling kernels a `Sampler` draws with."""

    plain: Callable[..., Tensor]  # kernels.triton.sampling.fused_sample
    filtered: Callable[..., Tensor]  # kernels.triton.filtered_sampling.filtered_sample
    # kernels.triton.sampling.sample_vocab_shard: plain rows from a rank's vocabulary slice
    sharded: Callable[..., Tensor] | None = None


@dataclass(frozen=True)
class VocabShard:
    """A rank's slice of a vocab-parallel LM head's logits, and how to reach the others."""

    token_offset: int  # the token id of its first column
    vocab: int  # its columns that are real tokens (the last rank's tail is padding)
    columns: int  # its logits' width (every rank's)
    ranks: int
    gather: Callable[[Tensor], Tensor]  # every rank's [..., n] -> [..., ranks * n], rank order


def triton_sampling_kernels() -> SamplingKernels:
    """The Triton kernels (CUDA; the CPU under TRITON_INTERPRET=1, set before this first
    runs: importing them jits them)."""
    from pagedserve.kernels.triton.filtered_sampling import filtered_sample
    from pagedserve.kernels.triton.sampling import fused_sample, sample_vocab_shard

    return SamplingKernels(fused_sample, filtered_sample, sample_vocab_shard)


def select_sampling_kernels(device: torch.device) -> SamplingKernels | None:
    """The kernels for a runner on `device`: Triton's on CUDA where Triton imports, else None
    (the torch path serves every row)."""
    if device.type != "cuda":
        return None
    try:
        return triton_sampling_kernels()
    except ImportError:
        return None


@dataclass
class SamplingMetadata:
    """Per-row sampling tensors for one step; rows follow the runner's sampling order."""

    all_greedy: bool
    greedy_mask: Tensor | None = None  # bool [S]; None when all rows are greedy
    temperature: Tensor | None = None  # float32 [S]; greedy rows hold 1.0
    min_p: Tensor | None = None  # float32 [S]; None when no row uses it
    top_k: Tensor | None = None  # int64 [S]; 0 = off; None when no row uses it
    top_p: Tensor | None = None  # float32 [S]; None when no row uses it
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # seeded torch rows
    penalties: PenaltyTensors | None = None  # None when no row uses penalties
    max_num_logprobs: int | None = None  # None when no row asked for logprobs
    philox: Tensor | None = None  # fused path: int64 [S, 2], each row's noise (seed, stream)
    # structured outputs (pagedserve/structured): int32 [S, ceil(V / 32)], bit set = allowed;
    # applied to the logits before any path. None when no row is constrained.
    allowed_token_bitmask: Tensor | None = None
    # logit_bias of the rows that have one, sparse: (row int64 [B], token id int64 [B],
    # bias float32 [B]) added to the logits after the bitmask. None when no row has one.
    logit_bias: tuple[Tensor, Tensor, Tensor] | None = None
    # allowed_token_ids: (row int64 [A], bool [A, V], True = allowed); None when no row has them
    allowed_tokens: tuple[Tensor, Tensor] | None = None
    # bad_words: (row int64 [B], token int64 [B], after int64 [B]): the token is banned on
    # that row when the row's last token is `after` (-1: in any case), `last_token_ids` the
    # rows' last tokens (needed only for an `after`). None when no row bans a token.
    bad_words: tuple[Tensor, Tensor, Tensor] | None = None
    last_token_ids: Tensor | None = None
    # thinking budgets' forced tokens: (row int64 [F], token int64 [F], when int64 [F], last
    # int64 [F]): the row takes only `token` when `when` (thinking_budget.ALWAYS, IF_LAST,
    # UNLESS_LAST) holds of its last token and `last`. None when no row is forced.
    forced: tuple[Tensor, Tensor, Tensor, Tensor] | None = None

    @classmethod
    def from_requests(cls, requests: Sequence[CachedRequestState], vocab_size: int,
                      device: torch.device, fused: bool = False,
                      penalty_state: PenaltyState | None = None,
                      penalty_slots: Sequence[int] | None = None,
                      last_token_ids: Tensor | None = None) -> SamplingMetadata:
        """`fused` builds the fused kernels' inputs (for a `Sampler` with kernels).
        Rows with penalties read their slots (`PenaltyState.slots` of the rows' request
        ids) in `penalty_state`; without one, a state is built from the rows' token lists,
        which is right only when those are complete (no token in flight).
        `last_token_ids` (int64 [S] on the device): each row's last token, which rows with
        bad words need when that token is still in flight (async scheduling)."""
        params = [r.sampling_params for r in requests]
        greedy = [p.is_greedy for p in params]
        logprobs = [p.logprobs for p in params if p.logprobs is not None]
        meta = cls(all_greedy=all(greedy), max_num_logprobs=max(logprobs) if logprobs else None)
        if not meta.all_greedy:
            meta._set_random(requests, greedy, device, fused)
        if any(p.needs_penalties for p in params):
            if penalty_state is None:
                penalty_state = PenaltyState(vocab_size, device, initial_slots=len(requests))
                penalty_slots = []
                for i, r in enumerate(requests):
                    penalty_slots.append(-1 if not r.sampling_params.needs_penalties else
                                         penalty_state.add(str(i), r.prompt_token_ids,
                                                           r.output_token_ids))
            meta.penalties = _penalty_tensors(params, penalty_state, penalty_slots, device)
        if any(p.logit_bias for p in params):
            meta.logit_bias = _logit_bias(params, device)
        if any(p.allowed_token_ids for p in params):
            meta.allowed_tokens = _allowed_tokens(params, vocab_size, device)
        if any(p.bad_words_token_ids for p in params):
            bans = [ban for row, r in enumerate(requests) for ban in _bad_word_bans(row, r)]
            if bans:
                meta.bad_words = tuple(to_device(torch.tensor(column, dtype=torch.int64),
                                                 device) for column in zip(*bans))
                if any(after >= 0 for _, _, after in bans):
                    if last_token_ids is None:
                        raise ValueError("rows with bad words and a token in flight need "
                                         "last_token_ids")
                    meta.last_token_ids = last_token_ids
        if any(p.thinking_budget for p in params):
            meta._set_forced(requests, device, last_token_ids)
        return meta

    def _set_forced(self, requests: Sequence[CachedRequestState], device: torch.device,
                    last_token_ids: Tensor | None) -> None:
        forced = []
        for row, r in enumerate(requests):
            budget = r.sampling_params.thinking_budget
            if budget is not None:
                in_flight = max(r.num_output_placeholders - 1, 0)
                f = forced_token(budget, r.output_token_ids, in_flight)
                if f is not None:
                    forced.append((row, f.token, f.when, f.last))
        if not forced:
            return
        if any(when != ALWAYS for _, _, when, _ in forced):
            if last_token_ids is None:
                raise ValueError("rows with a thinking budget and a token in flight need "
                                 "last_token_ids")
            self.last_token_ids = last_token_ids
        self.forced = tuple(to_device(torch.tensor(column, dtype=torch.int64), device)
                            for column in zip(*forced))

    def _set_random(self, requests: Sequence[CachedRequestState], greedy: list[bool],
                    device: torch.device, fused: bool) -> None:
        params = [r.sampling_params for r in requests]

        def column(values, dtype):
            return to_device(torch.tensor(values, dtype=dtype), device)

        self.greedy_mask = column(greedy, torch.bool)
        self.temperature = column([1.0 if g else p.temperature for g, p in zip(greedy, params)],
                                  torch.float32)
        if any(p.min_p > 0 for p in params):
            self.min_p = column([p.min_p for p in params], torch.float32)
        if any(p.top_k > 0 for p in params):
            self.top_k = column([p.top_k for p in params], torch.int64)
        if any(p.top_p < 1.0 for p in params):
            self.top_p = column([p.top_p for p in params], torch.float32)
        if fused:  # every row draws Philox noise in a kernel
            self.philox = to_device(philox_rows(requests), device)
        else:
            self.generators = {i: r.generator_for(device) for i, r in enumerate(requests)
                               if r.generator is not None and not greedy[i]}

    @property
    def filtered(self) -> bool:
        return self.min_p is not None or self.top_k is not None or self.top_p is not None

    @property
    def restricted(self) -> bool:
        """Whether `restrict` changes any row's logits."""
        return (self.allowed_token_bitmask is not None or self.allowed_tokens is not None
                or self.bad_words is not None or self.logit_bias is not None
                or self.forced is not None)


def is_plain(params: SamplingParams) -> bool:
    """A row drawn from its logits and temperature alone (greedy or not, seeded or not):
    nothing of `from_requests` but the greedy mask, the temperatures and the noise applies
    to it. A grammar's bitmask comes at sampling, apart from the metadata."""
    return (params.logprobs is None and params.min_p == 0.0 and params.top_k == 0
            and params.top_p == 1.0 and not params.needs_penalties and not params.logit_bias
            and not params.allowed_token_ids and not params.bad_words_token_ids
            and params.thinking_budget is None)


class PlainBatch:
    """The sampling metadata of a batch whose rows are all plain (`is_plain`), its columns
    kept from one step to the next.

    At steady state a decode step samples the same requests in the same order as the step
    before, so its greedy mask and temperatures are that step's: only the noise (the fused
    kernels' `philox_rows`, or the seeded rows' generators) is drawn anew. Rebuilding the
    columns read every row's parameters a dozen times and copied two tensors to the device,
    most of the runner's host work in a large decode step (docs/benchmarks.md, "The
    engine's host work per step at batch 256"). The batch is
    recognised by its states (the runner's objects, one per request for its life), compared
    in order; whether it is plain is decided once per batch."""

    def __init__(self, device: torch.device, fused: bool) -> None:
        self.device, self.fused = device, fused
        self._requests: list[CachedRequestState] = []
        self._columns: SamplingMetadata | None = None  # None: the batch is not plain
        self._greedy: list[bool] = []
        self._seeded: list[int] = []  # the rows with a seed

    def metadata(self, requests: list[CachedRequestState]) -> SamplingMetadata | None:
        """This step's metadata (a new object: the caller may attach a bitmask to it), or
        None where a row is not plain (the caller builds it in full:
        `SamplingMetadata.from_requests`)."""
        if requests != self._requests:
            self._requests = list(requests)
            plain = bool(requests) and all(is_plain(r.sampling_params) for r in requests)
            self._greedy = [r.sampling_params.is_greedy for r in requests] if plain else []
            self._seeded = [i for i, r in enumerate(requests)
                            if r.sampling_params.seed is not None] if plain else []
            self._columns = (SamplingMetadata.from_requests(requests, 0, self.device,
                                                            fused=self.fused)
                             if plain else None)
            return replace(self._columns) if plain else None
        columns = self._columns
        if columns is None or columns.all_greedy:
            return None if columns is None else SamplingMetadata(all_greedy=True)
        meta = SamplingMetadata(all_greedy=False, greedy_mask=columns.greedy_mask,
                                temperature=columns.temperature)
        if self.fused:
            meta.philox = to_device(philox_rows(requests, self._seeded), self.device)
        else:
            greedy = self._greedy
            meta.generators = {i: r.generator_for(self.device) for i, r in enumerate(requests)
                               if r.generator is not None and not greedy[i]}
        return meta


def _penalty_tensors(params: list[SamplingParams], state: PenaltyState,
                     slots: Sequence[int] | None, device: torch.device) -> PenaltyTensors:
    if slots is None:
        raise ValueError("rows with penalties need their slots in the PenaltyState")
    missing = [i for i, (p, s) in enumerate(zip(params, slots)) if p.needs_penalties and s < 0]
    if missing:
        raise ValueError(f"rows {missing} have penalties but no PenaltyState slot")
    rows = [s if p.needs_penalties else -1 for p, s in zip(params, slots)]

    def column(values, dtype=torch.float32):
        return to_device(torch.tensor(values, dtype=dtype), device)

    return PenaltyTensors(
        rows=column(rows, torch.int64), output_counts=state.output_counts,
        prompt_mask=state.prompt_mask,
        repetition=column([p.repetition_penalty for p in params]),
        presence=column([p.presence_penalty for p in params]),
        frequency=column([p.frequency_penalty for p in params]),
        penalized_rows=[i for i, s in enumerate(rows) if s >= 0])


def _logit_bias(params: Sequence[SamplingParams], device: torch.device
                ) -> tuple[Tensor, Tensor, Tensor]:
    entries = [(row, token, bias) for row, p in enumerate(params)
               for token, bias in (p.logit_bias or {}).items()]
    rows, tokens, biases = zip(*entries)
    return (to_device(torch.tensor(rows, dtype=torch.int64), device),
            to_device(torch.tensor(tokens, dtype=torch.int64), device),
            to_device(torch.tensor(biases, dtype=torch.float32), device))


def _allowed_tokens(params: Sequence[SamplingParams], vocab_size: int,
                    device: torch.device) -> tuple[Tensor, Tensor]:
    rows = [row for row, p in enumerate(params) if p.allowed_token_ids]
    allowed = torch.zeros(len(rows), vocab_size, dtype=torch.bool)
    for i, row in enumerate(rows):
        allowed[i, params[row].allowed_token_ids] = True
    return (to_device(torch.tensor(rows, dtype=torch.int64), device),
            to_device(allowed, device))


def _bad_word_bans(row: int, request: CachedRequestState) -> list[tuple[int, int, int]]:
    """(row, token, after) per bad word whose last token this row must not sample now: the
    output ends with the word's other tokens. The tokens the host knows decide all but the
    one in flight (async scheduling: at most one, the row's last token), which the device
    compares with `after`."""
    output = request.output_token_ids
    in_flight = max(request.num_output_placeholders - 1, 0)
    bans = []
    for *before, token in request.sampling_params.bad_words_token_ids or ():
        if len(output) + in_flight < len(before):
            continue
        after = before[-1] if in_flight and before else -1
        known = before[:-1] if after >= 0 else before
        if not known or output[len(output) - len(known):] == known:
            bans.append((row, token, after))
    return bans


def philox_rows(requests: Sequence[CachedRequestState],
                seeded_rows: Sequence[int] | None = None) -> Tensor:
    """The fused kernel's (seed, stream) per row, int64 [S, 2] on the host.

    A seeded row: its own seed and the index of the token being drawn, so its draws depend
    on nothing else in the batch and repeat after a preemption. That index counts the tokens
    generated and those still in flight before this one: the scheduler has already given
    this step's token a placeholder (`request.py`), and with async scheduling the previous
    step's token may not have arrived yet. Unseeded rows share one seed drawn per step from
    torch's default generator (torch.manual_seed makes a run repeatable, as on the torch
    path) and take distinct streams by row, in a stream range no seeded row reaches.
    `seeded_rows`: the rows with a seed, where the caller knows them already (`PlainBatch`).
    Built in numpy: at a few hundred rows torch's per-op cost was most of it.
    """
    rows = np.empty((len(requests), 2), dtype=np.int64)
    rows[:, 0] = int(torch.randint(_SEED_MASK, (1,)))
    rows[:, 1] = np.arange(_UNSEEDED_STREAM, _UNSEEDED_STREAM + len(requests))
    if seeded_rows is None:
        seeded_rows = [i for i, r in enumerate(requests) if r.sampling_params.seed is not None]
    for i in seeded_rows:
        r = requests[i]
        rows[i] = r.sampling_params.seed & _SEED_MASK, _drawn_token_index(r)
    return torch.from_numpy(rows)


def _drawn_token_index(request: CachedRequestState) -> int:
    return request.num_output_tokens + max(request.num_output_placeholders - 1, 0)


def _force(logits: Tensor, meta: SamplingMetadata) -> Tensor:
    """The forced rows whose condition holds: their token at 0, every other at -inf (the
    conditions are read on the device: no wait for a token in flight)."""
    rows, tokens, when, last = meta.forced
    active = when == ALWAYS
    if meta.last_token_ids is not None:
        previous = meta.last_token_ids.index_select(0, rows)
        active = active | ((when == IF_LAST) & (previous == last)) \
            | ((when == UNLESS_LAST) & (previous != last))
    current = logits.index_select(0, rows)
    only = torch.full_like(current, float("-inf")).scatter_(1, tokens[:, None], 0.0)
    return logits.index_copy(0, rows, torch.where(active[:, None], only, current))


@dataclass
class LogprobsTensors:
    top_token_ids: Tensor  # int64 [S, k]
    top_logprobs: Tensor  # float32 [S, k]
    sampled_logprobs: Tensor  # float32 [S]
    sampled_ranks: Tensor  # int64 [S]; 1 = the most likely token


@dataclass
class SamplerOutput:
    sampled_token_ids: Tensor  # int64 [S]
    logprobs: LogprobsTensors | None


class Sampler:
    def __init__(self, kernels: SamplingKernels | None = None) -> None:
        """kernels: the fused kernels its rows take (`select_sampling_kernels`); None: the
        torch path for every row."""
        self.kernels = kernels

    @property
    def fused(self) -> bool:
        """Whether it has the fused kernels: its metadata is built with their inputs."""
        return self.kernels is not None

    def __call__(self, logits: Tensor, meta: SamplingMetadata) -> SamplerOutput:
        logits = restrict(logits, meta)
        fused = self._takes_fused_path(meta)
        if fused:  # the kernels read the model's dtype; only logprobs need float32
            tokens = self._sample_fused(logits, meta)
            if meta.max_num_logprobs is not None:
                logits = logits.float()
        else:
            logits = logits.float()  # one copy serves logprobs, penalties and the draw
            penalized = logits
            if meta.penalties is not None:
                penalized = apply_penalties(logits, meta.penalties)
            tokens = self._sample_torch(penalized, meta)
        logprobs = None
        if meta.max_num_logprobs is not None:
            logprobs = gather_logprobs(logits.log_softmax(-1), tokens, meta.max_num_logprobs)
        return SamplerOutput(tokens, logprobs)

    def _takes_fused_path(self, meta: SamplingMetadata) -> bool:
        """Metadata built without the kernels' inputs (no philox) keeps to torch; metadata
        built with them holds no generators, so it needs the kernels."""
        if meta.philox is not None and self.kernels is None:
            raise ValueError("sampling metadata built for the fused kernels "
                             "(from_requests(fused=True)) reached a sampler without them")
        return self.kernels is not None and (meta.all_greedy or meta.philox is not None)

    def samples_shards(self, meta: SamplingMetadata) -> bool:
        """Whether `sample_shard` can serve these rows: the plain kernel's rows (greedy or
        temperature alone) with nothing that reads the whole vocabulary (no restriction,
        penalty, filter or logprobs)."""
        return (self.kernels is not None and self.kernels.sharded is not None
                and self._takes_fused_path(meta) and meta.penalties is None
                and not meta.filtered and meta.max_num_logprobs is None
                and not meta.restricted)

    def sample_shard(self, logits: Tensor, meta: SamplingMetadata,
                     shard: VocabShard) -> SamplerOutput:
        """The tokens `__call__` would draw from the gathered logits, from this rank's slice
        (rows `samples_shards` accepts); the same on every rank."""
        if not self.samples_shards(meta):
            raise ValueError("these sampling rows need the whole vocabulary's logits")
        tokens = self.kernels.sharded(logits, meta.temperature, meta.greedy_mask, meta.philox,
                                      shard.token_offset, shard.vocab, shard.ranks,
                                      shard.gather)
        return SamplerOutput(tokens, None)

    def _sample_fused(self, logits: Tensor, meta: SamplingMetadata) -> Tensor:
        kernels = self.kernels
        if meta.penalties is None and not meta.filtered:
            return kernels.plain(logits, meta.temperature, meta.greedy_mask, meta.philox)
        temperature, greedy_mask, philox = meta.temperature, meta.greedy_mask, meta.philox
        if meta.all_greedy:  # greedy rows with penalties: the kernel reads but ignores these
            rows, device = logits.shape[0], logits.device
            temperature = torch.ones(rows, dtype=torch.float32, device=device)
            greedy_mask = torch.ones(rows, dtype=torch.bool, device=device)
            philox = torch.zeros(rows, 2, dtype=torch.int64, device=device)
        return kernels.filtered(logits, temperature, greedy_mask, philox, meta.min_p,
                                meta.top_k, meta.top_p, meta.penalties)

    def _sample_torch(self, logits: Tensor, meta: SamplingMetadata) -> Tensor:
        tokens = logits.argmax(-1)
        if not meta.all_greedy:
            tokens = torch.where(meta.greedy_mask, tokens, self._sample_random(logits, meta))
        return tokens

    def _sample_random(self, logits: Tensor, meta: SamplingMetadata) -> Tensor:
        probs = random_probs(logits, meta)
        noise = torch.empty_like(probs).exponential_()  # one launch for all unseeded rows
        for row, generator in meta.generators.items():  # seeded rows: their own stream
            noise[row].exponential_(generator=generator)
        return (probs / noise).argmax(-1)


def restrict(logits: Tensor, meta: SamplingMetadata) -> Tensor:
    """The rows' token restrictions, before any path (see the module docstring); the
    speculative verify applies them too (`rejection.py`)."""
    if meta.allowed_token_bitmask is not None:
        logits = apply_token_bitmask(logits, meta.allowed_token_bitmask)
    if meta.allowed_tokens is not None:
        rows, allowed = meta.allowed_tokens
        banned = torch.zeros_like(logits, dtype=torch.bool)
        banned[rows] = ~allowed
        logits = logits.masked_fill(banned, float("-inf"))
    if meta.bad_words is not None:
        rows, tokens, after = meta.bad_words
        hit = after < 0
        if meta.last_token_ids is not None:
            hit |= meta.last_token_ids.index_select(0, rows) == after
        bans = torch.where(hit, float("-inf"), 0.0).to(logits.dtype)
        logits = logits.index_put((rows, tokens), bans, accumulate=True)
    if meta.logit_bias is not None:
        rows, tokens, biases = meta.logit_bias
        logits = logits.index_put((rows, tokens), biases.to(logits.dtype), accumulate=True)
    if meta.forced is not None:
        logits = _force(logits, meta)
    return logits


# Row mixes that between them launch every kernel variant a CUDA step can take: plain
# greedy / temperature, the candidate path (with its full pass over the rows it skips) with
# and without penalties, and the full filtered pass with and without penalties.
_WARM_UP_MIXES = (
    (SamplingParams(temperature=0.0),),
    (SamplingParams(temperature=0.8),),
    (SamplingParams(temperature=0.0),
     SamplingParams(top_k=40, top_p=0.95, repetition_penalty=1.1, seed=0)),
    (SamplingParams(top_k=40, min_p=0.05),),
    (SamplingParams(top_p=0.9),),
    (SamplingParams(top_p=0.9, presence_penalty=0.5, frequency_penalty=0.5),),
)


def warm_up_sampler(sampler: Sampler, vocab_size: int, dtype: torch.dtype,
                    device: torch.device, max_rows: int,
                    shard: VocabShard | None = None) -> None:
    """Run every sampling path once on random logits, at one row and at `max_rows`, so
    Triton compiles its kernels (and xgrammar its bitmask kernel) at start-up. Otherwise the
    first request with top-k or penalties pays seconds of compiling inside a step, and every
    request in that batch waits. Nothing to compile for a sampler without kernels. The rows'
    token lists are complete, so `from_requests` builds their penalty state itself.
    `shard`: a rank's vocabulary slice, whose plain rows also go through
    `sample_shard`, with this rank's winners standing in for every rank's (the kernels see
    the shapes of a real step, and no rank waits on another)."""
    if not sampler.fused:
        return
    for i, mix in enumerate(_WARM_UP_MIXES):
        for rows in sorted({len(mix), max(max_rows, len(mix))}):
            states = [CachedRequestState(f"warm-up-{j}", [0, 1], mix[j % len(mix)])
                      for j in range(rows)]
            meta = SamplingMetadata.from_requests(states, vocab_size, device, fused=True)
            if shard is not None and sampler.samples_shards(meta):
                _warm_up_shard(sampler, meta, shard, rows, dtype, device)
            if i == 0:
                meta.allowed_token_bitmask = torch.full(
                    (rows, -(-vocab_size // 32)), -1, dtype=torch.int32, device=device)
            sampler(torch.randn(rows, vocab_size, dtype=dtype, device=device), meta)


def _warm_up_shard(sampler: Sampler, meta: SamplingMetadata, shard: VocabShard, rows: int,
                   dtype: torch.dtype, device: torch.device) -> None:
    def own_winners_only(parts: Tensor) -> Tensor:
        return torch.cat([parts] * shard.ranks, dim=-1)

    logits = torch.randn(rows, shard.columns, dtype=dtype, device=device)
    sampler.sample_shard(logits, meta, replace(shard, gather=own_winners_only))


def random_probs(logits: Tensor, meta: SamplingMetadata) -> Tensor:
    """The distribution a random row draws from: temperature, min-p, top-k, top-p, softmax
    (float32 logits, restricted and penalized already)."""
    logits = logits / meta.temperature.unsqueeze(1)
    if meta.min_p is not None:
        logits = apply_min_p(logits, meta.min_p)
    if meta.top_k is not None or meta.top_p is not None:
        logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
    return logits.softmax(-1)


def apply_min_p(logits: Tensor, min_p: Tensor) -> Tensor:
    """Drop tokens whose probability is below min_p times the most likely token's, as
    exp(z - max z) < min_p: the same float32 test as the kernel's."""
    relative = (logits - logits.amax(-1, keepdim=True)).exp()
    return logits.masked_fill(relative < min_p.unsqueeze(1), float("-inf"))


def apply_top_k_top_p(logits: Tensor, top_k: Tensor | None, top_p: Tensor | None) -> Tensor:
    """One descending sort serves both thresholds; tokens tied with a cut-off stay.
    top-k keeps values >= the k-th largest; top-p keeps values >= the first sorted value
    at which the cumulative mass (of what top-k kept) reaches top_p; 1 keeps all."""
    vocab = logits.shape[1]
    sorted_logits = logits.sort(dim=-1, descending=True).values
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).clamp(max=vocab)
        kth = sorted_logits.gather(1, (k - 1).unsqueeze(1))
        logits = logits.masked_fill(logits < kth, float("-inf"))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        first = (cumulative < top_p.unsqueeze(1)).sum(-1, keepdim=True).clamp(max=vocab - 1)
        first[top_p >= 1.0] = vocab - 1  # off: a sum that rounds to 1 early cuts nothing
        logits = logits.masked_fill(logits < sorted_logits.gather(1, first), float("-inf"))
    return logits


def gather_logprobs(logprobs: Tensor, tokens: Tensor, k: int) -> LogprobsTensors:
    sampled = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    ranks = (logprobs > sampled.unsqueeze(1)).sum(-1) + 1
    top_logprobs, top_ids = logprobs.topk(k, dim=-1) if k > 0 else (
        logprobs[:, :0], tokens[:, None][:, :0])
    return LogprobsTensors(top_ids, top_logprobs, sampled, ranks)
