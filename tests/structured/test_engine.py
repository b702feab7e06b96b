"""Structured outputs in the engine, on a tiny random Qwen3 with a byte-level tokenizer (fast;
random weights would never emit valid JSON on their own, so validity is the grammar's doing):
outputs validate against their schema, greedy and sampled, n > 1; constrained and free rows
share a batch without changing the free rows' tokens; async scheduling, preemption (recompute
and swap) and prefix-cache hits give the synchronous engine's tokens; bad specs and logit_bias
ids are refused before taking a block; logit_bias moves the choice."""

from __future__ import annotations

import json
import logging
import re

import jsonschema
import pytest
import torch

from benchmarks.make_checkpoint import make_checkpoint
from pagedserve.config import EngineConfig
from pagedserve.frontend.llm_engine import LLMEngine, LoadedModel
from pagedserve.sampling_params import SamplingParams
from pagedserve.structured.params import StructuredOutputsParams
from tests.conftest import assert_pool_clean
from tests.structured.test_remote import grammar_child

CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 32,
    "hidden_size": 128, "intermediate_size": 256, "max_position_embeddings": 512,
    "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": True,
    "vocab_size": 259, "bos_token_id": 1, "eos_token_id": 2, "initializer_range": 0.5,
}
BLOCK = 16
BLOCK_BYTES = 2 * 2 * BLOCK * 2 * 32 * 4  # K and V, 2 layers, 2 KV heads of 32, fp32

PERSON = {  # nested object, array, enum, bounded strings and integers, required fields
    "type": "object",
    "properties": {
        # a pattern, not maxLength: xgrammar 0.2.8 lets control characters into strings
        # bounded by maxLength, which a random model picks and JSON forbids
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "address": {"type": "object", "properties": {"zip": {"type": "string", "pattern":
                                                             "^[0-9]{3}$"}},
                    "required": ["zip"]},
    },
    "required": ["name", "age", "tags", "address"],
}


@pytest.fixture(scope="module")
def loaded(tmp_path_factory) -> LoadedModel:
    root = tmp_path_factory.mktemp("tiny-qwen3-structured")
    (root / "config.json").write_text(json.dumps(CONFIG))
    make_checkpoint(root / "config.json", root / "ckpt", torch.float32, seed=0,
                    tokenizer="bytes")
    return LoadedModel.load(EngineConfig(model=str(root / "ckpt"), device="cpu",
                                         dtype="float32"))


def make(loaded: LoadedModel, num_blocks: int = 256, **options) -> LLMEngine:
    options.setdefault("max_num_batched_tokens", 64)
    return LLMEngine(EngineConfig(model="tiny", device="cpu", dtype="float32",
                                  block_size=BLOCK, kv_cache_memory=num_blocks * BLOCK_BYTES,
                                  **options), loaded)


def prompt(i: int, length: int = 20) -> list[int]:
    return [3 + (i * 7 + j * 13) % 250 for j in range(length)]


def run(engine: LLMEngine, requests: list[tuple[str, list[int], SamplingParams]],
        ) -> dict[str, list[tuple[list[int], str, str]]]:
    """Add all, step to the end; per request id its samples' (tokens, text, finish reason)."""
    for request_id, ids, params in requests:
        engine.add_request(request_id, None, params, prompt_token_ids=ids)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = [(c.token_ids, c.text, c.finish_reason)
                                          for c in out.outputs]
    assert_pool_clean(engine)
    return finals


def constrained(max_tokens: int = 100, **kwargs) -> SamplingParams:
    kwargs.setdefault("temperature", 0.0)
    return SamplingParams(max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(json=PERSON), **kwargs)


def mixed_batch() -> list[tuple[str, list[int], SamplingParams]]:
    return [
        ("json-greedy", prompt(0), constrained()),
        ("free-greedy", prompt(1), SamplingParams(max_tokens=30, temperature=0.0,
                                                  ignore_eos=True)),
        ("json-sampled", prompt(2, 40), constrained(temperature=1.0, seed=3, n=2)),
        ("free-sampled", prompt(3), SamplingParams(max_tokens=30, temperature=1.0, seed=4)),
        ("regex", prompt(4), SamplingParams(max_tokens=30, temperature=1.0, seed=5,
                                            structured_outputs=StructuredOutputsParams(
                                                regex=r"[a-z]{2,4}-[0-9]{2}"))),
        # seeded: grammars compile in the background, so when a constrained request is
        # first scheduled (and which draws of the engine's generator it gets) varies
        ("choice", prompt(5), SamplingParams(max_tokens=30, seed=6, structured_outputs=(
            StructuredOutputsParams(choice=["alpha", "beta", "gamma"])))),
    ]


