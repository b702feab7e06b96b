"""The sampler's hook: a step's token bitmask applied to the logits as one masked fill.

The structured-output manager fills one bitmask row per sampling row (all ones for
unconstrained rows); the runner uploads it with the step's other sampling tensors, and the
sampler applies it before any of its paths, so the fused kernel and the torch path, greedy
and random rows, penalties and logprobs all see the constrained distribution. xgrammar's in-place kernel does the fill
(Triton on CUDA, a vectorized loop on the CPU), one launch for the whole batch.
"""

from __future__ import annotations

from torch import Tensor


def apply_token_bitmask(logits: Tensor, bitmask: Tensor) -> Tensor:
    """Set the logits of tokens whose bit is 0 to -inf, in place; returns `logits`.

    `bitmask`: int32 [rows, words] on the logits' device, words = ceil(vocab / 32), or fewer
    where the grammar covers fewer ids than the LM head has rows (`grammar_vocab_size`):
    the ids past its last bit are then allowed in a row exactly when that bit is set (the
    sign bit of the row's last word), i.e. masked in a constrained row, free in a free one."""
    import xgrammar as xgr  # here, not at the top: the engine core loads it only for grammars

    if not logits.is_contiguous():
        logits = logits.contiguous()
    vocab, covered = logits.shape[1], bitmask.shape[1] * 32
    if covered >= vocab:
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab)
        return logits
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=covered)
    logits[:, covered:].masked_fill_(bitmask[:, -1:] >= 0, float("-inf"))
    return logits

