"""Processor: the frontend's input side, from a user's request to engine-core requests.

It tokenizes, truncates the prompt when asked (`truncate_prompt_tokens`), checks the request
against the model (vocabulary, max_model_len, the token ids of logit_bias, stop_token_ids and
allowed_token_ids, the structured-output spec, compiled here so a bad one fails at once),
tokenizes `bad_words`, and fans n > 1 out into child requests `<id>#<i>` whose seeds derive
from the parent's (seed + i). A bad request raises RequestError (a ValueError naming the field)
here, before the core sees it or takes any block: this is the one place these checks live,
shared by the in-process LLMEngine and the server's API process (which maps the error to a
400 naming the field the client sent).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from pagedserve.errors import RequestError
from pagedserve.frontend.lora_registry import LoRARegistry
from pagedserve.messages import EngineCoreRequest, LoRARequest
from pagedserve.sampling_params import SamplingParams
from pagedserve.structured.grammar import GrammarCache
from pagedserve.structured.params import StructuredOutputsParams


def child_request_ids(request_id: str, n: int) -> list[str]:
    """The core request ids of a request's samples: its own id when n == 1."""
    return [request_id] if n == 1 else [f"{request_id}#{i}" for i in range(n)]


class Processor:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int,
                 grammars: Callable[[], GrammarCache],
                 loras: LoRARegistry | None = None) -> None:
        """`grammars` returns the grammar cache, built on first use (it costs a second for a
        large vocabulary); in one process the core's, so a grammar compiles once for both.
        `loras`: the adapters' registry when LoRA is on (None: a request naming one is
        refused)."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.grammars = grammars
        self.loras = loras

    def process(self, request_id: str, prompt: str | None, params: SamplingParams,
                prompt_token_ids: list[int] | None = None, arrival_time: float | None = None,
                cache_salt: str | None = None, lora_request: LoRARequest | None = None
                ) -> tuple[list[int], list[EngineCoreRequest]]:
        """The prompt's token ids (truncated if asked) and one core request per sample.

        `cache_salt` isolates the prefix cache: requests share cached blocks only when their
        salts are equal (it is hashed into the first block, so it reaches the whole chain).
        `lora_request`: the LoRA adapter to run under (checked once per adapter id).
        """
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        token_ids = self.truncate(self.prompt_token_ids(prompt, prompt_token_ids), params)
        self.check_lengths(len(token_ids), params)
        self.check_token_ids(params)
        if params.bad_words:
            params = dataclasses.replace(params, bad_words_token_ids=self.bad_words_token_ids(
                params.bad_words))
        if params.structured_outputs is not None:  # compiled now (and cached): fails early
            self.check_structured_outputs(params.structured_outputs)
        if lora_request is not None:
            if self.loras is None:
                raise RequestError("lora_request needs an engine started with enable_lora",
                                   param="lora_request")
            self.loras.check(lora_request)
        arrival = time.time() if arrival_time is None else arrival_time
        requests = []
        for index, child_id in enumerate(child_request_ids(request_id, params.n)):
            child_params = params
            if params.n > 1:
                seed = None if params.seed is None else params.seed + index
                child_params = dataclasses.replace(params, n=1, seed=seed)
            requests.append(EngineCoreRequest(child_id, token_ids, child_params, arrival,
                                              cache_salt, lora_request))
        return token_ids, requests

    def prompt_token_ids(self, prompt: str | None, prompt_token_ids: list[int] | None
                         ) -> list[int]:
        if prompt_token_ids is None:
            if prompt is None:
                raise RequestError("give a prompt or prompt_token_ids", "prompt")
            prompt_token_ids = self.tokenizer.encode(prompt)
        token_ids = [int(t) for t in prompt_token_ids]
        if not token_ids:
            raise RequestError("The prompt is empty: it must have at least one token.",
                               "prompt")
        self._check_vocabulary(token_ids, "prompt", "prompt token ids")
        return token_ids

    def truncate(self, token_ids: list[int], params: SamplingParams) -> list[int]:
        """The prompt's last `truncate_prompt_tokens` tokens; -1: the most that leave room
        for max_tokens (at least one new token)."""
        keep = params.truncate_prompt_tokens
        if keep is None:
            return token_ids
        if keep == -1:
            keep = self.max_model_len - (params.max_tokens or 1)
        elif keep > self.max_model_len:
            raise RequestError(f"truncate_prompt_tokens is {keep}, more than the model's limit "
                               f"of {self.max_model_len} tokens.", "truncate_prompt_tokens")
        return token_ids[-keep:] if keep > 0 else token_ids

    def check_lengths(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        limit = self.max_model_len
        if num_prompt_tokens >= limit:
            raise RequestError(
                f"The prompt is {num_prompt_tokens} tokens long, which leaves no room to "
                f"generate within the model's limit of {limit} tokens (max_model_len).",
                "prompt", "context_length_exceeded")
        if params.max_tokens is not None and num_prompt_tokens + params.max_tokens > limit:
            raise RequestError(
                f"{{param}} is {params.max_tokens}, but the prompt ({num_prompt_tokens} tokens) "
                f"leaves room for at most {limit - num_prompt_tokens} within the model's limit "
                f"of {limit} tokens (max_model_len).", "max_tokens", "context_length_exceeded")
        if num_prompt_tokens + params.min_tokens > limit:
            raise RequestError(
                f"min_tokens is {params.min_tokens}, but the prompt ({num_prompt_tokens} "
                f"tokens) leaves room for at most {limit - num_prompt_tokens} within the "
                f"model's limit of {limit} tokens (max_model_len).", "min_tokens",
                "context_length_exceeded")

    def check_token_ids(self, params: SamplingParams) -> None:
        """Every token id a request names is in the vocabulary (which also keeps every id
        within the 64 bits the core's messages and tensors hold)."""
        self._check_vocabulary(params.logit_bias or (), "logit_bias", "logit_bias token ids")
        self._check_vocabulary(params.stop_token_ids, "stop_token_ids", "stop_token_ids")
        self._check_vocabulary(params.allowed_token_ids or (), "allowed_token_ids",
                               "allowed_token_ids")
        spec = params.structured_outputs
        if spec is not None and spec.starts_after is not None:
            self._check_vocabulary(spec.starts_after, "structured_outputs",
                                   "structured_outputs.starts_after token ids")
        budget = params.thinking_budget
        if budget is not None:
            self._check_vocabulary(budget.start_token_ids + budget.end_token_ids,
                                   "thinking_budget", "thinking_budget token ids")

    def _check_vocabulary(self, token_ids, param: str, what: str) -> None:
        vocab = self.vocab_size
        bad = [t for t in token_ids if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise RequestError(f"{what} {bad[:5]} are outside the vocabulary [0, {vocab})",
                               param)

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each word's tokens, and those of the word after a space where that is another
        token sequence of the same length (vLLM's rule): a word is banned at the start of the
        output and in the middle of text alike."""
        encode = self.tokenizer.encode
        sequences: list[list[int]] = []
        for word in words:
            plain = list(encode(word.lstrip(), add_special_tokens=False))
            sequences.append(plain)
            spaced = list(encode(" " + word.lstrip(), add_special_tokens=False))
            if spaced[0] != plain[0] and len(spaced) == len(plain):
                sequences.append(spaced)
        return sequences

    def check_structured_outputs(self, spec: StructuredOutputsParams) -> None:
        """Compile `spec` (cached); RequestError naming structured_outputs if it is invalid,
        in the grammar compiler's words (`GrammarCache.get`)."""
        try:
            self.grammars().get(spec)
        except ValueError as exc:
            raise RequestError(str(exc), "structured_outputs") from None
