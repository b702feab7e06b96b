"""EAGLE-3 draft heads in the published checkpoint layout (the EAGLE authors', SpecForge's,
as vLLM and SGLang read them), on the decoder's own layer, norms and attention.

A head is one Llama decoder layer that predicts the target's next token from the target's
own features: `fc` fuses the residual streams of three target layers (low, middle, high) to
one hidden state; the layer's attention reads concat(norm(embedding of the token),
hidden_norm(that state)), twice the hidden size; its `lm_head` scores a smaller draft
vocabulary, mapped to target ids by `d2t` (target id = draft id + d2t[draft id]). Drafting
further, the head reads its own output (before its final norm) in place of the fused state.

The folder holds config.json and safetensors:

    fc.weight                          [H, 3 * target hidden size]
    midlayer.input_layernorm.weight    the token embedding's norm
    midlayer.hidden_norm.weight        the fused state's norm
    midlayer.self_attn.{q,k,v,o}_proj.weight   q/k/v read 2 * H
    midlayer.post_attention_layernorm.weight, midlayer.mlp.{gate,up,down}_proj.weight
    norm.weight, lm_head.weight        [draft vocab, H]
    d2t                                int64 [draft vocab]; t2d (target -> draft) is unused
    embed_tokens.weight                optional: the target's embedding when absent

config.json is a Llama layer's config plus `draft_vocab_size` (default: vocab_size, which
must be the target's), `target_hidden_size` (default: hidden_size), `norm_before_residual`
(default false: the residual is the fused state before hidden_norm) and the target layers,
`eagle_aux_hidden_state_layer_ids` (at the top or under `eagle_config`). Those ids name
layers whose *output* the head reads (SGLang's and SpecForge's reading: the stream entering
layer id + 1); without them the streams entering layers 2, L // 2 and L - 3 (both engines'
default).

Under tensor parallelism the layer's projections are this rank's shard, cut as the target's
(`parallel.checkpoint_rows`: q/k/v and gate/up by output rows, o/down by input columns, so
the layer's two all-reduces make its output whole); fc, the norms and the draft vocabulary's
lm_head are small and kept whole on every rank, which reads the target's whole streams.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from pagedserve.model import parallel
from pagedserve.model.config import ModelConfig
from pagedserve.model.decoder import DecoderLayer, Linear, make_norm
from pagedserve.model.loader import materialize
from pagedserve.model.ops import Ops
from pagedserve.model.rope import RotaryEmbedding

# the layer's projections, which tensor parallelism shards as the target's (the rest of the
# head is small and kept whole on every rank: fc, the norms, the draft vocabulary's lm_head)
_SHARDED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# a q/k/v or gate/up shard in the checkpoint -> (the fused parameter, its index)
_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


@dataclass(frozen=True)
class Eagle3Spec:
    """What config.json says beyond the layer's own config."""

    draft_vocab_size: int
    target_hidden_size: int
    norm_before_residual: bool
    layer_ids: tuple[int, ...] | None  # target layers whose outputs are read; None: default

    @classmethod
    def read(cls, folder: Path, config: ModelConfig) -> Eagle3Spec:
        raw = json.loads((folder / "config.json").read_text())
        eagle = raw.get("eagle_config") or {}
        ids = raw.get("eagle_aux_hidden_state_layer_ids") or eagle.get(
            "eagle_aux_hidden_state_layer_ids")
        return cls(int(raw.get("draft_vocab_size") or config.vocab_size),
                   int(raw.get("target_hidden_size") or config.hidden_size),
                   bool(raw.get("norm_before_residual", False)),
                   tuple(int(i) for i in ids) if ids else None)

    def capture(self, num_target_layers: int) -> tuple[int, ...]:
        """The target layers whose entering residual stream the head reads (index
        num_target_layers: the last layer's output)."""
        if self.layer_ids is None:
            layers = (2, num_target_layers // 2, num_target_layers - 3)
        else:
            layers = tuple(i + 1 for i in self.layer_ids)
        if len(layers) != 3 or not all(0 <= i <= num_target_layers for i in layers):
            raise ValueError(f"EAGLE-3 head: eagle_aux_hidden_state_layer_ids must name three "
                             f"of the target's {num_target_layers} layers, got "
                             f"{list(self.layer_ids) if self.layer_ids else 'the default'}")
        return layers


class Eagle3Head(nn.Module):
    """The head's layer and projections (the embedding is bound after loading: its own, or
    the target's)."""

    def __init__(self, config: ModelConfig, spec: Eagle3Spec, ops: Ops) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.config, self.spec = config, spec
        self.fc = Linear(3 * spec.target_hidden_size, hidden, bias=False, matmul=ops.matmul())
        self.midlayer = layer = DecoderLayer(config, 0, ops)
        attn = layer.self_attn
        attn.qkv_proj = Linear(2 * hidden, (attn.num_heads + 2 * attn.num_kv_heads)
                               * config.head_dim, bias=config.qkv_bias, matmul=ops.matmul())
        layer.hidden_norm = make_norm(config, hidden, ops)
        self.norm = make_norm(config, hidden, ops)
        self.lm_head = nn.Linear(hidden, spec.draft_vocab_size, bias=False)
        self.lm_head_matmul = ops.matmul()
        self.register_buffer("d2t", torch.zeros(spec.draft_vocab_size, dtype=torch.long))
        self.rotary = RotaryEmbedding(config, config.layer_type(0))
        self.embed_tokens: nn.Module | None = None

    def attention_layers(self) -> list:
        return [self.midlayer.self_attn]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(final-normed, pre-norm) hidden states of the head's rows. `hidden`: the target's
        three streams [T, 3 * target hidden] (fused by fc here), or the head's own pre-norm
        output of the draft step before [T, H]."""
        if hidden.shape[-1] != self.config.hidden_size:
            hidden = self.fc(hidden)
        layer = self.midlayer
        embeds = layer.input_layernorm.normalize(self.embed_tokens(input_ids))
        if self.spec.norm_before_residual:
            hidden = layer.hidden_norm.normalize(hidden)
            residual = hidden.clone()
        else:
            residual = hidden.clone()  # the norms below add into it in place
            hidden = layer.hidden_norm.normalize(hidden)
        cos, sin = self.rotary.tables(hidden.device, hidden.dtype)
        out = layer.self_attn(torch.cat([embeds, hidden], -1), positions, cos, sin)
        x, residual = layer.post_attention_layernorm(out, residual)
        return self.norm(layer.mlp(x), residual)

    def draft_tokens(self, normed: torch.Tensor) -> torch.Tensor:
        """The greedy draft of each row, as target token ids."""
        best = self.lm_head_matmul(normed, self.lm_head.weight, None).argmax(-1)
        return best + self.d2t[best]


def eagle3_config(folder: str | Path) -> ModelConfig:
    """The head's layer config (config.json, read as a Llama layer's)."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise ValueError(f"speculative_config.model: {folder} is not an EAGLE-3 head's folder "
                         "(no config.json)")
    return ModelConfig.from_hf_folder(folder, architecture="LlamaForCausalLM")


