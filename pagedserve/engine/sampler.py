"""Sampler: picks one token per sampling sequence, vectorized over the batch.

Order of operations (vLLM v1's): penalties on the raw logits, greedy argmax, then for
random rows temperature, min-p, top-k, top-p and a draw. The draw uses the exponential
race (argmax of p / q with q ~ Exp(1)), which is equivalent to multinomial sampling but
lets each seeded row fill its own noise from its own generator: a seeded request gets the
same tokens whatever else shares its batch. Logprobs are those of the raw model
distribution, before any processing, as the OpenAI API reports them.

On CUDA, greedy and plain temperature rows go through one fused Triton kernel
(`sampling_kernel.py`) that reads the logits once in the model's dtype; rows with top-k,
top-p or min-p take the torch path (on the whole batch, then selected), and penalties are
applied before either. Which path a row takes depends only on its own parameters, so a
seeded request keeps drawing from one noise source whatever its batch. Seeded draws repeat
per device type and path, not across them. The CPU always takes the torch path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache

import torch
from torch import Tensor

from pagedserve.engine.request import Request

_SEED_MASK = 2**63 - 1  # Philox takes a 64-bit key; int64 holds the low 63 bits of any seed
_UNSEEDED_STREAM = 2**32  # unseeded rows' streams: a Philox counter word seeded rows never use


@cache
def _fused_sample() -> Callable[..., Tensor] | None:
    """The kernel entry, imported on first need: a CPU run never pays for Triton, and the
    interpreter tests can set TRITON_INTERPRET before the kernels are jitted. None without
    Triton: the torch path then serves every row."""
    try:
        from pagedserve.engine.sampling_kernel import fused_sample
    except ImportError:
        return None
    return fused_sample


def fused_sampling_available(device: torch.device) -> bool:
    return device.type == "cuda" and _fused_sample() is not None


@dataclass
class SamplingMetadata:
    """Per-row sampling tensors for one step; rows follow the runner's sampling order."""

    all_greedy: bool
    greedy_mask: Tensor | None  # bool [S]; None when all rows are greedy
    temperature: Tensor | None  # float32 [S]; greedy rows hold 1.0
    min_p: Tensor | None  # float32 [S]; None when no row uses it
    top_k: Tensor | None  # int64 [S]; 0 = off; None when no row uses it
    top_p: Tensor | None  # float32 [S]; None when no row uses it
    generators: dict[int, torch.Generator]  # row -> generator of a seeded torch-path row
    repetition_penalty: Tensor | None  # float32 [S]; None when no row uses penalties
    presence_penalty: Tensor | None
    frequency_penalty: Tensor | None
    prompt_token_ids: Tensor | None  # int64 [S, P] padded with vocab_size
    output_token_ids: Tensor | None  # int64 [S, O] padded with vocab_size
    max_num_logprobs: int | None  # None when no row asked for logprobs
    # fused path only (None otherwise, and when all rows are greedy):
    philox: Tensor | None = None  # int64 [S, 2]: each row's noise (seed, stream)
    filtered_mask: Tensor | None = None  # bool [S]: rows left to the torch path; None if none

    @classmethod
    def from_requests(cls, requests: Sequence[Request], vocab_size: int,
                      device: torch.device, fused: bool | None = None) -> SamplingMetadata:
        """`fused` builds the fused kernel's inputs; None: when the device can run it."""
        params = [r.sampling_params for r in requests]
        greedy = [p.is_greedy for p in params]
        all_greedy = all(greedy)
        logprobs = [p.logprobs for p in params if p.logprobs is not None]
        meta = cls(all_greedy=all_greedy, greedy_mask=None, temperature=None, min_p=None,
                   top_k=None, top_p=None, generators={}, repetition_penalty=None,
                   presence_penalty=None, frequency_penalty=None, prompt_token_ids=None,
                   output_token_ids=None, max_num_logprobs=max(logprobs) if logprobs else None)
        if not all_greedy:
            meta._set_random(requests, greedy, device,
                             fused_sampling_available(device) if fused is None else fused)
        if any(p.needs_penalties for p in params):
            meta._set_penalties(requests, vocab_size, device)
        return meta

    def _set_random(self, requests: Sequence[Request], greedy: list[bool],
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
        torch_rows = range(len(requests))
        if fused:
            self.philox = to_device(philox_rows(requests), device)
            torch_rows = []
            if any(t is not None for t in (self.min_p, self.top_k, self.top_p)):
                # greedy rows have these filters off (SamplingParams resets them)
                filtered = [p.min_p > 0 or p.top_k > 0 or p.top_p < 1.0 for p in params]
                self.filtered_mask = column(filtered, torch.bool)
                torch_rows = [i for i, f in enumerate(filtered) if f]
        self.generators = {i: requests[i].generator_for(device) for i in torch_rows
                           if requests[i].generator is not None and not greedy[i]}

    def _set_penalties(self, requests: Sequence[Request], vocab_size: int,
                       device: torch.device) -> None:
        params = [r.sampling_params for r in requests]

        def column(values):
            return to_device(torch.tensor(values, dtype=torch.float32), device)

        self.repetition_penalty = column([p.repetition_penalty for p in params])
        self.presence_penalty = column([p.presence_penalty for p in params])
        self.frequency_penalty = column([p.frequency_penalty for p in params])
        self.prompt_token_ids = _pad([r.prompt_token_ids for r in requests], vocab_size, device)
        self.output_token_ids = _pad([r.output_token_ids for r in requests], vocab_size, device)


def philox_rows(requests: Sequence[Request]) -> Tensor:
    """The fused kernel's (seed, stream) per row, int64 [S, 2] on the host.

    A seeded row: its own seed and the index of the token being drawn, so its draws depend
    on nothing else in the batch and repeat after a preemption. That index counts the tokens
    generated and those still in flight before this one: the scheduler has already given
    this step's token a placeholder (`request.py`), and with async scheduling the previous
    step's token may not have arrived yet. Unseeded rows share one seed drawn per step from
    torch's default generator (torch.manual_seed makes a run repeatable, as on the torch
    path) and take distinct streams by row, in a stream range no seeded row reaches.
    """
    rows = torch.empty(len(requests), 2, dtype=torch.int64)
    rows[:, 0] = int(torch.randint(_SEED_MASK, (1,)))
    rows[:, 1] = torch.arange(_UNSEEDED_STREAM, _UNSEEDED_STREAM + len(requests))
    seeded = [(i, r.sampling_params.seed & _SEED_MASK, _drawn_token_index(r))
              for i, r in enumerate(requests) if r.sampling_params.seed is not None]
    if seeded:
        index, seeds, streams = zip(*seeded)
        rows[list(index)] = torch.tensor([seeds, streams], dtype=torch.int64).T
    return rows


def _drawn_token_index(request: Request) -> int:
    return request.num_output_tokens + max(request.num_output_placeholders - 1, 0)


def to_device(cpu: Tensor, device: torch.device) -> Tensor:
    """Copy through pinned memory without waiting: a copy from pageable memory to a GPU
    blocks the host until the stream has drained, a sync in the middle of the step."""
    if device.type != "cuda":
        return cpu.to(device)
    return cpu.pin_memory().to(device, non_blocking=True)


def _pad(rows: Sequence[Sequence[int]], pad: int, device: torch.device) -> Tensor:
    width = max(1, max(len(r) for r in rows))
    out = torch.full((len(rows), width), pad, dtype=torch.int64)
    for i, row in enumerate(rows):
        out[i, :len(row)] = torch.as_tensor(row, dtype=torch.int64)
    return to_device(out, device)


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
    def __init__(self, use_triton: bool | None = None) -> None:
        """use_triton: None picks the fused kernel for CUDA logits when Triton imports;
        True forces it (CPU logits need TRITON_INTERPRET=1); False keeps to torch."""
        if use_triton and _fused_sample() is None:
            raise ValueError("use_triton=True needs Triton, which did not import")
        self.use_triton = use_triton

    def __call__(self, logits: Tensor, meta: SamplingMetadata) -> SamplerOutput:
        fused = self._takes_fused_path(logits, meta)
        if not fused or meta.max_num_logprobs is not None or meta.repetition_penalty is not None:
            logits = logits.float()  # one copy serves logprobs, penalties and the torch path
        raw_logprobs = logits.log_softmax(-1) if meta.max_num_logprobs is not None else None
        if meta.repetition_penalty is not None:
            logits = apply_penalties(logits, meta)
        tokens = self._sample_fused(logits, meta) if fused else self._sample_torch(logits, meta)
        logprobs = None
        if raw_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, tokens, meta.max_num_logprobs)
        return SamplerOutput(tokens, logprobs)

    def _takes_fused_path(self, logits: Tensor, meta: SamplingMetadata) -> bool:
        """Metadata built without the kernel's inputs (no philox) keeps to torch; metadata
        built with them holds generators for the torch-path rows only, so it needs the
        kernel."""
        enabled = self.use_triton
        if enabled is None:
            enabled = fused_sampling_available(logits.device)
        if meta.philox is not None and not enabled:
            raise ValueError("sampling metadata built for the fused kernel "
                             "(from_requests(fused=True)) reached a sampler without it")
        return enabled and (meta.all_greedy or meta.philox is not None)

    def _sample_fused(self, logits: Tensor, meta: SamplingMetadata) -> Tensor:
        tokens = _fused_sample()(logits, meta.temperature, meta.greedy_mask, meta.philox)
        if meta.filtered_mask is not None:
            tokens = torch.where(meta.filtered_mask, self._sample_random(logits.float(), meta),
                                 tokens)
        return tokens

    def _sample_torch(self, logits: Tensor, meta: SamplingMetadata) -> Tensor:
        tokens = logits.argmax(-1)
        if not meta.all_greedy:
            tokens = torch.where(meta.greedy_mask, tokens, self._sample_random(logits, meta))
        return tokens

    def _sample_random(self, logits: Tensor, meta: SamplingMetadata) -> Tensor:
        logits = logits / meta.temperature.unsqueeze(1)
        if meta.min_p is not None:
            logits = apply_min_p(logits, meta.min_p)
        if meta.top_k is not None or meta.top_p is not None:
            logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
        probs = logits.softmax(-1)
        noise = torch.empty_like(probs).exponential_()  # one launch for all unseeded rows
        for row, generator in meta.generators.items():  # seeded rows: their own stream
            noise[row].exponential_(generator=generator)
        return (probs / noise).argmax(-1)


