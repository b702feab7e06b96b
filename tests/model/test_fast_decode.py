"""The fast mode's whole-step decode (`model/fast_decode.py`, `decode.c`) on the default
GGUF (and an integer checkpoint converted to the same blocks): the same kernels on the same
values as the per-op fast mode, so every step it takes must give the per-op path's hidden
states and KV cache writes bit for bit; the steps it does not take (prefills, other
backends, other models) must fall through to the layers.

The kernels it composes are held to float64 references on the dequantized blocks in
tests/native (test_quant, test_ops, test_attention), and the fast mode's quality against
float32 in test_gguf_fast_mode.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks.make_checkpoint import make_checkpoint
from benchmarks.quantize_int import quantize_folder
from pagedserve.attention.backend import set_forward_context
from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.attention.selector import get_attention_backend
from pagedserve.config import EngineConfig
from pagedserve.frontend.llm_engine import LLMEngine, LoadedModel
from pagedserve.kernels.native import decode
from pagedserve.model.fast_decode import FastDecode
from pagedserve.model.loader import load_model
from pagedserve.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not decode.available(),
                                reason="native kernels unavailable")

CONFIGS = Path(__file__).resolve().parents[2] / "benchmarks" / "configs"
PROMPTS = ["Hi", "Write a haiku about the sea.", "List three uses of copper and say why each "
           "one matters for the electrical grid, in plain words.", "Why is the sky blue?",
           "Count to ten.", "What does a CPU cache do? Answer briefly.", "Name a prime."]


@pytest.fixture(scope="module")
def fast(default_loaded_model):
    model, config, _ = load_model(None, torch.float32, "cpu", quantized=True)
    return LoadedModel(model, config, default_loaded_model.tokenizer)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float32 tensor: NaN in unwritten cache rows compares equal."""
    return t.view(torch.int32)


class Checked:
    """Stands in for `model.fast_decode`: runs each step it takes twice from the same KV cache
    state, through the whole-step call and through the layers, and holds them equal."""

    def __init__(self, model) -> None:
        self.model, self.fast = model, model.fast_decode
        self.batches: list[int] = []  # the steps taken, by batch size
        self.declined = 0

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        caches = [c for a in self.model.attention_layers() for c in (a.k_cache, a.v_cache)]
        before = [c.clone() for c in caches]
        hidden = self.fast(input_ids, positions)
        if hidden is None:
            self.declined += 1
            return None
        written = [c.clone() for c in caches]
        for cache, old in zip(caches, before):
            cache.copy_(old)
        self.model.fast_decode = None
        try:
            reference = self.model(input_ids, positions)
        finally:
            self.model.fast_decode = self
        assert torch.equal(_bits(hidden), _bits(reference))
        for cache, new in zip(caches, written):
            assert torch.equal(_bits(cache), _bits(new))
        self.batches.append(input_ids.shape[0])
        return hidden


