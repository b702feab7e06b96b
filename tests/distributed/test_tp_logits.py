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


def vocab_config(vocab: int) -> ModelConfig:
    return ModelConfig(family="llama", vocab_size=vocab, hidden_size=16, intermediate_size=16,
                       num_layers=1, num_heads=2, num_kv_heads=2, head_dim=8,
                       rms_norm_eps=1e-5, rope_theta=1e4, max_model_len=16,
                       tie_word_embeddings=True)


def shard_sampling_case(vocab: int):
    """Logits [8, vocab] (a tie across ranks, NaN, -inf rows, +inf) and sampling metadata
    of greedy and seeded temperature rows, the same in every process."""
    from pagedserve.device.input_batch import CachedRequestState
    from pagedserve.device.sampler import SamplingMetadata
    from pagedserve.sampling_params import SamplingParams

    logits = torch.randn(8, vocab, generator=torch.Generator().manual_seed(vocab)) * 2
    logits[0, [5, vocab - 3]] = 20.0
    logits[1, vocab - 1] = float("nan")
    logits[2] = float("-inf")
    logits[3, vocab // 2 + 2] = float("inf")
    temps = [0.0, 0.0, 0.0, 0.0, 1.0, 0.6, 2.0, 0.0]
    states = [CachedRequestState(f"r{i}", [1, 2], SamplingParams(temperature=t, seed=i))
              for i, t in enumerate(temps)]
    return logits, SamplingMetadata.from_requests(states, vocab, torch.device("cpu"),
                                                  fused=True)


def tokens_from_vocab_slices(vocab: int) -> tuple[list[int], bool]:
    """On a rank: the tokens its Sampler draws from its slice of the case's logits (the
    padding of the last rank's slice at a value that would win), and whether a vocabulary
    whose slices do not start on a group of four tokens falls back to gathering."""
    from pagedserve.device.model_runner import vocab_shard
    from pagedserve.device.sampler import Sampler, triton_sampling_kernels

    logits, meta = shard_sampling_case(vocab)
    config = vocab_config(vocab)
    shard = vocab_shard(config)
    rows = parallel.local_vocab(config)
    local = torch.full((logits.shape[0], len(rows)), 1e4)
    local[:, :shard.vocab] = logits[:, rows.start:rows.start + shard.vocab]
    sampler = Sampler(triton_sampling_kernels())
    tokens = sampler.sample_shard(local, meta, shard).sampled_token_ids.tolist()
    return tokens, vocab_shard(vocab_config(vocab + 2)) is None


def test_tp2_ranks_draw_from_their_vocabulary_slices_what_one_process_draws():
    """Plain rows (greedy, temperature) sampled from each rank's LM-head rows, only each
    row's split winners all-gathered: every rank gets the tokens the whole logits give."""
    from pagedserve.device.sampler import Sampler, triton_sampling_kernels

    vocab = 2047  # 1024 rows a rank, the last one of them padding
    logits, meta = shard_sampling_case(vocab)
    want = Sampler(triton_sampling_kernels())(logits, meta).sampled_token_ids.tolist()
    assert want[:4] == [5, vocab - 1, 0, vocab // 2 + 2]
    ranks = run_on_ranks(tokens_from_vocab_slices, vocab, size=2)
    assert ranks == [(want, True)] * 2
