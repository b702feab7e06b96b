"""Fused Triton sampling: greedy and plain temperature rows in one pass over the logits.

The torch path upcasts the logits to float32 and walks them about eight times (divide,
softmax, noise, divide, argmaxes). Here each program reads its slice of a row once, in the
model's dtype, and keeps a running best score and index per tile lane. A random row is
sampled with the Gumbel-max trick, argmax(logits / T + G) with G = -log(-log(U)), which
picks token i with probability softmax(logits / T)_i; greedy rows skip the noise.

Noise comes from Philox, counter based, so no noise tensor exists and a token's noise is a
pure function of (seed, stream, token id): key = the row's 64-bit seed, counter = (token // 4,
stream low 32 bits, stream high 32 bits, 0), and the four outputs of one Philox call serve
four consecutive tokens. The draw therefore does not depend on the tile size, on how a row
is split over programs, or on the other rows of the batch. The caller picks (seed, stream):
a seeded request uses its own seed and the index of the token being sampled.

Rows are split over programs so that small batches still fill the GPU; a second tiny kernel
reduces each row's per-split winners. Greedy rows follow torch.argmax exactly: a NaN wins
over +inf, +inf over any number, and ties go to the lowest token id. Random rows use the same
order on their noisy scores, so a NaN or +inf logit is always the draw: a broken row gives a
repeatable token instead of a plausible-looking sample.

Under tensor parallelism each rank holds a slice of the vocabulary's logits (a vocab-parallel
LM head): `sample_vocab_shard` runs the split kernel over the slice and all-gathers only each
row's split winners, a few numbers per row, instead of the logits; the reduce then sees what it
would have seen for the whole row, so the tokens are the same.

Random scores are kept in base 2 (logits * log2(e) / T plus base-2 Gumbel noise): log2(e)
times the natural score less a constant, so the same argmax, with one fast lg2 per log.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from pagedserve.kernels.triton.gumbel import (FLOAT32_MAX, LOG2E, TOKEN_SENTINEL, best_of,
                                              gumbel2, interpreting)


@dataclass(frozen=True)
class SamplingKernelConfig:
    block: int = 2048  # tokens per tile: a power of two, at least 4
    num_warps: int = 8
    programs_per_sm: int = 4  # splits rows until about this many programs per SM run
    philox_rounds: int = 10  # Philox4x32-10, the standard strength

    def __post_init__(self) -> None:
        if self.block < 4 or self.block & (self.block - 1):
            raise ValueError(f"block must be a power of two >= 4, got {self.block}")


DEFAULT_CONFIG = SamplingKernelConfig()


@triton.jit
def _tile_scores(row_ptr, start, vocab, noisy, scale, seed, stream_lo, stream_hi,
                 GROUPS: tl.constexpr, ROUNDS: tl.constexpr, FAST: tl.constexpr):
    """Scores and token ids [GROUPS, 4] of tokens [start, start + 4 * GROUPS); tokens past the
    vocabulary score -inf. torch.argmax's order: NaN scores +inf and +inf the largest float,
    so NaN beats +inf, which beats every finite score. A random row scores logits * log2(e) / T plus
    base-2 Gumbel noise: log2(e) times the natural-base score less a constant, same argmax."""
    tokens = start + tl.arange(0, GROUPS)[:, None] * 4 + tl.arange(0, 4)[None, :]
    x = tl.load(row_ptr + tokens, mask=tokens < vocab, other=float("-inf")).to(tl.float32)
    if noisy:
        groups = (start // 4 + tl.arange(0, GROUPS)).to(tl.uint32)
        x = x * scale + gumbel2(seed, stream_lo, stream_hi, groups, ROUNDS, FAST)
    x = tl.where(x == float("inf"), FLOAT32_MAX, x)
    return tl.where(x != x, float("inf"), x), tokens


@triton.jit
def _sample_split_kernel(logits_ptr, stride_row, token_offset, vocab, split_len, temperature_ptr,
                         greedy_ptr, philox_ptr, part_score_ptr, part_token_ptr,
                         ALL_GREEDY: tl.constexpr, GROUPS: tl.constexpr, ROUNDS: tl.constexpr,
                         FAST: tl.constexpr):
    """One program per (row, split): the winner of tokens [split * split_len, + split_len) of
    the row's `vocab` columns, whose first is token id `token_offset` (a multiple of 4, so a
    column's noise is its token id's)."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row - token_offset
    start = token_offset + split * split_len
    end = tl.minimum(start + split_len, token_offset + vocab)
    vocab_end = token_offset + vocab
    if ALL_GREEDY:
        noisy: tl.constexpr = False
        scale, seed, stream_lo, stream_hi = 1.0, 0, 0, 0  # unused without noise
    else:
        noisy = tl.load(greedy_ptr + row) == 0
        scale = LOG2E / tl.load(temperature_ptr + row)
        seed = tl.load(philox_ptr + 2 * row)
        stream = tl.load(philox_ptr + 2 * row + 1)
        stream_lo = (stream & 0xFFFFFFFF).to(tl.uint32)
        stream_hi = (stream >> 32).to(tl.uint32)
    # the first tile seeds the running state, so an all -inf slice still names a real token
    best, best_token = _tile_scores(row_ptr, start, vocab_end, noisy, scale, seed, stream_lo,
                                    stream_hi, GROUPS, ROUNDS, FAST)
    for tile in range(start + 4 * GROUPS, end, 4 * GROUPS):
        scores, tokens = _tile_scores(row_ptr, tile, vocab_end, noisy, scale, seed, stream_lo,
                                      stream_hi, GROUPS, ROUNDS, FAST)
        better = scores > best  # strict: an equal score keeps the earlier (lower) token
        best = tl.where(better, scores, best)
        best_token = tl.where(better, tokens, best_token)
    score, token = best_of(best, best_token)
    num_splits = tl.num_programs(1)
    tl.store(part_score_ptr + row * num_splits + split, score)
    tl.store(part_token_ptr + row * num_splits + split, token)


