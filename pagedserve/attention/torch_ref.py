"""Pure-PyTorch paged attention: the reference for the kernels and the CPU engine's backend.

Decodes are vectorized over the batch (one gather of their blocks, one pair of batched
matmuls) because on the CPU the decode step dominates throughput; prefills run one SDPA per
sequence with a mask that shifts the causal diagonal by the cached prefix length.
Scores and softmax are computed in float32 so the reference stays accurate for bf16/fp16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from pagedserve.attention.backend import AttentionBackend
from pagedserve.attention.metadata import AttentionMetadata


def store_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
             slot_mapping: Tensor) -> None:
    """Write k/v rows [T, Hkv, D] into their slots; slot -1 rows are skipped."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k[keep].to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v[keep].to(v_cache.dtype))


def gather_context(cache: Tensor, block_tables: Tensor, num_tokens: int) -> Tensor:
    """[S, max_blocks] block tables -> the first num_tokens cached rows, [S, num_tokens, H, D]."""
    block_size = cache.shape[1]
    num_blocks = -(-num_tokens // block_size)
    blocks = cache[block_tables[:, :num_blocks].long()]  # [S, nb, bs, H, D]
    return blocks.flatten(1, 2)[:, :num_tokens]


def paged_decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                 seq_lens: Tensor, max_seq_len: int, scale: float) -> Tensor:
    """One query token per sequence: q [S, Hq, D] -> [S, Hq, D]."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    keys = gather_context(k_cache, block_tables, max_seq_len).float()  # [S, L, Hkv, D]
    values = gather_context(v_cache, block_tables, max_seq_len).float()
    qg = q.float().view(num_seqs, num_kv_heads, group, head_dim)
    scores = torch.matmul(qg, keys.permute(0, 2, 3, 1)) * scale  # [S, Hkv, G, L]
    positions = torch.arange(max_seq_len, device=q.device)
    invalid = positions[None, :] >= seq_lens[:, None].to(q.device)  # [S, L]
    scores.masked_fill_(invalid[:, None, None, :], float("-inf"))
    # rows past seq_len (null block, stale tail of the last block) may hold NaN: 0 * NaN = NaN
    values.masked_fill_(invalid[:, :, None, None], 0.0)
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, values.transpose(1, 2))  # [S, Hkv, G, D]
    return out.reshape(num_seqs, num_heads, head_dim).to(q.dtype)


def paged_prefill_one(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor,
                      seq_len: int, scale: float) -> Tensor:
    """A chunk of n new tokens q [n, Hq, D] at the end of a seq_len context -> [n, Hq, D].

    Query i sits at absolute position seq_len - n + i and sees keys 0..that position.
    """
    num_new = q.shape[0]
    prefix = seq_len - num_new
    keys = gather_context(k_cache, block_table[None], seq_len)[0].float()  # [L, Hkv, D]
    values = gather_context(v_cache, block_table[None], seq_len)[0].float()
    qt, kt, vt = q.float().transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1)
    if prefix == 0:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale,
                                             enable_gqa=True)
    else:
        q_pos = torch.arange(prefix, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        mask = k_pos[None, :] <= q_pos[:, None]
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale,
                                             enable_gqa=True)
    return out.transpose(0, 1).to(q.dtype)


class TorchRefBackend(AttentionBackend):
    """Reference backend that runs on any device torch supports."""

    name = "torch"

    def forward(self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                meta: AttentionMetadata, scale: float) -> Tensor:
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        num_seqs = meta.seq_lens.shape[0]
        if nd > 0:
            # a long prefill in the batch must not widen the decodes' gather
            max_len = meta.max_seq_len if nd == num_seqs else int(meta.seq_lens[:nd].max())
            out[:nd] = paged_decode(q[:nd], k_cache, v_cache, meta.block_tables[:nd],
                                    meta.seq_lens[:nd], max_len, scale)
        if num_seqs > nd:
            starts = meta.query_start_loc.tolist()
            seq_lens = meta.seq_lens.tolist()
            for i in range(nd, num_seqs):
                s, e = starts[i], starts[i + 1]
                out[s:e] = paged_prefill_one(q[s:e], k_cache, v_cache, meta.block_tables[i],
                                             seq_lens[i], scale)
        return out
