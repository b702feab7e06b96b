"""LLMEngine: add_request / step / abort_request.

It is the three parts the server splits over two processes, called in turn: the Processor
(tokenize, validate, fan out n > 1 into child requests `<id>#<i>` with seeds seed + i), the
EngineCore (scheduler, KV cache, model runner; token ids only) and the OutputProcessor (text,
stop strings, logprobs, RequestOutputs). Single-threaded by design.

The core runs in this process (the default: its parts can be inspected, engines can share
loaded weights) or, with `core_process=True`, in a process of its own behind
`core_client.RemoteEngineCore`, as the server runs it: the core then steps on while this
process turns the previous steps' tokens into text, so output work never delays the device
(the offline `LLM` does this).

All children of a request are queued together, so they are usually admitted in the same
step: the KV cache manager indexes a block as soon as the step that writes it is scheduled,
and the attention backends write a step's K/V before attending, so children after the first
hit the first child's prompt blocks in the prefix cache and share them (only the last,
partial block and the generated tokens are per child).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from pagedserve.config import EngineConfig
from pagedserve.device.loading import LoadedModel
from pagedserve.device.model_runner import ModelRunner
from pagedserve.engine.core import EngineCore
from pagedserve.engine.scheduler import Scheduler
from pagedserve.frontend.core_client import RemoteEngineCore
from pagedserve.frontend.output_processor import OutputProcessor
from pagedserve.frontend.outputs import EngineStats, RequestOutput
from pagedserve.frontend.lora_registry import LoRARegistry
from pagedserve.frontend.processor import Processor
from pagedserve.kv_cache.kv_cache_manager import KVCacheManager
from pagedserve.messages import LoRARequest
from pagedserve.model.tokenizer_ref import as_loaded
from pagedserve.sampling_params import SamplingParams
from pagedserve.structured.manager import StructuredOutputManager
from pagedserve.structured.remote import GrammarProcess

__all__ = ["LLMEngine", "LoadedModel"]


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None,
                 core_process: bool = False) -> None:
        """`loaded` lets tests and benchmarks build engines with other KV budgets or
        scheduling options over one copy of the weights instead of reloading them.
        `core_process`: the engine core in a process of its own (see the module docstring)."""
        if core_process and loaded is not None:
            raise ValueError("an engine core in its own process loads its own weights: "
                             "it cannot share loaded ones")
        self.engine_core = core = (RemoteEngineCore(config) if core_process
                                   else EngineCore(config, loaded))
        self.config = core.config  # with the batch limits resolved
        self.loaded = core.loaded
        self.model_config = core.model_config
        self.tokenizer = as_loaded(core.tokenizer)  # a core built alone reads only a ref
        loras = (LoRARegistry(self.model_config, self.config.max_lora_rank)
                 if self.config.enable_lora else None)
        self.processor = Processor(self.tokenizer, self.model_config.vocab_size,
                                   core.max_model_len, lambda: core.grammars, loras)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._aborted_outputs: list[RequestOutput] = []

    @classmethod
    def from_options(cls, model: str | None = None, core_process: bool = False,
                     **options) -> LLMEngine:
        return cls(EngineConfig.from_options(model=model, **options),
                   core_process=core_process)

    # the core's parts, for introspection (stats, benchmarks, the CLI)
    @property
    def scheduler(self) -> Scheduler:
        return self.engine_core.scheduler

    @property
    def kv_cache_manager(self) -> KVCacheManager:
        return self.engine_core.kv_cache_manager

    @property
    def model_runner(self) -> ModelRunner:
        return self.engine_core.model_runner

    @property
    def num_blocks(self) -> int:
        return self.engine_core.num_blocks

    @property
    def max_model_len(self) -> int:
        return self.engine_core.max_model_len

    @property
    def async_scheduling(self) -> bool:
        return self.engine_core.async_scheduling

    @property
    def structured(self) -> StructuredOutputManager | GrammarProcess:
        return self.engine_core.structured

    def shutdown(self) -> None:
        """Stop the core's process, the tensor-parallel workers and the grammar process now
        (else when the engine is collected or the process exits)."""
        self.engine_core.shutdown()

    # -- requests -----------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | None, params: SamplingParams,
                    prompt_token_ids: list[int] | None = None,
                    arrival_time: float | None = None, cache_salt: str | None = None,
                    final_only: bool = False, lora_request: LoRARequest | None = None) -> None:
        """Validate and queue; raises ValueError (taking no block) when the request is bad.

        `cache_salt` isolates the prefix cache (see Processor.process); `final_only`: step()
        reports the request only once it has finished (see OutputProcessor.add_request);
        `lora_request`: the LoRA adapter it runs under (None: the base model).
        """
        token_ids, core_requests = self.processor.process(
            request_id, prompt, params, prompt_token_ids, arrival_time, cache_salt,
            lora_request)
        self.output_processor.add_request(request_id, prompt, token_ids, params, core_requests,
                                          final_only)
        for core_request in core_requests:
            self.engine_core.add_request(core_request)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Finish requests at once, freeing their blocks; the next step() reports them."""
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        now = time.time()
        for request_id in request_ids:
            output, core_ids = self.output_processor.abort_request(request_id, now)
            if output is not None:
                self.engine_core.abort_requests(core_ids)
                self._aborted_outputs.append(output)

    def has_unfinished_requests(self) -> bool:
        """True while a step is in flight too: its results must be collected (or dropped)."""
        return (self.output_processor.has_unfinished_requests() or bool(self._aborted_outputs)
                or self.engine_core.has_unfinished_requests())

    # -- the step -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run a core step; return the outputs of the requests that progressed (with async
        scheduling, in the step that was in flight), after the ones aborted since."""
        outputs, self._aborted_outputs = self._aborted_outputs, []
        request_outputs, stopped = self.output_processor.process_outputs(self.engine_core.step())
        if stopped:
            self.engine_core.abort_requests(stopped)
        return outputs + request_outputs

    def get_stats(self) -> EngineStats:
        processed = self.output_processor
        return EngineStats.of(self.engine_core.make_stats(), processed.prompt_tokens_total,
                              processed.generation_tokens_total)
