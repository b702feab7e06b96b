"""Triton paged decode attention: one query token per sequence, KV read via block tables.

v1 runs one program per (sequence, KV head); the program holds every query head of the GQA
group as rows of one tile, so each KV block is read from memory once for the whole group,
and keeps a running max and sum (online softmax) so scores are never materialized.

v2 also splits each sequence's context into partitions handled by separate programs, which
write a partial (max, sum-exp, unnormalized output) per query head; the partials are merged by
rescaling with exp(max_p - max). It wins when (sequences x KV heads) is too small to fill the
GPU's SMs: long contexts at small batch. The merge runs in the same launch: each program
bumps an arrival counter for its (sequence, KV head) and the last to arrive merges, so no
second launch waits for the whole grid to drain (docs/benchmarks.md, "Paged attention
kernels", (1, 32768)). A
partition's program knows where its context starts without the sequence length, so it loads
its first block ids together with that length rather than after it. A sequence shorter than
the grid's partitions cover (under CUDA graphs the grid is sized for max_model_len) spreads
over all of them in smaller partitions (`DecodeConfig.split_short`).

A sliding window (a layer's `window`, None for global attention) starts the context at
seq_len - window: v1 starts its loop there, v2 lays its partitions from there (fewer of them),
and no block before it is read, so the block manager may have freed those. A score cap
(Gemma 2) maps each score s to softcap * tanh(s / softcap) before the softmax.

An FP8 cache (`FP8_KV`) is read as e4m3 and cast to the query's dtype in registers; its KV
head's K scale multiplies the score scale and its V scale the output (`kv_quant`), so no
element is multiplied.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from torch import Tensor

from pagedserve.kernels.fp8_format import is_fp8
from pagedserve.kernels.triton import pdl
from pagedserve.kernels.triton.arrivals import arrival_counters
from pagedserve.kernels.triton.e4m3 import e4m3_to
from pagedserve.kernels.triton.precision import dot_precision

LOG2E = 1.4426950408889634


@triton.jit
def capped_scores(s, qk_scale, cap_scale, SOFTCAP: tl.constexpr):
    """Raw q.k scores -> log2-domain scores: s * scale * log2(e), or with a cap
    softcap * tanh(s * scale / softcap) * log2(e), where the caller passes qk_scale =
    scale / softcap and cap_scale = softcap * log2(e) (tanh(x) = 2 sigmoid(2x) - 1)."""
    s = s * qk_scale
    if SOFTCAP:
        s = (2.0 * tl.sigmoid(2.0 * s) - 1.0) * cap_scale
    return s


@triton.jit
def _attend_tile(q, k_ptr, v_ptr, row, n_mask, m_i, l_i, acc, qk_scale, cap_scale,
                 HEAD_DIM: tl.constexpr, SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 K_BITS: tl.constexpr, V_BITS: tl.constexpr):
    """One online-softmax step of q over the K/V rows at offsets `row` (masked by n_mask);
    an e4m3 cache's K (V) rows read by `e4m3.e4m3_bits` where K_BITS (V_BITS), V's as
    loaded, else cast."""
    offs_d = tl.arange(0, HEAD_DIM)
    k = e4m3_to(tl.load(k_ptr + row[:, None] + offs_d[None, :], mask=n_mask[:, None],
                        other=0.0), q.dtype, K_BITS)
    s = capped_scores(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION), qk_scale,
                      cap_scale, SOFTCAP)
    s = tl.where(n_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = e4m3_to(tl.load(v_ptr + row[:, None] + offs_d[None, :], mask=n_mask[:, None],
                        other=0.0), q.dtype, V_BITS, True)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _attend_range(q, k_ptr, v_ptr, bt_row_ptr, kv_head, start, end, qk_scale, cap_scale,
                  stride_kb, stride_kt, stride_kh,
                  GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr,
                  DOT_PRECISION: tl.constexpr, K_BITS: tl.constexpr,
                  V_BITS: tl.constexpr):
    """Online-softmax attention of q [GROUP_PAD, D] over context positions [start, end).

    Returns (max, sum-exp, unnormalized output) in the log2 domain.
    """
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for tile in range(start, end, BLOCK_N):
        offs_n = tile + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        block = tl.load(bt_row_ptr + offs_n // BLOCK_SIZE, mask=n_mask, other=0)
        row = (block.to(tl.int64) * stride_kb + (offs_n % BLOCK_SIZE) * stride_kt
               + kv_head * stride_kh)
        m_i, l_i, acc = _attend_tile(q, k_ptr, v_ptr, row, n_mask, m_i, l_i, acc, qk_scale,
                                     cap_scale, HEAD_DIM, SOFTCAP, DOT_PRECISION,
                                     K_BITS, V_BITS)
    return m_i, l_i, acc


@triton.jit
def _load_tile_blocks(bt_row_ptr, tile, row_blocks, BLOCK_SIZE: tl.constexpr,
                      BLOCK_N: tl.constexpr):
    """Block ids of context positions [tile, tile + BLOCK_N), bounded by the row's end only:
    past the sequence they are the null block 0 (or stale ids), which the caller masks out."""
    idx = (tile + tl.arange(0, BLOCK_N)) // BLOCK_SIZE
    return tl.load(bt_row_ptr + idx, mask=idx < row_blocks, other=0)


@triton.jit
def _attend_partition(q, k_ptr, v_ptr, bt_row_ptr, block, kv_head, start, end, qk_scale,
                      cap_scale, row_blocks, stride_kb, stride_kt, stride_kh,
                      GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                      BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr,
                      DOT_PRECISION: tl.constexpr, K_BITS: tl.constexpr,
                  V_BITS: tl.constexpr):
    """`_attend_range` with the first tile's block ids given (`block`, loaded before the
    sequence length was known) and each next tile's loaded one iteration ahead."""
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for tile in range(start, end, BLOCK_N):
        offs_n = tile + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        row = (block.to(tl.int64) * stride_kb + (offs_n % BLOCK_SIZE) * stride_kt
               + kv_head * stride_kh)
        block = _load_tile_blocks(bt_row_ptr, tile + BLOCK_N, row_blocks, BLOCK_SIZE, BLOCK_N)
        m_i, l_i, acc = _attend_tile(q, k_ptr, v_ptr, row, n_mask, m_i, l_i, acc, qk_scale,
                                     cap_scale, HEAD_DIM, SOFTCAP, DOT_PRECISION,
                                     K_BITS, V_BITS)
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
def _dot_operand(q, F16_DOT: tl.constexpr):
    """q as the dot products take it: with F16_DOT in float16 (clamped to its range), so an
    e4m3 cache's rows cast to float16 (every e4m3 value exactly, in one conversion) rather
    than bfloat16."""
    if F16_DOT:
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    return q


