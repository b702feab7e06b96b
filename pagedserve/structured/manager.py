"""StructuredOutputManager: the engine core's matchers and each step's grammar bitmask.

It sits beside the scheduler, as vLLM's manager of the same name does. A constrained request
gets a matcher over its compiled grammar when it is added; the manager fills one bitmask row
per constrained row that samples in a step and advances a matcher with every token its
request receives. The matcher's state is a function of the request's output tokens alone,
which survive preemption (by recompute or swap), so a preempted request resumes with its
matcher as it left it; each child of an n > 1 request is a request with its own matcher.

Filling rows is host work; `BatchGrammarMatcher` spreads it over threads outside the GIL.
The engine asks for the bitmask after it has launched the step's forward pass, so this work
overlaps the device's (see llm_engine.py).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xgrammar as xgr

from pagedserve.structured.grammar import GrammarCache

logger = logging.getLogger(__name__)


@dataclass
class GrammarOutput:
    """A step's bitmask, one row per sampling row (plain data for the runner): row i of
    `bitmask` (int32, one bit per token id, 1 = allowed) belongs to `req_ids[i]`; an
    unconstrained row allows every token. The array is the manager's buffer (pinned memory
    on CUDA, so its upload does not block), valid until its next `grammar_bitmask` call."""

    req_ids: list[str]
    bitmask: np.ndarray  # int32 [len(req_ids), ceil(vocab_size / 32)]


class StructuredOutputManager:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int],
                 max_num_seqs: int, pin_memory: bool = False) -> None:
        """`stop_token_ids`: the engine's EOS ids, the tokens a finished grammar allows.
        `pin_memory`: the bitmask goes to a GPU (its buffer is then page-locked)."""
        self._tokenizer, self._vocab_size = tokenizer, vocab_size
        self._grammars: GrammarCache | None = None
        self._stop_token_ids = sorted(stop_token_ids)
        self._matchers: dict[str, xgr.GrammarMatcher] = {}
        self._batch = xgr.BatchGrammarMatcher(max_threads=min(8, os.cpu_count() or 1))
        self._bitmask = xgr.allocate_token_bitmask(max_num_seqs, vocab_size)
        if pin_memory:
            self._bitmask = self._bitmask.pin_memory()

    @property
    def grammars(self) -> GrammarCache:
        """Built on first use: its token table costs a second for a large vocabulary."""
        if self._grammars is None:
            self._grammars = GrammarCache(self._tokenizer, self._vocab_size)
        return self._grammars

    def add_request(self, request: Any) -> None:
        spec = request.sampling_params.structured_outputs
        if spec is None:
            return
        matcher = xgr.GrammarMatcher(self.grammars.get(spec),
                                     override_stop_tokens=self._stop_token_ids)
        for token_id in request.output_token_ids:  # a request that arrives with output
            self._accept(request.request_id, matcher, token_id)
        self._matchers[request.request_id] = matcher

    def remove_request(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def has_requests(self) -> bool:
        return bool(self._matchers)

    def is_constrained(self, request_id: str) -> bool:
        return request_id in self._matchers

    def accept_tokens(self, requests: Iterable[Any]) -> None:
        """Advance the matchers of requests that just received a token."""
        for request in requests:
            matcher = self._matchers.get(request.request_id)
            if matcher is not None:
                self._accept(request.request_id, matcher, request.output_token_ids[-1])

    def _accept(self, request_id: str, matcher: xgr.GrammarMatcher, token_id: int) -> None:
        if matcher.is_terminated():
            return  # past the grammar's end (EOS ignored, e.g. under min_tokens): unconstrained
        if not matcher.accept_token(token_id):
            # only reachable if a token was sampled without its mask: stop constraining
            # rather than mask every token from here on
            logger.error("request %s: token %d does not match its grammar; its output is no "
                         "longer constrained", request_id, token_id)
            self._matchers.pop(request_id, None)

    def grammar_bitmask(self, req_ids: Sequence[str]) -> GrammarOutput | None:
        """The bitmask of a step's sampling rows (in order): a constrained row filled by
        its matcher, the others all ones; None when no row is constrained. The rows are
        filled in place in the step's order, so the runner uploads the buffer as it is."""
        indices, matchers = [], []
        for i, req_id in enumerate(req_ids):
            matcher = self._matchers.get(req_id)
            if matcher is not None and not matcher.is_terminated():
                indices.append(i)
                matchers.append(matcher)
        if not matchers:
            return None
        bitmask = self._bitmask[:len(req_ids)]
        if len(matchers) < len(req_ids):
            bitmask.fill_(-1)
        self._batch.batch_fill_next_token_bitmask(matchers, self._bitmask, indices)
        return GrammarOutput(list(req_ids), bitmask.numpy())