def load_eagle3(folder: str | Path, target_config: ModelConfig, target_embedding: nn.Module,
                dtype: torch.dtype, device: torch.device, ops: Ops,
                max_model_len: int | None = None) -> tuple[Eagle3Head, tuple[int, ...]]:
    """The head on `device` and the target layers it reads (`Eagle3Spec.capture`); a head
    made for another target (vocabulary, hidden size, layers) is a ValueError.
    `max_model_len`: the positions the head must reach. Published heads state a short
    max_position_embeddings (trained on short sequences); with plain RoPE the table is only
    a cache of a formula, so it is built that long (a scaled RoPE is not extended)."""
    folder = Path(folder)
    config = eagle3_config(folder)
    if (max_model_len is not None and config.max_model_len < max_model_len
            and config.rope_scaling is None):
        config = dataclasses.replace(config, max_model_len=max_model_len)
    spec = Eagle3Spec.read(folder, config)
    if config.vocab_size != target_config.vocab_size:
        raise ValueError(f"speculative_config.model: the EAGLE-3 head's vocabulary "
                         f"({config.vocab_size} tokens) is not the target's "
                         f"({target_config.vocab_size})")
    if spec.target_hidden_size != target_config.hidden_size:
        raise ValueError(f"speculative_config.model: the EAGLE-3 head reads hidden states of "
                         f"size {spec.target_hidden_size}, the target's are "
                         f"{target_config.hidden_size}")
    capture = spec.capture(target_config.num_layers)
    with torch.device("meta"):
        head = Eagle3Head(config, spec, ops)
    head = materialize(head.to(dtype), device)
    embedding = _load_weights(head, _read_tensors(folder), config)
    head.embed_tokens = target_embedding
    if embedding is not None:
        head.embed_tokens = nn.Embedding.from_pretrained(embedding.to(device, dtype))
    targets = torch.arange(spec.draft_vocab_size, device=device) + head.d2t
    if int(targets.min()) < 0 or int(targets.max()) >= target_config.vocab_size:
        raise ValueError("speculative_config.model: the EAGLE-3 head's d2t maps draft ids "
                         "outside the target's vocabulary")
    return head.eval().requires_grad_(False), capture


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """safetensors files, else a pytorch_model.bin (the EAGLE authors' heads ship one),
    read as tensors only."""
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(str(file)))
    if not files and (folder / "pytorch_model.bin").is_file():
        tensors = torch.load(folder / "pytorch_model.bin", map_location="cpu",
                             weights_only=True)
    if not tensors:
        raise ValueError(f"speculative_config.model: no weights (safetensors or "
                         f"pytorch_model.bin) in {folder}")
    return tensors


