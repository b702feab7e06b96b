"""EngineCore: the scheduler, the KV cache manager and the model runner, stepped together.

It takes tokenized requests (`EngineCoreRequest`) and returns, once per model step, the new
token ids of every request that progressed (`EngineCoreOutputs`): plain data, no text. All
text work (detokenization, stop strings, logprob token strings) is the frontend's
(`output_processor.py`), so the core can run in a process of its own, where nothing but
scheduling and launching model steps competes for its interpreter.

Token-level stops (EOS, stop token ids, max_tokens, max_model_len) are decided here, by the
scheduler; a stop string is found by the frontend, which then aborts the core request.

A step reads top to bottom (`step`): schedule -> execute (the forward pass) -> the grammar
bitmask, if a sampling row is constrained -> sample -> update (the scheduler takes the
tokens; the outputs are built).

With async scheduling (`EngineConfig.async_scheduling`) `step_pipelined` runs instead: it
takes the step in flight as an argument (`executor.InFlightStep`), launches the next step
before it waits for that one's tokens, processes those while the device runs the new one,
and returns the new one: the device's queue always holds a step, and the CPU work of a step
hides behind the device's. Requests are scheduled with placeholders for the tokens in
flight (see scheduler.py). Penalties need no host tokens: the runner keeps their counts on
the device (`penalties.py`).

Structured outputs (`pagedserve/structured`): a constrained request's grammar compiles in
the background (seconds for a large schema, which would stall every running request if it
ran here); the request waits in the queue (`WAITING_FOR_GRAMMAR`) while the others are
scheduled, and each step first takes the compiles that finished (`_take_compiled`: ready
requests become schedulable, failed ones finish with an error). The grammar bitmask of a
step needs every earlier token of its constrained rows, and the grammar work runs on the
manager's worker threads (or process). Synchronous, the workers advance the matchers while
the step's outputs are processed and the next one is scheduled and launched, and the
bitmask is filled while the device runs the forward pass. Async, a step with constrained
rows launches its forward pass, completes the step in flight and hands its tokens and the
new step's rows to the workers (advance the matchers, fill the rows), and stays in flight
unsampled: the workers fill while this thread builds the outputs, the frontend processes
them and the next step is scheduled; that step's `execute_model` does its host work, then
samples this one under its bitmask, then launches its own forward pass, which reads the
sampled tokens.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable
from typing import Any

import torch

from pagedserve.config import EngineConfig, resolve_batch_limits
from pagedserve.device.executor import (
    Executor, InFlightStep, MultiprocExecutor, PendingOutput, UniprocExecutor)
from pagedserve.device.loading import LoadedModel
from pagedserve.device.model_runner import ModelRunner
from pagedserve.engine.recall_rule import recall_rule
from pagedserve.engine.request import FINISH_REASON_VALUES, Request, RequestStatus
from pagedserve.engine.scheduler import Scheduler
from pagedserve.engine.startup import StartupPhases
from pagedserve.engine.tiers import build_tiers
from pagedserve.kv_cache.kv_cache_manager import KVCacheManager
from pagedserve.kv_cache.kv_events import KVEventPublisher
from pagedserve.messages import (
    EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, KVCacheSpec, LogprobsLists,
    ModelRunnerOutput, SchedulerOutput, SchedulerStats, TokenLogprobs)
from pagedserve.model.config import ModelConfig
from pagedserve.model.loader import read_model_config, tokenizer_source
from pagedserve.model.tokenizer_ref import TokenizerRef
from pagedserve.spec.config import SpeculativeConfig
from pagedserve.spec.ngram import NgramProposer, Proposer
from pagedserve.structured.grammar import GrammarCache
from pagedserve.structured.manager import StructuredOutputManager
from pagedserve.structured.remote import GrammarProcess

logger = logging.getLogger(__name__)


def _structured_outputs(config: EngineConfig, executor: Executor, tokenizer: Any,
                        tokenizer_source: str, model_config: ModelConfig,
                        eos_token_ids: frozenset[int]
                        ) -> StructuredOutputManager | GrammarProcess:
    """The matchers in a process of their own (`grammar_process`, by default on a GPU,
    where the engine thread is the step's critical path) or in this one (on the CPU, where
    the forward pass keeps every core busy and the work is done inline)."""
    on_gpu = executor.device_type == "cuda"
    # pinned for an in-process runner on CUDA to upload
    pin = isinstance(executor, UniprocExecutor) and on_gpu
    separate = on_gpu if config.grammar_process is None else config.grammar_process
    rows = config.max_num_seqs  # bitmask rows: a verify's k + 1 each (speculation)
    spec = config.speculative_config
    if spec is not None:
        rows += min(rows, spec.disable_by_batch_size) * spec.num_speculative_tokens
    if separate:
        return GrammarProcess(tokenizer, tokenizer_source, model_config.vocab_size,
                              eos_token_ids, rows, pin_memory=pin)
    return StructuredOutputManager(tokenizer, model_config.vocab_size, eos_token_ids,
                                   rows, pin_memory=pin, device_type=executor.device_type)


class EngineCore:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        """`loaded` lets tests and benchmarks build engines with other KV budgets or
        scheduling options over one copy of the weights instead of reloading them (one
        process only: tensor-parallel workers load their own shards)."""
        torch.manual_seed(config.seed)
        phases = StartupPhases()
        if loaded is None and config.tensor_parallel_size == 1:
            # the core needs only the tokenizer's size and EOS id: no transformers import
            loaded = LoadedModel.load(config, phases.timed, TokenizerRef.read)
        self.loaded = loaded
        with phases.timed("weights"):  # the ranks' (tensor parallelism)
            self.executor = executor = _make_executor(config, loaded)
        try:
            self._setup(config, executor, phases)
        except BaseException:
            executor.shutdown()
            raise
        logger.info("engine core started in %s", phases)
        # async scheduling: the step launched by the last `step()`, handed to the next one
        self.in_flight: InFlightStep | None = None
        self.step_times = StepTimes()

    def _setup(self, config: EngineConfig, executor: Executor, phases: StartupPhases) -> None:
        self.model_config = executor.model_config
        if self.loaded is not None:
            self.tokenizer = self.loaded.tokenizer
            self.tokenizer_source = self.loaded.tokenizer_source
        else:  # the workers load the weights
            with phases.timed("tokenizer"):
                self.tokenizer_source = tokenizer_source(config.model, config.tokenizer)
                self.tokenizer = TokenizerRef.read(self.tokenizer_source)
        self.config = config = _resolve_admission(_resolve_limits(config, executor),
                                                  executor.device_type)
        with phases.timed("memory profile"):
            self.num_blocks = num_blocks = executor.determine_num_blocks(config)
        self.kv_cache_manager = KVCacheManager(
            num_blocks, config.block_size, config.enable_prefix_caching,
            config.prefix_caching_hash_algo, hash_seed=config.prefix_caching_hash_seed,
            sliding_window=self.model_config.kv_window,
            enable_events=config.kv_events_endpoint is not None,
            record_evictions=bool(config.kv_offload_memory or config.kv_offload_path))
        self.kv_event_publisher = (
            KVEventPublisher(config.kv_events_endpoint, config.kv_events_replay_endpoint)
            if config.kv_events_endpoint is not None else None)
        self.max_model_len = self._resolve_max_model_len(num_blocks)
        num_cpu_blocks = 0
        if config.preemption_mode == "swap":
            num_cpu_blocks = config.swap_space // executor.block_bytes
        tiers = build_tiers(config, executor, self.model_config, self.max_model_len,
                            config.kv_events_endpoint is not None)
        with phases.timed("kv cache + sampler warm-up + cuda graphs + tier costs"):
            tier_costs = executor.initialize(KVCacheSpec(
                num_blocks, num_cpu_blocks, self.max_model_len,
                tiers.host.num_slots if tiers.host is not None else 0, tiers.disk_dir,
                tiers.digest))
        self.scheduler = Scheduler(config, self.kv_cache_manager, self.max_model_len,
                                   num_cpu_blocks, tiers.host,
                                   _proposer(config.speculative_config), tiers.disk,
                                   recall_rule(tier_costs, config.block_size,
                                               self.max_model_len))
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        with phases.timed("grammar backend"):
            self.structured = _structured_outputs(config, executor, self.tokenizer,
                                                  self.tokenizer_source, self.model_config,
                                                  self.eos_token_ids)
        self.async_scheduling = _async_scheduling(config, executor.device_type)
        self._prompt_logprobs: dict[str, LogprobsLists] = {}  # until each request's first token

    @property
    def model_runner(self) -> ModelRunner:
        """The in-process runner (tensor_parallel_size 1 only: otherwise each rank has one)."""
        runner = getattr(self.executor, "model_runner", None)
        if runner is None:
            raise AttributeError("a tensor-parallel engine has no model runner in this "
                                 "process: each worker has its own")
        return runner

    @property
    def grammars(self) -> GrammarCache:
        """The structured-output matchers' grammar cache (the Processor checks specs with it)."""
        return self.structured.grammars

    def check_health(self) -> None:
        """Raise ExecutorError if a tensor-parallel worker has died (a no-op in one process)."""
        self.executor.check_health()

    def shutdown(self) -> None:
        try:
            self.structured.shutdown()
        finally:
            self.executor.shutdown()

    def _resolve_max_model_len(self, num_blocks: int) -> int:
        """The model's limit, or the user's if lower; never more than the cache can hold, so
        any single admitted request can always run to completion alone."""
        model_limit = self.model_config.max_model_len
        wanted = self.config.max_model_len or model_limit
        if wanted > model_limit:
            raise ValueError(f"max_model_len={wanted} exceeds the model's limit of {model_limit}")
        return min(wanted, (num_blocks - 1) * self.config.block_size)

    # -- requests -----------------------------------------------------------------------------

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request the frontend has validated (`processor.py`); max_tokens None means
        up to max_model_len."""
        params = request.sampling_params
        num_prompt = len(request.prompt_token_ids)
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = self.max_model_len - num_prompt
        core_request = Request(
            request.request_id, request.prompt_token_ids, params, max_tokens,
            self.eos_token_ids, request.arrival_time, cache_salt=request.cache_salt,
            lora_request=request.lora_request)
        self.scheduler.add_request(core_request)  # first: it refuses an id in use
        if params.structured_outputs is not None:  # compiled in the background: see step
            core_request.status = RequestStatus.WAITING_FOR_GRAMMAR
            self.structured.add_request(core_request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Finish requests at once, freeing their blocks; unknown ids are ignored. An aborted
        request gets no further output."""
        request_ids = list(request_ids)
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        for request_id in request_ids:
            self.structured.remove_request(request_id)
            self._prompt_logprobs.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        """True while a step is in flight too: its results must be collected (or dropped)."""
        return self.scheduler.has_unfinished_requests() or self.in_flight is not None

    def waits_for_grammars_only(self) -> bool:
        """Every unfinished request waits for its grammar to compile: a step now would
        schedule nothing (a busy loop may sleep a little instead of spinning)."""
        scheduler = self.scheduler
        return (self.in_flight is None and not scheduler.running and bool(scheduler.waiting)
                and all(r.status == RequestStatus.WAITING_FOR_GRAMMAR
                        for r in scheduler.waiting))

    # -- the step -----------------------------------------------------------------------------

    def step(self) -> EngineCoreOutputs:
        """Schedule, execute, sample and return the tokens of the requests that progressed.

        With async scheduling, `step_pipelined` from the step in flight: the tokens are
        those of the step the previous call launched. Under speculative decoding, while
        the batch is small enough to draft for (`Scheduler.may_draft`) the step in flight
        is completed first and the step runs synchronously: a verify's outcome decides
        where its request's next step starts, and a proposer on the device drafts from the
        tokens of the step before. A large batch, where nothing is drafted, keeps the
        pipeline (a proposer on the device still runs over each step's chunks, once its
        tokens are back, to keep its KV)."""
        outputs: list[EngineCoreOutput] = []
        if self.async_scheduling:
            if not self.scheduler.may_draft():
                outputs, self.in_flight = self.step_pipelined(self.in_flight)
                return outputs
            if self.in_flight is not None:  # drain: a verify needs every token known
                outputs = self._complete(self.executor.sample_awaiting(self.in_flight))
                self.in_flight = None
        return self._step_synchronously(outputs)

    def _step_synchronously(self, outputs: list[EngineCoreOutput]) -> EngineCoreOutputs:
        """A step with nothing in flight: schedule (drafts included), execute, sample and
        update; `outputs` (those of a step just completed) go out first."""
        failed = self._take_compiled()
        scheduler_output = self.scheduler.schedule()
        if not scheduler_output.is_empty:  # finished ids alone still reach the runner
            step, _ = self.executor.execute_model(scheduler_output)
            self.step_times.steps += 1
            rows = self._grammar_rows(scheduler_output, 0)
            grammar = (self.structured.grammar_bitmask(rows, scheduler_output.draft_token_ids)
                       if rows is not None else None)
            tokens = self.executor.sample_tokens(step, grammar)
            outputs = outputs + self._update(scheduler_output, self._result(tokens))
        return self._step_outputs(failed + outputs)

    def step_pipelined(self, in_flight: InFlightStep | None
                       ) -> tuple[EngineCoreOutputs, InFlightStep | None]:
        """Launch the next step, then complete `in_flight` (launched by the previous call)
        while the device runs the new one; return its outputs and the new step in flight.

        A step with constrained rows is not sampled at its launch: its bitmask needs the
        tokens of the step in flight, which are completed first and handed to the grammar
        workers with the new rows to fill. It is returned unsampled, and the next call's
        `execute_model` samples it (see the module docstring)."""
        failed = self._take_compiled()
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:  # nothing to launch: complete the step in flight
            previous = self.executor.sample_awaiting(in_flight) if in_flight else None
            return self._step_outputs(failed + self._complete(previous)), None
        step, previous = self.executor.execute_model(scheduler_output, in_flight)
        self.step_times.steps += 1
        rows = self._grammar_rows(scheduler_output, 1)
        if rows is None:
            launched = InFlightStep(scheduler_output, step, self.executor.sample_tokens(step))
        else:  # sampled by the next call, under the bitmask `previous`'s tokens lead to
            launched = InFlightStep(scheduler_output, step, bitmask=self.structured.take_bitmask)
        return self._step_outputs(failed + self._complete(previous, rows)), launched

    def _take_compiled(self) -> list[EngineCoreOutput]:
        """Let the requests whose grammar has compiled be scheduled; finish those whose
        compile failed (they hold no block yet), returning their final outputs."""
        if not self.structured.has_compiles():
            return []
        ready, failed = self.structured.take_compiled()
        self.scheduler.grammars_ready(ready)
        outputs = []
        for request_id, error in failed:
            if request_id not in self.scheduler.requests:
                continue  # aborted meanwhile
            logger.error("request %s: its grammar failed to compile: %s", request_id, error)
            self.scheduler.finish_requests(request_id, RequestStatus.FINISHED_ERROR)
            outputs.append(EngineCoreOutput(
                request_id, [], finish_reason=FINISH_REASON_VALUES[RequestStatus.FINISHED_ERROR],
                error=error))
        return outputs

    def _complete(self, step: InFlightStep | None,
                  next_rows: list[str] | None = None) -> list[EngineCoreOutput]:
        """Wait for a sampled step's tokens and `_update` from them; the grammar workers get
        `next_rows` to fill after them (with no step, at once)."""
        if step is None:
            if next_rows is not None:
                self.structured.submit((), next_rows)
            return []
        return self._update(step.scheduler_output, self._result(step.tokens), next_rows)

    def _result(self, tokens: PendingOutput) -> ModelRunnerOutput:
        """A sampled step's tokens, the wait for them counted (`StepTimes`)."""
        start = time.perf_counter()
        output = tokens.result()
        self.step_times.waited(time.perf_counter() - start, output)
        return output

    def _grammar_rows(self, scheduler_output: SchedulerOutput,
                      num_unseen: int) -> list[str] | None:
        """The step's sampling rows if one of them is under a grammar (the manager knows),
        or may be once the `num_unseen` tokens in flight (async: 1) are known (a grammar
        that starts after a think block's end): then the step is sampled under their
        bitmask."""
        structured = self.structured
        if not structured.has_requests():
            return None
        rows = scheduler_output.sampling_req_ids
        return rows if any(structured.is_constrained(r, num_unseen) for r in rows) else None

    def _step_outputs(self, outputs: list[EngineCoreOutput]) -> EngineCoreOutputs:
        if self.kv_event_publisher is not None:
            events = self.kv_cache_manager.block_pool.take_events()
            for tier in (self.scheduler.host_tier, self.scheduler.disk_tier):
                if tier is not None:
                    events += tier.take_events()
            self.kv_event_publisher.publish(events)
        return EngineCoreOutputs(outputs, self.make_stats(), time.time())

    def _update(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput,
                next_rows: list[str] | None = None) -> list[EngineCoreOutput]:
        """Hand a step's tokens to the scheduler and build the outputs of the requests that
        progressed. The tokens go to the grammar workers, with the rows of the next step to
        fill if given."""
        if runner_output.prompt_logprobs:
            self._collect_prompt_logprobs(runner_output.prompt_logprobs)
        progressed = self.scheduler.update_from_output(scheduler_output, runner_output)
        structured = self.structured
        if next_rows is not None or structured.has_requests():
            num_new = ([n for _, n in progressed] if runner_output.accepted_token_ids
                       else None)
            structured.submit([request for request, _ in progressed], next_rows,
                              num_new=num_new)
        rows = _logprobs_rows(runner_output) if runner_output.logprobs is not None else None
        outputs = []
        append = outputs.append
        for request, num_new in progressed:  # per request at every step: attribute reads
            logprobs = None
            if rows is not None and request.sampling_params.logprobs is not None:
                first, k = rows[request.request_id], request.sampling_params.logprobs
                logprobs = [_token_logprobs(runner_output, first + j, k)
                            for j in range(num_new)]
            finish_reason = FINISH_REASON_VALUES.get(request.status)
            if finish_reason is not None and structured.has_requests():
                structured.remove_request(request.request_id)
            prompt_logprobs = None
            if self._prompt_logprobs and request.request_id in self._prompt_logprobs:
                prompt_logprobs = self._prompt_logprobs.pop(request.request_id)
            append(EngineCoreOutput(
                request.request_id,
                [request.all_token_ids[-1]] if num_new == 1 else
                request.all_token_ids[-num_new:], logprobs,
                finish_reason, request.stop_reason, request.num_cached_tokens,
                prompt_logprobs))
        return outputs

    def _collect_prompt_logprobs(self, chunks: dict[str, LogprobsLists]) -> None:
        """Keep a prefill chunk's prompt logprobs until the request's first token, which
        carries them all to the frontend."""
        kept = self._prompt_logprobs
        for req_id, chunk in chunks.items():
            if req_id not in self.scheduler.requests:
                continue  # aborted while the step was in flight
            if req_id not in kept:
                kept[req_id] = chunk
                continue
            lists = kept[req_id]
            lists.top_token_ids += chunk.top_token_ids
            lists.top_logprobs += chunk.top_logprobs
            lists.sampled_logprobs += chunk.sampled_logprobs
            lists.sampled_ranks += chunk.sampled_ranks

    # -- introspection ------------------------------------------------------------------------

    def make_stats(self) -> SchedulerStats:
        manager, scheduler = self.kv_cache_manager, self.scheduler
        prefix = manager.prefix_cache_stats
        return SchedulerStats(
            num_running=len(scheduler.running), num_waiting=len(scheduler.waiting),
            kv_cache_usage=manager.usage, prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits, num_preemptions=scheduler.num_preemptions,
            num_gpu_blocks=self.num_blocks,
            prefix_cache_evictions=manager.block_pool.num_evictions,
            num_blocks_swapped_out=scheduler.num_blocks_swapped_out,
            num_blocks_swapped_in=scheduler.num_blocks_swapped_in,
            spec_num_drafts=scheduler.spec_stats.num_drafts,
            spec_num_draft_tokens=scheduler.spec_stats.num_draft_tokens,
            spec_num_accepted_tokens=scheduler.spec_stats.num_accepted_tokens,
            spec_accepted_per_position=list(scheduler.spec_stats.accepted_per_position),
            kv_block_bytes=self.executor.block_bytes,
            schedule_seconds=scheduler.schedule_seconds,
            num_steps=self.step_times.steps,
            step_wait_seconds=self.step_times.wait_seconds,
            device_wait_seconds=self.step_times.device_wait_seconds,
            device_seconds=self.step_times.device_seconds,
            num_decode_graph_steps=self.step_times.decode_graph_steps,
            num_verify_graph_steps=self.step_times.verify_graph_steps,
            **_tier_stats(scheduler))