@triton.jit
def _decode_v1_kernel(q_ptr, k_ptr, v_ptr, out_ptr, bt_ptr, seq_lens_ptr, order_ptr,
                      k_scale_ptr, v_scale_ptr, qk_scale, cap_scale,
                      window, stride_qs, stride_qh, stride_os, stride_oh,
                      stride_kb, stride_kt, stride_kh, stride_bts,
                      GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                      BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                      WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr,
                      DOT_PRECISION: tl.constexpr, FP8_KV: tl.constexpr,
                      F16_DOT: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr,
                      ORDERED: tl.constexpr):
    pdl.step_entry()
    if ORDERED:  # grid (KV heads, sequences): the i-th longest sequence's heads go i-th
        kv_head = tl.program_id(0)
        seq = tl.load(order_ptr + tl.program_id(1)).to(tl.int32)
    else:
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
    if FP8_KV:
        qk_scale = qk_scale * tl.load(k_scale_ptr + kv_head)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = 0
    if WINDOWED:
        start = tl.maximum(seq_len - window, 0)
    q, heads, g_mask = _load_group_q(q_ptr, seq, kv_head, stride_qs, stride_qh,
                                     GROUP, GROUP_PAD, HEAD_DIM)
    q = _dot_operand(q, F16_DOT)
    m_i, l_i, acc = _attend_range(q, k_ptr, v_ptr, bt_ptr + seq * stride_bts, kv_head, start,
                                  seq_len, qk_scale, cap_scale, stride_kb, stride_kt,
                                  stride_kh, GROUP_PAD, HEAD_DIM, BLOCK_SIZE, BLOCK_N, SOFTCAP,
                                  DOT_PRECISION, K_BITS, V_BITS)
    out = acc / l_i[:, None]
    if FP8_KV:
        out = out * tl.load(v_scale_ptr + kv_head)
    offs_d = tl.arange(0, HEAD_DIM)
    tl.store(out_ptr + seq * stride_os + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])


