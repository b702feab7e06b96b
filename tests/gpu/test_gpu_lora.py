"""LoRA on CUDA: the Triton kernels (segments for prefills, rows for decodes) under CUDA graphs,
float32, against PEFT's model on the GPU; and a batch mixing adapters and the base model gives
each request what it gets alone (the decode graphs read each row's slot from its buffer), also
when the step switches between the graphs captured with and without the adapters' kernels."""

from __future__ import annotations

import pytest
import torch

from pagedserve.config import EngineConfig
from pagedserve.frontend.llm_engine import LLMEngine, LoadedModel
from pagedserve.sampling_params import SamplingParams
from tests.lora_adapters import ADAPTERS, PROMPT, base_checkpoint, make_adapters, run

peft = pytest.importorskip("peft")
from transformers import AutoModelForCausalLM  # noqa: E402

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu-lora")
    base = base_checkpoint(root, "tiny-llama3")
    adapters = make_adapters(base, root)
    loaded = LoadedModel.load(EngineConfig(model=str(base), device="cuda", dtype="float32"))
    return base, adapters, loaded


def engine(family, **options) -> LLMEngine:
    base, _, loaded = family
    return LLMEngine(EngineConfig(
        model=str(base), device="cuda", dtype="float32", enable_lora=True, max_loras=2,
        max_lora_rank=16, kv_cache_memory=64 << 20, block_size=16, max_num_seqs=8,
        **options), loaded)


PARAMS = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.mark.parametrize("adapter", list(ADAPTERS))
def test_greedy_tokens_match_peft_on_cuda(family, adapter):
    base, adapters, _ = family
    lora = adapters[adapter]
    got = run(engine(family), {"r": (PROMPT, lora)}, PARAMS)["r"].outputs[0].token_ids
    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).cuda()
    ref = peft.PeftModel.from_pretrained(hf, lora.lora_path).eval()
    ids = torch.tensor([PROMPT], device="cuda")
    with torch.no_grad():
        expected = ref.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                pad_token_id=0)[0, len(PROMPT):].tolist()
    assert got == expected


def test_mixed_batch_under_graphs_matches_alone(family):
    _, adapters, _ = family
    requests = {"base": (PROMPT, None)}
    for i, (name, lora) in enumerate(adapters.items()):
        requests[name] = (PROMPT[i:] + [i + 7] * 5, lora)
    alone = {rid: run(engine(family), {rid: req}, PARAMS)[rid].outputs[0].token_ids
             for rid, req in requests.items()}
    together = run(engine(family, max_num_batched_tokens=16), requests, PARAMS)
    assert {rid: out.outputs[0].token_ids for rid, out in together.items()} == alone


def test_switching_between_graphs_with_and_without_lora_matches_alone(family):
    """The adapters' requests finish first: the base request's later steps have no adapter
    row and replay the graphs captured without LoRA, its earlier ones those with it."""
    _, adapters, _ = family
    requests = {"base": (PROMPT, None)}
    params = {"base": PARAMS}
    for i, (name, lora) in enumerate(adapters.items()):
        requests[name] = (PROMPT[i:] + [i + 7] * 5, lora)
        params[name] = SamplingParams(temperature=0.0, max_tokens=3 + i, ignore_eos=True)
    alone = {rid: run(engine(family), {rid: req}, params[rid])[rid].outputs[0].token_ids
             for rid, req in requests.items()}
    eng = engine(family)
    for rid, (prompt, lora) in requests.items():
        eng.add_request(rid, None, params[rid], prompt_token_ids=prompt, lora_request=lora)
    together = {}
    while eng.has_unfinished_requests():
        together.update({o.request_id: o.outputs[0].token_ids for o in eng.step()
                         if o.finished})
    assert together == alone
