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

from pagedserve.model.hf_config import read_hf_config

# HF `architectures[0]` -> our family name. One decoder serves them all; the families differ
# only in the switches `from_hf_folder` sets.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
GEMMA_FAMILIES = ("gemma2", "gemma3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
LAYER_TYPES = ("full_attention", "sliding_attention")
# HF activation name -> ours
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


@dataclass
class ModelConfig:
    """Everything the decoder and the engine need to know about a model."""

    family: str  # a value of SUPPORTED_ARCHITECTURES
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
    # {"rope_type": one of SUPPORTED_ROPE_TYPES, ...}; "freq_factors" (from a GGUF's
    # rope_freqs) divide the frequencies of the default, linear or yarn types
    rope_scaling: dict[str, Any] | None = None
    qkv_bias: bool = False  # Qwen2 always; Llama/Qwen3 when attention_bias
    o_bias: bool = False  # Llama/Qwen3 when attention_bias (Qwen2 never)
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    dtype: torch.dtype = torch.float32  # dtype the checkpoint was saved in
    # the checkpoint's max_position_embeddings, which rope scalings measure against (0: the
    # same as max_model_len, which dynamic and yarn scalings extend)
    max_position_embeddings: int = 0
    # Sliding-window attention: a query at position p sees keys p - window < k <= p.
    # layer_types[i] is "sliding_attention" or "full_attention"; None: every layer is
    # sliding when sliding_window is set (Mistral, Phi-3), else full.
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    local_rope_theta: float | None = None  # Gemma 3: its own base on sliding layers
    local_rope_scaling: dict[str, Any] | None = None
    # Gemma switches
    attn_scale: float | None = None  # None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar)
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap) before the softmax
    final_softcap: float | None = None  # the same on the logits
    hidden_act: str = "silu"  # "silu" | "gelu_tanh": act(gate) * up
    norm_unit_offset: bool = False  # RMSNorm scales by (1 + w), in float32
    sandwich_norms: bool = False  # a norm after attention and after the MLP too, before the add
    scale_embeddings: bool = False  # embeddings times sqrt(hidden_size), in the model dtype
    fused_checkpoint: bool = False  # the checkpoint stores qkv_proj and gate_up_proj (Phi-3)
    # Mixture of experts (every layer's MLP; 0 experts: dense)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalise the top-k routing weights to sum to 1

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if not self.max_position_embeddings:
            self.max_position_embeddings = self.max_model_len
        for scaling in (self.rope_scaling, self.local_rope_scaling):
            rope_type = (scaling or {}).get("rope_type", "default")
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise ValueError(f"unsupported rope scaling type {rope_type!r}; "
                                 f"supported: {SUPPORTED_ROPE_TYPES}")
        if self.hidden_act not in ACTIVATIONS.values():
            raise ValueError(f"unsupported activation {self.hidden_act!r}")
        unknown = set(self.layer_types or ()) - set(LAYER_TYPES)
        if unknown:
            raise ValueError(f"unsupported layer types {sorted(unknown)}; supported: {LAYER_TYPES}")
        if self.num_experts and self.hidden_act != "silu":
            raise ValueError(f"unsupported activation {self.hidden_act!r} for experts")
        if self.layer_types is not None and len(self.layer_types) != self.num_layers:
            raise ValueError(f"{len(self.layer_types)} layer types for {self.num_layers} layers")

    def layer_type(self, layer: int) -> str:
        if self.layer_types is not None:
            return self.layer_types[layer]
        return "full_attention" if self.sliding_window is None else "sliding_attention"

    def layer_window(self, layer: int) -> int | None:
        """The layer's sliding window in tokens, None for global attention."""
        sliding = self.layer_type(layer) == "sliding_attention"
        return self.sliding_window if sliding else None

    @property
    def kv_window(self) -> int | None:
        """The widest window when every layer has one (the block manager may then free what
        lies before it); None when any layer attends globally."""
        windows = [self.layer_window(i) for i in range(self.num_layers)]
        return None if None in windows else max(windows)

    def rope_for(self, layer_type: str) -> tuple[float, dict[str, Any] | None]:
        """(theta, scaling) of the layers of this type."""
        if layer_type == "sliding_attention" and self.local_rope_theta is not None:
            return self.local_rope_theta, self.local_rope_scaling
        return self.rope_theta, self.rope_scaling

    @property
    def scale(self) -> float:
        """The attention scores' scale."""
        return self.head_dim**-0.5 if self.attn_scale is None else self.attn_scale

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
    def from_hf_folder(cls, folder: str | Path, architecture: str | None = None) -> ModelConfig:
        """Read config.json (and generation_config.json for stop tokens) as transformers does.

        `hf_config.read_hf_config` applies transformers' defaults and normalisations (old and
        new rope layouts, missing head_dim, derived sliding windows) without importing it, so
        we read its attributes rather than the raw JSON.
        `architecture`: read it as this one, not the one it names (an EAGLE-3 head's folder
        names its own, over a Llama layer's config).
        """
        folder = Path(folder)
        raw = json.loads((folder / "config.json").read_text())
        arch = architecture or (raw.get("architectures") or [None])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r} in {folder / 'config.json'}; "
                f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        hf = read_hf_config(folder)
        layer_types = getattr(hf, "layer_types", None)
        rope, local_rope = _rope_parameters(hf, layer_types)
        rope_theta = float(rope.pop("rope_theta", getattr(hf, "rope_theta", 10000.0)))
        rope_scaling = rope if rope.get("rope_type", "default") != "default" else None
        local_theta = local_scaling = None
        if local_rope is not None:
            local_theta = float(local_rope.pop("rope_theta"))
            local_scaling = local_rope if local_rope.get("rope_type") != "default" else None
        act = getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", "silu")
        if act not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {act!r} in {folder / 'config.json'}; "
                             f"supported: {sorted(ACTIVATIONS)}")
        attention_bias = bool(getattr(hf, "attention_bias", False))
        gemma = family in GEMMA_FAMILIES
        moe = _moe_fields(hf, family, folder)
        max_positions = hf.max_position_embeddings
        pre_attn_scalar = getattr(hf, "query_pre_attn_scalar", None) if gemma else None
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
            max_model_len=max(rope_context_len(rope_scaling, max_positions),
                              rope_context_len(local_scaling, max_positions)),
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(hf.tie_word_embeddings),
            qkv_bias=family == "qwen2" or attention_bias,
            o_bias=family != "qwen2" and attention_bias,
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            qk_norm=family in ("qwen3", "gemma3", "qwen3_moe"),
            bos_token_id=hf.bos_token_id,
            eos_token_ids=_hf_eos_ids(folder, hf.eos_token_id),
            dtype=_as_dtype(getattr(hf, "dtype", None) or raw.get("torch_dtype")),
            sliding_window=getattr(hf, "sliding_window", None),
            layer_types=list(layer_types) if layer_types is not None else None,
            local_rope_theta=local_theta,
            local_rope_scaling=local_scaling,
            attn_scale=None if pre_attn_scalar is None else float(pre_attn_scalar) ** -0.5,
            attn_softcap=getattr(hf, "attn_logit_softcapping", None) if gemma else None,
            final_softcap=getattr(hf, "final_logit_softcapping", None) if gemma else None,
            hidden_act=ACTIVATIONS[act],
            norm_unit_offset=gemma,
            sandwich_norms=gemma,
            scale_embeddings=gemma,
            fused_checkpoint=family == "phi3",
            **moe,
        )


