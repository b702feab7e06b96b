"""Random weights for a model folder that has only its config (`load_format="dummy"`).

For measuring shapes nobody has weights for, or that would take minutes to write to disk
(Llama-3-8B is 16 GB in bf16; Llama-3-70B, which fits only on two GPUs, is 141 GB). Element
(r, c) of a tensor is a function of the tensor's name and of r and c alone: entry
(offset(name) + start(r) + c) mod N of one table of N(0, 0.02) draws, made once per load. So a
tensor-parallel rank computes just its own rows or columns (no drawing the whole tensor to
throw half away: that would take minutes at 70B), and every tensor-parallel size gets the
same weights, so TP=2's logits can be held against TP=1's. Why a row is a run of the table:
then a tensor is one gather of whole rows from a strided view of the table (a copy at memory
speed, on the device, in the target dtype), not a hash and a lookup per element (tens of
seconds on a CPU at 0.6B). Rows start far apart (`ROW_STRIDE`), so neighbouring rows are not
shifts of each other by a few places. Norm weights are 1, as transformers initialises them;
vocabulary padding rows are 0.

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


TABLE_SIZE = 1 << 22  # distinct values; each row is TABLE_SIZE-periodic
ROW_STRIDE = 2_654_435_761 % TABLE_SIZE  # odd: rows < TABLE_SIZE start at distinct places
SEED = 0


def dummy_weights(config: ModelConfig, dtype: torch.dtype,
                  device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, this rank's part of the tensor) for every tensor, one at a time, on `device`:
    already sharded, as `parallel.checkpoint_rows` says."""
    check_supported(config)
    shapes = list(tensor_shapes(config))
    table = _table(max(_width(shape) for _, shape in shapes), dtype, device)
    for name, shape in shapes:
        parts = [range(n) for n in shape] + [range(1)] * (2 - len(shape))
        picked = parallel.checkpoint_rows(name, config)
        if picked is not None:
            dim, indices = picked
            parts[dim] = indices
        if name.endswith("norm.weight"):
            yield name, torch.ones(len(parts[0]), dtype=dtype, device=device)
            continue
        out = _fill(table, zlib.crc32(name.encode()), parts[0], parts[1], device)
        yield name, out if len(shape) == 2 else out[:, 0]


def _width(shape: tuple[int, ...]) -> int:
    return shape[1] if len(shape) == 2 else 1


def _table(width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The N(0, 0.02) draws in `dtype` on `device`, followed by their first `width` again:
    a row that runs past the end goes on from the start without a modulo per element."""
    generator = torch.Generator(device).manual_seed(SEED)
    draws = torch.randn(TABLE_SIZE, generator=generator, device=device).mul_(INIT_STD)
    draws = draws.to(dtype)
    return torch.cat([draws, draws[:width]])


def _fill(table: torch.Tensor, offset: int, rows, cols, device: torch.device) -> torch.Tensor:
    """Rows `rows` (-1: a zero row) and columns `cols` of a tensor whose table offset is
    `offset`: element (r, c) = draws[(offset + r * ROW_STRIDE + c) mod TABLE_SIZE]."""
    real = torch.tensor([max(r, 0) for r in rows], dtype=torch.long, device=device)
    starts = real.mul_(ROW_STRIDE).add_(offset)
    if list(cols) == list(range(cols[0], cols[0] + len(cols))):  # a run: one row gather
        windows = table.as_strided((TABLE_SIZE, len(cols)), (1, 1))
        out = windows[starts.add_(cols[0]).remainder_(TABLE_SIZE)]
    else:
        columns = torch.tensor(list(cols), dtype=torch.long, device=device)
        out = table[(starts[:, None] + columns[None, :]).remainder_(TABLE_SIZE)]
    padding = [i for i, r in enumerate(rows) if r < 0]
    if padding:
        out[torch.tensor(padding, device=device)] = 0  # vocab padding
    return out