@triton.jit
def _merge_partitions(max_ptr, sum_ptr, part_ptr, out_ptr, seq, kv_head, num_parts, max_parts,
                      stride_os, stride_oh, NUM_HEADS: tl.constexpr, GROUP: tl.constexpr,
                      GROUP_P2: tl.constexpr, CHUNK: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Merge a GQA group's per-partition partials into the output, rescaling each by
    exp2(max_p - running max). The partials were written by other programs of this launch, so
    they are read from L2 (.cg): this SM's L1 may hold nothing valid for them.

    v2 launches without FP contraction (`enable_fp_fusion=False`) because of the sums here:
    Triton reduces `w * l` across lanes by butterfly shuffles, and with contraction each lane
    fused its own product into the first add (fma(w_i, l_i, round(w_j * l_j))), so lanes of
    one row held sums differing in the last bit, and all of them stored to one shared word
    for the broadcast: the last writer won, a data race (compute-sanitizer racecheck: WAW
    hazards at the `total` line) and a merge that was not bitwise repeatable."""
    offs_g = tl.arange(0, GROUP_P2)
    offs_c = tl.arange(0, CHUNK)
    offs_d = tl.arange(0, HEAD_DIM)
    g_mask = offs_g < GROUP
    heads = kv_head * GROUP + offs_g
    base = (seq * NUM_HEADS + heads) * max_parts  # [G]
    m_run = tl.full([GROUP_P2], float("-inf"), tl.float32)
    total = tl.zeros([GROUP_P2], tl.float32)
    acc = tl.zeros([GROUP_P2, HEAD_DIM], tl.float32)
    for p0 in range(0, num_parts, CHUNK):
        idx = base[:, None] + p0 + offs_c[None, :]  # [G, C]
        mask = g_mask[:, None] & (p0 + offs_c < num_parts)[None, :]
        m = tl.load(max_ptr + idx, mask=mask, other=float("-inf"), cache_modifier=".cg")
        l = tl.load(sum_ptr + idx, mask=mask, other=0.0, cache_modifier=".cg")
        part = tl.load(part_ptr + idx[:, :, None] * HEAD_DIM + offs_d[None, None, :],
                       mask=mask[:, :, None], other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m_run, tl.max(m, 1))
        m_new = tl.where(g_mask, m_new, 0.0)  # padded heads: keep exp2 finite
        alpha = tl.exp2(m_run - m_new)
        w = tl.exp2(m - m_new[:, None])
        total = total * alpha + tl.sum(w * l, 1)
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * part, 1)
        m_run = m_new
    out = acc / tl.where(g_mask, total, 1.0)[:, None]
    tl.store(out_ptr + seq * stride_os + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])


@triton.jit(do_not_specialize=["row_blocks"])  # the block table's width may vary by step
def _decode_v2_kernel(q_ptr, k_ptr, v_ptr, out_ptr, max_ptr, sum_ptr, part_ptr, arrivals_ptr,
                      bt_ptr, seq_lens_ptr, k_scale_ptr, v_scale_ptr, qk_scale, cap_scale,
                      window, partition, max_parts,
                      row_blocks, stride_qs, stride_qh, stride_os, stride_oh,
                      stride_kb, stride_kt, stride_kh, stride_bts,
                      NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                      GROUP_P2: tl.constexpr, MERGE_CHUNK: tl.constexpr,
                      HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                      WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr,
                      DOT_PRECISION: tl.constexpr, FP8_KV: tl.constexpr,
                      F16_DOT: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr,
                      SPLIT_SHORT: tl.constexpr):
    pdl.step_entry()
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    bt_row_ptr = bt_ptr + seq * stride_bts
    # The sequence length, q and the first tile's block ids do not depend on one another:
    # loaded together, the first K/V loads wait one round trip to memory, not two (the gain:
    # docs/benchmarks.md, "Paged attention kernels", (1, 32768)). A window's partitions
    # start from the window's first token, which needs the length first.
    seq_len = tl.load(seq_lens_ptr + seq)
    first = 0
    if WINDOWED:
        first = tl.maximum(seq_len - window, 0)
    start = first + part * partition
    q, heads, g_mask = _load_group_q(q_ptr, seq, kv_head, stride_qs, stride_qh,
                                     GROUP, GROUP_PAD, HEAD_DIM)
    block = _load_tile_blocks(bt_row_ptr, start, row_blocks, BLOCK_SIZE, BLOCK_N)
    if SPLIT_SHORT:  # this sequence's partitions: its length over all max_parts programs
        short = tl.maximum(tl.cdiv(tl.cdiv(seq_len - first, max_parts), BLOCK_N) * BLOCK_N,
                           BLOCK_N)
        if short < partition:  # (else the block ids loaded with the length stand)
            partition = short
            start = first + part * partition
            block = _load_tile_blocks(bt_row_ptr, start, row_blocks, BLOCK_SIZE, BLOCK_N)
    if start >= seq_len:
        return
    end = tl.minimum(start + partition, seq_len)
    if FP8_KV:
        qk_scale = qk_scale * tl.load(k_scale_ptr + kv_head)
    q = _dot_operand(q, F16_DOT)
    m_i, l_i, acc = _attend_partition(q, k_ptr, v_ptr, bt_row_ptr, block, kv_head, start, end,
                                      qk_scale, cap_scale, row_blocks, stride_kb, stride_kt,
                                      stride_kh, GROUP_PAD, HEAD_DIM, BLOCK_SIZE, BLOCK_N,
                                      SOFTCAP, DOT_PRECISION, K_BITS, V_BITS)
    if FP8_KV:  # the partials' merge is linear in acc: scale it once here
        acc = acc * tl.load(v_scale_ptr + kv_head)
    offs_d = tl.arange(0, HEAD_DIM)
    num_parts = tl.cdiv(seq_len - first, partition)
    if num_parts == 1:  # a short sequence of the batch: nothing to merge
        tl.store(out_ptr + seq * stride_os + heads[:, None] * stride_oh + offs_d[None, :],
                 (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
    else:
        # partial buffers are [S, Hq, max_parts] and [S, Hq, max_parts, D]
        idx = (seq * NUM_HEADS + heads) * max_parts + part
        tl.store(max_ptr + idx, m_i, mask=g_mask)
        tl.store(sum_ptr + idx, l_i, mask=g_mask)
        tl.store(part_ptr + idx[:, None] * HEAD_DIM + offs_d[None, :], acc,
                 mask=g_mask[:, None])
        # Every thread's partial stores happen before the barrier, the barrier before the
        # counter's release: the program that sees the last arrival sees every partial.
        tl.debug_barrier()
        counter = arrivals_ptr + seq * tl.num_programs(1) + kv_head
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived == num_parts - 1:
            _merge_partitions(max_ptr, sum_ptr, part_ptr, out_ptr, seq, kv_head, num_parts,
                              max_parts, stride_os, stride_oh, NUM_HEADS, GROUP, GROUP_P2,
                              MERGE_CHUNK, HEAD_DIM)
            tl.store(counter, 0)  # zero again for the next launch (CUDA-graph replays)


@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters; defaults are the best for a bf16 cache in `benchmarks/kernels.py`'s
    sweep on the GPU the project benchmarks on (`FP8_DECODE` for an FP8 one; docs/benchmarks.md,
    "Paged attention kernels")."""

    block_n: int = 64  # context positions per inner tile
    partition: int = 512  # v2 called directly; `paged_decode` picks one per batch instead
    num_warps: int = 4
    num_stages: int = 3  # as v1 counts them: K/V single-buffered up to 4, double from 5
    # what `paged_decode` chooses v2's partition from, largest first (multiples of block_n)
    partitions: tuple[int, ...] = (1024, 512, 256)
    small_grid_block_n: int = 32  # v2's tile where the grid underfills the SMs
    # an FP8 cache only: dot products in float16, not the query's dtype (see _dot_operand)
    fp16_dot: bool = False
    # an FP8 cache only: K's (V's) rows read by bit moves (`e4m3.e4m3_bits`: integer and
    # half-precision ops, not the conversion unit); V's as loaded (16 bytes a thread, then
    # to the dot through shared memory as bf16 rows go) rather than gathered byte by byte
    bits_k: bool = False
    bits_v: bool = False
    # v2: a sequence shorter than the grid's partitions cover is spread over all of them
    # (partitions of its length / max_parts, in whole tiles), not over the first few.
    # Why: under CUDA graphs the grid is sized for max_model_len, so at batch 1 a 256-token
    # context sat in one program looping over 8 tiles, a latency chain per layer.
    split_short: bool = True


# An FP8 cache holds a token's K/V in half the bytes: with bf16's tiles each program would
# keep half the bytes in flight per step and sit on memory latency (a far smaller share of the
# copy bandwidth than bf16 reaches). So its tiles, v2 partitions and small-grid tiles hold
# twice the tokens: the same bytes as bf16's. V read by bit moves and float16 dot products,
# 64-token double-buffered tiles: the fastest at every shape of `benchmarks/fp8.py --parts
# kernel --sweep` (docs/benchmarks.md, "FP8 KV cache and FP8 weights", the decode sweep).
FP8_DECODE = DecodeConfig(block_n=64, num_stages=5, partitions=(2048, 1024, 512),
                          small_grid_block_n=64, bits_v=True, fp16_dot=True)


def _f16_dot(fp8: bool, cfg: DecodeConfig, q: Tensor) -> bool:
    """float16 dot products only for a 16-bit query: they are at least its precision
    there, but would round a float32 query's."""
    return fp8 and cfg.fp16_dot and q.element_size() == 2


BF16_DECODE = DecodeConfig()  # (and float16, float32 caches)


def default_config(k_cache: Tensor) -> DecodeConfig:
    """The launch parameters for a cache of this dtype."""
    return FP8_DECODE if is_fp8(k_cache) else BF16_DECODE


def _group_pad(group: int) -> int:
    return max(16, triton.next_power_of_2(group))  # tl.dot needs >= 16 rows


def score_args(scale: float, softcap: float | None) -> tuple[float, float]:
    """(qk_scale, cap_scale) as `capped_scores` takes them."""
    if softcap is None:
        return scale * LOG2E, 1.0
    return scale / softcap, softcap * LOG2E


def attended_len(max_seq_len: int, window: int | None) -> int:
    """The longest context a decode attends to: its window at most."""
    return max_seq_len if window is None else min(max_seq_len, window)


def scale_args(k_cache: Tensor, v_cache: Tensor,
               kv_scales: tuple[Tensor, Tensor] | None) -> tuple[Tensor, Tensor, bool]:
    """(K scale, V scale, FP8_KV) as the kernels take them; without FP8 the scale pointers
    are never read (the caches stand in)."""
    if not is_fp8(k_cache):
        return k_cache, v_cache, False
    assert kv_scales is not None, "an FP8 KV cache needs its scales"
    return *kv_scales, True


def paged_decode_v1(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                    seq_lens: Tensor, scale: float, out: Tensor,
                    cfg: DecodeConfig = DecodeConfig(), window: int | None = None,
                    softcap: float | None = None,
                    kv_scales: tuple[Tensor, Tensor] | None = None,
                    order: Tensor | None = None) -> Tensor:
    """q/out [S, Hq, D]; caches [num_blocks, block_size, Hkv, D]; an FP8 cache's
    kv_scales: (K, V) scales [Hkv]. `order` (`longest_first`): the sequences in the order
    their programs are dispatched.

    Why an order: v1 runs one program per (sequence, KV head) to the end of its context, so
    with ragged lengths the step ends with the programs of whichever long sequences happened
    to be dispatched last, on a few SMs. Longest first, the short ones fill in behind them."""
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    k_scale, v_scale, fp8 = scale_args(k_cache, v_cache, kv_scales)
    grid = (num_seqs, num_kv_heads) if order is None else (num_kv_heads, num_seqs)
    _decode_v1_kernel[grid](
        q, k_cache, v_cache, out, block_tables, seq_lens,
        seq_lens if order is None else order, k_scale, v_scale,
        *score_args(scale, softcap),
        window or 0, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=group, GROUP_PAD=_group_pad(group), HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_N=cfg.block_n, WINDOWED=window is not None, SOFTCAP=softcap is not None,
        DOT_PRECISION=dot_precision(q.dtype), FP8_KV=fp8, F16_DOT=_f16_dot(fp8, cfg, q),
        K_BITS=fp8 and cfg.bits_k, V_BITS=fp8 and cfg.bits_v, ORDERED=order is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.launch_options())
    return out


def paged_decode_v2(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                    seq_lens: Tensor, max_seq_len: int, scale: float, out: Tensor,
                    cfg: DecodeConfig = DecodeConfig(), window: int | None = None,
                    softcap: float | None = None,
                    kv_scales: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Like v1, split over partitions of cfg.partition positions; max_seq_len (or the window)
    sizes the grid.

    One launch: the last partition of each (sequence, KV head) to finish merges the partials.
    Launches on one device must be stream-ordered (they share the arrival counters)."""
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    assert cfg.partition % cfg.block_n == 0, "partition must be a multiple of block_n"
    max_parts = triton.cdiv(attended_len(max_seq_len, window), cfg.partition)
    stats = torch.empty(2, num_seqs, num_heads, max_parts, dtype=torch.float32,
                        device=q.device)
    parts = torch.empty(num_seqs, num_heads, max_parts, head_dim, dtype=torch.float32,
                        device=q.device)
    group_p2 = triton.next_power_of_2(group)
    k_scale, v_scale, fp8 = scale_args(k_cache, v_cache, kv_scales)
    _decode_v2_kernel[(num_seqs, num_kv_heads, max_parts)](
        q, k_cache, v_cache, out, stats[0], stats[1], parts,
        arrival_counters(num_seqs * num_kv_heads, q.device), block_tables, seq_lens,
        k_scale, v_scale,
        *score_args(scale, softcap), window or 0, cfg.partition, max_parts,
        block_tables.shape[1], q.stride(0),
        q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), block_tables.stride(0), NUM_HEADS=num_heads, GROUP=group,
        GROUP_PAD=_group_pad(group), GROUP_P2=group_p2,
        MERGE_CHUNK=max(2, MERGE_ROWS // group_p2), HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, BLOCK_N=cfg.block_n, WINDOWED=window is not None,
        SOFTCAP=softcap is not None, DOT_PRECISION=dot_precision(q.dtype), FP8_KV=fp8,
        F16_DOT=_f16_dot(fp8, cfg, q), K_BITS=fp8 and cfg.bits_k,
        V_BITS=fp8 and cfg.bits_v, SPLIT_SHORT=cfg.split_short, num_warps=cfg.num_warps,
        num_stages=_v2_stages(cfg.num_stages), enable_fp_fusion=False,
        **pdl.launch_options())
    return out


def _v2_stages(num_stages: int) -> int:
    """Triton's num_stages for v2 that buffers K/V as `num_stages` does for v1. v1 leaves its
    block-table loads to Triton's pipeliner, which spends stages on them (1 K/V tile in flight
    at 2-4 stages, 2 at 5, 3 at 7); v2 loads the next tile's block ids itself, a tile ahead,
    so the pipeliner keeps num_stages - 1 K/V tiles in flight."""
    return max(2, (num_stages - 1) // 2 + 1)


# Partial rows (query heads x partitions) one merge step loads: each step is a round trip to
# L2 at the end of the grid, so fewer, larger steps end the grid sooner (docs/benchmarks.md,
# "Paged attention kernels: tuning notes"); 64 adds no registers to the 4-warp kernel.
MERGE_ROWS = 64

PARTITIONS = DecodeConfig().partitions


def use_v2(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> bool:
    """Split over partitions when v1's (sequence, KV head) programs make less than two waves
    on the SMs and there are at least two partitions to split into: v2 wins by far at batch 1,
    ties at ~2 waves, and loses a little (the merge, the partials' traffic) beyond
    (docs/benchmarks.md, "v1 vs v2 by context length")."""
    return num_seqs * num_kv_heads < 2 * num_sms and max_seq_len > 2 * PARTITIONS[-1]


def choose_partition(num_seqs: int, num_kv_heads: int, max_seq_len: int,
                     num_sms: int, partitions: tuple[int, ...] = PARTITIONS) -> int:
    """The largest partition that still yields two programs per SM: fewer partitions mean
    less partial-result traffic, but each SM needs a couple of programs to hide latency."""
    for partition in partitions:
        if num_seqs * num_kv_heads * triton.cdiv(max_seq_len, partition) >= 2 * num_sms:
            return partition
    return partitions[-1]


# v2's tiles where even the smallest partition leaves the SMs under two programs each (batch 1
# up to 8k tokens, a few sequences of 1-2k): each program is latency-bound, so it keeps the
# next tile's K/V in flight while it does this one's math. 5 stages do that: Triton's pipeliner
# splits the stages between the block-table load and the K/V loads whose addresses it gives,
# so at 3 or 4 the next K/V is fetched only after the math (one buffer each, triton 3.6).
# 32-row tiles keep it at 122 registers and 38 KB of shared memory, 4 programs per SM.
# It gains at batch 1 up to 8k tokens and nothing on grids that fill the SMs (`benchmarks/
# kernels.py --sweep v2`; docs/benchmarks.md, "Paged attention kernels", (1, 32768)). The
# tile's length is the config's `small_grid_block_n`.
SMALL_GRID_STAGES = 5


def choose_v2_config(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int,
                     cfg: DecodeConfig = DecodeConfig()) -> DecodeConfig:
    """cfg with the partition of `choose_partition` among cfg.partitions, and the small-grid
    tiles where that grid still leaves the SMs under two programs each."""
    partition = choose_partition(num_seqs, num_kv_heads, max_seq_len, num_sms, cfg.partitions)
    cfg = replace(cfg, partition=partition)
    if num_seqs * num_kv_heads * triton.cdiv(max_seq_len, partition) < 2 * num_sms:
        cfg = replace(cfg, block_n=cfg.small_grid_block_n, num_stages=SMALL_GRID_STAGES)
    return cfg


def paged_decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                 seq_lens: Tensor, max_seq_len: int, scale: float, out: Tensor, num_sms: int,
                 cfg: DecodeConfig | None = None, window: int | None = None,
                 softcap: float | None = None,
                 kv_scales: tuple[Tensor, Tensor] | None = None,
                 order: Callable[[], Tensor | None] | None = None) -> Tensor:
    """v1 or v2 (with a partition sized to the batch, and double-buffered tiles where the
    grid is small), by `use_v2` on the attended length (the window at most). cfg None: the
    cache dtype's `default_config`. `order` gives v1's dispatch order (see
    paged_decode_v1), asked only when v1 runs: v2 splits long sequences instead."""
    num_seqs, num_kv_heads = q.shape[0], k_cache.shape[2]
    cfg = cfg or default_config(k_cache)
    length = attended_len(max_seq_len, window)
    if use_v2(num_seqs, num_kv_heads, length, num_sms):
        cfg = choose_v2_config(num_seqs, num_kv_heads, length, num_sms, cfg)
        return paged_decode_v2(q, k_cache, v_cache, block_tables, seq_lens, max_seq_len,
                               scale, out, cfg, window, softcap, kv_scales)
    return paged_decode_v1(q, k_cache, v_cache, block_tables, seq_lens, scale, out, cfg,
                           window, softcap, kv_scales, order() if order else None)


def longest_first(seq_lens: Tensor) -> Tensor:
    """The sequences' indices by length, longest first (int64): v1's dispatch order. On the
    device, without a host sync, so a CUDA graph captures it."""
    return torch.argsort(seq_lens, descending=True)
