"""`tensor_parallel_size=2` on the CPU: two gloo worker processes give TP=1's tokens.

The engines run the same requests with the same scheduling options and the same number of
KV blocks (a rank's block holds half the KV heads, so it gets half the bytes): chunked
prefill (a 24-token step budget against prompts of up to 61 tokens), prefix-cache hits
(prompts sharing their first 32 tokens), preemption (a KV cache too small for the batch),
n > 1 with seeded random sampling, logprobs, a grammar-constrained request (sampled once its
bitmask is sent), and async scheduling (the executor's launch, then collect). Then the faults: a worker that cannot start and one killed mid-run give an
ExecutorError, not a hang, and leave no worker behind.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from pagedserve.device.executor import ExecutorError
from pagedserve.entrypoints.llm import LLM
from pagedserve.frontend.llm_engine import LLMEngine
from pagedserve.model import parallel
from pagedserve.model.eagle3 import eagle3_config
from pagedserve.model.loader import read_model_config
from pagedserve.model.parallel import TensorParallel
from pagedserve.sampling_params import SamplingParams
from pagedserve.structured.params import StructuredOutputsParams
from tests.spec.heads import write_eagle3_head

CHOICES = ["alpha", "beta", "gamma"]
NUM_BLOCKS = 24  # blocks of 4 tokens: fewer than the batch needs at once


def kv_bytes_per_block(folder: str, tp: int, block_size: int = 4) -> int:
    """A rank's bytes per block in float32 (rank 0 keeps as many KV heads as any)."""
    config = read_model_config(folder)
    kv_heads = len(parallel.local_kv_heads(config, TensorParallel(0, tp)))
    return 2 * config.num_layers * block_size * kv_heads * config.head_dim * 4


def engine(folder: str, tp: int, draft_block_bytes: int = 0, **options) -> LLM:
    """The core in this process, so that the workers are its children (the fault tests
    kill them and watch them go). `draft_block_bytes`: a model proposer's share of a
    rank's block."""
    return LLM.from_engine(LLMEngine.from_options(
        folder, device="cpu", dtype="float32", block_size=4, max_num_seqs=8,
        max_num_batched_tokens=24, seed=0, tensor_parallel_size=tp,
        kv_cache_memory=NUM_BLOCKS * (kv_bytes_per_block(folder, tp) + draft_block_bytes),
        **options))


def workload() -> tuple[list[list[int]], list[SamplingParams]]:
    gen = torch.Generator().manual_seed(3)
    shared = torch.randint(3, 2000, (32,), generator=gen).tolist()
    prompts = [shared + torch.randint(3, 2000, (n,), generator=gen).tolist()
               for n in (5, 29, 11)]
    prompts += [torch.randint(3, 2000, (n,), generator=gen).tolist() for n in (7, 40)]
    greedy = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, logprobs=3)
    sampled = SamplingParams(temperature=0.9, top_p=0.95, n=2, seed=11, max_tokens=10,
                             ignore_eos=True)
    choice = SamplingParams(temperature=0.0, max_tokens=10, structured_outputs=(
        StructuredOutputsParams(choice=CHOICES)))  # the executor's grammar-bitmask path
    return prompts + [prompts[4][:9]], [greedy, greedy, greedy, sampled, greedy, choice]


def run(llm: LLM) -> list[list[tuple]]:
    prompts, params = workload()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert outputs[5].outputs[0].text in CHOICES
    return [[(c.token_ids, c.logprobs) for c in o.outputs] for o in outputs]


def assert_same_outputs(got: list[list[tuple]], want: list[list[tuple]]) -> None:
    for g_request, w_request in zip(got, want, strict=True):
        for (g_tokens, g_lps), (w_tokens, w_lps) in zip(g_request, w_request, strict=True):
            assert g_tokens == w_tokens
            for g, w in zip(g_lps or [], w_lps or [], strict=True):
                assert list(g) == list(w)  # the same top tokens, in the same order
                for token in w:
                    assert g[token].logprob == pytest.approx(w[token].logprob, abs=1e-4)


def stats(llm: LLM):
    return llm.llm_engine.get_stats()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_tp2_tokens_equal_tp1(llama, async_scheduling):
    reference = engine(llama, 1, async_scheduling=async_scheduling)
    want = run(reference)
    tp2 = engine(llama, 2, async_scheduling=async_scheduling)
    try:
        assert tp2.llm_engine.num_blocks == reference.llm_engine.num_blocks == NUM_BLOCKS
        got = run(tp2)
        assert_same_outputs(got, want)
        s1, s2 = stats(reference), stats(tp2)
        assert s2.num_preemptions == s1.num_preemptions > 0
        assert s2.prefix_cache_hits == s1.prefix_cache_hits > 0
        assert len(got[3]) == 2 and got[3][0][0] != got[3][1][0]  # n=2 drew two samples
        assert run(tp2) == got  # and again, with every block freed and reused
    finally:
        tp2.llm_engine.shutdown()