def _generate(engine: LLMEngine, prompts: list[str], max_tokens: int,
              stagger: bool = False) -> dict[str, list[int]]:
    """Greedy tokens per request; with `stagger`, one request joins at each step."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    pending, tokens = list(enumerate(prompts)), {}
    while pending or engine.has_unfinished_requests():
        joining, pending = (pending[:1], pending[1:]) if stagger else (pending, [])
        for i, text in joining:
            engine.add_request(f"r{i}", text, params)
        for output in engine.step():
            if output.finished:
                tokens[output.request_id] = output.outputs[0].token_ids
    return tokens


def test_every_step_matches_the_per_op_fast_mode_bit_for_bit(fast):
    model = fast.model
    assert isinstance(model.fast_decode, FastDecode)
    checked = Checked(model)
    model.fast_decode = checked
    try:
        engine = LLMEngine(EngineConfig(device="cpu", kv_cache_memory=16 << 20), fast)
        _generate(engine, PROMPTS[:1], 20)  # batch 1, across a block boundary
        _generate(engine, PROMPTS, 6)  # ragged contexts, 7 rows: tiles of 4 and 3
        _generate(engine, PROMPTS[:5], 4, stagger=True)  # mixed steps fall through
    finally:
        model.fast_decode = checked.fast
    assert 1 in checked.batches and 7 in checked.batches, checked.batches
    assert checked.declined > 0  # every prefill step


def test_tokens_match_the_per_op_fast_mode(fast):
    """The same greedy tokens with the whole-step call on and off (a check of the wiring:
    the runner samples from what the call returned)."""
    model, runs = fast.model, []
    saved = model.fast_decode
    try:
        for on in (True, False):
            model.fast_decode = saved if on else None
            engine = LLMEngine(EngineConfig(device="cpu", kv_cache_memory=16 << 20), fast)
            runs.append(_generate(engine, PROMPTS[:3], 24))
    finally:
        model.fast_decode = saved
    assert runs[0] == runs[1]


def test_the_rule_leaves_other_models_and_backends_to_the_layers(fast, default_loaded_model,
                                                                 monkeypatch):
    assert default_loaded_model.model.fast_decode is None  # the exact float32 path
    model, saved = fast.model, fast.model.fast_decode
    checked = Checked(model)
    model.fast_decode = checked
    try:
        engine = LLMEngine(EngineConfig(device="cpu", kv_cache_memory=16 << 20,
                                        attention_backend="torch"), fast)
        _generate(engine, PROMPTS[:2], 3)
    finally:
        model.fast_decode = saved
    assert checked.batches == [] and checked.declined > 0
    monkeypatch.setattr(decode, "kernel", lambda: None)  # no library / no AVX2
    assert FastDecode.for_model(model) is None


def _one_decode(model, position: int, slot: int, seq_len: int, block_size: int = 4):
    """A decode step of one sequence over fresh zeroed caches of 4 blocks: (hidden or the
    exception, caches)."""
    caches = []
    for attn in model.attention_layers():
        attn.k_cache = torch.zeros(4, block_size, attn.num_kv_heads, attn.head_dim)
        attn.v_cache = torch.zeros_like(attn.k_cache)
        caches += [attn.k_cache, attn.v_cache]
    meta = AttentionMetadata(
        num_decodes=1, num_decode_tokens=1, slot_mapping=torch.tensor([slot]),
        block_tables=torch.tensor([[1, 2, 3]], dtype=torch.int32),
        seq_lens=torch.tensor([seq_len], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32), max_query_len=1,
        max_seq_len=seq_len)
    with torch.inference_mode(), set_forward_context(meta, get_attention_backend("cpu", "cpu")):
        try:
            return model.fast_decode(torch.tensor([7]), torch.tensor([position])), caches
        except (IndexError, ValueError) as e:
            return e, caches


def test_bad_indices_raise_and_write_nothing(fast):
    model = fast.model
    hidden, caches = _one_decode(model, position=5, slot=9, seq_len=6)
    assert isinstance(hidden, torch.Tensor) and hidden.isfinite().all()
    assert any(c.any() for c in caches)  # the good step wrote its K/V row
    limit = model.fast_decode._cos.shape[0]
    for kwargs, error in [({"position": limit, "slot": 9, "seq_len": 6}, IndexError),
                          ({"position": 5, "slot": 16, "seq_len": 6}, ValueError),
                          ({"position": 5, "slot": 9, "seq_len": 13}, ValueError),
                          ({"position": 5, "slot": 9, "seq_len": 0}, ValueError)]:
        result, caches = _one_decode(model, **kwargs)
        assert isinstance(result, error), kwargs
        assert not any(c.any() for c in caches), kwargs


@pytest.fixture(scope="module")
def int4_fast(tmp_path_factory):
    """A tiny Llama's W4A16 checkpoint (compressed-tensors, group 32) in the fast mode: its
    layers converted to the native blocks (`model/int_native.py`)."""
    root = tmp_path_factory.mktemp("int4-fast")
    config = json.loads((CONFIGS / "tiny-llama3.json").read_text())
    # every projection's input a whole number of 32-blocks (688 is not)
    config.update(vocab_size=2001, num_hidden_layers=2, intermediate_size=704)
    (root / "config.json").write_text(json.dumps(config))
    make_checkpoint(root / "config.json", root / "float", torch.float32, seed=0,
                    tokenizer="bytes")
    quantize_folder(root / "float", root / "w4", "compressed-tensors", bits=4, group=32)
    return LoadedModel.load(EngineConfig(model=str(root / "w4"), device="cpu"))


def test_an_int4_checkpoint_decodes_in_one_call_as_its_layers_do(int4_fast):
    model = int4_fast.model
    assert model.quantization == "w4a16" and isinstance(model.fast_decode, FastDecode)
    checked = Checked(model)
    model.fast_decode = checked
    try:
        engine = LLMEngine(EngineConfig(device="cpu", kv_cache_memory=16 << 20), int4_fast)
        _generate(engine, PROMPTS[:3], 6)
    finally:
        model.fast_decode = checked.fast
    assert 3 in checked.batches, checked.batches
