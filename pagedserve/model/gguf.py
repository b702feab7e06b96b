"""GGUF files: metadata -> ModelConfig, tensors -> HF-named float32 weights, and the linear
layers' blocks kept quantized for the CPU's fast mode (`open_quantized`).

We read and dequantize with the `gguf` package (the same calls transformers' GGUF loader makes), so
our weights are bit-identical to what `AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`
builds, and logits can be compared with it exactly.

llama.cpp's converter permutes the rows of Q and K of llama-arch models (it stores RoPE pairs
interleaved, HF stores them as two halves); we undo that. Qwen2/Qwen3 files are not permuted.

Reading a GGUF is slow in Python (the reader parses every one of the ~50k vocabulary entries
into numpy objects, then we dequantize every tensor), so the result of a first load is cached
under `cache_root()`: the config and the float32 weights as safetensors, and (see
`loader.load_tokenizer`) transformers' converted tokenizer. An entry is keyed by the file's
path, size and mtime, so an edited or replaced file misses; it is written to a temporary
folder and renamed into place, so a reader sees a whole entry or none; and an entry that fails
to read is deleted and rebuilt from the GGUF, never trusted. The quantized weights (repacked
for `pagedserve.native.quant`, values unchanged) are cached the same way, as entry "quantized".
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors import safe_open
from safetensors.torch import save_file

from pagedserve.cache import cache_root
from pagedserve.model.config import ModelConfig
from pagedserve.model.gguf_blocks import GGUF_TYPES, from_gguf
from pagedserve.native.quant import QuantizedWeight
from pagedserve.progress import notice, progress

logger = logging.getLogger(__name__)

# Bump when what an entry holds changes meaning (names, layout, dequantization), to miss old ones.
CACHE_VERSION = 1

SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")

# GGUF per-layer tensor name -> HF name inside `model.layers.N.`
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def hf_name(gguf_name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`."""
    base, suffix = gguf_name.rsplit(".", 1)
    parts = base.split(".")
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{suffix}"
    if base in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[base]}.{suffix}"
    raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")


def _field(reader: GGUFReader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def read_config(reader: GGUFReader, path: str | Path) -> ModelConfig:
    """Map `general.architecture` and `<arch>.*` metadata to a ModelConfig."""
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r} in {path}; "
            f"supported: {list(SUPPORTED_GGUF_ARCHITECTURES)}"
        )
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ValueError(f"{path}: RoPE frequency factors (rope_freqs) are not supported")
    scaling = _field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling != "none":
        raise ValueError(f"{path}: unsupported rope scaling type {scaling!r}")

    def key(name: str, default=None):
        return _field(reader, f"{arch}.{name}", default)

    hidden = key("embedding_length")
    heads = key("attention.head_count")
    vocab = key("vocab_size") or len(_field(reader, "tokenizer.ggml.tokens", []))
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    return ModelConfig(
        family=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=key("feed_forward_length"),
        num_layers=key("block_count"),
        num_heads=heads,
        num_kv_heads=key("attention.head_count_kv", heads),
        head_dim=key("attention.key_length") or key("rope.dimension_count") or hidden // heads,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        max_model_len=key("context_length"),
        tie_word_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        o_bias="blk.0.attn_output.bias" in names,
        mlp_bias="blk.0.ffn_up.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=[] if eos is None else [eos],
        dtype=torch.float32,
    )


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head interleaving of RoPE pairs (rows 0,2,4.. | 1,3,5.. -> halves)."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermute_rows(name: str, rows: int, config: ModelConfig) -> np.ndarray | None:
    """The row order that undoes the Q/K permutation of `name`, or None (no permutation)."""
    if config.family != "llama":
        return None
    if ".attn_q." in name:
        return _unpermute(np.arange(rows), config.num_heads)
    if ".attn_k." in name:
        return _unpermute(np.arange(rows), config.num_kv_heads)
    return None


def iter_weights(reader: GGUFReader, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, float32 tensor) one at a time, so only one dequantized tensor is alive."""
    for tensor in reader.tensors:
        w = dequantize(tensor.data, tensor.tensor_type)
        order = _unpermute_rows(tensor.name, w.shape[0], config)
        if order is not None:
            w = w[order]
        if not w.flags.writeable:  # unquantized tensors come back as views of the mmap
            w = w.copy()
        yield hf_name(tensor.name), torch.from_numpy(np.ascontiguousarray(w))


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
        yield hf_name(tensor.name), weight if order is None else weight.rows(torch.from_numpy(order))


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


def write_cache_entry(entry: Path, fill: Callable[[Path], object]) -> None:
    """Let `fill` write into a fresh temporary folder, then rename it to `entry` in one step.

    A failure (read-only or full disk, another process renaming its copy first) only costs
    the cache: it is logged and the caller goes on with what it already has in memory.
    """
    tmp = None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}-", dir=entry.parent))
        fill(tmp)
        os.rename(tmp, entry)
    except OSError as e:
        logger.warning("could not write the GGUF cache entry %s: %s", entry, e)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


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
