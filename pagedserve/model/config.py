"""ModelConfig: the shape and numerics of one decoder, whatever file it came from.

Both loaders (HF folder, GGUF file) reduce their metadata to this one dataclass, so the decoder
and the engine (KV sizing, max length, stop tokens) never look at a checkpoint format again.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

# HF `architectures[0]` / `model_type` -> our family name. One decoder serves all three.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
SUPPORTED_ROPE_TYPES = ("default", "llama3")


@dataclass
class ModelConfig:
    """Everything the decoder and the engine need to know about a model."""

    family: str  # "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_model_len: int
    tie_word_embeddings: bool
    rope_scaling: dict[str, Any] | None = None  # only {"rope_type": "llama3", ...} today
    qkv_bias: bool = False  # Qwen2 always; Llama/Qwen3 when attention_bias
    o_bias: bool = False  # Llama/Qwen3 when attention_bias (Qwen2 never)
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    dtype: torch.dtype = torch.float32  # dtype the checkpoint was saved in

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope scaling type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}"
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def to_json(self) -> str:
        """Every field as JSON (the dtype by name), for caches that skip re-reading a checkpoint."""
        fields = dataclasses.asdict(self)
        fields["dtype"] = str(self.dtype).removeprefix("torch.")
        return json.dumps(fields, indent=1)

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        fields = json.loads(text)
        fields["dtype"] = _as_dtype(fields["dtype"])
        return cls(**fields)

    @classmethod
    def from_hf_folder(cls, folder: str | Path) -> ModelConfig:
        """Read config.json (and generation_config.json for stop tokens) through transformers.

        AutoConfig normalises old and new config layouts (rope_scaling vs rope_parameters,
        missing head_dim), so we read its attributes rather than the raw JSON.
        """
        from transformers import AutoConfig

        folder = Path(folder)
        raw = json.loads((folder / "config.json").read_text())
        arch = (raw.get("architectures") or [None])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r} in {folder / 'config.json'}; "
                f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        hf = AutoConfig.from_pretrained(folder)
        if getattr(hf, "use_sliding_window", False):
            raise ValueError("sliding-window attention is not supported")
        rope = dict(getattr(hf, "rope_parameters", None) or {})
        rope_theta = float(rope.pop("rope_theta", getattr(hf, "rope_theta", 10000.0)))
        rope_scaling = rope if rope.get("rope_type", "default") != "default" else None
        attention_bias = bool(getattr(hf, "attention_bias", False))
        return cls(
            family=family,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=hf.num_attention_heads,
            num_kv_heads=hf.num_key_value_heads or hf.num_attention_heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
            rms_norm_eps=hf.rms_norm_eps,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_model_len=hf.max_position_embeddings,
            tie_word_embeddings=bool(hf.tie_word_embeddings),
            qkv_bias=family == "qwen2" or attention_bias,
            o_bias=family != "qwen2" and attention_bias,
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            qk_norm=family == "qwen3",
            bos_token_id=hf.bos_token_id,
            eos_token_ids=_hf_eos_ids(folder, hf.eos_token_id),
            dtype=_as_dtype(getattr(hf, "dtype", None) or raw.get("torch_dtype")),
        )


def _as_list(ids: int | list[int] | None) -> list[int]:
    if ids is None:
        return []
    return [ids] if isinstance(ids, int) else list(ids)


def _hf_eos_ids(folder: Path, config_eos: int | list[int] | None) -> list[int]:
    """generation_config.json wins: chat models list their end-of-turn token only there."""
    gen_path = folder / "generation_config.json"
    if gen_path.exists():
        gen_eos = _as_list(json.loads(gen_path.read_text()).get("eos_token_id"))
        if gen_eos:
            return gen_eos
    return _as_list(config_eos)


def _as_dtype(value: torch.dtype | str | None) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and isinstance(getattr(torch, value, None), torch.dtype):
        return getattr(torch, value)
    return torch.float32