def _load_weights(head: Eagle3Head, tensors: dict[str, torch.Tensor],
                  config: ModelConfig) -> torch.Tensor | None:
    """Copy the checkpoint into the head (q/k/v and gate/up into their fused parameters);
    returns its embedding, if it has one. A missing or stray weight is a ValueError."""
    params = dict(head.named_parameters())
    params["d2t"] = head.d2t
    attn = head.midlayer.self_attn
    q, kv = attn.num_heads * config.head_dim, attn.num_kv_heads * config.head_dim
    sizes = {"qkv_proj": [q, kv, kv],
             "gate_up_proj": [parallel.local_intermediate(config)] * 2}
    loaded, embedding = set(), None
    with torch.no_grad():
        for name, tensor in tensors.items():
            name = name.removeprefix("model.").replace("layers.0.", "midlayer.")
            if name == "t2d":
                continue
            if name == "embed_tokens.weight":
                embedding = tensor
                continue
            parts, rows = name.split("."), None
            if len(parts) > 2 and parts[-2] in _SHARDED:  # this rank's heads / features
                shard = parallel.checkpoint_rows(name, config, shape=tuple(tensor.shape))
                tensor = tensor if shard is None else parallel.take_rows(tensor, *shard)
            if len(parts) > 2 and parts[-2] in _FUSED:
                fused, index = _FUSED[parts[-2]]
                parts[-2] = fused
                start = sum(sizes[fused][:index])
                rows = slice(start, start + sizes[fused][index])
                name = ".".join(parts) + f"#{index}"
            target = name.split("#")[0]
            if target not in params:
                raise ValueError(f"speculative_config.model: unexpected EAGLE-3 weight {name!r}")
            dst = params[target] if rows is None else params[target][rows]
            if dst.shape != tensor.shape:
                raise ValueError(f"speculative_config.model: EAGLE-3 weight {name!r} has shape "
                                 f"{tuple(tensor.shape)}, expected {tuple(dst.shape)}")
            dst.copy_(tensor)
            loaded.add(name)
    expected = {n for n in params if n not in ("midlayer.self_attn.qkv_proj.weight",
                                               "midlayer.mlp.gate_up_proj.weight")}
    expected |= {f"midlayer.self_attn.qkv_proj.weight#{i}" for i in range(3)}
    expected |= {f"midlayer.mlp.gate_up_proj.weight#{i}" for i in range(2)}
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"speculative_config.model: the EAGLE-3 head lacks {missing[:6]}")
    return embedding
