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

Packed experts leave that grouped GEMM at both ends of the token count, for the reasons the
dense int matmuls do (`int_linear.py`), chosen per call by `MoeConfig`: up to
`gemv_max_tokens` tokens, a decode step whose time is the packed bytes over bandwidth, each
(token, chosen expert) pair runs as a GEMV (`gemv.row_dot`: the float32 exponent trick for
integer codes in column order, `dequant_tile` otherwise; no tl.dot, no wasted tile rows);
from `dequant_min_tokens` tokens, where the unpacking inside the tl.dot loop is the
bottleneck, every expert is dequantized once into a scratch tensor in the activation dtype
(`int_linear.dequantize`; at that many tokens nearly every expert is touched) and the float
kernels run on it, gate and up first and down after, so only one projection's scratch lives
at a time. Both compute what the grouped GEMM computes, rounded at the same points (the
integer GEMV keeps the weight in float32, as the dense one does).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from pagedserve.kernels.triton import int_linear
from pagedserve.kernels.triton.dequant import dequant_tile
from pagedserve.kernels.triton.gemv import row_dot
from pagedserve.kernels.triton.precision import dot_precision, round_to
from pagedserve.kernels.weight_formats import Stacked, WeightFormat

BLOCK_M = 16  # pairs per tile (tl.dot needs 16 rows)
_FLOAT = tl.constexpr(-1)  # an operand's FORMAT for plain weights in the activation dtype


@dataclass(frozen=True)
class MoeConfig:
    """Which kernels packed experts take by the call's token count (the module docstring
    says why), and the GEMV's tile: rows per program, columns per step and warps, for
    integer codes in column order (`int_*`) and for the other formats."""

    gemv_max_tokens: int = 8
    dequant_min_tokens: int = 128
    int_block_n: int = 4
    int_block_k: int = 512
    int_warps: int = 2
    block_n: int = 16
    block_k: int = 256
    warps: int = 4


DEFAULT = MoeConfig()


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


