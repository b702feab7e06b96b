"""EngineConfig: every engine option in one dataclass, with defaults and validation.

Options that depend on the model or the machine (dtype "auto", max_model_len None, the KV
budget, the batch limits) stay unresolved here; the engine resolves them once the model is
loaded and the KV cache is sized, so a config can be built and validated without touching any
weights.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from pagedserve.spec.config import SpeculativeConfig

ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")
PREEMPTION_MODES = ("recompute", "swap")
DTYPES = ("auto", "float32", "float16", "bfloat16")
HASH_ALGOS = ("sha256", "xxhash")
KV_CACHE_DTYPES = ("auto", "fp8")  # auto: the model's dtype; fp8: e4m3 (attention/kv_quant.py)
QUANTIZATIONS = ("fp8",)  # weights (model/fp8.py)
LOAD_FORMATS = ("auto", "dummy")  # dummy: random weights (model/dummy.py)
SCHEDULING_POLICIES = ("fcfs", "priority")  # the waiting queue's order (engine/scheduler.py)

# Batch limits when left to auto. The CPU's are where its bench is best. A GPU step costs
# about the same from a few sequences up to hundreds (decode reads the weights once either
# way), so a GPU takes as many as its memory allows: tiers of the memory left for the KV
# cache and activations once the weights are in, (GiB at least, max_num_seqs,
# max_num_batched_tokens), largest first.
CPU_BATCH_LIMITS = (64, 2048)
GPU_BATCH_LIMITS = ((48, 256, 16384), (16, 256, 8192), (0, 128, 4096))


@dataclass
class EngineConfig:
    """Engine options; `LLMEngine.from_options(**kwargs)` builds one from keyword arguments."""

    model: str | None = None  # HF folder or .gguf file; None = the default SmolLM2 GGUF
    tokenizer: str | None = None  # defaults to what the loader reports for `model`
    dtype: str = "auto"  # "auto": float32 on CPU (a GGUF's fast mode), bfloat16 on CUDA
    device: str = "auto"  # "auto": cuda when available, else cpu
    seed: int = 0  # seeds the global generator used by unseeded random sampling
    # "fp8": FP8 weights in the dense projections, quantized at load unless the checkpoint
    # is FP8 already; None = the checkpoint's own (FP8 for an FP8 checkpoint)
    quantization: str | None = None
    # "dummy": random weights for a folder with only config.json and a tokenizer, the same
    # whatever the tensor-parallel size (model/dummy.py); for measuring shapes
    load_format: str = "auto"
    # KV cache
    block_size: int = 16
    # "fp8": the cache in e4m3 with per-layer, per-KV-head scales (half the bytes per token)
    kv_cache_dtype: str = "auto"
    kv_cache_memory: int | None = None  # bytes for K and V of all layers; None = measured
    gpu_memory_utilization: float = 0.9  # CUDA: fraction of total memory the engine may use
    cpu_kv_cache_fraction: float = 0.25  # CPU: fraction of available RAM for the KV cache
    cpu_kv_cache_cap: int = 2 << 30  # CPU: never take more than this by default
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"
    # root of the block-hash chain; None = random per process (hashes cannot be predicted
    # across tenants); replicas behind a prefix-aware router set the same seed
    prefix_caching_hash_seed: str | None = None
    # publish the prefix cache's block events (stored / removed / cleared) on a ZeroMQ PUB
    # socket bound here, e.g. "tcp://*:5557" (see kv_cache/kv_events.py); None = not recorded
    kv_events_endpoint: str | None = None
    # answer replay requests for missed event batches on a ZeroMQ ROUTER socket bound here,
    # e.g. "tcp://*:5558" (needs kv_events_endpoint); None = no replay
    kv_events_replay_endpoint: str | None = None
    # scheduling; None = chosen by the engine for the device and model (resolve_batch_limits)
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None  # None = the model's limit, capped by the KV cache
    # "recompute" frees a preempted request's blocks and recomputes its KV on readmission;
    # "swap" copies them to pinned CPU memory (swap_space bytes) and back
    preemption_mode: str = "recompute"
    # the waiting queue's order: "fcfs" by arrival; "priority" by each request's
    # SamplingParams.priority (lower first), then arrival; also which running request a full
    # KV cache preempts first (the lowest priority's)
    scheduling_policy: str = "fcfs"
    # with more requests waiting than the batch has free slots, fewer slots free than this,
    # and every running request decoding, look at the waiting queue at most once every this
    # many steps: a step that admits a request runs its prefill beside the decodes, eagerly
    # (a CUDA decode graph serves only steps of decodes), so admitting each freed slot at
    # once makes a step in three of a long queue eager; held, the freed slots of several
    # steps fill in one. None = 16 where decode steps replay CUDA graphs (CUDA, not
    # enforce_eager), 1 (every step) elsewhere
    admission_interval: int | None = None
    swap_space: int = 4 << 30  # bytes of CPU memory for swapped-out blocks ("swap" mode)
    # bytes of host memory (pinned on CUDA) for the prefix cache's second tier: cached blocks
    # evicted from the device pool are kept there and recalled on a later hit
    # (kv_cache/host_tier.py); 0 = off
    kv_offload_memory: int = 0
    # a directory for the prefix cache's disk tier, below the host tier: blocks the host tier
    # drops are written to files there, read back through it, and found again by a restart
    # with the same model, dtypes, block size, KV layout and hash seed
    # (kv_cache/disk_format.py); None = off. kv_offload_disk: the bytes of files it may keep
    kv_offload_path: str | None = None
    kv_offload_disk: int = 16 << 30
    # execution
    attention_backend: str = "auto"  # "auto" | "torch" | "cpu" | "triton"
    enforce_eager: bool = False  # CUDA: no CUDA graphs (decode, verify); the CPU: always eager
    # schedule and launch step N+1 before waiting for step N's tokens, so the CPU work of a
    # step overlaps the GPU's; None = on for CUDA, off for the CPU (which runs a step
    # synchronously: there is nothing to overlap)
    async_scheduling: bool | None = None
    # structured outputs: the grammar matchers in a process of their own rather than on
    # threads of the engine's (structured/remote.py); None = on for CUDA, off on the CPU
    grammar_process: bool | None = None
    # tensor parallelism: ranks that each hold a shard of the weights and of the KV heads,
    # one worker process each (device/executor.py); on CUDA rank r uses GPU r
    tensor_parallel_size: int = 1
    # None: the engine starts its workers on this host; an address ("tcp://*:5600"): it binds
    # there and waits for tensor_parallel_size workers started elsewhere (torchrun)
    tensor_parallel_address: str | None = None
    # tensor parallelism on one host's GPUs: all-reduces up to this many bytes go through
    # peer-mapped memory (model/allreduce.py), larger ones through NCCL; 0 = NCCL for all
    peer_all_reduce_max_bytes: int = 8 << 20
    # ... and where peer memory takes it, the all-reduce after o_proj and down_proj fused
    # with the residual add and RMSNorm that follow: one kernel (model/allreduce.py)
    fuse_all_reduce_norm: bool = True
    # ... that fusion for the messages two-shot takes too (one-shot's: fuse_all_reduce_norm);
    # False: two-shot's messages sum, then normalise in a kernel of its own
    fuse_two_shot_all_reduce_norm: bool = True
    # ... the one-shot fused kernel pushing each rank's partial product into every peer's
    # buffer before its barrier and summing locally after it, instead of reading the peers'
    # buffers after it (kernels/triton/allreduce_norm.py): off until measured on the GPU
    all_reduce_push: bool = False
    # CUDA: the float linears' decode steps of one row through the split-K Triton GEMV
    # (kernels/triton/dense_gemv.py); False: cuBLAS at every row count
    dense_gemv: bool = True
    # CUDA, a GGUF kept in its blocks: decode steps of one token quantize the activations to
    # int8 for the Q4_K and Q6_K linears (kernels/triton/gguf_dp4a.py, integer dot products);
    # False: float activations (kernels/triton/gguf_gemv.py)
    gguf_int8_activations: bool = True
    # LoRA adapters (model/lora.py): requests may name one; at most max_loras distinct ones
    # run in a step (device slots of rank up to max_lora_rank), max_cpu_loras stay loaded in
    # host memory behind them (None: max_loras)
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # speculative decoding (pagedserve/spec): a SpeculativeConfig, its dict or its JSON text,
    # e.g. {"method": "ngram", "num_speculative_tokens": 4}; None = off. The dict and text are
    # parsed in __post_init__; the annotation names only the parsed form, the one the
    # tensor-parallel workers decode (msgspec takes one dict-like type in a union)
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        self._check_choice("dtype", DTYPES)
        self._check_choice("attention_backend", ATTENTION_BACKENDS)
        self._check_choice("preemption_mode", PREEMPTION_MODES)
        self._check_choice("prefix_caching_hash_algo", HASH_ALGOS)
        self._check_choice("kv_cache_dtype", KV_CACHE_DTYPES)
        self._check_choice("load_format", LOAD_FORMATS)
        self._check_choice("scheduling_policy", SCHEDULING_POLICIES)
        if self.quantization is not None:
            self._check_choice("quantization", QUANTIZATIONS)
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.admission_interval is not None and self.admission_interval < 1:
            raise ValueError(f"admission_interval must be >= 1, got {self.admission_interval}")
        if self.async_scheduling not in (None, True, False):
            raise ValueError("async_scheduling must be True, False or None (auto), "
                             f"got {self.async_scheduling!r}")
        if self.grammar_process not in (None, True, False):
            raise ValueError("grammar_process must be True, False or None (auto), "
                             f"got {self.grammar_process!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.tensor_parallel_address is not None and self.tensor_parallel_size == 1:
            raise ValueError("tensor_parallel_address needs tensor_parallel_size > 1")
        if self.peer_all_reduce_max_bytes < 0:
            raise ValueError("peer_all_reduce_max_bytes must be >= 0, got "
                             f"{self.peer_all_reduce_max_bytes}")
        if self.kv_events_replay_endpoint is not None and self.kv_events_endpoint is None:
            raise ValueError("kv_events_replay_endpoint needs kv_events_endpoint")
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 bytes, got {self.swap_space}")
        if self.kv_offload_memory < 0:
            raise ValueError(f"kv_offload_memory must be >= 0 bytes, got {self.kv_offload_memory}")
        if self.kv_offload_disk <= 0:
            raise ValueError(f"kv_offload_disk must be > 0 bytes, got {self.kv_offload_disk}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1], "
                             f"got {self.gpu_memory_utilization}")
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError("max_loras and max_lora_rank must be >= 1, got "
                             f"{self.max_loras} and {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                             f"({self.max_loras})")
        if not 0.0 < self.cpu_kv_cache_fraction <= 1.0:
            raise ValueError("cpu_kv_cache_fraction must be in (0, 1], "
                             f"got {self.cpu_kv_cache_fraction}")

    def _check_choice(self, name: str, choices: tuple[str, ...]) -> None:
        if getattr(self, name) not in choices:
            raise ValueError(f"{name} must be one of {choices}, got {getattr(self, name)!r}")

    @classmethod
    def from_options(cls, **options) -> EngineConfig:
        """Build from keyword options, rejecting unknown names with the list of valid ones."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; valid: {sorted(known)}")
        return cls(**options)


def resolve_batch_limits(config: EngineConfig, device_type: str, total_memory: int | None,
                         weight_bytes: int) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens): the config's where set, else the defaults for
    the device. On CUDA they follow what the GPU has left after the weights (`total_memory`
    times gpu_memory_utilization, minus `weight_bytes`): bigger batches amortize each step's
    weight reads, and the activations of max_num_batched_tokens tokens must still leave the KV
    cache room for that many sequences."""
    if device_type == "cuda":
        left_gib = max(0.0, (total_memory * config.gpu_memory_utilization - weight_bytes)
                       / (1 << 30))
        seqs, tokens = next((s, t) for gib, s, t in GPU_BATCH_LIMITS if left_gib >= gib)
    else:
        seqs, tokens = CPU_BATCH_LIMITS
    return (seqs if config.max_num_seqs is None else config.max_num_seqs,
            tokens if config.max_num_batched_tokens is None else config.max_num_batched_tokens)
