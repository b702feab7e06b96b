"""Batched LoRA kernels: y += x @ A[slot].T @ B[slot].T for rows of different adapters in one
launch per stage (Punica's SGMV / BGMV idea).

Two stages per projection: the shrink (x [T, K] -> xa [T, R], R the stacked rank, in
float32) and the expand (xa -> y [T, N], added in place). Each comes in two forms:

- tiles (prefill chunks, and decode batches over `model.lora.ONE_ROW_MAX` rows): the step's
  rows sorted by adapter (`sorted_rows`) are cut into tiles of up to `tile_rows` of one
  adapter each; a program gathers a tile's rows and multiplies them with `tl.dot` against
  its slot's A or B, read once per tile rather than once per row (with many rows per
  adapter, the weights' reads would otherwise dominate the step). A decode batch makes few
  tiles (about one per adapter), and a tile's shrink is a loop over all of K: so the shrink
  also splits K over programs, enough of them to fill the GPU, summed with float32 atomic
  adds into a zeroed xa; a prefill chunk has tiles enough and runs K whole (no zero-fill,
  no atomics);
- rows (small decode batches: batch-1 latency): each row on its own, a GEMV. The shrink
  splits K over programs that each write their partial sums, and the expand adds a row's
  partials up as it reads them: two launches, no zero-fill and no atomics, since at this
  size a step's LoRA cost is its launches. Both are launched with PDL (`pdl.py`): each
  starts while the kernel before it ends, and reads its block of A (B) before it waits.

Both are graph-safe: a CUDA graph replays a fixed grid (the tile count for its size is
rows / tile_rows + slots; the splits follow from the grid's size), and unused tiles, rows
of the base model (slot -1) and padding rows exit at once, so a graph captured with nothing
to do serves any mix of adapters: the tiles and each row's slot are read from their input
buffers at replay. The shrink's result is rounded to the weights' dtype before the expand,
as PEFT's `lora_B(lora_A(x))` stores it.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from pagedserve.kernels.triton import pdl
from pagedserve.kernels.triton.precision import dot_precision, round_to


@triton.jit
def _tile(rows_ptr, tile_starts, tile_lens, tile_slots, tile, BLOCK_M: tl.constexpr):
    """A tile's slot (-1: unused), its rows (gathered from `rows_ptr`) and their mask."""
    slot = tl.load(tile_slots + tile).to(tl.int64)
    length = tl.load(tile_lens + tile)
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < length
    rows = tl.load(rows_ptr + tl.load(tile_starts + tile) + offs_m, mask=mask_m,
                   other=0).to(tl.int64)
    return slot, rows, mask_m


@triton.jit
def _shrink_tiles(x_ptr, a_ptr, out_ptr, rows_ptr, tile_starts, tile_lens, tile_slots,
                  stride_x, stride_as, stride_ar, stride_out, K, R, K_PER_SPLIT,
                  BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                  PRECISION: tl.constexpr, UPCAST: tl.constexpr, ATOMIC: tl.constexpr):
    tile, rblk, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    slot, rows, mask_m = _tile(rows_ptr, tile_starts, tile_lens, tile_slots, tile, BLOCK_M)
    if slot < 0:
        return
    offs_r = rblk * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    k_start = split * K_PER_SPLIT  # K_PER_SPLIT: a multiple of BLOCK_K
    for k0 in range(0, K_PER_SPLIT, BLOCK_K):
        offs_k = k_start + k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_ptr + rows[:, None] * stride_x + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        a = tl.load(a_ptr + slot * stride_as + offs_r[None, :] * stride_ar + offs_k[:, None],
                    mask=mask_k[:, None] & mask_r[None, :], other=0.0)
        if UPCAST:
            x, a = x.to(tl.float32), a.to(tl.float32)
        acc += tl.dot(x, a, input_precision=PRECISION)
    out = out_ptr + rows[:, None] * stride_out + offs_r[None, :]
    mask = mask_m[:, None] & mask_r[None, :]
    if ATOMIC:
        tl.atomic_add(out, acc, mask=mask)
    else:
        tl.store(out, acc, mask=mask)


