"""LLMEngine: add_request / step / abort_request over scheduler, runner and detokenizer.

Single-threaded by design: a server funnels every call through one loop thread. A request
with n > 1 fans out into n child requests (`<id>#<i>`) whose seeds are derived from the
parent's (seed + i). All children are queued together, so they are usually admitted in
the same step: the KV cache manager indexes a block as soon as the step that writes it is
scheduled, and the attention backends write a step's K/V before attending, so children
after the first hit the first child's prompt blocks in the prefix cache and share them
(only the last, partial block and the generated tokens are per child).

With async scheduling (`EngineConfig.async_scheduling`) a step schedules and launches the
next model step before it waits for the tokens of the one in flight, then processes those
(stop checks, detokenization, outputs) while the GPU runs the new one: the GPU's queue always
holds a step, and the CPU work of a step is hidden behind the GPU's. Requests are scheduled
with placeholders for the tokens in flight (see scheduler.py). Penalties need no host
tokens: the runner keeps their counts on the device (`penalties.py`).

Structured outputs (`pagedserve/structured`): the grammar bitmask of a step needs every
earlier token of its constrained rows. Such a step launches its forward pass, then (async)
completes the step in flight, advancing the matchers, fills the bitmask while the device
computes, and only then launches its sampling. Overlap is kept for the forward pass and the
bitmask work; what is given up is that the step's sampling cannot be queued before the
previous step's tokens are back.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from pagedserve.config import EngineConfig, resolve_batch_limits
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.kv_events import KVEventPublisher
from pagedserve.engine.detokenizer import IncrementalDetokenizer
from pagedserve.engine.model_runner import ModelRunner, ModelRunnerOutput, PendingRunnerOutput
from pagedserve.engine.outputs import (
    CompletionOutput, EngineStats, Logprob, RequestOutput, SampleLogprobs)
from pagedserve.engine.request import Request, RequestStatus
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.scheduler import Scheduler, SchedulerOutput
from pagedserve.model.config import ModelConfig
from pagedserve.model.decoder import Decoder
from pagedserve.model.loader import load_model, load_tokenizer
from pagedserve.native.build import cpu_flags, has_bf16_compute
from pagedserve.structured.manager import StructuredOutputManager


logger = logging.getLogger(__name__)

@dataclass
class _ChildState:
    """Output-side state of one sample: its text, logprobs and what was already reported."""

    request: Request
    index: int
    parent_id: str
    detokenizer: IncrementalDetokenizer
    logprobs: SampleLogprobs | None
    cumulative_logprob: float | None
    num_reported_tokens: int = 0
    detokenize_at_end: bool = False  # final-only and no stop strings: text decoded once


@dataclass
class _ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    final_only: bool = False  # report only the finished output (offline generation)
    children: list[_ChildState] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(c.request.is_finished for c in self.children)


def resolve_device(name: str) -> torch.device:
    """"auto" picks CUDA when there is one; an unavailable device is a ValueError up front
    (a clear message instead of torch's failure deep inside the model's loading)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"unknown device {name!r}: use cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r} is not available: this torch "
                             f"({torch.__version__}) has no CUDA or sees no GPU")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {name!r} is not available: "
                             f"{torch.cuda.device_count()} CUDA device(s)")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def _check_cpu_dtype(dtype: torch.dtype, device: torch.device) -> None:
    """bfloat16 weights on the CPU only where it computes in bfloat16 (AVX-512-BF16 or AMX;
    torch's oneDNN kernels use them); elsewhere refuse, rather than run slower than float32."""
    if device.type == "cpu" and dtype == torch.bfloat16 and not has_bf16_compute(cpu_flags()):
        raise ValueError("--dtype bfloat16 on the CPU needs AVX-512-BF16 or AMX, which this CPU "
                         "does not report; use --dtype auto (a GGUF's fast mode) or float32")


