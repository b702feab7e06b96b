"""SamplingParams: how one request's tokens are chosen and when its generation stops.

Names and defaults follow vLLM so that code written for it carries over. Every value is
checked here, at construction, so a bad request fails before it reaches the scheduler; a bad
value raises RequestError naming its field. What needs the model (the vocabulary, the
context length, the tokenizer) is checked by the Processor.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.errors import RequestError
from pagedserve.structured.params import StructuredOutputsParams
from pagedserve.thinking_budget import ThinkingBudget

_GREEDY_EPS = 1e-5  # temperatures below this are treated as greedy (argmax)
_MAX_TOP_K = 2**31 - 1  # beyond any vocabulary; the sampler holds top_k in int64 tensors
_SEEDS = (-(2**63), 2**64 - 1)  # a torch generator's 64-bit seed


@dataclass
class SamplingParams:
    n: int = 1  # parallel samples per prompt
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus: keep the smallest set with cumulative prob >= top_p
    top_k: int = 0  # keep the k most likely tokens; 0 or -1 = all
    min_p: float = 0.0  # drop tokens whose prob < min_p * max prob
    repetition_penalty: float = 1.0  # HF/CTRL style, over prompt and output tokens
    presence_penalty: float = 0.0  # OpenAI style, over output tokens
    frequency_penalty: float = 0.0  # OpenAI style, over output tokens
    seed: int | None = None  # per-request generator: same seed -> same tokens, any batch
    max_tokens: int | None = 16  # None = up to the model's max length
    min_tokens: int = 0  # eos / stop_token_ids are ignored before this many tokens
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # return this many top logprobs (+ the sampled token's)
    # vLLM's extension: per prompt position, the logprob of the prompt's next token and
    # this many top ones. Such a request skips the prefix cache (its positions need logits).
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # with special tokens kept: a space between an added token and the text around it, as
    # transformers' slow tokenizers decode; False joins them as the fast tokenizers do
    spaces_between_special_tokens: bool = True
    # keep only the prompt's last k tokens (-1: as many as leave room for max_tokens)
    truncate_prompt_tokens: int | None = None
    allowed_token_ids: list[int] | None = None  # only these tokens can be sampled
    # words that are never generated: the last token of a word is banned wherever the output
    # ends with the tokens before it (each word with and without a leading space)
    bad_words: list[str] | None = None
    # bad_words as token ids; set by the Processor, which holds the tokenizer
    bad_words_token_ids: list[list[int]] | None = None
    # the output must match a JSON schema, any JSON object, a regex, a choice or an EBNF
    # grammar (pagedserve/structured)
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    # at most this many tokens inside a reasoning block, then its end is forced
    # (thinking_budget.py)
    thinking_budget: ThinkingBudget | None = None
    # scheduling, not sampling, but it travels with the request to the scheduler this way:
    # under the "priority" policy lower values are admitted first (EngineConfig)
    priority: int = 0
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.stop_strings = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()
        if self.is_greedy:
            self.temperature = 0.0
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def _validate(self) -> None:
        checks = [
            ("n", self.n >= 1, f"n must be >= 1, got {self.n}"),
            ("temperature", self.temperature >= 0.0,
             f"temperature must be >= 0, got {self.temperature}"),
            ("top_p", 0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            ("top_k", 0 <= self.top_k <= _MAX_TOP_K,
             f"top_k must be -1, 0 (all) or in [1, {_MAX_TOP_K}], got {self.top_k}"),
            ("seed", self.seed is None or _SEEDS[0] <= self.seed <= _SEEDS[1],
             f"seed must be in [{_SEEDS[0]}, {_SEEDS[1]}], got {self.seed}"),
            ("min_p", 0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}"),
            ("repetition_penalty", self.repetition_penalty > 0.0,
             f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0,
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 1,
             f"{{param}} must be >= 1, got {self.max_tokens}"),
            ("min_tokens", self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}"),
            ("min_tokens", self.max_tokens is None or self.min_tokens <= self.max_tokens,
             f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"),
            ("logprobs", self.logprobs is None or self.logprobs >= 0,
             f"logprobs must be >= 0, got {self.logprobs}"),
            ("prompt_logprobs", self.prompt_logprobs is None or self.prompt_logprobs >= 0,
             f"prompt_logprobs must be >= 0, got {self.prompt_logprobs}"),
            ("stop", all(s for s in self.stop_strings), "stop strings must be non-empty"),
            ("structured_outputs", self.structured_outputs is None
             or isinstance(self.structured_outputs, StructuredOutputsParams),
             "structured_outputs must be a StructuredOutputsParams"),
            ("logit_bias", all(-100.0 <= v <= 100.0 for v in (self.logit_bias or {}).values()),
             "logit_bias values must be in [-100, 100]"),
            ("truncate_prompt_tokens", self.truncate_prompt_tokens is None
             or self.truncate_prompt_tokens == -1 or self.truncate_prompt_tokens >= 1,
             f"truncate_prompt_tokens must be -1 or >= 1, got {self.truncate_prompt_tokens}"),
            ("allowed_token_ids", self.allowed_token_ids is None or len(self.allowed_token_ids),
             "allowed_token_ids must not be empty: no token could be sampled"),
            ("bad_words", all(isinstance(w, str) and w.strip() for w in self.bad_words or ()),
             "bad_words must be non-empty strings"),
            ("thinking_budget", self.thinking_budget is None or self.structured_outputs is None
             or self.structured_outputs.starts_after is not None,
             "{param} cannot be combined with structured outputs that hold from the first "
             "token (no think block before the grammar: it would refuse the block's tokens)"),
            ("priority", _SEEDS[0] <= self.priority < 2**63,
             f"priority must be a 64-bit integer, got {self.priority}"),
        ]
        for param, ok, message in checks:
            if not ok:
                raise RequestError(message, param)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def needs_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)