@triton.jit
def _gate_up_gemv_kernel(x_ptr, inter_ptr, ids_ptr, hidden, inter_size,
                         g_data, g_scales, g_zeros, g_gidx, g_data_stride, g_scales_stride,
                         g_data_e, g_scales_e, g_gidx_e,
                         u_data, u_scales, u_zeros, u_gidx, u_data_stride, u_scales_stride,
                         u_data_e, u_scales_e, u_gidx_e,
                         G_FORMAT: tl.constexpr, G_BITS: tl.constexpr, G_GROUP: tl.constexpr,
                         G_HAS_ZEROS: tl.constexpr, G_HAS_G_IDX: tl.constexpr,
                         U_FORMAT: tl.constexpr, U_BITS: tl.constexpr, U_GROUP: tl.constexpr,
                         U_HAS_ZEROS: tl.constexpr, U_HAS_G_IDX: tl.constexpr,
                         TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Pair program_id(0) (token pair // TOP_K, expert ids[pair]): silu(gate) * up of its
    rows offs_n, into the pair's row of inter. Pairs vary fastest, so the pairs sharing an
    expert read its rows at about the same time (from L2 after the first)."""
    pair = tl.program_id(0)
    e = tl.load(ids_ptr + pair).to(tl.int64)
    x_row = x_ptr + (pair // TOP_K).to(tl.int64) * hidden
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < inter_size
    dtype = inter_ptr.dtype.element_ty
    gate = row_dot(x_row, g_data + e * g_data_e, g_scales + e * g_scales_e,
                   g_zeros + e * g_scales_e, g_gidx + e * g_gidx_e, g_data_stride,
                   g_scales_stride, offs_n, n_mask, hidden, dtype, G_FORMAT, G_BITS, G_GROUP,
                   G_HAS_ZEROS, G_HAS_G_IDX, BLOCK_N, BLOCK_K)
    up = row_dot(x_row, u_data + e * u_data_e, u_scales + e * u_scales_e,
                 u_zeros + e * u_scales_e, u_gidx + e * u_gidx_e, u_data_stride,
                 u_scales_stride, offs_n, n_mask, hidden, dtype, U_FORMAT, U_BITS, U_GROUP,
                 U_HAS_ZEROS, U_HAS_G_IDX, BLOCK_N, BLOCK_K)
    g = round_to(gate, dtype)
    act = (g * tl.sigmoid(g)).to(dtype)
    h = act * up.to(dtype)
    tl.store(inter_ptr + pair.to(tl.int64) * inter_size + offs_n, h.to(dtype), mask=n_mask)


@triton.jit
def _down_gemv_kernel(inter_ptr, out_ptr, weights_ptr, ids_ptr, hidden, inter_size,
                      d_data, d_scales, d_zeros, d_gidx, d_data_stride, d_scales_stride,
                      d_data_e, d_scales_e, d_gidx_e,
                      D_FORMAT: tl.constexpr, D_BITS: tl.constexpr, D_GROUP: tl.constexpr,
                      D_HAS_ZEROS: tl.constexpr, D_HAS_G_IDX: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Pair program_id(0): its inter row times its expert's w2, rows offs_n, scaled by its
    routing weight, into the pair's output row."""
    pair = tl.program_id(0).to(tl.int64)
    e = tl.load(ids_ptr + pair).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < hidden
    dtype = out_ptr.dtype.element_ty
    y = row_dot(inter_ptr + pair * inter_size, d_data + e * d_data_e,
                d_scales + e * d_scales_e, d_zeros + e * d_scales_e, d_gidx + e * d_gidx_e,
                d_data_stride, d_scales_stride, offs_n, n_mask, inter_size, dtype, D_FORMAT,
                D_BITS, D_GROUP, D_HAS_ZEROS, D_HAS_G_IDX, BLOCK_N, BLOCK_K)
    routed = tl.load(weights_ptr + pair).to(tl.float32)
    tl.store(out_ptr + pair * hidden + offs_n, (round_to(y, dtype) * routed).to(dtype),
             mask=n_mask)


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
              weights: Tensor, ids: Tensor, config: MoeConfig = DEFAULT) -> Tensor:
    """x [T, H]; w13 [E, 2I, H] (gate rows, then up) or the pair (gate, up) of `Stacked`
    [E, I, H] weights; w2 [E, H, I] or a `Stacked` of them; weights and ids [T, top_k] from
    `moe.route` -> sum over each token's choices of weight * expert(x)."""
    if isinstance(w13, Tensor):
        w13 = w13.contiguous()
        inter_size = w13.shape[1] // 2
        gate, up = w13[:, :inter_size], w13[:, inter_size:]
    else:
        gate, up = w13
    if isinstance(w2, Tensor):
        w2 = w2.contiguous()
    x, weights = x.contiguous(), weights.contiguous().flatten()
    num_tokens = x.shape[0]
    packed = [isinstance(w, Stacked) for w in (gate, up, w2)]
    if all(packed) and 0 < num_tokens <= config.gemv_max_tokens:
        pairs_out = _pairs_by_gemv(x, gate, up, w2, weights, ids, config)
    else:
        dequant = any(packed) and num_tokens >= config.dequant_min_tokens
        pairs_out = _pairs_by_gemm(x, gate, up, w2, weights, ids, dequant)
    return _sum_choices(pairs_out, ids)


def _pairs_by_gemm(x: Tensor, gate, up, w2, weights: Tensor, ids: Tensor,
                   dequant: bool) -> Tensor:
    """Each (token, choice) pair's weighted expert output [T * top_k, H] by the grouped GEMM
    kernels; `dequant`: packed experts dequantized first, one projection's at a time."""
    num_tokens, hidden = x.shape
    inter_size, num_experts, top_k = gate.shape[1], w2.shape[0], ids.shape[1]
    order, tile_expert, tile_start, tile_end = group_by_expert(ids, num_experts)
    grid_m = tile_expert.numel()
    inter = torch.empty(num_tokens * top_k, inter_size, dtype=x.dtype, device=x.device)
    pairs_out = torch.empty(num_tokens * top_k, hidden, dtype=x.dtype, device=x.device)
    precision = dot_precision(x.dtype)
    block_n, block_k = 64, 64
    gate, up = (_floats(w, x.dtype, dequant) for w in (gate, up))
    (g_args, g_const), (u_args, u_const) = _operand(gate, "G"), _operand(up, "U")
    _gate_up_kernel[(grid_m, triton.cdiv(inter_size, block_n))](
        x, inter, order, tile_expert, tile_start, tile_end, hidden, inter_size,
        *g_args, *u_args, **g_const, **u_const, TOP_K=top_k, BLOCK_M=BLOCK_M,
        BLOCK_N=block_n, BLOCK_K=block_k, DOT_PRECISION=precision)
    del gate, up, g_args, u_args  # a dequantized scratch goes before down's is made
    d_args, d_const = _operand(_floats(w2, x.dtype, dequant), "D")
    _down_kernel[(grid_m, triton.cdiv(hidden, block_n))](
        inter, pairs_out, weights, order, tile_expert, tile_start, tile_end, hidden,
        inter_size, *d_args, **d_const, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_PRECISION=precision)
    return pairs_out


def _floats(w, dtype: torch.dtype, dequant: bool):
    """The operand as the grouped GEMM takes it: a `Stacked` dequantized into [E, N, K] of
    `dtype` where `dequant`, else as it is."""
    if dequant and isinstance(w, Stacked):
        return int_linear.dequantize(w, dtype)
    return w


def _pairs_by_gemv(x: Tensor, gate: Stacked, up: Stacked, w2: Stacked, weights: Tensor,
                   ids: Tensor, config: MoeConfig) -> Tensor:
    """Each (token, choice) pair's weighted expert output [T * top_k, H], a GEMV per pair."""
    num_tokens, hidden = x.shape
    inter_size, top_k = gate.shape[1], ids.shape[1]
    pairs = num_tokens * top_k
    flat_ids = ids.contiguous().flatten()
    inter = torch.empty(pairs, inter_size, dtype=x.dtype, device=x.device)
    pairs_out = torch.empty(pairs, hidden, dtype=x.dtype, device=x.device)
    (g_args, g_const), (u_args, u_const) = _operand(gate, "G"), _operand(up, "U")
    d_args, d_const = _operand(w2, "D")
    bn, bk, warps = _gemv_tile((gate, up), config)
    _gate_up_gemv_kernel[(pairs, triton.cdiv(inter_size, bn))](
        x, inter, flat_ids, hidden, inter_size, *g_args, *u_args, **g_const, **u_const,
        TOP_K=top_k, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)
    bn, bk, warps = _gemv_tile((w2,), config)
    _down_gemv_kernel[(pairs, triton.cdiv(hidden, bn))](
        inter, pairs_out, weights, flat_ids, hidden, inter_size, *d_args, **d_const,
        BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)
    return pairs_out


def _gemv_tile(operands, config: MoeConfig) -> tuple[int, int, int]:
    """One launch's GEMV tile: the integer one where all its operands take `int_row_dot`."""
    args = [w.kernel_args() for w in operands]
    if all(a.format == WeightFormat.INT and not a.has_g_idx for a in args):
        return config.int_block_n, config.int_block_k, config.int_warps
    return config.block_n, config.block_k, config.warps


def _sum_choices(pairs_out: Tensor, ids: Tensor) -> Tensor:
    """[T * top_k, H] -> [T, H]: each token's rows in ascending expert order, added as
    transformers adds them."""
    top_k = ids.shape[1]
    num_tokens, hidden = pairs_out.shape[0] // top_k, pairs_out.shape[1]
    by_expert = ids.argsort(dim=1)
    rows = pairs_out.view(num_tokens, top_k, hidden).gather(
        1, by_expert[:, :, None].expand(-1, -1, hidden))
    out = rows[:, 0].clone()
    for j in range(1, top_k):
        out += rows[:, j]
    return out
