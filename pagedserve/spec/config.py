"""SpeculativeConfig: the `--speculative-config` JSON / `LLM(speculative_config=...)`, in
vLLM's keys, checked once at start-up so that a bad config is a clear error before any
weight loads rather than a surprise in a step."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "draft_model", "eagle3")
# proposed by a model on the device after each step (device/drafter.py), from `model`
DEVICE_METHODS = ("draft_model", "eagle3")
# methods vLLM users know that this engine does not run yet: refused by name
NOT_BUILT = ("eagle", "mtp", "medusa")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    # None: "draft_model" when `model` is given (vLLM's inference), else "ngram"
    method: str | None = None
    num_speculative_tokens: int = 4  # k: draft tokens verified per step and sequence
    prompt_lookup_max: int = 4  # ngram: the longest suffix matched
    prompt_lookup_min: int = 1  # ngram: the shortest suffix matched
    # no drafting while more requests than this run: a verify of k + 1 positions per
    # sequence stops being nearly free once the step is bound by compute, not weight reads
    disable_by_batch_size: int = 8
    # draft_model: the draft's folder or .gguf (same vocabulary as the target); eagle3: the
    # EAGLE-3 head's folder
    model: str | None = None

    def __post_init__(self) -> None:
        if self.method is None:  # frozen: the inferred method is set once, here
            object.__setattr__(self, "method",
                               "draft_model" if self.model is not None else "ngram")
        if self.method in NOT_BUILT:
            raise ValueError(f"speculative_config: method {self.method!r} is not built yet; "
                             f"available: {METHODS}")
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {METHODS}, "
                             f"got {self.method!r}")
        if self.on_device and not (isinstance(self.model, str) and self.model):
            raise ValueError(f"speculative_config: method {self.method!r} needs \"model\", "
                             "the path of its weights")
        if not self.on_device and self.model is not None:
            raise ValueError("speculative_config.model is for the draft_model and eagle3 "
                             f"methods, not {self.method!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError("speculative_config.num_speculative_tokens must be an integer "
                             f"in 1..{MAX_SPECULATIVE_TOKENS}, got {k!r}")
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if not (isinstance(low, int) and isinstance(high, int) and 1 <= low <= high):
            raise ValueError("speculative_config needs integers 1 <= prompt_lookup_min <= "
                             f"prompt_lookup_max, got {low!r} and {high!r}")
        batch = self.disable_by_batch_size
        if not isinstance(batch, int) or batch < 1:
            raise ValueError("speculative_config.disable_by_batch_size must be an integer "
                             f">= 1, got {batch!r}")

    @property
    def on_device(self) -> bool:
        """Drafts come from a model the runner runs after each step, not from the host."""
        return self.method in DEVICE_METHODS

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str | None
              ) -> SpeculativeConfig | None:
        """From a dict or its JSON text (the command line's form); unknown keys are refused
        with the list of known ones."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(f"speculative_config is not valid JSON: {error}") from None
        if not isinstance(value, dict):
            raise ValueError("speculative_config must be a JSON object, got "
                             f"{type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown}; known: "
                             f"{sorted(known)}")
        return cls(**value)
