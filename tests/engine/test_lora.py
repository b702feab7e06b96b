"""LoRA adapters on the CPU engine against PEFT: tiny random Llama and Qwen3 checkpoints, random
adapters made by the `peft` package (ranks 4 to 16, plain and rsLoRA scaling, different target
modules), and the engine's greedy tokens and prompt logprobs (float32) against PEFT's model
with the adapter applied, and merged into the weights. Then what batching must not change: a
step mixing three adapters and the base model gives each request what it gets alone, and the
prefix cache keeps adapters apart.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedserve.config import EngineConfig
from pagedserve.errors import RequestError
from pagedserve.frontend.llm_engine import LLMEngine, LoadedModel
from pagedserve.messages import LoRARequest
from pagedserve.sampling_params import SamplingParams
from tests.lora_adapters import ADAPTERS, PROMPT, base_checkpoint, make_adapters, run

peft = pytest.importorskip("peft")
from transformers import AutoModelForCausalLM  # noqa: E402

NEW_TOKENS = 6


@pytest.fixture(scope="module", params=["tiny-llama3", "tiny-qwen3"])
def family(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    base = base_checkpoint(root, request.param)
    adapters = make_adapters(base, root)
    loaded = LoadedModel.load(EngineConfig(model=str(base), device="cpu", dtype="float32"))
    return base, adapters, loaded


def engine_for(family, **options) -> LLMEngine:
    base, _, loaded = family
    options = {"max_loras": 2, "max_lora_rank": 16, "kv_cache_memory": 4 << 20,
               "block_size": 4, **options}
    return LLMEngine(EngineConfig(model=str(base), device="cpu", dtype="float32",
                                  enable_lora=True, **options), loaded)


def peft_reference(base: Path, lora: LoRARequest | None, merged: bool):
    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    if lora is None:
        return hf
    model = peft.PeftModel.from_pretrained(hf, lora.lora_path).eval()
    return model.merge_and_unload() if merged else model


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True,
                        prompt_logprobs=3)


@pytest.mark.parametrize("adapter", [None, *ADAPTERS])
def test_tokens_and_logprobs_match_peft(family, adapter):
    base, adapters, _ = family
    lora = adapters.get(adapter)
    out = run(engine_for(family), {"r": (PROMPT, lora)}, GREEDY)["r"]
    tokens = out.outputs[0].token_ids
    for merged in (False, True):
        ref = peft_reference(base, lora, merged)
        with torch.no_grad():
            ids = torch.tensor([PROMPT])
            expected = ref.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                    max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                    pad_token_id=0)[0, len(PROMPT):].tolist()
            logprobs = ref(ids).logits[0].float().log_softmax(-1)
        assert tokens == expected, (adapter, merged)
        for position, top in enumerate(out.prompt_logprobs[1:]):  # position 0 has none
            for token_id, logprob in top.items():
                assert logprob.logprob == pytest.approx(logprobs[position, token_id].item(),
                                                        abs=2e-4)


def test_mixed_batch_gives_each_request_what_it_gets_alone(family):
    _, adapters, _ = family
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    requests = {"base": (PROMPT, None)}
    for i, (name, lora) in enumerate(adapters.items()):
        requests[name] = (PROMPT[i:] + [i + 7] * 5, lora)
    alone = {rid: run(engine_for(family), {rid: req}, params)[rid].outputs[0].token_ids
             for rid, req in requests.items()}
    # three adapters over two slots: one waits, then takes an idle slot; chunked prefills
    # run beside decodes of other adapters
    together = run(engine_for(family, max_num_batched_tokens=8, max_loras=2), requests, params)
    assert {rid: out.outputs[0].token_ids for rid, out in together.items()} == alone
    assert len({tuple(tokens) for tokens in alone.values()}) == len(alone)  # adapters matter


def test_prefix_cache_keeps_adapters_apart(family):
    _, adapters, _ = family
    engine = engine_for(family)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    a, b = adapters["all-r8"], adapters["qv-r4-rslora"]
    first = run(engine, {"a1": (PROMPT, a)}, params)["a1"]
    assert first.num_cached_tokens == 0
    assert run(engine, {"b1": (PROMPT, b)}, params)["b1"].num_cached_tokens == 0
    assert run(engine, {"base": (PROMPT, None)}, params)["base"].num_cached_tokens == 0
    again = run(engine, {"a2": (PROMPT, a)}, params)["a2"]
    assert again.num_cached_tokens == 12  # three full blocks of 4 (the last token recomputed)
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_bad_adapters_are_refused_before_anything_runs(family, tmp_path):
    base, adapters, loaded = family
    engine = engine_for(family, max_lora_rank=8)
    params = SamplingParams(max_tokens=1)
    cases = {
        "missing": (LoRARequest("missing", 50, str(tmp_path / "nowhere")), "adapter_config"),
        "rank": (adapters["mlp-o-r16"], "over max_lora_rank 8"),
    }
    for name, (lora, message) in cases.items():
        with pytest.raises(RequestError, match=message) as info:
            engine.add_request(name, None, params, prompt_token_ids=PROMPT, lora_request=lora)
        assert info.value.param == "lora_request"
    assert not engine.has_unfinished_requests()
    off = LLMEngine(EngineConfig(model=str(base), device="cpu", dtype="float32",
                                 kv_cache_memory=1 << 20), loaded)
    with pytest.raises(RequestError, match="enable_lora"):
        off.add_request("x", None, params, prompt_token_ids=PROMPT,
                        lora_request=adapters["all-r8"])
