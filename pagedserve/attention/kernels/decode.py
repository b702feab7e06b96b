"""Triton paged decode attention: one query token per sequence, KV read via block tables.

v1 runs one program per (sequence, KV head); the program holds every query head of the GQA
group as rows of one tile, so each KV block is read from memory once for the whole group,
and keeps a running max and sum (online softmax) so scores are never materialized.

v2 also splits each sequence's context into partitions handled by separate programs, which
write a partial (max, sum-exp, unnormalized output) per query head; a reduce kernel merges them
by rescaling with exp(max_p - max). It wins when (sequences x KV heads) is too small to fill
the GPU's SMs: long contexts at small batch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from torch import Tensor

LOG2E = 1.4426950408889634


@triton.jit
def _attend_range(q, k_ptr, v_ptr, bt_row_ptr, kv_head, start, end, qk_scale,
                  stride_kb, stride_kt, stride_kh,
                  GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Online-softmax attention of q [GROUP_PAD, D] over context positions [start, end).

    Returns (max, sum-exp, unnormalized output) in the log2 domain.
    """
    offs_d = tl.arange(0, HEAD_DIM)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for tile in range(start, end, BLOCK_N):
        offs_n = tile + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        block = tl.load(bt_row_ptr + offs_n // BLOCK_SIZE, mask=n_mask, other=0)
        row = (block.to(tl.int64) * stride_kb + (offs_n % BLOCK_SIZE) * stride_kt
               + kv_head * stride_kh)
        k = tl.load(k_ptr + row[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + row[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _load_group_q(q_ptr, seq, kv_head, stride_qs, stride_qh,
                  GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr):
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + offs_g
    q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + offs_d[None, :],
                mask=(offs_g < GROUP)[:, None], other=0.0)
    return q, heads, offs_g < GROUP


@triton.jit
def _decode_v1_kernel(q_ptr, k_ptr, v_ptr, out_ptr, bt_ptr, seq_lens_ptr, qk_scale,
                      stride_qs, stride_qh, stride_os, stride_oh,
                      stride_kb, stride_kt, stride_kh, stride_bts,
                      GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                      BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    q, heads, g_mask = _load_group_q(q_ptr, seq, kv_head, stride_qs, stride_qh,
                                     GROUP, GROUP_PAD, HEAD_DIM)
    m_i, l_i, acc = _attend_range(q, k_ptr, v_ptr, bt_ptr + seq * stride_bts, kv_head, 0,
                                  seq_len, qk_scale, stride_kb, stride_kt, stride_kh,
                                  GROUP_PAD, HEAD_DIM, BLOCK_SIZE, BLOCK_N)
    out = acc / l_i[:, None]
    offs_d = tl.arange(0, HEAD_DIM)
    tl.store(out_ptr + seq * stride_os + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])


@triton.jit
def _decode_v2_kernel(q_ptr, k_ptr, v_ptr, max_ptr, sum_ptr, part_ptr, bt_ptr, seq_lens_ptr,
                      qk_scale, stride_qs, stride_qh, stride_kb, stride_kt, stride_kh,
                      stride_bts, max_parts, NUM_HEADS: tl.constexpr,
                      PARTITION: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                      HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = part * PARTITION
    if start >= seq_len:
        return
    end = tl.minimum(start + PARTITION, seq_len)
    q, heads, g_mask = _load_group_q(q_ptr, seq, kv_head, stride_qs, stride_qh,
                                     GROUP, GROUP_PAD, HEAD_DIM)
    m_i, l_i, acc = _attend_range(q, k_ptr, v_ptr, bt_ptr + seq * stride_bts, kv_head, start,
                                  end, qk_scale, stride_kb, stride_kt, stride_kh,
                                  GROUP_PAD, HEAD_DIM, BLOCK_SIZE, BLOCK_N)
    # partial buffers are [S, Hq, max_parts] and [S, Hq, max_parts, D]
    idx = (seq * NUM_HEADS + heads) * max_parts + part
    tl.store(max_ptr + idx, m_i, mask=g_mask)
    tl.store(sum_ptr + idx, l_i, mask=g_mask)
    offs_d = tl.arange(0, HEAD_DIM)
    tl.store(part_ptr + idx[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=g_mask[:, None])


@triton.jit
def _decode_reduce_kernel(max_ptr, sum_ptr, part_ptr, out_ptr, seq_lens_ptr,
                          stride_os, stride_oh, max_parts, NUM_HEADS: tl.constexpr,
                          PARTS_PAD: tl.constexpr,
                          PARTITION: tl.constexpr, CHUNK: tl.constexpr,
                          HEAD_DIM: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    num_parts = tl.cdiv(seq_len, PARTITION)
    base = (seq * NUM_HEADS + head) * max_parts
    offs_p = tl.arange(0, PARTS_PAD)
    m_all = tl.load(max_ptr + base + offs_p, mask=offs_p < num_parts, other=float("-inf"))
    m_max = tl.max(m_all, 0)
    offs_d = tl.arange(0, HEAD_DIM)
    total = 0.0
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for p0 in range(0, num_parts, CHUNK):
        offs_c = p0 + tl.arange(0, CHUNK)
        c_mask = offs_c < num_parts
        m = tl.load(max_ptr + base + offs_c, mask=c_mask, other=float("-inf"))
        l = tl.load(sum_ptr + base + offs_c, mask=c_mask, other=0.0)
        w = tl.where(c_mask, tl.exp2(m - m_max), 0.0)
        total += tl.sum(w * l, 0)
        part = tl.load(part_ptr + (base + offs_c)[:, None] * HEAD_DIM + offs_d[None, :],
                       mask=c_mask[:, None], other=0.0)
        acc += tl.sum(w[:, None] * part, 0)
    tl.store(out_ptr + seq * stride_os + head * stride_oh + offs_d,
             (acc / total).to(out_ptr.dtype.element_ty))


@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters; defaults are the H100 choice from benchmarks/kernels.py."""

    block_n: int = 64  # context positions per inner tile
    partition: int = 512  # v2 called directly; `paged_decode` picks one per batch instead
    num_warps: int = 4
    num_stages: int = 3


def _group_pad(group: int) -> int:
    return max(16, triton.next_power_of_2(group))  # tl.dot needs >= 16 rows


def paged_decode_v1(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                    seq_lens: Tensor, scale: float, out: Tensor,
                    cfg: DecodeConfig = DecodeConfig()) -> Tensor:
    """q/out [S, Hq, D]; caches [num_blocks, block_size, Hkv, D]."""
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    _decode_v1_kernel[(num_seqs, num_kv_heads)](
        q, k_cache, v_cache, out, block_tables, seq_lens, scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=group, GROUP_PAD=_group_pad(group), HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_N=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


def paged_decode_v2(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                    seq_lens: Tensor, max_seq_len: int, scale: float, out: Tensor,
                    cfg: DecodeConfig = DecodeConfig()) -> Tensor:
    """Like v1, split over partitions of cfg.partition positions; max_seq_len sizes the grid."""
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    assert cfg.partition % cfg.block_n == 0, "partition must be a multiple of block_n"
    max_parts = triton.cdiv(max_seq_len, cfg.partition)
    stats = torch.empty(2, num_seqs, num_heads, max_parts, dtype=torch.float32,
                        device=q.device)
    parts = torch.empty(num_seqs, num_heads, max_parts, head_dim, dtype=torch.float32,
                        device=q.device)
    _decode_v2_kernel[(num_seqs, num_kv_heads, max_parts)](
        q, k_cache, v_cache, stats[0], stats[1], parts, block_tables, seq_lens, scale * LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), max_parts, NUM_HEADS=num_heads,
        PARTITION=cfg.partition, GROUP=group, GROUP_PAD=_group_pad(group), HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    parts_pad = triton.next_power_of_2(max_parts)
    _decode_reduce_kernel[(num_seqs, num_heads)](
        stats[0], stats[1], parts, out, seq_lens, out.stride(0), out.stride(1), max_parts,
        NUM_HEADS=num_heads, PARTS_PAD=parts_pad,
        PARTITION=cfg.partition, CHUNK=min(parts_pad, 16), HEAD_DIM=head_dim, num_warps=4)
    return out


PARTITIONS = (1024, 512, 256)  # multiples of block_n


def use_v2(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> bool:
    """Split over partitions when v1's (sequence, KV head) programs make less than two waves
    on the SMs and there are at least two partitions to split into. Measured on the H100
    (docs/benchmarks.md): v2 wins by up to 13x at batch 1, ties at ~2 waves, and loses
    1-3% (the reduce pass, the partials' traffic) beyond."""
    return num_seqs * num_kv_heads < 2 * num_sms and max_seq_len > 2 * PARTITIONS[-1]


def choose_partition(num_seqs: int, num_kv_heads: int, max_seq_len: int,
                     num_sms: int) -> int:
    """The largest partition that still yields two programs per SM: fewer partitions mean
    less partial-result traffic, but each SM needs a couple of programs to hide latency."""
    for partition in PARTITIONS:
        if num_seqs * num_kv_heads * triton.cdiv(max_seq_len, partition) >= 2 * num_sms:
            return partition
    return PARTITIONS[-1]


def paged_decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                 seq_lens: Tensor, max_seq_len: int, scale: float, out: Tensor, num_sms: int,
                 cfg: DecodeConfig = DecodeConfig()) -> Tensor:
    """v1 or v2 (with a partition sized to the batch), by `use_v2`."""
    num_seqs, num_kv_heads = q.shape[0], k_cache.shape[2]
    if use_v2(num_seqs, num_kv_heads, max_seq_len, num_sms):
        partition = choose_partition(num_seqs, num_kv_heads, max_seq_len, num_sms)
        return paged_decode_v2(q, k_cache, v_cache, block_tables, seq_lens, max_seq_len,
                               scale, out, replace(cfg, partition=partition))
    return paged_decode_v1(q, k_cache, v_cache, block_tables, seq_lens, scale, out, cfg)
