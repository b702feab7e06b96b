"""Triton kernels of FP8 linear layers (`model.fp8`); imported on CUDA only (or under
TRITON_INTERPRET=1 in tests).

`quantize_tokens`: activations to e4m3, one scale per token, in one launch where eager
PyTorch needs five (abs, amax, divide, clamp, cast), ahead of `torch._scaled_mm`.

`weight_only_linear`: the decode steps' few tokens. There `_scaled_mm` does not stream the
weights at memory bandwidth and the activations' quantization is one launch more per layer,
while the step's time should be the weights' bytes over bandwidth. So the e4m3 weight is cast
in registers and multiplied with the activations as they are (no activation rounding either).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from pagedserve.attention.kernels.arrivals import arrival_counters
from pagedserve.attention.kernels import pdl
from pagedserve.attention.kernels.e4m3 import e4m3_to
from pagedserve.attention.kernels.precision import dot_precision
from pagedserve.attention.kernels.store_kv import round_to_e4m3
from pagedserve.attention.kv_quant import FP8_DTYPE, FP8_MAX
from pagedserve.model.fp8 import MIN_AMAX, Rope
from pagedserve.model.triton_ops import round_to

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
def _sum_slices(acc, part_ptr, arrivals_ptr, offs, mask, pid_n, pid_k, slice_size,
                SPLIT_K: tl.constexpr):
    """Split K: store this program's partial (float32, slice pid_k of [SPLIT_K, slice_size]);
    the last of the n-tile's SPLIT_K programs to arrive gets (True, the partials added up in
    slice order: the same sum whichever arrives last), the others (False, zeros)."""
    tl.store(part_ptr + pid_k * slice_size + offs, acc, mask=mask)
    # Every thread's partial stores happen before the barrier, the barrier before the
    # counter's release: the program that sees the last arrival sees every partial.
    tl.debug_barrier()
    counter = arrivals_ptr + pid_n
    last = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1
    total = tl.zeros_like(acc)
    if last:
        for s in range(SPLIT_K):  # written by other programs: read from L2 (.cg)
            total += tl.load(part_ptr + s * slice_size + offs, mask=mask, other=0.0,
                             cache_modifier=".cg")
        tl.store(counter, 0)  # zero again for the next launch (CUDA-graph replays)
    return last, total


@triton.jit
def _weight_only_kernel(x_ptr, w_ptr, w_scale_ptr, bias_ptr, y_ptr, part_ptr, arrivals_ptr,
                        M, N, K, k_per_split, stride_xm, stride_wn, stride_ym,
                        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                        DOT_PRECISION: tl.constexpr, BITS: tl.constexpr):
    """y[:, n-tile] = (x @ W_q[n-tile]^T) * s_w[n-tile] (+ bias): the e4m3 weight rows are
    cast to x's dtype in registers, the M rows of x (padded to BLOCK_M) ride along.

    With SPLIT_K > 1 program (n, s) sums only K's slice s and the last of the n-tile's
    programs to arrive adds the partials up and applies the epilogue (`_sum_slices`).

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
        last, total = _sum_slices(acc, part_ptr, arrivals_ptr, mn, mn_mask, pid_n, pid_k,
                                  M * N, SPLIT_K)
        if last:
            _weight_only_epilogue(total, w_scale_ptr, bias_ptr, y_ptr, offs_m, offs_n,
                                  m_mask, n_mask, stride_ym, HAS_BIAS)


# What a one-row product's epilogue does with its tile (`_one_row_kernel`'s PAIRS)
PLAIN, SILU_AND_MUL, ROPE = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


