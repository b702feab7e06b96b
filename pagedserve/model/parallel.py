"""Tensor parallelism: the group of ranks that shard one model, and what each rank keeps.

Every rank holds a slice of each weight and runs the same forward pass on the same tokens:

- column-parallel (output features split): the fused q/k/v projection keeps this rank's query
  heads and the KV heads they read; gate/up keep a slice of the intermediate features. Each
  of q, k, v and gate, up is sliced on its own, so a rank's fused output is its heads, whole.
  Everything per head (RoPE, Qwen3's q/k norm, attention) then runs on the local heads alone;
- row-parallel (input features split): o_proj and down_proj multiply their slice of the
  input and the partial sums are added over ranks with one all-reduce (the bias once, after);
- vocab-parallel: the embedding and the LM head keep a range of the vocabulary. A token id
  outside the range embeds to zeros and the all-reduce fills it in; the LM head's logits are
  gathered over ranks, since the sampler needs the whole vocabulary.

- MoE: every rank keeps every expert, each sliced over its intermediate features (w1/w3 or
  gate/up column-parallel, w2 or down row-parallel), and the router whole: each rank routes
  the same tokens to the same experts and adds its partial sums into one all-reduce;
- FP8 weights: a per-channel scale goes with its output row (sliced with the rows of a
  column-parallel weight, whole for a row-parallel one), a per-tensor scale is kept whole.
  A row-parallel layer's activations are quantized per token over the rank's slice of the
  input features, so its scales are finer than one process's and the sum differs from it by
  less than the quantization error.

So a layer costs two all-reduces of [tokens, hidden], and the KV cache is split by KV head.
With fewer KV heads than ranks (or a count the ranks do not divide), a KV head is kept by
every rank whose query heads read it: replicated, so that attention never crosses ranks.

The group state is process-wide (one model per process): with one rank (the default) every
collective here is a no-op and a rank keeps the whole of every weight.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pagedserve.model import allreduce
from pagedserve.model.config import ModelConfig


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in the tensor-parallel group."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None  # the device collectives: NCCL on CUDA, gloo on CPU
    # small all-reduces over peer memory (`allreduce`); None: every one through `group`
    peer: allreduce.PeerAllReduce | None = None
    # the one-shot all-reduce fused with the residual add and RMSNorm after it; None: the
    # norm runs on its own after `all_reduce_`
    fused: allreduce.FusedAllReduceNorm | None = None
    # the same for the messages two-shot takes; None: the norm runs on its own after them
    fused_two_shot: allreduce.FusedTwoShotAllReduceNorm | None = None


_STATE = TensorParallel()


def get_tp() -> TensorParallel:
    return _STATE


def init_tensor_parallel(rank: int, size: int, device: torch.device, init_method: str | None,
                         timeout: timedelta = timedelta(seconds=60),
                         peer_all_reduce_max_bytes: int = 0,
                         fuse_all_reduce_norm: bool = True,
                         fuse_two_shot_all_reduce_norm: bool = True,
                         all_reduce_push: bool = False,
                         store: dist.Store | None = None) -> TensorParallel:
    """Join the group of `size` ranks (NCCL on CUDA, gloo on the CPU) through `init_method`
    (a torch.distributed rendezvous URL) or an open `store`, and on CUDA set up the
    peer-memory all-reduce for messages up to `peer_all_reduce_max_bytes` where every rank
    can (`allreduce.start`; 0: NCCL for all), and with it, unless `fuse_all_reduce_norm` is
    off, the all-reduce fused with the norm after it (`allreduce.start_fused`; for the
    messages two-shot takes, `allreduce.start_fused_two_shot`, unless
    `fuse_two_shot_all_reduce_norm` is off too); `all_reduce_push`: the one-shot fused
    kernel that pushes the partial products to the peers (`allreduce.FusedAllReduceNorm`).

    The timeout bounds every collective and the rendezvous: a rank that never arrives (a dead
    or missing worker) makes the others fail instead of waiting forever.
    """
    global _STATE
    # NVLink SHARP (NVLS) buffers take GPU memory per communicator and hang on some hosts.
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if size > 1:
        if not dist.is_initialized():
            backend = "nccl" if device.type == "cuda" else "gloo"
            options = {"device_id": device} if device.type == "cuda" else {}
            rendezvous = {"store": store} if store is not None else {"init_method": init_method}
            dist.init_process_group(backend, rank=rank, world_size=size, timeout=timeout,
                                    **rendezvous, **options)
        if dist.get_world_size() != size or dist.get_rank() != rank:
            raise RuntimeError(f"torch.distributed is initialised as rank {dist.get_rank()} of "
                               f"{dist.get_world_size()}, expected rank {rank} of {size}")
        group = dist.group.WORLD
        peer = allreduce.start(size, rank, group, device, peer_all_reduce_max_bytes)
        fused = (allreduce.start_fused(peer, rank, group, device, all_reduce_push)
                 if fuse_all_reduce_norm else None)
        fused_two_shot = (allreduce.start_fused_two_shot(peer, rank, group, device)
                          if fuse_all_reduce_norm and fuse_two_shot_all_reduce_norm else None)
        _STATE = TensorParallel(rank, size, group, peer, fused, fused_two_shot)
    else:
        _STATE = TensorParallel()
    return _STATE


# -- collectives ----------------------------------------------------------------------------


def _fused_one_shot(nbytes: int, dtype: torch.dtype) -> bool:
    """Whether a message whose sum a norm follows takes the fused one-shot kernel."""
    tp = _STATE
    return tp.fused is not None and tp.peer.plan.fuses_norm(nbytes, dtype)


def _fused_two_shot(nbytes: int, dtype: torch.dtype) -> bool:
    """Whether a message whose sum a norm follows takes the fused two-shot kernel: a
    two-shot message the fused one-shot does not take."""
    tp = _STATE
    return (tp.fused_two_shot is not None and not _fused_one_shot(nbytes, dtype)
            and tp.peer.plan.algorithm(nbytes, dtype, True) == "two_shot")


def fuses_norm(shape: tuple[int, int], dtype: torch.dtype) -> bool:
    """Whether a row-parallel product of `shape` whose sum an RMSNorm follows is summed and
    normalised in one kernel (`all_reduce_add_rms_norm_`): peer memory with a fused kernel,
    one-shot up to the plan's fused limit, two-shot above."""
    nbytes = math.prod(shape) * dtype.itemsize
    return _fused_one_shot(nbytes, dtype) or _fused_two_shot(nbytes, dtype)


