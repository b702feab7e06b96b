"""The official `openai` client against a live server on the default model."""

from __future__ import annotations


import httpx
import pytest

from pagedserve.entrypoints.llm import LLM
from pagedserve.sampling_params import SamplingParams
from tests.server.conftest import MODEL_NAME

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
CHAT = [{"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name three primary colors."}]
MAX_TOKENS = 12
BLOCK_SIZE = 16  # the engine's default


@pytest.fixture(scope="module")
def llm():
    """The offline API on the same model: the reference the server must reproduce."""
    return LLM(kv_cache_memory=64 << 20)


def test_health_and_models(server, client):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL_NAME]
    # the server's CPU default: float32 activations and cache, the GGUF's own weights
    assert models[0].kv_cache_dtype == "float32" and models[0].quantization is None


def test_greedy_completions_equal_llm_generate(client, llm):
    expected = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                            use_tqdm=False)
    for prompt, ref in zip(PROMPTS, expected):
        resp = client.completions.create(model=MODEL_NAME, prompt=prompt, temperature=0,
                                         max_tokens=MAX_TOKENS)
        choice = resp.choices[0]
        assert choice.text == ref.outputs[0].text
        assert choice.finish_reason == ref.outputs[0].finish_reason
        assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert resp.usage.completion_tokens == len(ref.outputs[0].token_ids)
        assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens

        stream = client.completions.create(model=MODEL_NAME, prompt=prompt, temperature=0,
                                           max_tokens=MAX_TOKENS, stream=True,
                                           stream_options={"include_usage": True})
        chunks = list(stream)
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == ref.outputs[0].text
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert finishes[-1] == ref.outputs[0].finish_reason
        assert all(f is None for f in finishes[:-1])
        assert chunks[-1].choices == [] and chunks[-1].usage == resp.usage


def test_greedy_chat_equals_llm_chat(client, llm):
    ref = llm.chat(CHAT, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                   use_tqdm=False)[0]
    resp = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, temperature=0,
                                          max_completion_tokens=MAX_TOKENS)
    assert resp.object == "chat.completion"
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == ref.outputs[0].text
    assert resp.choices[0].finish_reason == ref.outputs[0].finish_reason
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert resp.usage.completion_tokens == len(ref.outputs[0].token_ids)

    chunks = list(client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, temperature=0, max_tokens=MAX_TOKENS, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == ref.outputs[0].text
    assert [c for c in chunks if c.choices][-1].choices[0].finish_reason == \
        ref.outputs[0].finish_reason
    assert chunks[-1].usage.completion_tokens == resp.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == resp.usage.prompt_tokens


def test_without_include_usage_stream_has_no_usage(client):
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=4,
                                            temperature=0, stream=True))
    assert all(c.usage is None for c in chunks)
    assert all(c.choices for c in chunks)


def test_n2_and_ignore_eos(client):
    resp = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], n=2, max_tokens=6,
                                     temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in resp.choices) == [0, 1]
    assert all(c.finish_reason == "length" for c in resp.choices)
    assert resp.usage.completion_tokens == 12

    chunks = list(client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, n=2, max_tokens=5, temperature=1.0, seed=7,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    finished = {c.choices[0].index: c.choices[0].finish_reason
                for c in chunks if c.choices and c.choices[0].finish_reason}
    assert finished == {0: "length", 1: "length"}
    assert chunks[-1].usage.completion_tokens == 10


def test_list_of_prompts_gives_a_choice_per_prompt(client):
    resp = client.completions.create(model=MODEL_NAME, prompt=PROMPTS, max_tokens=3,
                                     temperature=0)
    assert [c.index for c in resp.choices] == [0, 1]
    single = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=3,
                                       temperature=0)
    assert resp.choices[1].text == single.choices[0].text


