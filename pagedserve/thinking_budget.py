"""A thinking budget: at most `max_tokens` tokens inside a reasoning block, then the block's
end tokens are forced through the sampler (every other token at -inf), one per step, and the
model writes its answer after them.

The budget is a per-request rule on the output tokens, so the sampler applies it like
`bad_words`: each step the host works out from the tokens it knows which token (if any) the
row must take now. With async scheduling one token, the row's last, may still be in flight;
it matters only if it opens the block (a budget of 0 then forces the end at once) or closes
it (nothing more to force), so such a row's forced token carries a condition on the last
token that the device checks (`ForcedToken`).
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.errors import RequestError

ALWAYS, IF_LAST, UNLESS_LAST = 0, 1, 2  # when a forced token applies, given the last token


@dataclass
class ThinkingBudget:
    max_tokens: int  # tokens allowed inside the block (its markers not counted)
    start_token_ids: list[int]  # the tokens that open a block (e.g. `<think>`)
    end_token_ids: list[int]  # the tokens that close it, forced when the budget is spent
    starts_inside: bool = False  # the prompt left a block open: the output begins inside

    def __post_init__(self) -> None:
        if self.max_tokens < 0:
            raise RequestError(f"{{param}} must be >= 0, got {self.max_tokens}",
                               "thinking_budget")
        if not self.start_token_ids or not self.end_token_ids:
            raise RequestError("a thinking budget needs the block's start and end tokens",
                               "thinking_budget")


@dataclass(frozen=True)
class ForcedToken:
    token: int
    when: int = ALWAYS  # ALWAYS, or IF_LAST / UNLESS_LAST `last`: the in-flight token is it
    last: int = -1


def forced_token(budget: ThinkingBudget, output: list[int], in_flight: int
                 ) -> ForcedToken | None:
    """The token the budget forces next, given the known output tokens and how many more
    (0 or 1) are in flight after them."""
    start, end = budget.start_token_ids, budget.end_token_ids
    begin = 0 if budget.starts_inside else _after(output, start, 0)
    if begin is None:  # no block yet: only a block opened by the in-flight token matters
        if in_flight and budget.max_tokens == 0 and _ends_with(output, start[:-1]):
            return ForcedToken(end[0], IF_LAST, start[-1])
        return None
    if _after(output, end, begin) is not None:
        return None  # closed
    inside = len(output) + in_flight - begin
    k = inside - budget.max_tokens
    if k < 0 or k >= len(end):
        return None
    if in_flight and _ends_with(output, end[:-1]):  # the in-flight token may close it
        return ForcedToken(end[k], UNLESS_LAST, end[-1])
    return ForcedToken(end[k])


def _after(tokens: list[int], marker: list[int], begin: int) -> int | None:
    """The index just after the first `marker` in tokens[begin:], or None."""
    n, i = len(marker), begin
    while True:
        try:
            i = tokens.index(marker[0], i)  # a scan in C: rows are scanned every step
        except ValueError:
            return None
        if tokens[i:i + n] == marker:
            return i + n
        i += 1


def _ends_with(tokens: list[int], tail: list[int]) -> bool:
    return not tail or tokens[len(tokens) - len(tail):] == tail