# num_splits changes with the batch: no variant per divisibility class of its value (JIT
# seconds in the middle of a run). split_len needs no such care: always a multiple of the tile,
# and its divisibility is what lets the split kernel's loads vectorize.
@triton.jit(do_not_specialize=["num_splits"])
def _reduce_splits_kernel(part_score_ptr, part_token_ptr, out_ptr, num_splits,
                          SPLITS: tl.constexpr):
    """One program per row: the winner among its splits (ordered by token id)."""
    row = tl.program_id(0)
    offs = tl.arange(0, SPLITS)
    mask = offs < num_splits
    scores = tl.load(part_score_ptr + row * num_splits + offs, mask=mask, other=float("-inf"))
    tokens = tl.load(part_token_ptr + row * num_splits + offs, mask=mask, other=TOKEN_SENTINEL)
    _, token = best_of(scores, tokens)
    tl.store(out_ptr + row, token.to(tl.int64))


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter runs programs one by one: fewer is faster
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(num_rows: int, vocab: int, num_sms: int,
                      config: SamplingKernelConfig = DEFAULT_CONFIG) -> int:
    """Split rows only while there are fewer programs than the GPU wants; never more splits
    than tiles, so each split holds at least one whole tile."""
    tiles = triton.cdiv(vocab, config.block)
    wanted = triton.cdiv(config.programs_per_sm * num_sms, max(num_rows, 1))
    return max(1, min(tiles, wanted))


def fused_sample(logits: Tensor, temperature: Tensor | None, greedy_mask: Tensor | None,
                 philox: Tensor | None, config: SamplingKernelConfig = DEFAULT_CONFIG,
                 num_splits: int | None = None) -> Tensor:
    """Sampled token ids, int64 [S], from logits [S, V] of any float dtype.

    temperature (float32 [S]), greedy_mask (bool [S]) and philox (int64 [S, 2]: seed, stream)
    describe the rows; all three None means every row is greedy. A row with greedy_mask set
    takes the argmax and ignores its temperature and philox entries.
    """
    parts = split_winners(logits, temperature, greedy_mask, philox, config=config,
                          num_splits=num_splits)
    return reduce_winners(parts, triton.cdiv(logits.shape[1], config.block))