def _async_scheduling(config: EngineConfig, device_type: str) -> bool:
    """The user's choice, else on for CUDA. Under speculative decoding the steps that may
    draft run synchronously (`step`), the others pipelined."""
    if config.async_scheduling is not None:
        return config.async_scheduling
    return device_type == "cuda"


def _proposer(config: SpeculativeConfig | None) -> Proposer | None:
    """The host's drafts of the configured method (None: no speculation, or a proposer on
    the device, which the runner runs: device/drafter.py)."""
    if config is None or config.on_device:
        return None
    return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)


@dataclasses.dataclass
class StepTimes:
    """Where the steps' time goes, since start: a step whose tokens were ready when the
    core asked (its device wait near zero) was bound by host work, not by the device."""

    steps: int = 0  # steps that launched a forward pass
    wait_seconds: float = 0.0  # the core blocked on a step's tokens
    device_wait_seconds: float = 0.0  # of which the runner (rank 0) blocked on the device
    device_seconds: float = 0.0  # the device's time on the steps (CUDA)
    decode_graph_steps: int = 0  # sampled steps that replayed a decode graph
    verify_graph_steps: int = 0  # and a verify graph (k + 1 tokens a request)

    def waited(self, seconds: float, output: ModelRunnerOutput) -> None:
        self.wait_seconds += seconds
        self.device_wait_seconds += output.device_wait_seconds
        self.device_seconds += output.device_seconds
        self.decode_graph_steps += output.graph_query_len == 1
        self.verify_graph_steps += output.graph_query_len > 1


