"""The thinking budget on CUDA (async scheduling, decode graphs, the fused sampler): the
block's end is forced exactly `n` tokens after it opened, the in-flight token decided on the
device, and the async engine gives the synchronous engine's tokens."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.test_gpu_async_scheduling import run, sync_and_async
from tests.gpu.test_gpu_engine import make_engine, prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@torch.inference_mode()
def test_budget_forces_the_end_and_async_matches_sync(loaded):
    from pagedserve.sampling_params import SamplingParams
    from pagedserve.thinking_budget import ThinkingBudget

    prompt_list = prompts(32, seed=11)
    free = run(make_engine(loaded, async_scheduling=False, max_num_batched_tokens=32768),
               prompt_list, [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)] * 32)
    end = 10_001  # a token no prompt holds (prompts draw below 10,000)
    params, opened_at = [], []
    for i, tokens in enumerate(free):
        budget = i % 5
        if i % 2:  # greedy: the block opens at the first output token, as the free run's
            rule, opened = ThinkingBudget(budget, [tokens[0]], [end]), 1
        else:  # sampled: the prompt opened it
            rule, opened = ThinkingBudget(budget, [end + 1], [end], starts_inside=True), 0
        opened_at.append(opened + budget)
        params.append(SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=24,
                                     ignore_eos=True, thinking_budget=rule))
    sync, overlapped = sync_and_async(loaded, prompt_list, params)
    assert overlapped == sync
    for tokens, forced_at in zip(sync, opened_at):
        assert tokens[forced_at] == end
        assert end not in tokens[:forced_at]
