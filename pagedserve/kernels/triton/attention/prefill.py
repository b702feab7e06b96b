"""Triton paged prefill / chunked-prefill attention (flash-attention style tiling).

Each program owns BLOCK_M new tokens of one sequence and one query head. A sequence's new
tokens sit at the end of its context (prefix = seq_len - query_len is already cached), so
query i has absolute position prefix + i and sees keys 0..prefix + i. All keys, the cached
prefix and this step's tokens alike, are read through the block table after store_kv wrote
them. Key tiles entirely below the causal diagonal of the program's first row skip the mask.

With a sliding window (query p sees keys p - window < k <= p) a program starts at the tile
holding its first row's first key, reads nothing before it (those blocks may be freed), and
masks every tile; a row that sees no key of a tile yet keeps its running max finite. A score
cap maps each score s to softcap * tanh(s / softcap), as in decode. An FP8 cache is read as
in decode: rows cast to the query's dtype, the KV head's scales on the score scale and the
output.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl
from torch import Tensor

from pagedserve.kernels.triton.attention.decode import capped_scores, scale_args, score_args
from pagedserve.kernels.triton.precision import dot_precision


@triton.jit
def _key_tile(k_ptr, v_ptr, bt_row_ptr, kv_head, tile, first_key, seq_len, stride_kb,
              stride_kt, stride_kh, dtype: tl.constexpr, HEAD_DIM: tl.constexpr,
              BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """Keys and values of positions [tile, tile + BLOCK_N) in `dtype`; MASKED: only those
    in [first_key, seq_len) are read, the others are zeros."""
    offs_n = tile + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    if MASKED:
        n_mask = (offs_n < seq_len) & (offs_n >= first_key)
        block = tl.load(bt_row_ptr + offs_n // BLOCK_SIZE, mask=n_mask, other=0)
        row = (block.to(tl.int64) * stride_kb + (offs_n % BLOCK_SIZE) * stride_kt
               + kv_head * stride_kh)
        k = tl.load(k_ptr + row[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0)
        v = tl.load(v_ptr + row[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0)
    else:
        block = tl.load(bt_row_ptr + offs_n // BLOCK_SIZE)
        row = (block.to(tl.int64) * stride_kb + (offs_n % BLOCK_SIZE) * stride_kt
               + kv_head * stride_kh)
        k = tl.load(k_ptr + row[:, None] + offs_d[None, :])
        v = tl.load(v_ptr + row[:, None] + offs_d[None, :])
    return offs_n, k.to(dtype), v.to(dtype)


# first_seq (the step's number of decodes) changes every step: no variant per value class
@triton.jit(do_not_specialize=["first_seq"])
def _prefill_kernel(q_ptr, k_ptr, v_ptr, out_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, k_scale_ptr,
                    v_scale_ptr, qk_scale,
                    cap_scale, window, first_seq, stride_qt, stride_qh, stride_ot, stride_oh,
                    stride_kb, stride_kt, stride_kh, stride_bts,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WINDOWED: tl.constexpr,
                    SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
                    FP8_KV: tl.constexpr):
    m_block = tl.program_id(0)
    seq = first_seq + tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    if m_block * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - q_len
    kv_head = head // GROUP
    if FP8_KV:
        qk_scale = qk_scale * tl.load(k_scale_ptr + kv_head)
    bt_row_ptr = bt_ptr + seq * stride_bts
    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    m_valid = offs_m < q_len
    q = tl.load(q_ptr + (q_start + offs_m)[:, None] * stride_qt + head * stride_qh
                + offs_d[None, :], mask=m_valid[:, None], other=0.0)
    q_pos = prefix + offs_m

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    causal_end = tl.minimum(seq_len, prefix + (m_block + 1) * BLOCK_M)
    # keys every row of this block sees: 0..prefix + m_block * BLOCK_M (none with a window)
    unmasked_end = 0
    masked_start = 0
    first_key = 0
    if WINDOWED:
        first_key = tl.maximum(prefix + m_block * BLOCK_M - window + 1, 0)
        masked_start = first_key // BLOCK_N * BLOCK_N
    else:
        unmasked_end = (prefix + m_block * BLOCK_M + 1) // BLOCK_N * BLOCK_N
        masked_start = unmasked_end
    for tile in range(0, unmasked_end, BLOCK_N):
        offs_n, k, v = _key_tile(k_ptr, v_ptr, bt_row_ptr, kv_head, tile, first_key, seq_len,
                                 stride_kb, stride_kt, stride_kh, q.dtype,
                                 HEAD_DIM, BLOCK_SIZE, BLOCK_N, False)
        s = capped_scores(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION), qk_scale,
                          cap_scale, SOFTCAP)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    for tile in range(masked_start, causal_end, BLOCK_N):
        offs_n, k, v = _key_tile(k_ptr, v_ptr, bt_row_ptr, kv_head, tile, first_key, seq_len,
                                 stride_kb, stride_kt, stride_kh, q.dtype,
                                 HEAD_DIM, BLOCK_SIZE, BLOCK_N, True)
        s = capped_scores(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION), qk_scale,
                          cap_scale, SOFTCAP)
        visible = (offs_n[None, :] <= q_pos[:, None]) & (offs_n[None, :] < seq_len)
        if WINDOWED:
            visible = visible & (offs_n[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if WINDOWED:  # a row with no key yet: exp2(-inf - -inf) would be NaN
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    out = acc / l_i[:, None]
    if FP8_KV:
        out = out * tl.load(v_scale_ptr + kv_head)
    tl.store(out_ptr + (q_start + offs_m)[:, None] * stride_ot + head * stride_oh
             + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=m_valid[:, None])


@dataclass(frozen=True)
class PrefillConfig:
    """Launch parameters; defaults are the best of `benchmarks/kernels.py`'s sweep on the GPU
    the project benchmarks on (docs/benchmarks.md, "Paged attention kernels")."""

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3


def paged_prefill(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                  seq_lens: Tensor, query_start_loc: Tensor, first_seq: int, num_seqs: int,
                  max_query_len: int, scale: float, out: Tensor,
                  cfg: PrefillConfig = PrefillConfig(), window: int | None = None,
                  softcap: float | None = None,
                  kv_scales: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Attend sequences first_seq .. first_seq + num_seqs - 1; q/out are the whole step's
    [T, Hq, D], indexed by query_start_loc; an FP8 cache's kv_scales: (K, V) scales [Hkv]."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    _, block_size, num_kv_heads, _ = k_cache.shape
    grid = (triton.cdiv(max_query_len, cfg.block_m), num_seqs, num_heads)
    k_scale, v_scale, fp8 = scale_args(k_cache, v_cache, kv_scales)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc, k_scale, v_scale,
        *score_args(scale, softcap), window or 0, first_seq, q.stride(0), q.stride(1),
        out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, WINDOWED=window is not None,
        SOFTCAP=softcap is not None, DOT_PRECISION=dot_precision(q.dtype), FP8_KV=fp8,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return out