def test_tp2_with_ngram_speculation_gives_tp1s_tokens(llama):
    """A verify is an ordinary batch for the workers; the ranks take rank 0's acceptances.
    Greedy rows (one with penalties and logprobs) and a grammar-constrained one, verified
    under TP=2, give the tokens of TP=1 without speculation. Each prompt holds its own
    greedy continuation, then its start again, so prompt lookup proposes it."""
    gen = torch.Generator().manual_seed(5)
    starts = [torch.randint(3, 2000, (n,), generator=gen).tolist() for n in (6, 9, 12)]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    reference = engine(llama, 1)
    continued = reference.generate(starts, greedy, use_tqdm=False)
    prompts = [s + c.outputs[0].token_ids + s for s, c in zip(starts, continued)]
    params = [greedy, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                                     logprobs=2, frequency_penalty=0.5),
              SamplingParams(temperature=0.0, max_tokens=10, structured_outputs=(
                  StructuredOutputsParams(choice=CHOICES)))]
    want = reference.generate(prompts, params, use_tqdm=False)
    tp2 = engine(llama, 2, speculative_config={"method": "ngram",
                                               "num_speculative_tokens": 3})
    try:
        got = tp2.generate(prompts, params, use_tqdm=False)
        assert stats(tp2).spec_num_accepted_tokens > 0
    finally:
        tp2.llm_engine.shutdown()
    assert got[2].outputs[0].text in CHOICES
    assert_same_outputs([[(c.token_ids, c.logprobs) for c in o.outputs] for o in got],
                        [[(c.token_ids, c.logprobs) for c in o.outputs] for o in want])


@pytest.fixture(scope="module")
def eagle3_head(tmp_path_factory) -> str:
    """Random EAGLE-3 heads for the tiny Llama (hidden 256; 4 query heads over 2 KV heads,
    which two ranks split), reading the streams entering its layers 1, 1 and 2."""
    folder = tmp_path_factory.mktemp("tp-eagle3") / "head"
    return str(write_eagle3_head(folder, {"hidden_size": 256, "vocab_size": 2001,
                                          "max_position_embeddings": 4096}, [0, 0, 1], 300))


@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
def test_tp2_with_a_model_proposer_gives_tp1s_tokens(llama, eagle3_head, method):
    """The draft (the target's own checkpoint) or the EAGLE-3 heads sharded over the ranks
    as the target is, under async scheduling (pipelined while the batch is too large to
    draft for): greedy rows (one with penalties and logprobs) over chunked prompts give
    TP=1's tokens without speculation, and TP=1's acceptance with the same proposer (the
    same drafts); the target drafting for itself has every draft accepted, which needs
    each rank's shard of the draft's KV right."""
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 2000, (n,), generator=gen).tolist() for n in (30, 9, 41)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    params = [greedy, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                     logprobs=2, frequency_penalty=0.5), greedy]
    model = llama if method == "draft_model" else eagle3_head
    spec = {"method": method, "model": model, "num_speculative_tokens": 3,
            "disable_by_batch_size": 2}  # pipelined while all three run (async scheduling)
    want = engine(llama, 1).generate(prompts, params, use_tqdm=False)
    runs = []
    for tp in (1, 2):
        llm = engine(llama, tp, draft_block_bytes=draft_bytes_per_block(spec, tp),
                     speculative_config=spec, async_scheduling=True)
        try:
            assert llm.llm_engine.num_blocks == NUM_BLOCKS
            runs.append((llm.generate(prompts, params, use_tqdm=False), stats(llm)))
        finally:
            llm.llm_engine.shutdown()
    (_, s1), (got, s2) = runs
    assert_same_outputs([[(c.token_ids, c.logprobs) for c in o.outputs] for o in got],
                        [[(c.token_ids, c.logprobs) for c in o.outputs] for o in want])
    assert (s2.spec_num_draft_tokens, s2.spec_num_accepted_tokens) == (
        s1.spec_num_draft_tokens, s1.spec_num_accepted_tokens)
    assert s2.spec_num_draft_tokens > 0
    if method == "draft_model":
        assert s2.spec_num_accepted_tokens == s2.spec_num_draft_tokens


def draft_bytes_per_block(spec: dict, tp: int, block_size: int = 4) -> int:
    """A rank's share of a block for the proposer's KV in float32 (its KV heads split as
    the target's)."""
    config = (eagle3_config(spec["model"]) if spec["method"] == "eagle3"
              else read_model_config(spec["model"]))
    kv_heads = len(parallel.local_kv_heads(config, TensorParallel(0, tp)))
    return 2 * config.num_layers * block_size * kv_heads * config.head_dim * 4


def test_a_draft_the_ranks_cannot_split_is_refused_before_any_worker_starts(llama, tmp_path):
    head = write_eagle3_head(tmp_path / "head", {"hidden_size": 256, "vocab_size": 2001,
                                                 "max_position_embeddings": 4096},
                             [0, 0, 1], 300, heads=1, kv_heads=1)
    with pytest.raises(ValueError, match="speculative_config.model: num_heads"):
        engine(llama, 2, speculative_config={"method": "eagle3", "model": str(head)})


