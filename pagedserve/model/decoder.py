"""One decoder for the Llama, Mistral, Qwen2/3, Phi-3 and Gemma 2/3 families, over a flat batch
of tokens.

The engine batches tokens from many sequences into one flat `[T]` vector (no padding): each token
carries its own position, and the attention backend uses the per-step `AttentionMetadata` to know
which sequence a token belongs to and where its context lives in the paged KV cache. Everything
here except attention is per-token, so it does not care how tokens are grouped.

The families differ only in switches read from `ModelConfig`: Qwen2 has a bias on q/k/v, Qwen3
normalises q and k per head before RoPE, Gemma scales its norms by (1 + w), adds norms after
attention and the MLP, caps scores and logits with tanh and uses GELU. Each layer takes its own
attention options (sliding window, score cap, scale, which RoPE table) from the config when it
is built, so `forward` is the same math for every family, with explicit arguments.
Q/K/V and gate/up are fused into one matmul each (fewer, larger GEMMs: less per-layer Python and
kernel-launch overhead); the loader fills the fused weights shard by shard.

The residual stream is carried apart from the sublayers' outputs (`x, residual`), so each
residual add is fused into the RMSNorm that follows it; each sublayer hands its output to that
norm itself (the attention to the post-attention norm, the MLP to the next layer's input norm
or the final norm), so that under tensor parallelism the all-reduce before the add can be fused
with it too (`RowParallelLinear`). The elementwise work (norms, RoPE,
SiLU), the float and FP8 matmuls and the MoE experts take the implementations of the `Ops`
the model is built with (`ops.select_ops`: chosen once, from the device and dtype, when the
model loads); each module keeps what it was given. Numerics follow transformers op for op
(RMSNorm in float32, RoPE tables in float32 cast to the activation dtype) so greedy tokens
match it. The one exception is the matmul kernel on the CPU at float32: see `PackedWeight`
(packed.py).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.attention.backend import QKRotation, get_forward_context
from pagedserve.model import parallel
from pagedserve.model.config import ModelConfig
from pagedserve.model.moe import SparseMoE
from pagedserve.model.ops import Matmul, Ops, matmul_into
from pagedserve.model.rope import RotaryEmbedding


class Linear(nn.Linear):
    """nn.Linear through the matmul it is given (`Ops.matmul`: a packed copy of its weight on
    the CPU, the decode GEMV on CUDA, else F.linear); the loader may swap in another for the
    weights it loads (FP8's `fp8.Fp8Matmul`, the fast mode's `packed.QuantizedMatmul`). With
    LoRA on, `lora` adds the step's adapters to the output (`lora.LoRAStack`)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 matmul: Matmul) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.matmul = matmul
        self.lora: Callable[[torch.Tensor, torch.Tensor], None] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x, self.weight, self.bias)
        if self.lora is not None:
            self.lora(x, y)
        return y


class RowParallelLinear(Linear):
    """A Linear over this rank's slice of the input features (tensor parallelism): the
    partial products are summed over the ranks (all-reduce), then the bias is added once.

    Given the RMSNorm that follows (`norm`, with the residual stream), it returns that norm's
    (output, stream) instead: the layers hand their norms here, so that where peer memory
    takes the sum, one kernel sums, adds the residual and normalises (`parallel.fuses_norm`;
    `slot`: which of the fused kernel's two buffers, alternated by the attention's and the
    MLP's). Either way the partial product is written where the sum reads it
    (`parallel.partial_target`), with no copy for a float weight's matmul."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 matmul: Matmul, slot: int = 0) -> None:
        super().__init__(in_features, out_features, bias=bias, matmul=matmul)
        self.slot = slot

    def forward(self, x: torch.Tensor, norm: RMSNorm | None = None,
                residual: torch.Tensor | None = None):
        if parallel.get_tp().size == 1:
            y = super().forward(x)
            return y if norm is None else norm(y, residual)
        shape = (x.shape[0], self.out_features)
        fused = (norm is not None and norm.fuses_with_all_reduce and residual is not None
                 and self.bias is None and parallel.fuses_norm(shape, x.dtype))
        target = parallel.partial_target(shape, x.dtype, self.slot if fused else None)
        y = matmul_into(self.matmul, x, self.weight, target)
        if self.lora is not None:  # this rank's partial shrink, expanded: summed below
            self.lora(x, y)
        if fused:
            return parallel.all_reduce_add_rms_norm_(y, residual, norm.weight, norm.eps,
                                                     self.slot)
        y = parallel.all_reduce_(y)
        y = y if self.bias is None else y.add_(self.bias)
        return y if norm is None else norm(y, residual)


class RMSNorm(nn.Module):
    # its arithmetic is the fused all-reduce kernel's (`RowParallelLinear`)
    fuses_with_all_reduce = True

    def __init__(self, dim: int, eps: float, ops: Ops) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.add_rms_norm = ops.fused_add_rms_norm

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(residual + x), residual + x), the sum written into `residual`; see
        `ops.eager_fused_add_rms_norm`."""
        return self.add_rms_norm(x, residual, self.weight, self.eps)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """RMSNorm(x), no residual."""
        return self.add_rms_norm(x, None, self.weight, self.eps)[0]


class UnitOffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm: normalise and scale by (1 + w), both in float32, then round once.

    Kept eager on every device: the fused kernels round before the weight multiply (Llama's
    order), which for Gemma would change results in bf16.
    """

    fuses_with_all_reduce = False

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self.normalize(x), x
        residual.add_(x)
        return self.normalize(residual), residual

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


def make_norm(config: ModelConfig, dim: int, ops: Ops) -> RMSNorm:
    return (UnitOffsetRMSNorm if config.norm_unit_offset else RMSNorm)(dim, config.rms_norm_eps,
                                                                      ops)


class Attention(nn.Module):
    """Self-attention of one layer. Its options come from the config, per layer: the sliding
    window (None: global), the score cap, the scale, and which RoPE table it reads
    (`layer_type`). The attention backend gets q and k unrotated, with the rotation to apply
    (`AttentionBackend.forward_qkv`): the Triton backend's K/V store rotates as it stores."""

    def __init__(self, config: ModelConfig, layer: int, ops: Ops) -> None:
        super().__init__()
        self.layer = layer  # its index among the caches the runner binds (a recall's waits)
        # this rank's heads (all of them without tensor parallelism): see `parallel`
        self.num_heads = len(parallel.local_q_heads(config))
        self.num_kv_heads = len(parallel.local_kv_heads(config))
        self.head_dim = config.head_dim
        self.scale = config.scale
        self.window = config.layer_window(layer)
        self.softcap = config.attn_softcap
        self.layer_type = config.layer_type(layer)
        self.qkv_proj = Linear(config.hidden_size,
                               (self.num_heads + 2 * self.num_kv_heads) * self.head_dim,
                               bias=config.qkv_bias, matmul=ops.matmul())
        self.o_proj = RowParallelLinear(self.num_heads * self.head_dim, config.hidden_size,
                                        bias=config.o_bias, matmul=ops.matmul(), slot=0)
        self.q_norm = make_norm(config, config.head_dim, ops) if config.qk_norm else None
        self.k_norm = make_norm(config, config.head_dim, ops) if config.qk_norm else None
        # Qwen3's q/k norm is part of the rotation (`ops.eager_rotate_qk_`); Gemma 3's
        # (unit-offset), which no kernel takes, runs eagerly before it
        self.eager_qk_norm = isinstance(self.q_norm, UnitOffsetRMSNorm)
        self.rotate_qk_ = ops.rotate_qk_
        # Paged caches [num_blocks, block_size, num_kv_heads, head_dim], bound by the runner
        # after it sizes the pool. Plain attributes, not buffers: they are not weights, must not
        # be saved, cast or moved with the model.
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        # An FP8 cache's (K, V) scales [num_kv_heads] (`attention.kv_quant`), bound with the
        # caches; the checkpoint's own, when it has them, are kept here by the loader.
        self.kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None
        self.checkpoint_kv_scales: dict[str, torch.Tensor] = {}

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, norm: RMSNorm | None = None,
                residual: torch.Tensor | None = None):
        """The attention output, or with `norm` that norm's (output, stream) of it added to
        `residual` (see `RowParallelLinear`)."""
        T = x.shape[0]
        hq, hkv = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(T, hq + 2 * hkv, self.head_dim)
        if self.eager_qk_norm:
            qkv[:, :hq] = self.q_norm.normalize(qkv[:, :hq])
            qkv[:, hq:hq + hkv] = self.k_norm.normalize(qkv[:, hq:hq + hkv])
        # the backend rotates q and k (in its K/V store where it can: `forward_qkv`)
        rotation = QKRotation(self.rotate_qk_, positions, cos, sin, *self._rotation_norm())
        ctx = get_forward_context()
        if ctx.kv_ready is not None:  # blocks this step recalls land layer by layer
            ctx.kv_ready(self.layer)
        out = ctx.backend.forward_qkv(qkv, hkv, rotation, self.k_cache, self.v_cache, ctx.meta,
                                      self.scale, window=self.window, softcap=self.softcap,
                                      kv_scales=self.kv_scales)
        return self.o_proj(out.reshape(T, hq * self.head_dim), norm, residual)

    def _rotation_norm(self) -> tuple[torch.Tensor | None, torch.Tensor | None, float]:
        """The per-head q/k RMSNorm the rotation applies first: (q weight, k weight, eps);
        (None, None, 0.0) for none (Gemma 3's was applied before)."""
        if self.q_norm is None or self.eager_qk_norm:
            return None, None, 0.0
        return self.q_norm.weight, self.k_norm.weight, self.q_norm.eps


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, ops: Ops) -> None:
        super().__init__()
        intermediate = parallel.local_intermediate(config)  # this rank's slice
        self.gate_up_proj = Linear(config.hidden_size, 2 * intermediate, bias=config.mlp_bias,
                                   matmul=ops.matmul())
        self.down_proj = RowParallelLinear(intermediate, config.hidden_size,
                                           bias=config.mlp_bias, matmul=ops.matmul(), slot=1)
        act_and_mul = {"silu": ops.silu_and_mul, "gelu_tanh": gelu_tanh_and_mul}
        self.act_and_mul = act_and_mul[config.hidden_act]

    def forward(self, x: torch.Tensor, norm: RMSNorm | None = None,
                residual: torch.Tensor | None = None):
        """The MLP output, or with `norm` that norm's (output, stream) of it added to
        `residual` (see `RowParallelLinear`)."""
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)), norm, residual)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] -> gelu_tanh(gate) * up (Gemma's MLP), eager on every device."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh").mul_(up)


# an expert's weight in a checkpoint: layers.N.(mlp|block_sparse_moe).experts.E.PROJ.weight
# (or a packed layout's part, under `int_weights`' names)
_EXPERT = re.compile(r"^(layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
                     r"(w1|w2|w3|gate_proj|up_proj|down_proj)\."
                     r"(weight|qweight|scales|zeros|g_idx)$")


class DecoderLayer(nn.Module):
    """Pre-norm block: h + attn(norm(h)), then + mlp(norm(...)). Each sublayer's output goes
    to the norm after it (the post-attention norm; the next layer's input norm, or the final
    norm), so that under tensor parallelism the all-reduce may be fused with it."""

    def __init__(self, config: ModelConfig, layer: int, ops: Ops) -> None:
        super().__init__()
        self.input_layernorm = make_norm(config, config.hidden_size, ops)
        self.self_attn = Attention(config, layer, ops)
        self.post_attention_layernorm = make_norm(config, config.hidden_size, ops)
        self.mlp = SparseMoE(config, ops) if config.num_experts else MLP(config, ops)

    def forward(self, x: torch.Tensor, residual: torch.Tensor, positions: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor,
                next_norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """x: this layer's input, normalised from the residual stream `residual` (by the
        layer before, or the decoder for the first). Returns `next_norm`'s (output, stream)
        after this layer: the next layer's input, or the final hidden states."""
        x, residual = self.self_attn(x, positions, cos, sin, self.post_attention_layernorm,
                                     residual)
        if isinstance(self.mlp, MLP):
            return self.mlp(x, next_norm, residual)
        return next_norm(self.mlp(x), residual)


class SandwichDecoderLayer(DecoderLayer):
    """Gemma 2/3's block: each sublayer's output is normalised again before it joins the
    residual stream (`post_attention_layernorm` is that norm here, not the MLP's input norm,
    which is `pre_feedforward_layernorm`)."""

    def __init__(self, config: ModelConfig, layer: int, ops: Ops) -> None:
        super().__init__(config, layer, ops)
        self.pre_feedforward_layernorm = make_norm(config, config.hidden_size, ops)
        self.post_feedforward_layernorm = make_norm(config, config.hidden_size, ops)

    def forward(self, x: torch.Tensor, residual: torch.Tensor, positions: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor,
                next_norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        attn = self.post_attention_layernorm.normalize(self.self_attn(x, positions, cos, sin))
        x, residual = self.pre_feedforward_layernorm(attn, residual)
        return next_norm(self.post_feedforward_layernorm.normalize(self.mlp(x)), residual)


class Decoder(nn.Module):
    """The causal LM. Parameter names follow HF's minus the `model.` prefix, with q/k/v ->
    qkv_proj and gate/up -> gate_up_proj fused (see `PACKED_SHARDS`; Phi-3 checkpoints store
    them fused already). `ops`: the implementations its layers take (`ops.select_ops`)."""

    # HF sub-module name -> (our fused module name, shard index in the fused output dim)
    PACKED_SHARDS = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig, ops: Ops) -> None:
        super().__init__()
        self.config = config
        # this rank's vocabulary rows (all of them without tensor parallelism)
        self.embed_tokens = parallel.VocabParallelEmbedding(config)
        layer_cls = SandwichDecoderLayer if config.sandwich_norms else DecoderLayer
        self.layers = nn.ModuleList(layer_cls(config, i, ops) for i in range(config.num_layers))
        self.norm = make_norm(config, config.hidden_size, ops)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, len(parallel.local_vocab(config)), bias=False)
        )
        # the output projection's matmul, on whichever weight it is
        self.lm_head_matmul = ops.matmul()
        self.lora_fn = ops.lora  # batched LoRA's implementation, for `lora.attach`
        # one table per layer type present (Gemma 3's local layers have their own base)
        self.rotary = {t: RotaryEmbedding(config, t)
                       for t in dict.fromkeys(map(config.layer_type, range(config.num_layers)))}
        self.embed_scale = config.hidden_size**0.5 if config.scale_embeddings else None
        self.quantization: str | None = None  # "fp8": FP8 weights (set by the loader)
        # the fast mode's whole-step decode (`fast_decode.FastDecode`, set by the loader):
        # takes the steps it can, returns None for the others
        self.fast_decode: Callable[..., torch.Tensor | None] | None = None

    def attention_layers(self) -> list[Attention]:
        """The attention modules in layer order, for the runner to bind `k_cache`/`v_cache`."""
        return [layer.self_attn for layer in self.layers]

    def dense_linears(self) -> list[Linear]:
        """The projections FP8 weights apply to: each layer's q/k/v, o, gate/up and down (not
        the embedding, the LM head or MoE experts)."""
        linears = []
        for layer in self.layers:
            linears += [layer.self_attn.qkv_proj, layer.self_attn.o_proj]
            if isinstance(layer.mlp, MLP):
                linears += [layer.mlp.gate_up_proj, layer.mlp.down_proj]
        return linears

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T] for a flat batch of tokens -> final hidden states [T, H]."""
        if self.fast_decode is not None:
            hidden = self.fast_decode(input_ids, positions)
            if hidden is not None:
                return hidden
        return self.forward_capturing(input_ids, positions, ())[0]

    def forward_capturing(self, input_ids: torch.Tensor, positions: torch.Tensor,
                          capture: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The final hidden states, and the residual stream entering each layer of `capture`
        ([T, len(capture) * H], in that order; index num_layers: the last layer's output
        before the final norm; None when `capture` is empty): EAGLE-3 heads read three of
        them (`model/eagle3.py`)."""
        h = self.embed_tokens(input_ids)
        if self.embed_scale is not None:  # rounded to the model dtype first, as Gemma does
            h = h * torch.tensor(self.embed_scale, dtype=h.dtype)
        tables = {t: rotary.tables(h.device, h.dtype) for t, rotary in self.rotary.items()}
        x, residual = self.layers[0].input_layernorm(h, None)  # the stream starts at h
        next_norms = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        streams: dict[int, torch.Tensor] = {}
        for i, (layer, next_norm) in enumerate(zip(self.layers, next_norms)):
            if i in capture:  # the layers add into the stream in place: a copy
                streams[i] = residual.clone()
            x, residual = layer(x, residual, positions, *tables[layer.self_attn.layer_type],
                                next_norm)
        if len(self.layers) in capture:
            streams[len(self.layers)] = residual.clone()
        captured = torch.cat([streams[i] for i in capture], -1) if capture else None
        return x, captured

    def compute_logits(self, hidden: torch.Tensor, gather: bool = True) -> torch.Tensor:
        """hidden [S, H] (usually one row per sequence) -> logits [S, vocab] in the model's
        dtype: the sampler upcasts only what it needs (a float32 copy of [256, 151936] bf16
        logits is 155 MB written and read back per step on the GPU). Under tensor
        parallelism, `gather=False` leaves each rank its own rows of the vocabulary
        (`parallel.local_vocab`, padding included): [S, len(local_vocab)], for a sampler
        that needs only a few numbers per row from each rank."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = self.lm_head_matmul(hidden, weight, None)
        if gather and parallel.get_tp().size > 1:
            # every rank's vocabulary rows, less the padding of the last
            logits = parallel.gather_last_dim(logits)[:, :self.config.vocab_size]
        cap = self.config.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def num_shards(self, param_name: str) -> int:
        """How many checkpoint tensors fill this parameter (3 for qkv, 2 for gate/up, unless
        the checkpoint stores them fused)."""
        stacked = re.search(r"\.mlp\.(w13|w2)(_\w+)?$", param_name)  # a packed one's too
        if stacked:
            return self.config.num_experts * (2 if stacked[1] == "w13" else 1)
        if self.config.fused_checkpoint:
            return 1
        module = param_name.split(".")[-2]
        return {"qkv_proj": 3, "gate_up_proj": 2}.get(module, 1)

    def _expert_shard(self, layer: str, expert: str, proj: str,
                      kind: str = "weight") -> tuple[str, int, tuple]:
        """One expert's gate (w1), up (w3) or down (w2) into the stacked weights (`kind`: the
        float weight, or a packed layout's part: `w13_qweight`, ..., see `int_weights`; a
        column order, g_idx, is one row per expert)."""
        e, size = int(expert), parallel.local_moe_intermediate(self.config)  # this rank's
        down = proj in ("w2", "down_proj")
        name = f"{layer}.mlp.{'w2' if down else 'w13'}" + ("" if kind == "weight" else f"_{kind}")
        half = 0 if proj in ("w1", "gate_proj") else 1
        if down or kind == "g_idx":
            return name, e if down else 2 * e + half, (e,)
        return name, 2 * e + half, (e, slice(half * size, (half + 1) * size))

    def shard_range(self, name: str) -> tuple[str, int, slice | tuple | None]:
        """Map an HF weight name (without `model.`) to (our parameter name, shard index, row
        slice of that shard in the fused output dim, or (expert, rows) in a stacked expert
        weight). Unfused names map to (name, 0, None)."""
        expert = _EXPERT.match(name)
        if expert is not None:
            return self._expert_shard(*expert.groups())
        name = name.replace(".block_sparse_moe.gate.", ".mlp.gate.")  # Mixtral's router
        parts = name.split(".")
        for i, part in enumerate(parts):
            if part in self.PACKED_SHARDS:
                fused, index = self.PACKED_SHARDS[part]
                parts[i] = fused
                attn, d = self.layers[0].self_attn, self.config.head_dim  # this rank's sizes
                q_size, kv_size = attn.num_heads * d, attn.num_kv_heads * d
                intermediate = parallel.local_intermediate(self.config)
                sizes = (
                    [q_size, kv_size, kv_size]
                    if fused == "qkv_proj"
                    else [intermediate, intermediate]
                )
                start = sum(sizes[:index])
                return ".".join(parts), index, slice(start, start + sizes[index])
        return name, 0, None
