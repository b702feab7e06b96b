"""ModelRunner: owns the device tensors (weights, KV cache) and turns a SchedulerOutput into
sampled tokens.

Per step it builds every input tensor in one go with numpy (no per-token Python loop): on a
2-core CPU the decode step of a 135M model takes tens of milliseconds, so input preparation
must stay far below that. Only the last token of each request whose chunk reaches the end of
its known tokens goes through the LM head and the sampler.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from pagedserve.attention.backend import get_attention_backend, set_forward_context
from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.config import EngineConfig
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.engine.request import Request
from pagedserve.engine.sampler import LogprobsTensors, Sampler, SamplingMetadata
from pagedserve.engine.scheduler import SchedulerOutput
from pagedserve.model.config import ModelConfig
from pagedserve.model.decoder import Decoder


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]  # requests that sampled this step, in row order
    sampled_token_ids: list[int]
    logprobs: LogprobsTensors | None  # rows follow req_ids


@dataclass
class StepInputs:
    input_ids: Tensor
    positions: Tensor
    meta: AttentionMetadata
    logits_indices: Tensor  # rows of the hidden states that get sampled
    sampling_requests: list[Request]


class ModelRunner:
    def __init__(self, config: EngineConfig, model: Decoder, model_config: ModelConfig,
                 device: torch.device) -> None:
        self.config = config
        self.model = model
        self.model_config = model_config
        self.device = device
        self.dtype = next(model.parameters()).dtype
        self.block_size = config.block_size
        self.backend = get_attention_backend(config.attention_backend, device)
        self.sampler = Sampler()
        self.kv_caches: list[tuple[Tensor, Tensor]] = []

    # -- KV cache sizing and allocation ---------------------------------------------------

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers, K and V."""
        mc = self.model_config
        element = torch.empty(0, dtype=self.dtype).element_size()
        return 2 * mc.num_layers * self.block_size * mc.num_kv_heads * mc.head_dim * element

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
        activations of a forward pass at max_num_batched_tokens (measured, not estimated)."""
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        allocated = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self._profile_run()
        peak_activations = torch.cuda.max_memory_allocated(self.device) - allocated
        torch.cuda.empty_cache()
        return int(total * self.config.gpu_memory_utilization - (total - free)
                   - peak_activations)

    def _profile_run(self) -> None:
        """One prefill of max_num_batched_tokens tokens against a throwaway 2-block cache."""
        num_tokens = self.config.max_num_batched_tokens
        self.initialize_kv_cache(2)
        meta = AttentionMetadata(
            num_decodes=0, num_decode_tokens=0,
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=self.device),
            # every logical block maps to the null block: reads are valid, nothing is written
            block_tables=torch.zeros((1, -(-num_tokens // self.block_size)), dtype=torch.int32,
                                     device=self.device),
            seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=self.device),
            query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=self.device),
            max_query_len=num_tokens, max_seq_len=num_tokens)
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        positions = torch.arange(num_tokens, device=self.device)
        with torch.inference_mode(), set_forward_context(meta, self.backend):
            hidden = self.model(ids, positions)
            self.model.compute_logits(hidden[-self.config.max_num_seqs:])
        self.kv_caches = []

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate per-layer K and V per the layout contract and bind them to the layers."""
        mc = self.model_config
        shape = (num_blocks, self.block_size, mc.num_kv_heads, mc.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                           torch.zeros(shape, dtype=self.dtype, device=self.device))
                          for _ in range(mc.num_layers)]
        self._bind_kv_cache()

    def _bind_kv_cache(self) -> None:
        """Point the attention layers at our caches (a model may be shared by engines)."""
        layers = self.model.attention_layers()
        if layers[0].k_cache is self.kv_caches[0][0]:
            return
        for attention, (k_cache, v_cache) in zip(layers, self.kv_caches):
            attention.k_cache, attention.v_cache = k_cache, v_cache

    # -- one step ---------------------------------------------------------------------------

    def prepare_inputs(self, output: SchedulerOutput,
                       kv_cache_manager: KVCacheManager) -> StepInputs:
        requests = [r for r, _ in output.scheduled]
        num_new = np.fromiter((n for _, n in output.scheduled), dtype=np.int64,
                              count=len(requests))
        num_computed = np.fromiter((r.num_computed_tokens for r in requests), dtype=np.int64,
                                   count=len(requests))
        seq_lens = num_computed + num_new
        query_start_loc = np.zeros(len(requests) + 1, dtype=np.int64)
        np.cumsum(num_new, out=query_start_loc[1:])
        req_index = np.repeat(np.arange(len(requests)), num_new)
        positions = (np.arange(query_start_loc[-1]) - query_start_loc[req_index]
                     + num_computed[req_index])

        token_ids: list[int] = []
        for request, start, n in zip(requests, num_computed.tolist(), num_new.tolist()):
            token_ids.extend(request.all_token_ids[start:start + n])
        block_rows = [kv_cache_manager.get_block_ids(r.request_id) for r in requests]
        block_tables = np.zeros((len(requests), max(map(len, block_rows))), dtype=np.int32)
        for i, row in enumerate(block_rows):
            block_tables[i, :len(row)] = row
        bs = self.block_size
        slot_mapping = block_tables[req_index, positions // bs].astype(np.int64) * bs + positions % bs

        samples = seq_lens == np.fromiter((r.num_tokens for r in requests), dtype=np.int64,
                                          count=len(requests))
        device = self.device
        meta = AttentionMetadata(
            num_decodes=output.num_decodes, num_decode_tokens=output.num_decodes,
            slot_mapping=torch.from_numpy(slot_mapping).to(device),
            block_tables=torch.from_numpy(block_tables).to(device),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(device),
            query_start_loc=torch.from_numpy(query_start_loc.astype(np.int32)).to(device),
            max_query_len=int(num_new.max()), max_seq_len=int(seq_lens.max()))
        return StepInputs(
            input_ids=torch.tensor(token_ids, dtype=torch.int64, device=device),
            positions=torch.from_numpy(positions).to(device),
            meta=meta,
            logits_indices=torch.from_numpy(query_start_loc[1:][samples] - 1).to(device),
            sampling_requests=[r for r, s in zip(requests, samples.tolist()) if s])

    @torch.inference_mode()
    def execute_model(self, output: SchedulerOutput,
                      kv_cache_manager: KVCacheManager) -> ModelRunnerOutput:
        inputs = self.prepare_inputs(output, kv_cache_manager)
        self._bind_kv_cache()
        with set_forward_context(inputs.meta, self.backend):
            hidden = self.model(inputs.input_ids, inputs.positions)
        if not inputs.sampling_requests:
            return ModelRunnerOutput([], [], None)
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        sampling_meta = SamplingMetadata.from_requests(
            inputs.sampling_requests, logits.shape[1], self.device)
        sampled = self.sampler(logits, sampling_meta)
        return ModelRunnerOutput(
            req_ids=[r.request_id for r in inputs.sampling_requests],
            sampled_token_ids=sampled.sampled_token_ids.tolist(),
            logprobs=_to_cpu(sampled.logprobs))


def _to_cpu(logprobs: LogprobsTensors | None) -> LogprobsTensors | None:
    if logprobs is None:
        return None
    return LogprobsTensors(*(t.cpu() for t in (logprobs.top_token_ids, logprobs.top_logprobs,
                                                 logprobs.sampled_logprobs,
                                                 logprobs.sampled_ranks)))
