"""GGUF quantized blocks -> the CPU kernel's layouts (`pagedserve.kernels.native.quant`).

Every weight of the types in `GGUF_TYPES` is exactly `scale * q + min` (q4 layout) or
`scale * q` (q8 layout) with the float scales computed here: products of a float16 and a
small integer, exact in float32. So the repacking changes no weight's value; tests hold it to
the `gguf` package's own dequantization. Separate from `gguf.py` so the kernel's layouts carry
no dependency on the `gguf` package.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from pagedserve.kernels.native.quant import BLOCK, QuantizedWeight

GGUF_TYPES = (T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K, T.Q6_K)


def from_gguf(blocks: np.ndarray, qtype: T) -> QuantizedWeight:
    """blocks: uint8 [n, bytes per row] as `GGUFReader` gives a quantized tensor."""
    if qtype not in _DECODERS:
        raise ValueError(f"GGUF type {qtype.name} has no quantized kernel")
    kind, *parts = _DECODERS[qtype](np.ascontiguousarray(blocks))
    if kind == "q4":
        q, scales, mins = parts
        pairs = q.reshape(q.shape[0], -1, 2, BLOCK // 2)  # [n, blocks, low/high, 16]
        packed = pairs[:, :, 0] | (pairs[:, :, 1] << np.uint8(4))
        return QuantizedWeight("q4", _tensor(packed.reshape(q.shape[0], -1)), _tensor(scales),
                               _tensor(mins))
    q, scales = parts
    return QuantizedWeight("q8", _tensor(q), _tensor(scales), None)


# -- GGUF block layouts -> (kind, q, scales[, mins]) ----------------------------------------


def _tensor(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a))


def _f16(raw: np.ndarray) -> np.ndarray:
    """float16 fields (2 bytes each, last axis) -> float32."""
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _split(blocks: np.ndarray, size: int) -> np.ndarray:
    """[n, bytes] -> [n, blocks per row, size]."""
    return blocks.reshape(blocks.shape[0], -1, size)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] values, low nibbles first (the Q4_0 / Q4_1 order)."""
    return np.concatenate([packed & np.uint8(15), packed >> np.uint8(4)], axis=-1)


def _q4_0(blocks: np.ndarray):
    b = _split(blocks, 18)
    d = _f16(b[..., 0:2])[..., 0]
    q = _nibbles(b[..., 2:])
    return "q4", q.reshape(b.shape[0], -1), d, -8.0 * d


def _q4_1(blocks: np.ndarray):
    b = _split(blocks, 20)
    d, m = _f16(b[..., 0:2])[..., 0], _f16(b[..., 2:4])[..., 0]
    return "q4", _nibbles(b[..., 4:]).reshape(b.shape[0], -1), d, m


def _q8_0(blocks: np.ndarray):
    b = _split(blocks, 34)
    d = _f16(b[..., 0:2])[..., 0]
    q = np.ascontiguousarray(b[..., 2:]).view(np.int8)
    return "q8", q.reshape(b.shape[0], -1), np.repeat(d, 2, axis=-1)


def _q4_k(blocks: np.ndarray):
    # 256 weights: d, dmin (f16), 12 bytes of eight 6-bit scales and mins, 128 bytes of
    # nibbles: each 32 bytes hold sub-block 2i in the low and 2i + 1 in the high nibbles.
    b = _split(blocks, 144)
    n, nsb = b.shape[:2]
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    s = b[..., 4:16].astype(np.uint8)
    lo, hi, mix = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([lo & 63, (mix & 15) | ((lo >> 6) << 4)], axis=-1)
    mn = np.concatenate([hi & 63, (mix >> 4) | ((hi >> 6) << 4)], axis=-1)
    qs = b[..., 16:].reshape(n, nsb, 4, 1, 32)
    q = np.concatenate([qs & np.uint8(15), qs >> np.uint8(4)], axis=3)  # [n, sb, 4, 2, 32]
    scales = (d * sc.astype(np.float32)).reshape(n, -1)
    mins = -(dmin * mn.astype(np.float32)).reshape(n, -1)
    return "q4", q.reshape(n, -1), scales, mins


def _q6_k(blocks: np.ndarray):
    # 256 weights: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales (one per
    # 16 weights), d (f16). Per half of 128: ql bytes l and l + 32 (low, then high nibbles)
    # and qh byte l (bit pairs 0-1, 2-3, 4-5, 6-7) make weights l, l + 32, l + 64, l + 96.
    b = _split(blocks, 210)
    n, nsb = b.shape[:2]
    ql = b[..., :128].reshape(n, nsb, 2, 1, 64)
    qh = b[..., 128:192].reshape(n, nsb, 2, 1, 32)
    low = np.concatenate([ql & np.uint8(15), ql >> np.uint8(4)], axis=3).reshape(n, nsb, 2, 4, 32)
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)) & np.uint8(3)
    q = (low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)
    sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8).astype(np.float32)
    d = _f16(b[..., 208:210])
    return "q8", q.reshape(n, -1), (d * sc).reshape(n, -1)


_DECODERS = {T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q8_0: _q8_0, T.Q4_K: _q4_k, T.Q6_K: _q6_k}