@triton.jit
def _tile_rows(pid_n, N, BLOCK_N: tl.constexpr, PAIRS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The weight rows of output tile pid_n, and their mask. A paired tile holds BLOCK_N / 2
    pairs of rows, interleaved, that its epilogue combines: gate row i with up row i + N / 2
    (SILU_AND_MUL), a head's element d with d + HEAD_DIM / 2 (ROPE)."""
    r = tl.arange(0, BLOCK_N)
    pair = pid_n * (BLOCK_N // 2) + r // 2
    half: tl.constexpr = HEAD_DIM // 2
    if PAIRS == PLAIN:
        rows = pid_n * BLOCK_N + r
    elif PAIRS == SILU_AND_MUL:
        rows = pair + (r % 2) * (N // 2)
    else:
        rows = (pair // half) * HEAD_DIM + pair % half + (r % 2) * half
    return rows, rows < N if PAIRS == PLAIN else pair < N // 2


@triton.jit
def _row_times_w(x_ptr, w_ptr, rows, mask, k_start, k_stop, stride_wn, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, BITS: tl.constexpr, EVICT: tl.constexpr):
    """One row x[k_start:k_stop] times W[rows, k_start:k_stop]^T -> [BLOCK_N] float32,
    without tl.dot: each thread multiplies and adds its own weights in float32 over the whole
    loop, and the threads' sums meet once at the end. tl.dot would pad the row to 16 (shared
    memory for 15 rows of zeros, fewer programs per SM) and wants the weight in x's dtype.
    Triton's pipeliner stages only a dot's operands in shared memory, so the next tile's
    weights are loaded by hand, one iteration ahead, into registers. EVICT: the weights'
    eviction policy ("evict_first": read once, they need not stay in cache)."""
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    w = tl.load(w_rows + (k_start + offs_k)[None, :],
                mask=mask[:, None] & ((k_start + offs_k) < k_stop)[None, :], other=0.0,
                eviction_policy=EVICT)
    pdl.wait_for_previous()  # x is the previous kernel's output; the weights are not
    for k0 in range(k_start, k_stop, BLOCK_K):
        k_next = k0 + BLOCK_K + offs_k
        w_next = tl.load(w_rows + k_next[None, :],
                         mask=mask[:, None] & (k_next < k_stop)[None, :], other=0.0,
                         eviction_policy=EVICT)
        x = tl.load(x_ptr + k0 + offs_k, mask=(k0 + offs_k) < k_stop, other=0.0)
        acc += e4m3_to(w, tl.float32, BITS) * x.to(tl.float32)[None, :]
        w = w_next
    return tl.sum(acc, 1)


@triton.jit
def _one_row_epilogue(acc, rows, mask, pid_n, w_scale_ptr, bias_ptr, y_ptr, pos_ptr, cos_ptr,
                      sin_ptr, N, HAS_BIAS: tl.constexpr, ADD: tl.constexpr,
                      PAIRS: tl.constexpr, NUM_ROT: tl.constexpr, HEAD_DIM: tl.constexpr,
                      BLOCK_N: tl.constexpr):
    """Scale (+ bias) the tile's sums, round them to y's dtype as the unfused layer's output,
    then: ADD them to y (the residual stream, in place, rounded as `triton_ops.rms_norm`
    adds), or store silu(gate) * up (SILU_AND_MUL, as `triton_ops.silu_and_mul`), or rotate
    the q and k heads by the token's position (ROPE, as `triton_ops.rotate_qk_`; the first
    NUM_ROT heads, v heads pass through), or store them as they are."""
    dtype = y_ptr.dtype.element_ty
    y = acc * tl.load(w_scale_ptr + rows, mask=mask, other=0.0)
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=mask, other=0.0).to(tl.float32)
    y = round_to(y, dtype)
    if PAIRS == PLAIN:
        if ADD:
            y = y + tl.load(y_ptr + rows, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + rows, y.to(dtype), mask=mask)
    else:
        a, b = tl.split(tl.reshape(y, (BLOCK_N // 2, 2)))  # rows 2i and 2i + 1 of the tile
        pair = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        pair_mask = pair < N // 2
        if PAIRS == SILU_AND_MUL:
            act = round_to(a / (1.0 + tl.exp(-a)), dtype)  # F.silu's output tensor
            tl.store(y_ptr + pair, (act * b).to(dtype), mask=pair_mask)
        else:
            half: tl.constexpr = HEAD_DIM // 2
            head = pair // half
            d = pair % half
            # cos is [cos, cos], sin sign-folded [-sin, sin] (decoder.py)
            pos = tl.load(pos_ptr).to(tl.int64)
            cos = tl.load(cos_ptr + pos * HEAD_DIM + d, mask=pair_mask, other=0.0)
            sin = tl.load(sin_ptr + pos * HEAD_DIM + half + d, mask=pair_mask, other=0.0)
            cos, sin = cos.to(tl.float32), sin.to(tl.float32)
            rotate = head < NUM_ROT
            out1 = tl.where(rotate, round_to(a * cos, dtype) - round_to(b * sin, dtype), a)
            out2 = tl.where(rotate, round_to(b * cos, dtype) + round_to(a * sin, dtype), b)
            lo = y_ptr + head * HEAD_DIM + d
            tl.store(lo, out1.to(dtype), mask=pair_mask)
            tl.store(lo + half, out2.to(dtype), mask=pair_mask)


@triton.jit
def _one_row_kernel(x_ptr, w_ptr, w_scale_ptr, bias_ptr, y_ptr, part_ptr, arrivals_ptr,
                    pos_ptr, cos_ptr, sin_ptr, N, K, k_per_split, stride_wn,
                    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    SPLIT_K: tl.constexpr, BITS: tl.constexpr, EVICT: tl.constexpr,
                    ADD: tl.constexpr, PAIRS: tl.constexpr, NUM_ROT: tl.constexpr,
                    HEAD_DIM: tl.constexpr):
    """`_weight_only_kernel` for one row (batch-1 decode), with the elementwise work after
    the projection fused: the residual add (ADD), SiLU-and-mul or RoPE (PAIRS). Split K as there; the epilogue runs once per output, in
    the program that finishes its tile. PDL as there: the first weight tile is loaded before
    the wait."""
    pdl.allow_dependents()
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows, mask = _tile_rows(pid_n, N, BLOCK_N, PAIRS, HEAD_DIM)
    k_start = pid_k * k_per_split
    k_stop = tl.minimum(k_start + k_per_split, K)
    acc = _row_times_w(x_ptr, w_ptr, rows, mask, k_start, k_stop, stride_wn, BLOCK_N,
                       BLOCK_K, BITS, EVICT)
    if SPLIT_K == 1:
        _one_row_epilogue(acc, rows, mask, pid_n, w_scale_ptr, bias_ptr, y_ptr, pos_ptr,
                          cos_ptr, sin_ptr, N, HAS_BIAS, ADD, PAIRS, NUM_ROT, HEAD_DIM, BLOCK_N)
    else:  # partials are [SPLIT_K, N], by weight row
        last, total = _sum_slices(acc, part_ptr, arrivals_ptr, rows, mask, pid_n, pid_k, N,
                                  SPLIT_K)
        if last:
            _one_row_epilogue(total, rows, mask, pid_n, w_scale_ptr, bias_ptr, y_ptr,
                              pos_ptr, cos_ptr, sin_ptr, N, HAS_BIAS, ADD, PAIRS, NUM_ROT,
                              HEAD_DIM, BLOCK_N)


@dataclass(frozen=True)
class WeightOnlyConfig:
    """Tiles of `weight_only_linear`. BLOCK_N is small and BLOCK_K long so that each program
    keeps many weight bytes in flight (a decode step's linear layers are bound by reading
    weights). 32 rather than 16 rows per program: the H100 sweep of `benchmarks/fp8.py
    --parts gemv --sweep` (docs/benchmarks.md) had 16-row tiles no faster than bf16.

    A projection of few rows (N / block_n programs) does not fill the GPU: a 4096-row one
    gives 128 programs for 132 SMs, each streaming all of K. So K is split until there are
    `programs_per_sm` programs per SM (`split_k`; 0: never split). `bits`: the weight is
    converted by `e4m3.e4m3_bits` rather than Triton's cast. `fma`: a single row (batch 1)
    is multiplied without tl.dot (`_row_times_w`): that is `WEIGHT_ONLY_ONE_ROW`, the batch-1
    default, whose small tiles and programs make many loads in flight per SM without the
    shared memory of tl.dot's padded rows."""

    block_n: int = 32
    block_k: int = 512
    num_warps: int = 4
    num_stages: int = 4
    programs_per_sm: int = 4
    bits: bool = True  # the H100's Llama-3-8B batch-1 TPOT: 4.48 ms with, 4.70 without
    fma: bool = False
    evict_first: bool = False  # one row: weights loaded with eviction_policy="evict_first"


# The launch settings `weight_only_linear` takes when given none (read at each call): for one
# row (batch-1 decode) and for 2-16 rows; chosen by the H100 sweeps of `benchmarks/fp8.py
# --parts gemv,8b-tpot --sweep` (docs/benchmarks.md, FP8).
WEIGHT_ONLY_ONE_ROW = WeightOnlyConfig(block_n=16, block_k=256, programs_per_sm=8, fma=True)
WEIGHT_ONLY = WeightOnlyConfig()

# Token counts up to which `fp8.fp8_linear` takes `weight_only_linear` (tl.dot's 16 rows)
MAX_WEIGHT_ONLY_ROWS = 16


def split_k(n: int, k: int, num_sms: int, cfg: WeightOnlyConfig) -> tuple[int, int]:
    """(slices of K, K per slice, a multiple of block_k): the fewest slices that give
    cfg.programs_per_sm programs per SM, no more than K has tiles, none of them empty."""
    k_tiles = triton.cdiv(k, cfg.block_k)
    n_tiles = triton.cdiv(n, cfg.block_n)
    wanted = min(k_tiles, triton.cdiv(cfg.programs_per_sm * num_sms, n_tiles))
    tiles_per_split = triton.cdiv(k_tiles, max(1, wanted))
    return triton.cdiv(k_tiles, tiles_per_split), tiles_per_split * cfg.block_k


@functools.cache
def num_sms(device: torch.device) -> int:
    """The SMs a launch on `device` spreads over (1 off CUDA: the interpreter runs one
    program at a time)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def weight_only_linear(x: Tensor, weight: Tensor, weight_scale: Tensor,
                       bias: Tensor | None = None,
                       cfg: WeightOnlyConfig | None = None) -> Tensor:
    """x [M <= 16, K] (rows contiguous) @ the e4m3 weight [N, K] with per-row scales [N]^T
    (+ bias) -> [M, N] in x's dtype, without quantizing x: one launch, no host sync (CUDA
    graphs capture it; a split-K launch's float32 partials come from torch.empty, which a
    graph's memory pool serves)."""
    num_rows, k = x.shape
    cfg = cfg or (WEIGHT_ONLY_ONE_ROW if num_rows == 1 else WEIGHT_ONLY)
    if num_rows == 1 and cfg.fma:
        return one_row_linear(x, weight, weight_scale, bias, cfg=cfg)
    n = weight.shape[0]
    assert num_rows <= MAX_WEIGHT_ONLY_ROWS and x.stride(-1) == 1 and weight.stride(-1) == 1
    y = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return y
    splits, k_per_split = split_k(n, k, num_sms(x.device), cfg)
    n_tiles = triton.cdiv(n, cfg.block_n)
    parts, arrivals = _split_buffers(splits, num_rows * n, n_tiles, x.device, y)
    _weight_only_kernel[(n_tiles, splits)](
        x, weight, weight_scale, weight_scale if bias is None else bias, y, parts, arrivals,
        num_rows, n, k, k_per_split, x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=MAX_WEIGHT_ONLY_ROWS, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, SPLIT_K=splits, DOT_PRECISION=dot_precision(x.dtype),
        BITS=cfg.bits, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **pdl.launch_options())
    return y


def _split_buffers(splits: int, size: int, n_tiles: int, device: torch.device,
                   unused: Tensor) -> tuple[Tensor, Tensor]:
    """(float32 partials [splits, size], arrival counters) of a split-K launch; `unused`
    (never read) for both when K is whole."""
    if splits == 1:
        return unused, unused
    parts = torch.empty((splits, size), dtype=torch.float32, device=device)
    return parts, arrival_counters(n_tiles, device)


def one_row_linear(x: Tensor, weight: Tensor, weight_scale: Tensor,
                   bias: Tensor | None = None, *, add_to: Tensor | None = None,
                   silu_and_mul: bool = False, rope: Rope | None = None,
                   cfg: WeightOnlyConfig | None = None) -> Tensor:
    """One token x [1, K] @ the e4m3 weight [N, K]^T * scales (+ bias), with the elementwise
    op after a projection in a batch-1 decode step fused into its launch:

    - add_to (the residual stream [1, N]): the product is added into it in place, and it is
      returned;
    - silu_and_mul: the weight is the fused gate/up [2I, K]; returns silu(gate) * up [1, I];
    - rope: the weight is the fused q/k/v; returns its product with q and k rotated.

    Each is a few loads and stores by the program that already holds the product, where a
    kernel of its own costs a launch and a round trip to memory in the step's critical
    path (`DecoderLayer.forward_one_row`)."""
    cfg = cfg or WEIGHT_ONLY_ONE_ROW
    (num_rows, k), n = x.shape, weight.shape[0]
    assert num_rows == 1 and x.stride(-1) == 1 and weight.stride(-1) == 1
    assert (add_to is not None) + silu_and_mul + (rope is not None) <= 1
    if add_to is not None:
        assert add_to.shape == (1, n) and add_to.dtype == x.dtype and add_to.stride(-1) == 1
        y = add_to
    else:
        y = torch.empty((1, n // 2 if silu_and_mul else n), dtype=x.dtype, device=x.device)
    splits, k_per_split = split_k(n, k, num_sms(x.device), cfg)
    n_tiles = triton.cdiv(n, cfg.block_n)
    parts, arrivals = _split_buffers(splits, n, n_tiles, x.device, y)
    pairs = SILU_AND_MUL if silu_and_mul else ROPE if rope is not None else PLAIN
    assert pairs == PLAIN or (n % 2 == 0 and cfg.block_n % 2 == 0)
    pos, cos, sin = ((rope.positions, rope.cos, rope.sin) if rope is not None
                     else (weight_scale,) * 3)  # unused pointers
    _one_row_kernel[(n_tiles, splits)](
        x, weight, weight_scale, weight_scale if bias is None else bias, y, parts, arrivals,
        pos, cos, sin, n, k, k_per_split, weight.stride(0), HAS_BIAS=bias is not None,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=splits, BITS=cfg.bits,
        EVICT="evict_first" if cfg.evict_first else "", ADD=add_to is not None,
        PAIRS=pairs.value, NUM_ROT=rope.num_rot_heads if rope else 0,
        HEAD_DIM=rope.head_dim if rope else 2, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **pdl.launch_options())
    return y
