"""A speculative verify's grammar rows, without a model: a row that verifies k drafts gets
k + 1 bitmask rows, row j the mask of a fresh matcher fed the request's tokens and its first
j drafts; past a draft the grammar refuses, or past a stop token, the rows allow every
token; the matcher is where it was after the fill; a verify's several accepted tokens
advance it in order (a stop token among them ends the grammar, with no error logged).
In process, threaded and inline (the grammar process gives the same rows:
tests/structured/test_remote.py)."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from pagedserve.structured.manager import StructuredOutputManager
from pagedserve.structured.params import StructuredOutputsParams
from tests.structured.test_manager import (  # noqa: F401 (the tokenizer fixture)
    EOS, VOCAB, Request, add_ready, expected_row, tokenizer)

SPEC = StructuredOutputsParams(regex=r"[a-c]{1,3}(-[0-9]{1,2}){1,4}")
ALL = np.full((VOCAB + 31) // 32, -1, dtype=np.int32)


@pytest.mark.parametrize("threads", [0, 2])
def test_verify_rows_are_the_masks_the_drafts_lead_to(tokenizer, threads):
    def tokens(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    manager = StructuredOutputManager(tokenizer, VOCAB, [EOS], 16, num_threads=threads)
    try:
        a = Request("a", SPEC, tokens("ab"))
        b = Request("b", SPEC, tokens("c"))
        for request in (a, b, Request("free", None)):
            add_ready(manager, request)
        drafts = {"a": tokens("-1x2"), "free": tokens("zz")}  # "x" is refused
        got = manager.grammar_bitmask(["a", "b", "free"], drafts)
        assert got.req_ids == ["a"] * 5 + ["b"] + ["free"] * 3
        for j, prefix in enumerate(("", "-", "-1")):
            want = expected_row(manager, Request("a", SPEC, tokens("ab" + prefix)))
            np.testing.assert_array_equal(got.bitmask[j], want)
        np.testing.assert_array_equal(got.bitmask[3:5], np.tile(ALL, (2, 1)))  # past "x"
        np.testing.assert_array_equal(got.bitmask[5], expected_row(manager, b))
        np.testing.assert_array_equal(got.bitmask[6:], np.tile(ALL, (3, 1)))
        # rolled back: the next step's rows start from the tokens the verify accepted
        a.output_token_ids += tokens("-1")
        b.output_token_ids += tokens("b")
        manager.submit([a, b], ["a", "b"], num_new=[2, 1])
        got = manager.take_bitmask()
        np.testing.assert_array_equal(got.bitmask[0], expected_row(manager, a))
        np.testing.assert_array_equal(got.bitmask[1], expected_row(manager, b))
    finally:
        manager.shutdown()


def test_a_stop_token_after_accepted_drafts_ends_the_grammar(tokenizer, caplog):
    manager = StructuredOutputManager(tokenizer, VOCAB, [EOS], 16, num_threads=1)
    try:
        request = Request("a", SPEC, tokenizer.encode("a", add_special_tokens=False))
        add_ready(manager, request)
        drafts = {"a": [*tokenizer.encode("-2", add_special_tokens=False), EOS]}
        got = manager.grammar_bitmask(["a"], drafts)
        assert got.bitmask[2][EOS // 32] >> (EOS % 32) & 1  # "a-2" may end there
        np.testing.assert_array_equal(got.bitmask[3], ALL)  # past the end: free
        request.output_token_ids += drafts["a"]
        with caplog.at_level(logging.ERROR):
            manager.submit([request], ["a"], num_new=[3])
            assert manager.take_bitmask() is None  # the grammar ended: the row is free
        assert not manager.is_constrained("a")
        assert "does not match" not in caplog.text
    finally:
        manager.shutdown()
