"""LoRA adapters in PEFT's format, read and checked against the base model, laid out for our
fused projections.

A PEFT adapter is a folder with `adapter_config.json` (rank `r`, `lora_alpha`, `use_rslora`,
`target_modules`, ...) and `adapter_model.safetensors`, whose tensors are named after the
base model's modules: `...layers.N.self_attn.q_proj.lora_A.weight` [r, in] and `lora_B.weight`
[out, r]. A projection's output gains `x @ A.T @ B.T * scale`, with scale = alpha / r (or
alpha / sqrt(r) under rsLoRA).

Our decoder fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj`, so an adapter's
per-projection pairs become the fused module's shards: shard j's A takes rows [j * max_rank,
j * max_rank + r) of the module's stacked A, and its B (scale folded in) the same columns of
the module's B, at the shard's output rows. One shrink and one expand per fused module then
serve every shard (`lora.py`). Under tensor parallelism each rank keeps its part, as the
base weight's rows are split (`parallel.checkpoint_rows`): B's output rows on the
column-parallel projections, A's input columns on the row-parallel ones (o, down).

Everything that can be wrong with an adapter is found here, before anything is loaded: a
missing file, a rank over the limit, a module we do not serve, a shape that does not fit the
base model. `LoRAAdapterError` says which.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import Tensor

from pagedserve.model import parallel
from pagedserve.model.config import ModelConfig

# our fused module -> its projections in shard order (an adapter of a fused checkpoint, as
# Phi-3's, targets the fused name itself: one shard over every output row)
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
         "o_proj": ("o_proj",), "down_proj": ("down_proj",)}
MODULE_OF = {proj: fused for fused, projs in FUSED.items() for proj in projs}
MODULE_OF.update({fused: fused for fused in FUSED})
ROW_PARALLEL = ("o_proj", "down_proj")  # their input features are split across ranks

_KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\."
                  r"(\w+)\.lora_([AB])(?:\.default)?\.weight$")


class LoRAAdapterError(ValueError):
    """An adapter that cannot run on this base model; the message says why."""


@dataclass(frozen=True)
class LoRAShard:
    """One projection's pair within its fused module (this rank's part), scale folded in."""

    index: int  # the shard: its columns of the stacked rank dimension
    out_start: int  # its first output row in the fused module (this rank's rows)
    a: Tensor  # [r, in]
    b: Tensor  # [out, r], times the scale


@dataclass(frozen=True)
class LoRAAdapter:
    """An adapter's weights for this rank, per (layer, fused module)."""

    rank: int  # the largest of its projections'
    modules: dict[tuple[int, str], list[LoRAShard]]

    def nbytes(self) -> int:
        return sum(s.a.nbytes + s.b.nbytes for shards in self.modules.values() for s in shards)


def read_adapter(path: str | Path, config: ModelConfig, max_rank: int,
                 dtype: torch.dtype = torch.float32) -> LoRAAdapter:
    """The adapter in folder `path`, checked against `config` (this rank's shard of it)."""
    folder = Path(path)
    settings = _read_config(folder)
    tensors = _read_tensors(folder)
    pairs = _pairs(tensors, config)
    modules: dict[tuple[int, str], list[LoRAShard]] = {}
    max_seen = 0
    for (layer, proj), (a, b) in sorted(pairs.items()):
        r = _check_pair(layer, proj, a, b, config, max_rank)
        max_seen = max(max_seen, r)
        scale = _scale(settings, f"layers.{layer}.{proj}", proj, r)
        modules.setdefault((layer, MODULE_OF[proj]), []).append(
            _shard(proj, a.to(dtype), (b.float() * scale).to(dtype), config))
    return LoRAAdapter(max_seen, modules)


def _read_config(folder: Path) -> dict:
    file = folder / "adapter_config.json"
    if not file.is_file():
        raise LoRAAdapterError(f"no adapter_config.json in {str(folder)!r}")
    try:
        settings = json.loads(file.read_text())
    except ValueError as exc:
        raise LoRAAdapterError(f"adapter_config.json is not JSON: {exc}") from None
    if settings.get("peft_type", "LORA") != "LORA":
        raise LoRAAdapterError(f"peft_type {settings['peft_type']!r} is not LORA")
    for key, unsupported in (("use_dora", True), ("fan_in_fan_out", True)):
        if settings.get(key) == unsupported:
            raise LoRAAdapterError(f"adapters with {key}=true are not supported")
    if settings.get("bias", "none") != "none":
        raise LoRAAdapterError("adapters that train biases (bias != 'none') are not supported")
    if settings.get("modules_to_save"):
        raise LoRAAdapterError("adapters with modules_to_save are not supported")
    if not isinstance(settings.get("r"), int) or not isinstance(
            settings.get("lora_alpha", 8), (int, float)):
        raise LoRAAdapterError("adapter_config.json needs an integer r and a number lora_alpha")
    return settings


