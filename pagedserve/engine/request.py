"""Request: one sequence's state as the scheduler sees it (the runner keeps its own,
`input_batch.CachedRequestState`, built from the plain-data step messages).

Both keep a request's tokens the same way (`TokenSequence`): one list, the prompt then each
token sampled after it, with the output tokens a view at the prompt's length rather than a
second list.

The scheduler owns `Request` objects. The KV cache manager reads them duck-typed
(`request_id`, `all_token_ids`, `num_tokens`, `num_computed_tokens`, `cache_salt`), so the
attribute names here are part of that contract.

`num_computed_tokens` counts the tokens whose KV a scheduled step computes: the scheduler
advances it when it schedules the step, not when the step returns. A step that samples adds
an output *placeholder* (`num_output_placeholders`) that its sampled token replaces when it
arrives; with async scheduling the next step is scheduled before that, as if the token
existed, so `all_token_ids` (the known tokens) can trail the scheduled ones by one or two.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pagedserve.messages import LoRARequest
from pagedserve.sampling_params import SamplingParams
from pagedserve.token_sequence import TokenSequence


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    WAITING_FOR_GRAMMAR = enum.auto()  # queued; not admitted until its grammar compiles
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # everything after this point is finished
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()  # its grammar failed to compile in the core


class FinishReason(str, enum.Enum):
    """The OpenAI-compatible reason strings."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


FIRST_FINISHED = RequestStatus.FINISHED_STOPPED  # statuses from here on are finished

_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    # the wire has no error reason yet: the frontend sees an abort (the core logs why)
    RequestStatus.FINISHED_ERROR: FinishReason.ABORT,
}
FINISH_REASON_VALUES = {status: reason.value for status, reason in _FINISH_REASONS.items()}


@dataclass(eq=False)
class Request(TokenSequence):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # resolved against max_model_len by the engine
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.time)
    cache_salt: str | None = None
    lora_request: LoRARequest | None = None  # None: the base model

    def __post_init__(self) -> None:
        self._init_tokens()
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_output_placeholders = 0  # sampled tokens scheduled but not arrived yet
        self.num_preemptions = 0
        self.stop_reason: int | None = None  # the stop token id that finished it
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at admission
        # (on the device or recalled from its host / disk tiers)
        # a proposer on the device: its drafts to follow the tokens as they stand (from the
        # step that last sampled for this request; the next verify takes them)
        self.spec_token_ids: list[int] = []
        params = self.sampling_params
        # the token ids that may stop it (EOS unless ignored, then stop_token_ids): one set
        # `check_stop` looks into for every token
        self._stop_ids = frozenset(params.stop_token_ids or ()) | (
            frozenset() if params.ignore_eos else frozenset(self.eos_token_ids))

    @property
    def is_finished(self) -> bool:
        return self.status >= FIRST_FINISHED  # read per request per step: no enum property

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self.status)

    def check_stop(self, max_model_len: int) -> bool:
        """Token-level stop checks after a token was appended; sets the status when done.

        Stop *strings* need the detokenized text and are checked by the frontend's output
        processor, which then aborts the request.
        """
        tokens = self.all_token_ids
        num_tokens, last = len(tokens), tokens[-1]
        num_output = num_tokens - self.num_prompt_tokens
        params = self.sampling_params
        if last in self._stop_ids and num_output >= params.min_tokens:
            self.status = RequestStatus.FINISHED_STOPPED
            if params.ignore_eos or last not in self.eos_token_ids:
                self.stop_reason = last  # a stop token id (EOS reports none)
            return True
        if num_output >= self.max_tokens or num_tokens >= max_model_len:
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        return False
