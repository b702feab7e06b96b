"""Pure-PyTorch paged attention: the reference for the kernels and the CPU engine's backend.

Decodes are vectorized over the batch because on the CPU the decode step dominates throughput:
one `index_select` per cache gathers every decode's context rows, then one SDPA call with a
padding mask does all sequences and heads. Prefills run one SDPA per sequence with a mask that
shifts the causal diagonal by the cached prefix length. A sliding window narrows both masks
(keys p - window < k <= p); a score cap (Gemma 2) needs the scores themselves, so it takes an
explicit matmul-softmax-matmul instead of SDPA.

Every layer of a step sees the same metadata, so the index tensors derived from it (which rows
to store, which cache rows each decode reads, the padding mask) are built by the first layer
and kept on the metadata object (`StepPlan`); the other layers only index. q/k/v are computed
in float32 (free at fp32, and it keeps the reference accurate for bf16/fp16). An FP8 cache
(`kv_quant`) is quantized on store and dequantized as its rows are gathered.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from pagedserve.attention import kv_quant
from pagedserve.kernels import fp8_format
from pagedserve.attention.backend import AttentionBackend
from pagedserve.attention.metadata import AttentionMetadata


@dataclass
class StepPlan:
    """Index tensors derived once per step from its AttentionMetadata, shared by all layers.

    Kept in `meta.derived`, which lives exactly as long as the step's metadata. The decodes'
    gather indices and mask depend on the layer's window, so they are built on first use for
    each window the step meets.
    """

    store_rows: Tensor | None  # rows of k/v that have a slot; None: all of them
    store_slots: Tensor  # int64 [rows]: their flat cache slots
    block_size: int
    decode_tables: Tensor | None  # int64 [num_decodes, max_blocks]
    decode_lens: Tensor | None  # int64 [num_decodes]
    decode_length: int  # L: the longest decode context
    # window -> (int64 [num_decodes, L] flat cache row of each context position,
    #            bool [num_decodes, 1, 1, L] True where the position is attended)
    decodes: dict[int | None, tuple[Tensor, Tensor]] = field(default_factory=dict)

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
            return cls(rows, slots, block_size, None, None, 0)
        seq_lens = meta.seq_lens[:nd].long()
        # a long prefill in the batch must not widen the decodes' gather
        length = meta.max_seq_len if nd == meta.num_seqs else int(seq_lens.max())
        return cls(rows, slots, block_size, meta.block_tables[:nd].long(), seq_lens, length)

    def decode(self, window: int | None) -> tuple[Tensor, Tensor]:
        """(slots, mask) of the decodes' context for a layer with this window."""
        built = self.decodes.get(window)
        if built is None:
            lens = self.decode_lens
            positions = torch.arange(self.decode_length, device=lens.device)[None, :]
            first = torch.zeros_like(lens) if window is None else (lens - window).clamp(min=0)
            mask = (positions < lens[:, None]) & (positions >= first[:, None])
            # Positions outside the attended range read the range's first or last token:
            # those rows are masked out of the softmax, and a real row cannot hold NaN (stale
            # rows, the null block and blocks freed out of the window can), which would
            # survive a zero probability.
            clamped = torch.maximum(torch.minimum(positions, lens[:, None] - 1), first[:, None])
            blocks = self.decode_tables.gather(1, clamped // self.block_size)
            slots = blocks * self.block_size + clamped % self.block_size
            built = self.decodes[window] = (slots, mask[:, None, None])
        return built


def rows_to_store(slot_mapping: Tensor) -> tuple[Tensor | None, Tensor]:
    """(rows with a slot or None for all, their slots): slot -1 rows are skipped."""
    keep = slot_mapping >= 0
    if bool(keep.all()):  # decode steps and prefills without a prefix hit
        return None, slot_mapping
    rows = keep.nonzero().squeeze(1)
    return rows, slot_mapping.index_select(0, rows)


def write_rows(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, rows: Tensor | None,
               slots: Tensor, kv_scales: tuple[Tensor, Tensor] | None = None) -> None:
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if rows is not None:
        k, v = k.index_select(0, rows), v.index_select(0, rows)
    for x, cache, scale in zip((k, v), (k_cache, v_cache), kv_scales or (None, None)):
        if fp8_format.is_fp8(cache):  # index_copy_ has no float8 kernel: copy the bytes
            x, cache = kv_quant.quantize(x, scale).view(torch.uint8), cache.view(torch.uint8)
        cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, x.to(cache.dtype))


def store_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
             kv_scales: tuple[Tensor, Tensor] | None = None) -> None:
    """Write k/v rows [T, Hkv, D] into their slots; slot -1 rows are skipped."""
    write_rows(k, v, k_cache, v_cache, *rows_to_store(slot_mapping), kv_scales)


def read_rows(rows: Tensor, scale: Tensor | None) -> Tensor:
    """Gathered cache rows [..., Hkv, D] in float32, dequantized from an FP8 cache."""
    if fp8_format.is_fp8(rows):
        return kv_quant.dequantize(rows, scale)
    return rows.float()


