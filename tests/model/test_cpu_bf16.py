"""bfloat16 weights on a CPU that computes in bfloat16 (AVX-512-BF16 or AMX): `--dtype
bfloat16` loads an HF float checkpoint as bfloat16 and runs it through the engine (linear layers
on the native AMX bfloat16 kernel where `native.linear` has it, else torch's oneDNN bfloat16
GEMMs; attention on the native kernel, which reads bfloat16 caches). Held to transformers in
float32 on the same weights: bfloat16 rounds every weight and activation, so logits agree only
coarsely and greedy tokens must be float32's own choice or within that rounding of it. Skipped
on CPUs without bfloat16 compute, where the engine refuses the dtype
(tests/model/test_gguf_fast_mode.py)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from pagedserve.config import EngineConfig
from pagedserve.frontend.llm_engine import LLMEngine, LoadedModel
from pagedserve.kernels.native import linear as native_linear
from pagedserve.kernels.native.build import cpu_flags, has_bf16_compute
from pagedserve.model.decoder import Linear
from pagedserve.model.loader import default_model_path
from pagedserve.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not has_bf16_compute(cpu_flags()),
                                reason="CPU without AVX-512-BF16 / AMX")

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A small Llama with weights large enough that its logits are spread (random weights of
    the usual 0.02 scale give near-ties everywhere), saved in bfloat16."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, initializer_range=0.08,
                         tie_word_embeddings=False)
    hf = AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()
    folder = tmp_path_factory.mktemp("llama-bf16")
    hf.save_pretrained(folder)
    return folder, hf.float()


def test_bfloat16_engine_follows_float32(checkpoint):
    folder, hf = checkpoint
    # the checkpoint has no tokenizer: the default model's takes ids below 512 as well
    config = EngineConfig(model=str(folder), tokenizer=str(default_model_path()),
                          dtype="bfloat16", device="cpu", kv_cache_memory=16 << 20)
    loaded = LoadedModel.load(config)
    assert all(p.dtype == torch.bfloat16 for p in loaded.model.parameters())
    engine = LLMEngine(config, loaded)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (5, 23, 40)]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), None, params, prompt_token_ids=prompt)
    finished = {}
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    outputs = [finished[str(i)] for i in range(len(prompts))]
    layers = [m for m in loaded.model.modules() if isinstance(m, Linear)]
    packed = [getattr(m.matmul, "_packed", None) is not None for m in layers]
    assert layers and all(packed) == any(packed) == native_linear.available(torch.bfloat16)
    exact = 0
    for prompt, out in zip(prompts, outputs):
        tokens = list(out.outputs[0].token_ids)
        assert len(tokens) == NEW_TOKENS
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
        chosen = logits.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        spread = logits.std(-1)
        # every greedy bf16 token is float32's best or within bfloat16's rounding of it
        assert torch.all(chosen >= logits.max(-1).values - 0.1 * spread), (prompt, tokens)
        exact += int((logits.argmax(-1) == torch.tensor(tokens)).sum())
    assert exact >= 0.9 * NEW_TOKENS * len(prompts)
