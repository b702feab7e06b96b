"""The decode steps' float matmul on CUDA: y = x W^T (+ b) for ONE row of activations (a
decode step of one token) against a weight W [N, K] in their dtype, row-major as nn.Linear
keeps it. `linear` is the float linears' matmul CUDA models take (`model.ops.select_ops`):
the GEMV for one bf16 or fp16 row, cuBLAS for everything else (float32, which a model is run
in for exactness, included). Imported on CUDA only (or under TRITON_INTERPRET=1 in tests).

Why: a decode step of one token reads each weight once and does two flops per weight, so a
matmul should take the weight's bytes over memory bandwidth. cuBLAS comes close on large
matrices, but on a tensor-parallel rank's slices (a quarter or half of each projection) its
kernels leave SMs waiting or split K into a second, reducing launch. Here K is split until
the grid has `programs_per_sm` programs per SM (`fp8_linear.one_row_tiles`, the FP8
weight-only kernels' tile rule: rows per tile first narrowed, then K split), and the last
of an output tile's programs to arrive adds the partials up (`arrivals.sum_slices`): one
launch, no memset, CUDA graphs replay it as captured. Launched with PDL (`pdl`), a program loads its
first weight tile before it waits for the previous kernel.

`_fma_kernel` multiplies without tl.dot, as `fp8_linear`'s one-row kernel does: each thread
multiplies and adds its own weights in float32 over the whole loop, and the sums meet once
at the end. Why one row only: from two rows on cuBLAS is faster. FMAs' cost grows with the
rows (each row is another multiply-add per weight and another accumulator), and tl.dot pads
the rows to 16 in shared memory and tensor-core time, which costs more than cuBLAS's own
tiles do (docs/benchmarks.md, "The float matmul's decode GEMV").

Rounding: float32 sums, the bias added in float32, one rounding to the output dtype: as
cuBLAS's half-precision GEMM with F.linear's bias, up to the order of the sums.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from pagedserve.kernels.triton import pdl
from pagedserve.kernels.triton.arrivals import finish_row, split_buffers
from pagedserve.kernels.triton.fp8_linear import WeightOnlyConfig, num_sms, one_row_tiles

# the activation (and weight) dtypes `linear` takes the GEMV for
DTYPES = (torch.bfloat16, torch.float16)

# Tiles (`benchmarks/kernels.py --only --sweep gemv` times candidates): 16-row tiles of 128
# columns (4 KiB of bf16, as the FP8 one-row tile's 16 x 256 bytes), narrowed down to 4 rows
# of 512 while a projection has too few rows to fill the SMs; 8 warps a program, the sweep's
# best on average over the tensor-parallel slices of the projections (docs/benchmarks.md).
# `bits` and `fma` are FP8's and unused here.
ONE_ROW = WeightOnlyConfig(block_n=16, block_k=128, num_warps=8, num_stages=1,
                           programs_per_sm=5, min_block_n=4, fma=True)


@triton.jit
def _fma_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, part_ptr, arrivals_ptr, N, K, k_per_split,
                stride_wn, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, EVICT: tl.constexpr):
    """y[n-tile] = x @ W[n-tile]^T (+ bias) by FMAs for one row x, program (n, s) over K's
    slice s; with SPLIT_K > 1 the last of the n-tile's programs to arrive sums the slices
    (partials [SPLIT_K, N]) and stores.

    Triton's pipeliner stages only a dot's operands, so the next weight tile is loaded by
    hand, one iteration ahead, into registers; the first before the PDL wait (the weights
    are no earlier kernel's output). It writes only after the wait.

    x is loaded through pointers of the accumulator's shape [BLOCK_N, BLOCK_K], each thread
    fetching (from L1: x is small) the very elements it multiplies, in the weights' layout:
    a [BLOCK_K] load broadcast over the tile's rows compiled to a layout conversion through
    shared memory, with barriers, in every iteration."""
    pdl.allow_dependents()
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)[None, :]
    n_mask = offs_n < N
    k_start = pid_k * k_per_split
    k_stop = tl.minimum(k_start + k_per_split, K)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    w_mask = n_mask[:, None]
    x_cols = x_ptr + 0 * offs_n[:, None]  # x's columns in the weights' shape
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    w = tl.load(w_rows + k_start + offs_k, mask=w_mask & (k_start + offs_k < k_stop),
                other=0.0, eviction_policy=EVICT)
    pdl.wait_for_previous()  # x is the previous kernel's output
    for k0 in range(k_start, k_stop, BLOCK_K):
        k_next = k0 + BLOCK_K + offs_k
        w_next = tl.load(w_rows + k_next, mask=w_mask & (k_next < k_stop), other=0.0,
                         eviction_policy=EVICT)
        x = tl.load(x_cols + k0 + offs_k, mask=w_mask & (k0 + offs_k < k_stop), other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)
        w = w_next
    total = tl.sum(acc, 1)
    finish_row(total, bias_ptr, y_ptr, part_ptr, arrivals_ptr, offs_n, n_mask, pid_n, pid_k, N,
               HAS_BIAS, SPLIT_K)


def takes(x: Tensor, weight: Tensor, out: Tensor | None = None) -> bool:
    """Whether `linear` takes `gemv` for x [M, K] @ weight [N, K]^T (into `out`): one row,
    one half-precision dtype for all, contiguous rows, and no autograd to record (the kernel
    has no backward)."""
    return (x.dim() == 2 and x.shape[0] == 1 and x.dtype in DTYPES
            and weight.dtype == x.dtype and x.stride(-1) == 1 and weight.stride(-1) == 1
            and (out is None or (out.dtype == x.dtype and out.stride(-1) == 1))
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None,
           out: Tensor | None = None) -> Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias) -> [..., N] in x's dtype, F.linear's contract,
    written into `out` [M, N] when given (x then [M, K]: a tensor-parallel layer's partial
    product in peer memory, `model.ops.matmul_into`): the GEMV for one row, else cuBLAS
    (F.linear, or torch.mm's out=)."""
    rows = x.reshape(-1, x.shape[-1])
    if takes(rows, weight, out):
        y = gemv(rows, weight, bias, out=out)
        return y if out is not None else y.view(*x.shape[:-1], weight.shape[0])
    if out is None:
        return F.linear(x, weight, bias)
    y = torch.mm(rows, weight.t(), out=out)
    return y if bias is None else y.add_(bias)


def gemv(x: Tensor, weight: Tensor, bias: Tensor | None = None, out: Tensor | None = None,
         cfg: WeightOnlyConfig | None = None) -> Tensor:
    """x [1, K] @ weight [N, K]^T (+ bias) -> [1, N] (`out` when given), one launch, no host
    sync: CUDA graphs capture it (a split launch's float32 partials come from torch.empty,
    which a graph's memory pool serves; its arrival counters are kept per device). cfg: the
    tiles (default `ONE_ROW`)."""
    num_rows, k = x.shape
    n = weight.shape[0]
    assert num_rows == 1 and x.stride(-1) == 1 and weight.stride(-1) == 1
    y = torch.empty((1, n), dtype=x.dtype, device=x.device) if out is None else out
    assert y.shape == (1, n) and y.stride(-1) == 1
    cfg, splits, k_per_split = one_row_tiles(n, k, num_sms(x.device), cfg or ONE_ROW)
    n_tiles = triton.cdiv(n, cfg.block_n)
    parts, arrivals = split_buffers(splits, n, n_tiles, y)
    bias_arg = y if bias is None else bias  # never read without HAS_BIAS
    _fma_kernel[(n_tiles, splits)](
        x, weight, bias_arg, y, parts, arrivals, n, k, k_per_split, weight.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=splits,
        EVICT="evict_first" if cfg.evict_first else "", num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **pdl.launch_options())
    return y
