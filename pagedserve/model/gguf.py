"""GGUF files: metadata -> ModelConfig, tensors -> HF-named float32 weights, and the linear
layers' blocks kept quantized for the CPU's fast mode (`open_quantized`).

We read and dequantize with the `gguf` package (the same calls transformers' GGUF loader makes), so
our weights are bit-identical to what `AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`
builds, and logits can be compared with it exactly.

Architectures: llama (Llama, Mistral, and Mixtral when it has experts), qwen2, qwen3, qwen3moe,
phi3 and gemma2/gemma3. We undo what llama.cpp's converter does to a checkpoint: it permutes the
rows of Q and K of llama-arch models (it stores RoPE pairs interleaved, HF stores them as two
halves), stores Gemma's norm weights as 1 + w, stacks each layer's experts into one tensor per
projection, and keeps Phi-3's longrope factors as tensors. What the metadata leaves out we take
as llama.cpp's runtime does (see `read_config`). A sliding window comes from
`<arch>.attention.sliding_window`: llama.cpp's converter writes none for Mistral, so a Mistral
file without the key is served with full attention, as llama.cpp serves it.

Reading a GGUF is slow in Python (the reader parses every one of the ~50k vocabulary entries
into numpy objects, then we dequantize every tensor), so the result of a first load is cached
under `cache_root()`: the config and the float32 weights as safetensors, and (see
`loader.load_tokenizer`) transformers' converted tokenizer. An entry is keyed by the file's
path, size and mtime, so an edited or replaced file misses; it is written to a temporary
folder and renamed into place, so a reader sees a whole entry or none; and an entry that fails
to read is deleted and rebuilt from the GGUF, never trusted. The quantized weights (repacked
for `pagedserve.kernels.native.quant`, values unchanged) are cached the same way, as entry
"quantized".
"""

from __future__ import annotations

import hashlib
import logging
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors import safe_open
from safetensors.torch import save_file

from pagedserve.artifacts import cache_root, write_cache_entry
from pagedserve.kernels.native.quant import QuantizedWeight
from pagedserve.model.config import GEMMA_FAMILIES, ModelConfig, rope_context_len
from pagedserve.model.gguf_blocks import GGUF_TYPES, from_gguf
from pagedserve.model.gguf_weights import GgufBlocks, is_linear_weight
from pagedserve.progress import notice, progress

logger = logging.getLogger(__name__)

# Bump when what an entry holds changes meaning (names, layout, dequantization, config fields),
# to miss old ones.
CACHE_VERSION = 2

# `general.architecture` -> our family. A llama file with experts is Mixtral (see `read_config`).
GGUF_FAMILIES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe",
                 "phi3": "phi3", "gemma2": "gemma2", "gemma3": "gemma3"}
SUPPORTED_GGUF_ARCHITECTURES = tuple(GGUF_FAMILIES)
# Families whose Q/K rows llama.cpp's converter interleaves (its non-NeoX RoPE).
_PERMUTED_FAMILIES = ("llama", "mixtral")
# Architectures whose `attention.sliding_window` llama.cpp applies; the Qwen configs state a
# window they do not use, so it is ignored there as llama.cpp ignores it.
_WINDOWED = ("llama", "phi3", "gemma2", "gemma3")
# Gemma's layer pattern when the file does not state one: every n-th layer is global.
_GEMMA_PATTERN = {"gemma2": 2, "gemma3": 6}
# llama.cpp scales Gemma's scores by (hidden / heads) ** -0.5, not head_dim ** -0.5, in the
# 27B models (their query_pre_attn_scalar), which it tells apart by their layer count.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
GEMMA_LOCAL_ROPE_THETA = 10000.0  # Gemma 3's local base when `rope.freq_base_swa` is absent

