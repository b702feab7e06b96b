"""Processor: the frontend's input side, from a user's request to engine-core requests.

It tokenizes, checks the request against the model (vocabulary, max_model_len, logit_bias
token ids, the structured-output spec, compiled here so a bad one fails at once) and fans
n > 1 out into child requests `<id>#<i>` whose seeds derive from the parent's (seed + i). A bad
request raises ValueError here, before the core sees it or takes any block. Shared by the
in-process LLMEngine and the server's API process.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from pagedserve.engine.messages import EngineCoreRequest
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.structured.grammar import GrammarCache


def child_request_ids(request_id: str, n: int) -> list[str]:
    """The core request ids of a request's samples: its own id when n == 1."""
    return [request_id] if n == 1 else [f"{request_id}#{i}" for i in range(n)]


class Processor:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int,
                 grammars: Callable[[], GrammarCache]) -> None:
        """`grammars` returns the grammar cache, built on first use (it costs a second for a
        large vocabulary); in one process the core's, so a grammar compiles once for both."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.grammars = grammars

    def process(self, request_id: str, prompt: str | None, params: SamplingParams,
                prompt_token_ids: list[int] | None = None, arrival_time: float | None = None,
                cache_salt: str | None = None) -> tuple[list[int], list[EngineCoreRequest]]:
        """The prompt's token ids and one core request per sample.

        `cache_salt` isolates the prefix cache: requests share cached blocks only when their
        salts are equal (it is hashed into the first block, so it reaches the whole chain).
        """
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        token_ids = self.prompt_token_ids(prompt, prompt_token_ids)
        self.check_lengths(len(token_ids), params)
        self.check_logit_bias(params)
        if params.structured_outputs is not None:  # compiled now (and cached): fails early
            self.grammars().get(params.structured_outputs)
        arrival = time.time() if arrival_time is None else arrival_time
        requests = []
        for index, child_id in enumerate(child_request_ids(request_id, params.n)):
            child_params = params
            if params.n > 1:
                seed = None if params.seed is None else params.seed + index
                child_params = dataclasses.replace(params, n=1, seed=seed)
            requests.append(EngineCoreRequest(child_id, token_ids, child_params, arrival,
                                              cache_salt))
        return token_ids, requests

    def prompt_token_ids(self, prompt: str | None, prompt_token_ids: list[int] | None
                         ) -> list[int]:
        if prompt_token_ids is None:
            if prompt is None:
                raise ValueError("give a prompt or prompt_token_ids")
            prompt_token_ids = self.tokenizer.encode(prompt)
        token_ids = [int(t) for t in prompt_token_ids]
        if not token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        return token_ids

    def check_lengths(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        limit = self.max_model_len
        if num_prompt_tokens >= limit:
            raise ValueError(f"the prompt has {num_prompt_tokens} tokens but max_model_len is "
                             f"{limit}: it must leave room for at least one new token")
        if params.max_tokens is not None and num_prompt_tokens + params.max_tokens > limit:
            raise ValueError(f"prompt ({num_prompt_tokens} tokens) + max_tokens "
                             f"({params.max_tokens}) exceeds max_model_len={limit}")

    def check_logit_bias(self, params: SamplingParams) -> None:
        vocab = self.vocab_size
        bad = [t for t in params.logit_bias or {} if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"logit_bias token ids {bad[:5]} are outside the vocabulary "
                             f"[0, {vocab})")