def partial_target(shape: tuple[int, int], dtype: torch.dtype,
                   fused_slot: int | None = None) -> torch.Tensor | None:
    """Where a row-parallel layer should write its partial product of `shape`, so that its
    sum reads it without a copy: when `fuses_norm` (`fused_slot` given), the fused kernel's
    memory (slot `fused_slot` of the one-shot kernel's; the two-shot kernel has one buffer),
    else the peer all-reduce's buffer when `all_reduce_` will take peer memory; None:
    anywhere (NCCL, one rank)."""
    tp = _STATE
    nbytes = math.prod(shape) * dtype.itemsize
    if fused_slot is not None:
        if _fused_two_shot(nbytes, dtype):
            return tp.fused_two_shot.target(shape, dtype)
        return tp.fused.target(fused_slot, shape, dtype)
    if tp.peer is None or tp.peer.plan.algorithm(nbytes, dtype, True) == "nccl":
        return None
    return tp.peer.target(shape, dtype)


def all_reduce_add_rms_norm_(partial: torch.Tensor, residual: torch.Tensor,
                             weight: torch.Tensor, eps: float,
                             slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(residual + the sum of `partial` over the ranks), that sum, written into
    `residual`) in one kernel, `partial` being `partial_target(..., slot)`: see `fuses_norm`,
    `allreduce.FusedAllReduceNorm` and `allreduce.FusedTwoShotAllReduceNorm`."""
    if _fused_two_shot(partial.numel() * partial.element_size(), partial.dtype):
        return _STATE.fused_two_shot(partial, residual, weight, eps)
    return _STATE.fused(slot, partial, residual, weight, eps)


def all_reduce_(x: torch.Tensor) -> torch.Tensor:
    """Sum x over the ranks (a no-op with one rank): in place, or into a new tensor when x is
    the peer buffer (`partial_target`), which the next reduction reuses."""
    tp = _STATE
    if tp.size == 1:
        return x
    if tp.peer is not None:
        algorithm = tp.peer.plan.algorithm(x.numel() * x.element_size(), x.dtype,
                                           x.is_contiguous())
        if algorithm != "nccl":
            return tp.peer(x, algorithm)
    dist.all_reduce(x, group=tp.group)
    return x


def max_(x: torch.Tensor) -> torch.Tensor:
    """The largest x over the ranks, in place, through the group's own collective (small
    control data, such as which of a step's file reads failed anywhere)."""
    tp = _STATE
    if tp.size > 1:
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=tp.group)
    return x