def _tier_stats(scheduler: Scheduler) -> dict[str, int | float]:
    host, disk = scheduler.host_tier, scheduler.disk_tier
    stats: dict[str, int | float] = {}
    if host is not None:
        stats.update(host_tier_hits=scheduler.num_blocks_recalled,
                     host_tier_stores=host.stats.stores, host_tier_evictions=host.stats.evictions,
                     host_tier_declined=scheduler.num_recalls_declined,
                     tier_copy_seconds=scheduler.tier_copy_seconds,
                     tier_stream_seconds=scheduler.tier_stream_seconds,
                     tier_recall_pass_overs=scheduler.num_recall_pass_overs,
                     tier_offload_steps=scheduler.num_offload_steps)
    if disk is not None:
        stats.update(disk_tier_hits=scheduler.num_blocks_loaded,
                     disk_tier_stores=disk.stats.stores, disk_tier_evictions=disk.stats.evictions,
                     disk_tier_load_failures=scheduler.num_failed_loads)
    return stats


def _logprobs_rows(runner_output: ModelRunnerOutput) -> dict[str, int]:
    """Each request's first row of the step's logprobs: one row per token it received (a
    verified request's accepted drafts, then its sampled token)."""
    accepted = runner_output.accepted_token_ids
    if accepted is None:
        return dict(zip(runner_output.req_ids, range(len(runner_output.req_ids))))
    rows, first = {}, 0
    for req_id, drafts in zip(runner_output.req_ids, accepted):
        rows[req_id] = first
        first += len(drafts) + 1
    return rows


