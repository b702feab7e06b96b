"""Small all-reduces over peer-mapped GPU memory; NCCL for the large ones.

Why: a decode step of a tensor-parallel model makes two all-reduces per layer of a few KiB to
a few MiB each, and NCCL's ring takes tens of microseconds for one however small it is: at
batch 1 those latencies are most of the step. GPUs that can map each other's memory (NVLink,
or PCIe with peer access) can instead reduce by reading their peers' buffers directly:

- one-shot: every rank copies its input into its buffer, waits for its peers to have done
  the same, and sums all the buffers itself (each rank reads everything: least latency, the
  most traffic);
- two-shot: each rank sums one slice of every buffer (reduce-scatter) and writes its sum to
  every peer (all-gather): half the latency's worth of steps more, a world-size-th of the
  traffic per rank, so it wins as messages grow;
- above `max_bytes`, NCCL's ring, which reaches the link's bandwidth.

The buffers are PyTorch's symmetric memory (`torch.distributed._symmetric_memory`) and the
reductions its `one_shot_all_reduce_out` / `two_shot_all_reduce_out` kernels, which read and
write peers' memory through ordinary loads and stores: never NVLink multicast (multimem),
which the workers turn off (`TORCH_SYMM_MEM_DISABLE_MULTICAST`, `NCCL_NVLS_ENABLE=0`). Both run
inside CUDA graphs, so the captured decode steps take them too.

A row-parallel layer writes its partial product straight into the buffer when its message
takes peer memory (`PeerAllReduce.target`), so nothing is copied before the reduction. And
where a norm follows (the residual add and RMSNorm after o_proj and down_proj), a message
one-shot takes goes through `FusedAllReduceNorm` instead: one kernel reads the peers' partial
products, sums them, adds the residual and normalises (`kernels/triton/allreduce_norm.py`),
in place of the reduction and the norm's own kernel. It has two buffers of its own, which
the layers alternate between (o_proj's, down_proj's), as that kernel ends without a barrier.
With `--all-reduce-push` (`EngineConfig.all_reduce_push`, off by default until measured) it
pushes instead of reading: each rank stores its partial product into every peer's buffer
before the barrier and sums them all from its own memory after it (one link latency where
the reads cost about three; the buffers world size times as large). A message two-shot
takes goes through `FusedTwoShotAllReduceNorm` likewise
(`kernels/triton/allreduce_norm_two_shot.py`): each rank sums, adds and normalises its share
of the rows and writes its rows of the new residual stream into every peer's buffer, then
normalises the rows its peers wrote into its own; one buffer of its own (partial products,
then the peers' stream rows), its two barriers ordering each call against the next.

The choice is made once, at start-up (`plan`), and agreed by every rank: peer memory only on
CUDA, one host, world sizes the kernels support, every GPU able to reach every other, symmetric
memory available, and a first all-reduce of each kind equal to NCCL's; otherwise NCCL for
everything. Which algorithm a message takes then depends on its size, type and layout alone
(`algorithm`), the same on every rank, since every rank reduces the same shapes in the same
order.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

DTYPES = (torch.bfloat16, torch.float32)  # the symmetric-memory kernels' types
WORLD_SIZES = (2, 4, 8)
ALIGNMENT = 16  # bytes: the kernels move 16-byte vectors
# up to this, one-shot (every rank reads every buffer); beyond, two-shot. Where the two cross
# on NVLink at 2 and 4 ranks was measured (benchmarks/tensor_parallel.py --only allreduce;
# docs/benchmarks.md, "All-reduce, 8 KiB-256 MiB"); 8 ranks is still a guess.
ONE_SHOT_MAX_BYTES = {2: 1 << 20, 4: 512 << 10, 8: 128 << 10}
# up to this, a sum that a norm follows takes the fused one-shot kernel rather than the fused
# two-shot: at 2 ranks one barrier and a pull of the peer's rows beat two-shot's two barriers
# up to 2 MiB (256 rows of 4096 bf16), where the unfused one-shot already lost; at 4 ranks the
# pulled bytes grow with the ranks and two-shot wins past 512 KiB (the same benchmark, its
# fused rows); 8 ranks as unfused
FUSED_ONE_SHOT_MAX_BYTES = {2: 2 << 20, 4: 512 << 10, 8: 128 << 10}
FUSED_CHECK_BYTES = 4 << 10  # the fused kernel's largest first message; smaller limits: unfused
# the world sizes where the fused all-reduce + add + RMSNorm is taken (one-shot and two-shot
# alike): where the one-shot beat the unfused chain in a decode step
# (benchmarks/tensor_parallel.py --only tpot --unfused; docs/benchmarks.md): at 2 ranks, and at
# 4 once a row's work was split over several programs (with one program per row it lost
# there); 8 not measured
FUSED_WORLD_SIZES = (2, 4)


@dataclass(frozen=True)
class AllReducePlan:
    """Which all-reduce a message takes: peer memory up to `max_bytes` (one-shot up to
    `one_shot_max_bytes`), NCCL above; a sum that a norm follows, the fused one-shot kernel
    up to `fused_one_shot_max_bytes` (at most `max_bytes`)."""

    max_bytes: int
    one_shot_max_bytes: int
    fused_one_shot_max_bytes: int

    def fuses_norm(self, nbytes: int, dtype: torch.dtype) -> bool:
        """Whether a contiguous message of `nbytes` whose sum a norm follows takes the fused
        one-shot all-reduce + add + RMSNorm (`FusedAllReduceNorm`): peer memory, up to the
        fused one-shot's limit."""
        return (self.algorithm(nbytes, dtype, True) != "nccl"
                and nbytes <= self.fused_one_shot_max_bytes)

    def algorithm(self, nbytes: int, dtype: torch.dtype, contiguous: bool) -> str:
        """"one_shot", "two_shot" or "nccl" for a message of `nbytes` bytes."""
        if (nbytes == 0 or nbytes > self.max_bytes or nbytes % ALIGNMENT or not contiguous
                or dtype not in DTYPES):
            return "nccl"
        return "one_shot" if nbytes <= self.one_shot_max_bytes else "two_shot"


