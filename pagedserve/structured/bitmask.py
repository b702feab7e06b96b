"""The sampler's hook: a step's token bitmask applied to the logits as one masked fill.

The runner builds one bitmask row per sampling row (all ones for unconstrained rows) and
uploads it with the step's other sampling tensors; the sampler applies it before any of its
paths, so the fused kernel and the torch path, greedy and random rows, penalties and
logprobs all see the constrained distribution. xgrammar's in-place kernel does the fill
(Triton on CUDA, a vectorized loop on the CPU), one launch for the whole batch.
"""

from __future__ import annotations

import numpy as np
import xgrammar as xgr
from torch import Tensor


def full_bitmask(num_rows: int, vocab_size: int) -> np.ndarray:
    """Every token allowed in every row: what unconstrained rows hold."""
    return np.full(xgr.get_bitmask_shape(num_rows, vocab_size), -1, dtype=np.int32)


def apply_token_bitmask(logits: Tensor, bitmask: Tensor) -> Tensor:
    """Set the logits of tokens whose bit is 0 to -inf, in place; returns `logits`.

    `bitmask`: int32 [rows, ceil(vocab / 32)] on the logits' device."""
    if not logits.is_contiguous():
        logits = logits.contiguous()
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1])
    return logits

