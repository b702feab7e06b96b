"""Builds random paged-attention steps and their dense answers, for backend and kernel tests.

Every sequence gets its own randomly chosen, non-contiguous blocks; the cache starts NaN-filled
(so any read outside a sequence's context poisons the result) and the null block 0 pads every
block table.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from pagedserve.attention import kv_quant
from pagedserve.kernels import fp8_format
from pagedserve.attention.metadata import AttentionMetadata


@dataclass
class PagedCase:
    q: Tensor  # [T, Hq, D]
    k: Tensor  # [T, Hkv, D] (garbage rows where slot_mapping is -1)
    v: Tensor
    k_cache: Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: Tensor
    meta: AttentionMetadata
    scale: float
    expected: Tensor  # [T, Hq, D] float64, dense causal attention on the whole sequence
    window: int | None = None
    softcap: float | None = None
    kv_scales: tuple[Tensor, Tensor] | None = None  # an FP8 cache's (K, V) scales [Hkv]


def make_case(seqs: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int,
              block_size: int, dtype: torch.dtype = torch.float32, seed: int = 0,
              prefix_hit_rows: int = 0, device: str = "cpu", window: int | None = None,
              softcap: float | None = None,
              kv_scales: tuple[Tensor, Tensor] | None = None) -> PagedCase:
    """seqs: (cached prefix length, new tokens) per sequence, decodes (new == 1) first.

    The last `prefix_hit_rows` of each prefill's prefix are passed as new tokens with slot -1
    (already cached), with garbage k/v, to check that the write is skipped. With a window,
    the blocks no query of the step can see are the null block in the table (as the block
    manager frees them), which the NaN-filled cache never wrote.

    kv_scales: the caches are FP8 with these per-head scales; the expected output is the
    attention over the K/V as the cache holds them (quantized, then dequantized).
    """
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in seqs]
    blocks_per_seq = [-(-L // block_size) for L in seq_lens]
    num_blocks = 1 + sum(blocks_per_seq) + 3
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"),
                         dtype=dtype if kv_scales is None else fp8_format.FP8_DTYPE)
    v_cache = torch.full_like(k_cache, float("nan"))
    max_blocks = max(blocks_per_seq) + 1  # always at least one null-block pad column
    block_tables = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)
    qs, ks, vs, slots, expected, q_lens = [], [], [], [], [], []
    for i, ((ctx, new), L) in enumerate(zip(seqs, seq_lens)):
        ids = [perm.pop() for _ in range(blocks_per_seq[i])]
        table = list(ids)
        if window is not None:  # blocks wholly before the first new token's window
            hit = min(prefix_hit_rows, ctx) if new > 1 else 0
            first_seen = max(0, ctx - hit - window + 1)
            table[:first_seen // block_size] = [0] * (first_seen // block_size)
        block_tables[i, : len(ids)] = torch.tensor(table, dtype=torch.int32)
        kf = torch.randn(L, num_kv_heads, head_dim, generator=gen).to(dtype)
        vf = torch.randn(L, num_kv_heads, head_dim, generator=gen).to(dtype)
        qf = torch.randn(L, num_heads, head_dim, generator=gen).to(dtype)
        seq_slots = torch.tensor([ids[p // block_size] * block_size + p % block_size
                                  for p in range(L)])
        hit = min(prefix_hit_rows, ctx) if new > 1 else 0
        first_new = ctx - hit
        k_cached, v_cached, k_ref, v_ref = kf, vf, kf, vf  # as stored, as read back
        if kv_scales is not None:
            k_cached, v_cached = (kv_quant.quantize(x, s) for x, s in zip((kf, vf), kv_scales))
            k_ref, v_ref = (kv_quant.dequantize(x, s) for x, s in zip((k_cached, v_cached),
                                                                        kv_scales))
        k_cache.view(-1, num_kv_heads, head_dim)[seq_slots[:ctx]] = k_cached[:ctx]
        v_cache.view(-1, num_kv_heads, head_dim)[seq_slots[:ctx]] = v_cached[:ctx]
        step_slots = seq_slots[first_new:].clone()
        step_slots[:hit] = -1
        k_step, v_step = kf[first_new:].clone(), vf[first_new:].clone()
        k_step[:hit] = 1e4
        v_step[:hit] = -1e4
        qs.append(qf[first_new:])
        ks.append(k_step)
        vs.append(v_step)
        slots.append(step_slots)
        q_lens.append(L - first_new)
        expected.append(dense_causal(qf[first_new:].double(), k_ref.double(), v_ref.double(),
                                     head_dim ** -0.5, window, softcap))
    num_decodes = sum(1 for _, n in seqs if n == 1)
    assert all(n == 1 for _, n in seqs[:num_decodes]), "decodes must come first"
    query_start_loc = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    meta = AttentionMetadata(
        num_decodes=num_decodes,
        num_decode_tokens=num_decodes,
        slot_mapping=torch.cat(slots).to(device),
        block_tables=block_tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=query_start_loc.to(device),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
    )
    return PagedCase(torch.cat(qs).to(device), torch.cat(ks).to(device),
                     torch.cat(vs).to(device), k_cache.to(device), v_cache.to(device), meta,
                     head_dim ** -0.5, torch.cat(expected), window, softcap,
                     None if kv_scales is None else tuple(s.to(device) for s in kv_scales))


def dense_causal(q: Tensor, k: Tensor, v: Tensor, scale: float, window: int | None = None,
                 softcap: float | None = None) -> Tensor:
    """Naive attention of the last n positions q [n, Hq, D] of one contiguous sequence,
    k/v [L, Hkv, D]: query i sits at position L - n + i (and sees the last `window` keys up
    to it, scores capped by softcap * tanh(s / softcap))."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    n, L = q.shape[0], k.shape[0]
    k_pos, q_pos = torch.arange(L)[None, :], torch.arange(L - n, L)[:, None]
    causal = k_pos <= q_pos
    if window is not None:
        causal &= k_pos > q_pos - window
    scores = scores.masked_fill(~causal, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
