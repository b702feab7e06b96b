"""prompt_logprobs (vLLM's extension): each prompt position's logprob of the prompt's next
token, its rank and the top ones, against transformers' float32 forward on the same tiny
random checkpoint: whole prefills and chunked ones, sync and async scheduling, a second
request that would hit the prefix cache (it must not skip positions), preemption by
recompute (no position reported twice), n > 1 and a batch mixing requests with and without."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.make_checkpoint import make_checkpoint
from pagedserve.config import EngineConfig
from pagedserve.entrypoints.llm import LLM
from pagedserve.frontend.llm_engine import LLMEngine, LoadedModel
from pagedserve.sampling_params import SamplingParams
from tests.conftest import assert_pool_clean

CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 32,
    "hidden_size": 128, "intermediate_size": 256, "max_position_embeddings": 512,
    "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": True,
    "vocab_size": 259, "bos_token_id": 1, "eos_token_id": 2, "initializer_range": 0.5,
}
TOP = 3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-qwen3-plp")
    (root / "config.json").write_text(json.dumps(CONFIG))
    make_checkpoint(root / "config.json", root / "ckpt", torch.float32, seed=3,
                    tokenizer="bytes")
    return str(root / "ckpt")


@pytest.fixture(scope="module")
def loaded(checkpoint) -> LoadedModel:
    return LoadedModel.load(EngineConfig(model=checkpoint, device="cpu", dtype="float32"))


@pytest.fixture(scope="module")
def reference(checkpoint):
    """prompt -> transformers' float32 log-softmax over the vocabulary at each position."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, torch_dtype=torch.float32).eval()

    def logprobs(prompt: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([prompt])).logits[0].float()
        return logits.log_softmax(-1)

    return logprobs


def prompts(count: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 259, (int(n),), generator=gen).tolist()
            for n in torch.randint(20, 70, (count,), generator=gen)]


def engine(loaded: LoadedModel, **options) -> LLMEngine:
    options.setdefault("kv_cache_memory", 256 * 2 * 2 * 16 * 2 * 32 * 4)
    return LLMEngine(EngineConfig(model="tiny", device="cpu", dtype="float32", block_size=16,
                                  **options), loaded)


def check(output, prompt: list[int], reference) -> None:
    """Every position after the first: the prompt token's logprob and rank, the top ones."""
    got = output.prompt_logprobs
    assert got is not None and len(got) == len(prompt) and got[0] is None
    ref = reference(prompt)
    for pos in range(1, len(prompt)):
        entry, row = got[pos], ref[pos - 1]
        token = prompt[pos]
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        top_lps, top_ids = row.topk(TOP)
        ranked = sorted((e for e in entry.values() if e.rank <= TOP), key=lambda e: e.rank)
        assert [e.logprob for e in ranked][:TOP] == pytest.approx(top_lps.tolist(), abs=1e-4)
        assert set(top_ids.tolist()) <= set(entry)
        assert len(entry) in (TOP, TOP + 1)  # the top ones, plus the prompt token if outside


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("max_num_batched_tokens", [2048, 16])  # whole prefills, chunks of 16
def test_prompt_logprobs_match_transformers(loaded, reference, async_scheduling,
                                            max_num_batched_tokens):
    eng = engine(loaded, async_scheduling=async_scheduling,
                 max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=True)
    batch = prompts(4, seed=1)
    params = [SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True,
                             prompt_logprobs=TOP if i % 2 == 0 else None)
              for i in range(len(batch))]
    outs = LLM.from_engine(eng).generate(batch, params, use_tqdm=False)
    for i, (out, prompt) in enumerate(zip(outs, batch)):
        if i % 2 == 0:
            check(out, prompt, reference)
        else:
            assert out.prompt_logprobs is None
    # the same prompt again: its blocks are cached now, yet every position is reported
    again = LLM.from_engine(eng).generate([batch[0]], params[0], use_tqdm=False)[0]
    check(again, batch[0], reference)
    assert again.num_cached_tokens == 0
    assert_pool_clean(eng)


def test_prompt_logprobs_survive_preemption_and_n(loaded, reference):
    """A pool too small for the batch preempts (recompute): each position is still reported
    once; n = 2 reports the prompt's logprobs once for the request."""
    eng = engine(loaded, kv_cache_memory=12 * 2 * 2 * 16 * 2 * 32 * 4,
                 max_num_batched_tokens=32, async_scheduling=True)
    batch = prompts(4, seed=2)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                            prompt_logprobs=TOP, n=2)
    outs = LLM.from_engine(eng).generate(batch, params, use_tqdm=False)
    assert eng.get_stats().num_preemptions > 0
    for out, prompt in zip(outs, batch):
        check(out, prompt, reference)
    assert_pool_clean(eng)


def test_prompt_logprobs_zero_reports_the_prompt_token_only(loaded, reference):
    prompt = prompts(1, seed=5)[0]
    out = LLM.from_engine(engine(loaded)).generate(
        [prompt], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    assert [list(e) for e in out.prompt_logprobs[1:]] == [[t] for t in prompt[1:]]
    ref = reference(prompt)
    assert [e[t].logprob for e, t in zip(out.prompt_logprobs[1:], prompt[1:])] == pytest.approx(
        [ref[p - 1, t].item() for p, t in enumerate(prompt) if p > 0], abs=1e-4)


def test_prompt_logprobs_must_not_be_negative():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
