"""Tiny random EAGLE-3 heads in the published checkpoint layout (`pagedserve/model/eagle3.py`
describes it), written the way the EAGLE authors' and SpecForge's checkpoints are: HF names
under `midlayer.`, q/k/v and gate/up apart, a smaller draft vocabulary with `d2t` offsets
and a `t2d` mask, no embedding (the target's is used)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def write_eagle3_head(folder: Path, target: dict, layer_ids: list[int] | None,
                      draft_vocab: int, seed: int = 0, heads: int = 4, kv_heads: int = 2,
                      head_dim: int = 32, **overrides) -> Path:
    """A head for the target whose HF config is `target`: one Llama layer of the target's
    hidden size. `overrides` change config.json's fields (another vocabulary, say)."""
    gen = torch.Generator().manual_seed(seed)
    hidden = target["hidden_size"]
    inter = 2 * hidden
    vocab = target["vocab_size"]

    def rand(*shape, scale=0.15):
        return torch.randn(*shape, generator=gen) * scale

    def norm(dim):
        return 1 + 0.2 * torch.randn(dim, generator=gen)

    targets = torch.sort(torch.randperm(vocab, generator=gen)[:draft_vocab]).values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[targets] = True
    tensors = {
        "fc.weight": rand(hidden, 3 * hidden, scale=0.03),  # attention matters as much
        "midlayer.input_layernorm.weight": norm(hidden),
        "midlayer.hidden_norm.weight": norm(hidden),
        "midlayer.post_attention_layernorm.weight": norm(hidden),
        "midlayer.self_attn.q_proj.weight": rand(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": rand(hidden, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": rand(inter, hidden),
        "midlayer.mlp.up_proj.weight": rand(inter, hidden),
        "midlayer.mlp.down_proj.weight": rand(hidden, inter),
        "norm.weight": norm(hidden),
        "lm_head.weight": rand(draft_vocab, hidden, scale=0.5),
        "d2t": targets - torch.arange(draft_vocab),
        "t2d": t2d,
    }
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": hidden, "intermediate_size": inter, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "num_hidden_layers": 1,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu",
        "max_position_embeddings": target["max_position_embeddings"], "vocab_size": vocab,
        "draft_vocab_size": draft_vocab, "tie_word_embeddings": False,
    }
    if layer_ids is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": layer_ids,
                                  "use_aux_hidden_state": True}
    config.update(overrides)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    return folder
