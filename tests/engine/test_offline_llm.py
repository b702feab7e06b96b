"""`LLM(...)` runs the engine core in a process of its own, as the server does, so that output
work (detokenization, stop strings, RequestOutputs) never delays the device: on the default
model it gives exactly the outputs of the same engine in this process (greedy, seeded
sampling, n > 1, stop strings, stop tokens, logprobs, prompt logprobs, chat), refuses bad
input before anything is queued, reports its stats, and leaves no process after shutdown."""

from __future__ import annotations

import pytest

from pagedserve.engine.core import EngineCore
from pagedserve.entrypoints.llm import LLM
from pagedserve.frontend.core_client import EngineDeadError, RemoteEngineCore
from pagedserve.sampling_params import SamplingParams

OPTIONS = dict(device="cpu", dtype="float32", kv_cache_memory=128 << 20)


@pytest.fixture(scope="module")
def remote() -> LLM:
    llm = LLM(**OPTIONS)
    yield llm
    llm.llm_engine.shutdown()


def batch() -> tuple[list, list[SamplingParams]]:
    prompts = ["The capital of France is", "Write a list of three fruits:",
               [1, 504, 3459, 28, 1], "Once upon a time", "1, 2, 3, 4,", "The sky is"]
    params = [SamplingParams(temperature=0.0, max_tokens=16),
              SamplingParams(temperature=0.0, max_tokens=24, stop=["\n"]),
              SamplingParams(temperature=0.0, max_tokens=12, logprobs=3, prompt_logprobs=2),
              SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=20, n=2),
              SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[28]),
              SamplingParams(temperature=1.0, top_k=20, seed=3, max_tokens=10,
                             repetition_penalty=1.3)]
    return prompts, params


def summary(outputs) -> list[tuple]:
    """Everything a request's final output says, but its timings."""
    def logprobs(entries):
        if entries is None:
            return None
        return [None if e is None else {t: (lp.logprob, lp.rank, lp.decoded_token)
                                        for t, lp in e.items()} for e in entries]

    return [(o.prompt, o.prompt_token_ids, o.finished, o.num_cached_tokens,
             logprobs(o.prompt_logprobs),
             [(c.index, c.token_ids, c.text, c.finish_reason, c.stop_reason,
               c.cumulative_logprob, logprobs(c.logprobs)) for c in o.outputs])
            for o in outputs]


def test_generate_and_chat_give_the_in_process_outputs(remote, make_engine):
    """A fresh in-process engine over the same weights runs the same batch the same way."""
    local = LLM.from_engine(make_engine(**{k: v for k, v in OPTIONS.items() if k != "device"}))
    assert isinstance(remote.llm_engine.engine_core, RemoteEngineCore)
    assert isinstance(local.llm_engine.engine_core, EngineCore)
    prompts, params = batch()
    want = summary(local.generate(prompts, params, use_tqdm=False))
    got = summary(remote.generate(prompts, params, use_tqdm=False))
    assert got == want
    assert want[1][5][0][3] == "stop" and want[4][5][0][3] == "stop"  # the stops fired
    assert len(want[3][5]) == 2 and want[2][4] is not None  # n=2; prompt logprobs
    conversations = [[{"role": "user", "content": q}] for q in ("Name a colour.", "Say hi.")]
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    assert (summary(remote.chat(conversations, greedy, use_tqdm=False))
            == summary(local.chat(conversations, greedy, use_tqdm=False)))
    stats = remote.llm_engine.get_stats()
    assert (stats.num_running, stats.num_waiting) == (0, 0)
    assert stats.generation_tokens_total == local.llm_engine.get_stats().generation_tokens_total
    assert stats.num_gpu_blocks == remote.llm_engine.num_blocks == local.llm_engine.num_blocks


def test_bad_input_is_refused_before_anything_is_queued(remote):
    with pytest.raises(ValueError):
        remote.generate(["fine", "too long"], SamplingParams(max_tokens=10**6), use_tqdm=False)
    assert not remote.llm_engine.has_unfinished_requests()
    out = remote.generate("The capital of Italy is",
                          SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert len(out) == 1 and len(out[0].outputs[0].token_ids) == 4


def test_shutdown_stops_the_core_process():
    llm = LLM(**OPTIONS)
    process = llm.llm_engine.engine_core.client.process
    assert process.is_alive()
    llm.llm_engine.shutdown()
    assert not process.is_alive()
    with pytest.raises(EngineDeadError):
        llm.generate("Hi", SamplingParams(max_tokens=2), use_tqdm=False)
