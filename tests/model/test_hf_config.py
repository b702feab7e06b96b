"""hf_config reads config.json as transformers' AutoConfig does, on every field ModelConfig
uses: the checked-in configs of every family, the same with only the required keys (each
class's defaults), in the legacy rope layout, with each rope scaling and the derived sliding
windows."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from transformers import AutoConfig

from pagedserve.model.config import ModelConfig
from pagedserve.model.hf_config import MODEL_TYPES, hf_attributes, read_hf_config

CONFIGS = Path(__file__).resolve().parents[2] / "benchmarks" / "configs"
FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
          "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
          "max_position_embeddings", "tie_word_embeddings", "attention_bias", "mlp_bias",
          "bos_token_id", "eos_token_id", "sliding_window", "layer_types", "rope_parameters",
          "hidden_act", "hidden_activation", "query_pre_attn_scalar", "attn_logit_softcapping",
          "final_logit_softcapping", "num_local_experts", "num_experts", "num_experts_per_tok",
          "moe_intermediate_size", "norm_topk_prob", "mlp_only_layers", "decoder_sparse_step")
SCALINGS = ({"type": "linear", "factor": 2.0}, {"rope_type": "yarn", "factor": 4.0},
            {"type": "dynamic", "factor": 2.0},
            {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
             "high_freq_factor": 4.0, "original_max_position_embeddings": 1024})


def _variants(raw: dict) -> dict[str, dict]:
    """The config as checked in, and edited the ways checkpoints on the Hub differ."""
    out = {"as is": raw}
    out["required keys only"] = {k: raw[k] for k in ("architectures", "model_type",
                                                      "hidden_size", "num_attention_heads",
                                                      "num_hidden_layers") if k in raw}
    legacy = copy.deepcopy(raw)
    rope = legacy.pop("rope_parameters", None) or {}
    if "full_attention" not in rope:
        legacy["rope_theta"] = rope.pop("rope_theta", 10000.0)
        if rope.get("rope_type", "default") != "default":
            rope["type"] = rope.pop("rope_type")
            legacy["rope_scaling"] = rope
        out["legacy rope_scaling"] = legacy
    for scaling in SCALINGS if raw["model_type"] != "phi3" else ():
        scaled = copy.deepcopy(raw)
        scaled.pop("rope_parameters", None)
        scaled.update(rope_scaling=scaling, rope_theta=500000.0)
        out[f"rope {scaling.get('type') or scaling['rope_type']}"] = scaled
    if raw["model_type"] in ("qwen2", "qwen3", "qwen3_moe"):
        out["sliding"] = {**raw, "use_sliding_window": True, "sliding_window": 64,
                          "max_window_layers": 1}
    if raw["model_type"] == "gemma3_text":
        old = {k: v for k, v in raw.items() if k not in ("layer_types", "rope_parameters")}
        out["gemma3 legacy"] = {**old, "sliding_window_pattern": 2, "rope_theta": 1e6,
                                "rope_local_base_freq": 1e4,
                                "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    if raw["model_type"] == "phi3":
        half = raw["hidden_size"] // raw["num_attention_heads"] // 2
        longrope = {k: v for k, v in raw.items() if k != "rope_parameters"}
        out["phi3 longrope"] = {**longrope, "original_max_position_embeddings": 64,
                                "rope_scaling": {"type": "longrope", "short_factor": [1.0] * half,
                                                 "long_factor": [2.0] * half}}
    out["torch_dtype"] = {k: v for k, v in raw.items() if k != "dtype"} | {
        "torch_dtype": "bfloat16"}
    return out


CASES = [(path.stem, name, variant) for path in sorted(CONFIGS.glob("*.json"))
         for name, variant in _variants(json.loads(path.read_text())).items()]


def test_the_configs_cover_every_model_type():
    assert {json.loads(p.read_text())["model_type"] for p in CONFIGS.glob("*.json")} == \
        set(MODEL_TYPES)


@pytest.mark.parametrize("shape, name, raw", CASES, ids=[f"{s}-{n}" for s, n, _ in CASES])
def test_fields_equal_autoconfig(shape, name, raw, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(raw))
    theirs = AutoConfig.from_pretrained(tmp_path)
    ours = hf_attributes(raw)
    for field in FIELDS:
        assert ours.get(field) == getattr(theirs, field, None), field
    assert str(ours["dtype"]) == str(theirs.dtype).removeprefix("torch.") or \
        (ours["dtype"] is None and theirs.dtype is None)


def test_a_model_config_reads_without_importing_transformers(tmp_path):
    """In a fresh interpreter: the public path the engine core takes."""
    import subprocess
    import sys

    (tmp_path / "config.json").write_text((CONFIGS / "qwen3-0.6b.json").read_text())
    code = ("import sys; from pagedserve.model.config import ModelConfig; "
            f"c = ModelConfig.from_hf_folder({str(tmp_path)!r}); "
            "print(c.num_layers, c.head_dim, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["28", "128", "False"]


def test_an_unlisted_model_type_goes_through_autoconfig(tmp_path):
    raw = json.loads((CONFIGS / "tiny-llama3.json").read_text())
    raw["model_type"] = "olmo"  # AutoConfig knows it; its class has no defaults here
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert read_hf_config(tmp_path).hidden_size == raw["hidden_size"]
    config = ModelConfig.from_hf_folder(tmp_path)  # the architecture is still Llama's
    assert config.family == "llama" and config.hidden_size == raw["hidden_size"]
