"""The plain-data messages between the engine's parts, as msgspec Structs.

Two boundaries cross them, so neither side needs the other's objects:

- frontend <-> engine core: `EngineCoreRequest` in (one per sample: the frontend has already
  fanned out n), `EngineCoreOutputs` back, one per model step for the whole batch;
- scheduler -> model runner (in process, or every tensor-parallel worker: `executor.py`):
  `SchedulerOutput`, answered by `ModelRunnerOutput`.

Every field is plain data (str, int, float, lists, SamplingParams, which is a dataclass), never
a torch tensor or a scheduler `Request`, so a message can go through msgpack to another process
and mean the same there. `encode` / `decode` are the one way they are serialized. The structs
made per request per step hold no cycles and skip the garbage collector (`gc=False`).

The scheduler -> runner message carries only what changed: a request's prompt and sampling
parameters once, when it is first scheduled (`NewRequestData`); after that only the block ids
allocated since its previous step (`CachedRequestData`). The runner keeps the rest itself
(`input_batch.CachedRequestState`).
"""

from __future__ import annotations

from functools import cache
from typing import TypeVar

import msgspec

from pagedserve.config import EngineConfig
from pagedserve.sampling_params import SamplingParams

T = TypeVar("T")

_encoder = msgspec.msgpack.Encoder()


class Message(msgspec.Struct, forbid_unknown_fields=True):
    """Base of every message: a field the receiver does not know is an error, so a message
    decoded as the wrong type (or from a mismatched version) fails loudly."""


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes | memoryview, message_type: type[T]) -> T:
    return _decoder(message_type).decode(data)


@cache
def _decoder(message_type: type[T]) -> msgspec.msgpack.Decoder:
    """One decoder per type: building one compiles the type's schema."""
    return msgspec.msgpack.Decoder(message_type)


# -- frontend <-> engine core ----------------------------------------------------------------

class LoRARequest(Message, array_like=True, frozen=True):
    """A LoRA adapter a request runs under (PEFT's format in folder `path`). `lora_int_id`
    names its KV in the prefix cache and its weights in the runner's caches: positive, and
    never reused for other weights (the server gives each load a new one)."""

    lora_name: str
    lora_int_id: int
    lora_path: str


