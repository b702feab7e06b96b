"""What the engine hands back: RequestOutput, CompletionOutput, Logprob, RequestMetrics,
EngineStats.

`text` and `token_ids` are cumulative (what an offline caller wants); `text_delta` and
`token_ids_delta` hold only what is new since this request's previous output (what a
streaming consumer wants), so neither side has to diff.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from pagedserve.messages import SchedulerStats


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (time.time()) and the prefix-cache reuse of one request."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str | None = None


# one dict per generated token: token id -> Logprob (the top ones plus the sampled one)
SampleLogprobs = list[dict[int, Logprob]]
# one per prompt token: None for the first, then the token's own entry plus the top ones
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop" | "length" | "abort"; None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that matched
    text_delta: str = ""
    token_ids_delta: list[int] = field(default_factory=list)
    error: str | None = None  # why the engine finished it ("abort"): a grammar that failed

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None  # SamplingParams.prompt_logprobs

    def absorb(self, earlier: RequestOutput) -> None:
        """Stand for `earlier` too, an output of this request that nobody consumed: its
        deltas go in front of ours (text and token_ids are cumulative already)."""
        previous = {c.index: c for c in earlier.outputs}
        for c in self.outputs:
            p = previous.get(c.index)
            if p is not None:
                c.text_delta = p.text_delta + c.text_delta
                c.token_ids_delta = p.token_ids_delta + c.token_ids_delta


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of non-null blocks in use
    prefix_cache_queries: int  # tokens looked up in the prefix cache
    prefix_cache_hits: int  # tokens found
    num_preemptions: int
    prompt_tokens_total: int
    generation_tokens_total: int
    num_gpu_blocks: int = 0
    prefix_cache_evictions: int = 0  # cached blocks reused for other content
    num_blocks_swapped_out: int = 0  # KV blocks swapped to CPU memory (preemption_mode swap)
    num_blocks_swapped_in: int = 0
    host_tier_hits: int = 0  # blocks recalled from the host tier (kv_cache/host_tier.py)
    host_tier_stores: int = 0  # evicted blocks copied into it
    host_tier_evictions: int = 0  # blocks dropped from it
    host_tier_declined: int = 0  # hit blocks recomputed: the recall rule found that faster
    disk_tier_hits: int = 0  # blocks read back whole from the disk tier (--kv-offload-path)
    disk_tier_stores: int = 0  # blocks written to it
    disk_tier_evictions: int = 0  # blocks dropped from it (their files reused)
    disk_tier_load_failures: int = 0  # files that did not read back whole (recomputed)
    kv_block_bytes: int = 0  # one KV block on one rank (tier bytes = blocks * this)
    tier_copy_seconds: float = 0.0  # the runner's time in tier copies and file I/O
    tier_stream_seconds: float = 0.0  # the copy stream's time in them (CUDA)
    tier_recall_pass_overs: int = 0  # waiting requests passed over: their hit was landing
    tier_offload_steps: int = 0  # steps that copied evicted blocks to the host tier
    schedule_seconds: float = 0.0  # the scheduler's host time in schedule()
    # steps that launched a forward pass; the core's time blocked on their tokens, the
    # runner's (rank 0's) time blocked on the device for them, the device's time on them
    # (see SchedulerStats)
    num_steps: int = 0
    step_wait_seconds: float = 0.0
    device_wait_seconds: float = 0.0
    device_seconds: float = 0.0
    # sampled steps that replayed a CUDA graph of decodes, and of verifies (see
    # SchedulerStats)
    num_decode_graph_steps: int = 0
    num_verify_graph_steps: int = 0
    # speculative decoding: verifies, draft tokens, accepted drafts, and accepted drafts at
    # each position of a draft
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = field(default_factory=list)

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens a verify emits on average: its accepted drafts and the one it samples."""
        return (1 + self.spec_num_accepted_tokens / self.spec_num_drafts
                if self.spec_num_drafts else 0.0)

    @classmethod
    def of(cls, scheduler: SchedulerStats, prompt_tokens_total: int,
           generation_tokens_total: int) -> EngineStats:
        """The core's scheduler stats with the frontend's token counts, in one place for the
        offline engine and the server (a field added to SchedulerStats arrives in both)."""
        return cls(**msgspec.structs.asdict(scheduler), prompt_tokens_total=prompt_tokens_total,
                   generation_tokens_total=generation_tokens_total)
