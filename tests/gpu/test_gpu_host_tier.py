"""The host tier on CUDA (pinned host memory, asynchronous copies): conversations whose
blocks a small device pool evicted are recalled from the host tier and answer with the same
greedy tokens as an engine that kept them on the device. Runs only where CUDA is available
(CI skips it); the checkpoint is the random Qwen3-0.6B-shaped one of test_gpu_engine."""

from __future__ import annotations

import random

import pytest
import torch

from tests.gpu.test_gpu_engine import make_engine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def conversations(engine, count: int = 6) -> list[list[int]]:
    """Turn 1 of every conversation, then turn 2 of each (its history and more): with a
    small pool, the later turn-1 prompts evict the earlier ones."""
    from pagedserve.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    rng = random.Random(7)
    firsts = [[rng.randrange(10_000) for _ in range(300)] for _ in range(count)]

    def ask(request_id, prompt):
        engine.add_request(request_id, None, params, prompt_token_ids=prompt)
        tokens = None
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    tokens = list(output.outputs[0].token_ids)
        return tokens

    answers = [ask(f"a{i}", prompt) for i, prompt in enumerate(firsts)]
    return answers + [ask(f"b{i}", prompt + answer + [5, 6, 7])
                      for i, (prompt, answer) in enumerate(zip(firsts, answers))]


def test_recalled_conversations_give_the_same_tokens(loaded):
    # the same max_model_len in both engines: under CUDA graphs the decode grid is sized for it,
    # and another split of the sums would be bf16 noise, not a recall error
    large = make_engine(loaded, max_model_len=512)
    reference = conversations(large)
    block_bytes = large.model_runner.block_bytes
    del large
    engine = make_engine(loaded, kv_cache_memory=48 * block_bytes, max_model_len=512,
                         kv_offload_memory=512 * block_bytes)
    assert conversations(engine) == reference
    stats = engine.get_stats()
    assert stats.prefix_cache_evictions > 0 and stats.host_tier_hits > 0


def test_conversations_recalled_from_disk_give_the_same_tokens(loaded, tmp_path):
    """A disk tier under a host tier too small for the conversations: blocks are written
    from pinned host slots once their copies out have landed, read back into slots no copy
    in flight still reads, then recalled; the tokens are those of an engine that kept
    them on the device."""
    large = make_engine(loaded, max_model_len=512)
    reference = conversations(large)
    block_bytes = large.model_runner.block_bytes
    del large
    engine = make_engine(loaded, kv_cache_memory=48 * block_bytes, max_model_len=512,
                         kv_offload_memory=40 * block_bytes, kv_offload_path=str(tmp_path))
    assert conversations(engine) == reference
    stats = engine.get_stats()
    assert stats.disk_tier_stores > 0 and stats.disk_tier_hits > 0
    assert stats.disk_tier_load_failures == 0
