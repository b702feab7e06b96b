"""ModelRunner: owns the device tensors (weights, KV cache) and turns a SchedulerOutput into
sampled tokens.

It is driven by plain data only (`messages.SchedulerOutput`): it keeps its own state per
request (`input_batch.CachedRequestState`: prompt, the tokens it sampled, sampling
parameters, generator) and its own block-table rows, introduced by `NewRequestData` and
updated with the block ids each step allocated, so it reads no scheduler object and could
run in another process. Its result is plain data too (`messages.ModelRunnerOutput`).

Per step it builds every input in one go with numpy (no per-token Python loop) into
persistent host buffers, uploaded without blocking (`input_batch.py`): input preparation
must stay far below a step's GPU time. Only the last token of each request whose chunk
reaches the end of its scheduled tokens goes through the LM head and the sampler. On CUDA,
decode-only steps, and steps whose requests all verify k drafts, replay a captured graph
(`cuda_graphs.py`).

A step is three calls, each taking the value the one before returned, so nothing about a
step waits in the runner between them: `prepare_step` (the runner's request states, swaps,
the input buffers and their uploads: host work) -> `launch` (the forward pass and the LM
head, queued) -> `sample_tokens` (under a grammar bitmask if the step has constrained rows).
The executor (`executor.py`) composes them into its two verbs.

Nothing in a step waits for the GPU: the sampled tokens come back through a non-blocking
copy to pinned memory and an event (`PendingRunnerOutput`), so the engine can schedule and
launch the next step before it waits for them (async scheduling). A token scheduled before
it was known (a placeholder, see `request.py`) is the one the previous step sampled for the
same request: `launch` is given that step's pending output and copies the token from its
sampled tensor into the step's input ids on the device.
"""

from __future__ import annotations

import os
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from itertools import chain
from typing import NamedTuple

from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from pagedserve.attention import kv_quant
from pagedserve.kernels import fp8_format
from pagedserve.attention.backend import AttentionShape, set_forward_context
from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.attention.selector import get_attention_backend
from pagedserve.config import EngineConfig
from pagedserve.device.cuda_graphs import StepGraphs, graph_shape
from pagedserve.device.disk_tier import DiskBlocks
from pagedserve.device.drafter import DraftStep, draft_step, make_drafter
from pagedserve.device.input_batch import BlockTableRows, CachedRequestState, StepBuffers
from pagedserve.device.lora_slots import LoRASlots
from pagedserve.device.tier_copies import TierCopies
from pagedserve.device.penalties import PenaltyState
from pagedserve.kernels.penalties import to_device
from pagedserve.kv_cache.disk_format import rank_dir
from pagedserve.device.profile_run import profile_batch
from pagedserve.device.rejection import Verified, VerifyRows, verify
from pagedserve.device.sampler import (
    LogprobsTensors, PlainBatch, Sampler, SamplerOutput, SamplingMetadata, VocabShard,
    gather_logprobs, select_sampling_kernels, warm_up_sampler)
from pagedserve.messages import LogprobsLists, ModelRunnerOutput, SchedulerOutput, TierCosts
from pagedserve.model import parallel
from pagedserve.model.config import ModelConfig
from pagedserve.model.decoder import Decoder
from pagedserve.model.lora import LoRABatch, lora_context
from pagedserve.structured.manager import GrammarOutput


class TierReport(NamedTuple):
    """What a step's tier copies came to: its loads whose file did not read back whole on
    some rank (indices into blocks_to_load), and the seconds the copies took here."""

    failed_loads: list[int]
    seconds: float
    stream_seconds: float  # the copy stream's, of the copies finished since the last report


NO_TIER_WORK = TierReport([], 0.0, 0.0)


class PendingRunnerOutput:
    """A step's sampled tokens (and logprobs) on their way to the host.

    On CUDA they are copied without blocking into pinned memory, followed by an event:
    `result()` waits for that event only, not for whatever steps were queued after this one.
    With the event recorded at the step's launch (`started`), `result()` also reports the
    device's time on the step: the device idle between steps is the step's wall time less
    that, which tells host-bound steps from device-bound ones.
    On the CPU the step has already run and the tensors are the results. `result()` also
    appends each token to its request's state (by object, not id: a finished request's id
    may already name a new request when a step in flight completes). The sampled tensor
    stays on the device for the next step's placeholder rows (`ModelRunner.launch`).
    """

    def __init__(self, states: list[CachedRequestState], sampled: SamplerOutput | None,
                 prompt_logprobs: dict[str, LogprobsLists] | None = None,
                 accepted: list[list[int]] | None = None,
                 tiers: TierReport = NO_TIER_WORK,
                 propose: Callable[[], dict[str, list[int]]] | None = None,
                 started: torch.cuda.Event | None = None, graph_query_len: int = 0) -> None:
        """`accepted`: speculative decoding's accepted drafts per row (on the host: the
        verify has waited for the step), placed before each row's sampled token.
        `propose`: a proposer on the device, run once the tokens are placed (it reads
        them): its drafts go out with them. `started`: a timing event recorded before the
        step's forward pass (CUDA). `graph_query_len`: the query length of the CUDA graph the
        step replayed (1: decodes; k + 1: verifies), 0: none."""
        self.states = states
        self.graph_query_len = graph_query_len
        self._propose = propose
        self._accepted = accepted
        self.tiers = tiers
        self.req_ids = [state.req_id for state in states]
        self.sampled_token_ids = sampled.sampled_token_ids if sampled is not None else None
        self._prompt_logprobs = prompt_logprobs  # already on the host
        self._tokens = _to_host(sampled.sampled_token_ids) if sampled is not None else None
        self._logprobs = None
        if sampled is not None and sampled.logprobs is not None:
            lp = sampled.logprobs
            self._logprobs = LogprobsTensors(
                _to_host(lp.top_token_ids), _to_host(lp.top_logprobs),
                _to_host(lp.sampled_logprobs), _to_host(lp.sampled_ranks))
        self._ready = self._started = None
        if sampled is not None and sampled.sampled_token_ids.is_cuda:
            self._started = started
            self._ready = torch.cuda.Event(enable_timing=started is not None)
            self._ready.record()

    def result(self) -> ModelRunnerOutput:
        """Wait for the copies (the engine's only wait on the GPU) and return the tokens."""
        if self._tokens is None:
            drafts = self._propose() if self._propose is not None else None
            return ModelRunnerOutput([], [], None, self._prompt_logprobs, None,
                                     *self.tiers, draft_token_ids=drafts,
                                     graph_query_len=self.graph_query_len)
        waited = 0.0
        if self._ready is not None:
            start = time.perf_counter()
            self._ready.synchronize()
            waited = time.perf_counter() - start
        output = self._output(waited)
        accepted = self._accepted
        for row, (state, token) in enumerate(zip(self.states, output.sampled_token_ids)):
            if accepted is not None:
                for draft in accepted[row]:
                    state.append_output_token(draft)
            state.append_output_token(token)
        if self._propose is not None:  # after the tokens are placed: it reads them
            output.draft_token_ids = self._propose()
        return output

    def output_if_ready(self) -> ModelRunnerOutput | None:
        """What `result()` will return, without waiting or placing the tokens, if the
        step's tokens are on the host already (a step with a proposer: never, its drafts
        need the tokens placed). A tensor-parallel rank 0 answers the engine with it before
        its next step's host work, and calls `result()` in its turn (`worker.py`)."""
        if self._tokens is None or self._propose is not None:
            return None
        if self._ready is not None and not self._ready.query():
            return None
        return self._output(0.0)

    def _output(self, waited: float) -> ModelRunnerOutput:
        """The step's output from its host copies (complete by now), drafts aside."""
        busy = 0.0
        if self._ready is not None and self._started is not None:
            busy = self._started.elapsed_time(self._ready) / 1e3
        logprobs = None
        if self._logprobs is not None:
            lp = self._logprobs
            logprobs = LogprobsLists(lp.top_token_ids.tolist(), lp.top_logprobs.tolist(),
                                     lp.sampled_logprobs.tolist(), lp.sampled_ranks.tolist())
        return ModelRunnerOutput(self.req_ids, self._tokens.tolist(), logprobs,
                                 self._prompt_logprobs, self._accepted, *self.tiers,
                                 device_wait_seconds=waited, device_seconds=busy,
                                 graph_query_len=self.graph_query_len)