def _moe_fields(hf: Any, family: str, folder: Path) -> dict[str, Any]:
    """The experts' shape and routing; every layer must be sparse."""
    if family == "mixtral":
        return dict(num_experts=hf.num_local_experts, num_experts_per_tok=hf.num_experts_per_tok,
                    moe_intermediate_size=hf.intermediate_size, norm_topk_prob=True)
    if family != "qwen3_moe":
        return {}
    if getattr(hf, "mlp_only_layers", None) or getattr(hf, "decoder_sparse_step", 1) != 1:
        raise ValueError(f"{folder / 'config.json'}: dense layers among the MoE layers "
                         "(mlp_only_layers, decoder_sparse_step) are not supported")
    return dict(num_experts=hf.num_experts, num_experts_per_tok=hf.num_experts_per_tok,
                moe_intermediate_size=hf.moe_intermediate_size,
                norm_topk_prob=bool(hf.norm_topk_prob))


def _rope_parameters(hf: Any, layer_types: list[str] | None
                     ) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(rope parameters of global layers, of sliding layers when they differ), as copies.

    transformers keys rope_parameters by layer type where the types differ (Gemma 3)."""
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    local = None
    if "full_attention" in rope or "sliding_attention" in rope:
        local = dict(rope.get("sliding_attention") or rope["full_attention"])
        rope = dict(rope.get("full_attention") or local)
    for params in (rope, local):
        if params and params.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"unsupported partial_rotary_factor "
                             f"{params['partial_rotary_factor']} (rotary over part of a head)")
        if params:
            params.pop("partial_rotary_factor", None)
    if local is not None and layer_types is not None and "sliding_attention" not in layer_types:
        local = None
    return rope, local


def rope_context_len(scaling: dict[str, Any] | None, max_positions: int) -> int:
    """The context a rope scaling is made for: dynamic and yarn extend the checkpoint's
    max_position_embeddings by `factor`; the other types' checkpoints state their full length."""
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "dynamic":
        return int(max_positions * scaling["factor"])
    if rope_type == "yarn" and scaling.get("factor"):
        old_len = scaling.get("original_max_position_embeddings") or max_positions
        return max(max_positions, int(old_len * scaling["factor"]))
    return max_positions


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
