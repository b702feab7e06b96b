"""LoRA under `tensor_parallel_size=2` on the CPU (gloo): each rank keeps its part of every
adapter (B's rows on q/k/v/gate/up, A's columns on o/down, whose partial expands join the
layer's all-reduce), and a batch mixing an adapter on all seven projections with the base
model gives TP=1's greedy tokens and logprobs (one adapter: worker start-up is the cost)."""

from __future__ import annotations

import pytest

from pagedserve.frontend.llm_engine import LLMEngine
from pagedserve.sampling_params import SamplingParams
from tests.lora_adapters import ADAPTERS, PROMPT, base_checkpoint, make_adapter

pytest.importorskip("peft")
from pagedserve.messages import LoRARequest  # noqa: E402


def test_tp2_lora_matches_tp1(tmp_path):
    base = base_checkpoint(tmp_path, "tiny-llama3")
    requests = {"base": (PROMPT, None)}
    make_adapter(base, tmp_path / "all", ADAPTERS["all-r8"], seed=0)
    requests["all"] = (PROMPT[1:] + [7] * 5, LoRARequest("all", 1, str(tmp_path / "all")))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    results = {}
    for tp in (1, 2):
        engine = LLMEngine.from_options(
            str(base), device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=16,
            kv_cache_memory=2 << 20, tensor_parallel_size=tp, enable_lora=True, max_loras=2,
            max_lora_rank=16)
        try:
            for rid, (prompt, lora) in requests.items():
                engine.add_request(rid, None, params, prompt_token_ids=prompt,
                                   lora_request=lora)
            finished = {}
            while engine.has_unfinished_requests():
                finished.update({o.request_id: o for o in engine.step() if o.finished})
        finally:
            engine.shutdown()
        results[tp] = {rid: out.outputs[0] for rid, out in finished.items()}
    for rid in requests:
        one, two = results[1][rid], results[2][rid]
        assert two.token_ids == one.token_ids, rid
        for a, b in zip(one.logprobs, two.logprobs):
            for token_id, lp in a.items():
                assert b[token_id].logprob == pytest.approx(lp.logprob, abs=1e-4)
