"""Shared fixtures: the default model loaded once, engines over it, a transformers reference,
and an autouse check that every engine built here ends each test with a clean block pool.

torch and the model code are imported inside fixtures so that tests of the pure-Python core
do not pay for them.
"""

from __future__ import annotations

import os
import shutil

import pytest

# Triton fixes at import whether its jit functions (its own standard library's included) run
# under the interpreter, and some test dependencies import triton themselves (peft,
# compressed-tensors): on a machine without a GPU, interpret from the start, so that the kernel
# tests (tests/kernels) still run under the interpreter whatever ran before them.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.kv_cache.conftest import free_order

_ENGINES: list = []  # engines built through `make_engine`, checked after every test


def assert_pool_clean(engine) -> None:
    """No request holds a block, nothing leaked, the null block was never used or written."""
    manager = engine.kv_cache_manager
    pool = manager.block_pool
    assert not engine.has_unfinished_requests(), "a test left requests in the engine"
    assert not manager.req_to_blocks, f"blocks still held by {list(manager.req_to_blocks)}"
    assert all(b.ref_cnt == 0 for b in pool.blocks), "a block kept a reference"
    free_ids = [b.block_id for b in free_order(pool.free_block_queue)]
    assert sorted(free_ids) == list(range(1, pool.num_blocks)), "free queue lost or duplicated"
    assert pool.get_num_free_blocks() == pool.num_blocks - 1
    null = pool.null_block
    assert null.block_id == 0 and null.is_null and null.ref_cnt == 0 and null.block_hash is None
    for block_hash, block in pool.cached_block_hash_to_block.items():
        assert block.block_hash == block_hash and not block.is_null
    for k_cache, v_cache in engine.model_runner.kv_caches:
        assert not k_cache[0].any() and not v_cache[0].any(), "KV written into the null block"


@pytest.fixture(autouse=True)
def _check_engine_block_pools():
    yield
    for engine in _ENGINES:
        assert_pool_clean(engine)


@pytest.fixture(scope="session")
def default_loaded_model():
    """SmolLM2-135M-Instruct (the default GGUF) with its tokenizer, on the CPU's exact float32
    path (not the fast quantized mode), which the transformers-equality tests hold."""
    from pagedserve.config import EngineConfig
    from pagedserve.frontend.llm_engine import LoadedModel

    return LoadedModel.load(EngineConfig(device="cpu", dtype="float32"))


@pytest.fixture(scope="session")
def make_engine(default_loaded_model):
    """Build LLMEngines over the shared default weights: make_engine(**engine_options)."""
    from pagedserve.config import EngineConfig
    from pagedserve.frontend.llm_engine import LLMEngine

    def make(**options):
        options.setdefault("kv_cache_memory", 128 << 20)
        options.setdefault("dtype", "float32")
        engine = LLMEngine(EngineConfig(device="cpu", **options), default_loaded_model)
        _ENGINES.append(engine)
        return engine

    yield make
    _ENGINES.clear()


@pytest.fixture(scope="session")
def engine(make_engine):
    """A default-model engine shared by the tests that only need a working engine."""
    return make_engine()


@pytest.fixture(scope="session")
def llm(engine):
    from pagedserve.entrypoints.llm import LLM

    return LLM.from_engine(engine)


@pytest.fixture(scope="session")
def hf_greedy():
    """transformers' greedy generate on the same GGUF: hf_greedy(prompt_ids, n) -> new ids.

    One prompt at a time (batch 1, no padding), so the reference is transformers' plain path.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from pagedserve.model.loader import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                 dtype=torch.float32).eval()
    cache: dict[tuple, list[int]] = {}

    def generate(prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        key = (tuple(prompt_ids), max_new_tokens)
        if key not in cache:
            ids = torch.tensor([prompt_ids])
            with torch.inference_mode():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     max_new_tokens=max_new_tokens, pad_token_id=0)
            cache[key] = out[0, len(prompt_ids):].tolist()
        return cache[key]

    generate.model = model
    return generate