def _token_logprobs(runner_output: ModelRunnerOutput, row: int, k: int) -> TokenLogprobs:
    lp = runner_output.logprobs
    return TokenLogprobs(lp.top_token_ids[row][:k], lp.top_logprobs[row][:k],
                         lp.sampled_logprobs[row], lp.sampled_ranks[row])


def _make_executor(config: EngineConfig, loaded: LoadedModel | None) -> Executor:
    """One process over `loaded` (which tensor_parallel_size 1 always has), or the ranks."""
    if config.tensor_parallel_size == 1:
        return UniprocExecutor(loaded.model, loaded.model_config)
    if loaded is not None:
        raise ValueError("tensor_parallel_size > 1 loads the weights in each worker: "
                         "an engine cannot share loaded weights then")
    return MultiprocExecutor(config, read_model_config(config.model))


def _resolve_admission(config: EngineConfig, device_type: str) -> EngineConfig:
    """The config with admission_interval chosen where it was left to auto (None): held
    admissions pay only where a decode step replays a CUDA graph and a step with a prefill
    does not (on the CPU every step runs eagerly alike)."""
    if config.admission_interval is not None:
        return config
    graphs = device_type == "cuda" and not config.enforce_eager
    return dataclasses.replace(config, admission_interval=16 if graphs else 1)


def _resolve_limits(config: EngineConfig, executor: Executor) -> EngineConfig:
    """The config with max_num_seqs / max_num_batched_tokens chosen for this device and
    model where they were left to auto (None); logged once."""
    if config.max_num_seqs is not None and config.max_num_batched_tokens is not None:
        return config
    total_memory, weight_bytes = executor.memory_info()
    max_num_seqs, max_num_batched_tokens = resolve_batch_limits(
        config, executor.device_type, total_memory, weight_bytes)
    logger.info("batch limits for %s: max_num_seqs=%d, max_num_batched_tokens=%d",
                executor.device_type, max_num_seqs, max_num_batched_tokens)
    return dataclasses.replace(config, max_num_seqs=max_num_seqs,
                               max_num_batched_tokens=max_num_batched_tokens)