class EngineCoreRequest(Message, tag="add"):
    """One sample to generate; the prompt is already tokenized and validated."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams  # n == 1: children carry their own derived seed
    arrival_time: float
    cache_salt: str | None = None
    lora_request: LoRARequest | None = None  # None: the base model


class LogprobsLists(Message, array_like=True):
    """Logprobs of rows: a step's sampling rows (top lists as wide as the batch's largest
    ask), or a request's prompt positions (`sampled_*`: the prompt's own next token)."""

    top_token_ids: list[list[int]]
    top_logprobs: list[list[float]]
    sampled_logprobs: list[float]
    sampled_ranks: list[int]


class TokenLogprobs(Message, array_like=True, gc=False):
    """The raw model distribution at one generated token (the OpenAI API's logprobs)."""

    top_token_ids: list[int]  # the request's `logprobs` most likely tokens, best first
    top_logprobs: list[float]
    sampled_logprob: float
    sampled_rank: int  # 1 = the most likely token


class EngineCoreOutput(Message, array_like=True, omit_defaults=True, gc=False):
    """What one core request got in one step: token ids only (the frontend makes the text)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None  # one per new token, if asked for
    finish_reason: str | None = None  # "stop" | "length" | "abort"; None while running
    stop_reason: int | None = None  # the stop token id that matched
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served at admission
    # with the first token of a request that asked for them: one row per prompt position
    # after the first (the logprob of that position's token given the ones before it)
    prompt_logprobs: LogprobsLists | None = None
    # why the core finished it on its own ("abort"): its grammar failed to compile
    error: str | None = None


class SchedulerStats(Message):
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of non-null blocks in use
    prefix_cache_queries: int  # tokens looked up in the prefix cache, since start
    prefix_cache_hits: int  # tokens found
    num_preemptions: int
    num_gpu_blocks: int
    prefix_cache_evictions: int = 0  # cached blocks reused for other content
    num_blocks_swapped_out: int = 0  # KV blocks copied to CPU memory by preemption, since start
    num_blocks_swapped_in: int = 0  # and copied back for resumption
    # the host tier (kv_cache/host_tier.py), in blocks since start: found by lookups (recalled),
    # copied in (offloaded), dropped from it
    host_tier_hits: int = 0
    host_tier_stores: int = 0
    host_tier_evictions: int = 0
    host_tier_declined: int = 0  # hit blocks recomputed instead: the recall rule's choice
    # speculative decoding, since start: verifies, draft tokens proposed, drafts accepted,
    # and accepted drafts at each position of a draft (index 0: its first token)
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = []
    # the disk tier (--kv-offload-path), in blocks since start: read back whole into the host
    # tier (hits; their recalls count as the host tier's too), written, dropped, and read
    # back broken (a miss: recomputed)
    disk_tier_hits: int = 0
    disk_tier_stores: int = 0
    disk_tier_evictions: int = 0
    disk_tier_load_failures: int = 0
    kv_block_bytes: int = 0  # one block on one rank, all layers (tier bytes = blocks * this)
    tier_copy_seconds: float = 0.0  # the runner's time in tier copies and file I/O, since start
    tier_stream_seconds: float = 0.0  # the copy stream's time in them (CUDA), since start
    # waiting requests passed over in a step because their hit was being recalled, since start
    tier_recall_pass_overs: int = 0
    tier_offload_steps: int = 0  # steps that copied evicted blocks to the host tier, since start
    schedule_seconds: float = 0.0  # the scheduler's host time in schedule(), since start
    # where the steps' time goes, since start (a host-bound step from a device-bound one):
    # steps that launched a forward pass, the core's time blocked on a step's tokens (its
    # runner's, or the ranks' under tensor parallelism), the runner's (rank 0's) own time
    # blocked on the device for them, and the device's time on the steps (rank 0's CUDA
    # events, launch to tokens; 0 on the CPU)
    num_steps: int = 0
    step_wait_seconds: float = 0.0
    device_wait_seconds: float = 0.0
    device_seconds: float = 0.0
    # sampled steps that replayed a CUDA graph, since start: decode graphs, verify graphs
    # (speculative decoding: k + 1 tokens a request)
    num_decode_graph_steps: int = 0
    num_verify_graph_steps: int = 0


class EngineCoreOutputs(Message, tag="outputs"):
    """One step's outputs for every request that received a token."""

    outputs: list[EngineCoreOutput]
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0  # time.time() when the step's tokens were processed


# -- scheduler -> model runner ---------------------------------------------------------------

class NewRequestData(Message, array_like=True):
    """A request scheduled for the first time: everything the runner keeps about it."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]  # all of its blocks, prefix-cache hits included
    num_computed_tokens: int  # tokens whose KV is already there (prefix-cache hit)
    lora_request: LoRARequest | None = None


class CachedRequestData(Message, array_like=True):
    """Requests the runner already knows whose blocks changed this step, one column per field.

    Running requests whose blocks did not change appear only in `SchedulerOutput.req_ids`. A
    request resumed after preemption lists all of its blocks and replaces its block-table row
    (its KV was recomputed or swapped back into new blocks); its tokens, including those it
    sampled before preemption, are still the runner's own. With a sliding window, blocks
    wholly before the window go back to the pool: `num_nulled_blocks` leading entries of the
    row are then the null block.
    """

    req_ids: list[str] = []
    resumed: list[bool] = []
    new_block_ids: list[list[int]] = []
    num_nulled_blocks: list[int] = []

    def append(self, req_id: str, resumed: bool, block_ids: list[int],
               num_nulled: int = 0) -> None:
        self.req_ids.append(req_id)
        self.resumed.append(resumed)
        self.new_block_ids.append(block_ids)
        self.num_nulled_blocks.append(num_nulled)


class SchedulerOutput(Message, tag="execute"):
    """One step's work. The batch is `req_ids` in order, decodes (one new token) first;
    the per-request lists follow that order.

    A request's chunk covers tokens [num_computed_tokens[i], num_computed_tokens[i] +
    num_scheduled_tokens[i]); `samples[i]` says whether the chunk reaches the end of its
    scheduled tokens, so that the step samples its next token (runner output rows follow the
    sampling requests in batch order). A token the runner has not received yet (async
    scheduling) is the one it sampled for that request in its previous step.
    The runner performs the block copies before the forward pass: swap-outs and offloads
    read GPU blocks that this step may hand to other requests, swap-ins and recalls fill
    blocks this step attends to. Offloads go before recalls: a recall may fill a block
    that an offload of the same step reads (`kv_cache.host_tier`, H2).
    """

    req_ids: list[str] = []
    num_scheduled_tokens: list[int] = []
    num_computed_tokens: list[int] = []
    samples: list[bool] = []
    num_decodes: int = 0
    total_num_scheduled_tokens: int = 0
    scheduled_new_reqs: list[NewRequestData] = []
    scheduled_cached_reqs: CachedRequestData = msgspec.field(default_factory=CachedRequestData)
    finished_req_ids: list[str] = []  # finished or aborted since the previous step
    preempted_req_ids: list[str] = []  # preempted this step (their blocks are freed)
    blocks_to_swap_out: list[tuple[int, int]] = []  # (gpu, cpu)
    blocks_to_swap_in: list[tuple[int, int]] = []  # (cpu, gpu)
    blocks_to_offload: list[tuple[int, int]] = []  # (gpu, host tier slot)
    blocks_to_recall: list[tuple[int, int]] = []  # (host tier slot, gpu)
    # speculative decoding: a verified request's chunk is its last known token then these
    # drafts (its last scheduled tokens); the step samples its k + 1 positions
    draft_token_ids: dict[str, list[int]] = {}
    # a proposer on the device (draft_model, eagle3): the requests it drafts for once this
    # step's tokens are known, each with how many drafts; their blocks reach that far ahead
    num_lookahead_tokens: dict[str, int] = {}
    # requests whose rejected drafts' blocks went back to the pool: each keeps this many
    # leading entries of its block-table row (applied before this step's new blocks)
    truncated_block_rows: dict[str, int] = {}
    # the disk tier (kv_cache/disk_format.py), before the offloads: host slots written to files
    # (host slot, disk slot, block hash); after them, files read into host slots (disk slot,
    # host slot, block hash), whose outcome comes back in ModelRunnerOutput.failed_loads
    blocks_to_spill: list[tuple[int, int, bytes | int]] = []
    blocks_to_load: list[tuple[int, int, bytes | int]] = []

    @property
    def sampling_req_ids(self) -> list[str]:
        """The requests this step samples for, in batch order: the rows of its sampled tokens
        (and of its grammar bitmask)."""
        return [req_id for req_id, sample in zip(self.req_ids, self.samples) if sample]

    @property
    def is_empty(self) -> bool:
        """Nothing for the runner to do at all, not even to forget a finished request, to
        learn of an admitted one or to copy blocks."""
        return not (self.req_ids or self.scheduled_new_reqs or self.scheduled_cached_reqs.req_ids
                    or self.finished_req_ids or self.preempted_req_ids
                    or self.blocks_to_swap_out or self.blocks_to_swap_in
                    or self.blocks_to_offload or self.blocks_to_recall
                    or self.blocks_to_spill or self.blocks_to_load)


class ModelRunnerOutput(Message, array_like=True):
    req_ids: list[str]  # the requests that sampled this step, in batch order
    sampled_token_ids: list[int]
    # a row per token: with accepted_token_ids, a row's accepted drafts then its sampled token
    logprobs: LogprobsLists | None = None
    # requests with prompt_logprobs whose prompt positions this step computed
    prompt_logprobs: dict[str, LogprobsLists] | None = None
    # speculative decoding: per row, the drafts accepted before its sampled token (which is
    # the bonus or the replacement of the first rejected draft); None when none verified
    accepted_token_ids: list[list[int]] | None = None
    # indices into the step's blocks_to_load whose file did not read back whole on some rank
    failed_loads: list[int] = []
    tier_copy_seconds: float = 0.0  # this step's tier copies and file I/O (rank 0's)
    # the copy stream's time in tier copies that finished since the last report (CUDA events)
    tier_stream_seconds: float = 0.0
    # a proposer on the device: the drafts for each request of num_lookahead_tokens, to
    # follow its tokens as they stand after this step (the next step verifies them)
    draft_token_ids: dict[str, list[int]] | None = None
    device_wait_seconds: float = 0.0  # the runner's time blocked on the device for this step
    device_seconds: float = 0.0  # the device's, from the step's launch to its tokens (CUDA)
    # the query length of the CUDA graph the step replayed (1: decodes; k + 1: verifies);
    # 0: it ran eagerly
    graph_query_len: int = 0


# -- engine-core process start-up (core_proc.py -> core_client.py) ----------------------------

class EngineCoreReady(Message, tag="ready"):
    """The core's answer once its model is loaded and its KV cache sized: what the frontend
    process needs and cannot know before (the limits resolved from the device and the model)."""

    tokenizer: str  # the folder or .gguf file the frontend loads its tokenizer from
    vocab_size: int
    max_model_len: int
    num_gpu_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_cache_dtype: str  # as /v1/models reports it: "bfloat16", "fp8_e4m3", ...
    quantization: str | None
    device: str
    # LoRA: the largest adapter rank (0: LoRA is off), and the model's config (ModelConfig's
    # JSON) that the frontend checks adapters against
    max_lora_rank: int = 0
    model_config: str = ""


class EngineCoreFailed(Message, tag="failed"):
    """Why the core could not start, or why it stopped: sent before the process exits."""

    error: str


class AbortRequests(Message, tag="abort"):
    """Requests the frontend has stopped (a stop string, a client gone)."""

    request_ids: list[str]


class ShutdownCore(Message, tag="shutdown"):
    """Leave the loop and exit: the frontend is shutting down."""


# what each side of the engine-core channel may send (ipc.Channel: tagged, one frame each)
ToEngineCore = EngineCoreRequest | AbortRequests | ShutdownCore
FromEngineCore = EngineCoreReady | EngineCoreOutputs | EngineCoreFailed


# -- engine core <-> tensor-parallel workers (executor.py, worker.py) -------------------------

class WorkerHello(Message, tag="hello"):
    """A worker's first word once connected: which rank it is."""

    rank: int
    size: int
    pid: int
    host: str


