"""CPU attention backend: the native paged-decode kernel for decodes and prefills.

The decode step is where the CPU engine spends its attention time, and there the reference's
gather of every decode's context into a padded copy costs more than the attention itself; the
kernel (`pagedserve/kernels/native/attention.c`) reads K/V in place through the block tables, in the
same call that stores the step's new K/V rows. A short prefill chunk goes through the same
call as one decode per new token (token i of a chunk of n ending at seq_len L attends to the
first L - n + i + 1 tokens, which the store has just completed): each token then re-reads its
context, cheap while contexts are short (where the reference's SDPA is a large share of a chat
prompt's prefill step) and still cheaper than torch's CPU SDPA at prompts of one and two
thousand tokens (docs/benchmarks.md, "Issue 17: one person chatting at llama.cpp's speed",
TTFT): the kernel skips the masked half and its rows come from cache. Only a step with a prefill
longer than MAX_NATIVE_PREFILL_LEN (more than the CPU's default chunk) keeps the reference's
`paged_prefills`, whose tiled SDPA reuses each K/V row across queries.

The kernel trusts the block ids, slots and lengths it is given, so those are checked once per
step, when the first layer builds the step's `StepIndices`; every later layer only calls the
kernel. A bfloat16 model (`--dtype bfloat16` on a CPU with bf16 compute) keeps bfloat16 caches,
which the kernel reads and writes as they are, with q widened to float32 and the output
rounded back (exact widening, float32 arithmetic: closer to float32 than the reference's
bfloat16 SDPA). Other dtypes (an FP8 cache), a head shape the kernel does not handle, or a
score cap are not this backend's: the selector picks the reference for such a model at load
(`unsupported`), so `forward` never decides per call. A sliding window is the kernel's: a
token attends to its last `window` positions, decode or prefill token alike.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pagedserve.attention.backend import AttentionBackend, AttentionShape
from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.attention.torch_ref import paged_prefills
from pagedserve.kernels.native import attention as native


# Prefills attended per token by the kernel when none in the step is longer than this.
MAX_NATIVE_PREFILL_LEN = 4096


def step_indices(meta: AttentionMetadata, k_cache: Tensor) -> native.StepIndices:
    """The step's indices as the kernel takes them, built and checked by the step's first
    layer and kept in `meta.derived` (which lives exactly as long as the step's metadata).
    Their rows are the decodes, then every prefill token when `_prefills_native`."""
    num_blocks, block_size = k_cache.shape[:2]
    indices = meta.derived.get("cpu")
    if indices is None or (indices.num_blocks, indices.block_size) != (num_blocks, block_size):
        nd = meta.num_decodes
        tables, seq_lens = (_per_token(meta) if _prefills_native(meta)
                            else (meta.block_tables[:nd], meta.seq_lens[:nd]))
        indices = meta.derived["cpu"] = native.StepIndices.check(
            meta.slot_mapping.to(torch.int64).contiguous(), tables.to(torch.int32).contiguous(),
            seq_lens.to(torch.int32).contiguous(), num_blocks, block_size)
    return indices


def _prefills_native(meta: AttentionMetadata) -> bool:
    return (meta.num_seqs > meta.num_decodes
            and int(meta.seq_lens[meta.num_decodes:].max()) <= MAX_NATIVE_PREFILL_LEN)


def _per_token(meta: AttentionMetadata) -> tuple[Tensor, Tensor]:
    """(block table row, context length) of every token of the step: its sequence's row, and
    its own position + 1 (a decode's is its seq_len)."""
    starts = meta.query_start_loc.long()
    query_lens = starts.diff()
    tables = meta.block_tables.repeat_interleave(query_lens, dim=0)
    ends = starts[1:].repeat_interleave(query_lens)  # one past each token's chunk
    tokens_after = ends - 1 - torch.arange(ends.shape[0])
    return tables, meta.seq_lens.long().repeat_interleave(query_lens) - tokens_after


def unsupported(shape: AttentionShape) -> str | None:
    """Why the kernel does not take a model's attention (None: it does)."""
    if shape.dtype != shape.cache_dtype or shape.dtype not in native.CACHE_DTYPES:
        return (f"the native attention kernel takes float32 or bfloat16 activations and KV "
                f"cache of one dtype, not {shape.dtype} with a {shape.cache_dtype} cache")
    if not native.supports(shape.num_heads, shape.num_kv_heads, shape.head_dim):
        return (f"the native attention kernel does not take {shape.num_heads} query heads, "
                f"{shape.num_kv_heads} KV heads of dimension {shape.head_dim}")
    if shape.softcap is not None:
        return "the native attention kernel has no score cap (attn_logit_softcapping)"
    return None


class CpuBackend(AttentionBackend):
    """Native store and decode attention (float32 or bfloat16 caches), for the models that
    `unsupported` passes."""

    name = "cpu"

    def forward(self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                meta: AttentionMetadata, scale: float, window: int | None = None,
                softcap: float | None = None,
                kv_scales: tuple[Tensor, Tensor] | None = None) -> Tensor:
        wide = q.dtype == torch.float32
        out = torch.empty(q.shape, dtype=torch.float32)
        indices = step_indices(meta, k_cache)
        native.store_and_decode(q if wide else q.float(), k, v, k_cache, v_cache, indices,
                                scale, out, window)
        if not wide:
            out = out.to(q.dtype)
        if indices.seq_lens.shape[0] < q.shape[0]:  # prefills left to the reference
            paged_prefills(q, k_cache, v_cache, meta, scale, out, window)
        return out