def split_winners(logits: Tensor, temperature: Tensor | None, greedy_mask: Tensor | None,
                  philox: Tensor | None, token_offset: int = 0, vocab: int | None = None,
                  config: SamplingKernelConfig = DEFAULT_CONFIG,
                  num_splits: int | None = None) -> Tensor:
    """The first pass of `fused_sample` over a slice of the vocabulary: logits [S, n] are the
    scores of token ids [token_offset, token_offset + n), of which the first `vocab` (default
    n) are real (a vocab-parallel LM head's rows; the rest padding). Returns float32
    [2, S, splits]: each split's best score, and its token id's int32 bits. The draw is a
    pure function of (logit, token id, row), so the splits of several slices, concatenated
    on the last dimension in token order (an all-gather over the ranks that hold them), give
    `reduce_winners` the token `fused_sample` draws from the whole row."""
    num_rows, columns = logits.shape
    vocab = columns if vocab is None else vocab
    all_greedy = temperature is None
    if all_greedy != (greedy_mask is None) or all_greedy != (philox is None):
        raise ValueError("temperature, greedy_mask and philox must be given together")
    if token_offset % 4 or not 0 < vocab <= columns:
        raise ValueError(f"token_offset must be a multiple of 4 and 0 < vocab <= {columns}, "
                         f"got {token_offset} and {vocab}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    if num_rows == 0:
        return torch.empty(2, 0, 1, dtype=torch.float32, device=logits.device)
    # the splits follow the columns, not `vocab`: slices of one width split alike (the
    # all-gather needs equal shapes); a split of padding alone scores -inf, never winning
    if num_splits is None:
        num_splits = choose_num_splits(num_rows, columns, _sm_count(logits.device), config)
    tiles_per_split = triton.cdiv(triton.cdiv(columns, config.block), num_splits)
    split_len = tiles_per_split * config.block
    num_splits = triton.cdiv(columns, split_len)  # no empty split
    parts = torch.empty(2, num_rows, num_splits, dtype=torch.float32, device=logits.device)
    part_score, part_token = parts[0], parts[1].view(torch.int32)
    if all_greedy:  # never read: any tensor stands in for the pointers
        temperature = greedy_mask = philox = part_score
    _sample_split_kernel[(num_rows, num_splits)](
        logits, logits.stride(0), token_offset, vocab, split_len, temperature, greedy_mask,
        philox, part_score, part_token, ALL_GREEDY=all_greedy, GROUPS=config.block // 4,
        ROUNDS=config.philox_rounds, FAST=logits.is_cuda and not interpreting(),
        num_warps=config.num_warps)
    return parts


def reduce_winners(parts: Tensor, max_splits: int) -> Tensor:
    """Each row's token, int64 [S], from `split_winners`' [2, S, splits] (of one slice or of
    several concatenated in token order). `max_splits`: the most splits a row can have here,
    which names the compiled variant (one for every batch size)."""
    num_rows, num_splits = parts.shape[1:]
    out = torch.empty(num_rows, dtype=torch.int64, device=parts.device)
    if num_rows == 0:
        return out
    if parts.stride(2) != 1 or parts.stride(1) != num_splits:
        parts = parts.contiguous()
    _reduce_splits_kernel[(num_rows,)](parts[0], parts[1].view(torch.int32), out, num_splits,
                                       SPLITS=triton.next_power_of_2(max(max_splits,
                                                                         num_splits)))
    return out


def sample_vocab_shard(logits: Tensor, temperature: Tensor | None, greedy_mask: Tensor | None,
                       philox: Tensor | None, token_offset: int, vocab: int, ranks: int,
                       gather: Callable[[Tensor], Tensor],
                       config: SamplingKernelConfig = DEFAULT_CONFIG,
                       num_splits: int | None = None) -> Tensor:
    """`fused_sample`'s tokens for the whole vocabulary from this rank's slice of it (see
    `split_winners` for the slice's arguments): `gather` concatenates every rank's
    [..., n] in rank order on the last dimension (an all-gather of each row's few split
    winners instead of its logits). Every rank reduces the same gathered bits, so every rank
    gets the same tokens."""
    parts = gather(split_winners(logits, temperature, greedy_mask, philox, token_offset, vocab,
                                 config, num_splits))
    return reduce_winners(parts, ranks * triton.cdiv(logits.shape[1], config.block))