@triton.jit
def _expand_tiles(xa_ptr, b_ptr, y_ptr, rows_ptr, tile_starts, tile_lens, tile_slots,
                  stride_xa, stride_bs, stride_bn, stride_y, N, R, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr,
                  UPCAST: tl.constexpr):
    tile, nblk = tl.program_id(0), tl.program_id(1)
    slot, rows, mask_m = _tile(rows_ptr, tile_starts, tile_lens, tile_slots, tile, BLOCK_M)
    if slot < 0:
        return
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
def _shrink_rows(x_ptr, a_ptr, part_ptr, token_slots, stride_x, stride_as, stride_ar,
                 stride_ps, stride_pt, K, R, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """One row's sums over one K block: part[split, row, r]. Launched with PDL: A (written
    before the step) is read before the wait, x (the previous kernel's output) after."""
    pdl.allow_dependents()
    row, rblk, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    slot = tl.load(token_slots + row).to(tl.int64)
    offs_r = rblk * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    offs_k = split * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_k = offs_k < tl.where(slot >= 0, K, 0)  # a base row's program reads no A
    a = tl.load(a_ptr + tl.maximum(slot, 0) * stride_as + offs_r[:, None] * stride_ar
                + offs_k[None, :], mask=mask_r[:, None] & mask_k[None, :],
                other=0.0).to(tl.float32)
    pdl.wait_for_previous()  # every program waits, those of base rows too (pdl.py)
    if slot < 0:
        return
    row = row.to(tl.int64)
    x = tl.load(x_ptr + row * stride_x + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    tl.store(part_ptr + split * stride_ps + row * stride_pt + offs_r,
             tl.sum(a * x[None, :], axis=1), mask=mask_r)


@triton.jit
def _summed_partials(part_ptr, row, stride_ps, stride_pt, offs_r, mask_r, SPLITS,
                     dtype: tl.constexpr, BLOCK_S: tl.constexpr):
    """xa[row, offs_r]: the shrink's partial sums added up, rounded to `dtype` (as the
    tiles' expand rounds it), in float32."""
    offs_s = tl.arange(0, BLOCK_S)
    part = tl.load(part_ptr + offs_s[:, None] * stride_ps + row * stride_pt + offs_r[None, :],
                   mask=(offs_s < SPLITS)[:, None] & mask_r[None, :], other=0.0)
    return round_to(tl.sum(part, axis=0), dtype)


@triton.jit
def _expand_rows(part_ptr, b_ptr, y_ptr, token_slots, stride_ps, stride_pt, stride_bs,
                 stride_bn, stride_y, N, R, SPLITS, BLOCK_N: tl.constexpr,
                 BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr):
    """One row's N block: its shrink's partial sums added up, rounded, expanded. Launched
    with PDL, like the shrink: B's first rank block is read before the wait."""
    pdl.allow_dependents()
    row, nblk = tl.program_id(0), tl.program_id(1)
    slot = tl.load(token_slots + row).to(tl.int64)
    offs_n = nblk * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < tl.where(slot >= 0, N, 0)  # a base row's program reads no B
    b_ptrs = b_ptr + tl.maximum(slot, 0) * stride_bs + offs_n[:, None] * stride_bn
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    b = tl.load(b_ptrs + offs_r[None, :], mask=mask_n[:, None] & mask_r[None, :], other=0.0)
    pdl.wait_for_previous()  # every program waits, those of base rows too (pdl.py)
    if slot < 0:
        return
    row = row.to(tl.int64)
    dtype = b_ptr.dtype.element_ty
    xa = _summed_partials(part_ptr, row, stride_ps, stride_pt, offs_r, mask_r, SPLITS, dtype,
                          BLOCK_S)
    acc = tl.sum(b.to(tl.float32) * xa[None, :], axis=1)
    for r0 in range(BLOCK_R, R, BLOCK_R):  # stacked ranks over one block
        offs_r = r0 + tl.arange(0, BLOCK_R)
        mask_r = offs_r < R
        b = tl.load(b_ptrs + offs_r[None, :], mask=mask_n[:, None] & mask_r[None, :],
                    other=0.0)
        xa = _summed_partials(part_ptr, row, stride_ps, stride_pt, offs_r, mask_r, SPLITS,
                              dtype, BLOCK_S)
        acc += tl.sum(b.to(tl.float32) * xa[None, :], axis=1)
    out = y_ptr + row * stride_y + offs_n
    y = tl.load(out, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(out, (y + acc).to(y_ptr.dtype.element_ty), mask=mask_n)


# the interpreter's half-precision tl.dot returns garbage: there the tiles are upcast first
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
TILE_BLOCK_K = 64
ROW_ELEMENTS = 8192  # a one-row shrink program's block of A: [BLOCK_R, BLOCK_K]
MAX_ROW_SPLITS = 64  # the most K blocks a one-row shrink is cut into


@functools.lru_cache(maxsize=None)
def _num_programs(device: torch.device) -> int:
    """How many shrink programs keep the GPU busy: two per multiprocessor (on the CPU, where
    the interpreter runs, a large GPU's count, so tests cut K as a GPU would)."""
    if device.type == "cuda":
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return 2 * 132


def tile_splits(tiles: int, r_blocks: int, K: int, device: torch.device) -> tuple[int, int]:
    """(splits, K per split) for the tiled shrink: enough programs to fill the GPU, each
    over whole BLOCK_K blocks of K."""
    k_blocks = triton.cdiv(K, TILE_BLOCK_K)
    wanted = max(1, min(k_blocks, triton.cdiv(_num_programs(device), tiles * r_blocks)))
    per_split = triton.cdiv(k_blocks, wanted)
    return triton.cdiv(k_blocks, per_split), per_split * TILE_BLOCK_K


def row_blocks(K: int, R: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_K) of the one-row shrink: blocks of A of about ROW_ELEMENTS, K cut
    into at most MAX_ROW_SPLITS blocks."""
    block_r = max(16, min(64, triton.next_power_of_2(R)))
    block_k = max(ROW_ELEMENTS // block_r,
                  triton.next_power_of_2(triton.cdiv(K, MAX_ROW_SPLITS)))
    return block_r, min(block_k, max(16, triton.next_power_of_2(K)))


def lora_shrink_expand(x: Tensor, y: Tensor, a: Tensor, b: Tensor, batch) -> None:
    """y [T, N] += each row's x [T, K] @ a[slot].T @ b[slot].T, in place, for the rows of
    `batch` (a `model.lora.LoRABatch`): a [slots, R, K], b [slots, N, R], both contiguous."""
    T = x.shape[0]
    if T == 0:
        return
    assert x.stride(-1) == 1 and y.stride(-1) == 1 and a.is_contiguous() and b.is_contiguous()
    if batch.one_row_kernels:
        _rows(x, y, a, b, batch.token_slots)
    else:
        _tiles(x, y, a, b, batch)


def _rows(x: Tensor, y: Tensor, a: Tensor, b: Tensor, token_slots: Tensor) -> None:
    (T, K), N, R = x.shape, b.shape[1], a.shape[1]
    block_r, block_k = row_blocks(K, R)
    splits = triton.cdiv(K, block_k)
    part = torch.empty(splits, T, R, dtype=torch.float32, device=x.device)  # all written
    _shrink_rows[(T, triton.cdiv(R, block_r), splits)](
        x, a, part, token_slots, x.stride(0), a.stride(0), a.stride(1), part.stride(0),
        part.stride(1), K, R, BLOCK_R=block_r, BLOCK_K=block_k, **pdl.launch_options())
    # about 128 programs a row; B's block at most 4096 elements (registers: it is held
    # across the wait)
    block_n = max(16, min(128, 4096 // block_r,
                          max(32, triton.next_power_of_2(triton.cdiv(N, 128)))))
    _expand_rows[(T, triton.cdiv(N, block_n))](
        part, b, y, token_slots, part.stride(0), part.stride(1), b.stride(0), b.stride(1),
        y.stride(0), N, R, splits, BLOCK_N=block_n, BLOCK_R=block_r,
        BLOCK_S=triton.next_power_of_2(splits), **pdl.launch_options())


def _tiles(x: Tensor, y: Tensor, a: Tensor, b: Tensor, batch) -> None:
    (T, K), N, R = x.shape, b.shape[1], a.shape[1]
    block_r = max(16, min(64, triton.next_power_of_2(R)))
    tiles, r_blocks = batch.tile_slots.shape[0], triton.cdiv(R, block_r)
    if tiles == 0:
        return
    splits, per_split = tile_splits(tiles, r_blocks, K, x.device)
    # base rows are never read; split K's partial sums are added to zeros
    xa = (torch.zeros if splits > 1 else torch.empty)(T, R, dtype=torch.float32,
                                                      device=x.device)
    precision = "ieee" if _INTERPRET else dot_precision(x.dtype)
    _shrink_tiles[(tiles, r_blocks, splits)](
        x, a, xa, batch.sorted_rows, batch.tile_starts, batch.tile_lens, batch.tile_slots,
        x.stride(0), a.stride(0), a.stride(1), xa.stride(0), K, R, per_split,
        BLOCK_M=batch.tile_rows, BLOCK_R=block_r, BLOCK_K=TILE_BLOCK_K, PRECISION=precision,
        UPCAST=_INTERPRET, ATOMIC=splits > 1)
    block_n = 64
    _expand_tiles[(tiles, triton.cdiv(N, block_n))](
        xa, b, y, batch.sorted_rows, batch.tile_starts, batch.tile_lens, batch.tile_slots,
        xa.stride(0), b.stride(0), b.stride(1), y.stride(0), N, R, BLOCK_M=batch.tile_rows,
        BLOCK_N=block_n, BLOCK_R=block_r, PRECISION=precision, UPCAST=_INTERPRET)