def apply_penalties(logits: Tensor, meta: SamplingMetadata) -> Tensor:
    """Repetition (prompt + output, divide positive / multiply negative logits), then
    frequency (count in output) and presence (seen in output) subtracted."""
    num_rows, vocab = logits.shape
    output_counts = torch.zeros(num_rows, vocab + 1, dtype=logits.dtype, device=logits.device)
    output_counts.scatter_add_(1, meta.output_token_ids,
                               torch.ones_like(meta.output_token_ids, dtype=logits.dtype))
    output_counts = output_counts[:, :vocab]
    seen = torch.zeros(num_rows, vocab + 1, dtype=torch.bool, device=logits.device)
    seen.scatter_(1, meta.prompt_token_ids, True)
    seen = seen[:, :vocab] | (output_counts > 0)
    rep = meta.repetition_penalty.unsqueeze(1).expand_as(logits)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    logits = logits - meta.frequency_penalty.unsqueeze(1) * output_counts
    return logits - meta.presence_penalty.unsqueeze(1) * (output_counts > 0).to(logits.dtype)


def apply_min_p(logits: Tensor, min_p: Tensor) -> Tensor:
    """Drop tokens whose probability is below min_p times the most likely token's."""
    probs = logits.softmax(-1)
    threshold = probs.amax(-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: Tensor, top_k: Tensor | None, top_p: Tensor | None) -> Tensor:
    """One ascending sort serves both masks. top-k keeps values >= the k-th largest;
    top-p keeps the smallest head of the sorted distribution whose mass reaches top_p."""
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1)
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).clamp(max=vocab)
        kth = sorted_logits.gather(1, (vocab - k).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative <= (1.0 - top_p).unsqueeze(1)
        drop[:, -1] = False  # the most likely token always stays
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def gather_logprobs(logprobs: Tensor, tokens: Tensor, k: int) -> LogprobsTensors:
    sampled = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    ranks = (logprobs > sampled.unsqueeze(1)).sum(-1) + 1
    top_logprobs, top_ids = logprobs.topk(k, dim=-1) if k > 0 else (
        logprobs[:, :0], tokens[:, None][:, :0])
    return LogprobsTensors(top_ids, top_logprobs, sampled, ranks)
