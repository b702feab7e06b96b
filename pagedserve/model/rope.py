"""Rotary position embeddings: inverse frequencies for each scaling type, and the cos/sin tables.

A scaling type changes only the angle table angle[p, i] = p * inv_freq[i] (and, for yarn and
longrope, multiplies cos and sin by an attention factor). `freq_factors` divide inv_freq per
dimension pair: the form a GGUF gives Llama 3.1's scaling in (its `rope_freqs` tensor). Most types give one inv_freq for all
positions. Two do not, and transformers recomputes them from the batch's longest sequence:
`dynamic` (NTK) grows the base once a sequence passes max_position_embeddings, `longrope`
switches from the short to the long factors once it passes original_max_position_embeddings.
A paged cache keeps each token's K rotated as it was when it was stored, so we give every
position the frequencies of a context that ends at it: the angles transformers uses when it
generates that token one at a time (a prompt longer than the threshold is the one place the
two differ: transformers rotates the whole prompt with the prompt's length).

Everything is computed in float32 on the CPU, the way transformers computes it, so tables agree
to the last bit or two.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from pagedserve.model.config import SUPPORTED_ROPE_TYPES, ModelConfig


def _exponents(dim: int) -> torch.Tensor:
    return torch.arange(0, dim, 2, dtype=torch.int64).float() / dim


def _default(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** _exponents(dim))


def _llama3(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate in between."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(theta: float, dim: int, scaling: dict[str, Any],
          max_positions: int) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies by `factor`, keep high ones, ramp linearly between
    the dimensions that turn beta_slow and beta_fast times over the original context."""
    old_len = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_positions / old_len
    attention = scaling.get("attention_factor")
    if attention is None:
        mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
                     if mscale and mscale_all else _yarn_mscale(factor))
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(fast), dim_of(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    return inv_freq, float(attention)


def _longrope_attention(scaling: dict[str, Any], max_positions: int) -> float:
    old_len = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_positions / old_len
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_len))
    return float(attention)


def rope_angles(theta: float, dim: int, scaling: dict[str, Any] | None, max_positions: int,
                num_positions: int) -> tuple[torch.Tensor, float]:
    """(angles [num_positions, dim / 2] float32, attention factor for cos and sin).

    max_positions: the checkpoint's max_position_embeddings, which dynamic and longrope
    measure their thresholds against (num_positions may be longer: `rope_context_len`).
    """
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope scaling type {rope_type!r}; "
                         f"supported: {SUPPORTED_ROPE_TYPES}")
    pos = torch.arange(num_positions, dtype=torch.float32)
    attention = 1.0
    if rope_type == "dynamic":
        return pos[:, None] * _dynamic_inv_freq(theta, dim, scaling, max_positions,
                                                num_positions), attention
    if rope_type == "longrope":
        old_len = scaling["original_max_position_embeddings"]
        short = 1.0 / (torch.tensor(scaling["short_factor"], dtype=torch.float32)
                       * theta ** _exponents(dim))
        long = 1.0 / (torch.tensor(scaling["long_factor"], dtype=torch.float32)
                      * theta ** _exponents(dim))
        inv_freq = torch.where((pos + 1 > old_len)[:, None], long, short)
        return pos[:, None] * inv_freq, _longrope_attention(scaling, max_positions)
    if rope_type == "yarn":
        inv_freq, attention = _yarn(theta, dim, scaling, max_positions)
    else:
        inv_freq = _default(theta, dim)
        if rope_type == "linear":
            inv_freq = inv_freq / scaling["factor"]
        elif rope_type == "llama3":
            inv_freq = _llama3(inv_freq, scaling)
    if (scaling or {}).get("freq_factors") is not None:
        inv_freq = inv_freq / torch.tensor(scaling["freq_factors"], dtype=torch.float32)
    return pos[:, None] * inv_freq[None, :], attention


def _dynamic_inv_freq(theta: float, dim: int, scaling: dict[str, Any], max_positions: int,
                      num_positions: int) -> torch.Tensor:
    """[num_positions, dim / 2]: NTK-scaled frequencies for a context ending at each position;
    the base grows with (factor * length / max_positions - (factor - 1)) ** (dim / (dim - 2))
    once length passes max_positions."""
    factor = scaling["factor"]
    length = torch.arange(1, num_positions + 1, dtype=torch.float32).clamp(min=max_positions)
    base = theta * ((factor * length / max_positions) - (factor - 1)) ** (dim / (dim - 2))
    return 1.0 / (base[:, None] ** _exponents(dim)[None, :])


class RotaryEmbedding:
    """cos/sin tables [max_model_len, D] for every position, built once per device and dtype.

    A forward pass only indexes them by position (`ops.rotate_qk_`), instead of recomputing
    trigonometry per step. The sin table is stored sign-folded so that
    rotate_half(x) * sin == roll(x, D/2) * sin_signed, saving a negation and a concat per layer.
    Layers of one type share a table (Gemma 3's local layers have their own base).
    """

    def __init__(self, config: ModelConfig, layer_type: str = "full_attention") -> None:
        theta, scaling = config.rope_for(layer_type)
        self.args = (theta, config.head_dim, scaling, config.max_position_embeddings,
                     config.max_model_len)
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None

    def _build(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        angles, attention = rope_angles(*self.args)
        angles = angles.to(device)
        cos, sin = angles.cos() * attention, angles.sin() * attention
        return torch.cat([cos, cos], -1).to(dtype), torch.cat([-sin, sin], -1).to(dtype)

    def tables(
        self, device: torch.device, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin_signed) [max_model_len, D] on `device` in `dtype`."""
        tables = self._tables
        if tables is None or tables[0].device != device or tables[0].dtype != dtype:
            tables = self._tables = self._build(device, dtype)
        return tables
