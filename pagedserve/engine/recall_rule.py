"""RecallRule: whether copying a request's host-tier hit back to the device beats recomputing
its tokens, decided from what the engine measured at start-up (`messages.TierCosts`).

Why a rule: a recall is not free. Its blocks cross the host link at that link's rate, and
the request waits a step for them (`engine/scheduler.py`); recomputing the same tokens costs
the device's prefill time. For a small model the KV of a token is large next to the work of
computing it, and the host link may be no faster than the prefill: then a recall only adds
latency. For a large model the prefill of a long history is far slower than its copy. The
engine measures both on its own device when it starts (`ModelRunner.measure_tier_costs`), so
the choice follows the model, the dtype, the GPU and its link, not constants.

The model of the costs, in seconds:

* copying n blocks in: `n * block_copy_s`;
* recomputing the tokens [s, e) of a prompt: `token_s * (e - s) + token_context_s * (e*e - s*s)`,
  a per-token part (weights, MLP) and an attention part growing with the position (a prefill
  of a sequence of length l from zero costs `token_s * l + token_context_s * l * l`).

A hit is recalled when its copy is the cheaper (`pays`). Since a token's recompute grows
with its position and its copy does not, a rule that declines a short hit early in a prompt
may accept a long one or one deep in a conversation; `never_pays` says whether no hit within
the model's context would be recalled, and the scheduler then leaves the host tier alone altogether (no lookups, no
offloads: nothing it stored could ever be used).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pagedserve.messages import TierCosts

logger = logging.getLogger(__name__)


def recall_rule(costs: TierCosts | None, block_size: int,
                max_model_len: int) -> RecallRule | None:
    """The rule over the costs the executor measured (None without a host tier), its inputs
    and outcome logged once."""
    if costs is None:
        return None
    rule = RecallRule(costs, block_size, max_model_len)
    logger.info("host tier recall rule: %s", rule.describe())
    return rule


@dataclass(frozen=True)
class RecallRule:
    costs: TierCosts
    block_size: int
    max_model_len: int

    def copy_seconds(self, num_blocks: int) -> float:
        return num_blocks * self.costs.block_copy_s

    def recompute_seconds(self, first_token: int, num_tokens: int) -> float:
        end = first_token + num_tokens
        return (self.costs.token_s * num_tokens
                + self.costs.token_context_s * (end * end - first_token * first_token))

    def pays(self, first_token: int, num_blocks: int) -> bool:
        """Whether the `num_blocks` blocks that start at prompt position `first_token` come
        back faster by copy than by prefill."""
        return num_blocks > 0 and self.copy_seconds(num_blocks) < self.recompute_seconds(
            first_token, num_blocks * self.block_size)

    @property
    def min_tokens(self) -> int | None:
        """The shortest hit from position 0 that is recalled (whole blocks), or None if none
        within max_model_len is."""
        for num_blocks in range(1, self.max_model_len // self.block_size + 1):
            if self.pays(0, num_blocks):
                return num_blocks * self.block_size
        return None

    @property
    def never_pays(self) -> bool:
        """No hit within the context pays. A block's recompute costs the more the later its
        position, and its copy the same anywhere: the context's last block is the one most
        worth recalling."""
        last = (self.max_model_len // self.block_size - 1) * self.block_size
        return not self.pays(max(last, 0), 1)

    def describe(self) -> str:
        """The inputs and the outcome, for the start-up log."""
        c = self.costs
        per_block = c.token_s * self.block_size
        outcome = ("recalls never pay within the model's context: the host tier is left "
                   "unused (no offloads, no lookups)" if self.never_pays else
                   f"recalled: hits from position 0 of {self.min_tokens} tokens or more "
                   "(later positions: shorter ones too)")
        return (f"copy in {c.block_copy_s * 1e6:.1f} us a block of {self.block_size} tokens "
                f"(measured over {c.copy_blocks} blocks), prefill {per_block * 1e6:.1f} us a "
                f"block + {c.token_context_s * 1e9:.3f} ns a token per context token "
                f"(measured over {c.prefill_tokens} tokens); {outcome}")
