"""A grammar that starts after a marker (`StructuredOutputsParams.starts_after`, a reasoning
model's think block), without a model: the in-process manager and the grammar process leave
the row free until the output has written the marker, say that a row may be constrained
when its token in flight may complete it, and then fill the rows of a fresh matcher that
never saw the tokens before (the marker included), the same rows on both."""

from __future__ import annotations

from functools import cache

import numpy as np
import pytest

from benchmarks.make_checkpoint import byte_level_tokenizer
from pagedserve.structured.manager import StructuredOutputManager
from pagedserve.structured.params import StructuredOutputsParams
from pagedserve.structured.remote import GrammarProcess
from tests.structured.test_manager import Request, add_ready
from tests.structured.test_remote import EOS, ROWS, VOCAB, tokenizer_dir  # noqa: F401


@cache
def token(char: str) -> int:
    [token_id] = byte_level_tokenizer().encode(char, add_special_tokens=False)
    return token_id


MARKER = [token("<"), token("/")]
SPEC = StructuredOutputsParams(regex=r"[0-9]{2}", starts_after=MARKER)
DIGITS = {token(c) for c in "0123456789"}


def allowed(bitmask: np.ndarray, row: int) -> set[int]:
    return {t for t in range(VOCAB) if bitmask[row][t // 32] >> (t % 32) & 1}


def step(holder, requests, rows) -> set[int] | None:
    """Submit the requests' last tokens and fill `rows`; the first row's allowed tokens
    (None: no row constrained)."""
    holder.submit([r for r in requests if r.output_token_ids], rows)
    output = holder.take_bitmask()
    return None if output is None else allowed(output.bitmask, 0)


@pytest.fixture(params=["in-process", "grammar-process"])
def holder(request, tokenizer_dir):
    tokenizer, source = tokenizer_dir
    if request.param == "in-process":
        made = StructuredOutputManager(tokenizer, VOCAB, [EOS], ROWS, num_threads=1)
    else:
        made = GrammarProcess(tokenizer, source, VOCAB, [EOS], ROWS, num_threads=1)
    yield made
    made.shutdown()


def test_free_until_the_marker_then_a_fresh_grammar(holder):
    request = Request("r", SPEC)
    add_ready(holder, request)
    assert holder.has_requests()
    assert not holder.is_constrained("r")
    assert holder.is_constrained("r", 1) is False  # "<" must come first
    for char in "a<b<":  # free text, a false start of the marker
        request.output_token_ids.append(token(char))
        assert step(holder, [request], ["r"]) is None
        assert not holder.is_constrained("r")
    assert holder.is_constrained("r", 1)  # an unseen "/" would complete it
    request.output_token_ids.append(token("/"))
    assert step(holder, [request], ["r"]) == DIGITS  # the marker was not fed to the grammar
    assert holder.is_constrained("r")
    request.output_token_ids.append(token("4"))
    assert step(holder, [request], ["r"]) == DIGITS
    request.output_token_ids.append(token("2"))
    assert step(holder, [request], ["r"]) in (None, {EOS})  # ended: only EOS, or free
    holder.remove_request("r")
    assert not holder.has_requests()


def test_an_output_that_has_the_marker_already(holder):
    """A request that arrives with output (e.g. resumed) is fed the tokens after it."""
    request = Request("r", SPEC, [token(c) for c in "x</7"])
    add_ready(holder, request)
    assert holder.is_constrained("r")
    assert step(holder, [], ["r"]) == DIGITS
    other = Request("free", SPEC, [token(c) for c in "x<"])
    add_ready(holder, other)
    assert not holder.is_constrained("free") and holder.is_constrained("free", 1)


def test_params_refuse_an_empty_marker():
    with pytest.raises(ValueError, match="starts_after"):
        StructuredOutputsParams(regex="a", starts_after=[])
