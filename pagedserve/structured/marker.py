"""MarkerWatch: where in an output a grammar starts (`StructuredOutputsParams.starts_after`).

A reasoning model's output may begin inside its think block; its grammar holds only after
the block's end marker. Both holders of matchers (the in-process manager, and the engine's
side of the grammar process, which must know without a round trip which rows are
constrained) watch each such output token by token, with this one rule, so they agree.
"""

from __future__ import annotations

from collections.abc import Sequence


class MarkerWatch:
    """The output's tokens so far, as far as the marker's first occurrence needs them."""

    def __init__(self, marker: Sequence[int]) -> None:
        self.marker = list(marker)
        self._tail: list[int] = []  # the last len(marker) tokens at most

    def feed(self, token: int) -> bool:
        """Take the output's next token; True when it completes the marker."""
        tail = self._tail
        tail.append(token)
        if len(tail) > len(self.marker):
            del tail[0]
        return tail == self.marker

    def may_end_with(self, num_unseen: int) -> bool:
        """Whether the marker may be complete once `num_unseen` more tokens (0 or 1, a token in
        flight) are fed."""
        if not num_unseen:
            return False
        head = self.marker[:-1]
        return not head or self._tail[len(self._tail) - len(head):] == head


def split_at_marker(watch: MarkerWatch, tokens: Sequence[int]) -> Sequence[int] | None:
    """Feed `tokens` (an output that already has some) to `watch`: the tokens after the
    marker if they complete it, None while it is still to come."""
    for i, token in enumerate(tokens):
        if watch.feed(token):
            return tokens[i + 1:]
    return None
