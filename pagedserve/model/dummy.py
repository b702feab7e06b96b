"""Random weights for a model folder that has only its config (`load_format="dummy"`).

For measuring shapes nobody has weights for, or that would take minutes to write to disk
(Llama-3-8B is 16 GB in bf16; Llama-3-70B, which fits only on two GPUs, is 141 GB). Element
(r, c) of a tensor is a function of the tensor's name and of r and c alone: a value of a
small table of N(0, 0.02) draws (seeded by the name), at an index hashed from r and c. So a
tensor-parallel rank computes just its own rows or columns (no drawing the whole tensor to
throw half away: that would take minutes at 70B), and every tensor-parallel size gets the
same weights, so TP=2's logits can be held against TP=1's. Norm weights are 1, as
transformers initialises them; vocabulary padding rows are 0.

Llama / Mistral / Qwen2 / Qwen3 shapes and MoE ones (Mixtral, Qwen3-MoE: a router and
per-expert tensors, named as Qwen3-MoE names them); not Gemma's extra norms or Phi-3's fused
tensors.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator

import torch

from pagedserve.model import parallel
from pagedserve.model.config import ModelConfig

INIT_STD = 0.02


def check_supported(config: ModelConfig) -> None:
    if config.sandwich_norms or config.fused_checkpoint:
        raise ValueError(f"load_format dummy supports Llama/Qwen/MoE shapes, not "
                         f"{config.family}")


def tensor_shapes(config: ModelConfig) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Every tensor of the model, HF-named (without `model.`), with its full shape."""
    h, d, inter = config.hidden_size, config.head_dim, config.intermediate_size
    q, kv = config.num_heads * d, config.num_kv_heads * d
    yield "embed_tokens.weight", (config.vocab_size, h)
    for i in range(config.num_layers):
        p = f"layers.{i}."
        yield p + "input_layernorm.weight", (h,)
        yield p + "post_attention_layernorm.weight", (h,)
        for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            yield p + f"self_attn.{name}.weight", (rows, h)
            if config.qkv_bias:
                yield p + f"self_attn.{name}.bias", (rows,)
        yield p + "self_attn.o_proj.weight", (h, q)
        if config.o_bias:
            yield p + "self_attn.o_proj.bias", (h,)
        if config.qk_norm:
            yield p + "self_attn.q_norm.weight", (d,)
            yield p + "self_attn.k_norm.weight", (d,)
        if config.num_experts:
            yield from _moe_shapes(config, p + "mlp.")
            continue
        for name, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h)),
                            ("down_proj", (h, inter))):
            yield p + f"mlp.{name}.weight", shape
            if config.mlp_bias:
                yield p + f"mlp.{name}.bias", (shape[0],)
    yield "norm.weight", (h,)
    if not config.tie_word_embeddings:
        yield "lm_head.weight", (config.vocab_size, h)


def _moe_shapes(config: ModelConfig, prefix: str) -> Iterator[tuple[str, tuple[int, ...]]]:
    """An MoE layer's router and experts, named as Qwen3-MoE's checkpoints name them."""
    h, inter = config.hidden_size, config.moe_intermediate_size
    yield prefix + "gate.weight", (config.num_experts, h)
    for e in range(config.num_experts):
        for name, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h)),
                            ("down_proj", (h, inter))):
            yield prefix + f"experts.{e}.{name}.weight", shape


TABLE_SIZE = 1_048_583  # a prime: the hashed indices cover the table evenly
STRIDE = 40_503  # coprime to TABLE_SIZE
CHUNK_ELEMENTS = 1 << 27  # elements hashed at once (bounds the int64 temporaries)


def dummy_weights(config: ModelConfig, dtype: torch.dtype,
                  device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, this rank's part of the tensor) for every tensor, one at a time, on `device`:
    already sharded, as `parallel.checkpoint_rows` says."""
    check_supported(config)
    for name, shape in tensor_shapes(config):
        picked = parallel.checkpoint_rows(name, config)
        axes = [torch.arange(n, device=device) for n in shape]
        if picked is not None:
            dim, rows = picked
            axes[dim] = torch.tensor(rows, device=device)
        if name.endswith("norm.weight"):
            yield name, torch.ones(len(axes[0]), dtype=dtype, device=device)
            continue
        yield name, _fill(name, axes, shape, dtype, device)


def _fill(name: str, axes: list[torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype,
          device: torch.device) -> torch.Tensor:
    generator = torch.Generator(device).manual_seed(zlib.crc32(name.encode()))
    table = torch.randn(TABLE_SIZE, generator=generator, device=device).mul_(INIT_STD)
    table = table.to(dtype)
    rows = axes[0]
    cols = axes[1] if len(axes) == 2 else torch.zeros(1, dtype=torch.long, device=device)
    width = shape[1] if len(shape) == 2 else 1
    out = torch.empty(len(rows), len(cols), dtype=dtype, device=device)
    step = max(1, CHUNK_ELEMENTS // len(cols))
    for start in range(0, len(rows), step):
        r = rows[start:start + step]
        flat = r.clamp(min=0)[:, None] * width + cols[None, :]  # the element's place
        values = table[flat.mul_(STRIDE).remainder_(TABLE_SIZE)]
        out[start:start + step] = values.masked_fill_((r < 0)[:, None], 0)  # vocab padding
    return out if len(shape) == 2 else out[:, 0]
