"""The engine with the Triton LoRA kernels (interpreted) in place of the torch reference's
LoRA gives the reference's tokens: a mixed batch of three adapters and the base model through
the runner's tiles (prefill chunks, decode steps of more than `ONE_ROW_MAX` rows) and its
one-row path (the last decodes). The model's other ops are the same in both runs (their Triton
kernels have tests of their own, and interpreting them would be most of this test's time)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pagedserve.config import EngineConfig
from pagedserve.frontend.llm_engine import LLMEngine, LoadedModel
from pagedserve.kernels.triton.lora import lora_shrink_expand
from pagedserve.model.loader import load_model, load_tokenizer
from pagedserve.model.lora import ONE_ROW_MAX
from pagedserve.model.ops import select_ops
from pagedserve.sampling_params import SamplingParams
from tests.lora_adapters import base_checkpoint, make_adapters

pytest.importorskip("peft")


def test_triton_lora_matches_the_reference(tmp_path):
    base = base_checkpoint(tmp_path, "tiny-llama3")
    loras = [None, *make_adapters(base, tmp_path).values()]
    num = ONE_ROW_MAX + 2
    requests = {f"r{i}": ([3 + i, 40 + 2 * i, 7, 90 + i] * (1 + i % 2), loras[i % 4])
                for i in range(num)}
    # 48 tokens a step: a prefill step, a step of prefill chunks beside decodes, a decode step
    # of every request (tiles: more than ONE_ROW_MAX rows), then the two requests that started
    # last decode alone (one row each)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    tokens = {}
    reference = select_ops("cpu", torch.float32)
    for name, ops in (("reference", reference),
                      ("triton", replace(reference, lora=lora_shrink_expand))):
        model, config, source = load_model(base, torch.float32, "cpu", ops=ops)
        loaded = LoadedModel(model, config, load_tokenizer(source), source)
        engine = LLMEngine(EngineConfig(
            model=str(base), device="cpu", dtype="float32", enable_lora=True, max_loras=3,
            max_lora_rank=16, kv_cache_memory=2 << 20, block_size=4,
            max_num_batched_tokens=48), loaded)
        out = {}
        for rid, (prompt, lora) in requests.items():
            engine.add_request(rid, None, params, prompt_token_ids=prompt, lora_request=lora)
        while engine.has_unfinished_requests():
            out.update({o.request_id: o.outputs[0].token_ids for o in engine.step()
                        if o.finished})
        tokens[name] = out
    assert tokens["triton"] == tokens["reference"]