@dataclass
class LoadedModel:
    """Weights, their config and tokenizer; shareable by several engines (read-only)."""

    model: Decoder
    model_config: ModelConfig
    tokenizer: object

    @classmethod
    def load(cls, config: EngineConfig) -> LoadedModel:
        device = resolve_device(config.device)
        _check_cpu_dtype(resolve_dtype(config.dtype, device), device)
        # "auto" on the CPU is the fast mode for a GGUF (its quantized blocks); an explicit
        # "float32" keeps the exact path.
        model, model_config, tokenizer_source = load_model(
            config.model, resolve_dtype(config.dtype, device), device,
            quantized=config.dtype == "auto", quantization=config.quantization)
        return cls(model, model_config, load_tokenizer(config.tokenizer or tokenizer_source))


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        """`loaded` lets tests and benchmarks build engines with other KV budgets or
        scheduling options over one copy of the weights instead of reloading them."""
        self.config = config
        torch.manual_seed(config.seed)
        self.loaded = loaded = loaded or LoadedModel.load(config)
        model, self.model_config, self.tokenizer = loaded.model, loaded.model_config, \
            loaded.tokenizer
        device = next(model.parameters()).device
        self.config = config = _resolve_limits(config, device, model)
        self.model_runner = ModelRunner(config, model, self.model_config, device)
        num_blocks = self.model_runner.determine_num_blocks()
        self.kv_cache_manager = KVCacheManager(
            num_blocks, config.block_size, config.enable_prefix_caching,
            config.prefix_caching_hash_algo, hash_seed=config.prefix_caching_hash_seed,
            sliding_window=self.model_config.kv_window,
            enable_events=config.kv_events_endpoint is not None)
        self.kv_event_publisher = (KVEventPublisher(config.kv_events_endpoint)
                                   if config.kv_events_endpoint is not None else None)
        self.model_runner.initialize_kv_cache(num_blocks)
        self.num_blocks = num_blocks
        self.max_model_len = self._resolve_max_model_len(num_blocks)
        num_cpu_blocks = 0
        if config.preemption_mode == "swap":
            num_cpu_blocks = config.swap_space // self.model_runner.block_bytes
            self.model_runner.initialize_swap_space(num_cpu_blocks)
        self.model_runner.setup(self.max_model_len)
        self.scheduler = Scheduler(config, self.kv_cache_manager, self.max_model_len,
                                   num_cpu_blocks)
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.structured = StructuredOutputManager(self.tokenizer, self.model_config.vocab_size,
                                                  self.eos_token_ids, config.max_num_seqs)
        self._parents: dict[str, _ParentState] = {}
        self._children: dict[str, _ChildState] = {}
        self._aborted_outputs: list[RequestOutput] = []
        self.async_scheduling = (device.type == "cuda" if config.async_scheduling is None
                                 else config.async_scheduling)
        self._in_flight: tuple[SchedulerOutput, PendingRunnerOutput] | None = None
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    @classmethod
    def from_options(cls, model: str | None = None, **options) -> LLMEngine:
        return cls(EngineConfig.from_options(model=model, **options))

    def _resolve_max_model_len(self, num_blocks: int) -> int:
        """The model's limit, or the user's if lower; never more than the cache can hold, so
        any single admitted request can always run to completion alone."""
        model_limit = self.model_config.max_model_len
        wanted = self.config.max_model_len or model_limit
        if wanted > model_limit:
            raise ValueError(f"max_model_len={wanted} exceeds the model's limit of {model_limit}")
        return min(wanted, (num_blocks - 1) * self.config.block_size)

    # -- requests -----------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | None, params: SamplingParams,
                    prompt_token_ids: list[int] | None = None,
                    arrival_time: float | None = None, cache_salt: str | None = None,
                    final_only: bool = False) -> None:
        """Validate and queue; raises ValueError (taking no block) when the request is bad.

        `cache_salt` isolates the prefix cache: requests share cached blocks only when their
        salts are equal (it is hashed into the first block, so it reaches the whole chain).
        `final_only`: step() reports the request only once it has finished, and its text is
        decoded once at the end unless stop strings need it token by token; per-token output
        work is what limits a GPU step at large batch.
        """
        if request_id in self._parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        token_ids = self._prompt_token_ids(prompt, prompt_token_ids)
        max_tokens = self._check_lengths(len(token_ids), params)
        self._check_logit_bias(params)
        self.structured.validate(params)
        parent = _ParentState(request_id, prompt, token_ids, final_only)
        arrival = time.time() if arrival_time is None else arrival_time
        for index in range(params.n):
            child_params = params
            if params.n > 1:
                seed = None if params.seed is None else params.seed + index
                child_params = dataclasses.replace(params, n=1, seed=seed)
            child_id = request_id if params.n == 1 else f"{request_id}#{index}"
            request = Request(child_id, token_ids, child_params, max_tokens,
                              self.eos_token_ids, arrival, cache_salt=cache_salt)
            child = self._child_state(request, index, request_id)
            child.detokenize_at_end = final_only and not params.stop_strings
            parent.children.append(child)
        taken = [c.request.request_id for c in parent.children
                 if c.request.request_id in self._children]
        if taken:
            raise ValueError(f"request id(s) {taken} are already in use")
        self._parents[request_id] = parent
        for child in parent.children:
            self._children[child.request.request_id] = child
            self.structured.add_request(child.request)
            self.scheduler.add_request(child.request)

    def _prompt_token_ids(self, prompt: str | None, prompt_token_ids: list[int] | None
                          ) -> list[int]:
        if prompt_token_ids is None:
            if prompt is None:
                raise ValueError("give a prompt or prompt_token_ids")
            prompt_token_ids = self.tokenizer.encode(prompt)
        token_ids = [int(t) for t in prompt_token_ids]
        if not token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        return token_ids

    def _check_logit_bias(self, params: SamplingParams) -> None:
        vocab = self.model_config.vocab_size
        bad = [t for t in params.logit_bias or {} if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"logit_bias token ids {bad[:5]} are outside the vocabulary "
                             f"[0, {vocab})")

    def _check_lengths(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """Returns max_tokens resolved against max_model_len."""
        limit = self.max_model_len
        if num_prompt_tokens >= limit:
            raise ValueError(f"the prompt has {num_prompt_tokens} tokens but max_model_len is "
                             f"{limit}: it must leave room for at least one new token")
        if params.max_tokens is None:
            return limit - num_prompt_tokens
        if num_prompt_tokens + params.max_tokens > limit:
            raise ValueError(f"prompt ({num_prompt_tokens} tokens) + max_tokens "
                             f"({params.max_tokens}) exceeds max_model_len={limit}")
        return params.max_tokens

    def _child_state(self, request: Request, index: int, parent_id: str) -> _ChildState:
        params = request.sampling_params
        detokenizer = IncrementalDetokenizer(
            self.tokenizer, request.prompt_token_ids, params.stop_strings,
            params.include_stop_str_in_output, params.skip_special_tokens)
        wants_logprobs = params.logprobs is not None
        return _ChildState(request, index, parent_id, detokenizer, [] if wants_logprobs else None,
                           0.0 if wants_logprobs else None)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Finish requests at once, freeing their blocks; the next step() reports them."""
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        for request_id in request_ids:
            parent = self._parents.get(request_id)
            if parent is None:
                continue
            running = [c.request.request_id for c in parent.children
                       if not c.request.is_finished]
            self.scheduler.finish_requests(running, RequestStatus.FINISHED_ABORTED)
            self._aborted_outputs.append(self._make_output(parent))
            self._drop(parent)

    def has_unfinished_requests(self) -> bool:
        """True while a step is in flight too: its results must be collected (or dropped)."""
        return bool(self._parents) or bool(self._aborted_outputs) or self._in_flight is not None

    # -- the step -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule and launch a model step; return the outputs of requests that progressed.

        Synchronous: the outputs of the step just launched. Async: those of the step that
        was in flight, processed while the new one runs.
        """
        outputs, self._aborted_outputs = self._aborted_outputs, []
        scheduler_output = self.scheduler.schedule()
        step = None
        if not scheduler_output.is_empty or scheduler_output.finished_req_ids:
            # an empty step still tells the runner which requests finished (their state goes)
            step = (scheduler_output, self._execute(scheduler_output, outputs))
        if self.async_scheduling:  # complete the step in flight, leave the new one running
            step, self._in_flight = self._in_flight, step
        if step is not None:
            outputs += self._complete(*step)
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.publish(self.kv_cache_manager.block_pool.take_events())
        return outputs

    def _execute(self, scheduler_output: SchedulerOutput,
                 outputs: list[RequestOutput]) -> PendingRunnerOutput:
        """Launch the step; a step with constrained rows is sampled once their bitmask is
        filled, after the step in flight (if any) has delivered its tokens into `outputs`."""
        pending = self.model_runner.execute_model(scheduler_output, self.kv_cache_manager)
        if pending is None:
            if self._in_flight is not None:
                previous, self._in_flight = self._in_flight, None
                outputs += self._complete(*previous)
            sampling_ids = [r.request_id for (r, _), s in
                            zip(scheduler_output.scheduled, scheduler_output.samples) if s]
            pending = self.model_runner.sample_tokens(
                self.structured.grammar_bitmask(sampling_ids))
        return pending

    def _complete(self, scheduler_output: SchedulerOutput,
                  pending: PendingRunnerOutput) -> list[RequestOutput]:
        """Wait for a step's tokens, hand them to the scheduler, build the outputs."""
        outputs = []
        runner_output = pending.result()
        req_ids = runner_output.req_ids
        progressed = self.scheduler.update_from_output(
            scheduler_output, dict(zip(req_ids, runner_output.sampled_token_ids)))
        if self.structured.has_requests():
            self.structured.accept_tokens(progressed)
        rows = (dict(zip(req_ids, range(len(req_ids))))
                if runner_output.logprobs is not None else {})
        self.generation_tokens_total += len(progressed)
        touched: dict[str, _ParentState] = {}  # ordered: the parents to report
        now = time.time()
        for request in progressed:
            child = self._children[request.request_id]
            self._process_token(child, runner_output, rows, now)
            parent = self._parents[child.parent_id]
            # a final-only parent is looked at only when one of its children finishes
            if not parent.final_only or request.is_finished:
                touched[child.parent_id] = parent
        for parent in touched.values():
            if parent.final_only and not parent.finished:
                continue
            outputs.append(self._make_output(parent))
            if parent.finished:
                self._drop(parent)
        return outputs

    def _process_token(self, child: _ChildState, runner_output: ModelRunnerOutput,
                       rows: dict[str, int], now: float) -> None:
        """Per token per request: logprobs, text, stop strings. `rows`: the runner output's
        row of each request, built only when the step returned logprobs."""
        request = child.request
        token = request.output_token_ids[-1]
        if request.metrics.first_token_time is None:
            request.metrics.first_token_time = now
            if child.index == 0:  # a prompt counts once, however many samples share it
                self.prompt_tokens_total += request.num_prompt_tokens
        if child.logprobs is not None:
            self._append_logprobs(child, runner_output, rows[request.request_id], token)
        if child.detokenize_at_end:
            if request.is_finished:
                child.detokenizer.update_at_once(request.output_token_ids)
            return
        stop = child.detokenizer.update([token])
        if stop is not None and not request.is_finished:
            request.stop_reason = stop
            self.scheduler.finish_requests(request.request_id, RequestStatus.FINISHED_STOPPED)

    def _append_logprobs(self, child: _ChildState, runner_output: ModelRunnerOutput, row: int,
                         token: int) -> None:
        lp = runner_output.logprobs
        k = child.request.sampling_params.logprobs
        ids = lp.top_token_ids[row, :k].tolist()
        values = lp.top_logprobs[row, :k].tolist()
        entry = {t: Logprob(v, rank + 1, self.tokenizer.decode([t]))
                 for rank, (t, v) in enumerate(zip(ids, values))}
        sampled_logprob = float(lp.sampled_logprobs[row])
        entry.setdefault(token, Logprob(sampled_logprob, int(lp.sampled_ranks[row]),
                                        self.tokenizer.decode([token])))
        child.logprobs.append(entry)
        child.cumulative_logprob += sampled_logprob

    def _make_output(self, parent: _ParentState) -> RequestOutput:
        completions = [self._completion(child) for child in parent.children]
        first = parent.children[0].request
        return RequestOutput(
            request_id=parent.request_id, prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids, outputs=completions,
            finished=parent.finished, metrics=first.metrics,
            num_cached_tokens=first.metrics.num_cached_tokens)

    def _completion(self, child: _ChildState) -> CompletionOutput:
        request = child.request
        reason = request.finish_reason
        token_ids = list(request.output_token_ids)
        delta_ids = token_ids[child.num_reported_tokens:]
        child.num_reported_tokens = len(token_ids)
        return CompletionOutput(
            index=child.index, text=child.detokenizer.output_text, token_ids=token_ids,
            cumulative_logprob=child.cumulative_logprob,
            logprobs=list(child.logprobs) if child.logprobs is not None else None,
            finish_reason=reason.value if reason is not None else None,
            stop_reason=request.stop_reason,
            text_delta=child.detokenizer.take_delta(request.is_finished),
            token_ids_delta=delta_ids)

    def _drop(self, parent: _ParentState) -> None:
        self._parents.pop(parent.request_id, None)
        for child in parent.children:
            self._children.pop(child.request.request_id, None)
            self.structured.remove_request(child.request.request_id)

    # -- introspection ------------------------------------------------------------------------

    def get_stats(self) -> EngineStats:
        stats = self.kv_cache_manager.prefix_cache_stats
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.kv_cache_manager.usage, prefix_cache_queries=stats.queries,
            prefix_cache_hits=stats.hits, num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_evictions=self.kv_cache_manager.block_pool.num_evictions,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            num_gpu_blocks=self.num_blocks)


def _resolve_limits(config: EngineConfig, device: torch.device, model: Decoder) -> EngineConfig:
    """The config with max_num_seqs / max_num_batched_tokens chosen for this device and
    model where they were left to auto (None); logged once."""
    if config.max_num_seqs is not None and config.max_num_batched_tokens is not None:
        return config
    total_memory = None
    if device.type == "cuda":
        total_memory = torch.cuda.get_device_properties(device).total_memory
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    max_num_seqs, max_num_batched_tokens = resolve_batch_limits(
        config, device.type, total_memory, weight_bytes)
    logger.info("batch limits for %s: max_num_seqs=%d, max_num_batched_tokens=%d",
                device, max_num_seqs, max_num_batched_tokens)
    return dataclasses.replace(config, max_num_seqs=max_num_seqs,
                               max_num_batched_tokens=max_num_batched_tokens)