def broadcast_(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's x on every rank, in place (a no-op with one rank)."""
    tp = _STATE
    if tp.size > 1:
        dist.broadcast(x, src=0, group=tp.group)
    return x


# torch 2.13 renamed the one-tensor all-gather (the old name warns); older releases lack the new
_ALL_GATHER_INTO = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def gather_first_dim(x: torch.Tensor) -> torch.Tensor:
    """Each rank's [n, ...] -> [size * n, ...], rank order, on every rank, in one collective."""
    tp = _STATE
    if tp.size == 1:
        return x
    x = x.contiguous()
    out = torch.empty((tp.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _ALL_GATHER_INTO(out, x, group=tp.group)
    return out


def gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Each rank's [..., n] -> [..., size * n], rank order, on every rank: one collective into
    one buffer (rank-major), then one copy into place (a list of outputs costs NCCL a copy out
    per rank, and then their concatenation)."""
    tp = _STATE
    if tp.size == 1:
        return x
    ranked = gather_first_dim(x).view(tp.size, *x.shape).movedim(0, -2)  # [..., size, n]
    return ranked.reshape(*x.shape[:-1], tp.size * x.shape[-1])


# -- what each rank keeps -------------------------------------------------------------------


def _split(total: int, what: str, tp: TensorParallel) -> int:
    if total % tp.size:
        raise ValueError(f"{what} ({total}) must be divisible by tensor_parallel_size "
                         f"({tp.size})")
    return total // tp.size


def check_shardable(config: ModelConfig, size: int) -> None:
    """A ValueError now, before any worker starts, for a model `size` ranks cannot split."""
    tp = TensorParallel(0, size)
    local_q_heads(config, tp)
    if config.num_experts:
        local_moe_intermediate(config, tp)
    else:
        local_intermediate(config, tp)


def local_q_heads(config: ModelConfig, tp: TensorParallel | None = None) -> range:
    """The query heads this rank computes: a contiguous range."""
    tp = tp or _STATE
    n = _split(config.num_heads, "num_heads", tp)
    return range(tp.rank * n, (tp.rank + 1) * n)


def local_kv_heads(config: ModelConfig, tp: TensorParallel | None = None) -> list[int]:
    """The KV heads this rank keeps (global ids, in order; repeats allowed), chosen so that
    each local KV head serves the same number of consecutive local query heads: the
    attention backends assume a uniform query/KV head ratio.

    When the ranks split the KV heads evenly this is the rank's own range. Otherwise a KV
    head read by several ranks is kept by each; and when one rank's query heads straddle KV
    heads unevenly, a KV head may appear more than once (each copy serves fewer query heads).
    """
    tp = tp or _STATE
    q_heads = local_q_heads(config, tp)
    group = config.num_heads // config.num_kv_heads
    needed = [h // group for h in q_heads]
    n = len(needed)
    for per_kv in range(n, 0, -1):  # the fewest KV heads that keep the ratio uniform
        chunks = [needed[i:i + per_kv] for i in range(0, n, per_kv)]
        if n % per_kv == 0 and all(len(set(c)) == 1 for c in chunks):
            return [c[0] for c in chunks]
    raise AssertionError("unreachable: one query head per KV head is always uniform")


def local_intermediate(config: ModelConfig, tp: TensorParallel | None = None) -> int:
    return _split(config.intermediate_size, "intermediate_size", tp or _STATE)


def local_moe_intermediate(config: ModelConfig, tp: TensorParallel | None = None) -> int:
    """Each expert's intermediate features on this rank."""
    return _split(config.moe_intermediate_size, "moe_intermediate_size", tp or _STATE)


def local_vocab(config: ModelConfig, tp: TensorParallel | None = None) -> range:
    """This rank's rows of the (padded) vocabulary: every rank gets the same count, the last
    one's tail past vocab_size is padding (zero weights, logits cut off after the gather)."""
    tp = tp or _STATE
    per_rank = -(-config.vocab_size // tp.size)
    return range(tp.rank * per_rank, (tp.rank + 1) * per_rank)


_COLUMN_FFN = ("gate_proj", "up_proj", "w1", "w3")
_ROW_FFN = ("down_proj", "w2")


def checkpoint_rows(name: str, config: ModelConfig, tp: TensorParallel | None = None,
                    shape: tuple[int, ...] | None = None) -> tuple[int, list[int]] | None:
    """Which part of the full checkpoint tensor `name` (HF naming, of `shape` if known) this
    rank keeps: (dimension, indices along it; -1 = a zero row of vocab padding), or None for
    all of it. A one-element tensor (an FP8 per-tensor scale) is kept whole.
    """
    tp = tp or _STATE
    if tp.size == 1 or (shape is not None and math.prod(shape) == 1):
        return None
    parts = name.split(".")
    module, kind = parts[-2], parts[-1]
    d = config.head_dim
    if module == "q_proj":
        return 0, _head_rows(local_q_heads(config, tp), d)
    if module in ("k_proj", "v_proj"):
        return 0, _head_rows(local_kv_heads(config, tp), d)
    if module == "o_proj" and kind == "weight":
        return 1, _head_rows(local_q_heads(config, tp), d)
    if module in _COLUMN_FFN + _ROW_FFN:
        if module in _ROW_FFN and kind != "weight":
            return None  # a bias or scale per output row: whole
        n = (local_moe_intermediate(config, tp) if ".experts." in name
             else local_intermediate(config, tp))
        return (1 if module in _ROW_FFN else 0), list(range(tp.rank * n, (tp.rank + 1) * n))
    if module in ("embed_tokens", "lm_head") or name in ("lm_head.weight",):
        return 0, [i if i < config.vocab_size else -1 for i in local_vocab(config, tp)]
    return None


def _head_rows(heads, head_dim: int) -> list[int]:
    return [h * head_dim + i for h in heads for i in range(head_dim)]


def take_rows(source, dim: int, rows: list[int]) -> torch.Tensor:
    """rows (along dim) of a tensor or of a lazy safetensors slice, reading only the span they
    cover; -1 rows come out as zeros."""
    real = [r for r in rows if r >= 0]
    lo, hi = min(real), max(real) + 1
    span = source[lo:hi] if dim == 0 else source[:, lo:hi]
    if real == list(range(lo, hi)) and len(real) == len(rows):
        return span
    index = torch.tensor([r - lo if r >= 0 else 0 for r in rows])
    out = span.index_select(dim, index)
    padding = torch.tensor([r < 0 for r in rows])
    if padding.any():
        out[padding] = 0  # only vocab rows (dim 0) are ever padding
    return out


class VocabParallelEmbedding(nn.Module):
    """Embedding of this rank's vocabulary rows (`weight`, as the checkpoint is sharded, and
    shared with a tied LM head: same rows); under tensor parallelism, once the weights are
    loaded, also the whole padded table (`replicate`), which the lookup reads.

    Why the whole table: a lookup in the rows alone embeds other ranks' ids to zeros, and the
    parts are then all-reduced, at the start of every step: six small kernels and an
    all-reduce that waits for every rank, a visible part of a decode step (docs/benchmarks.md).
    The whole table costs each rank (size - 1) / size of it more memory, which the KV pool,
    sized after loading, gives up."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(len(local_vocab(config)), config.hidden_size))
        self.table: torch.Tensor | None = None  # every rank's rows (TP > 1, `replicate`)

    def replicate(self) -> None:
        """Gather every rank's rows into the whole table (collective: every rank calls it)."""
        if _STATE.size > 1:
            self.table = gather_first_dim(self.weight.detach())

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if _STATE.size == 1:
            return F.embedding(input_ids, self.weight)
        if self.table is None:
            raise RuntimeError("the embedding's table is gathered once the weights are loaded")
        return F.embedding(input_ids, self.table)