# GGUF per-layer tensor name -> HF name inside `model.layers.N.`
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # the MoE router
}
# What differs from _LAYER_TENSORS per family: Phi-3 stores gate and up as one `ffn_up`;
# Gemma's `ffn_norm` is the MLP's input norm, with a norm after each sublayer besides.
_GEMMA_TENSORS = {
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_FAMILY_TENSORS = {
    "phi3": {"ffn_up": "mlp.gate_up_proj"},
    "gemma2": _GEMMA_TENSORS,
    "gemma3": _GEMMA_TENSORS,
}
# Stacked experts [E, rows, cols] -> each expert's HF projection
_EXPERT_TENSORS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj",
                   "ffn_down_exps": "down_proj"}
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# Tensors that hold configuration (rope factors of Phi-3, Llama 3.1), read by `read_config`.
_LONGROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")
_CONFIG_TENSORS = (*_LONGROPE_TENSORS, "rope_freqs.weight")


def hf_name(gguf_name: str, family: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight` (the family's HF name)."""
    base, suffix = gguf_name.rsplit(".", 1)
    parts = base.split(".")
    if parts[0] == "blk" and len(parts) == 3:
        tensors = {**_LAYER_TENSORS, **_FAMILY_TENSORS.get(family, {})}
        if parts[2] in tensors:
            return f"model.layers.{parts[1]}.{tensors[parts[2]]}.{suffix}"
    if base in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[base]}.{suffix}"
    raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")


def _expert_names(gguf_name: str, num_experts: int) -> list[str] | None:
    """The HF names of each expert's slice of a stacked expert tensor, or None (not one)."""
    parts = gguf_name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or parts[2] not in _EXPERT_TENSORS:
        return None
    proj = _EXPERT_TENSORS[parts[2]]
    return [f"model.layers.{parts[1]}.mlp.experts.{e}.{proj}.{parts[3]}"
            for e in range(num_experts)]


def _field(reader: GGUFReader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _tensor_values(reader: GGUFReader, name: str) -> list[float]:
    tensor = next(t for t in reader.tensors if t.name == name)
    return [float(x) for x in dequantize(tensor.data, tensor.tensor_type).reshape(-1)]


def read_config(reader: GGUFReader, path: str | Path) -> ModelConfig:
    """Map `general.architecture` and `<arch>.*` metadata to a ModelConfig.

    What llama.cpp's converter leaves out of the metadata, we take the way llama.cpp's runtime
    does (Gemma's layer pattern, local RoPE base and score scale; Qwen3-MoE's renormalised
    routing); what we cannot run is refused by name.
    """
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_FAMILIES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r} in {path}; "
            f"supported: {list(SUPPORTED_GGUF_ARCHITECTURES)}"
        )
    names = {t.name for t in reader.tensors}

    def key(name: str, default=None):
        return _field(reader, f"{arch}.{name}", default)

    _refuse_unsupported(key, names, path)
    hidden = key("embedding_length")
    heads = key("attention.head_count")
    layers = key("block_count")
    head_dim = key("attention.key_length") or hidden // heads
    rope_dims = key("rope.dimension_count") or head_dim
    if rope_dims != head_dim:
        raise ValueError(f"{path}: RoPE over {rope_dims} of {head_dim} head dimensions "
                         "(partial rotary) is not supported")
    family = "mixtral" if arch == "llama" and key("expert_count") else GGUF_FAMILIES[arch]
    gemma = family in GEMMA_FAMILIES
    max_positions = key("context_length")
    rope_scaling = _rope_scaling(reader, key, names, head_dim, path)
    window, layer_types = _sliding_window(key, arch, layers, path)
    sliding = window is not None and "sliding_attention" in (layer_types or ["sliding_attention"])
    vocab = key("vocab_size") or len(_field(reader, "tokenizer.ggml.tokens", []))
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    return ModelConfig(
        family=family,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=key("feed_forward_length"),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=key("attention.head_count_kv", heads),
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_model_len=rope_context_len(rope_scaling, max_positions),
        max_position_embeddings=max_positions,
        tie_word_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names or "blk.0.attn_qkv.bias" in names,
        o_bias="blk.0.attn_output.bias" in names,
        mlp_bias="blk.0.ffn_up.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=[] if eos is None else [eos],
        dtype=torch.float32,
        sliding_window=window,
        layer_types=layer_types,
        local_rope_theta=(float(key("rope.freq_base_swa", GEMMA_LOCAL_ROPE_THETA))
                          if arch == "gemma3" and sliding else None),
        attn_scale=_attention_scale(key, arch, hidden // heads, layers),
        attn_softcap=key("attn_logit_softcapping") if gemma else None,
        final_softcap=key("final_logit_softcapping") if gemma else None,
        hidden_act="gelu_tanh" if gemma else "silu",
        norm_unit_offset=gemma,
        sandwich_norms=gemma,
        scale_embeddings=gemma,
        fused_checkpoint="blk.0.attn_qkv.weight" in names,
        **_moe_fields(key, family, names, path),
    )


def _refuse_unsupported(key: Callable, names: set[str], path: str | Path) -> None:
    """Options a GGUF can state that change the math in ways this decoder does not implement."""
    neutral = {"logit_scale": 1.0, "embedding_scale": 1.0, "residual_scale": 1.0,
               "expert_shared_count": 0, "expert_weights_scale": 1.0,
               "expert_gating_func": 1}  # 1: softmax
    for name, value in neutral.items():
        if key(name, value) != value:
            raise ValueError(f"{path}: {name} = {key(name)} is not supported")
    if key("attention.value_length", key("attention.key_length")) != key("attention.key_length"):
        raise ValueError(f"{path}: attention.value_length != attention.key_length "
                         "is not supported")


def _rope_scaling(reader: GGUFReader, key: Callable, names: set[str], head_dim: int,
                  path: str | Path) -> dict | None:
    """`rope.scaling.*` and the factor tensors -> our rope_scaling dict. Llama 3.1's scaling
    comes as `rope_freqs`, a divisor per frequency, on top of the stated type."""
    scaling = _scaling_type(reader, key, names, path)
    if "rope_freqs.weight" not in names:
        return scaling
    factors = _tensor_values(reader, "rope_freqs.weight")
    if len(factors) != head_dim // 2 or (scaling or {}).get("rope_type") == "longrope":
        raise ValueError(f"{path}: rope_freqs with {len(factors)} factors for head_dim "
                         f"{head_dim} and scaling {scaling} is not supported")
    return {**(scaling or {"rope_type": "default"}), "freq_factors": factors}


def _scaling_type(reader: GGUFReader, key: Callable, names: set[str],
                  path: str | Path) -> dict | None:
    """`rope.scaling.*` (and Phi-3's factor tensors) -> our rope_scaling dict."""
    kind = key("rope.scaling.type", "longrope" if _LONGROPE_TENSORS[0] in names else "none")
    if kind == "none" and key("rope.scale_linear", 1.0) != 1.0:  # the key's older spelling
        return {"rope_type": "linear", "factor": float(key("rope.scale_linear"))}
    if kind == "none":
        return None
    original = key("rope.scaling.original_context_length")
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
    if kind == "yarn":
        for name, value in (("yarn_ext_factor", 1.0), ("yarn_attn_factor", 1.0),
                            ("yarn_log_multiplier", 0.0)):
            if key(f"rope.scaling.{name}", value) != value:
                raise ValueError(f"{path}: rope.scaling.{name} = "
                                 f"{key(f'rope.scaling.{name}')} is not supported")
        return {"rope_type": "yarn", "factor": float(key("rope.scaling.factor")),
                "original_max_position_embeddings": original,
                "beta_fast": float(key("rope.scaling.yarn_beta_fast", 32.0)),
                "beta_slow": float(key("rope.scaling.yarn_beta_slow", 1.0))}
    if kind == "longrope" and set(_LONGROPE_TENSORS) <= names and original:
        scaling = {"rope_type": "longrope", "original_max_position_embeddings": original,
                   "long_factor": _tensor_values(reader, _LONGROPE_TENSORS[0]),
                   "short_factor": _tensor_values(reader, _LONGROPE_TENSORS[1])}
        if key("rope.scaling.attn_factor") is not None:
            scaling["attention_factor"] = float(key("rope.scaling.attn_factor"))
        return scaling
    if kind == "longrope":
        raise ValueError(f"{path}: longrope scaling without its factor tensors "
                         f"{list(_LONGROPE_TENSORS)} and rope.scaling.original_context_length")
    raise ValueError(f"{path}: unsupported rope scaling type {kind!r}; "
                     "supported: none, linear, yarn, longrope")


def _sliding_window(key: Callable, arch: str, layers: int,
                    path: str | Path) -> tuple[int | None, list[str] | None]:
    """(window, per-layer types or None when every layer is alike).

    `attention.sliding_window_pattern` is a list (true: sliding) or n (every n-th layer
    global); Gemma files leave it out and mean 2 (Gemma 2) or 6 (Gemma 3). A window of 0 is
    none (Phi-4 is written as Phi-3 that way); Gemma 3 without a window is global throughout.
    """
    window = (key("attention.sliding_window") or None) if arch in _WINDOWED else None
    if window is None:
        if arch == "gemma2":
            raise ValueError(f"{path}: a Gemma 2 model needs gemma2.attention.sliding_window "
                             "(its local layers' window), which this file lacks")
        return None, None
    pattern = key("attention.sliding_window_pattern", _GEMMA_PATTERN.get(arch))
    if pattern is None:
        return window, None
    if isinstance(pattern, int):
        pattern = [pattern == 0 or i % pattern < pattern - 1 for i in range(layers)]
    if len(pattern) != layers:
        raise ValueError(f"{path}: attention.sliding_window_pattern has {len(pattern)} entries "
                         f"for {layers} layers")
    return window, ["sliding_attention" if s else "full_attention" for s in pattern]


def _attention_scale(key: Callable, arch: str, head_size: int, layers: int) -> float | None:
    """The scores' scale when not head_dim ** -0.5: `attention.scale`, else llama.cpp's rule
    for the Gemma 27B models (query_pre_attn_scalar = hidden / heads)."""
    if key("attention.scale") is not None:
        return float(key("attention.scale"))
    if _GEMMA_27B_LAYERS.get(arch) == layers:
        return head_size**-0.5
    return None


def _moe_fields(key: Callable, family: str, names: set[str], path: str | Path) -> dict:
    """The experts' shape and routing. Without `expert_weights_norm` the top-k weights are
    renormalised, as llama.cpp does for both Mixtral and Qwen3-MoE."""
    experts = key("expert_count") or 0
    if not experts:
        return {}
    dense = sorted(n for n in names if n.endswith((".ffn_up.weight", ".ffn_gate.weight")))
    if dense:
        raise ValueError(f"{path}: dense layers among the MoE layers ({dense[0]}, ...) "
                         "are not supported")
    return dict(num_experts=experts, num_experts_per_tok=key("expert_used_count"),
                moe_intermediate_size=key("expert_feed_forward_length")
                or key("feed_forward_length"),
                norm_topk_prob=bool(key("expert_weights_norm", True)))


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head interleaving of RoPE pairs (rows 0,2,4.. | 1,3,5.. -> halves)."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermute_rows(name: str, rows: int, config: ModelConfig) -> np.ndarray | None:
    """The row order that undoes the Q/K permutation of `name`, or None (no permutation)."""
    if config.family not in _PERMUTED_FAMILIES:
        return None
    if ".attn_q." in name:
        return _unpermute(np.arange(rows), config.num_heads)
    if ".attn_k." in name:
        return _unpermute(np.arange(rows), config.num_kv_heads)
    return None


def iter_weights(reader: GGUFReader, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, float32 tensor) one at a time, so only one dequantized tensor is alive."""
    for tensor in reader.tensors:
        if tensor.name not in _CONFIG_TENSORS:
            yield from _float_tensors(tensor, config)


def _float_tensors(tensor, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """One GGUF tensor as (HF name, float32 tensor) pairs (one per expert of a stacked one).

    Undone here: the Q/K permutation, Gemma's norms stored as 1 + w (llama.cpp's converter
    adds the 1 that Gemma's RMSNorm adds at run time), and stacked experts (one per expert)."""
    w = dequantize(tensor.data, tensor.tensor_type)
    order = _unpermute_rows(tensor.name, w.shape[0], config)
    if order is not None:
        w = w[order]
    if config.family in GEMMA_FAMILIES and tensor.name.endswith("norm.weight"):
        w = w - np.float32(1)
    if not w.flags.writeable:  # unquantized tensors come back as views of the mmap
        w = w.copy()
    w = torch.from_numpy(np.ascontiguousarray(w))
    experts = _expert_names(tensor.name, config.num_experts)
    if experts is None:
        yield hf_name(tensor.name, config.family), w
    else:
        # copies: the cache cannot save views of one storage
        yield from ((name, e.clone()) for name, e in zip(experts, w, strict=True))


def tensor_types(reader: GGUFReader, config: ModelConfig) -> dict[str, int]:
    """HF name -> GGML type of each 2-D tensor (from the header: nothing is read)."""
    return {hf_name(t.name, config.family): int(t.tensor_type) for t in reader.tensors
            if len(t.shape) == 2 and t.name not in _CONFIG_TENSORS
            and _expert_names(t.name, config.num_experts) is None}


def expert_types(reader: GGUFReader, config: ModelConfig) -> dict[str, int]:
    """HF name of each expert's projection -> the GGML type of its stacked tensor."""
    return {name: int(t.tensor_type) for t in reader.tensors
            for name in _expert_names(t.name, config.num_experts) or ()}


def iter_tensors(reader: GGUFReader, config: ModelConfig,
                 keep: set[str]) -> Iterator[tuple[str, torch.Tensor | GgufBlocks]]:
    """`iter_weights`, except that the tensors named in `keep` come as their blocks (rows
    unpermuted like the float ones'; blocks run along K, so rows move whole), a stacked
    expert tensor as each expert's (views of one copy). The types of the linear weights
    (and experts) dequantized instead are logged."""
    dequantized: dict[str, int] = {}
    for tensor in reader.tensors:
        if tensor.name in _CONFIG_TENSORS:
            continue
        name = hf_name(tensor.name, config.family) if len(tensor.shape) == 2 else None
        experts = name is None and _expert_names(tensor.name, config.num_experts)
        if experts and keep.issuperset(experts):
            blocks = torch.from_numpy(np.array(tensor.data))  # [E, rows, row bytes]
            yield from ((n, GgufBlocks(int(tensor.tensor_type), b, int(tensor.shape[0])))
                        for n, b in zip(experts, blocks, strict=True))
            continue
        if name not in keep:
            if experts or (name is not None and is_linear_weight(name)):
                kind = tensor.tensor_type.name + (" (MoE experts)" if experts else "")
                dequantized[kind] = dequantized.get(kind, 0) + 1
            yield from _float_tensors(tensor, config)
            continue
        blocks = np.asarray(tensor.data)
        order = _unpermute_rows(tensor.name, blocks.shape[0], config)
        blocks = torch.from_numpy(np.array(blocks if order is None else blocks[order]))
        yield name, GgufBlocks(int(tensor.tensor_type), blocks, int(tensor.shape[0]))
    if dequantized:
        logger.warning("GGUF linear weights dequantized at load (a type without a kernel "
                       "on its blocks, in them or in a layer they are fused with or in their "
                       "MoE layer's other expert projections; or experts without a fused MoE "
                       "kernel or whose tensor-parallel slice is off their blocks' "
                       "boundaries): %s",
                       ", ".join(f"{n} of {kind}" for kind, n in sorted(dequantized.items())))


def open_gguf(path: str | Path) -> tuple[ModelConfig, Iterator[tuple[str, torch.Tensor]]]:
    """Config and HF-named float32 weights, from the cache when it holds this file's."""
    entry = cache_entry(path, "weights")
    if entry is not None:
        cached = _read_cached_weights(entry)
        if cached is not None:
            return cached
    reader = GGUFReader(path)
    config = read_config(reader, path)
    notice(f"converting {Path(path).name} to float32 weights"
           + (" (first load only: the result is cached)" if entry is not None else ""))
    weights = progress(iter_weights(reader, config), len(reader.tensors), "converting")
    if entry is not None:
        weights = _cache_when_done(weights, config, entry)
    return config, weights


def iter_quantized(reader: GGUFReader,
                   config: ModelConfig) -> Iterator[tuple[str, QuantizedWeight]]:
    """(HF name, QuantizedWeight) for every matrix stored in a type the kernel takes."""
    for tensor in reader.tensors:
        if tensor.tensor_type not in GGUF_TYPES or len(tensor.shape) != 2:
            continue
        weight = from_gguf(tensor.data, tensor.tensor_type)
        order = _unpermute_rows(tensor.name, weight.shape[0], config)
        yield (hf_name(tensor.name, config.family),
               weight if order is None else weight.rows(torch.from_numpy(order)))


def open_quantized(path: str | Path,
                   config: ModelConfig) -> Iterator[tuple[str, QuantizedWeight]]:
    """The quantized matrices of a GGUF file, from the cache when it holds them."""
    entry = cache_entry(path, "quantized")
    if entry is not None and entry.is_dir():
        try:
            return iter(_read_quantized(entry))
        except Exception as e:  # any unreadable entry is a miss, whatever the parser raised
            drop_cache_entry(entry, e)
    notice(f"reading the quantized blocks of {Path(path).name} for the fast mode"
           + (" (first load only: the result is cached)" if entry is not None else ""))
    reader = GGUFReader(path)
    total = sum(t.tensor_type in GGUF_TYPES and len(t.shape) == 2 for t in reader.tensors)
    weights = list(progress(iter_quantized(reader, config), total, "repacking"))
    if entry is not None:
        write_cache_entry(entry, lambda folder: _write_quantized(weights, folder))
    return iter(weights)


def _write_quantized(weights: list[tuple[str, QuantizedWeight]], folder: Path) -> None:
    tensors = {}
    for name, w in weights:
        tensors[f"{name}.{w.kind}.qs"] = w.qs
        tensors[f"{name}.{w.kind}.scales"] = w.scales
        if w.mins is not None:
            tensors[f"{name}.{w.kind}.mins"] = w.mins
    save_file(tensors, folder / "quantized.safetensors")


def _read_quantized(entry: Path) -> list[tuple[str, QuantizedWeight]]:
    with safe_open(entry / "quantized.safetensors", framework="pt") as f:
        keys = set(f.keys())
        parts = sorted({tuple(key.rsplit(".", 2)[:2]) for key in keys})
        return [(name, QuantizedWeight(kind, f.get_tensor(f"{name}.{kind}.qs"),
                                       f.get_tensor(f"{name}.{kind}.scales"),
                                       f.get_tensor(f"{name}.{kind}.mins")
                                       if f"{name}.{kind}.mins" in keys else None))
                for name, kind in parts]


# -- cache of converted GGUF files ------------------------------------------------------------


def cache_entry(path: str | Path, kind: str) -> Path | None:
    """Where the `kind` ("weights" or "tokenizer") converted from this GGUF file lives."""
    root = cache_root()
    if root is None:
        return None
    path = Path(path).resolve()
    stat = path.stat()
    identity = f"{path}|{stat.st_size}|{stat.st_mtime_ns}|v{CACHE_VERSION}"
    key = hashlib.sha256(identity.encode()).hexdigest()[:16]
    return root / f"{path.stem}-{key}" / kind


def drop_cache_entry(entry: Path, error: Exception) -> None:
    logger.warning("ignoring unreadable GGUF cache entry %s (%s); rebuilding it", entry, error)
    shutil.rmtree(entry, ignore_errors=True)


def _read_cached_weights(
    entry: Path,
) -> tuple[ModelConfig, Iterator[tuple[str, torch.Tensor]]] | None:
    if not entry.is_dir():
        return None
    try:
        config = ModelConfig.from_json((entry / "config.json").read_text())
        # safe_open checks the header against the file size: a truncated file fails here.
        with safe_open(entry / "model.safetensors", framework="pt") as f:
            names = list(f.keys())
    except Exception as e:  # any unreadable entry is a miss, whatever the parser raised
        drop_cache_entry(entry, e)
        return None
    return config, _iter_cached_weights(entry / "model.safetensors", names)


def _iter_cached_weights(file: Path, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    with safe_open(file, framework="pt") as f:
        for name in names:
            yield name, f.get_tensor(name)


def _cache_when_done(
    weights: Iterator[tuple[str, torch.Tensor]], config: ModelConfig, entry: Path
) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass the weights through, keeping them; once all were consumed, write the entry.

    A load that stops early (a bad tensor) leaves no entry behind.
    """
    kept = {}
    for name, tensor in weights:
        kept[name] = tensor
        yield name, tensor

    def fill(folder: Path) -> None:
        save_file(kept, folder / "model.safetensors")
        (folder / "config.json").write_text(config.to_json())

    write_cache_entry(entry, fill)
