"""RecallRule: whether copying a request's host-tier hit back to the device beats recomputing
its tokens, decided from what the engine measured at start-up (`messages.TierCosts`).

Why a rule: a recall is not free. Its blocks cross the host link at that link's rate, and
the step that computes the request waits, layer by layer, for what the copy has not
delivered by then (`device/tier_copies.py`); recomputing the same tokens costs the device's
prefill time in that same step. For a small model the KV of a token is large next to the
work of computing it, and the host link may be no faster than the prefill: then a long
recall only adds latency. For a large model the prefill of a long history is far slower
than its copy. The engine measures both on its own device when it starts
(`ModelRunner.measure_tier_costs`), so the choice follows the model, the dtype, the GPU and
its link, not constants.

The model of the costs, in seconds, of what each adds to the request's step:

* recalling n blocks: `max(0, n * block_copy_s - step_s)`: the copy runs beside the step's
  own compute, layer n's part landing while the layers before it compute, so the step
  waits only for the copy's excess over its compute, which is at least `step_s` (the
  least a step costs: a one-request decode step);
* recomputing the tokens [s, e) of a prompt: `token_s * (e - s) + token_context_s * (e*e - s*s)`,
  a per-token part (weights, MLP) and an attention part growing with the position (a prefill
  of a sequence of length l from zero costs `token_s * l + token_context_s * l * l`).

A hit is recalled when the recall is the cheaper (`pays`; a tie is recomputed). A token's
recompute grows with its position and its copy does not: a rule that declines a hit early
in a prompt may accept one deep in a conversation; where a block copies slower than it
is recomputed, the step's compute hides short hits' copies, not long ones'. `never_pays`
says whether no hit within the model's context would be recalled; the scheduler then
leaves the host tier alone altogether (no lookups, no offloads: nothing it stored could
ever be used).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cached_property

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

    def recall_seconds(self, num_blocks: int) -> float:
        return max(0.0, num_blocks * self.costs.block_copy_s - self.costs.step_s)

    def recompute_seconds(self, first_token: int, num_tokens: int) -> float:
        end = first_token + num_tokens
        return (self.costs.token_s * num_tokens
                + self.costs.token_context_s * (end * end - first_token * first_token))

    def pays(self, first_token: int, num_blocks: int) -> bool:
        """Whether the `num_blocks` blocks that start at prompt position `first_token` come
        back sooner by a recall than by a prefill."""
        return num_blocks > 0 and self.recall_seconds(num_blocks) < self.recompute_seconds(
            first_token, num_blocks * self.block_size)

    @cached_property
    def from_start(self) -> tuple[int, int] | None:
        """The shortest and the longest hit from position 0 that is recalled (in tokens,
        whole blocks), or None if none within max_model_len is: a copy faster than the
        prefill pays at any length, a slower one only while the step's compute hides it."""
        paying = [num_blocks for num_blocks in range(1, self.max_model_len // self.block_size + 1)
                  if self.pays(0, num_blocks)]
        return (paying[0] * self.block_size, paying[-1] * self.block_size) if paying else None

    @cached_property
    def never_pays(self) -> bool:
        """No hit within the context pays: of the hits that end at the context's end (the
        most expensive to recompute of their length), none does."""
        num_blocks = self.max_model_len // self.block_size
        return not any(self.pays(first * self.block_size, num_blocks - first)
                       for first in range(num_blocks))

    def describe(self) -> str:
        """The inputs and the outcome, for the start-up log."""
        c = self.costs
        outcome = ("recalls never pay within the model's context: the host tier is left "
                   "unused (no offloads, no lookups)" if self.never_pays else
                   "recalled: hits from position 0 of {} to {} tokens (deeper in a prompt: "
                   "more)".format(*self.from_start) if self.from_start is not None
                   else "recalled: only hits deep in a prompt")
        return (f"copy in {c.block_copy_s * 1e6:.1f} us a block of {self.block_size} tokens "
                f"(measured over {c.copy_blocks} blocks), overlapping a step of at least "
                f"{c.step_s * 1e3:.2f} ms, prefill {c.token_s * self.block_size * 1e6:.1f} us "
                f"a block + {c.token_context_s * 1e9:.3f} ns a token per context token "
                f"(measured over {c.prefill_tokens} tokens); {outcome}")
