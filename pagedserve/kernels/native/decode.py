"""The fast mode's whole decode step in one native call (`decode.c`): its C structures and
entry points. `pagedserve.model.fast_decode` fills the structures from a model and decides
which steps take it; this module knows nothing of the model.

A step's spec points at each layer's norm weights, its quantized projections (`QLinear`: up
to `MAX_PARTS` quantized parts each, `kernels/native/quant.py`'s layout) and its K/V caches.
"""

from __future__ import annotations

from ctypes import POINTER, Structure, byref, c_float, c_int, c_int64, c_void_p
from functools import cache

from pagedserve.kernels.native.build import function

# Most sequences a step may have here: the per-op path's quantized GEMM keeps 64 activation
# rows in cache (quant.c's MCHUNK); beyond that the two would tile differently.
MAX_BATCH = 64
MAX_PARTS = 4  # quantized parts per layer (decode.c)


class QPart(Structure):
    _fields_ = [("kind", c_int64), ("rows", c_int64), ("qs", c_void_p), ("scales", c_void_p),
                ("mins", c_void_p)]


class QLinear(Structure):
    _fields_ = [("num_parts", c_int64), ("parts", QPart * MAX_PARTS), ("bias", c_void_p)]


class Layer(Structure):
    _fields_ = [("input_norm", c_void_p), ("post_norm", c_void_p), ("q_norm", c_void_p),
                ("k_norm", c_void_p), ("qkv", QLinear), ("o", QLinear),
                ("gate_up", QLinear), ("down", QLinear), ("k_cache", c_void_p),
                ("v_cache", c_void_p), ("window", c_int64)]


class Model(Structure):
    _fields_ = [("num_layers", c_int64), ("hidden", c_int64), ("num_heads", c_int64),
                ("num_kv_heads", c_int64), ("head_dim", c_int64), ("intermediate", c_int64),
                ("num_blocks", c_int64), ("block_size", c_int64), ("max_positions", c_int64),
                ("eps", c_float), ("scale", c_float), ("cos", c_void_p), ("sin", c_void_p),
                ("final_norm", c_void_p), ("layers", POINTER(Layer))]


@cache
def kernel():
    """The C function through ctypes (looked up once), or None where the library is
    missing (no compiler, no AVX2)."""
    return function("pagedserve_decode_step", POINTER(Model), c_void_p, c_void_p, c_int64,
                    c_void_p, c_void_p, c_void_p, c_int64, c_int64, c_void_p, c_void_p, c_int,
                    restype=c_int)


@cache
def _workspace_bytes():
    return function("pagedserve_decode_workspace", POINTER(Model), c_int64, c_int,
                    restype=c_int64)


def available() -> bool:
    return kernel() is not None


def workspace_bytes(spec: Model, count: int, threads: int) -> int:
    """The scratch a step of `count` rows on `threads` threads needs."""
    return _workspace_bytes()(byref(spec), count, threads)


def decode_step(spec: Model, hidden: int, out: int, count: int, positions: int, slots: int,
                tables: int, table_stride: int, table_width: int, seq_lens: int,
                workspace: int, threads: int) -> int:
    """One decode step over every layer (addresses of the step's tensors); returns 0, -2 for
    a position outside the RoPE tables, another value for a slot, seq_len or block id outside
    the cache or its block table."""
    return kernel()(byref(spec), hidden, out, count, positions, slots, tables, table_stride,
                     table_width, seq_lens, workspace, threads)