def _read_tensors(folder: Path) -> dict[str, Tensor]:
    file = folder / "adapter_model.safetensors"
    if not file.is_file():
        raise LoRAAdapterError(f"no adapter_model.safetensors in {str(folder)!r}")
    try:
        return load_file(file)
    except Exception as exc:  # a truncated or foreign file: safetensors' own error types
        raise LoRAAdapterError(f"adapter_model.safetensors cannot be read: {exc}") from None


def _pairs(tensors: dict[str, Tensor], config: ModelConfig
           ) -> dict[tuple[int, str], tuple[Tensor, Tensor]]:
    found: dict[tuple[int, str], dict[str, Tensor]] = {}
    for name, tensor in tensors.items():
        match = _KEY.match(name)
        if match is None or match[2] not in MODULE_OF:
            raise LoRAAdapterError(f"tensor {name!r}: only LoRA pairs on the layers' q/k/v/o/"
                                   "gate/up/down projections are supported")
        layer, proj = int(match[1]), match[2]
        if layer >= config.num_layers:
            raise LoRAAdapterError(f"tensor {name!r}: the base model has {config.num_layers} "
                                   "layers")
        if config.num_experts and MODULE_OF[proj] in ("gate_up_proj", "down_proj"):
            raise LoRAAdapterError(f"tensor {name!r}: LoRA on MoE experts is not supported")
        found.setdefault((layer, proj), {})[match[3]] = tensor
    if not found:
        raise LoRAAdapterError("the adapter has no LoRA tensors")
    for (layer, proj), pair in found.items():
        if set(pair) != {"A", "B"}:
            raise LoRAAdapterError(f"layers.{layer}.{proj}: lora_A and lora_B must both be given")
    return {key: (pair["A"], pair["B"]) for key, pair in found.items()}


def _full_shape(proj: str, config: ModelConfig) -> tuple[int, int]:
    """(out, in) of the base projection, all ranks together."""
    h, q, kv = config.hidden_size, config.q_size, config.kv_size
    inter = config.intermediate_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter),
            "qkv_proj": (q + 2 * kv, h), "gate_up_proj": (2 * inter, h)}[proj]


def _check_pair(layer: int, proj: str, a: Tensor, b: Tensor, config: ModelConfig,
                max_rank: int) -> int:
    out, inp = _full_shape(proj, config)
    where = f"layers.{layer}.{proj}"
    if a.dim() != 2 or b.dim() != 2:
        raise LoRAAdapterError(f"{where}: lora_A and lora_B must be matrices")
    r = a.shape[0]
    if r > max_rank:
        raise LoRAAdapterError(f"{where}: rank {r} is over max_lora_rank {max_rank}")
    if tuple(a.shape) != (r, inp) or tuple(b.shape) != (out, r):
        raise LoRAAdapterError(
            f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit the base "
            f"projection ({out} x {inp}): expected ({r}, {inp}) and ({out}, {r})")
    return r


def _scale(settings: dict, where: str, proj: str, r: int) -> float:
    """alpha / r, or alpha / sqrt(r) under rsLoRA; PEFT's alpha_pattern may set a module's
    alpha (its key matched against the module's name, as PEFT does: a suffix match)."""
    alpha = settings.get("lora_alpha", 8)
    for pattern, value in (settings.get("alpha_pattern") or {}).items():
        if re.search(rf"(^|\.){pattern}$", f"{where}") or where.endswith(pattern):
            alpha = value
    return alpha / (math.sqrt(r) if settings.get("use_rslora") else r)


def _shard(proj: str, a: Tensor, b: Tensor, config: ModelConfig) -> LoRAShard:
    """This rank's part of one pair, at its place in the fused module."""
    fused = MODULE_OF[proj]
    index = FUSED[fused].index(proj) if proj != fused else 0
    if proj == fused and fused in ("qkv_proj", "gate_up_proj"):
        if parallel.get_tp().size > 1:
            raise LoRAAdapterError(f"{proj}: adapters of fused checkpoints do not run under "
                                   "tensor parallelism")
        return LoRAShard(0, 0, a.contiguous(), b.contiguous())
    rows = parallel.checkpoint_rows(f"layers.0.x.{proj}.weight", config)
    if rows is not None:
        dim, index_rows = rows
        if proj in ROW_PARALLEL:  # the base splits its input: A's columns follow
            a = parallel.take_rows(a, 1, index_rows)
        else:
            b = parallel.take_rows(b, 0, index_rows)
    sizes = _local_sizes(fused, config)
    return LoRAShard(index, sum(sizes[:index]), a.contiguous(), b.contiguous())


def _local_sizes(fused: str, config: ModelConfig) -> list[int]:
    """This rank's output rows of each shard of `fused`."""
    d = config.head_dim
    if fused == "qkv_proj":
        q = len(parallel.local_q_heads(config)) * d
        kv = len(parallel.local_kv_heads(config)) * d
        return [q, kv, kv]
    if fused == "gate_up_proj":
        n = parallel.local_intermediate(config)
        return [n, n]
    return [config.hidden_size]
