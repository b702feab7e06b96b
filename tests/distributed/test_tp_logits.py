"""Tensor-parallel decoder: two gloo ranks give the logits of one process, in float32.

Tiny random checkpoints from benchmarks/configs (written by benchmarks/make_checkpoint.py)
cover Llama (llama3 RoPE, untied), Qwen2 (q/k/v bias, tied), Qwen3 (per-head q/k norm, tied)
and a Llama whose 3 KV heads two ranks cannot split (a KV head kept by both ranks). Two sequences share every step through
the paged cache: one prefills then decodes, the other prefills in chunks that read the cached
prefix; every fed token's logits are compared.
"""

from __future__ import annotations

import json

import pytest
import torch

from pagedserve.model import parallel
from pagedserve.model.config import ModelConfig
from pagedserve.model.parallel import TensorParallel
from tests.distributed.harness import (CONFIGS, assert_ranks_equal_reference, paged_logits,
                                       tiny_checkpoint, tp_logits, tp_logits_mixed)
from tests.distributed.ranks import run_on_ranks

CASES = ["tiny-llama3", "tiny-qwen2", "tiny-qwen3", "tiny-llama-kv3"]
# Mixtral with a 6-token sliding window (the prompts are longer), Qwen3-MoE top-3 of 8
MOE_CASES = ["tiny-mixtral", "tiny-qwen3-moe"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tp-logits")
    return {case: tiny_checkpoint(root, case) for case in CASES + MOE_CASES}


def test_tp2_logits_equal_tp1(checkpoints):
    folders = [checkpoints[c] for c in CASES]
    ranks = run_on_ranks(tp_logits, folders, size=2)
    for i, case in enumerate(CASES):
        assert_ranks_equal_reference(case, [r[i] for r in ranks], paged_logits(folders[i]))


def test_tp2_dummy_weights_equal_tp1(tmp_path):
    """Random weights for a config-only folder are drawn whole and then sharded, so two
    ranks compute what one does (the GPU benchmark compares TP sizes on them)."""
    config = json.loads((CONFIGS / "tiny-qwen3.json").read_text())
    config.update(vocab_size=2001, num_hidden_layers=2)
    (tmp_path / "config.json").write_text(json.dumps(config))
    folder = str(tmp_path)
    want = paged_logits(folder, "dummy")
    assert want[0].std() > 0.01  # not all zeros or ones
    rank0, rank1 = run_on_ranks(tp_logits, [folder], "dummy", size=2)
    for w, g0, g1 in zip(want, rank0[0], rank1[0]):
        assert torch.equal(g0, g1)
        torch.testing.assert_close(g0, w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("heads,kv_heads,size", [
    (8, 2, 2), (8, 4, 2), (6, 3, 2), (8, 1, 2), (8, 2, 4), (8, 8, 4), (12, 3, 4), (16, 4, 8),
])
def test_local_kv_heads_serve_each_query_head(heads, kv_heads, size):
    """Local query head i reads local KV head i // ratio: that must be its own KV head."""
    config = ModelConfig(family="llama", vocab_size=64, hidden_size=heads * 8,
                         intermediate_size=8 * size, num_layers=1, num_heads=heads,
                         num_kv_heads=kv_heads, head_dim=8, rms_norm_eps=1e-5,
                         rope_theta=1e4, max_model_len=16, tie_word_embeddings=True)
    for rank in range(size):
        tp = TensorParallel(rank, size)
        q = parallel.local_q_heads(config, tp)
        kv = parallel.local_kv_heads(config, tp)
        assert len(q) % len(kv) == 0
        ratio = len(q) // len(kv)
        for i, head in enumerate(q):
            assert kv[i // ratio] == head // (heads // kv_heads)
        if kv_heads % size == 0:  # an even split keeps no KV head twice
            assert kv == list(range(rank * kv_heads // size, (rank + 1) * kv_heads // size))


# (case, quantization) run by one two-rank group: the MoE families in float32, then FP8
# weights (the CPU's reference path) on a dense and an MoE model
TP2_RUNS = [(c, None) for c in MOE_CASES] + [("tiny-llama3", "fp8"), ("tiny-mixtral", "fp8")]


@pytest.fixture(scope="module")
def tp2_runs(checkpoints) -> dict[tuple[str, str | None], list[list[torch.Tensor]]]:
    runs = [(checkpoints[c], q) for c, q in TP2_RUNS]
    ranks = run_on_ranks(tp_logits_mixed, runs, size=2)
    return {key: [rank[i] for rank in ranks] for i, key in enumerate(TP2_RUNS)}


@pytest.mark.parametrize("case", MOE_CASES)
def test_tp2_moe_logits_equal_tp1(checkpoints, tp2_runs, case):
    """Experts sliced over their intermediate features, the router whole: one all-reduce
    gives one process's sums (Mixtral's also through a sliding window)."""
    assert_ranks_equal_reference(case, tp2_runs[case, None], paged_logits(checkpoints[case]))


@pytest.mark.parametrize("case", ["tiny-llama3", "tiny-mixtral"])
def test_tp2_fp8_weights_agree_with_tp1(checkpoints, tp2_runs, case):
    """FP8 weights under TP: each column-parallel rank keeps its rows' scales, a row-parallel
    one quantizes its slice of the activations per token, so two ranks differ from one by
    less than FP8 itself differs from float32 (on average: a perturbation of either kind may
    tip a near-tie in the router to another expert for one token); both ranks see the same
    gathered logits."""
    got0, got1 = tp2_runs[case, "fp8"]
    one = paged_logits(checkpoints[case], quantization="fp8")
    exact = paged_logits(checkpoints[case])
    assert all(torch.equal(a, b) for a, b in zip(got0, got1))
    sharding = torch.cat([(g - w).abs().flatten() for g, w in zip(got0, one)]).mean()
    quantization = torch.cat([(w - e).abs().flatten() for w, e in zip(one, exact)]).mean()
    assert 0 < quantization  # FP8 weights did load
    assert sharding < quantization, (sharding, quantization)


def test_tp4_logits_equal_tp1(checkpoints):
    """Four gloo ranks: a dense Llama (2 KV heads, each kept by two ranks) and Qwen3-MoE."""
    cases = ["tiny-llama3", "tiny-qwen3-moe"]
    ranks = run_on_ranks(tp_logits, [checkpoints[c] for c in cases], size=4)
    for i, case in enumerate(cases):
        assert_ranks_equal_reference(case, [r[i] for r in ranks],
                                     paged_logits(checkpoints[case]))