def test_tp2_tokens_equal_tp1_when_kv_heads_do_not_split(llama_kv3):
    want = run(engine(llama_kv3, 1))
    tp2 = engine(llama_kv3, 2)
    try:
        assert_same_outputs(run(tp2), want)
    finally:
        tp2.llm_engine.shutdown()


def test_tp2_moe_with_fp8_weights_through_the_workers(qwen3_moe):
    """An MoE model with FP8 weights is no longer refused: two workers start and their greedy
    first tokens are TP=1's but where FP8's rounding, which differs between one and two
    ranks, tips a near-tie of the random weights (the logits' agreement is checked closely
    in test_tp_logits)."""
    prompts, params = workload()
    greedy = [(p, s) for p, s in zip(prompts, params) if s.temperature == 0 and s.structured_outputs is None]
    prompts, params = [p for p, _ in greedy], [s for _, s in greedy]
    want = engine(qwen3_moe, 1, quantization="fp8").generate(prompts, params, use_tqdm=False)
    tp2 = engine(qwen3_moe, 2, quantization="fp8")
    try:
        got = tp2.generate(prompts, params, use_tqdm=False)
    finally:
        tp2.llm_engine.shutdown()
    same = sum(g.outputs[0].token_ids[0] == w.outputs[0].token_ids[0]
               for g, w in zip(got, want, strict=True))
    assert same >= len(want) - 1
    assert [len(o.outputs[0].token_ids) for o in got] == [s.max_tokens for s in params]


def test_a_model_the_ranks_cannot_split_is_refused_before_any_worker_starts(llama):
    with pytest.raises(ValueError, match="divisible by tensor_parallel_size"):
        engine(llama, 3)  # 8 query heads


def test_a_worker_that_cannot_start_is_an_error(llama, monkeypatch):
    monkeypatch.setattr(sys, "executable", "/bin/false")  # what the workers are started with
    start = time.monotonic()
    with pytest.raises(ExecutorError, match=r"worker rank \d .* exited with code 1"):
        engine(llama, 2)
    assert time.monotonic() - start < 60


def worker_processes() -> dict[int, int]:
    """The tensor-parallel workers this process started and has not reaped: rank -> pid, from
    their command lines (Linux /proc)."""
    workers = {}
    for children in Path("/proc/self/task").glob("*/children"):
        for pid in children.read_text().split():
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except FileNotFoundError:
                continue  # exited meanwhile
            if b"pagedserve.device.worker" in argv:
                workers[int(argv[argv.index(b"--rank") + 1])] = int(pid)
    return workers


def test_a_killed_worker_is_an_error_and_no_worker_is_left(llama):
    before = worker_processes()
    tp2 = engine(llama, 2)
    workers = {rank: pid for rank, pid in worker_processes().items()
               if pid not in before.values()}
    assert sorted(workers) == [0, 1]
    os.kill(workers[1], signal.SIGKILL)
    prompts, params = workload()
    with pytest.raises(ExecutorError, match=r"rank 1 .* killed by signal 9"):
        tp2.generate(prompts, params, use_tqdm=False)
    # rank 0 was stopped too, and both were reaped
    assert not set(workers.values()) & set(worker_processes().values())
    with pytest.raises(ExecutorError, match="rank 1"):  # and the engine stays failed
        tp2.generate(prompts[:1], params[:1], use_tqdm=False)


def test_tp2_disk_tier_agrees_across_ranks_on_a_file_broken_on_one(llama, tmp_path):
    """Each rank writes its shard of the blocks the host tier drops; when rank 1's files
    are damaged, every rank treats them as a miss (the outcome is reduced over the ranks),
    so the recompute gives TP=1's tokens."""
    gen = torch.Generator().manual_seed(5)
    first = torch.randint(3, 2000, (41,), generator=gen).tolist()
    others = [torch.randint(3, 2000, (41,), generator=gen).tolist() for _ in range(8)]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    want = engine(llama, 1).generate([first], greedy, use_tqdm=False)[0].outputs[0].token_ids
    tp2 = engine(llama, 2, kv_offload_path=str(tmp_path), prefix_caching_hash_seed="s")
    try:
        for prompt in [first, *others]:  # pushes the first prompt's blocks to disk
            tp2.generate([prompt], greedy, use_tqdm=False)
        assert stats(tp2).disk_tier_stores > 0
        for path in tmp_path.glob("*/rank1/*.kv"):
            path.write_bytes(path.read_bytes()[:-1] + b"\0")
        got = tp2.generate([first], greedy, use_tqdm=False)[0]
        assert got.outputs[0].token_ids == want
        assert stats(tp2).disk_tier_load_failures > 0 and stats(tp2).disk_tier_hits == 0
    finally:
        tp2.llm_engine.shutdown()
