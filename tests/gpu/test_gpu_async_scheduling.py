"""Async scheduling on CUDA (the default there) against the synchronous engine, same weights.

With every prompt prefilled in one step, both engines run the same batches through the same
captured graphs, so their tokens must be identical: the async engine's decode input ids are
copied on the device from the previous step's sampled tokens instead of uploaded from the
host. Requests that stop on a token mid-generation leave a wasted row in the async engine's
next batch, which can change a graph's padded size and so flip bf16 near-ties of random
weights: there most, not all, requests must agree.
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.test_gpu_engine import make_engine, prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

LOCKSTEP = dict(max_num_batched_tokens=32768)  # all 64 prompts prefill in one step


def run(engine, prompt_list, params_list) -> list[list[int]]:
    for i, (ids, params) in enumerate(zip(prompt_list, params_list)):
        engine.add_request(f"a{i}", None, params, prompt_token_ids=ids)
    done = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output.outputs[0].token_ids
    assert not engine.kv_cache_manager.req_to_blocks
    return [done[f"a{i}"] for i in range(len(prompt_list))]


def sync_and_async(loaded, prompt_list, params_list):
    sync = run(make_engine(loaded, async_scheduling=False, **LOCKSTEP), prompt_list, params_list)
    engine = make_engine(loaded, **LOCKSTEP)
    assert engine.async_scheduling and engine.model_runner.graphs is not None
    assert engine.config.admission_interval == 16  # decode graphs: admissions held
    return sync, run(engine, prompt_list, params_list)


@torch.inference_mode()
def test_async_scheduling_gives_the_synchronous_tokens(loaded):
    from pagedserve.sampling_params import SamplingParams

    prompt_list = prompts(64, seed=5)
    params = [SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True) if i % 2 else
              SamplingParams(temperature=0.8, seed=i, max_tokens=32, ignore_eos=True)
              for i in range(64)]
    sync, overlapped = sync_and_async(loaded, prompt_list, params)
    assert overlapped == sync


@torch.inference_mode()
def test_async_scheduling_stops_mid_flight_like_the_synchronous_engine(loaded):
    from pagedserve.sampling_params import SamplingParams

    prompt_list = prompts(64, seed=6)
    free = run(make_engine(loaded, async_scheduling=False, **LOCKSTEP), prompt_list,
               [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)] * 64)
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                             stop_token_ids=[tokens[8 + i % 8]]) for i, tokens in enumerate(free)]
    sync, overlapped = sync_and_async(loaded, prompt_list, params)
    for tokens, p in zip(overlapped, params):
        assert tokens[-1] in p.stop_token_ids or len(tokens) == 24
    assert sum(a == b for a, b in zip(overlapped, sync)) >= 48
