"""A Hugging Face folder's config.json as transformers' config classes read it, without them.

Why not `AutoConfig`: importing transformers' config machinery pulls in its generation code
(torch.distributed's tensor module, torch._dynamo, scikit-learn in some releases), which took
most of the engine core's start-up. The engine core reads only the fields `ModelConfig` uses,
for the model types it serves, so this module applies transformers' rules for those alone:
each class's defaults for keys config.json leaves out, the derived fields (head_dim,
num_key_value_heads, sliding windows and layer types) and the rope normalisation (legacy
`rope_scaling` and `rope_theta` folded into `rope_parameters`, Gemma 3's per-layer-type
parameters, Phi-3's longrope). A model type not listed goes through `AutoConfig` itself.
tests/model/test_hf_config.py holds every field to AutoConfig's.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

# The defaults of transformers' config class for each model type, for the fields read here.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                  num_hidden_layers=32, num_attention_heads=32, head_dim=None, rms_norm_eps=1e-06,
                  max_position_embeddings=2048, tie_word_embeddings=False, attention_bias=False,
                  mlp_bias=False, bos_token_id=1, eos_token_id=2, hidden_act="silu"),
    "mistral": dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                    head_dim=None, rms_norm_eps=1e-06, max_position_embeddings=131072,
                    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, sliding_window=4096,
                    hidden_act="silu"),
    "qwen2": dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016,
                  num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                  rms_norm_eps=1e-06, max_position_embeddings=32768, tie_word_embeddings=False,
                  bos_token_id=None, eos_token_id=None, sliding_window=4096, hidden_act="silu",
                  use_sliding_window=False, max_window_layers=28),
    "qwen3": dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016,
                  num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                  head_dim=128, rms_norm_eps=1e-06, max_position_embeddings=32768,
                  tie_word_embeddings=False, attention_bias=False, bos_token_id=None,
                  eos_token_id=None, sliding_window=4096, hidden_act="silu",
                  use_sliding_window=False, max_window_layers=28),
    "phi3": dict(vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                 num_attention_heads=32, rms_norm_eps=1e-05, max_position_embeddings=4096,
                 tie_word_embeddings=False, bos_token_id=1, eos_token_id=32000,
                 sliding_window=None, hidden_act="silu", original_max_position_embeddings=4096),
    "gemma2": dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216,
                   num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
                   head_dim=256, rms_norm_eps=1e-06, max_position_embeddings=8192,
                   tie_word_embeddings=True, attention_bias=False, bos_token_id=2, eos_token_id=1,
                   sliding_window=4096, hidden_activation="gelu_pytorch_tanh",
                   query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
                   final_logit_softcapping=30.0),
    "gemma3_text": dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216,
                        num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
                        head_dim=256, rms_norm_eps=1e-06, max_position_embeddings=131072,
                        tie_word_embeddings=True, attention_bias=False, bos_token_id=2,
                        eos_token_id=1, sliding_window=4096, hidden_activation="gelu_pytorch_tanh",
                        query_pre_attn_scalar=256, attn_logit_softcapping=None,
                        final_logit_softcapping=None, use_bidirectional_attention=False),
    "mixtral": dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                    head_dim=None, rms_norm_eps=1e-05, max_position_embeddings=131072,
                    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, sliding_window=None,
                    hidden_act="silu", num_local_experts=8, num_experts_per_tok=2),
    "qwen3_moe": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                      num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=4,
                      rms_norm_eps=1e-06, max_position_embeddings=32768,
                      tie_word_embeddings=False, attention_bias=False, bos_token_id=None,
                      eos_token_id=None, sliding_window=4096, hidden_act="silu", num_experts=128,
                      num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=False,
                      decoder_sparse_step=1, use_sliding_window=False),
}
MODEL_TYPES = tuple(_DEFAULTS)
_DEFAULT_THETA = {"mixtral": 1_000_000.0}  # else 10,000
_GEMMA3_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}
_LAYER_TYPE_KEYS = ("full_attention", "sliding_attention")
_SCALED_ROPES = ("llama3", "yarn", "longrope")  # measured against a pretraining length


def read_hf_config(folder: str | Path) -> Any:
    """The folder's config as an object with transformers' attribute names and values (a
    transformers config itself for a model type not in `MODEL_TYPES`)."""
    raw = json.loads((Path(folder) / "config.json").read_text())
    model_type = raw.get("model_type")
    if model_type not in _DEFAULTS:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(folder)
    return SimpleNamespace(**hf_attributes(raw))


def hf_attributes(raw: dict[str, Any]) -> dict[str, Any]:
    """config.json's keys (one of `MODEL_TYPES`) with the class's defaults, derived fields and
    normalised rope parameters, as transformers' config object has them."""
    model_type = raw["model_type"]
    attrs = {**_DEFAULTS[model_type], **copy.deepcopy(raw)}
    if model_type in ("mixtral", "qwen3_moe"):  # one count under either name
        count = raw.get("num_local_experts", raw.get("num_experts"))
        if count is None:
            count = attrs.get("num_local_experts", attrs.get("num_experts"))
        attrs["num_experts"] = attrs["num_local_experts"] = count
    attrs["dtype"] = raw.get("dtype") or raw.get("torch_dtype")
    if model_type == "qwen3_moe" and attrs.get("mlp_only_layers") is None:
        attrs["mlp_only_layers"] = []
    if attrs.get("num_key_value_heads") is None:
        attrs["num_key_value_heads"] = attrs["num_attention_heads"]
    if model_type in ("llama", "mistral") and attrs.get("head_dim") is None:
        attrs["head_dim"] = attrs["hidden_size"] // attrs["num_attention_heads"]
    _sliding_layers(attrs, model_type)
    attrs["rope_parameters"] = _rope_parameters(attrs, model_type)
    return attrs