def test_stop_string_truncates_and_reports_stop(client):
    base = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], temperature=0,
                                     max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True})
    text = base.choices[0].text
    # a stop string from the middle of the greedy continuation; the engine stops at its
    # first occurrence
    middle = len(text) // 2
    stop = text[middle:middle + 3]
    cut = text.index(stop)
    for stream in (False, True):
        resp = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], temperature=0,
                                         max_tokens=MAX_TOKENS, stop=[stop], stream=stream,
                                         extra_body={"ignore_eos": True})
        if stream:
            chunks = list(resp)
            got = "".join(c.choices[0].text for c in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            got, reason = resp.choices[0].text, resp.choices[0].finish_reason
        assert got == text[:cut]
        assert reason == "stop"


def test_seed_makes_sampling_reproducible(client):
    def sample(seed: int) -> str:
        return client.chat.completions.create(
            model=MODEL_NAME, messages=CHAT, temperature=1.0, seed=seed, max_tokens=10,
            extra_body={"ignore_eos": True}).choices[0].message.content

    first = sample(1234)
    assert sample(1234) == first
    assert any(sample(seed) != first for seed in (1, 2, 3))


def test_logprobs_present_and_consistent(client):
    resp = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], temperature=0,
                                     max_tokens=5, logprobs=2)
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == resp.choices[0].text
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 2 and value <= 0.0
        assert max(top.values()) == pytest.approx(value)  # greedy picks the most likely
        assert top[token] == pytest.approx(value)

    chat = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, temperature=0,
                                          max_tokens=5, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 5
    for item in content:
        assert len(item.top_logprobs) == 3
        assert item.top_logprobs[0].token == item.token
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob)
        assert [t.logprob for t in item.top_logprobs] == sorted(
            (t.logprob for t in item.top_logprobs), reverse=True)

    streamed = list(client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, temperature=0, max_tokens=5, logprobs=True,
        top_logprobs=1, stream=True))
    tokens = [t.token for c in streamed if c.choices and c.choices[0].logprobs
              for t in c.choices[0].logprobs.content]
    assert tokens == [item.token for item in content]


def test_metrics_after_requests(server, client):
    client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=3)
    m = server.wait_idle()
    assert m["pagedserve_num_requests_running"] == 0
    assert m["pagedserve_kv_cache_usage_perc"] == 0.0  # nothing held beyond the prefix cache
    assert m["pagedserve_prompt_tokens_total"] > 0
    assert m["pagedserve_generation_tokens_total"] >= 3
    # the same prompts were sent repeatedly: the prefix cache was asked and hit
    assert m["pagedserve_prefix_cache_queries_total"] > 0
    assert m["pagedserve_prefix_cache_hits_total"] > 0
    assert m["pagedserve_time_to_first_token_seconds_count"] > 0
    assert m["pagedserve_time_per_output_token_seconds_count"] > 0
    assert m["pagedserve_e2e_request_latency_seconds_count"] > 0
    assert m["pagedserve_num_requests_waiting"] == 0
    assert "pagedserve_num_preemptions_total" in m
    # every request was prefilled and decoded: steps ran; the CPU has no CUDA graphs
    assert m["pagedserve_engine_steps_total"] >= 3
    assert m["pagedserve_decode_graph_steps_total"] == 0


LONG_PROMPT = "Paged attention stores the KV cache in fixed-size blocks. " * 8


def test_repeated_prompt_reports_cached_tokens(client):
    first = client.completions.create(model=MODEL_NAME, prompt=LONG_PROMPT, max_tokens=2)
    again = client.completions.create(model=MODEL_NAME, prompt=LONG_PROMPT, max_tokens=2)
    assert first.usage.prompt_tokens == again.usage.prompt_tokens > 32
    # every full block but the one holding the last prompt token comes from the cache
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached == (again.usage.prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE


def test_cache_salt_isolates_the_prefix_cache(client):
    def cached(**extra) -> int:
        resp = client.completions.create(model=MODEL_NAME, prompt="Tenant data. " + LONG_PROMPT,
                                         max_tokens=1, extra_body=extra)
        return resp.usage.prompt_tokens_details.cached_tokens

    cached(cache_salt="tenant-a")
    assert cached(cache_salt="tenant-a") > 0
    assert cached(cache_salt="tenant-b") == 0
