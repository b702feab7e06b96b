"""A minimal paged-KV driver for model tests: what the model runner does, by hand.

Each sequence gets blocks from a shuffled pool (non-contiguous ids, never the null block 0);
a step takes, per sequence, the tokens to feed (one = decode, several = a prefill chunk), builds
`AttentionMetadata` with decodes first as the contract requires, and returns float32 logits for
every fed token so they can be compared position by position with transformers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagedserve.attention.backend import set_forward_context
from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.attention.torch_ref import TorchRefBackend
from pagedserve.model.decoder import Decoder


class PagedDriver:
    def __init__(self, model: Decoder, num_blocks: int = 64, block_size: int = 4,
                 seed: int = 0) -> None:
        c = model.config
        self.model = model
        self.block_size = block_size
        dtype = model.embed_tokens.weight.dtype
        self.device = device = model.embed_tokens.weight.device
        for layer in model.attention_layers():
            shape = (num_blocks, block_size, layer.num_kv_heads, c.head_dim)  # this rank's
            # NaN-filled: any read of a slot that was never written poisons the logits.
            layer.k_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
            layer.v_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
        gen = torch.Generator().manual_seed(seed)
        self.free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
        self.blocks: dict[str, list[int]] = {}
        self.lens: dict[str, int] = {}
        self.backend = TorchRefBackend()

    def _slot(self, seq: str, pos: int) -> int:
        blocks = self.blocks.setdefault(seq, [])
        while len(blocks) <= pos // self.block_size:
            blocks.append(self.free.pop())
        return blocks[pos // self.block_size] * self.block_size + pos % self.block_size

    @torch.no_grad()
    def step(self, feeds: dict[str, list[int]],
             kv_ready: Callable[[int], None] | None = None) -> dict[str, torch.Tensor]:
        """feeds: seq id -> new token ids. Returns seq id -> logits [n_new, vocab].
        `kv_ready`: the forward context's per-layer wait of a recall (the runner's)."""
        order = sorted(feeds, key=lambda s: len(feeds[s]) != 1)  # decodes first
        ids, positions, slots, starts, seq_lens = [], [], [], [0], []
        for seq in order:
            start = self.lens.get(seq, 0)
            for i, tok in enumerate(feeds[seq]):
                ids.append(tok)
                positions.append(start + i)
                slots.append(self._slot(seq, start + i))
            self.lens[seq] = start + len(feeds[seq])
            starts.append(len(ids))
            seq_lens.append(self.lens[seq])
        max_blocks = max(len(self.blocks[s]) for s in order)
        tables = [self.blocks[s] + [0] * (max_blocks - len(self.blocks[s])) for s in order]
        num_decodes = sum(len(feeds[s]) == 1 for s in order)
        dev = self.device
        meta = AttentionMetadata(
            num_decodes=num_decodes,
            num_decode_tokens=num_decodes,
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            max_query_len=max(len(f) for f in feeds.values()),
            max_seq_len=max(seq_lens),
        )
        with set_forward_context(meta, self.backend, kv_ready):
            hidden = self.model(torch.tensor(ids, device=dev), torch.tensor(positions, device=dev))
        logits = self.model.compute_logits(hidden).float().cpu()
        return {seq: logits[starts[i]:starts[i + 1]] for i, seq in enumerate(order)}
