"""GGUF files made from tiny HF checkpoints, laid out as llama.cpp's converter lays them out,
so the GGUF loader is tested on every family without a model download.

What the converter does to a checkpoint, and this writer does too: llama-arch models (Llama,
Mistral, Mixtral) get the rows of Q and K interleaved per head; Gemma's norm weights are stored
as 1 + w; each layer's experts are stacked into one [E, rows, cols] tensor per projection;
Phi-3 keeps qkv and gate/up fused and its longrope factors as two tensors with the attention
factor in the metadata; Llama 3.1's scaling becomes `rope_freqs`, a divisor per frequency. Tensor names come from the gguf package's own HF -> GGUF map
(`gguf.get_tensor_name_map`), not from our loader's table, so an error in either shows.

Metadata the converter does not write but a GGUF can carry is written only where the
checkpoint needs it: Mistral's window (`llama.attention.sliding_window`), a Gemma layer pattern
other than the default, a Gemma score scale other than head_dim ** -0.5 (`attention.scale`),
Qwen3-MoE routing without renormalisation (`expert_weights_norm`).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import torch
from gguf import (MODEL_ARCH_NAMES, MODEL_TENSOR, TENSOR_NAMES, GGUFWriter, RopeScalingType,
                  get_tensor_name_map)
from safetensors.torch import load_file
from transformers import AutoConfig

# HF model_type -> GGUF architecture
ARCHITECTURES = {"llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "qwen2",
                 "qwen3": "qwen3", "qwen3_moe": "qwen3moe", "phi3": "phi3", "gemma2": "gemma2",
                 "gemma3_text": "gemma3"}
MODEL_ARCH_BY_NAME = {name: arch for arch, name in MODEL_ARCH_NAMES.items()}
GEMMA_PATTERN = {"gemma2": 2, "gemma3": 6}  # every n-th layer global unless stated
# one expert's projection in a checkpoint: (layer, expert, projection)
_EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\."
                     r"(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight")
_STACKED = {"w1": MODEL_TENSOR.FFN_GATE_EXP, "gate_proj": MODEL_TENSOR.FFN_GATE_EXP,
            "w3": MODEL_TENSOR.FFN_UP_EXP, "up_proj": MODEL_TENSOR.FFN_UP_EXP,
            "w2": MODEL_TENSOR.FFN_DOWN_EXP, "down_proj": MODEL_TENSOR.FFN_DOWN_EXP}


def write_gguf(folder: Path, path: Path) -> Path:
    """Convert the float32 checkpoint in `folder` (config.json, model.safetensors) to `path`."""
    config = AutoConfig.from_pretrained(folder)
    arch = ARCHITECTURES[config.model_type]
    writer = GGUFWriter(str(path), arch)
    write_metadata(writer, config, arch)
    for name, tensor in gguf_tensors(load_file(folder / "model.safetensors"), config, arch):
        writer.add_tensor(name, np.ascontiguousarray(tensor.numpy()))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_metadata(writer: GGUFWriter, config, arch: str) -> None:
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
    write_rope(writer, config)
    write_window(writer, config, arch)
    write_experts(writer, config, arch)
    if arch in GEMMA_PATTERN:
        if config.query_pre_attn_scalar != head_dim:
            writer.add_attention_scale(config.query_pre_attn_scalar**-0.5)
        if getattr(config, "attn_logit_softcapping", None):
            writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        if config.final_logit_softcapping:
            writer.add_final_logit_softcapping(config.final_logit_softcapping)
    writer.add_tokenizer_model("llama")
    writer.add_token_list([f"<t{i}>" for i in range(config.vocab_size)])
    writer.add_token_scores([0.0] * config.vocab_size)
    writer.add_token_types([1] * config.vocab_size)
    if config.bos_token_id is not None:
        writer.add_bos_token_id(config.bos_token_id)
    if config.eos_token_id is not None:
        writer.add_eos_token_id(config.eos_token_id)


def write_rope(writer: GGUFWriter, config) -> None:
    params = config.rope_parameters
    full = params.get("full_attention", params)
    writer.add_rope_freq_base(full["rope_theta"])
    if "sliding_attention" in params:
        writer.add_rope_freq_base_swa(params["sliding_attention"]["rope_theta"])
    kind = full.get("rope_type", "default")
    if kind == "linear":
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(full["factor"])
    elif kind == "yarn":
        writer.add_rope_scaling_type(RopeScalingType.YARN)
        writer.add_rope_scaling_factor(full["factor"])
        writer.add_rope_scaling_orig_ctx_len(full["original_max_position_embeddings"])
    elif kind == "longrope":  # Phi-3: no type key, the factors as tensors (`gguf_tensors`)
        original = full["original_max_position_embeddings"]
        scale = config.max_position_embeddings / original
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_rope_scaling_attn_factors(
            math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
    elif kind not in ("default", "llama3"):  # llama3: a tensor (`gguf_tensors`)
        raise ValueError(f"a GGUF cannot carry rope scaling {kind!r}")


def write_window(writer: GGUFWriter, config, arch: str) -> None:
    window = getattr(config, "sliding_window", None)
    if arch == "phi3":
        writer.add_sliding_window(window or 0)
    elif window and arch in ("llama", *GEMMA_PATTERN):
        writer.add_sliding_window(window)
    if arch in GEMMA_PATTERN:
        n = GEMMA_PATTERN[arch]
        sliding = [t == "sliding_attention" for t in config.layer_types]
        if sliding != [i % n < n - 1 for i in range(config.num_hidden_layers)]:
            writer.add_sliding_window_pattern(sliding)


def write_experts(writer: GGUFWriter, config, arch: str) -> None:
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if not experts:
        return
    writer.add_expert_count(experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    if arch == "qwen3moe":
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        if not config.norm_topk_prob:
            writer.add_expert_weights_norm(False)


def interleave_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Per head, rows of the two RoPE halves [a0..an | b0..bn] -> pairs [a0 b0 a1 b1 ..]."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).transpose(1, 2) \
        .reshape(w.shape)


def gguf_tensors(tensors: dict[str, torch.Tensor], config,
                 arch: str) -> list[tuple[str, torch.Tensor]]:
    names = get_tensor_name_map(MODEL_ARCH_BY_NAME[arch], config.num_hidden_layers)
    out, experts = [], {}
    for hf_name, w in tensors.items():
        if arch == "llama" and re.search(r"\.(q|k)_proj\.(weight|bias)$", hf_name):
            heads = (config.num_attention_heads if ".q_proj." in hf_name
                     else config.num_key_value_heads)
            w = interleave_rope_rows(w, heads)
        if arch in GEMMA_PATTERN and hf_name.endswith("norm.weight"):
            w = w + 1
        expert = _EXPERT.fullmatch(hf_name)
        if expert is not None:
            layer, e, proj = expert.groups()
            experts.setdefault((int(layer), _STACKED[proj]), {})[int(e)] = w
            continue
        base, suffix = hf_name.rsplit(".", 1)
        name = names.get_name(base)
        if name is None:
            raise ValueError(f"the gguf package maps no GGUF name for {hf_name}")
        out.append((f"{name}.{suffix}", w))
    for (layer, kind), stack in experts.items():
        out.append((TENSOR_NAMES[kind].format(bid=layer) + ".weight",
                    torch.stack([stack[e] for e in sorted(stack)])))
    rope = config.rope_parameters
    if rope.get("rope_type") == "longrope":
        out.append(("rope_factors_long.weight", torch.tensor(rope["long_factor"])))
        out.append(("rope_factors_short.weight", torch.tensor(rope["short_factor"])))
    if rope.get("rope_type") == "llama3":
        out.append(("rope_freqs.weight", llama3_freq_factors(rope, config.head_dim)))
    return out


def llama3_freq_factors(rope: dict, dim: int) -> torch.Tensor:
    """Llama 3.1's scaling as a divisor per frequency: 1 for wavelengths shorter than
    original / high_freq_factor, `factor` past original / low_freq_factor, blended between."""
    freqs = 1.0 / rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    original = rope["original_max_position_embeddings"]
    factors = []
    for wavelen in (2 * math.pi / freqs).tolist():
        if wavelen < original / high:
            factors.append(1.0)
        elif wavelen > original / low:
            factors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32)
