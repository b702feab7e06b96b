"""Pure-PyTorch paged attention: the reference for the kernels and the CPU engine's backend.

Decodes are vectorized over the batch because on the CPU the decode step dominates throughput:
one `index_select` per cache gathers every decode's context rows, then one SDPA call with a
padding mask does all sequences and heads. Prefills run one SDPA per sequence with a mask that
shifts the causal diagonal by the cached prefix length.

Every layer of a step sees the same metadata, so the index tensors derived from it (which rows
to store, which cache rows each decode reads, the padding mask) are built by the first layer
and kept on the metadata object (`StepPlan`); the other layers only index. q/k/v are computed
in float32 (free at fp32, and it keeps the reference accurate for bf16/fp16).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from pagedserve.attention.backend import AttentionBackend
from pagedserve.attention.metadata import AttentionMetadata


@dataclass
class StepPlan:
    """Index tensors derived once per step from its AttentionMetadata, shared by all layers.

    Kept in `meta.derived`, which lives exactly as long as the step's metadata.
    """

    store_rows: Tensor | None  # rows of k/v that have a slot; None: all of them
    store_slots: Tensor  # int64 [rows]: their flat cache slots
    decode_slots: Tensor | None  # int64 [num_decodes, L]: flat cache row of each context token
    decode_mask: Tensor | None  # bool [num_decodes, 1, 1, L]: True where the token is context
    block_size: int

    @classmethod
    def of(cls, meta: AttentionMetadata, block_size: int) -> StepPlan:
        """The plan cached on `meta` (built on the first call of the step)."""
        plan = meta.derived.get("torch_ref")
        if plan is None or plan.block_size != block_size:
            plan = meta.derived["torch_ref"] = cls.build(meta, block_size)
        return plan

    @classmethod
    def build(cls, meta: AttentionMetadata, block_size: int) -> StepPlan:
        rows, slots = rows_to_store(meta.slot_mapping)
        nd = meta.num_decodes
        if nd == 0:
            return cls(rows, slots, None, None, block_size)
        seq_lens = meta.seq_lens[:nd].long()
        # a long prefill in the batch must not widen the decodes' gather
        length = meta.max_seq_len if nd == meta.num_seqs else int(seq_lens.max())
        positions = torch.arange(length, device=seq_lens.device)
        mask = positions[None, :] < seq_lens[:, None]
        # Positions past a sequence's end read its last token instead of the padding: those
        # rows are masked out of the softmax, and a real row cannot hold NaN (stale or null
        # block rows can), which would survive a zero probability.
        clamped = torch.minimum(positions[None, :], seq_lens[:, None] - 1)
        blocks = meta.block_tables[:nd].long().gather(1, clamped // block_size)
        context_slots = blocks * block_size + clamped % block_size
        return cls(rows, slots, context_slots, mask[:, None, None], block_size)


def rows_to_store(slot_mapping: Tensor) -> tuple[Tensor | None, Tensor]:
    """(rows with a slot or None for all, their slots): slot -1 rows are skipped."""
    keep = slot_mapping >= 0
    if bool(keep.all()):  # decode steps and prefills without a prefix hit
        return None, slot_mapping
    rows = keep.nonzero().squeeze(1)
    return rows, slot_mapping.index_select(0, rows)


def write_rows(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, rows: Tensor | None,
               slots: Tensor) -> None:
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if rows is not None:
        k, v = k.index_select(0, rows), v.index_select(0, rows)
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v.to(v_cache.dtype))


def store_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
             slot_mapping: Tensor) -> None:
    """Write k/v rows [T, Hkv, D] into their slots; slot -1 rows are skipped."""
    write_rows(k, v, k_cache, v_cache, *rows_to_store(slot_mapping))


def gather_context(cache: Tensor, block_tables: Tensor, num_tokens: int) -> Tensor:
    """[S, max_blocks] block tables -> the first num_tokens cached rows, [S, num_tokens, H, D]."""
    block_size = cache.shape[1]
    num_blocks = -(-num_tokens // block_size)
    blocks = cache[block_tables[:, :num_blocks].long()]  # [S, nb, bs, H, D]
    return blocks.flatten(1, 2)[:, :num_tokens]


def paged_decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, mask: Tensor,
                 scale: float) -> Tensor:
    """One query token per sequence: q [S, Hq, D] -> [S, Hq, D].

    slots [S, L]: the flat cache row of each of the sequence's L context positions; mask
    [S, 1, 1, L]: which of them are real (see `StepPlan`).
    """
    num_seqs, length = slots.shape
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    rows = slots.view(-1)

    def gather(cache: Tensor) -> Tensor:  # [S, Hkv, L, D], a strided view SDPA reads as is
        flat = cache.view(-1, num_kv_heads, head_dim).index_select(0, rows)
        return flat.view(num_seqs, length, num_kv_heads, head_dim).transpose(1, 2).float()

    out = F.scaled_dot_product_attention(q.float()[:, :, None], gather(k_cache),
                                         gather(v_cache), attn_mask=mask, scale=scale,
                                         enable_gqa=True)
    return out[:, :, 0].to(q.dtype)


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


def paged_prefills(q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata,
                   scale: float, out: Tensor) -> None:
    """The step's prefill sequences (after the decodes), one `paged_prefill_one` each, into
    out's rows."""
    starts = meta.query_start_loc.tolist()
    seq_lens = meta.seq_lens.tolist()
    for i in range(meta.num_decodes, meta.num_seqs):
        s, e = starts[i], starts[i + 1]
        out[s:e] = paged_prefill_one(q[s:e], k_cache, v_cache, meta.block_tables[i],
                                     seq_lens[i], scale)


class TorchRefBackend(AttentionBackend):
    """Reference backend that runs on any device torch supports."""

    name = "torch"

    def forward(self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                meta: AttentionMetadata, scale: float) -> Tensor:
        plan = StepPlan.of(meta, k_cache.shape[1])
        write_rows(k, v, k_cache, v_cache, plan.store_rows, plan.store_slots)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        num_seqs = meta.seq_lens.shape[0]
        if nd > 0:
            out[:nd] = paged_decode(q[:nd], k_cache, v_cache, plan.decode_slots,
                                    plan.decode_mask, scale)
        if num_seqs > nd:
            paged_prefills(q, k_cache, v_cache, meta, scale, out)
        return out
