"""One decoder for the Llama, Qwen2 and Qwen3 families, over a flat batch of tokens.

The engine batches tokens from many sequences into one flat `[T]` vector (no padding): each token
carries its own position, and the attention backend uses the per-step `AttentionMetadata` to know
which sequence a token belongs to and where its context lives in the paged KV cache. Everything
here except attention is per-token, so it does not care how tokens are grouped.

The three families differ only in small switches read from `ModelConfig`: Qwen2 has a bias on
q/k/v, Qwen3 normalises q and k per head before RoPE, Llama-3 rescales RoPE frequencies.
Q/K/V and gate/up are fused into one matmul each (fewer, larger GEMMs: less per-layer Python and
kernel-launch overhead); the loader fills the fused weights shard by shard.

The residual stream is carried apart from the sublayers' outputs (`h, residual`), so each
residual add is fused into the RMSNorm that follows it. The elementwise work (norms, RoPE,
SiLU) goes through `ops`: eager PyTorch on the CPU, a few Triton kernels on CUDA. Numerics
follow transformers op for op (RMSNorm in float32, RoPE tables in float32 cast to the
activation dtype) so greedy tokens match it. The one exception is the matmul kernel on the CPU
at float32: see `PackedWeight`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.attention.backend import get_forward_context
from pagedserve.model import ops, parallel
from pagedserve.model.config import ModelConfig
from pagedserve.native import linear as native_linear


# Row count oneDNN tunes a packed weight's layout for: a decode batch. Any row count works.
PACK_ROWS_HINT = 16


class PackedWeight:
    """A prepacked copy of a float32 weight, used for inference on the CPU.

    Why: at decode batch sizes (1 to a few dozen rows) MKL's sgemm behind `F.linear` re-lays
    out the weight on every call and reads it from DRAM before computing. The copy is packed
    for our AVX2 kernel (`native/linear.c`), which streams the weight while it computes, else
    (no C compiler, no AVX2) for oneDNN. On the 2-core dev box one decode step's 120 layer
    GEMMs + LM head at batch 16 take ~110 ms with `F.linear`, ~65 ms with oneDNN and ~37 ms
    with the kernel (docs/benchmarks.md). Products and float32 accumulation are the same; only
    the summation order differs, so results differ from `F.linear` in the last bits (tests hold
    logits to transformers' within 5e-4 and greedy tokens exactly). The copy costs the
    weight's memory once more. It is rebuilt when the weight is written (version counter) or
    replaced; anything else (GPU, other dtypes, autograd, weights made under inference mode)
    takes `F.linear`.
    """

    def __init__(self) -> None:
        self._source: torch.Tensor | None = None  # the weight the copy was made from
        self._key: tuple[int, int] | None = None  # its storage and version at the time
        self._packed: torch.Tensor | None = None

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        native = native_linear.available()
        if torch.is_grad_enabled() or x.device.type != "cpu" or (
            x.dtype != torch.float32 or weight.dtype != torch.float32
        ) or weight.is_inference() or not (native or _ONEDNN):
            return F.linear(x, weight, bias)  # (an inference tensor has no version counter)
        key = (weight.data_ptr(), weight._version)
        if weight is not self._source or key != self._key:
            self._packed = (native_linear.pack(weight.detach()) if native else
                            torch.ops.mkldnn._reorder_linear_weight(weight.detach(),
                                                                    PACK_ROWS_HINT))
            self._source, self._key = weight, key
        if native:
            return native_linear.linear(x, self._packed, weight.shape[0], bias)
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, bias, "none", [], "")


_ONEDNN = torch.backends.mkldnn.is_available()


class Linear(nn.Linear):
    """nn.Linear whose CPU float32 inference goes through a `PackedWeight`."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.packed = PackedWeight()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.packed.linear(x, self.weight, self.bias)


class RowParallelLinear(Linear):
    """A Linear over this rank's slice of the input features (tensor parallelism): the
    partial products are summed over the ranks (all-reduce), then the bias is added once."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if parallel.get_tp().size == 1:
            return super().forward(x)
        y = parallel.all_reduce_(self.packed.linear(x, self.weight))
        return y if self.bias is None else y.add_(self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(residual + x), residual + x), the sum written into `residual`; see
        `ops.fused_add_rms_norm`."""
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] in float32, with Llama-3 scaling when configured."""
    dim = config.head_dim
    steps = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (config.rope_theta**steps)
    scaling = config.rope_scaling
    if scaling is None or scaling.get("rope_type", "default") == "default":
        return inv_freq
    assert scaling["rope_type"] == "llama3", f"unsupported rope type {scaling['rope_type']!r}"
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate in between.
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


class RotaryEmbedding:
    """cos/sin tables [max_model_len, D] for every position, built once per device and dtype.

    A forward pass only indexes them by position (`ops.rotate_qk_`), instead of recomputing
    trigonometry per step. The sin table is stored sign-folded so that
    rotate_half(x) * sin == roll(x, D/2) * sin_signed, saving a negation and a concat per layer.
    """

    def __init__(self, config: ModelConfig) -> None:
        self.inv_freq = rope_inv_freq(config)
        self.max_positions = config.max_model_len
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None

    def _build(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.inv_freq.to(device)
        pos = torch.arange(self.max_positions, device=device, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        return torch.cat([cos, cos], -1).to(dtype), torch.cat([-sin, sin], -1).to(dtype)

    def tables(
        self, device: torch.device, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin_signed) [max_model_len, D] on `device` in `dtype`."""
        tables = self._tables
        if tables is None or tables[0].device != device or tables[0].dtype != dtype:
            tables = self._tables = self._build(device, dtype)
        return tables


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # this rank's heads (all of them without tensor parallelism): see `parallel`
        self.num_heads = len(parallel.local_q_heads(config))
        self.num_kv_heads = len(parallel.local_kv_heads(config))
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.qkv_proj = Linear(config.hidden_size,
                               (self.num_heads + 2 * self.num_kv_heads) * self.head_dim,
                               bias=config.qkv_bias)
        self.o_proj = RowParallelLinear(self.num_heads * self.head_dim, config.hidden_size,
                                        bias=config.o_bias)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        # Paged caches [num_blocks, block_size, num_kv_heads, head_dim], bound by the runner
        # after it sizes the pool. Plain attributes, not buffers: they are not weights, must not
        # be saved, cast or moved with the model.
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        T = x.shape[0]
        hq, hkv = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(T, hq + 2 * hkv, self.head_dim)
        if self.q_norm is None:
            ops.rotate_qk_(qkv, positions, cos, sin, hq, hkv)
        else:
            ops.rotate_qk_(qkv, positions, cos, sin, hq, hkv, self.q_norm.weight,
                           self.k_norm.weight, self.q_norm.eps)
        q, k, v = qkv.split([hq, hkv, hkv], dim=1)
        ctx = get_forward_context()
        out = ctx.backend.forward(
            q, k, v, self.k_cache, self.v_cache, ctx.meta, self.scale
        )
        return self.o_proj(out.reshape(T, hq * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        intermediate = parallel.local_intermediate(config)  # this rank's slice
        self.gate_up_proj = Linear(config.hidden_size, 2 * intermediate, bias=config.mlp_bias)
        self.down_proj = RowParallelLinear(intermediate, config.hidden_size,
                                           bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """h: the previous layer's MLP output, not yet added to `residual` (None before the
        first layer, where h is the embedding). Returns this layer's (MLP output, residual)."""
        x, residual = self.input_layernorm(h, residual)
        x, residual = self.post_attention_layernorm(self.self_attn(x, positions, cos, sin),
                                                    residual)
        return self.mlp(x), residual


class Decoder(nn.Module):
    """Llama / Qwen2 / Qwen3 causal LM. Parameter names follow HF's minus the `model.` prefix,
    with q/k/v -> qkv_proj and gate/up -> gate_up_proj fused (see `PACKED_SHARDS`)."""

    # HF sub-module name -> (our fused module name, shard index in the fused output dim)
    PACKED_SHARDS = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        # this rank's vocabulary rows (all of them without tensor parallelism)
        self.embed_tokens = parallel.VocabParallelEmbedding(config)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, len(parallel.local_vocab(config)), bias=False)
        )
        self.lm_head_packed = PackedWeight()  # of whichever weight is the output projection
        self.rotary = RotaryEmbedding(config)

    def attention_layers(self) -> list[Attention]:
        """The attention modules in layer order, for the runner to bind `k_cache`/`v_cache`."""
        return [layer.self_attn for layer in self.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T] for a flat batch of tokens -> final hidden states [T, H]."""
        h = self.embed_tokens(input_ids)
        cos, sin = self.rotary.tables(h.device, h.dtype)
        residual = None
        for layer in self.layers:
            h, residual = layer(h, residual, positions, cos, sin)
        return self.norm(h, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, H] (usually one row per sequence) -> logits [S, vocab] in the model's
        dtype: the sampler upcasts only what it needs (a float32 copy of [256, 151936] bf16
        logits is 155 MB written and read back per step on the GPU)."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = self.lm_head_packed.linear(hidden, weight)
        if parallel.get_tp().size == 1:
            return logits
        # every rank's vocabulary rows, less the padding of the last
        return parallel.gather_last_dim(logits)[:, :self.config.vocab_size]

    def num_shards(self, param_name: str) -> int:
        """How many checkpoint tensors fill this parameter (3 for qkv, 2 for gate/up)."""
        module = param_name.split(".")[-2]
        return {"qkv_proj": 3, "gate_up_proj": 2}.get(module, 1)

    def shard_range(self, name: str) -> tuple[str, int, slice | None]:
        """Map an HF weight name (without `model.`) to (our parameter name, shard index, row
        slice of that shard in the fused output dim). Unfused names map to (name, 0, None)."""
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