class WorkerLoaded(Message, tag="loaded"):
    """A rank's weights are in: what the engine needs to choose its batch limits."""

    device_type: str  # "cuda" | "cpu"
    total_memory: int | None  # the GPU's, None on the CPU
    weight_bytes: int  # this rank's shard
    dtype: str  # the activations', e.g. "bfloat16"
    quantization: str | None


class WorkerBlocks(Message, tag="blocks"):
    """The KV blocks that fit a rank's free memory, and the bytes of one on that rank."""

    num_blocks: int
    block_bytes: int
    kv_cache_dtype: str  # e.g. "bfloat16", "float8_e4m3fn"


class KVCacheSpec(Message, tag="initialize"):
    """The one KV cache shape every rank allocates (block tables are the same on every rank)."""

    num_blocks: int
    num_cpu_blocks: int
    max_model_len: int
    num_host_tier_blocks: int = 0  # the prefix cache's host tier (kv_cache/host_tier.py)
    # the disk tier: its run directory (kv_cache/disk_format.py) and fingerprint digest
    disk_tier_dir: str | None = None
    disk_tier_digest: bytes = b""


class GrammarBitmask(Message, array_like=True):
    """`structured.manager.GrammarOutput` as bytes: int32 rows of `num_words` words."""

    req_ids: list[str]
    bitmask: bytes
    num_words: int


