"""The host tier's recall rule: a hit is recalled when its copy is expected to be faster than
recomputing its tokens, from the costs the engine measured (given here as inputs)."""

from __future__ import annotations

import logging

import pytest

from pagedserve.engine.recall_rule import RecallRule, recall_rule
from pagedserve.messages import TierCosts

BLOCK = 16


def rule(block_copy_s, token_s, token_context_s=0.0, step_s=0.0, max_model_len=4096):
    return RecallRule(TierCosts(block_copy_s, token_s, token_context_s, step_s, 8, 256),
                      BLOCK, max_model_len)


def test_a_copy_faster_than_the_prefill_is_recalled():
    fast_copy = rule(block_copy_s=BLOCK * 1e-6, token_s=2e-6)  # half the recompute's time
    assert fast_copy.pays(0, 1) and fast_copy.pays(320, 10)
    assert not fast_copy.never_pays
    assert fast_copy.from_start == (BLOCK, 4096)


def test_a_copy_slower_than_the_prefill_is_recomputed():
    slow_copy = rule(block_copy_s=BLOCK * 2e-6, token_s=1e-6)
    assert not slow_copy.pays(0, 1) and not slow_copy.pays(1024, 64)
    assert slow_copy.never_pays
    assert slow_copy.from_start is None
    assert "never pay" in slow_copy.describe()


def test_equal_costs_are_recomputed():
    assert not rule(block_copy_s=BLOCK * 1e-6, token_s=1e-6).pays(0, 4)


def test_the_step_hides_a_short_copy_slower_than_the_prefill():
    """The request computes in the step that queues its recall, whose compute overlaps the
    copy: a copy slower than the prefill still pays while the step hides it, and a hit
    whose copy outlasts the step by more than its recompute is recomputed."""
    r = rule(block_copy_s=BLOCK * 2e-6, token_s=1e-6, step_s=100e-6)  # 32 us against 16 us
    # 32n - 100 against 16n microseconds: up to 6 blocks the recall is the cheaper
    assert r.pays(0, 1) and r.pays(0, 6) and not r.pays(0, 7)
    assert r.from_start == (BLOCK, 6 * BLOCK) and not r.never_pays
    assert r.recall_seconds(2) == 0.0
    assert r.recall_seconds(7) == pytest.approx(124e-6)


def test_the_attention_term_makes_long_or_late_hits_pay():
    """Recomputing a token costs more the later its position; its copy does not."""
    r = rule(block_copy_s=BLOCK * 2e-6, token_s=1e-6, token_context_s=1e-9)
    # per block from position s: 16e-6 + 1e-9 * ((s + 16)^2 - s^2) against 32e-6
    assert not r.pays(0, 1)
    assert r.pays(1024, 1)
    assert not r.never_pays
    shortest, longest = r.from_start
    assert 0 < shortest <= 1024 and longest == 4096
    assert r.pays(0, shortest // BLOCK) and not r.pays(0, shortest // BLOCK - 1)


def test_a_context_too_short_for_the_attention_term_never_pays():
    r = rule(block_copy_s=BLOCK * 2e-6, token_s=1e-6, token_context_s=1e-9, max_model_len=256)
    assert r.never_pays and not r.pays(240, 1)


def test_no_hit_is_weighed_on_nothing():
    assert not rule(block_copy_s=0.0, token_s=1e-6).pays(0, 0)


def test_the_rule_logs_its_inputs_once(caplog):
    with caplog.at_level(logging.INFO, logger="pagedserve.engine.recall_rule"):
        assert recall_rule(None, BLOCK, 4096) is None
        built = recall_rule(TierCosts(3e-5, 1e-6, 0.0, 1e-5, 8, 256), BLOCK, 4096)
    assert built.never_pays
    [record] = caplog.records
    message = record.getMessage()
    assert "30.0 us a block" in message and "0.01 ms" in message and "never pay" in message


@pytest.mark.parametrize("first", [0, 160, 2000])
def test_the_costs_add_up_over_the_blocks(first):
    """Recomputing n blocks costs what their blocks one by one cost (one prefill model)."""
    r = rule(block_copy_s=1e-5, token_s=1e-6, token_context_s=1e-9)
    whole = r.recompute_seconds(first, 4 * BLOCK)
    parts = sum(r.recompute_seconds(first + i * BLOCK, BLOCK) for i in range(4))
    assert whole == pytest.approx(parts)
    assert r.recall_seconds(4) == pytest.approx(4e-5)
