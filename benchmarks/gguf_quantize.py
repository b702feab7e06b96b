"""Round-to-nearest GGUF quantizers, and a Q4_K_M-mix GGUF writer for a Llama shape: the
checkpoints of `benchmarks/gguf_gpu.py` and of the GPU-path GGUF tests.

The `gguf` package quantizes Q4_0, Q4_1 and Q8_0 (`gguf.quants.quantize`); the K-quants
(Q4_K, Q5_K, Q6_K) are written here in llama.cpp's block layouts, with plain round-to-nearest
scales (no search for the best scale as llama.cpp's quantizer does: the layout, which is what
the readers depend on, is the same). `q4_k_m_type` gives the type llama.cpp's Q4_K_M recipe
picks for each tensor.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter
from gguf.quants import quantize as gguf_quantize

QK = 256  # weights per K-quant super-block


def _f16(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(float16 bytes [..., 2], the float32 value the readers will see)."""
    h = x.astype(np.float16)
    return h[..., None].view(np.uint8).reshape(*x.shape, 2), h.astype(np.float32)


def _ratio(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b == 0, 0, a / b)


def _scales_mins(x: np.ndarray, levels: int):
    """Q4_K / Q5_K: per 32-weight sub-block an unsigned 6-bit scale and min under a float16
    d and dmin per super-block -> (header bytes [nb, 16], q [nb, 8, 32])."""
    sub = x.reshape(-1, 8, 32)
    low = np.minimum(sub.min(-1), 0)
    scale = (sub.max(-1) - low) / levels
    d_bytes, d = _f16(scale.max(-1) / 63)
    dmin_bytes, dmin = _f16(-low.min(-1) / 63)
    sc = np.clip(np.rint(_ratio(scale, d[:, None])), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(_ratio(-low, dmin[:, None])), 0, 63).astype(np.uint8)
    eff_scale, eff_min = d[:, None] * sc, dmin[:, None] * mn
    q = np.clip(np.rint(_ratio(sub + eff_min[..., None], eff_scale[..., None])), 0, levels)
    packed = np.concatenate([sc[:, :4] | ((sc[:, 4:] >> 4) << 6),
                             mn[:, :4] | ((mn[:, 4:] >> 4) << 6),
                             (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)], axis=-1)
    return np.concatenate([d_bytes, dmin_bytes, packed], axis=-1), q.astype(np.uint8)


def _nibbles(q: np.ndarray) -> np.ndarray:
    """[nb, 8, 32] 4-bit values -> [nb, 128]: sub-blocks 2c and 2c + 1 in bytes 32c..32c+31."""
    return (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(q.shape[0], -1)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    header, q = _scales_mins(x, 15)
    return np.concatenate([header, _nibbles(q)], axis=-1)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    header, q = _scales_mins(x, 31)
    high = sum(((q[:, s] >> 4) & 1) << s for s in range(8)).astype(np.uint8)
    return np.concatenate([header, high, _nibbles(q & 15)], axis=-1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """Per 16 weights a signed 8-bit scale under a float16 d; weights -32..31."""
    sub = x.reshape(-1, 16, 16)
    scale = np.abs(sub).max(-1) / 31
    d_bytes, d = _f16(scale.max(-1) / 127)
    sc = np.clip(np.rint(_ratio(scale, d[:, None])), -128, 127).astype(np.int8)
    eff = d[:, None] * sc
    q = np.clip(np.rint(_ratio(sub, eff[..., None])), -32, 31).astype(np.int16) + 32
    q = q.astype(np.uint8).reshape(-1, 2, 4, 32)  # [nb, half, quarter, lane]
    low = q & 15
    ql = (low[:, :, 0:2] | (low[:, :, 2:4] << 4)).reshape(q.shape[0], -1)
    qh = sum(((q[:, :, i] >> 4) & 3) << (2 * i) for i in range(4)).astype(np.uint8)
    return np.concatenate([ql, qh.reshape(q.shape[0], -1), sc.view(np.uint8), d_bytes],
                          axis=-1)


_K_QUANTS = {T.Q4_K: quantize_q4_k, T.Q5_K: quantize_q5_k, T.Q6_K: quantize_q6_k}


def quantize(x: np.ndarray, qtype: T) -> np.ndarray:
    """float32 [rows, K] -> uint8 [rows, row bytes] in `qtype`'s blocks."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if qtype not in _K_QUANTS:
        return gguf_quantize(x, qtype)
    rows, k = x.shape
    if k % QK:
        raise ValueError(f"{qtype.name} needs K a multiple of {QK}, got {k}")
    return _K_QUANTS[qtype](x.reshape(-1, QK)).reshape(rows, -1)


def q4_k_m_type(name: str, layers: int) -> T:
    """The type llama.cpp's Q4_K_M gives a GGUF tensor: Q6_K for the output and, in the first
    and last eighth of the layers and every third between, for attn_v and ffn_down; Q4_K for
    the other matrices."""
    if name == "output.weight":
        return T.Q6_K
    parts = name.split(".")
    if parts[0] == "blk" and parts[2] in ("attn_v", "ffn_down"):
        i = int(parts[1])
        if i < layers // 8 or i >= 7 * layers // 8 or (i - layers // 8) % 3 == 2:
            return T.Q6_K
    return T.Q4_K


def llama_tensors(config: dict) -> list[tuple[str, tuple[int, int] | tuple[int]]]:
    """(GGUF name, HF-order shape [rows, K] or [dim]) of every tensor of a Llama `config`."""
    h, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    d = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    names = [("token_embd.weight", (v, h)), ("output_norm.weight", (h,))]
    if not config.get("tie_word_embeddings"):
        names.append(("output.weight", (v, h)))
    for n in range(config["num_hidden_layers"]):
        names += [(f"blk.{n}.attn_norm.weight", (h,)), (f"blk.{n}.ffn_norm.weight", (h,)),
                  (f"blk.{n}.attn_q.weight", (q, h)), (f"blk.{n}.attn_k.weight", (kv, h)),
                  (f"blk.{n}.attn_v.weight", (kv, h)), (f"blk.{n}.attn_output.weight", (h, q)),
                  (f"blk.{n}.ffn_gate.weight", (i, h)), (f"blk.{n}.ffn_up.weight", (i, h)),
                  (f"blk.{n}.ffn_down.weight", (h, i))]
    return names


def write_llama_q4_k_m(config: dict, path: str, seed: int = 0, tile_rows: int = 256) -> None:
    """A Q4_K_M-mix GGUF of a Llama `config` with random weights. To write an 8B file in
    seconds, each matrix is `tile_rows` quantized random rows repeated to its row count (a
    decode step's cost does not depend on the values)."""
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(path, "llama")
    h, heads = config["hidden_size"], config["num_attention_heads"]
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(h)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_eos_token_id(config["eos_token_id"])
    tiles: dict[tuple[int, T], np.ndarray] = {}
    for name, shape in llama_tensors(config):
        if len(shape) == 1:
            writer.add_tensor(name, np.ones(shape, dtype=np.float32))
            continue
        rows, k = shape
        qtype = q4_k_m_type(name, config["num_hidden_layers"])
        if (k, qtype) not in tiles:
            x = rng.standard_normal((tile_rows, k), dtype=np.float32) * k**-0.5
            tiles[(k, qtype)] = quantize(x, qtype)
        tile = tiles[(k, qtype)]
        blocks = np.tile(tile, (-(-rows // tile_rows), 1))[:rows]
        writer.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
