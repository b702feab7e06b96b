"""The FP8 KV cache format: e4m3 values with a float32 scale per layer and KV head.

Why FP8: decode attention reads the whole cache every step and is bound by memory bandwidth,
so one byte per element instead of two reads half as much and holds twice the tokens.

A cached element is `round_e4m3(clamp(x / scale, -448, 448))` and reads back as
`e4m3 * scale`; each layer keeps a K scale and a V scale per KV head (`[Hkv]` float32
tensors on the cache's device, so CUDA graphs capture their addresses, not their values).
The kernels never dequantize element by element: a KV head's K scale is folded into the
score scale and its V scale into the output, so a cached row is only cast to the query's
dtype (e4m3 fits exactly in bf16, fp16 and float32).

Where the scales come from (`kv_scales`): a checkpoint that carries them (`self_attn.k_scale`
/ `v_scale`, as llm-compressor writes them: one per tensor or one per KV head), else 1.0.
e4m3 covers 2^-9 to 448 with 3 mantissa bits at every magnitude between, so the K/V of
models without outlier channels that large lose only the mantissa bits; a larger value
saturates at 448 x scale instead of turning into NaN.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pagedserve.config import KV_CACHE_DTYPES
from pagedserve.kernels.fp8_format import FP8_DTYPE, FP8_MAX



def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache tensors' dtype: the model's for "auto", e4m3 for "fp8"."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype == "fp8":
        return FP8_DTYPE
    raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")


def quantize(x: Tensor, scale: Tensor) -> Tensor:
    """x [..., Hkv, D] -> e4m3 with scale [Hkv] per head; NaN stays NaN."""
    return (x.float() / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize(x: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """e4m3 x [..., Hkv, D] -> x * scale[head] in `dtype`."""
    return (x.to(dtype) * scale[:, None].to(dtype))


def kv_scales(num_kv_heads: int, checkpoint: tuple[Tensor, Tensor] | None,
              kv_heads: list[int], device: torch.device) -> tuple[Tensor, Tensor]:
    """One layer's (K, V) scales, [Hkv] float32 on `device`: the checkpoint's (a scalar or
    one per KV head of the whole model, of which `kv_heads` are this rank's), else ones."""
    if checkpoint is None:
        ones = torch.ones(num_kv_heads, dtype=torch.float32, device=device)
        return ones, ones.clone()
    return tuple(_per_head(s, num_kv_heads, kv_heads).to(device) for s in checkpoint)


def _per_head(scale: Tensor, num_kv_heads: int, kv_heads: list[int]) -> Tensor:
    scale = scale.detach().float().reshape(-1)
    if scale.numel() == 1:
        out = scale.expand(num_kv_heads).clone()
    elif scale.numel() > max(kv_heads):
        out = scale[kv_heads].clone()
    else:
        raise ValueError(f"a KV cache scale has {scale.numel()} values: expected 1 or one "
                         "per KV head")
    if not bool((out > 0).all() & out.isfinite().all()):
        raise ValueError(f"KV cache scales must be finite and positive, got {out.tolist()}")
    return out
