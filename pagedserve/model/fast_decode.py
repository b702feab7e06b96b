"""Decode steps of a quantized GGUF model on the CPU in one native call (`kernels/native/
decode.py`).

Why: in the fast mode a decode step at batch 1 is memory-light (the model's 4-bit blocks),
so what is left is overhead: per layer about ten Python-level ops, each with its module call,
checks, torch allocation and OpenMP fork/join. `FastDecode` runs the whole stack of layers
as one call instead, the same kernels on the same values: its hidden states are bit for bit
those of the per-op fast mode (tests/model/test_fast_decode.py holds it to that).

One rule decides (`FastDecode.for_model` once, when the model loads; `__call__` per step, on
the step's shape): a model in the fast mode (every dense projection on its quantized blocks:
a GGUF's, or an integer checkpoint's converted in their column order, `model.int_native`)
of the plain pre-norm Llama shape (SiLU MLP, no MoE, no Gemma norms, score cap or embedding
scale, one RoPE table), without tensor parallelism, running on the CPU attention backend, in
a step where every sequence decodes one token and there are at most `MAX_BATCH` of them.
Anything else returns None and the decoder runs its layers as usual; `--dtype float32` (the
exact path) has no quantized blocks and never gets here.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

from pagedserve.attention.backend import get_forward_context
from pagedserve.kernels.native import attention as native_attention
from pagedserve.kernels.native import decode
from pagedserve.kernels.native import ops as native_ops
from pagedserve.kernels.native.decode import MAX_BATCH, MAX_PARTS, Layer, Model, QLinear, QPart
from pagedserve.model import parallel
from pagedserve.model.decoder import MLP, Decoder, DecoderLayer, Linear, RMSNorm, UnitOffsetRMSNorm
from pagedserve.model.packed import QuantizedMatmul


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _qlinear(linear: Linear) -> QLinear:
    quantized = linear.matmul.quantized
    parts = (QPart * MAX_PARTS)(*(
        QPart(0 if p.kind == "q4" else 1, p.shape[0], p.qs.data_ptr(), p.scales.data_ptr(),
              _ptr(p.mins)) for p in quantized.parts))
    return QLinear(len(quantized.parts), parts, _ptr(linear.bias))


def _eligible(model: Decoder) -> bool:
    """The model side of the rule (see the module docstring)."""
    config = model.config
    if (parallel.get_tp().size > 1 or config.num_experts or config.sandwich_norms
            or model.embed_scale is not None or config.attn_softcap is not None
            or config.hidden_act != "silu" or len(model.rotary) != 1
            or not decode.available() or not native_ops.available()):
        return False
    for layer in model.layers:
        attn = layer.self_attn
        norms = [layer.input_layernorm, layer.post_attention_layernorm, attn.q_norm, attn.k_norm]
        linears = [attn.qkv_proj, attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
        if (type(layer) is not DecoderLayer or not isinstance(layer.mlp, MLP)
                or any(isinstance(n, UnitOffsetRMSNorm) for n in norms)
                or not native_attention.supports(attn.num_heads, attn.num_kv_heads,
                                                 attn.head_dim)
                or any(type(lin.matmul) is not QuantizedMatmul  # (not a PermutedMatmul)
                       or len(lin.matmul.quantized.parts) > MAX_PARTS
                       or lin.weight is not None and lin.weight.device.type != "cpu"
                       for lin in linears)):
            return False
    return True


class FastDecode:
    """The step's layers as one call; built once per model, rebuilt on each new KV cache."""

    def __init__(self, model: Decoder) -> None:
        self.model = model
        config, first = model.config, model.layers[0].self_attn
        self._cos, self._sin = next(iter(model.rotary.values())).tables(
            torch.device("cpu"), torch.float32)
        self._attns = model.attention_layers()
        self._layers = (Layer * len(model.layers))()
        for spec, layer in zip(self._layers, model.layers):
            attn = layer.self_attn
            spec.input_norm = _ptr(layer.input_layernorm.weight)
            spec.post_norm = _ptr(layer.post_attention_layernorm.weight)
            spec.q_norm = _ptr(attn.q_norm.weight) if attn.q_norm is not None else None
            spec.k_norm = _ptr(attn.k_norm.weight) if attn.k_norm is not None else None
            spec.qkv, spec.o = _qlinear(attn.qkv_proj), _qlinear(attn.o_proj)
            spec.gate_up = _qlinear(layer.mlp.gate_up_proj)
            spec.down = _qlinear(layer.mlp.down_proj)
            spec.window = attn.window or 0
        final: RMSNorm = model.norm
        self._spec = Model(
            len(model.layers), config.hidden_size, first.num_heads, first.num_kv_heads,
            first.head_dim, model.layers[0].mlp.down_proj.in_features, 0, 0, self._cos.shape[0],
            final.eps, first.scale, self._cos.data_ptr(), self._sin.data_ptr(),
            final.weight.data_ptr(), self._layers)
        # (k, v) caches the specs point at, per layer
        self._caches: list[tuple[weakref.ref, weakref.ref]] = []
        self._scratch = torch.empty(0, dtype=torch.uint8)

    @classmethod
    def for_model(cls, model: Decoder) -> FastDecode | None:
        return cls(model) if _eligible(model) else None

    def _bind(self) -> bool:
        """Point the specs at the layers' current caches; False unless they are float32
        [num_blocks, block_size, Hkv, D] and contiguous (not an FP8 cache, say). The caches
        are held weakly: an engine's caches must go when the engine does."""
        attns = self._attns
        if len(self._caches) == len(attns) and all(
                k() is a.k_cache and v() is a.v_cache for a, (k, v) in zip(attns, self._caches)):
            return True
        self._caches = []
        for spec, attn in zip(self._layers, attns):
            k, v = attn.k_cache, attn.v_cache
            if (k.dtype != torch.float32 or v.dtype != k.dtype or not k.is_cpu or k.dim() != 4
                    or v.shape != k.shape or k.shape[:2] != attns[0].k_cache.shape[:2]
                    or k.shape[2:] != (attn.num_kv_heads, attn.head_dim)
                    or not (k.is_contiguous() and v.is_contiguous())):
                return False
            spec.k_cache, spec.v_cache = k.data_ptr(), v.data_ptr()
        self._spec.num_blocks, self._spec.block_size = attns[0].k_cache.shape[:2]
        self._caches = [(weakref.ref(a.k_cache), weakref.ref(a.v_cache)) for a in attns]
        return True

    def _workspace(self, count: int, threads: int) -> int:
        """The address of a scratch buffer for a step of `count` rows: kept across steps
        (a fresh one each step would be page-faulted in each step), grown when too small."""
        size = decode.workspace_bytes(self._spec, count, threads)
        if self._scratch.numel() < size:
            self._scratch = torch.empty(size, dtype=torch.uint8)
        return self._scratch.data_ptr()

    def __call__(self, input_ids: Tensor, positions: Tensor) -> Tensor | None:
        """The step's final hidden states [T, H] as `Decoder.forward` returns them, or None
        when the step is not one for this path."""
        ctx = get_forward_context()
        meta, count = ctx.meta, input_ids.shape[0]
        if (meta.num_decodes != count or meta.num_seqs != count or count > MAX_BATCH
                or ctx.backend.name != "cpu" or torch.is_grad_enabled() or not self._bind()):
            return None
        slots, tables, seq_lens = meta.slot_mapping, meta.block_tables, meta.seq_lens
        positions = positions.contiguous()
        if (positions.dtype != torch.int64 or slots.dtype != torch.int64
                or tables.dtype != torch.int32 or seq_lens.dtype != torch.int32
                or not (slots.is_contiguous() and seq_lens.is_contiguous())
                or tables.stride(-1) != 1):
            return None
        h = self.model.embed_tokens(input_ids)
        out = torch.empty_like(h)
        threads = torch.get_num_threads()
        status = decode.decode_step(self._spec, h.data_ptr(), out.data_ptr(), count,
                                    positions.data_ptr(), slots.data_ptr(), tables.data_ptr(),
                                    tables.stride(0), tables.shape[1], seq_lens.data_ptr(),
                                    self._workspace(count, threads), threads)
        if status == -2:
            raise IndexError(f"a position of {positions.tolist()} is outside the RoPE tables "
                             f"({self._cos.shape[0]} positions)")
        if status != 0:
            raise ValueError("fast decode: a slot, seq_len or block id is outside the cache "
                             "or its block table")
        return out