def plan(world_size: int, max_bytes: int, device_type: str, one_host: bool,
         peer_access: bool) -> AllReducePlan | None:
    """The plan for this group, or None (NCCL for everything) when peer memory cannot serve
    it: not CUDA, several hosts, a world size the kernels lack, a GPU that cannot reach
    another, or `max_bytes` 0 (turned off)."""
    if (max_bytes <= 0 or device_type != "cuda" or not one_host or not peer_access
            or world_size not in WORLD_SIZES):
        return None
    return AllReducePlan(max_bytes, min(max_bytes, ONE_SHOT_MAX_BYTES[world_size]),
                         min(max_bytes, FUSED_ONE_SHOT_MAX_BYTES[world_size]))


class PeerAllReduce:
    """A symmetric-memory buffer of `plan.max_bytes` mapped by every rank of `group`, and the
    two reductions over it. A message written into the buffer by its producer (`target`) is
    reduced into a new tensor; any other is copied into the buffer and reduced into its own
    storage (the result never aliases what peers still read). Both of torch's kernels end
    with a barrier, so the buffer is free again when a reduction returns."""

    def __init__(self, plan: AllReducePlan, group: dist.ProcessGroup,
                 device: torch.device) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.plan = plan
        self.group_name = group.group_name
        with warnings.catch_warnings():  # deprecated (a no-op) in recent PyTorch
            warnings.simplefilter("ignore")
            enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
            if enable is not None:
                enable(self.group_name)
        self.buffer = symm_mem.empty(plan.max_bytes, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)

    def target(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The buffer as a tensor of `shape`, for a producer to write a message into."""
        return self.buffer[:math.prod(shape) * dtype.itemsize].view(dtype).view(shape)

    def __call__(self, x: torch.Tensor, algorithm: str) -> torch.Tensor:
        """The sum of x over the ranks: x itself, summed in place, or a new tensor when x
        is the buffer (`target`)."""
        if x.data_ptr() == self.buffer.data_ptr():
            staged, out = x.view(-1), torch.empty_like(x)
            flat = out.view(-1)
        else:
            flat, out = x.view(-1), x
            staged = self.buffer[:x.numel() * x.element_size()].view(x.dtype)
            staged.copy_(flat)
        if algorithm == "one_shot":
            torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", self.group_name, out=flat)
        else:
            torch.ops.symm_mem.two_shot_all_reduce_out(staged, "sum", self.group_name, flat)
        return out


def _signal_pad_fits(symm_mem, words: int) -> None:
    """Raise unless a signal pad holds `words` int32 flags (older PyTorch cannot tell)."""
    pad_size = getattr(symm_mem, "get_signal_pad_size", None)
    pad_bytes = None if pad_size is None else pad_size()
    if pad_bytes is not None and pad_bytes < 4 * words:
        raise RuntimeError(f"signal pad of {pad_bytes} bytes, the barriers need {4 * words}")


def _peer_tables(nbytes: int, group: dist.ProcessGroup, device: torch.device,
                 signal_words: Callable[[int], int]
                 ) -> tuple[torch.Tensor, int, torch.Tensor, torch.Tensor]:
    """A buffer of `nbytes` of symmetric memory mapped by every rank of `group`: (the buffer,
    this rank, every rank's buffer and signal pad as int64 device-address tables, which the
    Triton kernels read). `signal_words(world size)`: the flags the kernel's barriers use."""
    import torch.distributed._symmetric_memory as symm_mem

    buffer = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
    handle = symm_mem.rendezvous(buffer, group.group_name)
    _signal_pad_fits(symm_mem, signal_words(handle.world_size))
    return (buffer, handle.rank,
            torch.tensor(handle.buffer_ptrs, dtype=torch.int64, device=device),
            torch.tensor(handle.signal_pad_ptrs, dtype=torch.int64, device=device))


class FusedAllReduceNorm:
    """Two buffers (slots) of symmetric memory of `slot_bytes` each (rounded up to 16 bytes),
    and the one-shot all-reduce + residual add + RMSNorm over them
    (`kernels/triton/allreduce_norm.py`). Callers alternate the slots: the kernel has no
    closing barrier, so a slot is written again only after a reduction over the other one
    (see that module). `push`: each rank stores its partial product into every peer's
    buffer and reads them all locally (one link latency instead of about three); a slot
    then holds a sub-slot per rank, so the buffer is world size times as large."""

    def __init__(self, slot_bytes: int, group: dist.ProcessGroup, device: torch.device,
                 push: bool = False) -> None:
        from pagedserve.kernels.triton import allreduce_norm

        self.kernel = allreduce_norm.all_reduce_add_rms_norm
        self.partial_offset = allreduce_norm.partial_offset
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        if allreduce_norm.MAX_PROGRAMS > sms:  # its barrier needs every program resident
            raise RuntimeError(f"{sms} SMs, the fused kernel may launch "
                               f"{allreduce_norm.MAX_PROGRAMS} programs")
        self.slot_bytes = -(-slot_bytes // ALIGNMENT) * ALIGNMENT
        self.push = push
        self.world = dist.get_world_size(group)
        self.buffer, self.rank, self.buffers, self.signals = _peer_tables(
            allreduce_norm.buffer_bytes(self.slot_bytes, self.world, push), group, device,
            allreduce_norm.signal_words)

    def target(self, slot: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Where this rank's partial product for slot `slot` goes, as a tensor of `shape`: the
        slot (with `push`, this rank's own sub-slot of it; the peers' rows land beside it)."""
        start = self.partial_offset(slot, self.rank, self.world, self.slot_bytes, self.push)
        return self.buffer[start:start + math.prod(shape) * dtype.itemsize].view(dtype).view(
            shape)

    def __call__(self, slot: int, partial: torch.Tensor, residual: torch.Tensor,
                 weight: torch.Tensor, eps: float,
                 split: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(residual + the sum of `partial`, which is `target(slot, ...)`, over the
        ranks), that sum, written into `residual`). `split`: programs per row, the kernel's
        choice from the shape by default."""
        return self.kernel(self.buffers, self.signals, self.rank, slot, self.slot_bytes,
                           partial, residual, weight, eps, split, self.push)


class FusedTwoShotAllReduceNorm:
    """A buffer of symmetric memory of twice `max_bytes` (a message's partial product, then
    the rows of the new residual stream that the peers reduced, written there by them), and
    the two-shot all-reduce + residual add + RMSNorm over it
    (`kernels/triton/allreduce_norm_two_shot.py`). One buffer serves every call: the
    kernel's two barriers order a call against the next (see that module)."""

    def __init__(self, max_bytes: int, group: dist.ProcessGroup, device: torch.device) -> None:
        from pagedserve.kernels.triton import allreduce_norm_two_shot

        self.kernel = allreduce_norm_two_shot.all_reduce_add_rms_norm
        # its barriers need every program resident (at most one per SM) and the same programs
        # on every rank (the fewest SMs of the group)
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        programs = torch.tensor([min(allreduce_norm_two_shot.MAX_PROGRAMS, sms)], device=device)
        dist.all_reduce(programs, op=dist.ReduceOp.MIN, group=group)
        self.max_programs = int(programs.item())
        self.max_bytes = max_bytes
        self.buffer, self.rank, self.buffers, self.signals = _peer_tables(
            2 * max_bytes, group, device, allreduce_norm_two_shot.signal_words)

    def target(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The buffer as a tensor of `shape`, for the partial product to be written into."""
        return self.buffer[:math.prod(shape) * dtype.itemsize].view(dtype).view(shape)

    def __call__(self, partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(residual + the sum of `partial`, which is `target(...)`, over the ranks),
        that sum, written into `residual`)."""
        return self.kernel(self.buffers, self.signals, self.rank, self.max_bytes, partial,
                           residual, weight, eps, self.max_programs)


def start(world_size: int, rank: int, group: dist.ProcessGroup, device: torch.device,
          max_bytes: int) -> PeerAllReduce | None:
    """Set up peer all-reduces for this group if every rank can (a collective call: every
    rank makes it and all get the same answer); None means NCCL for everything."""
    if device.type != "cuda" or max_bytes <= 0:  # alike on every rank: no collective
        return None
    hosts = [None] * world_size
    dist.all_gather_object(hosts, _host(), group=group)
    chosen = plan(world_size, max_bytes, device.type, len(set(hosts)) == 1,
                  _peer_access(device, world_size))
    if not _agree(chosen is not None, group, device):
        logger.info("all-reduce: NCCL (peer memory is not open to every rank)")
        return None
    try:
        peer = PeerAllReduce(chosen, group, device)
        ok = _matches_nccl(peer, rank, world_size, group, device)
    except Exception:  # noqa: BLE001 - any failure here means NCCL, on every rank
        logger.exception("peer all-reduce unavailable; NCCL for every all-reduce")
        peer, ok = None, False
    if not _agree(ok, group, device):
        logger.info("all-reduce: NCCL (peer memory failed its first reductions)")
        return None
    logger.info("all-reduce: peer memory up to %d bytes (one-shot up to %d), NCCL above",
                chosen.max_bytes, chosen.one_shot_max_bytes)
    return peer


def start_fused(peer: PeerAllReduce | None, rank: int, group: dist.ProcessGroup,
                device: torch.device, push: bool = False) -> FusedAllReduceNorm | None:
    """Set up the fused one-shot all-reduce + add + RMSNorm beside `peer` for the messages up
    to the plan's `fused_one_shot_max_bytes` (a collective call: every rank makes it and all
    get the same answer); None where there is no peer memory, at a world size where it was
    not the faster (`FUSED_WORLD_SIZES`), or where its first results differ from NCCL's sum
    normalised. `push` (the same on every rank): the variant that pushes each rank's partial
    product to its peers (`FusedAllReduceNorm`); the same first results are checked, so a
    GPU where its stores and flags do not order as they must falls back to the unfused
    path."""
    # alike on every rank (`start` agreed on `peer`): no collective
    if (peer is None or peer.plan.fused_one_shot_max_bytes < FUSED_CHECK_BYTES
            or dist.get_world_size(group) not in FUSED_WORLD_SIZES):
        return None
    try:
        fused = FusedAllReduceNorm(peer.plan.fused_one_shot_max_bytes, group, device, push)
        ok = _fused_matches_nccl(fused, rank, group, device)
    except Exception:  # noqa: BLE001 - any failure here means the unfused path, on every rank
        logger.exception("fused all-reduce + RMSNorm unavailable; the norm runs on its own")
        fused, ok = None, False
    if not _agree(ok, group, device):
        logger.info("all-reduce: the norm after it runs on its own (the fused kernel failed "
                    "its first reductions)")
        return None
    logger.info("all-reduce: fused with the residual add and RMSNorm up to %d bytes%s",
                fused.slot_bytes, " (partial products pushed to the peers)" if push else "")
    return fused


def start_fused_two_shot(peer: PeerAllReduce | None, rank: int, group: dist.ProcessGroup,
                         device: torch.device) -> FusedTwoShotAllReduceNorm | None:
    """Set up the fused two-shot all-reduce + add + RMSNorm beside `peer` for the messages
    two-shot takes (a collective call: every rank makes it and all get the same answer);
    None where there is no peer memory or no message takes two-shot, at a world size
    outside `FUSED_WORLD_SIZES`, or where its first results differ from NCCL's sum
    normalised."""
    # alike on every rank (`start` agreed on `peer`): no collective
    if (peer is None or peer.plan.max_bytes <= peer.plan.one_shot_max_bytes
            or dist.get_world_size(group) not in FUSED_WORLD_SIZES):
        return None
    try:
        fused = FusedTwoShotAllReduceNorm(peer.plan.max_bytes, group, device)
        ok = _two_shot_matches_nccl(fused, rank, group, device)
    except Exception:  # noqa: BLE001 - any failure here means the unfused path, on every rank
        logger.exception("fused two-shot all-reduce + RMSNorm unavailable; the norm runs on "
                         "its own after two-shot")
        fused, ok = None, False
    if not _agree(ok, group, device):
        logger.info("all-reduce: the norm after two-shot runs on its own (the fused kernel "
                    "failed its first reductions)")
        return None
    logger.info("all-reduce: two-shot fused with the residual add and RMSNorm up to %d bytes",
                fused.max_bytes)
    return fused


def _two_shot_matches_nccl(fused: FusedTwoShotAllReduceNorm, rank: int,
                           group: dist.ProcessGroup, device: torch.device) -> bool:
    """A few messages through the fused two-shot kernel, and through NCCL and the norm's own
    kernel: equal? Integer values, so that any order of the sum gives the same result. Row
    counts that the ranks share unevenly and one that leaves a rank none; each twice, as the
    second call meets flags the first left. One width: one compilation at start-up."""
    from pagedserve.kernels.triton import model_ops

    for shape in ((5, 256), (5, 256), (1, 256), (1, 256), (67, 256), (67, 256)):
        weight = torch.arange(shape[1], dtype=torch.float32, device=device).remainder_(7).add_(1)
        x = torch.arange(math.prod(shape), dtype=torch.float32, device=device).view(shape)
        x.remainder_(97).add_(rank)
        residual = torch.ones(shape, device=device)
        want = x.clone()
        dist.all_reduce(want, group=group)
        want_out, want_sum = model_ops.rms_norm(want, weight, 1e-6, residual.clone())
        partial = fused.target(shape, torch.float32)
        partial.copy_(x)
        out, total = fused(partial, residual, weight, 1e-6)
        if not (torch.equal(out, want_out) and torch.equal(total, want_sum)):
            logger.warning("fused two-shot all-reduce + RMSNorm disagrees with NCCL's (%s)",
                           shape)
            return False
    return True


def _fused_matches_nccl(fused: FusedAllReduceNorm, rank: int, group: dist.ProcessGroup,
                        device: torch.device) -> bool:
    """One message through each slot, fused, and through NCCL and the norm's own kernel:
    equal? Integer values, so that any order of the sum gives the same result. Two rows of
    one program each, and one row of several programs (`allreduce_norm.programs_per_row`).
    Each call's values differ from every earlier call's, so a row that a pushing peer's
    stores did not reach in time (the slot's last contents read instead) shows."""
    from pagedserve.kernels.triton import model_ops

    for call, (slot, shape) in enumerate(((0, (2, 256)), (1, (2, 256)),
                                          (0, (1, FUSED_CHECK_BYTES // 4)),
                                          (1, (1, FUSED_CHECK_BYTES // 4)))):  # float32
        weight = torch.arange(shape[1], dtype=torch.float32, device=device).remainder_(7).add_(1)
        x = torch.arange(math.prod(shape), dtype=torch.float32, device=device).view(shape)
        x.remainder_(97).add_(rank + 3 * call)
        residual = torch.ones(shape, device=device)
        want = x.clone()
        dist.all_reduce(want, group=group)
        want_out, want_sum = model_ops.rms_norm(want, weight, 1e-6, residual.clone())
        partial = fused.target(slot, shape, torch.float32)
        partial.copy_(x)
        out, total = fused(slot, partial, residual, weight, 1e-6)
        if not (torch.equal(out, want_out) and torch.equal(total, want_sum)):
            logger.warning("fused all-reduce + RMSNorm (slot %d) disagrees with NCCL's", slot)
            return False
    return True


def _host() -> str:
    import socket

    return socket.gethostname()


def _peer_access(device: torch.device, world_size: int) -> bool:
    """Whether this GPU can map every other GPU of the group (GPU r for rank r)."""
    if torch.cuda.device_count() < world_size:
        return False
    return all(torch.cuda.can_device_access_peer(device.index, other)
               for other in range(world_size) if other != device.index)


def _agree(ok: bool, group: dist.ProcessGroup, device: torch.device) -> bool:
    """True on every rank if it is true on every rank."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def _matches_nccl(peer: PeerAllReduce, rank: int, world_size: int, group: dist.ProcessGroup,
                  device: torch.device) -> bool:
    """One message of each algorithm, summed by peer memory and by NCCL: equal?"""
    sizes = {"one_shot": peer.plan.one_shot_max_bytes,
             "two_shot": peer.plan.max_bytes}
    for algorithm, nbytes in sizes.items():
        if peer.plan.algorithm(nbytes, torch.float32, True) != algorithm:
            continue  # the plan never takes it
        x = torch.arange(nbytes // 4, dtype=torch.float32, device=device).remainder_(97)
        x.add_(rank)
        want = x.clone()
        dist.all_reduce(want, group=group)
        if not torch.equal(peer(x, algorithm), want):
            logger.warning("peer all-reduce (%s) disagrees with NCCL", algorithm)
            return False
    return True
