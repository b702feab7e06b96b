"""Tiny random checkpoints and random PEFT adapters for the LoRA tests (engine, kernels, tensor
parallelism, server, GPU): one small base model per family, adapters of ranks 4 to 16 (plain
and rsLoRA scaling, different target modules) made by the `peft` package itself, and a driver
that runs requests under them to their end."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from benchmarks.make_checkpoint import make_checkpoint
from pagedserve.frontend.llm_engine import LLMEngine
from pagedserve.messages import LoRARequest
from pagedserve.sampling_params import SamplingParams

CONFIGS = Path(__file__).resolve().parents[1] / "benchmarks" / "configs"
SMALL = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1)
ADAPTERS = {  # name -> LoraConfig options
    "all-r8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                        "gate_proj", "up_proj", "down_proj"]),
    "qv-r4-rslora": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj"]),
    "mlp-o-r16": dict(r=16, lora_alpha=8, target_modules=["o_proj", "gate_proj", "down_proj"]),
}
PROMPT = [5, 77, 200, 13, 9, 250, 31, 64, 101, 3, 17, 288, 40]


def base_checkpoint(root: Path, case: str) -> Path:
    """A two-layer float32 checkpoint of benchmarks/configs/<case>.json, shrunk to SMALL."""
    config = json.loads((CONFIGS / f"{case}.json").read_text())
    config.update(SMALL, head_dim=16) if case == "tiny-qwen3" else config.update(SMALL)
    (root / "config.json").write_text(json.dumps(config))
    make_checkpoint(root / "config.json", root / case, torch.float32, seed=0, tokenizer="bytes")
    return root / case


def make_adapter(base: Path, folder: Path, options: dict, seed: int) -> None:
    import peft
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model = peft.get_peft_model(hf, peft.LoraConfig(init_lora_weights=False, **options))
    with torch.no_grad():  # PEFT's random init leaves B small: make every adapter matter
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.2)
    model.save_pretrained(folder)


def make_adapters(base: Path, root: Path) -> dict[str, LoRARequest]:
    """Every adapter of ADAPTERS for `base`, in root/<name>; LoRA ids 1, 2, 3 in that order."""
    requests = {}
    for seed, (name, options) in enumerate(ADAPTERS.items()):
        make_adapter(base, root / name, options, seed)
        requests[name] = LoRARequest(name, seed + 1, str(root / name))
    return requests


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], LoRARequest | None]],
        params: SamplingParams) -> dict[str, object]:
    """Every request (prompt, adapter) to its end: the finished outputs by request id; every
    block is free again afterwards."""
    for request_id, (prompt, lora) in requests.items():
        engine.add_request(request_id, None, params, prompt_token_ids=prompt,
                           lora_request=lora)
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    assert engine.kv_cache_manager.usage == 0.0  # every block freed
    return finished