def check_constrained(out: dict) -> None:
    for request_id in ("json-greedy", "json-sampled"):
        for tokens, text, reason in out[request_id]:
            assert reason == "stop", (request_id, text)
            jsonschema.validate(json.loads(text), PERSON)
    assert len(out["json-sampled"]) == 2
    (_, regex_text, _), = out["regex"]
    assert re.fullmatch(r"[a-z]{2,4}-[0-9]{2}", regex_text)
    assert out["choice"][0][1] in ("alpha", "beta", "gamma")


@pytest.fixture(scope="module")
def reference(loaded) -> dict:
    """The mixed batch on the synchronous engine with room for everything."""
    return run(make(loaded, async_scheduling=False), mixed_batch())


def test_outputs_match_their_constraints_and_free_rows_are_unchanged(loaded, reference):
    engine = make(loaded)
    out = reference
    check_constrained(out)
    alone = run(engine, [r for r in mixed_batch() if r[0].startswith("free")])
    assert {k: out[k] for k in alone} == alone
    # the random model left alone does not write JSON: the grammar did
    free = run(engine, [("x", prompt(0), SamplingParams(max_tokens=30, temperature=0.0))])
    assert free["x"][0][1] != out["json-greedy"][0][1]


@pytest.mark.parametrize("options", [
    {"async_scheduling": True},
    {"async_scheduling": True, "num_blocks": 12},  # preempted and resumed (recompute)
    {"async_scheduling": False, "num_blocks": 12, "preemption_mode": "swap",
     "swap_space": 64 * BLOCK_BYTES},
    {"async_scheduling": True, "num_blocks": 12, "preemption_mode": "swap",
     "swap_space": 64 * BLOCK_BYTES},
])
def test_async_and_preemption_give_the_synchronous_tokens(loaded, reference, options):
    engine = make(loaded, **options)
    assert run(engine, mixed_batch()) == reference
    if "num_blocks" in options:
        assert engine.scheduler.num_preemptions > 0


def test_prefix_hits_keep_the_output(loaded):
    engine = make(loaded)
    params = SamplingParams(max_tokens=30, temperature=0.0, structured_outputs=(
        StructuredOutputsParams(regex=r"[a-z]{2,4}-[0-9]{2}")))
    first = run(engine, [("p", prompt(7, 60), params)])
    engine.add_request("q", None, params, prompt_token_ids=prompt(7, 60))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert out.num_cached_tokens >= 48
                assert [(c.token_ids, c.text, c.finish_reason) for c in out.outputs] \
                    == first["p"]


@pytest.mark.parametrize("spec, message", [
    (dict(json='{"type": "object", '), "not valid JSON"),
    (dict(regex="[a-"), "invalid regex"),
    (dict(grammar="root ::= "), "invalid grammar"),
    (dict(json={"type": "object"}, regex="a"), "exactly one"),
])
def test_bad_specs_are_refused_before_taking_a_block(loaded, spec, message):
    engine = make(loaded)
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", None, SamplingParams(
            structured_outputs=StructuredOutputsParams(**spec)), prompt_token_ids=prompt(0))
    assert not engine.has_unfinished_requests()
    assert_pool_clean(engine)


def test_logit_bias(loaded):
    engine = make(loaded)
    free = run(engine, [("f", prompt(0), SamplingParams(max_tokens=8, temperature=0.0,
                                                         ignore_eos=True))])["f"][0][0]
    forced = run(engine, [("b", prompt(0), SamplingParams(
        max_tokens=8, temperature=0.0, ignore_eos=True, logit_bias={65: 100.0}))])["b"][0][0]
    assert forced == [65] * 8
    banned = run(engine, [("c", prompt(0), SamplingParams(
        max_tokens=8, temperature=0.0, ignore_eos=True,
        logit_bias={free[0]: -100.0}))])["c"][0][0]
    assert banned[0] != free[0]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("d", None, SamplingParams(logit_bias={259: 1.0}),
                           prompt_token_ids=prompt(0))


def make_grammar(loaded: LoadedModel, where: str, **options) -> LLMEngine:
    """An engine whose grammar work runs `where`: "inline", "threads-N" (N workers in this
    process) or "process" (a child process, the GPU's default, with 2 workers there)."""
    engine = make(loaded, grammar_process=where == "process", **options)
    engine.structured.set_num_threads(int(where.rpartition("-")[2]) if "-" in where
                                      else 2 if where == "process" else 0)
    return engine


