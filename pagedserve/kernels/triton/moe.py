"""Fused mixture-of-experts on CUDA (Triton): two grouped GEMM launches per layer.

The (token, choice) pairs of a batch are sorted by expert (`group_by_expert`, a few torch ops
on the device, no host sync), and each expert's run of pairs is cut into tiles of BLOCK_M
rows. One launch computes every tile's gate and up projections against its expert's `w13`
rows and writes silu(gate) * up; a second multiplies that by the expert's `w2`, scales each
row by its routing weight and writes it to the pair's row. Each program looks up its tile's
expert, so one launch covers all experts and no Python loop runs over them; experts that got
no token get no tile. Only the last reduction, a token's top_k rows, is torch: summed in
ascending expert order in the activation dtype, the order transformers adds them in.

Rounding follows transformers where it rounds: the projections to the activation dtype, then
silu(gate) * up, then the down projection before its routing weight.

The experts' weights may be kept quantized (an integer checkpoint's or a GGUF's experts):
each projection (gate, up, down) is an operand of its own, either stacked floats or a
`weight_formats.Stacked` whose tiles `dequant.dequant_tile` unpacks in registers, the same
description the dense int matmuls use, so the weights stay packed on the device. Gate and up
are separate operands because a GGUF may store them in different block types.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from pagedserve.kernels.triton.dequant import dequant_tile
from pagedserve.kernels.triton.precision import dot_precision, round_to
from pagedserve.kernels.weight_formats import Stacked

BLOCK_M = 16  # pairs per tile (tl.dot needs 16 rows)
_FLOAT = tl.constexpr(-1)  # an operand's FORMAT for plain weights in the activation dtype


@triton.jit
def _expert_tile(data, scales, zeros, g_idx, data_stride, scales_stride, data_e, scales_e,
                 g_idx_e, expert, offs_n, n_mask, k0, K, dtype: tl.constexpr,
                 FORMAT: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
                 HAS_ZEROS: tl.constexpr, HAS_G_IDX: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """Expert `expert`'s weight, rows offs_n and columns k0 + arange(BLOCK_K), as tl.dot's
    B operand [BLOCK_K, BLOCK_N] in `dtype`: loaded as it is (_FLOAT), or unpacked in
    registers by `dequant_tile` (a `weight_formats` format; its tensors e * *_e elements
    past expert 0's)."""
    e = expert.to(tl.int64)
    if FORMAT == _FLOAT:
        k = k0 + tl.arange(0, BLOCK_K)
        return tl.load(data + e * data_e + offs_n[None, :].to(tl.int64) * data_stride
                       + k[:, None], mask=(k < K)[:, None] & n_mask[None, :], other=0.0)
    else:
        w = dequant_tile(data + e * data_e, scales + e * scales_e, zeros + e * scales_e,
                         g_idx + e * g_idx_e, data_stride, scales_stride, offs_n, n_mask, k0,
                         K, FORMAT, BITS, GROUP, HAS_ZEROS, HAS_G_IDX, BLOCK_N, BLOCK_K)
        return tl.trans(w.to(dtype))


@triton.jit
def _gate_up_kernel(x_ptr, inter_ptr, order_ptr, tile_expert_ptr, tile_start_ptr,
                    tile_end_ptr, hidden, inter_size,
                    g_data, g_scales, g_zeros, g_gidx, g_data_stride, g_scales_stride,
                    g_data_e, g_scales_e, g_gidx_e,
                    u_data, u_scales, u_zeros, u_gidx, u_data_stride, u_scales_stride,
                    u_data_e, u_scales_e, u_gidx_e,
                    G_FORMAT: tl.constexpr, G_BITS: tl.constexpr, G_GROUP: tl.constexpr,
                    G_HAS_ZEROS: tl.constexpr, G_HAS_G_IDX: tl.constexpr,
                    U_FORMAT: tl.constexpr, U_BITS: tl.constexpr, U_GROUP: tl.constexpr,
                    U_HAS_ZEROS: tl.constexpr, U_HAS_G_IDX: tl.constexpr,
                    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile)
    if expert < 0:
        return
    row0 = tl.load(tile_start_ptr + tile)
    rows = row0 + tl.arange(0, BLOCK_M)  # positions in the expert-sorted pair order
    m_mask = rows < tl.load(tile_end_ptr + tile)
    pair = tl.load(order_ptr + rows, mask=m_mask, other=0)
    token = (pair // TOP_K).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < inter_size
    offs_k = tl.arange(0, BLOCK_K)
    dtype = inter_ptr.dtype.element_ty
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k = k0 + offs_k
        a = tl.load(x_ptr + token[:, None] * hidden + k[None, :],
                    mask=m_mask[:, None] & (k < hidden)[None, :], other=0.0)
        gate = _expert_tile(g_data, g_scales, g_zeros, g_gidx, g_data_stride, g_scales_stride,
                            g_data_e, g_scales_e, g_gidx_e, expert, offs_n, n_mask, k0, hidden,
                            dtype, G_FORMAT, G_BITS, G_GROUP, G_HAS_ZEROS, G_HAS_G_IDX,
                            BLOCK_N, BLOCK_K)
        up = _expert_tile(u_data, u_scales, u_zeros, u_gidx, u_data_stride, u_scales_stride,
                          u_data_e, u_scales_e, u_gidx_e, expert, offs_n, n_mask, k0, hidden,
                          dtype, U_FORMAT, U_BITS, U_GROUP, U_HAS_ZEROS, U_HAS_G_IDX,
                          BLOCK_N, BLOCK_K)
        acc_gate += tl.dot(a, gate, input_precision=DOT_PRECISION)
        acc_up += tl.dot(a, up, input_precision=DOT_PRECISION)
    g = round_to(acc_gate, dtype)
    act = (g * tl.sigmoid(g)).to(dtype)
    h = act * acc_up.to(dtype)
    tl.store(inter_ptr + rows[:, None].to(tl.int64) * inter_size + offs_n[None, :],
             h.to(dtype), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _down_kernel(inter_ptr, out_ptr, weights_ptr, order_ptr, tile_expert_ptr,
                 tile_start_ptr, tile_end_ptr, hidden, inter_size,
                 d_data, d_scales, d_zeros, d_gidx, d_data_stride, d_scales_stride,
                 d_data_e, d_scales_e, d_gidx_e,
                 D_FORMAT: tl.constexpr, D_BITS: tl.constexpr, D_GROUP: tl.constexpr,
                 D_HAS_ZEROS: tl.constexpr, D_HAS_G_IDX: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile)
    if expert < 0:
        return
    row0 = tl.load(tile_start_ptr + tile)
    rows = row0 + tl.arange(0, BLOCK_M)
    m_mask = rows < tl.load(tile_end_ptr + tile)
    pair = tl.load(order_ptr + rows, mask=m_mask, other=0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)
    dtype = out_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter_size, BLOCK_K):
        k = k0 + offs_k
        a = tl.load(inter_ptr + rows[:, None].to(tl.int64) * inter_size + k[None, :],
                    mask=m_mask[:, None] & (k < inter_size)[None, :], other=0.0)
        w = _expert_tile(d_data, d_scales, d_zeros, d_gidx, d_data_stride, d_scales_stride,
                         d_data_e, d_scales_e, d_gidx_e, expert, offs_n, n_mask, k0,
                         inter_size, dtype, D_FORMAT, D_BITS, D_GROUP, D_HAS_ZEROS,
                         D_HAS_G_IDX, BLOCK_N, BLOCK_K)
        acc += tl.dot(a, w, input_precision=DOT_PRECISION)
    routed = tl.load(weights_ptr + pair, mask=m_mask, other=0.0)
    y = round_to(acc, dtype) * routed.to(tl.float32)[:, None]
    tl.store(out_ptr + pair[:, None] * hidden + offs_n[None, :], y.to(dtype),
             mask=m_mask[:, None] & n_mask[None, :])


def _operand(w, prefix: str) -> tuple[list, dict]:
    """A projection's kernel arguments: (tensors and strides, constexprs named PREFIX_*)."""
    if isinstance(w, Tensor):
        args = [w, w, w, w, w.stride(1), 0, w.stride(0), 0, 0]
        const = (int(_FLOAT), 0, 1, False, False)
    else:
        a = w.kernel_args()
        args = [a.data, a.scales, a.zeros, a.g_idx, a.data_stride, a.scales_stride, *w.strides]
        const = (a.format, a.bits, a.group_size, a.has_zeros, a.has_g_idx)
    names = ("FORMAT", "BITS", "GROUP", "HAS_ZEROS", "HAS_G_IDX")
    return args, {f"{prefix}_{n}": v for n, v in zip(names, const)}


def group_by_expert(ids: Tensor, num_experts: int,
                    block_m: int = BLOCK_M) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """ids [T, top_k] -> (pair order sorted by expert [T*top_k], and per tile of block_m
    pairs: its expert (-1: an unused tile), first and end position in that order).

    The tile arrays are padded to the most tiles any routing can need, and nothing here reads
    a count back to the host (no bincount, no repeat_interleave), so the launch shapes do not
    depend on the routing and the whole MoE can run inside a CUDA graph."""
    flat = ids.flatten()
    order = flat.argsort(stable=True).to(torch.int32)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    ends = counts.cumsum(0)
    tiles_end = ((counts + block_m - 1) // block_m).cumsum(0)  # one past each expert's tiles
    max_tiles = triton.cdiv(flat.numel(), block_m) + num_experts
    tile = torch.arange(max_tiles, device=ids.device)
    expert = torch.searchsorted(tiles_end, tile, right=True)  # num_experts: past the last
    used = expert < num_experts
    expert = expert.clamp(max=num_experts - 1)
    first_tile = tiles_end[expert] - (counts[expert] + block_m - 1) // block_m
    tile_start = ends[expert] - counts[expert] + (tile - first_tile) * block_m
    # -1 as a Python scalar: a tensor made from it here would be a host-to-device copy,
    # which a CUDA graph capture refuses
    return (order, torch.where(used, expert, -1).to(torch.int32),
            torch.where(used, tile_start, -1).to(torch.int32),
            torch.where(used, ends[expert], -1).to(torch.int32))


def fused_moe(x: Tensor, w13: Tensor | tuple[Stacked, Stacked], w2: Tensor | Stacked,
              weights: Tensor, ids: Tensor) -> Tensor:
    """x [T, H]; w13 [E, 2I, H] (gate rows, then up) or the pair (gate, up) of `Stacked`
    [E, I, H] weights; w2 [E, H, I] or a `Stacked` of them; weights and ids [T, top_k] from
    `moe.route` -> sum over each token's choices of weight * expert(x)."""
    num_tokens, hidden = x.shape
    if isinstance(w13, Tensor):
        w13 = w13.contiguous()
        inter_size = w13.shape[1] // 2
        gate, up = w13[:, :inter_size], w13[:, inter_size:]
    else:
        gate, up = w13
        inter_size = gate.shape[1]
    if isinstance(w2, Tensor):
        w2 = w2.contiguous()
    num_experts = w2.shape[0]
    top_k = ids.shape[1]
    x = x.contiguous()
    order, tile_expert, tile_start, tile_end = group_by_expert(ids, num_experts)
    grid_m = tile_expert.numel()
    inter = torch.empty(num_tokens * top_k, inter_size, dtype=x.dtype, device=x.device)
    pairs_out = torch.empty(num_tokens * top_k, hidden, dtype=x.dtype, device=x.device)
    precision = dot_precision(x.dtype)
    block_n, block_k = 64, 64
    (g_args, g_const), (u_args, u_const) = _operand(gate, "G"), _operand(up, "U")
    _gate_up_kernel[(grid_m, triton.cdiv(inter_size, block_n))](
        x, inter, order, tile_expert, tile_start, tile_end, hidden, inter_size,
        *g_args, *u_args, **g_const, **u_const, TOP_K=top_k, BLOCK_M=BLOCK_M,
        BLOCK_N=block_n, BLOCK_K=block_k, DOT_PRECISION=precision)
    d_args, d_const = _operand(w2, "D")
    _down_kernel[(grid_m, triton.cdiv(hidden, block_n))](
        inter, pairs_out, weights.contiguous().flatten(), order, tile_expert, tile_start,
        tile_end, hidden, inter_size, *d_args, **d_const, BLOCK_M=BLOCK_M, BLOCK_N=block_n,
        BLOCK_K=block_k, DOT_PRECISION=precision)
    # each token's rows in ascending expert order, added as transformers adds them
    by_expert = ids.argsort(dim=1)
    rows = pairs_out.view(num_tokens, top_k, hidden).gather(
        1, by_expert[:, :, None].expand(-1, -1, hidden))
    out = rows[:, 0].clone()
    for j in range(1, top_k):
        out += rows[:, j]
    return out
