"""The batch that measures a forward pass's peak activation memory before the KV cache is
sized: max_num_batched_tokens prompt tokens, as a step could schedule them.

Why sequences and not one long prompt: a step's batch never holds a position past the
model's context, and the kernels read tables sized by it (RoPE's cos/sin rows). A single
prompt of max_num_batched_tokens tokens (16k on a large GPU) ran positions past a 4k model's
RoPE table: an out-of-bounds read that crashed the engine with an illegal memory access
whenever the allocator put the table at the end of a mapped segment (after other CUDA work
in the process). So the tokens are cut into prompts of at most the model's context, each
attending to itself, which is also the attention work a full prefill step does.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pagedserve.attention.metadata import AttentionMetadata


def profile_batch(num_tokens: int, max_len: int, block_size: int,
                  device: torch.device) -> tuple[Tensor, Tensor, AttentionMetadata]:
    """(input ids, positions, metadata) of `num_tokens` prompt tokens in prompts of at most
    `max_len` tokens. Every block table entry is the null block and every slot is -1: the
    pass reads only valid memory and writes nothing to the KV cache, so a 2-block throwaway
    cache serves."""
    lengths = [max_len] * (num_tokens // max_len)
    if num_tokens % max_len:
        lengths.append(num_tokens % max_len)
    lens = torch.tensor(lengths, dtype=torch.int32)
    starts = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    torch.cumsum(lens, 0, out=starts[1:])
    positions = torch.cat([torch.arange(n) for n in lengths])
    meta = AttentionMetadata(
        num_decodes=0, num_decode_tokens=0,
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=device),
        block_tables=torch.zeros((len(lengths), -(-max(lengths) // block_size)),
                                 dtype=torch.int32, device=device),
        seq_lens=lens.to(device), query_start_loc=starts.to(device),
        max_query_len=max(lengths), max_seq_len=max(lengths))
    ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    return ids, positions.to(device), meta
