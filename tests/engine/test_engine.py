"""LLMEngine / LLM behaviour on the default model: abort, validation, stop conditions, n > 1,
streaming deltas, chat. Block-pool invariants are checked after each test by the autouse
fixture in tests/conftest.py."""

from __future__ import annotations

import pytest

from pagedserve.entrypoints.llm import encode_chat
from pagedserve.sampling_params import SamplingParams

CHAT = [{"role": "user", "content": "Write a short poem about rivers and the sea."}]


def chat_ids(engine, conversation=CHAT):
    return encode_chat(engine.tokenizer, conversation)


def drain(engine) -> dict:
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    return finished


def test_abort_mid_generation_frees_everything(engine):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"a{i}", None, params, prompt_token_ids=chat_ids(engine))
    for _ in range(3):
        engine.step()
    assert engine.kv_cache_manager.get_num_free_blocks() < engine.num_blocks - 1
    engine.abort_request(["a0", "a1"])
    assert "a0" not in engine.kv_cache_manager.req_to_blocks
    finished = drain(engine)
    assert finished["a0"].outputs[0].finish_reason == "abort"
    assert finished["a1"].outputs[0].finish_reason == "abort"
    assert finished["a2"].outputs[0].finish_reason == "length"
    assert len(finished["a2"].outputs[0].token_ids) == 12
    engine.abort_request("unknown-id")  # a no-op, not an error


@pytest.mark.parametrize("kwargs, message", [
    ({"prompt_token_ids": []}, "empty"),
    ({"prompt_token_ids": [1] * 5000}, "max_model_len"),
    ({"prompt_token_ids": [1] * 100, "params": SamplingParams(max_tokens=10_000)},
     "max_model_len"),
    ({"prompt_token_ids": [10**9]}, "vocabulary"),
])
def test_bad_requests_rejected_before_taking_blocks(make_engine, kwargs, message):
    engine = make_engine(max_model_len=1024)
    free = engine.kv_cache_manager.get_num_free_blocks()
    params = kwargs.pop("params", SamplingParams())
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", None, params, **kwargs)
    assert engine.kv_cache_manager.get_num_free_blocks() == free
    assert not engine.has_unfinished_requests()
    # the engine keeps serving, and the rejected id is free again
    engine.add_request("bad", "Hello", SamplingParams(max_tokens=2))
    assert len(drain(engine)["bad"].outputs[0].token_ids) == 2


def test_stop_string_truncates_and_deltas_add_up(engine):
    ids = chat_ids(engine)
    full = drain_one(engine, ids, SamplingParams(temperature=0.0, max_tokens=30,
                                                 ignore_eos=True))
    text = full.outputs[0].text
    words = text.split()
    assert len(words) > 3
    stop = words[2]
    start = text.index(stop)
    deltas = []
    engine.add_request("s", None, SamplingParams(temperature=0.0, max_tokens=30, stop=[stop]),
                       prompt_token_ids=ids)
    while engine.has_unfinished_requests():
        for output in engine.step():
            deltas.append(output.outputs[0].text_delta)
            last = output
    out = last.outputs[0]
    assert out.text == text[:start]
    assert "".join(deltas) == out.text
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == full.outputs[0].token_ids[:len(out.token_ids)]


def test_stop_token_ids_and_min_tokens(engine):
    ids = chat_ids(engine)
    full = drain_one(engine, ids, SamplingParams(temperature=0.0, max_tokens=20,
                                                 ignore_eos=True)).outputs[0].token_ids
    stop_token = full[5]
    first = full.index(stop_token)
    out = drain_one(engine, ids, SamplingParams(temperature=0.0, max_tokens=20,
                                                stop_token_ids=[stop_token])).outputs[0]
    assert out.token_ids == full[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_token
    later = drain_one(engine, ids, SamplingParams(temperature=0.0, max_tokens=20,
                                                  stop_token_ids=[stop_token],
                                                  min_tokens=first + 2)).outputs[0]
    assert later.token_ids[:first + 2] == full[:first + 2]  # the early stop token was ignored


def test_eos_stops_unless_ignored(engine):
    ids = chat_ids(engine, [{"role": "user", "content": "Say only the word yes."}])
    out = drain_one(engine, ids, SamplingParams(temperature=0.0, max_tokens=64)).outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] in engine.engine_core.eos_token_ids
    assert out.stop_reason is None
    assert len(out.token_ids) < 24
    ignored = drain_one(engine, ids, SamplingParams(temperature=0.0, max_tokens=24,
                                                    ignore_eos=True)).outputs[0]
    assert len(ignored.token_ids) == 24 and ignored.finish_reason == "length"


