"""Attention backend built on the Triton kernels (CUDA, or the CPU under TRITON_INTERPRET=1)."""

from __future__ import annotations

from functools import cache

import torch
from torch import Tensor

from pagedserve.attention.backend import AttentionBackend, QKRotation
from pagedserve.kernels.triton.attention import (DecodeConfig, PrefillConfig, copy_blocks,
                                                 longest_first, paged_decode, paged_prefill,
                                                 rotate_store_kv_, store_kv)
from pagedserve.attention.metadata import AttentionMetadata


@cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter runs programs one by one: nothing to fill
    return torch.cuda.get_device_properties(device).multi_processor_count


def _decode_order(meta: AttentionMetadata) -> Tensor | None:
    """The decodes longest first, sorted once per step for every layer (None for one); only
    when v1 runs (`paged_decode` asks)."""
    if meta.num_decodes < 2:
        return None
    order = meta.derived.get("decode_order")
    if order is None:
        order = meta.derived["decode_order"] = longest_first(meta.seq_lens[:meta.num_decodes])
    return order


class TritonBackend(AttentionBackend):
    """The K/V store, then the decode kernel on the leading decodes and the prefill kernel on
    the rest; copy_blocks is a Triton kernel, swap_blocks the base class's staged torch copy.
    A layer's fused QKV (`forward_qkv`) is rotated by the store itself (`rotate_store_kv_`):
    one launch a layer fewer than RoPE's kernel then the store's, every step. decode_cfg
    None: each cache dtype's own launch settings (`decode.default_config`)."""

    name = "triton"

    def __init__(self, decode_cfg: DecodeConfig | None = None,
                 prefill_cfg: PrefillConfig = PrefillConfig()):
        self.decode_cfg = decode_cfg
        self.prefill_cfg = prefill_cfg

    def forward(self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                meta: AttentionMetadata, scale: float, window: int | None = None,
                softcap: float | None = None,
                kv_scales: tuple[Tensor, Tensor] | None = None) -> Tensor:
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping, kv_scales)
        return self._attend(q, k_cache, v_cache, meta, scale, window, softcap, kv_scales)

    def forward_qkv(self, qkv: Tensor, num_kv_heads: int, rotation: QKRotation,
                    k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, scale: float,
                    window: int | None = None, softcap: float | None = None,
                    kv_scales: tuple[Tensor, Tensor] | None = None) -> Tensor:
        r = rotation
        rotate_store_kv_(qkv, num_kv_heads, r.positions, r.cos, r.sin, r.q_weight, r.k_weight,
                         r.eps, k_cache, v_cache, meta.slot_mapping, kv_scales)
        q = qkv[:, :qkv.shape[1] - 2 * num_kv_heads]
        return self._attend(q, k_cache, v_cache, meta, scale, window, softcap, kv_scales)

    def _attend(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata,
                scale: float, window: int | None, softcap: float | None,
                kv_scales: tuple[Tensor, Tensor] | None) -> Tensor:
        """The step's attention over the caches, this step's K/V already in them."""
        if q.stride(2) != 1:
            q = q.contiguous()
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        nd = meta.num_decodes
        num_seqs = meta.seq_lens.shape[0]
        if nd > 0:
            paged_decode(q[:nd], k_cache, v_cache, meta.block_tables, meta.seq_lens,
                         meta.max_seq_len, scale, out[:nd], _num_sms(q.device),
                         self.decode_cfg, window, softcap, kv_scales,
                         lambda: _decode_order(meta))
        if num_seqs > nd:
            paged_prefill(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                          meta.query_start_loc, nd, num_seqs - nd, meta.max_query_len, scale,
                          out, self.prefill_cfg, window, softcap, kv_scales)
        return out

    def copy_blocks(self, kv_caches: list[tuple[Tensor, Tensor]], src_dst: Tensor) -> None:
        copy_blocks(kv_caches, src_dst)
