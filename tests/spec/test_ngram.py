"""Prompt lookup (spec/ngram.py): the draft is what followed the latest earlier occurrence
of the longest matching suffix."""

from __future__ import annotations

from pagedserve.spec.ngram import NgramProposer


def test_the_longest_suffix_wins_over_a_later_shorter_match():
    tokens = [1, 2, 3, 9, 9, 5, 3, 7, 8, 1, 2, 3]
    # suffix [1, 2, 3] occurs at 0..2 (then 9, 9, 5); [3] alone occurs later at 6 (then 7)
    assert NgramProposer(1, 3).propose(tokens, 3) == [9, 9, 5]
    assert NgramProposer(1, 1).propose(tokens, 3) == [7, 8, 1]


def test_the_latest_occurrence_is_used_and_k_bounds_the_draft():
    tokens = [4, 5, 6, 4, 5, 7, 7, 7, 4, 5]
    assert NgramProposer(2, 2).propose(tokens, 2) == [7, 7]
    assert NgramProposer(2, 2).propose(tokens, 8) == [7, 7, 7, 4, 5]


def test_no_draft_without_a_match_or_below_the_minimum():
    assert NgramProposer(1, 4).propose([1, 2, 3, 4], 4) == []
    assert NgramProposer(2, 4).propose([1, 2, 9, 2], 4) == []  # only a 1-token match
    assert NgramProposer(1, 4).propose([5], 4) == []
    assert NgramProposer(1, 4).propose([5, 5], 0) == []