def gather_context(cache: Tensor, block_tables: Tensor, num_tokens: int) -> Tensor:
    """[S, max_blocks] block tables -> the first num_tokens cached rows, [S, num_tokens, H, D]."""
    block_size = cache.shape[1]
    num_blocks = -(-num_tokens // block_size)
    blocks = _indexable(cache)[block_tables[:, :num_blocks].long()].view(cache.dtype)
    return blocks.flatten(1, 2)[:, :num_tokens]


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float,
           softcap: float | None) -> Tensor:
    """q [..., Hq, Lq, D], k/v [..., Hkv, L, D] in float32, mask bool [.., Lq, L] (None:
    causal from the first key) -> [..., Hq, Lq, D]."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                              is_causal=mask is None, enable_gqa=True)
    group = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(group, -3), v.repeat_interleave(group, -3)
    scores = torch.tanh(q @ k.transpose(-1, -2) * scale / softcap) * softcap
    if mask is None:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ v


def paged_decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, mask: Tensor,
                 scale: float, softcap: float | None = None,
                 kv_scales: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """One query token per sequence: q [S, Hq, D] -> [S, Hq, D].

    slots [S, L]: the flat cache row of each of the sequence's L context positions; mask
    [S, 1, 1, L]: which of them are real (see `StepPlan`).
    """
    num_seqs, length = slots.shape
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    rows = slots.view(-1)
    k_scale, v_scale = kv_scales or (None, None)

    def gather(cache: Tensor, scale: Tensor | None) -> Tensor:  # [S, Hkv, L, D], strided
        flat = read_rows(_indexable(cache).view(-1, num_kv_heads, head_dim)
                         .index_select(0, rows).view(cache.dtype), scale)
        return flat.view(num_seqs, length, num_kv_heads, head_dim).transpose(1, 2)

    out = attend(q.float()[:, :, None], gather(k_cache, k_scale), gather(v_cache, v_scale),
                 mask, scale, softcap)
    return out[:, :, 0].to(q.dtype)


def _indexable(cache: Tensor) -> Tensor:
    """An FP8 cache as uint8 for index_select (no float8 kernel); view back after."""
    return cache.view(torch.uint8) if fp8_format.is_fp8(cache) else cache


def paged_prefill_one(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor,
                      seq_len: int, scale: float, window: int | None = None,
                      softcap: float | None = None,
                      kv_scales: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """A chunk of n new tokens q [n, Hq, D] at the end of a seq_len context -> [n, Hq, D].

    Query i sits at absolute position seq_len - n + i and sees keys 0..that position (the
    last `window` of them with a window).
    """
    num_new = q.shape[0]
    prefix = seq_len - num_new
    # keys before the first query's window are never read (their blocks may be freed)
    first = 0 if window is None else max(0, prefix - window + 1)
    k_scale, v_scale = kv_scales or (None, None)
    keys = read_rows(gather_context(k_cache, block_table[None], seq_len)[0, first:], k_scale)
    values = read_rows(gather_context(v_cache, block_table[None], seq_len)[0, first:],
                       v_scale)  # [L, Hkv, D]
    qt, kt, vt = q.float().transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1)
    mask = None  # causal from key 0
    if prefix > 0 or window is not None:
        q_pos = torch.arange(prefix, seq_len, device=q.device)
        k_pos = torch.arange(first, seq_len, device=q.device)
        mask = k_pos[None, :] <= q_pos[:, None]
        if window is not None:
            mask &= k_pos[None, :] > q_pos[:, None] - window
    return attend(qt, kt, vt, mask, scale, softcap).transpose(0, 1).to(q.dtype)


def paged_prefills(q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata,
                   scale: float, out: Tensor, window: int | None = None,
                   softcap: float | None = None,
                   kv_scales: tuple[Tensor, Tensor] | None = None) -> None:
    """The step's prefill sequences (after the decodes), one `paged_prefill_one` each, into
    out's rows."""
    starts = meta.query_start_loc.tolist()
    seq_lens = meta.seq_lens.tolist()
    for i in range(meta.num_decodes, meta.num_seqs):
        s, e = starts[i], starts[i + 1]
        out[s:e] = paged_prefill_one(q[s:e], k_cache, v_cache, meta.block_tables[i],
                                     seq_lens[i], scale, window, softcap, kv_scales)


class TorchRefBackend(AttentionBackend):
    """Reference backend that runs on any device torch supports."""

    name = "torch"
    capturable = False  # it selects rows and builds its plan with data-dependent shapes

    def forward(self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                meta: AttentionMetadata, scale: float, window: int | None = None,
                softcap: float | None = None,
                kv_scales: tuple[Tensor, Tensor] | None = None) -> Tensor:
        plan = StepPlan.of(meta, k_cache.shape[1])
        write_rows(k, v, k_cache, v_cache, plan.store_rows, plan.store_slots, kv_scales)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        num_seqs = meta.seq_lens.shape[0]
        if nd > 0:
            out[:nd] = paged_decode(q[:nd], k_cache, v_cache, *plan.decode(window), scale,
                                    softcap, kv_scales)
        if num_seqs > nd:
            paged_prefills(q, k_cache, v_cache, meta, scale, out, window, softcap, kv_scales)
        return out
