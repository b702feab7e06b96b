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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from pagedserve.kernels.triton.precision import dot_precision, round_to

BLOCK_M = 16  # pairs per tile (tl.dot needs 16 rows)


@triton.jit
def _gate_up_kernel(x_ptr, w13_ptr, inter_ptr, order_ptr, tile_expert_ptr, tile_start_ptr,
                    tile_end_ptr, hidden, inter_size,
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
    w_base = w13_ptr + expert.to(tl.int64) * 2 * inter_size * hidden
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < hidden
        a = tl.load(x_ptr + token[:, None] * hidden + k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & n_mask[None, :]
        gate = tl.load(w_base + offs_n[None, :].to(tl.int64) * hidden + k[:, None],
                       mask=w_mask, other=0.0)
        up = tl.load(w_base + (inter_size + offs_n[None, :]).to(tl.int64) * hidden + k[:, None],
                     mask=w_mask, other=0.0)
        acc_gate += tl.dot(a, gate, input_precision=DOT_PRECISION)
        acc_up += tl.dot(a, up, input_precision=DOT_PRECISION)
    dtype = inter_ptr.dtype.element_ty
    g = round_to(acc_gate, dtype)
    act = (g * tl.sigmoid(g)).to(dtype)
    h = act * acc_up.to(dtype)
    tl.store(inter_ptr + rows[:, None].to(tl.int64) * inter_size + offs_n[None, :],
             h.to(dtype), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _down_kernel(inter_ptr, w2_ptr, out_ptr, weights_ptr, order_ptr, tile_expert_ptr,
                 tile_start_ptr, tile_end_ptr, hidden, inter_size,
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
    w_base = w2_ptr + expert.to(tl.int64) * hidden * inter_size
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter_size, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < inter_size
        a = tl.load(inter_ptr + rows[:, None].to(tl.int64) * inter_size + k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_base + offs_n[None, :].to(tl.int64) * inter_size + k[:, None],
                    mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc += tl.dot(a, w, input_precision=DOT_PRECISION)
    dtype = out_ptr.dtype.element_ty
    routed = tl.load(weights_ptr + pair, mask=m_mask, other=0.0)
    y = round_to(acc, dtype) * routed.to(tl.float32)[:, None]
    tl.store(out_ptr + pair[:, None] * hidden + offs_n[None, :], y.to(dtype),
             mask=m_mask[:, None] & n_mask[None, :])


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


def fused_moe(x: Tensor, w13: Tensor, w2: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
    """x [T, H]; w13 [E, 2I, H] (gate rows, then up); w2 [E, H, I]; weights and ids
    [T, top_k] from `moe.route` -> sum over each token's choices of weight * expert(x)."""
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter_size = two_inter // 2
    top_k = ids.shape[1]
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    order, tile_expert, tile_start, tile_end = group_by_expert(ids, num_experts)
    grid_m = tile_expert.numel()
    inter = torch.empty(num_tokens * top_k, inter_size, dtype=x.dtype, device=x.device)
    pairs_out = torch.empty(num_tokens * top_k, hidden, dtype=x.dtype, device=x.device)
    precision = dot_precision(x.dtype)
    block_n, block_k = 64, 64
    _gate_up_kernel[(grid_m, triton.cdiv(inter_size, block_n))](
        x, w13, inter, order, tile_expert, tile_start, tile_end, hidden, inter_size,
        TOP_K=top_k, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_PRECISION=precision)
    _down_kernel[(grid_m, triton.cdiv(hidden, block_n))](
        inter, w2, pairs_out, weights.contiguous().flatten(), order, tile_expert, tile_start,
        tile_end, hidden, inter_size, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_PRECISION=precision)
    # each token's rows in ascending expert order, added as transformers adds them
    by_expert = ids.argsort(dim=1)
    rows = pairs_out.view(num_tokens, top_k, hidden).gather(
        1, by_expert[:, :, None].expand(-1, -1, hidden))
    out = rows[:, 0].clone()
    for j in range(1, top_k):
        out += rows[:, j]
    return out
