"""Scheduler: continuous batching under a per-step token budget (vLLM v1 style).

There are no separate prefill and decode phases: every request simply has tokens it has
not computed yet (`num_tokens - num_computed_tokens`), a whole prompt, a prefill chunk or
the one token sampled last step. Each step spends `max_num_batched_tokens` first on running
requests, in admission order, then on waiting ones, so prefill chunks mix with decodes.

When the pool runs dry the most recently admitted running request is preempted by
recompute: its blocks are freed tail first (so its prompt prefix stays cached longest),
it restarts from zero computed tokens at the front of the waiting queue, and the prefix
cache usually hands most of its work back on readmission.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from pagedserve.config import EngineConfig
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.engine.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    """This step's work: (request, num_new_tokens) with decodes (one token) first."""

    scheduled: list[tuple[Request, int]]
    num_decodes: int
    preempted: list[Request] = field(default_factory=list)

    @property
    def total_num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: EngineConfig, kv_cache_manager: KVCacheManager,
                 max_model_len: int) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = max_model_len
        self.kv_cache_manager = kv_cache_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order; the tail is preempted first
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.waiting.append(request)
        self.requests[request.request_id] = request

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        preempted: list[Request] = []
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._allocate_or_preempt(request, num_new, preempted):
                break
            scheduled.append((request, num_new))
            budget -= num_new
            index += 1
        if not preempted:
            budget = self._admit_waiting(budget, scheduled)
        scheduled.sort(key=lambda item: item[1] != 1)  # stable: decodes first
        num_decodes = sum(1 for _, n in scheduled if n == 1)
        return SchedulerOutput(scheduled, num_decodes, preempted)

    def _allocate_or_preempt(self, request: Request, num_new: int,
                             preempted: list[Request]) -> bool:
        """Allocate, preempting from the tail until it fits; False if `request` went itself."""
        while self.kv_cache_manager.allocate_slots(request, num_new) is None:
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _admit_waiting(self, budget: int, scheduled: list[tuple[Request, int]]) -> int:
        now = time.time()
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            blocks, num_hit = self.kv_cache_manager.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_hit, budget)
            if self.kv_cache_manager.allocate_slots(request, num_new, blocks, num_hit) is None:
                break
            self.waiting.popleft()
            if request.status == RequestStatus.WAITING:
                request.metrics.num_cached_tokens = num_hit
                request.metrics.first_scheduled_time = now
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit
            self.running.append(request)
            scheduled.append((request, num_new))
            budget -= num_new
        return budget

    def update_from_output(self, output: SchedulerOutput,
                           sampled: dict[str, int]) -> list[Request]:
        """Advance computed tokens, append sampled tokens, finish and free stopped requests.

        Returns the requests that received a token this step.
        """
        progressed = []
        for request, num_new in output.scheduled:
            request.num_computed_tokens += num_new
            token = sampled.get(request.request_id)
            if token is None:
                continue
            request.append_output_token(token)
            progressed.append(request)
            if request.check_stop(self.max_model_len):
                self._finish(request)
        return progressed

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """Finish (e.g. stop string, abort) requests wherever they are; frees their blocks."""
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request in self.waiting:
                self.waiting.remove(request)
            request.status = status
            self._finish(request)

    def _finish(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        self.kv_cache_manager.free(request)
        self.requests.pop(request.request_id, None)
        request.metrics.finished_time = time.time()
