"""Preemption by swapping KV blocks to CPU swap space: same greedy tokens as a run without
preemption, the swap space and the block pool clean afterwards, and the fallback to
recompute when the swap space is too small."""

from __future__ import annotations

import pytest

from pagedserve.device.input_batch import BlockTableRows
from pagedserve.device.swap import SwapSpace
from pagedserve.sampling_params import SamplingParams

NEW_TOKENS = 24
PROMPTS = [list(range(10 + i, 10 + i + 20 + 7 * i)) for i in range(6)]


def run_all_at_once(engine, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"s{i}", None, params, prompt_token_ids=ids)
    results = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                results[output.request_id] = output.outputs[0].token_ids
    return [results[f"s{i}"] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def references(engine):
    return run_all_at_once(engine, PROMPTS)


@pytest.mark.parametrize("caching", [False, True])
def test_swap_preemption_keeps_tokens_exact(make_engine, engine, references, caching):
    block_bytes = engine.model_runner.block_bytes
    small = make_engine(kv_cache_memory=14 * block_bytes, preemption_mode="swap",
                        swap_space=64 * block_bytes, enable_prefix_caching=caching)
    assert run_all_at_once(small, PROMPTS) == references
    scheduler, stats = small.scheduler, small.get_stats()
    assert stats.num_preemptions > 0
    assert stats.num_blocks_swapped_out > 0
    if not caching:  # without prefix hits every swapped-out block comes back by copy
        assert stats.num_blocks_swapped_in == stats.num_blocks_swapped_out
    assert not scheduler.swapped
    assert scheduler.swap_space.num_free_blocks == scheduler.swap_space.num_blocks


def test_too_small_swap_space_falls_back_to_recompute(make_engine, engine, references):
    block_bytes = engine.model_runner.block_bytes
    small = make_engine(kv_cache_memory=14 * block_bytes, preemption_mode="swap",
                        swap_space=1 * block_bytes, enable_prefix_caching=False)
    assert run_all_at_once(small, PROMPTS) == references
    assert small.scheduler.num_preemptions > 0
    assert small.get_stats().num_blocks_swapped_out == 0


def test_swap_space_allocates_all_or_nothing():
    space = SwapSpace(5)
    first = space.allocate(3)
    assert sorted(first) == first and len(set(first)) == 3
    assert space.allocate(3) is None and space.num_free_blocks == 2
    rest = space.allocate(2)
    assert set(first) | set(rest) == set(range(5))
    space.free(first)
    assert space.num_free_blocks == 3


def test_block_table_rows_append_reassign_and_release():
    rows = BlockTableRows(max_blocks_per_seq=4, capacity=1)
    rows.add("a", [3])
    rows.add("b", [7, 8])  # grows past capacity 1
    idx = rows.rows(["a", "b"])
    assert rows.table[idx].tolist() == [[3, 0, 0, 0], [7, 8, 0, 0]]
    rows.append("a", [5])
    rows.append("a", [])
    assert rows.table[rows.rows(["a"])].tolist() == [[3, 5, 0, 0]]
    rows.add("a", [9])  # resumed after preemption: its row holds only its new blocks
    assert rows.table[rows.rows(["a"])].tolist() == [[9, 0, 0, 0]]
    rows.release(["a", "unknown"])
    rows.add("c", [2])
    assert rows.rows(["c"])[0] == idx[0]  # the released row is reused
    assert rows.table[rows.rows(["c", "b"])].tolist() == [[2, 0, 0, 0], [7, 8, 0, 0]]
