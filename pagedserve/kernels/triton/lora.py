"""Batched LoRA kernels: y += x @ A[slot].T @ B[slot].T for rows of different adapters in one
launch per stage (Punica's SGMV / BGMV idea).

Two stages per projection: the shrink (x [T, K] -> xa [T, R], R the stacked rank, in
float32) and the expand (xa -> y [T, N], added in place). Each comes in two forms:

- tiles (prefill chunks, and decode batches over `model.lora.ONE_ROW_MAX` rows): the step's rows sorted by
  adapter (`sorted_rows`) are cut into tiles of up to `tile_rows` of one adapter each; a
  program gathers a tile's rows and multiplies them with `tl.dot` against its slot's A or B,
  read once per tile rather than once per row (with many rows per adapter, the weights'
  reads would otherwise dominate the step);
- rows (small decode batches: batch-1 latency): each row on its own, a GEMV; the shrink
  splits K over programs (float32 atomic adds) so that a single row still spreads over
  the GPU.

Both are graph-safe: a CUDA graph replays a fixed grid (the tile count for its size is
rows / tile_rows + slots), and unused tiles, rows of the base model (slot -1) and padding rows
exit at once, so a graph captured with nothing to do serves any mix of adapters: the tiles
and each row's slot are read from their input buffers at replay. The shrink's result is rounded to the weights' dtype before the expand,
as PEFT's `lora_B(lora_A(x))` stores it.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from pagedserve.kernels.triton.precision import dot_precision


@triton.jit
def _shrink_tiles(x_ptr, a_ptr, out_ptr, rows_ptr, tile_starts, tile_lens, tile_slots,
                  stride_x, stride_as, stride_ar, stride_out, K, R, BLOCK_M: tl.constexpr,
                  BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                  UPCAST: tl.constexpr):
    tile, rblk = tl.program_id(0), tl.program_id(1)
    slot = tl.load(tile_slots + tile).to(tl.int64)
    length = tl.load(tile_lens + tile)
    if slot < 0:
        return
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < length
    rows = tl.load(rows_ptr + tl.load(tile_starts + tile) + offs_m, mask=mask_m,
                   other=0).to(tl.int64)
    offs_r = rblk * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_ptr + rows[:, None] * stride_x + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        a = tl.load(a_ptr + slot * stride_as + offs_r[None, :] * stride_ar + offs_k[:, None],
                    mask=mask_k[:, None] & mask_r[None, :], other=0.0)
        if UPCAST:
            x, a = x.to(tl.float32), a.to(tl.float32)
        acc += tl.dot(x, a, input_precision=PRECISION)
    tl.store(out_ptr + rows[:, None] * stride_out + offs_r[None, :], acc,
             mask=mask_m[:, None] & mask_r[None, :])


@triton.jit
def _expand_tiles(xa_ptr, b_ptr, y_ptr, rows_ptr, tile_starts, tile_lens, tile_slots,
                  stride_xa, stride_bs, stride_bn, stride_y, N, R, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr,
                  UPCAST: tl.constexpr):
    tile, nblk = tl.program_id(0), tl.program_id(1)
    slot = tl.load(tile_slots + tile).to(tl.int64)
    length = tl.load(tile_lens + tile)
    if slot < 0:
        return
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < length
    rows = tl.load(rows_ptr + tl.load(tile_starts + tile) + offs_m, mask=mask_m,
                   other=0).to(tl.int64)
    offs_n = nblk * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    dtype = b_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        mask_r = offs_r < R
        xa = tl.load(xa_ptr + rows[:, None] * stride_xa + offs_r[None, :],
                     mask=mask_m[:, None] & mask_r[None, :], other=0.0)
        b = tl.load(b_ptr + slot * stride_bs + offs_n[None, :] * stride_bn + offs_r[:, None],
                    mask=mask_r[:, None] & mask_n[None, :], other=0.0)
        xa = xa.to(dtype)
        if UPCAST:
            xa, b = xa.to(tl.float32), b.to(tl.float32)
        acc += tl.dot(xa, b, input_precision=PRECISION)
    out = y_ptr + rows[:, None] * stride_y + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    y = tl.load(out, mask=mask, other=0.0).to(tl.float32)
    tl.store(out, (y + acc).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _shrink_rows(x_ptr, a_ptr, out_ptr, token_slots, stride_x, stride_as, stride_ar,
                 stride_out, K, R, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    row, rblk, kblk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    slot = tl.load(token_slots + row).to(tl.int64)
    if slot < 0:
        return
    row = row.to(tl.int64)
    offs_r = rblk * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    offs_k = kblk * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_k = offs_k < K
    x = tl.load(x_ptr + row * stride_x + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + slot * stride_as + offs_r[:, None] * stride_ar + offs_k[None, :],
                mask=mask_r[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
    tl.atomic_add(out_ptr + row * stride_out + offs_r, tl.sum(a * x[None, :], axis=1),
                  mask=mask_r)


@triton.jit
def _expand_rows(xa_ptr, b_ptr, y_ptr, token_slots, stride_xa, stride_bs, stride_bn, stride_y,
                 N, R, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    row, nblk = tl.program_id(0), tl.program_id(1)
    slot = tl.load(token_slots + row).to(tl.int64)
    if slot < 0:
        return
    row = row.to(tl.int64)
    offs_n = nblk * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    dtype = b_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        mask_r = offs_r < R
        xa = tl.load(xa_ptr + row * stride_xa + offs_r, mask=mask_r, other=0.0)
        xa = xa.to(dtype).to(tl.float32)  # rounded as the segments' expand rounds it
        b = tl.load(b_ptr + slot * stride_bs + offs_n[:, None] * stride_bn + offs_r[None, :],
                    mask=mask_n[:, None] & mask_r[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(b * xa[None, :], axis=1)
    out = y_ptr + row * stride_y + offs_n
    y = tl.load(out, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(out, (y + acc).to(y_ptr.dtype.element_ty), mask=mask_n)


# the interpreter's half-precision tl.dot returns garbage: there the tiles are upcast first
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def lora_shrink_expand(x: Tensor, y: Tensor, a: Tensor, b: Tensor, batch) -> None:
    """y [T, N] += each row's x [T, K] @ a[slot].T @ b[slot].T, in place, for the rows of
    `batch` (a `model.lora.LoRABatch`): a [slots, R, K], b [slots, N, R], both contiguous."""
    T, K = x.shape
    N, R = b.shape[1], a.shape[1]
    if T == 0:
        return
    assert x.stride(-1) == 1 and y.stride(-1) == 1 and a.is_contiguous() and b.is_contiguous()
    block_r = max(16, min(64, triton.next_power_of_2(R)))
    if batch.one_row_kernels:
        xa = torch.zeros(T, R, dtype=torch.float32, device=x.device)
        block_k = min(512, triton.next_power_of_2(K))
        _shrink_rows[(T, triton.cdiv(R, 16), triton.cdiv(K, block_k))](
            x, a, xa, batch.token_slots, x.stride(0), a.stride(0), a.stride(1), xa.stride(0),
            K, R, BLOCK_R=16, BLOCK_K=block_k)
        _expand_rows[(T, triton.cdiv(N, 64))](
            xa, b, y, batch.token_slots, xa.stride(0), b.stride(0), b.stride(1), y.stride(0),
            N, R, BLOCK_N=64, BLOCK_R=block_r)
        return
    xa = torch.empty(T, R, dtype=torch.float32, device=x.device)  # base rows: never read
    tiles = batch.tile_slots.shape[0]
    precision = "ieee" if _INTERPRET else dot_precision(x.dtype)
    _shrink_tiles[(tiles, triton.cdiv(R, block_r))](
        x, a, xa, batch.sorted_rows, batch.tile_starts, batch.tile_lens, batch.tile_slots,
        x.stride(0), a.stride(0), a.stride(1), xa.stride(0), K, R, BLOCK_M=batch.tile_rows,
        BLOCK_R=block_r, BLOCK_K=64, PRECISION=precision, UPCAST=_INTERPRET)
    _expand_tiles[(tiles, triton.cdiv(N, 64))](
        xa, b, y, batch.sorted_rows, batch.tile_starts, batch.tile_lens, batch.tile_slots,
        xa.stride(0), b.stride(0), b.stride(1), y.stride(0), N, R, BLOCK_M=batch.tile_rows,
        BLOCK_N=64, BLOCK_R=block_r, PRECISION=precision, UPCAST=_INTERPRET)
