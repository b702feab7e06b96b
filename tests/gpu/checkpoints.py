"""Random checkpoints for the GPU tests, made by benchmarks/make_checkpoint.py in a child
process (as a user would run it), so every GPU module builds its weights the same way."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
QWEN3_0_6B = ROOT / "benchmarks/configs/qwen3-0.6b.json"
# an 8-layer Qwen3 of hidden size 1024: quick to build and load, deep enough to drift
QWEN3_8_LAYERS = {
    "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "bos_token_id": 1,
    "eos_token_id": 2, "head_dim": 128, "hidden_size": 1024, "intermediate_size": 3072,
    "max_position_embeddings": 4096, "num_attention_heads": 16, "num_hidden_layers": 8,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
    "tie_word_embeddings": False, "torch_dtype": "float32", "vocab_size": 32000}


def random_checkpoint(folder: Path, config: Path | dict, dtype: str, seed: int = 0,
                      tokenizer: str = "bytes", lm_head_scale: float | None = 25) -> str:
    """An HF folder under `folder` with random weights of `config` (a config.json path or
    its fields) in `dtype`. The LM head is untied and scaled by `lm_head_scale` by default,
    so that greedy agreement means something; `tokenizer` as make_checkpoint.py takes it."""
    if isinstance(config, dict):
        path = folder / "config.json"
        path.write_text(json.dumps(config))
        config = path
    out = folder / "model"
    args = [sys.executable, str(ROOT / "benchmarks/make_checkpoint.py"), str(config),
            str(out), "--dtype", dtype, "--tokenizer", tokenizer, "--seed", str(seed)]
    if lm_head_scale is not None:
        args += ["--lm-head-scale", str(lm_head_scale)]
    subprocess.run(args, check=True)
    return str(out)
