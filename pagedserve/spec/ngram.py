"""NgramProposer (prompt lookup): the draft is what followed the latest earlier occurrence
of the sequence's last n tokens in its own prompt and output, for the longest n from
prompt_lookup_max down to prompt_lookup_min that occurs. No model runs: rewriting, fixing
or quoting a passage given in the prompt repeats long runs of it, which this finds for the
cost of a search on the host.

The search is numpy over the token ids: the positions where the last token occurs, then
those where the n - 1 before it match too, latest first."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np


class Proposer(Protocol):
    """What the scheduler asks for drafts: at most `k` tokens to follow `token_ids` (the
    sequence's prompt and output); fewer, or none, when it has no guess."""

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]: ...


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        num = len(token_ids)
        if k < 1 or num < self.min_n + 1 or token_ids.index(token_ids[-1]) == num - 1:
            return []  # (every match ends on an earlier occurrence of the last token)
        tokens = np.asarray(token_ids, dtype=np.int64)
        # candidate ends: earlier positions holding the last token, latest first
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])[::-1]
        for n in range(min(self.max_n, num - 1), self.min_n - 1, -1):
            found = ends[ends >= n - 1]
            for back in range(1, n):
                if not len(found):
                    break
                found = found[tokens[found - back] == tokens[num - 1 - back]]
            if len(found):
                start = int(found[0]) + 1
                return tokens[start:start + k].tolist()
        return []
