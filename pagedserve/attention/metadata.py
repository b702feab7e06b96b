"""Per-step attention metadata shared by every attention backend.

The model runner builds one `AttentionMetadata` per forward step and every attention layer
reads it through the forward context (see `backend.set_forward_context`), so the tensors are
built once per step, not once per layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor


@dataclass
class AttentionMetadata:
    """Describes one step's batch of sequences.

    Sequences are ordered with all decodes (exactly one new token) first, then prefills and
    prefill chunks; backends rely on that order to run one vectorized decode path over the
    first `num_decodes` sequences.
    """

    num_decodes: int  # the first num_decodes sequences have exactly one new token
    num_decode_tokens: int  # == num_decodes
    slot_mapping: Tensor  # int64 [num_tokens]; -1 = skip the write (prefix hit / padding)
    block_tables: Tensor  # int32 [num_seqs, max_blocks], padded with the null block 0
    seq_lens: Tensor  # int32 [num_seqs]: context length including this step's tokens
    query_start_loc: Tensor  # int32 [num_seqs + 1]: cumulative new tokens per sequence
    max_query_len: int
    max_seq_len: int
    # per-step tensors a backend derives from the fields above once and every layer reuses;
    # valid for this object only, which is why the runner builds a fresh one each step
    derived: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]
