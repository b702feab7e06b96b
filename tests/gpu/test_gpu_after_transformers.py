"""Issue 27's regression: an engine started in a process whose GPU memory transformers used
and freed first (then a second engine in the same process) runs, and gives transformers'
float32 greedy tokens wherever the torch reference backend does.

What broke: the engine's memory-profiling prefill ran positions past the model's RoPE table
(`device/profile_run.py`). In a fresh process the overrun read stayed inside mapped memory;
after transformers had allocated and freed gigabytes, the table could end a mapped segment
and the read faulted: "an illegal memory access", every later CUDA call failing. The model
is the issue's: a random Qwen3 whose context (4096) is far shorter than an H100's
max_num_batched_tokens (16384), with the LM head untied and scaled so greedy tokens are not
near-ties. float32 everywhere, so agreement is exact, not within bf16 noise.
"""

from __future__ import annotations

import gc
import random

import pytest
import torch

from tests.gpu.checkpoints import QWEN3_8_LAYERS, random_checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return random_checkpoint(tmp_path_factory.mktemp("issue27"), QWEN3_8_LAYERS, "float32",
                             seed=random.randrange(1 << 16))


def _prompts() -> list[list[int]]:
    """32 prompts of 5-390 tokens, half of them behind one 60-token prefix (prefix caching)."""
    rng = random.Random()
    prefix = [rng.randrange(3, 259) for _ in range(60)]
    prompts = []
    for i in range(32):
        body = [rng.randrange(3, 259) for _ in range(rng.randrange(5, 330))]
        prompts.append(prefix + body if i % 2 else body)
    return prompts


@torch.inference_mode()
def _transformers_tokens(checkpoint: str, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy float32 tokens, then a bf16 pass over the same prompts: transformers leaves
    the caching allocator's segments freed and refilled, as a user's process would."""
    from transformers import AutoModelForCausalLM

    tokens = []
    for dtype in (torch.float32, torch.bfloat16):
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype).cuda().eval()
        for ids in prompts:
            out = model.generate(torch.tensor([ids], device="cuda"), max_new_tokens=NEW_TOKENS,
                                 do_sample=False, eos_token_id=-1, pad_token_id=0)
            if dtype == torch.float32:
                tokens.append(out[0, len(ids):].tolist())
        model.cpu()
        del model
    torch.cuda.empty_cache()
    return tokens


def _engine_tokens(checkpoint: str, prompts: list[list[int]], backend: str) -> list[list[int]]:
    """The KV cache is sized by the memory profile (the path that faulted), over what the
    other tests' fixtures leave free: 6 GiB more than is in use now. The profile batch is an
    H100's default 16384 tokens, four times the model's context, whatever that leaves."""
    from pagedserve.frontend.llm_engine import LLMEngine
    from pagedserve.sampling_params import SamplingParams
    from pagedserve.entrypoints.llm import LLM

    free, total = torch.cuda.mem_get_info()
    engine = LLMEngine.from_options(  # the core in this process, beside transformers
        model=checkpoint, device="cuda", dtype="float32", attention_backend=backend,
        max_num_seqs=64, max_num_batched_tokens=16384,
        gpu_memory_utilization=min(0.95, (total - free + (6 << 30)) / total))
    llm = LLM.from_engine(engine)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()  # an illegal access surfaces here at the latest
    del llm, engine
    gc.collect()  # the engine's memory goes back before the next one measures what is free
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_engine_after_transformers_and_another_engine(checkpoint):
    prompts = _prompts()
    reference = _transformers_tokens(checkpoint, prompts)
    triton = _engine_tokens(checkpoint, prompts, "triton")
    torch_ref = _engine_tokens(checkpoint, prompts, "torch")  # a second engine, same process
    again = _engine_tokens(checkpoint, prompts, "triton")  # and a third
    assert again == triton
    exact = [i for i in range(len(prompts)) if torch_ref[i] == reference[i]]
    assert len(exact) >= len(prompts) * 3 // 4, f"torch backend matched only {len(exact)}"
    wrong = [i for i in exact if triton[i] != reference[i]]
    assert not wrong, f"Triton tokens differ from transformers' on prompts {wrong}"