def _timing_event(device: torch.device) -> torch.cuda.Event | None:
    """On CUDA, a timing event recorded now on the current stream: where a step's device
    time starts (`PendingRunnerOutput`)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _to_host(tensor: Tensor) -> Tensor:
    """Queue the copy to the host: from CUDA with non_blocking, torch allocates the
    destination in pinned memory (its caching host allocator), so the copy is a DMA."""
    return tensor.to("cpu", non_blocking=True)


@dataclass
class StepInputs:
    input_ids: Tensor
    positions: Tensor
    meta: AttentionMetadata
    logits_indices: Tensor  # rows of the hidden states that get sampled
    sampling_states: list[CachedRequestState]
    # the captured graphs (decode or verify) that run this step, if any, and the padded
    # batch size they run it at
    graphs: StepGraphs | None
    graph_size: int | None
    # the placeholder rows of input_ids, which the launch fills on the device from the
    # previous step's sampled tokens (of these requests)
    placeholder_ids: list[str]
    placeholder_rows: np.ndarray
    lora: LoRABatch | None = None  # the adapters' rows; None: all the base model's
    # speculative decoding: each sampling state's drafts (k + 1 logits rows each, the
    # others one); None when the step verifies none
    drafts: list[list[int]] | None = None


class PreparedStep(NamedTuple):
    """A step whose host work is done (`prepare_step`), ready to `launch`."""

    output: SchedulerOutput
    inputs: StepInputs | None  # None: no request is scheduled (finished ids only)
    tiers: TierReport = NO_TIER_WORK


@dataclass(eq=False)
class StepHandle:
    """A launched step: its forward pass and LM head are queued, its sampling is not. What
    `sample_tokens` needs, handed back by the caller."""

    states: list[CachedRequestState]  # the sampling rows, in batch order
    logits: Tensor | None  # [rows, vocab]; None when the step samples nothing
    sampling: SamplingMetadata | None
    prompt_logprobs: dict[str, LogprobsLists] | None  # on the host already
    # speculative decoding: the verified requests' rows (then `logits` and `sampling` are
    # the other sampling states' rows, `ordinary` their positions among `states`)
    verify: VerifyRows | None = None
    ordinary: list[int] | None = None
    tiers: TierReport = NO_TIER_WORK
    draft: DraftStep | None = None  # a proposer on the device: what it drafts from
    started: torch.cuda.Event | None = None  # recorded before its forward pass (CUDA)
    graph_query_len: int = 0  # its CUDA graph's query length (1 or k + 1); 0: eager
    sharded: bool = False  # `logits` are this rank's vocabulary rows (`vocab_shard`)


class ModelRunner:
    def __init__(self, config: EngineConfig, model: Decoder, model_config: ModelConfig,
                 device: torch.device) -> None:
        self.config = config
        self.model = model
        self.model_config = model_config
        self.device = device
        self.dtype = model.embed_tokens.weight.dtype  # the activations' (FP8 weights aside)
        self.kv_cache_dtype = kv_quant.cache_dtype(config.kv_cache_dtype, self.dtype)
        self.block_size = config.block_size
        # this rank's KV heads (tensor parallelism shards the cache by KV head)
        self.num_kv_heads = len(parallel.local_kv_heads(model_config))
        self.backend = get_attention_backend(config.attention_backend, device, AttentionShape(
            self.dtype, self.kv_cache_dtype, len(parallel.local_q_heads(model_config)),
            self.num_kv_heads, model_config.head_dim, model_config.attn_softcap))
        self.sampler = Sampler(select_sampling_kernels(device))
        # a step's sampling inputs when every row is plain, kept while the rows stay the same
        self.plain_batch = PlainBatch(device, self.sampler.fused)
        # under tensor parallelism: this rank's LM-head rows, for steps whose rows the
        # sampler can draw from them (`_handle`); None: every step gathers the logits
        self.vocab_shard = vocab_shard(model_config)
        self.penalties = PenaltyState(model_config.vocab_size, device)
        self.kv_caches: list[tuple[Tensor, Tensor]] = []
        # an FP8 cache's (K, V) scales per layer (`attention.kv_quant`); None otherwise
        self.kv_scales: list[tuple[Tensor, Tensor] | None] = []
        self.cpu_kv_caches: list[tuple[Tensor, Tensor]] = []  # swap space
        # the host tier's slots, the disk tier's files and the copies to and from them
        self.tiers: TierCopies | None = None
        self._swapped_out: torch.cuda.Event | None = None  # after the latest swap-out copies
        self._unbind: weakref.finalize | None = None  # see _bind_kv_cache
        self.requests: dict[str, CachedRequestState] = {}  # every unfinished request seen
        self.loras = None if not config.enable_lora else LoRASlots(
            model, model_config, config.max_loras, config.max_lora_rank,
            config.max_cpu_loras or config.max_loras, device)
        # speculative decoding's draft model or EAGLE-3 heads (device/drafter.py)
        self.drafter = make_drafter(config, model, model_config, device)

    # -- KV cache sizing and allocation ---------------------------------------------------

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers, K and V (one byte an element in FP8), on
        this rank."""
        mc = self.model_config
        element = torch.empty(0, dtype=self.kv_cache_dtype).element_size()
        draft = self.drafter.block_bytes if self.drafter is not None else 0
        return (2 * mc.num_layers * self.block_size * self.num_kv_heads * mc.head_dim * element
                + draft)

    def determine_num_blocks(self) -> int:
        budget = self.config.kv_cache_memory
        if budget is None:
            budget = self._cuda_budget() if self.device.type == "cuda" else self._cpu_budget()
        num_blocks = budget // self.block_bytes
        if num_blocks < 2:
            raise ValueError(f"a KV cache budget of {budget} bytes holds {num_blocks} blocks of "
                             f"{self.block_bytes} bytes; at least 2 (one is the null block) "
                             "are needed: raise kv_cache_memory")
        return int(num_blocks)

    def _cpu_budget(self) -> int:
        """A fraction of the RAM available now, capped: the OS and other processes keep theirs."""
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return int(min(self.config.cpu_kv_cache_cap, available * self.config.cpu_kv_cache_fraction))

    def _cuda_budget(self) -> int:
        """What is left of gpu_memory_utilization of the GPU after the weights and the peak
        activations of a forward pass at max_num_batched_tokens (measured, not estimated).
        The allocator's cache is emptied first: tensors the loader freed (a weight's packed
        form once converted to another, `int_linear.prepare`) would otherwise count as held."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        allocated = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self._profile_run()
        peak_activations = torch.cuda.max_memory_allocated(self.device) - allocated
        torch.cuda.empty_cache()
        return int(total * self.config.gpu_memory_utilization - (total - free)
                   - peak_activations)

    def _profile_run(self) -> None:
        """One prefill step of max_num_batched_tokens tokens against a throwaway 2-block
        cache."""
        self.initialize_kv_cache(2)
        self._prefill_probe(self.config.max_num_batched_tokens, self.model_config.max_model_len)
        self.kv_caches = []

    def _prefill_probe(self, num_tokens: int, max_len: int, whole_step: bool = True) -> None:
        """A prefill step of `num_tokens` prompt tokens in prompts of at most `max_len`
        (`profile_run.profile_batch`: it writes no KV, so it may run over any cache); not
        `whole_step`: the target's forward pass only, what recomputing a prefix hit adds to
        a step (the logits, the sampling and a draft are the request's either way)."""
        ids, positions, meta = profile_batch(num_tokens, max_len, self.block_size, self.device)
        capture = self.drafter.capture if self.drafter is not None and whole_step else ()
        with torch.inference_mode(), set_forward_context(meta, self.backend):
            hidden, aux = (self.model.forward_capturing(ids, positions, capture) if capture
                           else (self.model(ids, positions), None))
            if not whole_step:
                return
            logits = self.model.compute_logits(hidden[-self.config.max_num_seqs:])
            self.sampler(logits, _random_sampling_meta(logits))  # its temporaries count too
            if self.drafter is not None:  # the draft's run over the same chunk, after it
                self.drafter.profile(ids, positions, meta, aux, self.config.max_num_seqs)

    def measure_tier_costs(self, max_model_len: int) -> TierCosts:
        """What the host tier's recall rule weighs (`engine/recall_rule.py`), measured here
        once the caches and the host slots exist: forward passes (`_prefill_costs`), and a
        recall of a prefill's blocks through the tier's own copy path (into pool blocks that
        nothing holds yet), after one to warm it up (the staging, the copy stream)."""
        token_s, token_context_s, step_s, num_tokens = self._prefill_costs(max_model_len)
        num_slots, num_blocks = self.tiers.num_slots, self.kv_caches[0][0].shape[0]
        num_copied = max(1, min(num_tokens // self.block_size, num_slots, num_blocks - 1))
        pairs = [(slot, slot + 1) for slot in range(num_copied)]  # never the null block

        def recall() -> None:
            self.tiers.recall(pairs)
            self.tiers.await_recalls()

        copy_s = self._timed(recall)
        self.tiers.take_stream_seconds()  # the probes' copies are no step's
        return TierCosts(copy_s / num_copied, token_s, token_context_s, step_s, num_copied,
                         num_tokens)

    def _prefill_costs(self, max_model_len: int) -> tuple[float, float, float, int]:
        """(seconds a token, seconds a token per context token, seconds a step at least,
        tokens measured) of the target's forward pass, each timed after a warm-up (kernels
        compiled, allocator grown, the first call's set-up: what the first step would pay
        otherwise). On CUDA: a step's budget of tokens, as a recompute runs, in prompts of
        two lengths, fitted to `token_s * l + token_context_s * l * l` a prompt of length
        l (a long history's recompute pays the attention's growth); the step, the cheapest
        a recall can wait: the one-request decode graph's replay (before any step: its
        inputs are still capture's, which write nothing), or without graphs an eager pass
        over one token. The eager pass is no floor with graphs: it is bound by the host's
        launches, a few times the replay, and it varied widely between starts of one engine
        (docs/benchmarks.md), declining recalls that paid. On the CPU one block,
        which is also the step (a pass there is bound by the weights at the lengths a probe
        can afford), and no context term (this runs at every start with a tier)."""
        def timed(num_tokens: int, max_len: int) -> float:
            return self._timed(partial(self._prefill_probe, num_tokens, max_len,
                                       whole_step=False))

        if self.device.type != "cuda":
            seconds = timed(self.block_size, self.block_size)
            return seconds / self.block_size, 0.0, seconds, self.block_size
        long = min(self.config.max_num_batched_tokens, max_model_len)
        short = max(1, long // 8)
        t_long, t_short = timed(long, long), timed(long, short)
        token_context_s = max(0.0, (t_long - t_short) / (long * max(1, long - short)))
        token_s = max(0.0, t_short / long - token_context_s * short)
        size = self.graphs.padded_size(1) if self.graphs is not None else None
        step_s = (self._timed(partial(self.graphs.replay, size)) if size is not None
                  else timed(1, 1))
        return token_s, token_context_s, step_s, long

    def _timed(self, work: Callable[[], None]) -> float:
        """Seconds from an idle device to `work` done on it, its second run (the first
        warms it up: kernels compiled, allocator grown, the first call's set-up)."""
        work()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        work()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - start

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate per-layer K and V per the layout contract and bind them to the layers.

        Left uninitialised (zero-filling gigabytes costs seconds at start-up): every backend
        masks slots past a sequence's length, so stale bytes are never read. Only the null
        block is zeroed, so that a write into it (a bug) is detectable. An FP8 cache gets its
        scales per layer: the checkpoint's `k_scale`/`v_scale`, else 1.0 (`kv_quant`).
        """
        mc = self.model_config
        shape = (num_blocks, self.block_size, self.num_kv_heads, mc.head_dim)
        dtype = self.kv_cache_dtype
        self.kv_caches = [(torch.empty(shape, dtype=dtype, device=self.device),
                           torch.empty(shape, dtype=dtype, device=self.device))
                          for _ in range(mc.num_layers)]
        for k_cache, v_cache in self.kv_caches:
            k_cache[0].zero_()
            v_cache[0].zero_()
        self.kv_scales = [self._layer_kv_scales(layer)
                          for layer in self.model.attention_layers()]
        self._bind_kv_cache()
        if self.drafter is not None:  # the same blocks in the draft's layers
            self.drafter.allocate(num_blocks)

    def _layer_kv_scales(self, layer) -> tuple[Tensor, Tensor] | None:
        if self.kv_cache_dtype != fp8_format.FP8_DTYPE:
            return None
        stored = layer.checkpoint_kv_scales
        checkpoint = (stored["k_scale"], stored["v_scale"]) if len(stored) == 2 else None
        return kv_quant.kv_scales(layer.num_kv_heads, checkpoint,
                                  parallel.local_kv_heads(self.model_config), self.device)

    def _bind_kv_cache(self) -> None:
        """Point the attention layers at our caches (a model may be shared by engines).

        The model outlives the engines that share it, so when this runner is collected our
        caches come off its layers: otherwise the last engine to bind them keeps its whole
        KV cache alive and the next engine sizes its own from what is left.
        """
        layers = self.model.attention_layers()
        if layers[0].k_cache is self.kv_caches[0][0]:
            return
        for attention, (k_cache, v_cache), scales in zip(layers, self.kv_caches,
                                                         self.kv_scales):
            attention.k_cache, attention.v_cache = k_cache, v_cache
            attention.kv_scales = scales
        if self._unbind is not None:
            self._unbind.detach()
        self._unbind = weakref.finalize(self, _unbind_kv_cache, layers, self.kv_caches[0][0])

    def initialize_swap_space(self, num_cpu_blocks: int) -> None:
        """CPU copies of the per-layer caches for preemption by swapping."""
        self.cpu_kv_caches = self._host_caches(num_cpu_blocks)

    def initialize_host_tier(self, num_slots: int) -> None:
        """The prefix cache's host tier: slots for evicted cached blocks (this rank's shard
        of their KV heads) and the copies to and from them (`tier_copies.py`)."""
        self.tiers = TierCopies(self._device_caches(), num_slots, self.device, self.backend)

    def initialize_disk_tier(self, run_dir: str, digest: bytes) -> None:
        """The disk tier below the host tier: this rank's files (`kv_cache.disk_format`)."""
        self.tiers.disk = DiskBlocks(rank_dir(Path(run_dir), parallel.get_tp().rank), digest)

    def _host_caches(self, num_blocks: int) -> list[tuple[Tensor, Tensor]]:
        """Per-layer caches of `num_blocks` blocks in CPU memory; pinned on CUDA so the
        copies are DMA transfers (pageable memory is far slower: docs/benchmarks.md,
        "Block copy and swap")."""
        pin = self.device.type == "cuda"
        return [tuple(torch.empty((num_blocks, *c.shape[1:]), dtype=c.dtype, pin_memory=pin)
                      for c in layer) for layer in self._device_caches()]

    def _device_caches(self) -> list[tuple[Tensor, Tensor]]:
        """Every layer's cache that a block id addresses: the target's, then a drafter's
        (whose KV moves with the target's wherever a block goes: swap, host tier, disk)."""
        return self.kv_caches + (self.drafter.kv_caches if self.drafter is not None else [])

    def setup(self, max_model_len: int) -> None:
        """Allocate the step buffers, compile the sampling kernels and, on CUDA unless
        enforce_eager or the backend cannot be captured, capture the decode graphs. Called
        once the KV cache is allocated and max_model_len is known."""
        config = self.config
        max_blocks = -(-max_model_len // self.block_size)
        self.buffers = StepBuffers(max(config.max_num_batched_tokens, config.max_num_seqs),
                                   config.max_num_seqs, max_blocks, self.device)
        self.block_rows = BlockTableRows(max_blocks, capacity=2 * config.max_num_seqs)
        if self.loras is not None:
            self.loras.allocate(max(config.max_num_batched_tokens, config.max_num_seqs))
        self.graphs = self.verify_graphs = None
        warm_up_sampler(self.sampler, self.model_config.vocab_size, self.dtype, self.device,
                        config.max_num_seqs, self.vocab_shard)
        graphs = self.device.type == "cuda" and not config.enforce_eager
        if graphs and self.backend.capturable:
            self._bind_kv_cache()
            self._capture_graphs(max_model_len)
        if self.drafter is not None:  # it drafts for at most disable_by_batch_size requests
            self.drafter.setup(min(config.max_num_seqs,
                                   config.speculative_config.disable_by_batch_size),
                               max_model_len, graphs)

    def _capture_graphs(self, max_model_len: int) -> None:
        """The decode graphs and, with speculative decoding, the verify graphs (k + 1 tokens
        a request, up to disable_by_batch_size requests: no drafts above it), in one memory
        pool (a step replays one graph). With an EAGLE-3 drafter both also return the
        residual streams it reads."""
        config, spec = self.config, self.config.speculative_config
        capture = self.drafter.capture if self.drafter is not None else ()
        forward = (partial(self.model.forward_capturing, capture=capture) if capture
                   else self.model)
        pool = torch.cuda.graph_pool_handle()
        self.graphs = StepGraphs(forward, self.backend, self.buffers, config.max_num_seqs,
                                 max_model_len, lora=self.loras)
        self.graphs.capture(pool)
        if spec is None:
            return
        query_len = spec.num_speculative_tokens + 1
        max_batch = min(config.max_num_seqs, spec.disable_by_batch_size,
                        self.buffers.input_ids.np.shape[0] // query_len)
        if max_batch >= 1:
            self.verify_graphs = StepGraphs(forward, self.backend, self.buffers, max_batch,
                                            max_model_len, query_len=query_len)
            self.verify_graphs.capture(pool)

    # -- one step ---------------------------------------------------------------------------

    def update_states(self, output: SchedulerOutput) -> None:
        """Apply the step's news: forget finished requests, drop the rows of preempted ones
        (their blocks are gone), take in new ones, add the blocks allocated this step."""
        self.block_rows.release(output.finished_req_ids)
        for req_id in output.finished_req_ids:
            self.requests.pop(req_id, None)
            self.penalties.remove(req_id)
        self.block_rows.release(output.preempted_req_ids)
        for req_id, num_blocks in output.truncated_block_rows.items():
            self.block_rows.truncate(req_id, num_blocks)
        for new in output.scheduled_new_reqs:
            self.requests[new.req_id] = CachedRequestState(
                new.req_id, new.prompt_token_ids, new.sampling_params,
                lora_request=new.lora_request)
            self.block_rows.add(new.req_id, new.block_ids)
        cached = output.scheduled_cached_reqs
        for req_id, resumed, block_ids, num_nulled in zip(
                cached.req_ids, cached.resumed, cached.new_block_ids, cached.num_nulled_blocks):
            if resumed:
                self.block_rows.add(req_id, block_ids)
            else:
                self.block_rows.append(req_id, block_ids, num_nulled)

    def prepare_inputs(self, output: SchedulerOutput) -> StepInputs:
        """Fill the host buffers with numpy, queue their uploads; no host-device sync."""
        requests = [self.requests[r] for r in output.req_ids]
        num_seqs = len(requests)
        num_new = np.array(output.num_scheduled_tokens, dtype=np.int64)
        num_computed = np.array(output.num_computed_tokens, dtype=np.int64)
        seq_lens = num_computed + num_new
        num_tokens = int(num_new.sum())
        drafts = output.draft_token_ids
        num_drafts = np.zeros(num_seqs, dtype=np.int64)
        if drafts:  # a verify's drafts are known to the step, after its last token
            num_drafts[:] = [len(drafts.get(r, ())) for r in output.req_ids]
        lora_slots = (self.loras.slots([r.lora_request for r in requests])
                      if self.loras is not None else None)
        graphs, graph_size = self._step_graph(num_new, num_drafts, lora_slots)
        query_len = graphs.query_len if graphs is not None else 1
        rows = num_seqs if graph_size is None else graph_size  # padded rows for a graph

        b = self.buffers
        b.wait_for_uploads()
        query_start_loc = b.query_start_loc.np[:rows + 1]
        query_start_loc[0] = 0
        np.cumsum(num_new, out=query_start_loc[1:num_seqs + 1])
        req_index = np.repeat(np.arange(num_seqs), num_new)
        token_pos = b.positions.np[:num_tokens]
        token_pos[:] = (np.arange(num_tokens) - query_start_loc[req_index]
                        + num_computed[req_index])
        num_known = np.fromiter((len(r.all_token_ids) for r in requests), dtype=np.int64,
                                count=num_seqs) + num_drafts
        # a chunk that ends past the known tokens ends on a placeholder (only ever one)
        placeholders = np.flatnonzero(seq_lens > num_known)
        placeholder_rows = query_start_loc[placeholders + 1] - 1
        self._fill_known_input_ids(requests, num_computed, np.minimum(seq_lens, num_known),
                                   placeholder_rows, num_tokens, drafts)

        bs = self.block_size
        b.fill_block_tables(self.block_rows.table, self.block_rows.rows(output.req_ids), rows,
                            -(-int(seq_lens.max()) // bs))
        block_tables = b.block_tables.np
        b.slot_mapping.np[:num_tokens] = (
            block_tables[req_index, token_pos // bs].astype(np.int64) * bs + token_pos % bs)
        b.seq_lens.np[:num_seqs] = seq_lens
        token_rows = b.pad_rows(num_seqs, num_tokens, rows, query_len)

        samples = np.array(output.samples, dtype=bool)
        sample_rows = _sample_rows(query_start_loc[1:num_seqs + 1][samples],
                                   num_drafts[samples])
        b.logits_indices.np[:len(sample_rows)] = sample_rows
        num_decodes, max_query_len = output.num_decodes, int(num_new.max())
        if self._verifies_as_decodes(drafts, num_new, num_drafts, num_tokens, graphs):
            self._decode_rows(output, num_new, token_pos, seq_lens)
            num_decodes = rows = num_tokens
            max_query_len = 1
        meta = AttentionMetadata(  # what an eager forward reads; a graph reads the buffers
            num_decodes=num_decodes, num_decode_tokens=num_decodes,
            slot_mapping=b.slot_mapping.upload(token_rows),
            block_tables=b.block_tables.upload(rows),
            seq_lens=b.seq_lens.upload(rows),
            query_start_loc=b.query_start_loc.upload(rows + 1),
            max_query_len=max_query_len, max_seq_len=int(seq_lens.max()))
        lora = None
        if self.loras is not None:
            lora = self.loras.batch(lora_slots, num_new, token_rows, graphs is not None)
        inputs = StepInputs(
            input_ids=b.input_ids.upload(token_rows),
            positions=b.positions.upload(token_rows),
            meta=meta,
            logits_indices=b.logits_indices.upload(len(sample_rows)),
            sampling_states=self._sampling_states(requests, samples, seq_lens - num_drafts),
            graphs=graphs, graph_size=graph_size,
            placeholder_ids=(output.req_ids if len(placeholders) == num_seqs else  # decoding
                             [output.req_ids[i] for i in placeholders.tolist()]),
            placeholder_rows=placeholder_rows, lora=lora,
            drafts=([drafts.get(r, []) for r, sample in zip(output.req_ids, output.samples)
                     if sample] if drafts else None))
        return inputs

    def _step_graph(self, num_new: np.ndarray, num_drafts: np.ndarray,
                    lora_slots: np.ndarray | None) -> tuple[StepGraphs | None, int | None]:
        """The captured graphs that run the step and the padded size it runs at
        (`cuda_graphs.graph_shape`); (None, None): eager. Verify graphs have no LoRA
        variant: a verify with an adapter row runs eagerly."""
        ladders = {graphs.query_len: graphs.sizes for graphs in (self.graphs,
                                                                 self.verify_graphs)
                   if graphs is not None}
        shape = graph_shape(num_new, num_drafts, ladders)
        if shape is None:
            return None, None
        query_len, size = shape
        if query_len == 1:
            return self.graphs, size
        if lora_slots is not None and (lora_slots >= 0).any():
            return None, None
        return self.verify_graphs, size

    def _verifies_as_decodes(self, drafts: dict[str, list[int]], num_new: np.ndarray,
                             num_drafts: np.ndarray, num_tokens: int,
                             graphs: StepGraphs | None) -> bool:
        """Whether a step of decodes and verifies only runs as one decode per token (the CPU
        backend, no LoRA, no graph, the rows within the step buffers): the CPU's whole-step
        decode (`model/fast_decode.py`) then takes it, which a verify chunk would otherwise
        leave for the per-op path at several times a decode's cost."""
        return (bool(drafts) and self.backend.name == "cpu" and self.loras is None
                and graphs is None and num_tokens <= self.config.max_num_seqs
                and bool(np.all(num_new == num_drafts + 1)))

    def _decode_rows(self, output: SchedulerOutput, num_new: np.ndarray,
                     token_pos: np.ndarray, seq_lens: np.ndarray) -> None:
        """Rewrite the step's attention rows as one decode per token: each token its
        request's block table and the context up to itself (a token attends to the K/V
        its step stores before it, as a short prefill does)."""
        b, num_tokens = self.buffers, len(token_pos)
        b.fill_block_tables(self.block_rows.table,
                            np.repeat(self.block_rows.rows(output.req_ids), num_new),
                            num_tokens, -(-int(seq_lens.max()) // self.block_size))
        b.seq_lens.np[:num_tokens] = token_pos + 1
        b.query_start_loc.np[:num_tokens + 1] = np.arange(num_tokens + 1)

    @staticmethod
    def _sampling_states(requests: list[CachedRequestState], samples: np.ndarray,
                         seq_lens: np.ndarray) -> list[CachedRequestState]:
        """The requests this step samples for (`samples`, a mask of the batch: all of it
        when decoding), each told how many of its tokens are not known yet, the one drawn
        now included (the sampler's seeded streams count them)."""
        if samples.all():
            states, ends = requests, seq_lens.tolist()
        else:
            states = [requests[i] for i in np.flatnonzero(samples).tolist()]
            ends = seq_lens[samples].tolist()
        for state, seq_len in zip(states, ends):
            state.num_output_placeholders = seq_len + 1 - len(state.all_token_ids)
        return states

    def _fill_known_input_ids(self, requests: list[CachedRequestState], starts: np.ndarray,
                              ends: np.ndarray, placeholder_rows: np.ndarray,
                              num_tokens: int, drafts: dict[str, list[int]]) -> None:
        """Write tokens [start, end) of each request into the host input ids around the
        placeholder rows, which the device copy fills. An async decode step at steady state
        is all placeholders and reads no token here. A verified request's drafts follow its
        known tokens."""
        input_ids = self.buffers.input_ids.np[:num_tokens]
        if len(placeholder_rows) == num_tokens:
            return
        starts, ends = starts.tolist(), ends.tolist()
        if num_tokens == len(requests):  # one token each
            known = [r.all_token_ids[c] for r, c, e in zip(requests, starts, ends) if c < e]
        else:
            known = list(chain.from_iterable(
                r.all_token_ids[c:e] + drafts.get(r.req_id, []) if drafts else
                r.all_token_ids[c:e] for r, c, e in zip(requests, starts, ends)))
        if len(placeholder_rows):
            mask = np.ones(num_tokens, dtype=bool)
            mask[placeholder_rows] = False
            input_ids[mask] = known
        else:
            input_ids[:] = known

    def _copy_last_sampled(self, inputs: StepInputs,
                           previous: PendingRunnerOutput | None) -> None:
        """Queue the copy of the previous step's sampled tokens into the placeholder rows of
        the device input ids: no host sync, the previous step may still be running."""
        if previous is None or previous.sampled_token_ids is None:
            raise RuntimeError("a step with placeholder tokens was launched without the step "
                               "that samples them")
        b = self.buffers
        count = len(inputs.placeholder_ids)
        b.placeholder_rows.np[:count] = inputs.placeholder_rows
        tokens = previous.sampled_token_ids
        if inputs.placeholder_ids != previous.req_ids:  # else (steady decoding) row i is i
            rows = {req_id: row for row, req_id in enumerate(previous.req_ids)}
            b.placeholder_sources.np[:count] = [rows[r] for r in inputs.placeholder_ids]
            tokens = tokens.index_select(0, b.placeholder_sources.upload(count))
        inputs.input_ids.index_copy_(0, b.placeholder_rows.upload(count),
                                     tokens.to(inputs.input_ids.dtype))

    def swap(self, output: SchedulerOutput) -> TierReport:
        """Block copies the scheduler asked for, before this step's forward pass: the
        compute stream first waits for a recall a step before queued and no forward pass
        waited for; then host slots to disk (they read slots that later copies overwrite),
        copies out to host memory (swap space, host tier), disk to host slots, and copies in
        (a recall lands layer by layer during this step's forward pass: `tier_copies.py`)."""
        start = time.perf_counter()
        tiers = self.tiers
        if tiers is not None:
            tiers.await_recalls()
        if output.blocks_to_spill:
            tiers.spill(output.blocks_to_spill)
        self._copy_out(self.cpu_kv_caches, output.blocks_to_swap_out)
        if output.blocks_to_offload:
            tiers.offload(output.blocks_to_offload)
        failed = self._load(output.blocks_to_load) if output.blocks_to_load else []
        self._copy_in(self.cpu_kv_caches, output.blocks_to_swap_in)
        if output.blocks_to_recall:
            tiers.recall(output.blocks_to_recall)
        tier_work = (output.blocks_to_spill or output.blocks_to_offload
                     or output.blocks_to_load or output.blocks_to_recall)
        stream = tiers.take_stream_seconds() if tiers is not None else 0.0
        return (TierReport(failed, time.perf_counter() - start, stream) if tier_work or stream
                else NO_TIER_WORK)

    def _load(self, loads: list[tuple[int, int, bytes | int]]) -> list[int]:
        """Read files into host slots; the loads that failed on any rank, so every rank and
        the scheduler agree on what was found."""
        done = self.tiers.load(loads)
        failed = torch.tensor([not ok for ok in done], dtype=torch.int32, device=self.device)
        parallel.max_(failed)
        return [i for i, flag in enumerate(failed.tolist()) if flag]

    def _host_writes_done(self) -> None:
        """Wait until the queued copies into host memory have landed (CUDA copies them
        asynchronously): the host reads or overwrites those slots next."""
        if self._swapped_out is not None:
            self._swapped_out.synchronize()
            self._swapped_out = None

    def _copy_out(self, host_caches: list[tuple[Tensor, Tensor]],
                  pairs: list[tuple[int, int]]) -> None:
        if pairs:
            self.backend.swap_blocks(self._device_caches(), host_caches, torch.tensor(pairs))
            if self.device.type == "cuda":  # the copies land asynchronously
                self._swapped_out = torch.cuda.Event()
                self._swapped_out.record()

    def _copy_in(self, host_caches: list[tuple[Tensor, Tensor]],
                 pairs: list[tuple[int, int]]) -> None:
        if pairs:
            self._host_writes_done()  # a copy in reads host memory on the host
            self.backend.swap_blocks(host_caches, self._device_caches(), torch.tensor(pairs))

    @torch.inference_mode()
    def prepare_step(self, output: SchedulerOutput) -> PreparedStep:
        """A step's host work: the runner's request states, swaps, the input buffers and
        their uploads. Kept apart from `launch` so that the executor can sample a step that
        awaited its grammar bitmask in between (the bitmask's work overlaps this; the step
        before has built its sampling inputs at its launch, so nothing done here changes
        them)."""
        self.update_states(output)
        tiers = self.swap(output)
        return PreparedStep(output, self.prepare_inputs(output) if output.req_ids else None,
                            tiers)

    @torch.inference_mode()
    def launch(self, prepared: PreparedStep,
               previous: PendingRunnerOutput | None = None) -> StepHandle:
        """Queue the forward pass and the LM head of a prepared step. `previous`: the step
        before, sampled already (its tokens may still be on their way): its sampled tokens
        fill this step's placeholder rows on the device."""
        output, inputs, tiers = prepared
        if inputs is None:
            return StepHandle([], None, None, None, tiers=tiers)
        started = _timing_event(self.device)
        if inputs.placeholder_ids:
            self._copy_last_sampled(inputs, previous)
        self.buffers.mark_uploaded()
        hidden, aux = self._forward(inputs)
        if self.tiers is not None:  # this step's recall, whole, before a drafter or the next step
            self.tiers.await_recalls()
        handle = self._handle(output, inputs, hidden, tiers)
        handle.started = started
        handle.graph_query_len = inputs.graphs.query_len if inputs.graphs is not None else 0
        if self.drafter is not None:
            handle.draft = draft_step(
                [self.requests[r] for r in output.req_ids], output.num_computed_tokens,
                output.num_scheduled_tokens, output.num_lookahead_tokens, aux,
                self.block_rows.table, self.block_rows.rows(output.req_ids), self.block_size)
        return handle

    def _handle(self, output: SchedulerOutput, inputs: StepInputs, hidden: Tensor,
                tiers: TierReport) -> StepHandle:
        """The launched step's sampling inputs: the LM head on its sampled rows."""
        prompt_logprobs = self._compute_prompt_logprobs(output, hidden)
        states = inputs.sampling_states
        if not states:
            return StepHandle([], None, None, prompt_logprobs, tiers=tiers)
        if inputs.drafts is not None:
            logits = self.model.compute_logits(hidden[inputs.logits_indices])
            return self._verify_handle(states, logits, inputs, prompt_logprobs, tiers)
        meta = self.plain_batch.metadata(states)  # the same rows as the step before: cheap
        if meta is None:
            last = inputs.input_ids[inputs.logits_indices] if any(  # in-flight tokens' conditions
                state.sampling_params.bad_words_token_ids
                or state.sampling_params.thinking_budget for state in states) else None
            meta = self.sampling_metadata(states, self.model_config.vocab_size, last)
        # rows the sampler draws from each rank's vocabulary rows: no logits gathered (a
        # grammar's bitmask comes only at sampling, so requests with one gather)
        sharded = (self.vocab_shard is not None and self.sampler.samples_shards(meta)
                   and not any(state.sampling_params.structured_outputs for state in states))
        logits = self.model.compute_logits(hidden[inputs.logits_indices], gather=not sharded)
        return StepHandle(states, logits, meta, prompt_logprobs, tiers=tiers, sharded=sharded)

    def _verify_handle(self, states: list[CachedRequestState], logits: Tensor,
                       inputs: StepInputs, prompt_logprobs: dict[str, LogprobsLists] | None,
                       tiers: TierReport) -> StepHandle:
        """A step with verified requests: their k + 1 rows apart from the other sampling
        states' one row each (which the sampler takes as usual)."""
        drafts = inputs.drafts
        ends = np.cumsum([len(d) + 1 for d in drafts])
        ordinary = [i for i, d in enumerate(drafts) if not d]
        verified = [i for i, d in enumerate(drafts) if d]
        verify_rows = torch.from_numpy(np.concatenate(
            [np.arange(ends[i] - len(drafts[i]) - 1, ends[i]) for i in verified]))
        expanded = [states[i] for i in verified for _ in range(len(drafts[i]) + 1)]
        _, slots = self._penalty_slots([states[i] for i in verified])
        at_drafts, positions = self.penalties.through_drafts(slots,
                                                             [drafts[i] for i in verified])
        rows = VerifyRows(verified, [drafts[i] for i in verified],
                          logits[verify_rows.to(logits.device)],
                          SamplingMetadata.from_requests(
                              expanded, logits.shape[1], self.device,
                              penalty_state=at_drafts, penalty_slots=positions))
        if not ordinary:
            return StepHandle(states, None, None, prompt_logprobs, rows, ordinary, tiers)
        ordinary_states = [states[i] for i in ordinary]
        last_rows = torch.from_numpy(ends[ordinary] - 1).to(logits.device)
        ordinary_logits = logits[last_rows]
        last = inputs.input_ids[inputs.logits_indices][last_rows] if any(
            s.sampling_params.bad_words_token_ids or s.sampling_params.thinking_budget
            for s in ordinary_states) else None
        return StepHandle(states, ordinary_logits,
                          self.sampling_metadata(ordinary_states, logits.shape[1], last),
                          prompt_logprobs, rows, ordinary, tiers)

    @torch.inference_mode()
    def sample_tokens(self, step: StepHandle,
                      grammar: GrammarOutput | None = None) -> PendingRunnerOutput:
        """Sample a launched step, under `grammar`'s bitmask rows if given."""
        if step.verify is not None:
            return self._sample_verified(step, grammar)
        sampled = None
        if step.logits is not None:
            if grammar is not None:
                self._attach_bitmask(step.sampling, step.states, grammar)
            sampled = self._sample(step.logits, step.sampling, step.sharded)
        return PendingRunnerOutput(step.states, sampled, step.prompt_logprobs,
                                   tiers=step.tiers, propose=self._proposal(step.draft),
                                   started=step.started,
                                   graph_query_len=step.graph_query_len)

    def _proposal(self, draft: DraftStep | None) -> Callable[[], dict[str, list[int]]] | None:
        """The drafter's run over a step, for its output to make once its tokens are placed
        (under async scheduling after the next step is launched: `draft` is the step as it
        ran)."""
        if draft is None:
            return None
        return lambda: self.drafter.propose(draft)

    def _sample_verified(self, step: StepHandle,
                         grammar: GrammarOutput | None) -> PendingRunnerOutput:
        """The verified requests' accepted drafts and next tokens (`rejection.verify`), the
        other rows sampled as usual; both merged into the step's rows. `grammar` has a row
        per logits row: a verified request's k + 1 in a row."""
        states, ordinary, rows = step.states, step.ordinary, step.verify
        num_rows = [1] * len(states)
        for i, drafts in zip(rows.index, rows.drafts):
            num_rows[i] = len(drafts) + 1
        firsts = np.cumsum([0] + num_rows[:-1])
        if grammar is not None:
            verify_rows = np.concatenate([np.arange(firsts[i], firsts[i] + num_rows[i])
                                          for i in rows.index])
            rows.sampling.allowed_token_bitmask = to_device(
                torch.from_numpy(grammar.bitmask[verify_rows]), self.device)
        tokens = torch.empty(len(states), dtype=torch.int64, device=self.device)
        ordinary_logprobs = None
        if step.logits is not None:
            if grammar is not None:
                self._attach_bitmask(step.sampling, [states[i] for i in ordinary],
                                     GrammarOutput([states[i].req_id for i in ordinary],
                                                   grammar.bitmask[firsts[ordinary]]))
            sampled = self._sample(step.logits, step.sampling)
            tokens[ordinary] = sampled.sampled_token_ids
            ordinary_logprobs = sampled.logprobs
        verified = _rank0_outcome(verify(rows, [states[i] for i in rows.index]), rows.drafts,
                                  self.device)
        tokens[rows.index] = torch.tensor(verified.tokens, device=self.device)
        accepted: list[list[int]] = [[] for _ in states]
        for i, drafts, token in zip(rows.index, verified.accepted, verified.tokens):
            accepted[i] = drafts
            if states[i].sampling_params.needs_penalties:
                self.penalties.count(states[i].req_id, [*drafts, token])
        logprobs = _emitted_logprobs([len(a) + 1 for a in accepted],
                                     (ordinary_logprobs, ordinary), (verified.logprobs, rows.index))
        return PendingRunnerOutput(states, SamplerOutput(tokens, logprobs),
                                   step.prompt_logprobs, accepted, step.tiers,
                                   self._proposal(step.draft), step.started,
                                   step.graph_query_len)

    def _compute_prompt_logprobs(self, output: SchedulerOutput, hidden: Tensor
                                 ) -> dict[str, LogprobsLists] | None:
        """vLLM's prompt_logprobs for the requests that ask: each prompt position this step
        computed gets the logprob of the prompt's next token and the top ones, from its hidden
        state (the rows the sampler never sees). A position is reported once: a preempted
        request recomputes its prompt, and its state remembers how far it got. Waits for
        the step (a host copy), so only steps holding such requests lose their overlap."""
        result = None
        row = 0
        for req_id, num_new, num_computed in zip(output.req_ids, output.num_scheduled_tokens,
                                                 output.num_computed_tokens):
            state = self.requests[req_id]
            first_row, row = row, row + num_new
            k = state.sampling_params.prompt_logprobs
            if k is None:
                continue
            # positions [first, last) predict the prompt tokens first + 1 .. last
            first = max(num_computed, state.num_prompt_logprobs)
            last = min(num_computed + num_new, len(state.prompt_token_ids) - 1)
            if first >= last:
                continue
            rows = hidden[first_row + first - num_computed:first_row + last - num_computed]
            targets = torch.tensor(state.prompt_token_ids[first + 1:last + 1],
                                   device=hidden.device)
            result = result or {}
            result[req_id] = self._logprobs_of(rows, targets, k)
            state.num_prompt_logprobs = last
        return result

    def _logprobs_of(self, hidden: Tensor, targets: Tensor, k: int,
                     rows_per_pass: int = 512) -> LogprobsLists:
        """The logprobs of `targets` under the LM head on `hidden`, in slices of rows (a
        float32 [rows, vocab] is what each slice costs)."""
        lists = LogprobsLists([], [], [], [])
        for start in range(0, hidden.shape[0], rows_per_pass):
            logits = self.model.compute_logits(hidden[start:start + rows_per_pass]).float()
            lp = gather_logprobs(logits.log_softmax(-1), targets[start:start + rows_per_pass], k)
            lists.top_token_ids += lp.top_token_ids.tolist()
            lists.top_logprobs += lp.top_logprobs.tolist()
            lists.sampled_logprobs += lp.sampled_logprobs.tolist()
            lists.sampled_ranks += lp.sampled_ranks.tolist()
        return lists

    def sampling_metadata(self, states: list[CachedRequestState], vocab_size: int,
                          last_token_ids: Tensor | None = None) -> SamplingMetadata:
        """The one place a step's sampling inputs are built from the runner's state.
        `last_token_ids`: the step's input tokens at the sampled positions (for bad words and
        thinking budgets)."""
        penalties, slots = self._penalty_slots(states)
        return SamplingMetadata.from_requests(
            states, vocab_size, self.device, fused=self.sampler.fused,
            penalty_state=penalties, penalty_slots=slots, last_token_ids=last_token_ids)

    def _penalty_slots(self, states: list[CachedRequestState]) -> tuple[PenaltyState, list[int]]:
        """Each state's slot in `penalties` (-1: none), given to a request with penalties
        when it first samples (its outputs so far are all known then); it keeps it across
        preemption until it finishes."""
        penalties = self.penalties
        for state in states:
            if state.sampling_params.needs_penalties and state.req_id not in penalties:
                penalties.add(state.req_id, state.prompt_token_ids, state.output_token_ids)
        return penalties, penalties.slots([state.req_id for state in states])

    def _attach_bitmask(self, meta: SamplingMetadata, states: list[CachedRequestState],
                        grammar: GrammarOutput) -> None:
        if grammar.req_ids != [state.req_id for state in states]:
            raise RuntimeError("the grammar bitmask's rows are not the step's sampling rows")
        meta.allowed_token_bitmask = to_device(torch.from_numpy(grammar.bitmask), self.device)

    def _sample(self, logits: Tensor, meta: SamplingMetadata,
                sharded: bool = False) -> SamplerOutput:
        """Sample, and count the tokens of requests with penalties on the device. Under
        tensor parallelism every rank samples the same gathered logits with the same
        generators, and then takes rank 0's tokens: each rank feeds them to its next step, so
        they must agree to the bit even if a sampling kernel were not deterministic.
        `sharded` logits (this rank's vocabulary rows) need no broadcast: every rank reduces
        the same all-gathered winners with one deterministic kernel."""
        if sharded:
            return self.sampler.sample_shard(logits, meta, self.vocab_shard)
        sampled = self.sampler(logits, meta)
        parallel.broadcast_(sampled.sampled_token_ids)
        if meta.penalties is not None:
            self.penalties.update(meta.penalties.rows, sampled.sampled_token_ids)
        return sampled

    def _forward(self, inputs: StepInputs) -> tuple[Tensor, Tensor | None]:
        """The final hidden states, and those of the layers an EAGLE-3 drafter reads (else
        None)."""
        self._bind_kv_cache()
        capture = self.drafter.capture if self.drafter is not None else ()
        # a recall queued for this step: its layers wait for it one by one, a graph at once
        kv_ready = self.tiers.layer_waits() if self.tiers is not None else None
        if inputs.graphs is not None:
            if kv_ready is not None:
                self.tiers.await_recalls()
            out = inputs.graphs.replay(inputs.graph_size, inputs.lora is not None)
            # the streams outlive the step's launches (the drafter reads them once its
            # tokens are back, after the next step's replay under async scheduling)
            return (out[0], out[1].clone()) if capture else (out, None)
        with set_forward_context(inputs.meta, self.backend, kv_ready), \
                lora_context(inputs.lora):
            if capture:
                return self.model.forward_capturing(inputs.input_ids, inputs.positions,
                                                    capture)
            return self.model(inputs.input_ids, inputs.positions), None


def _sample_rows(ends: np.ndarray, num_drafts: np.ndarray) -> np.ndarray:
    """The token rows that get sampled: each sampling request's last, and before it one per
    draft of a verified request (the positions that check its drafts)."""
    if not num_drafts.any():
        return ends - 1
    counts = num_drafts + 1
    firsts = np.repeat(ends - counts, counts)
    offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    return firsts + offsets


def _rank0_outcome(verified: Verified, drafts: list[list[int]],
                   device: torch.device) -> Verified:
    """Rank 0's accepted counts and tokens on every tensor-parallel rank (each rank verifies
    the same gathered logits with the same generators, but feeds the outcome to its next
    step, so the ranks must agree to the bit, as `_sample` makes them for sampled tokens);
    the outcome itself with one rank. Logprobs are rank 0's alone to report."""
    if parallel.get_tp().size == 1:
        return verified
    outcome = torch.tensor([[len(a) for a in verified.accepted], verified.tokens],
                           dtype=torch.int64, device=device)
    counts, tokens = parallel.broadcast_(outcome).tolist()
    return Verified([d[:n] for d, n in zip(drafts, counts)], tokens, verified.logprobs)


def _emitted_logprobs(num_emitted: list[int],
                      *parts: tuple[LogprobsTensors | None, list[int]]) -> LogprobsTensors | None:
    """A verify step's logprobs, one row per token emitted (each row's accepted drafts,
    then its sampled token), from `parts`: (logprobs, the step rows they cover), a row
    each of the ordinary rows' and `num_emitted` each of the verified rows'. The top
    columns are padded to the widest part (past a request's own k, never read)."""
    parts = [(lp, index) for lp, index in parts if lp is not None]
    if not parts:
        return None
    firsts = np.cumsum([0] + num_emitted[:-1])
    total, width = sum(num_emitted), max(lp.top_token_ids.shape[1] for lp, _ in parts)
    device = parts[0][0].sampled_logprobs.device
    out = LogprobsTensors(torch.zeros(total, width, dtype=torch.int64, device=device),
                          torch.zeros(total, width, dtype=torch.float32, device=device),
                          torch.zeros(total, dtype=torch.float32, device=device),
                          torch.ones(total, dtype=torch.int64, device=device))
    for lp, index in parts:
        dest = torch.from_numpy(np.concatenate(
            [np.arange(firsts[i], firsts[i] + num_emitted[i]) for i in index])).to(device)
        columns = lp.top_token_ids.shape[1]
        out.top_token_ids[dest, :columns] = lp.top_token_ids
        out.top_logprobs[dest, :columns] = lp.top_logprobs
        out.sampled_logprobs[dest] = lp.sampled_logprobs
        out.sampled_ranks[dest] = lp.sampled_ranks
    return out


def _unbind_kv_cache(layers: list, first_k_cache: Tensor) -> None:
    """Empty the layers' cache attributes if they still hold the caches bound with
    `first_k_cache` (another engine may have bound its own since)."""
    if layers[0].k_cache is first_k_cache:
        for attention in layers:
            attention.k_cache = attention.v_cache = torch.empty(0)
            attention.kv_scales = None


def _random_sampling_meta(logits: Tensor) -> SamplingMetadata:
    """Every row sampled at temperature 1: the sampler's most memory-hungry common path."""
    rows = logits.shape[0]
    ones = torch.ones(rows, dtype=torch.float32, device=logits.device)
    return SamplingMetadata(
        all_greedy=False, greedy_mask=torch.zeros(rows, dtype=torch.bool, device=logits.device),
        temperature=ones)


def vocab_shard(config: ModelConfig) -> VocabShard | None:
    """This rank's rows of the vocab-parallel LM head, under tensor parallelism; None with
    one rank, or where a slice's first token id is not a multiple of 4 (the sampling
    kernel's noise comes four tokens per call) or a rank holds padding alone."""
    tp = parallel.get_tp()
    rows = parallel.local_vocab(config)
    real = min(rows.stop, config.vocab_size) - rows.start
    if tp.size == 1 or len(rows) % 4 or real <= 0:
        return None
    return VocabShard(rows.start, real, len(rows), tp.size, parallel.gather_last_dim)
