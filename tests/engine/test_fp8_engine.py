"""FP8 through the engine on the CPU, default model (float32): the KV cache in e4m3 (through
the reference attention) and FP8 weights (the dequantizing reference product), checked by
their first greedy tokens against float32 (later tokens of a 135M model drift apart at
near-ties: the mean KL of FP8 KV against float32 is ~0.0065 nats on these prompts). The H100
figures come from benchmarks/fp8.py."""

from __future__ import annotations

import pytest

from pagedserve.engine.core_proc import ready_message
from pagedserve.entrypoints.llm import LLM, encode_chat
from pagedserve.sampling_params import SamplingParams

QUESTIONS = ["Why is the sky blue?", "Name three rivers in Europe.",
             "What is a paged KV cache?", "Write a haiku about autumn."]


def greedy(engine, max_tokens: int = 3) -> list[list[int]]:
    prompts = [encode_chat(engine.tokenizer, [{"role": "user", "content": q}])
               for q in QUESTIONS]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = LLM.from_engine(engine).generate(prompts, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def reference(make_engine):
    return greedy(make_engine())


def test_fp8_kv_cache_holds_4x_float32_blocks_and_keeps_greedy_tokens(make_engine, engine,
                                                                         reference):
    import torch

    fp8 = make_engine(kv_cache_dtype="fp8")
    runner = fp8.model_runner
    k_cache = runner.kv_caches[0][0]
    assert k_cache.dtype == torch.float8_e4m3fn and runner.block_bytes * 4 == \
        engine.model_runner.block_bytes
    assert fp8.num_blocks == 4 * engine.num_blocks  # the same 128 MiB: 1 byte, not 4
    assert runner.kv_scales[0][0].tolist() == [1.0] * k_cache.shape[2]  # no checkpoint scales
    tokens = greedy(fp8)
    assert [t[0] for t in tokens] == [r[0] for r in reference]
    ready = ready_message(fp8.engine_core)  # what /v1/models reports
    assert (ready.kv_cache_dtype, ready.quantization) == ("fp8_e4m3", None)


def test_fp8_weights_on_the_cpu_reference_path(reference):
    import torch

    from pagedserve.config import EngineConfig
    from pagedserve.frontend.llm_engine import LLMEngine, LoadedModel

    config = EngineConfig(device="cpu", dtype="float32", quantization="fp8",
                          kv_cache_memory=32 << 20)
    engine = LLMEngine(config, LoadedModel.load(config))
    proj = engine.model_runner.model.layers[0].self_attn.qkv_proj
    assert proj.weight.dtype == torch.float8_e4m3fn and proj.weight_scale.dtype == torch.float32
    tokens = greedy(engine, max_tokens=1)  # the reference product is slow: one token
    assert sum(t[0] == r[0] for t, r in zip(tokens, reference)) >= 3
    ready = ready_message(engine.engine_core)
    assert (ready.kv_cache_dtype, ready.quantization) == ("float32", "fp8")


def test_bad_fp8_options_are_refused():
    from pagedserve.config import EngineConfig

    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="fp16")
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="int4")
