"""Scheduler: continuous batching under a per-step token budget (vLLM v1 style).

There are no separate prefill and decode phases: every request simply has tokens it has
not computed yet (`num_tokens - num_computed_tokens`), a whole prompt, a prefill chunk or
the one token sampled last step. Each step spends `max_num_batched_tokens` first on running
requests, in admission order, then on waiting ones, so prefill chunks mix with decodes.

The waiting queue is in arrival order ("fcfs"), or, under the "priority" policy, in order of
each request's `SamplingParams.priority` (lower first), arrival order within a priority.
The running list is then kept in that order too, so the request a full KV cache preempts
(the tail) is the lowest priority's: a running request yields to a higher-priority one only
through that preemption, never just because one arrived.

A request whose grammar is still compiling (structured outputs, `WAITING_FOR_GRAMMAR`) keeps
its place in the waiting queue but is passed over: the requests behind it are admitted
meanwhile, and it is admitted once the engine core marks its grammar ready
(`grammars_ready`).

When the pool runs dry the most recently admitted running request is preempted and goes
to the front of the waiting queue. By recompute (the default) its blocks are freed tail
first (so its prompt prefix stays cached longest) and it restarts from zero computed
tokens; the prefix cache usually hands most of its work back on readmission. By swap its
computed blocks are first copied to CPU swap space (`swap.py`), and on readmission the
blocks the prefix cache no longer holds are copied back instead of recomputed; a request
that does not fit in the swap space falls back to recompute.

With a host tier (`kv_cache.host_tier`, --kv-offload-memory) the prefix cache reaches past the
device pool: the cached blocks this step's allocations evicted are copied to host slots
(`blocks_to_offload`), and a waiting request whose prefix misses on the device continues its
hash chain in the host tier; the blocks found there count as computed, and they are copied
back into the request's fresh device blocks (`blocks_to_recall`). The copies run on a
stream of their own, layer by layer, and each layer's attention in the step that queues
them waits for its part (`device/tier_copies.py`), so the request computes its new tokens
in that very step, the copy of layer n overlapping the compute of the layers before it: a
recall costs the step only the copy's excess over its compute, shared by the step's other
requests as a recompute's prefill would be, never a step of the request's own. A request
whose device hit includes blocks recalled in this step is passed over until the next.
The decision is the scheduler's alone, so every tensor-parallel rank copies the same blocks
of its own shard and waits for them in the same step. A hit is recalled only where the
recall rule (`recall_rule.py`, from the costs the engine measured at start-up) says its copy
beats recomputing its tokens; a hit it declines is recomputed as without a tier (and the
blocks are offloaded again when evicted: the tier already holds them, so nothing is copied).
Where no hit within the context could pay, the scheduler leaves the tiers alone: no
lookups, no offloads.

With a disk tier below it (--kv-offload-path) the blocks the host tier drops are written to
files (`blocks_to_spill`), and a waiting request whose chain continues on disk past its
host hit first has those blocks loaded into pending host slots (`blocks_to_load`); it is
passed over (it keeps its place) until the step that loads them has come back, whose output
says which files did not read back whole on some rank (`failed_loads`). Those are dropped
from both tiers, and the request is admitted with the chain as far as it held: its prefill
starts where the loaded blocks end, so a broken file costs a recompute, never wrong KV, and
nothing waits on a file for longer than one step.

Scheduling a step advances `num_computed_tokens` at once and gives every request whose chunk
reaches its end an output placeholder (see `request.py`), so the next step can be scheduled
before this one's tokens are back (async scheduling): a placeholder is scheduled as if the
token existed, and the runner reads it from the previous step's sampled tokens on the
device. A request that will have reached max_tokens (or max_model_len) once its placeholders
arrive is not scheduled again. A request finished when its token arrives (a stop) may still
have a step in flight: that step's token is dropped.

Speculative decoding (`pagedserve/spec`; with async scheduling, only in the steps the core
runs synchronously, `may_draft`: a small batch, and for a host proposer a lookup that finds
a draft): a running request
whose only uncomputed token is its last one asks the proposer for up to k drafts and is
scheduled with its last token and the drafts, a verify of k + 1 positions (a short prefill
against its blocks, mixed with the other requests' chunks). Its lookahead slots are
allocated before the step like any chunk's, but the drafts are not known tokens, so no block
is hashed over them. When the tokens come back, the accepted drafts and the sampled token are
placed one by one (a stop ends the run), the rejected drafts are taken off
`num_computed_tokens`, the blocks only they needed go back to the pool (`trim`; the runner
cuts its row to match, `truncated_block_rows`), and the blocks the accepted tokens complete
are hashed. No drafting while more than `disable_by_batch_size` requests run, nor for a
request whose sampling a verify could not keep exact (bad words, thinking budgets and a
grammar that starts after a marker are decided on the host from the tokens before each
position); penalties and grammars are applied per position (`speculates`).

A proposer on the device (a draft model, EAGLE-3 heads: `device/drafter.py`) drafts in the
runner after the step instead: a request that may be drafted for gets its blocks that many
positions past its chunk (`num_lookahead_tokens`; only where they fit without preempting),
given back when the tokens come back; the drafts wait on the request (`spec_token_ids`)
for the next schedule. With async scheduling this too happens only in the steps the core
runs synchronously: none while a step is in flight.

What the runner gets is plain data (`messages.SchedulerOutput`): the batch's request ids,
positions and token counts, the prompt and parameters of requests new to it, and the block
ids `allocate_slots` handed out this step. The scheduler keeps its own list of each launched
step's sampling requests, oldest first, to place the sampled tokens when they come back
(steps complete in launch order).
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Iterable

from pagedserve.config import EngineConfig
from pagedserve.device.swap import SwappedRequest, SwapSpace
from pagedserve.engine.recall_rule import RecallRule
from pagedserve.engine.request import FIRST_FINISHED, Request, RequestStatus
from pagedserve.kv_cache.host_tier import HostTier
from pagedserve.kv_cache.kv_cache_manager import KVCacheManager
from pagedserve.messages import ModelRunnerOutput, NewRequestData, SchedulerOutput
from pagedserve.sampling_params import SamplingParams
from pagedserve.spec.config import SpeculativeConfig
from pagedserve.spec.ngram import Proposer


class Scheduler:
    def __init__(self, config: EngineConfig, kv_cache_manager: KVCacheManager,
                 max_model_len: int, num_cpu_blocks: int = 0,
                 host_tier: HostTier | None = None, proposer: Proposer | None = None,
                 disk_tier: HostTier | None = None,
                 recall_rule: RecallRule | None = None) -> None:
        """`num_cpu_blocks`: the swap space, used when config.preemption_mode is "swap".
        `host_tier`: the prefix cache's host tier, whose slots the runner holds; the
        manager must record its evictions (`record_evictions`). `proposer`: the drafts of
        config.speculative_config's method (None: no speculation). `disk_tier`: the file
        slots below the host tier (needs `host_tier`). `recall_rule`: which of the tiers'
        hits are recalled (None: every one)."""
        self.max_num_seqs = config.max_num_seqs
        # distinct LoRA adapters among the running requests: the runner's device slots
        self.max_loras = config.max_loras if config.enable_lora else 0
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = max_model_len
        self.kv_cache_manager = kv_cache_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order; the tail is preempted first
        self.by_priority = config.scheduling_policy == "priority"  # both queues' order
        self.admission_interval = config.admission_interval or 1
        self._steps_held = 0  # steps since the waiting queue was last looked at (when held)
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.block_size = kv_cache_manager.block_size
        self.swap_space = SwapSpace(num_cpu_blocks) if config.preemption_mode == "swap" else None
        self.swapped: dict[str, SwappedRequest] = {}
        self.num_blocks_swapped_out = 0
        self.num_blocks_swapped_in = 0
        self.host_tier = host_tier
        self.recall_rule = recall_rule
        # the tiers are used at all: some hit within the context may be worth recalling
        self.tiers_pay = host_tier is not None and (recall_rule is None
                                                    or not recall_rule.never_pays)
        self.num_blocks_recalled = 0
        self.num_recalls_declined = 0  # host-tier hits the rule had recomputed instead
        self.disk_tier = disk_tier
        self.num_blocks_loaded = 0  # read back whole from disk
        self.num_failed_loads = 0
        self.tier_copy_seconds = 0.0
        self.tier_stream_seconds = 0.0
        self.num_recall_pass_overs = 0  # waiting requests passed over: their hit was landing
        self.num_offload_steps = 0  # steps whose evictions were copied to the host tier
        self.schedule_seconds = 0.0  # host time in `schedule`
        self._loading: dict[str, list[int]] = {}  # request id -> host slots it waits for
        self._landing: set[int] = set()  # device blocks whose recall this step queues
        self._finished_ids: list[str] = []
        self._steps_in_flight: deque[list[Request]] = deque()  # sampling requests per step
        self.proposer = proposer
        spec = config.speculative_config
        on_device = spec is not None and spec.on_device
        self.spec: SpeculativeConfig | None = spec if proposer or on_device else None
        # a proposer on the device drafts after the step: its slots are allocated with it
        self.lookahead = spec.num_speculative_tokens if on_device else 0
        self._truncated: dict[str, int] = {}  # rows cut since the last step (trim)
        self.spec_stats = SpecStats(self.spec.num_speculative_tokens if self.spec else 0)

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self._enqueue(request)
        self.requests[request.request_id] = request

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def may_draft(self) -> bool:
        """The batch is small enough for drafts (`disable_by_batch_size`) and a draft is
        likely: an engine with async scheduling then steps synchronously, so that every
        running request's tokens are known when it is scheduled (a verify's outcome decides
        the next step's positions; a proposer on the device drafts from the tokens of the
        step before). A proposer on the device drafts every step; a host proposer only
        where its lookup finds something, so it is asked over the tokens known now (a step
        in flight may hold one more): while nothing running would get a draft, the
        pipeline is kept, and an engine speculating on text that does not repeat itself
        runs as fast as one that does not speculate."""
        if self.spec is None or len(self.running) > self.spec.disable_by_batch_size:
            return False
        return self.proposer is None or any(
            speculates(r.sampling_params) and self.proposer.propose(r.all_token_ids, 1)
            for r in self.running)

    def schedule(self) -> SchedulerOutput:
        """The next step (`_schedule`), its host time counted (`schedule_seconds`): the
        bookkeeping a tier adds shows there."""
        start = time.perf_counter()
        out = self._schedule()
        self.schedule_seconds += time.perf_counter() - start
        return out

    def _schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        out = SchedulerOutput(finished_req_ids=self._finished_ids,
                              truncated_block_rows=self._truncated)
        self._finished_ids, self._truncated = [], {}
        self._landing = set()
        scheduled: list[tuple[Request, int]] = []
        index = num_decodes = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            index += 1
            num_pending = request.num_output_placeholders
            num_tokens = len(request.all_token_ids)  # known tokens
            if num_pending and self._ends_in_flight(request, num_tokens, num_pending):
                continue
            num_new = min(num_tokens + num_pending - request.num_computed_tokens, budget)
            drafts = self._drafts(request, budget) if self.spec is not None else None
            if drafts:
                out.draft_token_ids[request.request_id] = drafts
                num_new += len(drafts)
            ahead = self._lookahead(request, request.num_computed_tokens + num_new,
                                    num_pending + len(drafts or ())) if self.lookahead else 0
            if ahead and self._allocate(request, num_new + ahead, out):
                out.num_lookahead_tokens[request.request_id] = ahead
            elif not self._holds_its_slot(request, num_new) and not self._allocate_or_preempt(
                    request, num_new, out):
                out.draft_token_ids.pop(request.request_id, None)  # preempted itself
                break
            scheduled.append((request, num_new))
            budget -= num_new
            num_decodes += num_new == 1
        decodes_only = bool(scheduled) and num_decodes == len(scheduled)
        if not out.preempted_req_ids and not self._holds_admission(decodes_only, out):
            budget = self._admit_waiting(budget, scheduled, out)
        if num_decodes < len(scheduled):  # else the batch is all decodes, in order
            scheduled.sort(key=lambda item: item[1] != 1)  # stable: decodes first
        self._advance(scheduled, out)
        if self.tiers_pay:
            self._offload_evicted(out)
        elif self.host_tier is not None:
            self.kv_cache_manager.take_evicted()  # nothing stored could ever be recalled
        return out

    def _holds_admission(self, decodes_only: bool, out: SchedulerOutput) -> bool:
        """Whether this step leaves the waiting queue alone (`admission_interval`): only
        while the batch is full (more requests wait than there are free slots, and fewer
        slots are free than the interval: each slot freed would be filled at once, one eager
        step each) and the step is decodes only (admitting into a step with a prefill chunk
        costs nothing more), and for at most admission_interval - 1 steps in a row."""
        free = self.max_num_seqs - len(self.running)
        full = len(self.waiting) > free and free < self.admission_interval
        decodes_only = decodes_only and not out.draft_token_ids
        if full and decodes_only and self._steps_held < self.admission_interval - 1:
            self._steps_held += 1
            return True
        self._steps_held = 0
        return False

    def _offload_evicted(self, out: SchedulerOutput) -> None:
        """Copy the cached blocks this step's allocations evicted into the host tier (the
        runner does so before the step overwrites them), and the blocks the host tier
        dropped to disk (before the copies that reuse their slots); the step's pins end
        here."""
        host, disk = self.host_tier, self.disk_tier
        for block_hash, block_id in self.kv_cache_manager.take_evicted():
            slot = host.store(block_hash)
            if slot is not None:
                out.blocks_to_offload.append((block_id, slot))
        self.num_offload_steps += bool(out.blocks_to_offload)
        for block_hash, slot in host.take_dropped():
            disk_slot = disk.store(block_hash) if disk is not None else None
            if disk_slot is not None:
                out.blocks_to_spill.append((slot, disk_slot, block_hash))
        host.end_step()
        if disk is not None:
            disk.take_dropped()  # the file is simply overwritten when its slot is reused
            disk.end_step()

    def _drafts(self, request: Request, budget: int) -> list[int] | None:
        """Up to k drafts for a request whose only uncomputed token is its last (none while
        a step is in flight, whose outcome decides where this one starts; none while the
        batch is large, or for sampling a verify cannot keep exact); never past
        max_tokens, max_model_len or the step's budget. A proposer on the device drafted
        them after the step that sampled the last token (`spec_token_ids`)."""
        spec = self.spec
        if (self._steps_in_flight or request.num_output_placeholders
                or request.num_computed_tokens != request.num_tokens - 1
                or len(self.running) > spec.disable_by_batch_size
                or not speculates(request.sampling_params)):
            return None
        k = min(spec.num_speculative_tokens, budget - 1,
                request.max_tokens - request.num_output_tokens - 1,
                self.max_model_len - request.num_tokens - 1)
        if k <= 0:
            return None
        if self.proposer is None:
            return request.spec_token_ids[:k]
        return self.proposer.propose(request.all_token_ids, k)

    def _lookahead(self, request: Request, end: int, num_unknown: int) -> int:
        """How many drafts a proposer on the device makes for the request after this step,
        whose chunk ends at `end`: none unless it ends where the request samples, it may
        speculate and the batch is small; none while a step is in flight (the next step,
        scheduled before this one's drafts exist, could not verify them, and the
        lookahead's trim must come after the drafts are written); never past
        max_model_len (the draft writes KV that far ahead)."""
        if not self.lookahead or self._steps_in_flight:
            return 0
        if (end != len(request.all_token_ids) + num_unknown
                or len(self.running) > self.spec.disable_by_batch_size
                or not speculates(request.sampling_params)):
            return 0
        return max(0, min(self.lookahead, self.max_model_len - end))

    def _allocate(self, request: Request, num_tokens: int, out: SchedulerOutput) -> bool:
        """Allocate without preempting (a draft's lookahead is not worth a preemption)."""
        blocks = self.kv_cache_manager.allocate_slots(request, num_tokens)
        if blocks is None:
            return False
        self._send_blocks(request, blocks, out)
        return True

    def _ends_in_flight(self, request: Request, num_tokens: int, num_pending: int) -> bool:
        """Its tokens in flight take it to max_tokens or max_model_len: no step can use it."""
        return (num_tokens - request.num_prompt_tokens + num_pending >= request.max_tokens
                or num_tokens + num_pending >= self.max_model_len)

    def _advance(self, scheduled: list[tuple[Request, int]], out: SchedulerOutput) -> None:
        """Write the batch into `out`; count the scheduled chunks as computed, and a
        placeholder for each that samples."""
        out.req_ids = [request.request_id for request, _ in scheduled]
        out.num_scheduled_tokens = counts = [num_new for _, num_new in scheduled]
        out.num_computed_tokens = [request.num_computed_tokens for request, _ in scheduled]
        samples, sampling, drafts = out.samples, [], out.draft_token_ids
        for request, num_new in scheduled:
            end = request.num_computed_tokens = request.num_computed_tokens + num_new
            num_drafts = len(drafts.get(request.request_id, ())) if drafts else 0
            sample = end == (len(request.all_token_ids) + request.num_output_placeholders
                             + num_drafts)
            if sample:
                request.num_output_placeholders += 1
                sampling.append(request)
            samples.append(sample)
        out.num_decodes, out.total_num_scheduled_tokens = counts.count(1), sum(counts)
        if scheduled:
            self._steps_in_flight.append(sampling)

    def _holds_its_slot(self, request: Request, num_new: int) -> bool:
        """A decode for which allocate_slots would do nothing, skipped: it saves a visible
        part of a large batch's step (docs/benchmarks.md, "Host-side costs behind the
        engine's choices" and "The engine's host work per step at batch 256"). Its token
        lands inside its last block, neither starting a block (which needs a new one) nor
        completing one (which the manager must cache); or it completes the block while the
        token is in flight (async scheduling: the block is cached by update_from_output
        when the token arrives), where no sliding window frees blocks behind it."""
        position = request.num_computed_tokens
        offset = position % self.block_size
        if num_new != 1 or offset == 0:
            return False
        if offset < self.block_size - 1:
            return True
        return (position >= len(request.all_token_ids)
                and self.kv_cache_manager.sliding_window is None)

    def _allocate_or_preempt(self, request: Request, num_new: int,
                             out: SchedulerOutput) -> bool:
        """Allocate, preempting from the tail until it fits; False if `request` went itself.
        The tail has not been scheduled this step, so no victim is in the batch."""
        while (blocks := self.kv_cache_manager.allocate_slots(request, num_new)) is None:
            victim = self.running.pop()
            self._preempt(victim, out)
            out.preempted_req_ids.append(victim.request_id)
            if victim is request:
                return False
        self._send_blocks(request, blocks, out)
        return True

    def _send_blocks(self, request: Request, blocks: list, out: SchedulerOutput) -> None:
        """Tell the runner of a running request's new blocks."""
        windowed = self.kv_cache_manager.sliding_window is not None
        if blocks or windowed:  # a window may have nulled leading blocks
            out.scheduled_cached_reqs.append(
                request.request_id, False, [block.block_id for block in blocks],
                self._num_nulled_blocks(request) if windowed else 0)

    def _num_nulled_blocks(self, request: Request) -> int:
        """Leading entries of the request's table that are the null block (out of its
        window); they are always a prefix, so a binary search finds their end."""
        blocks = self.kv_cache_manager.req_to_blocks[request.request_id]
        low, high = 0, len(blocks)
        while low < high:
            middle = (low + high) // 2
            if blocks[middle].is_null:
                low = middle + 1
            else:
                high = middle
        return low

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        if self.swap_space is not None and request.num_computed_tokens > 0:
            self._swap_out(request, out)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(request, front=True)

    def _enqueue(self, request: Request, front: bool = False) -> None:
        """Into the waiting queue: at its end, or its front (preempted), in fcfs order; by
        priority then arrival under the priority policy (a preempted request arrived before
        the later ones of its priority, so it goes before them)."""
        if self.by_priority:
            bisect.insort_right(self.waiting, request, key=_priority_order)
        elif front:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

    def _swap_out(self, request: Request, out: SchedulerOutput) -> None:
        """Reserve CPU blocks for the request's computed KV and queue the copy; without room,
        the request is simply recomputed."""
        num_blocks = -(-request.num_computed_tokens // self.block_size)
        cpu_ids = self.swap_space.allocate(num_blocks)
        if cpu_ids is None:
            return
        gpu_ids = self.kv_cache_manager.get_block_ids(request.request_id)[:num_blocks]
        out.blocks_to_swap_out.extend(zip(gpu_ids, cpu_ids))
        self.num_blocks_swapped_out += num_blocks
        self.swapped[request.request_id] = SwappedRequest(cpu_ids, request.num_computed_tokens)

    def grammars_ready(self, request_ids: Iterable[str]) -> None:
        """These requests' grammars have compiled: they may be admitted from now on."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None and request.status == RequestStatus.WAITING_FOR_GRAMMAR:
                request.status = RequestStatus.WAITING

    def _admit_waiting(self, budget: int, scheduled: list[tuple[Request, int]],
                       out: SchedulerOutput) -> int:
        """Admit from the front of the queue while the budget, the batch and the pool allow,
        passing over requests whose grammar is still compiling, and those whose LoRA adapter
        would be one more than the runner's slots hold (they keep their place)."""
        skipped = 0
        adapters = {r.lora_request.lora_int_id for r in self.running if r.lora_request}
        while len(self.waiting) > skipped and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[skipped]
            lora = request.lora_request
            if request.status == RequestStatus.WAITING_FOR_GRAMMAR or (
                    lora is not None and lora.lora_int_id not in adapters
                    and len(adapters) >= self.max_loras):
                skipped += 1
                continue
            blocks, num_hit = [], 0
            looked_up = request.sampling_params.prompt_logprobs is None  # else: every logit
            if looked_up:
                blocks, num_hit = self.kv_cache_manager.get_computed_blocks(request)
            if self._landing and any(block.block_id in self._landing for block in blocks):
                skipped += 1  # its hit is being recalled: it keeps its place until landed
                self.num_recall_pass_overs += 1
                continue
            swapped = self.swapped.get(request.request_id)
            found = self._host_hits(request, num_hit) if swapped is None else None
            # a hit the rule declines is recomputed, and nothing is read from disk past it
            declined = bool(found) and not self._recall_pays(num_hit, len(found))
            if found is not None and not declined and self._waits_for_loads(
                    request, num_hit + len(found) * self.block_size, out):
                skipped += 1  # keeps its place until its blocks are read from disk
                continue
            slots = [] if declined or found is None else found
            # tokens whose KV is present before this step: prefix hits, then swapped-in or
            # recalled blocks
            num_ready = (max(num_hit, swapped.num_computed_tokens) if swapped
                         else num_hit + len(slots) * self.block_size)
            # a recall lands layer by layer in this step, before each layer's attention
            num_new = min(request.num_tokens - num_ready, budget)
            ahead = self._lookahead(request, num_ready + num_new, 0) if num_new else 0
            if ahead and self.kv_cache_manager.allocate_slots(
                    request, num_ready - num_hit + num_new + ahead, blocks, num_hit) is not None:
                out.num_lookahead_tokens[request.request_id] = ahead
            elif self.kv_cache_manager.allocate_slots(
                    request, num_ready - num_hit + num_new, blocks, num_hit) is None:
                break
            del self.waiting[skipped]
            if looked_up and not request.num_preemptions:  # once a prompt (`record_lookup`)
                self.kv_cache_manager.record_lookup(request, num_hit)
            if declined:
                self.num_recalls_declined += len(found)
            if swapped is not None:
                self._swap_in(request, swapped, num_hit, out)
            if slots:
                self._recall(request, slots, num_hit, out)
            self._add_to_batch_data(request, num_hit, num_ready, out)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_ready
            if lora is not None:
                adapters.add(lora.lora_int_id)
            if self.by_priority:
                bisect.insort_right(self.running, request, key=_priority_order)
            else:
                self.running.append(request)
            if num_new:
                scheduled.append((request, num_new))
                budget -= num_new
        return budget

    def _add_to_batch_data(self, request: Request, num_hit: int, num_ready: int,
                           out: SchedulerOutput) -> None:
        """What the runner needs to know of an admitted request: all of it when new; when
        resumed after preemption, its new blocks (its tokens are the runner's already)."""
        block_ids = self.kv_cache_manager.get_block_ids(request.request_id)
        if request.status == RequestStatus.WAITING:
            request.num_cached_tokens = num_ready  # the device's hit and its tiers'
            out.scheduled_new_reqs.append(NewRequestData(
                request.request_id, request.prompt_token_ids, request.sampling_params,
                block_ids, num_ready, request.lora_request))
        else:
            out.scheduled_cached_reqs.append(request.request_id, True, block_ids)

    def _swap_in(self, request: Request, swapped: SwappedRequest, num_hit: int,
                 out: SchedulerOutput) -> None:
        """Queue the copy back of the blocks that the prefix hit did not already provide."""
        gpu_ids = self.kv_cache_manager.get_block_ids(request.request_id)
        last = -(-swapped.num_computed_tokens // self.block_size)
        first = num_hit // self.block_size
        out.blocks_to_swap_in.extend(
            (swapped.cpu_block_ids[i], gpu_ids[i]) for i in range(first, last))
        self.num_blocks_swapped_in += max(0, last - first)
        self._release_swap(request)

    def _host_hits(self, request: Request, num_hit: int) -> list[int] | None:
        """Host slots of the request's prefix blocks past its device hit, while the chain
        holds. None when the tiers are not used for it: for prompt logprobs (they need
        every position's logits), or where no hit could pay (`tiers_pay`)."""
        if not self.tiers_pay or request.sampling_params.prompt_logprobs is not None:
            return None
        return self.host_tier.lookup(
            self.kv_cache_manager.prefix_hashes(request, num_hit // self.block_size))

    def _recall_pays(self, first_token: int, num_blocks: int) -> bool:
        """The one place a tier's hit is weighed: recalled when the rule says the copy of
        its `num_blocks` blocks from prompt position `first_token` beats their recompute."""
        return self.recall_rule is None or self.recall_rule.pays(first_token, num_blocks)

    def _waits_for_loads(self, request: Request, num_found: int, out: SchedulerOutput) -> bool:
        """Whether the request waits for blocks read from disk: loads it started and that
        have not come back, or loads it starts now, for its chain past the `num_found`
        tokens found on the device and in host memory. Once its loads are back it is
        admitted with what they found (no second round on this admission)."""
        if self.disk_tier is None or request.sampling_params.prompt_logprobs is not None:
            return False
        waits = self._loading.get(request.request_id)
        if waits is not None:
            if any(self.host_tier.is_pending(slot) for slot in waits):
                return True
            del self._loading[request.request_id]
            return False
        waits = self._start_loads(request, num_found // self.block_size, out)
        if waits:
            self._loading[request.request_id] = waits
        return bool(waits)

    def _start_loads(self, request: Request, first: int, out: SchedulerOutput) -> list[int]:
        """Queue loads of the request's blocks from `first` on while the chain holds on disk
        and the host tier has room; the pending host slots to wait for (a block another
        request is loading already is waited for, not loaded twice)."""
        hashes = self.kv_cache_manager.prefix_hashes(request, first)
        disk_slots = self.disk_tier.lookup(hashes)
        if disk_slots and not self._recall_pays(first * self.block_size, len(disk_slots)):
            return []  # a file read and a copy, slower than the recompute
        waits = []
        for block_hash, disk_slot in zip(hashes, disk_slots):
            slot = self.host_tier.pending_slot(block_hash)
            if slot is None:
                slot = self.host_tier.store(block_hash, pending=True)
                if slot is None:
                    break
                out.blocks_to_load.append((disk_slot, slot, block_hash))
            waits.append(slot)
        return waits

    def _resolve_loads(self, output: SchedulerOutput, runner_output: ModelRunnerOutput) -> None:
        """A step's loads are back: the blocks read whole become host-tier blocks; a broken
        file is a miss, forgotten by both tiers."""
        failed = set(runner_output.failed_loads)
        for i, (_, slot, block_hash) in enumerate(output.blocks_to_load):
            ok = i not in failed
            self.host_tier.resolve(slot, ok)
            if ok:
                self.num_blocks_loaded += 1
            else:
                self.num_failed_loads += 1
                self.disk_tier.discard(block_hash)

    def _recall(self, request: Request, slots: list[int], num_hit: int,
                out: SchedulerOutput) -> None:
        """Queue the copy of the host-tier blocks into the request's blocks after its device
        hit (a null entry, out of a sliding window, needs no copy)."""
        blocks = self.kv_cache_manager.req_to_blocks[request.request_id]
        first = num_hit // self.block_size
        pairs = [(slot, block.block_id)
                 for slot, block in zip(slots, blocks[first:first + len(slots)])
                 if not block.is_null]
        out.blocks_to_recall.extend(pairs)
        self._landing.update(block_id for _, block_id in pairs)
        self.num_blocks_recalled += len(pairs)

    def _release_swap(self, request: Request) -> None:
        swapped = self.swapped.pop(request.request_id, None)
        if swapped is not None:
            self.swap_space.free(swapped.cpu_block_ids)

    def update_from_output(self, output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[tuple[Request, int]]:
        """Put the sampled tokens of the oldest step in flight (`output`) in place of their
        placeholders, after a verified request's accepted drafts; finish and free stopped
        requests. A request that finished while the step was in flight drops its token.

        Returns the requests that received tokens this step, each with how many.
        """
        self.tier_copy_seconds += runner_output.tier_copy_seconds
        self.tier_stream_seconds += runner_output.tier_stream_seconds
        if output.blocks_to_load:
            self._resolve_loads(output, runner_output)
        if not output.req_ids:
            return []
        sampling = self._steps_in_flight.popleft()
        tokens = runner_output.sampled_token_ids
        if len(tokens) != len(sampling):
            raise RuntimeError(f"the runner sampled {len(tokens)} tokens for a step that "
                               f"samples {len(sampling)}: outputs out of order")
        progressed = []
        block_size, max_model_len = self.block_size, self.max_model_len
        drafts, accepted = output.draft_token_ids, runner_output.accepted_token_ids
        proposed = runner_output.draft_token_ids or {}
        lookahead, ahead = self.lookahead, output.num_lookahead_tokens
        for row, (request, token) in enumerate(zip(sampling, tokens)):
            if request.status >= FIRST_FINISHED:  # `is_finished`, read per request per step
                continue
            request.num_output_placeholders -= 1
            if lookahead:
                request.spec_token_ids = proposed.get(request.request_id, [])
            if drafts and request.request_id in drafts:
                progressed.append((request, self._place_verified(
                    request, drafts[request.request_id], accepted[row], token)))
                continue
            request.append_output_token(token)
            progressed.append((request, 1))
            num_tokens = len(request.all_token_ids)
            if request.check_stop(max_model_len):
                self._finish(request)
                continue
            if ahead and request.request_id in ahead:
                self._trim(request)  # the drafter's positions past the known tokens
            if (num_tokens % block_size == 0 and request.num_computed_tokens >= num_tokens
                  and request.status == RequestStatus.RUNNING):
                # the token completes a block that a step already in flight computes: it
                # could not be cached at scheduling, as its last token was unknown
                self.kv_cache_manager.cache_blocks(request, num_tokens)
        return progressed

    def _place_verified(self, request: Request, drafts: list[int], accepted: list[int],
                        token: int) -> int:
        """Place a verify's accepted drafts and its sampled token until one stops the
        request; give back what the rejected drafts held. Returns the tokens placed."""
        self.spec_stats.record(len(drafts), len(accepted))
        request.num_computed_tokens -= len(drafts) - len(accepted)
        placed = 0
        for new in (*accepted, token):
            request.append_output_token(new)
            placed += 1
            if request.check_stop(self.max_model_len):
                self._finish(request)
                return placed
        self._trim(request)
        self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
        return placed

    def _trim(self, request: Request) -> None:
        """Give back the blocks past the request's known tokens (rejected drafts', a
        proposer's lookahead); the runner cuts its row before the next step."""
        kept = self.kv_cache_manager.trim(request, request.num_computed_tokens + 1)
        if kept is not None:
            self._truncated[request.request_id] = kept

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """Finish (e.g. stop string, abort) requests wherever they are; frees their blocks."""
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            request.status = status
            self._finish(request)

    def _finish(self, request: Request) -> None:
        """Also for a waiting request: one preempted while its token was in flight can stop
        when the token arrives."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv_cache_manager.free(request)
        self._release_swap(request)
        self._truncated.pop(request.request_id, None)
        self._loading.pop(request.request_id, None)
        self._finished_ids.append(request.request_id)
        self.requests.pop(request.request_id, None)


def _priority_order(request: Request) -> tuple[int, float]:
    return request.sampling_params.priority, request.arrival_time


def speculates(params: SamplingParams) -> bool:
    """Whether a verify keeps this sampling exact. Penalties and grammars are applied per
    position as of the drafts before it (the runner's penalty counts, the grammar's masks);
    bad words, thinking budgets and a grammar that starts after a marker are decided by the
    host between steps from the tokens before each position, which a verify does not
    have."""
    structured = params.structured_outputs
    return not (params.bad_words_token_ids or params.thinking_budget is not None
                or (structured is not None and structured.starts_after is not None))


class SpecStats:
    """Speculative decoding's counters since start (the scheduler records each verify)."""

    def __init__(self, k: int) -> None:
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * k

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1