def drain_one(engine, ids, params):
    engine.add_request("one", None, params, prompt_token_ids=ids)
    return drain(engine)["one"]


def test_n_samples_share_prompt_blocks_and_are_seeded(engine):
    ids = chat_ids(engine)
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    hits_before = engine.get_stats().prefix_cache_hits
    prompt_tokens_before = engine.get_stats().prompt_tokens_total
    engine.kv_cache_manager.reset_prefix_cache()
    engine.add_request("n", None, params, prompt_token_ids=ids)
    engine.step()
    held = [engine.kv_cache_manager.get_block_ids(f"n#{i}") for i in range(3)]
    shared = len(ids) // engine.config.block_size
    assert held[0][:shared] == held[1][:shared] == held[2][:shared]
    assert engine.get_stats().prefix_cache_hits - hits_before >= 2 * shared * 16
    out = drain(engine)["n"]
    # one prompt, however many samples share it
    assert engine.get_stats().prompt_tokens_total - prompt_tokens_before == len(ids)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    samples = [c.token_ids for c in out.outputs]
    assert all(len(s) == 12 for s in samples) and len({tuple(s) for s in samples}) > 1
    # child i is the request with seed 7 + i: the same tokens when run on its own
    alone = drain_one(engine, ids, SamplingParams(temperature=1.0, seed=8, max_tokens=12,
                                                  ignore_eos=True))
    assert alone.outputs[0].token_ids == samples[1]


def test_logprobs_in_outputs(engine):
    out = drain_one(engine, chat_ids(engine), SamplingParams(temperature=0.0, max_tokens=5,
                                                             logprobs=3)).outputs[0]
    assert len(out.logprobs) == len(out.token_ids)
    total = 0.0
    for token, entry in zip(out.token_ids, out.logprobs):
        assert len(entry) == 3 and entry[token].rank == 1  # greedy = the most likely
        assert max(lp.logprob for lp in entry.values()) == entry[token].logprob
        total += entry[token].logprob
    assert out.cumulative_logprob == pytest.approx(total)


def test_llm_generate_and_chat_keep_input_order(llm, hf_greedy):
    params = SamplingParams(temperature=0.0, max_tokens=12)
    conversations = [[{"role": "user", "content": q}] for q in
                     ("Name a colour.", "What is 2 + 2?", "Say hi.")]
    outputs = llm.chat(conversations, params, use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    for conversation, output in zip(conversations, outputs):
        ids = encode_chat(tokenizer, conversation)
        assert output.prompt_token_ids == ids
        assert output.outputs[0].token_ids == hf_greedy(ids, 12)[:len(output.outputs[0].token_ids)]
        assert output.outputs[0].text == tokenizer.decode(output.outputs[0].token_ids,
                                                          skip_special_tokens=True)
    texts = llm.generate(["The capital of Italy is", [1, 2, 3]], params, use_tqdm=False)
    assert texts[0].prompt == "The capital of Italy is" and texts[1].prompt_token_ids == [1, 2, 3]
    assert all(len(o.outputs[0].token_ids) > 0 for o in texts)


def test_dropped_engine_frees_its_kv_cache_from_the_shared_model(default_loaded_model):
    """Engines share the loaded model, whose attention layers point at the KV cache of the
    engine that bound them last: dropping that engine must release its cache, or the next
    engine sizes its own from what is left."""
    import gc
    import weakref

    from pagedserve.config import EngineConfig
    from pagedserve.frontend.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(device="cpu", kv_cache_memory=16 << 20),
                       default_loaded_model)
    layers = default_loaded_model.model.attention_layers()
    assert layers[0].k_cache is engine.model_runner.kv_caches[0][0]
    cache = weakref.ref(engine.model_runner.kv_caches[0][0])
    del engine
    gc.collect()
    assert cache() is None
    assert all(layer.k_cache.numel() == 0 and layer.v_cache.numel() == 0 for layer in layers)