@pytest.mark.parametrize("where", ["threads-1", "threads-3", "process"])
@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_grammar_workers_give_the_reference_tokens(loaded, reference, where,
                                                   async_scheduling):
    """Inline (the CPU's default, what `reference` ran with), on worker threads and in a
    process of its own, async and not: the same tokens. A shut-down engine leaves no
    grammar process behind."""
    engine = make_grammar(loaded, where, async_scheduling=async_scheduling)
    assert run(engine, mixed_batch()) == reference
    assert not engine.structured.has_requests()
    if where == "process":
        child = grammar_child()
        engine.shutdown()
        assert not child.is_running()


@pytest.mark.parametrize("where", ["inline", "threads-2", "process"])
@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_abort_while_a_bitmask_is_filled_leaves_no_matcher(loaded, reference,
                                                           async_scheduling, where):
    """Requests aborted while their rows await a bitmask (async) or while their matchers
    are being advanced (sync): no matcher is left, the others keep their tokens."""
    engine = make_grammar(loaded, where, async_scheduling=async_scheduling)
    batch = mixed_batch()
    for request_id, ids, params in batch:
        engine.add_request(request_id, None, params, prompt_token_ids=ids)
    finals: dict = {}
    aborted = False
    while engine.has_unfinished_requests():
        outputs = engine.step()
        for out in outputs:
            if out.finished:
                finals[out.request_id] = [(c.token_ids, c.text, c.finish_reason)
                                          for c in out.outputs]
        if not aborted and any(o.request_id == "json-greedy" and len(o.outputs[0].token_ids) > 3
                               for o in outputs):
            if async_scheduling:
                assert engine.engine_core.in_flight.awaits_bitmask
            engine.abort_request(["json-greedy", "regex"])
            aborted = True
            assert not engine.structured.is_constrained("json-greedy")
            assert not engine.structured.is_constrained("regex")
    assert aborted
    assert "json-greedy" not in finals or finals["json-greedy"][0][2] == "abort"
    for request_id in ("json-sampled", "choice", "free-greedy", "free-sampled"):
        assert finals[request_id] == reference[request_id]
    assert not engine.structured.has_requests()
    assert_pool_clean(engine)


@pytest.mark.parametrize("where", ["inline", "threads-2", "process"])
@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_a_grammar_that_ends_under_ignore_eos_goes_free(loaded, async_scheduling, where):
    """EOS ends the grammar; with ignore_eos the request goes on unconstrained (its matcher
    is dropped, never filled after its end) and its text starts with the valid JSON. In a
    grammar process the engine learns of it from the child's next reply."""
    engine = make_grammar(loaded, where, async_scheduling=async_scheduling)
    params = constrained(max_tokens=120, ignore_eos=True)
    out = run(engine, [("j", prompt(0), params)])
    tokens, text, reason = out["j"][0]
    assert reason == "length" and len(tokens) == 120
    end = tokens.index(2)  # the grammar's EOS
    prefix = engine.tokenizer.decode(tokens[:end])
    jsonschema.validate(json.loads(prefix), PERSON)
    assert not engine.structured.has_requests()


def test_an_lm_head_wider_than_the_tokenizer(tmp_path, caplog):
    """A head of 1,000 rows over the 259-id byte tokenizer, its config's EOS (999) past the
    tokenizer (a borrowed tokenizer, as in the GPU benchmarks' checkpoints): the grammar
    covers the tokenizer's ids, the padding rows are masked under it (random weights give
    them large logits), the tokenizer's EOS ends it; no token is refused."""
    config = dict(CONFIG, vocab_size=1000, eos_token_id=999)
    (tmp_path / "config.json").write_text(json.dumps(config))
    make_checkpoint(tmp_path / "config.json", tmp_path / "ckpt", torch.float32, seed=1,
                    tokenizer="bytes")
    wide = LoadedModel.load(EngineConfig(model=str(tmp_path / "ckpt"), device="cpu",
                                         dtype="float32"))
    engine = make(wide, async_scheduling=True)
    assert engine.structured.stop_token_ids == [2]
    with caplog.at_level(logging.ERROR, logger="pagedserve.structured.manager"):
        out = run(engine, [(f"j{i}", prompt(i), constrained(temperature=1.0, seed=i))
                           for i in range(3)])
    assert "does not match" not in caplog.text
    for (tokens, text, reason), in out.values():
        assert reason == "stop" and max(tokens) < 259
        jsonschema.validate(json.loads(text), PERSON)
