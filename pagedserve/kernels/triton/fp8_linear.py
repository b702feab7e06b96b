"""Triton kernels of FP8 linear layers (`model.fp8`) and `linear`, the FP8 matmul CUDA models
take (`model.ops.select_ops`); imported on CUDA only (or under TRITON_INTERPRET=1 in tests).

`linear`: y = (x_q * s_x) @ (W_q * s_w)^T through `torch._scaled_mm`, which applies both
per-row scales in its epilogue (row-wise scaling: Ada or Hopper, bf16 output); decode steps
of at most `MAX_WEIGHT_ONLY_ROWS` tokens take `weight_only_linear` instead.

`quantize_tokens`: activations to e4m3, one scale per token, in one launch where eager
PyTorch needs five (abs, amax, divide, clamp, cast), ahead of `torch._scaled_mm`.

`weight_only_linear`: the decode steps' few tokens. There `_scaled_mm` does not stream the
weights at memory bandwidth and the activations' quantization is one launch more per layer,
while the step's time should be the weights' bytes over bandwidth. So the e4m3 weight is cast
in registers and multiplied with the activations as they are (no activation rounding either).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from torch import Tensor

from pagedserve.kernels.fp8_format import FP8_DTYPE, FP8_MAX, MIN_AMAX
from pagedserve.kernels.triton import pdl
from pagedserve.kernels.triton.arrivals import split_buffers, sum_slices
from pagedserve.kernels.triton.e4m3 import (E4M3_WORD_F32_UNSCALE, e4m3_to, e4m3_word_f32,
                                            round_to_e4m3)
from pagedserve.kernels.triton.precision import dot_precision

_FP8_MAX = tl.constexpr(FP8_MAX)
_MIN_AMAX = tl.constexpr(MIN_AMAX)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, stride_x, N: tl.constexpr,
                          BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0), _MIN_AMAX) / _FP8_MAX
    q = round_to_e4m3(tl.clamp(x / scale, -_FP8_MAX, _FP8_MAX))
    tl.store(q_ptr + row * N + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


def quantize_tokens(x: Tensor) -> tuple[Tensor, Tensor]:
    """`quantize_rows` of activations x [T, K] in one Triton launch (CUDA, or the CPU under
    TRITON_INTERPRET=1) -> (e4m3 [T, K], float32 scales [T, 1], as `_scaled_mm` takes them)."""
    assert x.stride(-1) == 1, "rows must be contiguous"
    num_rows, n = x.shape
    q = torch.empty((num_rows, n), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((num_rows, 1), dtype=torch.float32, device=x.device)
    if num_rows > 0:
        block = triton.next_power_of_2(n)
        _quantize_rows_kernel[(num_rows,)](x, q, scale, x.stride(0), N=n, BLOCK=block,
                                           num_warps=min(16, max(4, block // 1024)))
    return q, scale


@triton.jit
def _weight_only_epilogue(acc, w_scale_ptr, bias_ptr, y_ptr, offs_m, offs_n, m_mask, n_mask,
                          stride_ym, HAS_BIAS: tl.constexpr):
    acc *= tl.load(w_scale_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _weight_only_kernel(x_ptr, w_ptr, w_scale_ptr, bias_ptr, y_ptr, part_ptr, arrivals_ptr,
                        M, N, K, k_per_split, stride_xm, stride_wn, stride_ym,
                        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                        DOT_PRECISION: tl.constexpr, BITS: tl.constexpr):
    """y[:, n-tile] = (x @ W_q[n-tile]^T) * s_w[n-tile] (+ bias): the e4m3 weight rows are
    cast to x's dtype in registers, the M rows of x (padded to BLOCK_M) ride along.

    With SPLIT_K > 1 program (n, s) sums only K's slice s and the last of the n-tile's
    programs to arrive adds the partials up and applies the epilogue (`arrivals.sum_slices`).

    Launched with PDL (`pdl`), it may start before the kernel that writes x has finished: it
    reads x, and writes anything, only after `pdl.wait_for_previous`."""
    pdl.allow_dependents()
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    k_start = pid_k * k_per_split
    k_stop = tl.minimum(k_start + k_per_split, K)
    pdl.wait_for_previous()
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn  # W^T's columns: W's rows
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_start, k_stop, BLOCK_K):
        k_mask = (k0 + offs_k) < K
        x = tl.load(x_rows + (k0 + offs_k)[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_cols + (k0 + offs_k)[:, None],
                    mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc += tl.dot(x, e4m3_to(w, x.dtype, BITS), input_precision=DOT_PRECISION)
    if SPLIT_K == 1:
        _weight_only_epilogue(acc, w_scale_ptr, bias_ptr, y_ptr, offs_m, offs_n, m_mask,
                              n_mask, stride_ym, HAS_BIAS)
    else:
        # partials are [SPLIT_K, M, N]
        mn = offs_m[:, None] * N + offs_n[None, :]
        mn_mask = m_mask[:, None] & n_mask[None, :]
        last, total = sum_slices(acc, part_ptr, arrivals_ptr, mn, mn_mask, pid_n, pid_k,
                                  M * N, SPLIT_K)
        if last:
            _weight_only_epilogue(total, w_scale_ptr, bias_ptr, y_ptr, offs_m, offs_n,
                                  m_mask, n_mask, stride_ym, HAS_BIAS)


@triton.jit
def _add_times_x(acc, w, x_ptr, cols, c_stop):
    """acc [BLOCK_N, WORDS] + weight words w [BLOCK_N, WORDS] (int32, four e4m3 values each)
    times x at the words' columns `cols` [WORDS] (x[4c:4c+4] for word column c; none at or
    past c_stop), per element in float32, scaled by 2^-120 (`e4m3_word_f32`): four FMAs a
    word."""
    WORDS: tl.constexpr = w.shape[1]
    xs = tl.load(x_ptr + 4 * cols[:, None] + tl.arange(0, 4)[None, :],
                 mask=(cols < c_stop)[:, None], other=0.0).to(tl.float32)
    even, odd = tl.split(tl.reshape(xs, (WORDS, 2, 2)))  # x[4c + 2p + q]: q = 0, q = 1
    x0, x2 = tl.split(even)
    x1, x3 = tl.split(odd)
    acc += e4m3_word_f32(w, 0) * x0[None, :]
    acc += e4m3_word_f32(w, 1) * x1[None, :]
    acc += e4m3_word_f32(w, 2) * x2[None, :]
    acc += e4m3_word_f32(w, 3) * x3[None, :]
    return acc


@triton.jit
def _row_times_w(x_ptr, w_ptr, rows, mask, k_start, k_stop, stride_wn, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, EVICT: tl.constexpr):
    """One row x[k_start:k_stop] times W[rows, k_start:k_stop]^T -> [BLOCK_N] float32,
    without tl.dot: each thread multiplies and adds its own weights in float32 over the whole
    loop, and the threads' sums meet once at the end. tl.dot would pad the row to 16 (shared
    memory for 15 rows of zeros, fewer programs per SM) and wants the weight in x's dtype.

    The weights are read as int32 words (K, k_start, k_stop and the row stride multiples of
    4) and converted by `e4m3_word_f32`: at one token the loop's integer and float
    instructions, not memory, were what set its pace, and words need the fewest. Triton's
    pipeliner stages only a dot's operands in shared memory, so the next tile's weights are
    loaded by hand, one iteration ahead, into registers. EVICT: the weights' eviction
    policy ("evict_first": read once, they need not stay in cache)."""
    WORDS: tl.constexpr = BLOCK_K // 4
    offs_c = tl.arange(0, WORDS)
    w_rows = w_ptr.to(tl.pointer_type(tl.int32)) + rows.to(tl.int64)[:, None] * (stride_wn // 4)
    c_start, c_stop = k_start // 4, k_stop // 4
    acc = tl.zeros([BLOCK_N, WORDS], tl.float32)
    w = tl.load(w_rows + (c_start + offs_c)[None, :],
                mask=mask[:, None] & ((c_start + offs_c) < c_stop)[None, :], other=0,
                eviction_policy=EVICT)
    pdl.wait_for_previous()  # x is the previous kernel's output; the weights are not
    for c0 in range(c_start, c_stop, WORDS):
        c_next = c0 + WORDS + offs_c
        w_next = tl.load(w_rows + c_next[None, :],
                         mask=mask[:, None] & (c_next < c_stop)[None, :], other=0,
                         eviction_policy=EVICT)
        acc = _add_times_x(acc, w, x_ptr, c0 + offs_c, c_stop)
        w = w_next
    return tl.sum(acc, 1) * E4M3_WORD_F32_UNSCALE


@triton.jit
def _one_row_kernel(x_ptr, w_ptr, w_scale_ptr, bias_ptr, y_ptr, part_ptr, arrivals_ptr, N, K,
                    k_per_split, stride_wn, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, EVICT: tl.constexpr):
    """`_weight_only_kernel` for one row (batch-1 decode), without tl.dot (`_row_times_w`).
    Split K as there, partials [SPLIT_K, N]; PDL as there, but the first weight tile is
    loaded before the wait."""
    pdl.allow_dependents()
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = rows < N
    k_start = pid_k * k_per_split
    k_stop = tl.minimum(k_start + k_per_split, K)
    acc = _row_times_w(x_ptr, w_ptr, rows, mask, k_start, k_stop, stride_wn, BLOCK_N,
                       BLOCK_K, EVICT)
    zero = tl.zeros([1], tl.int32)  # the one row, for the epilogue's [M, N] tiles
    if SPLIT_K == 1:
        _weight_only_epilogue(acc[None, :], w_scale_ptr, bias_ptr, y_ptr, zero, rows,
                              zero == 0, mask, 0, HAS_BIAS)
    else:
        last, total = sum_slices(acc, part_ptr, arrivals_ptr, rows, mask, pid_n, pid_k, N,
                                  SPLIT_K)
        if last:
            _weight_only_epilogue(total[None, :], w_scale_ptr, bias_ptr, y_ptr, zero, rows,
                                  zero == 0, mask, 0, HAS_BIAS)


@dataclass(frozen=True)
class WeightOnlyConfig:
    """Tiles of `weight_only_linear`. BLOCK_N is small and BLOCK_K long so that each program
    keeps many weight bytes in flight (a decode step's linear layers are bound by reading
    weights). 32 rather than 16 rows per program: in the sweep of `benchmarks/fp8.py --parts
    gemv --sweep`, 16-row tiles were no faster than bf16 (docs/benchmarks.md, "FP8 KV cache and
    FP8 weights").

    A projection of few rows (N / block_n programs) does not fill the GPU: a 4096-row one
    gives about one program per SM of a large GPU, each streaming all of K. So K is split until there are
    `programs_per_sm` programs per SM (`split_k`; 0: never split). `bits`: tl.dot's weight
    is converted by `e4m3.e4m3_bits` rather than Triton's cast. `fma`: a single row (batch
    1) is multiplied without tl.dot (`_row_times_w`, which always reads the weight as words
    of bits): that is `WEIGHT_ONLY_ONE_ROW`, the batch-1 default, whose small tiles and
    programs make many loads in flight per SM without the shared memory of tl.dot's padded
    rows."""

    block_n: int = 32
    block_k: int = 512
    num_warps: int = 4
    num_stages: int = 4
    programs_per_sm: int = 4
    bits: bool = True  # tl.dot's weight by bit moves: faster (docs/benchmarks.md, FP8)
    fma: bool = False
    # one row: the weights loaded with eviction_policy="evict_first" (read once; a shorter
    # 8B batch-1 step: docs/benchmarks.md, "the batch-1 FP8 step")
    evict_first: bool = True
    # one row: tiles of fewer rows (down to this many, each as many bytes) while a
    # projection has too few rows for programs_per_sm programs per SM (0: block_n always)
    min_block_n: int = 0


# The launch settings `weight_only_linear` takes when given none (read at each call): for one
# row (batch-1 decode) and for 2-16 rows; chosen by the sweeps of `benchmarks/fp8.py
# --parts gemv,8b-tpot --sweep` (docs/benchmarks.md, "FP8 KV cache and FP8 weights").
WEIGHT_ONLY_ONE_ROW = WeightOnlyConfig(block_n=16, block_k=256, programs_per_sm=5, fma=True,
                                       min_block_n=4)
WEIGHT_ONLY = WeightOnlyConfig()

# Token counts up to which `linear` takes `weight_only_linear` (tl.dot's 16 rows)
MAX_WEIGHT_ONLY_ROWS = 16


def narrowed(n: int, num_sms: int, cfg: WeightOnlyConfig) -> WeightOnlyConfig:
    """cfg with tiles of fewer, longer rows (the same bytes) until n rows make
    cfg.programs_per_sm programs per SM, down to cfg.min_block_n rows; K is split only past
    that (`split_k`). A program that streams whole rows of K needs no partial sums, and its
    loads run along each row for longer: Llama-3-8B's q/k/v and o projections ran faster in
    narrower tiles over all of K than in 16-row tiles with K split (docs/benchmarks.md, "the
    batch-1 FP8 step")."""
    block_n = cfg.block_n
    while 0 < cfg.min_block_n < block_n and n < cfg.programs_per_sm * num_sms * block_n:
        block_n //= 2
    if block_n == cfg.block_n:
        return cfg
    return replace(cfg, block_n=block_n, block_k=cfg.block_k * cfg.block_n // block_n)


def split_k(n: int, k: int, num_sms: int, cfg: WeightOnlyConfig) -> tuple[int, int]:
    """(slices of K, K per slice, a multiple of block_k): the fewest slices that give
    cfg.programs_per_sm programs per SM, no more than K has tiles, none of them empty."""
    k_tiles = triton.cdiv(k, cfg.block_k)
    n_tiles = triton.cdiv(n, cfg.block_n)
    wanted = min(k_tiles, triton.cdiv(cfg.programs_per_sm * num_sms, n_tiles))
    tiles_per_split = triton.cdiv(k_tiles, max(1, wanted))
    return triton.cdiv(k_tiles, tiles_per_split), tiles_per_split * cfg.block_k


def one_row_tiles(n: int, k: int, num_sms: int,
                  cfg: WeightOnlyConfig) -> tuple[WeightOnlyConfig, int, int]:
    """What `_one_row_kernel` launches for an [n, k] weight: (cfg `narrowed` to n, slices of
    K, K per slice)."""
    cfg = narrowed(n, num_sms, cfg)
    return (cfg, *split_k(n, k, num_sms, cfg))


@functools.cache
def num_sms(device: torch.device) -> int:
    """The SMs a launch on `device` spreads over (1 off CUDA: the interpreter runs one
    program at a time)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def linear(x: Tensor, weight: Tensor, weight_scale: Tensor,
           bias: Tensor | None = None) -> Tensor:
    """x [..., K] @ the e4m3 weight [N, K] with scales [N]^T (+ bias) -> [..., N] in x's dtype:
    what `model.fp8.reference_linear` computes, on CUDA."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if rows.shape[0] <= MAX_WEIGHT_ONLY_ROWS:
        y = weight_only_linear(rows, weight, weight_scale, bias)
        return y.view(*x.shape[:-1], weight.shape[0])
    x_q, x_scale = quantize_tokens(rows)
    # weight.t() is column-major, as the second operand must be; row-wise scales want a
    # bf16 result
    y = torch._scaled_mm(x_q, weight.t(), scale_a=x_scale, scale_b=weight_scale.view(1, -1),
                         out_dtype=torch.bfloat16).to(x.dtype)
    if bias is not None:
        y += bias
    return y.view(*x.shape[:-1], weight.shape[0])


def weight_only_linear(x: Tensor, weight: Tensor, weight_scale: Tensor,
                       bias: Tensor | None = None,
                       cfg: WeightOnlyConfig | None = None) -> Tensor:
    """x [M <= 16, K] (rows contiguous) @ the e4m3 weight [N, K] with per-row scales [N]^T
    (+ bias) -> [M, N] in x's dtype, without quantizing x: one launch, no host sync (CUDA
    graphs capture it; a split-K launch's float32 partials come from torch.empty, which a
    graph's memory pool serves)."""
    num_rows, k = x.shape
    cfg = cfg or (WEIGHT_ONLY_ONE_ROW if num_rows == 1 else WEIGHT_ONLY)
    if num_rows == 1 and cfg.fma and _in_words(weight):
        return _one_row_linear(x, weight, weight_scale, bias, cfg)
    n = weight.shape[0]
    assert num_rows <= MAX_WEIGHT_ONLY_ROWS and x.stride(-1) == 1 and weight.stride(-1) == 1
    y = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return y
    splits, k_per_split = split_k(n, k, num_sms(x.device), cfg)
    n_tiles = triton.cdiv(n, cfg.block_n)
    parts, arrivals = split_buffers(splits, num_rows * n, n_tiles, y)
    _weight_only_kernel[(n_tiles, splits)](
        x, weight, weight_scale, weight_scale if bias is None else bias, y, parts, arrivals,
        num_rows, n, k, k_per_split, x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=MAX_WEIGHT_ONLY_ROWS, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, SPLIT_K=splits, DOT_PRECISION=dot_precision(x.dtype),
        BITS=cfg.bits, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **pdl.launch_options())
    return y


def _in_words(weight: Tensor) -> bool:
    """Whether the one-row kernels can read the e4m3 weight's rows as int32 words (K, the
    row stride and the start multiples of 4 bytes; any model's hidden sizes are); else the
    tl.dot kernel takes the row."""
    return (weight.shape[1] % 4 == 0 and weight.stride(0) % 4 == 0
            and weight.data_ptr() % 4 == 0)


def _one_row_linear(x: Tensor, weight: Tensor, weight_scale: Tensor, bias: Tensor | None,
                    cfg: WeightOnlyConfig) -> Tensor:
    """`weight_only_linear` of one token x [1, K] by `_one_row_kernel`, with tiles
    `narrowed` to the weight's rows."""
    k, n, sms = x.shape[1], weight.shape[0], num_sms(x.device)
    assert x.stride(-1) == 1 and weight.stride(-1) == 1
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    cfg, splits, k_per_split = one_row_tiles(n, k, sms, cfg)
    n_tiles = triton.cdiv(n, cfg.block_n)
    parts, arrivals = split_buffers(splits, n, n_tiles, y)
    _one_row_kernel[(n_tiles, splits)](
        x, weight, weight_scale, weight_scale if bias is None else bias, y, parts, arrivals,
        n, k, k_per_split, weight.stride(0), HAS_BIAS=bias is not None, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, SPLIT_K=splits,
        EVICT="evict_first" if cfg.evict_first else "", num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **pdl.launch_options())
    return y