class WorkerFailure(Message, tag="error"):
    """A rank's exception, as text: the engine raises it."""

    rank: int
    error: str


class LoadWeights(Message, tag="load"):
    """Join the group and load this rank's shard of the weights."""

    config: EngineConfig


class ProfileMemory(Message, tag="profile"):
    """Build the runner and size the KV cache in this rank's free memory."""

    config: EngineConfig


class SampleTokens(Message, tag="sample"):
    """Sample the oldest launched step (under the grammar's bitmask rows, if any)."""

    grammar: GrammarBitmask | None = None


class CollectOutput(Message, tag="collect"):
    """Take in the oldest sampled step's tokens; rank 0 sends them (ModelRunnerOutput)."""


class ShutdownWorker(Message, tag="shutdown"):
    """Leave: the engine is stopping (the worker answers WorkerBye first)."""


class TierCosts(msgspec.Struct, frozen=True):
    """What a rank measured at start-up for the host tier's recall rule
    (`engine/recall_rule.py`), in seconds: copying one block from a host slot into the pool
    (`block_copy_s`, over `copy_blocks` blocks), a prefill's cost per token (`token_s`)
    and per token per context token (`token_context_s`, the attention's growth; both fitted to
    prefills of `prefill_tokens` tokens at two sequence lengths), and the least a step costs
    (`step_s`: a one-request decode step), the least compute a recall's copy overlaps."""

    block_copy_s: float
    token_s: float
    token_context_s: float
    step_s: float
    copy_blocks: int
    prefill_tokens: int


class WorkerInitialized(Message, tag="initialized"):
    """The KV cache is allocated (the answer to KVCacheSpec); with a host tier, what this
    rank measured of its copies and prefill."""

    tier_costs: TierCosts | None = None


class CollectedOutput(Message, tag="output"):
    """Rank 0's answer to CollectOutput (a union of tagged Structs may not mix array-like
    ones, which ModelRunnerOutput is for its size, with the others)."""

    output: ModelRunnerOutput


class WorkerBye(Message, tag="bye"):
    """The answer to ShutdownWorker: the engine may close its socket now."""


class StartProfile(Message, tag="start_profile"):
    """Rank 0: run torch.profiler over the calls that follow (device/step_profile.py)."""


class StopProfile(Message, tag="stop_profile"):
    """Rank 0: stop the profiler and write its Chrome trace to `trace_path`; every rank
    answers ProfileStopped (then the file is complete)."""

    trace_path: str


class ProfileStopped(Message, tag="profile_stopped"):
    """The answer to StopProfile."""


# what each side of a rank's channel may send (ipc.Channel: tagged, one frame each)
ToWorker = (LoadWeights | ProfileMemory | KVCacheSpec | SchedulerOutput | SampleTokens
            | CollectOutput | ShutdownWorker | StartProfile | StopProfile)
FromWorker = (WorkerHello | WorkerLoaded | WorkerBlocks | WorkerInitialized | CollectedOutput
              | WorkerFailure | WorkerBye | ProfileStopped)