def _sliding_layers(attrs: dict[str, Any], model_type: str) -> None:
    """sliding_window and layer_types as each class's `__post_init__` derives them."""
    layers = attrs["num_hidden_layers"]
    if model_type in ("qwen2", "qwen3", "qwen3_moe"):
        if not attrs.get("use_sliding_window"):
            attrs["sliding_window"] = None
        if model_type != "qwen3_moe" and attrs.get("layer_types") is None:
            window, first = attrs["sliding_window"], attrs["max_window_layers"]
            attrs["layer_types"] = [
                "sliding_attention" if window is not None and i >= first else "full_attention"
                for i in range(layers)]
    elif model_type == "gemma2" and attrs.get("layer_types") is None:
        attrs["layer_types"] = ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                for i in range(layers)]
    elif model_type == "gemma3_text":
        if attrs.get("use_bidirectional_attention"):
            attrs["sliding_window"] = attrs["sliding_window"] // 2 + 1
        pattern = attrs.get("sliding_window_pattern", 6)
        if attrs.get("layer_types") is None:
            attrs["layer_types"] = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                    for i in range(layers)]


def _rope_parameters(attrs: dict[str, Any], model_type: str) -> dict[str, Any]:
    """`rope_parameters` as transformers normalises it: the legacy `rope_scaling` wins over
    `rope_parameters`, and each parameter set is completed by `_complete`."""
    if model_type == "gemma3_text":
        return _gemma3_rope(attrs)
    rope = attrs.get("rope_scaling") or attrs.get("rope_parameters") or {}
    theta = attrs.get("rope_theta", _DEFAULT_THETA.get(model_type, 10_000.0))
    partial = attrs.get("partial_rotary_factor", 1.0 if model_type == "phi3" else None)
    nested = [key for key in _LAYER_TYPE_KEYS if key in rope]
    for params in [rope[key] for key in nested] or [rope]:
        if params is not None:
            _complete(params, attrs, theta, partial, beside=not nested)
    if model_type == "phi3" and rope.get("rope_type") in ("su", "yarn"):
        rope["rope_type"] = "longrope"
    return rope


def _complete(params: dict[str, Any], attrs: dict[str, Any], theta: float,
              partial: float | None, beside: bool = False) -> None:
    """rope_theta (and partial_rotary_factor) inside; "type" names the rope_type where that is
    missing; the scaled types get the pretraining length they are measured against (`beside`:
    a config's own original_max_position_embeddings wins, as Phi-3 keeps it there)."""
    params.setdefault("rope_theta", theta)
    if partial is not None:
        params.setdefault("partial_rotary_factor", partial)
    params.setdefault("rope_type", params.get("type", "default"))
    if params["rope_type"] in _SCALED_ROPES:
        if beside and "original_max_position_embeddings" in attrs:
            params["original_max_position_embeddings"] = attrs["original_max_position_embeddings"]
        else:
            params.setdefault("original_max_position_embeddings",
                              attrs["max_position_embeddings"])


def _gemma3_rope(attrs: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3: parameters per layer type, each with its own default theta; a legacy
    rope_scaling is the global layers'."""
    rope = attrs.get("rope_parameters") or {key: {"rope_type": "default"}
                                            for key in _LAYER_TYPE_KEYS}
    if attrs.get("rope_scaling") is not None:
        rope["full_attention"].update(attrs["rope_scaling"])
    thetas = {"full_attention": attrs.get("rope_theta", _GEMMA3_THETA["full_attention"]),
              "sliding_attention": attrs.get("rope_local_base_freq",
                                             _GEMMA3_THETA["sliding_attention"])}
    for key in _LAYER_TYPE_KEYS:
        if rope.get(key) is None:
            rope[key] = {"rope_type": "default"}
        _complete(rope[key], attrs, thetas[key], attrs.get("partial_rotary_factor"))
    return rope
