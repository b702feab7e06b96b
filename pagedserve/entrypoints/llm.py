"""LLM: the offline API (generate / chat) a vLLM user already knows.

It adds every prompt to one LLMEngine up front and steps until all are done, so the whole
batch is continuously batched; results come back in input order whatever order they
finish in.

`LLM(model, ...)` runs the engine core in a process of its own, as the server does
(`LLMEngine(core_process=True)`): this process tokenizes, detokenizes and builds the outputs
of one step while the core already runs the next, so a batch runs at the speed the server
gets. `LLM.from_engine` wraps an engine built here instead (in-process core: shared weights,
inspectable parts).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from pagedserve.entrypoints.chat_template import Message, encode_chat
from pagedserve.frontend.llm_engine import LLMEngine
from pagedserve.frontend.outputs import RequestOutput
from pagedserve.messages import LoRARequest
from pagedserve.sampling_params import SamplingParams

PromptInput = str | Sequence[int]


class LLM:
    def __init__(self, model: str | None = None, **engine_options) -> None:
        self.llm_engine = LLMEngine.from_options(model=model, core_process=True,
                                                 **engine_options)
        self._counter = 0

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        """Wrap an existing engine (e.g. one built over shared weights)."""
        llm = cls.__new__(cls)
        llm.llm_engine, llm._counter = engine, 0
        return llm

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts: PromptInput | Sequence[PromptInput],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """prompts: a string, a list of strings, or a list of token-id lists.
        `lora_request`: the LoRA adapter every prompt runs under, or one per prompt (None:
        the base model); the engine needs enable_lora."""
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        loras = _as_lora_list(lora_request, len(prompts))
        request_ids = []
        try:
            for prompt, p, lora in zip(prompts, params, loras):
                request_ids.append(self._add(prompt, p, lora))
        except Exception:
            self.llm_engine.abort_request(request_ids)
            self.llm_engine.step()  # drain the abort outputs
            raise
        return self._run(request_ids, use_tqdm)

    def chat(self, messages: list[Message] | Sequence[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} dicts) or a list of them.
        `chat_template_kwargs`: variables the template reads, as the server's request field
        (Qwen3's `{"enable_thinking": False}`)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(c, add_generation_prompt, chat_template_kwargs)
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(self, conversation: list[Message],
                            add_generation_prompt: bool = True,
                            chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Render with the tokenizer's template, then tokenize without adding special tokens
        again (the template already wrote them)."""
        return encode_chat(self.llm_engine.tokenizer, conversation, add_generation_prompt,
                           template_kwargs=chat_template_kwargs)

    def _add(self, prompt: PromptInput, params: SamplingParams,
             lora: LoRARequest | None = None) -> str:
        request_id = f"llm-{self._counter}"
        self._counter += 1
        if isinstance(prompt, str):
            self.llm_engine.add_request(request_id, prompt, params, final_only=True,
                                        lora_request=lora)
        else:
            self.llm_engine.add_request(request_id, None, params, prompt_token_ids=list(prompt),
                                        final_only=True, lora_request=lora)
        return request_id

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        engine = self.llm_engine
        with tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm) as bar:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
        return [finished[request_id] for request_id in request_ids]


def _as_prompt_list(prompts) -> list[PromptInput]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and isinstance(prompts[0], int):
        return [prompts]  # a single token-id list
    return prompts


def _as_params_list(params, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} sampling params for {count} prompts")
    return params


def _as_lora_list(lora, count: int) -> list[LoRARequest | None]:
    if lora is None or isinstance(lora, LoRARequest):
        return [lora] * count
    lora = list(lora)
    if len(lora) != count:
        raise ValueError(f"got {len(lora)} lora requests for {count} prompts")
    return lora
