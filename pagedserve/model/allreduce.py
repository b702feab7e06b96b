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

The choice is made once, at start-up (`plan`), and agreed by every rank: peer memory only on
CUDA, one host, world sizes the kernels support, every GPU able to reach every other, symmetric
memory available, and a first all-reduce of each kind equal to NCCL's; otherwise NCCL for
everything. Which algorithm a message takes then depends on its size, type and layout alone
(`algorithm`), the same on every rank, since every rank reduces the same shapes in the same
order.
"""

from __future__ import annotations

import logging
import warnings
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
ONE_SHOT_MAX_BYTES = {2: 512 << 10, 4: 512 << 10, 8: 128 << 10}


@dataclass(frozen=True)
class AllReducePlan:
    """Which all-reduce a message takes: peer memory up to `max_bytes` (one-shot up to
    `one_shot_max_bytes`), NCCL above."""

    max_bytes: int
    one_shot_max_bytes: int

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
    return AllReducePlan(max_bytes, min(max_bytes, ONE_SHOT_MAX_BYTES[world_size]))


class PeerAllReduce:
    """A symmetric-memory buffer of `plan.max_bytes` mapped by every rank of `group`, and the
    two reductions over it. A message is copied into the buffer, reduced into its own
    storage (so the result never aliases what peers still read)."""

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

    def __call__(self, x: torch.Tensor, algorithm: str) -> torch.Tensor:
        flat = x.view(-1)
        staged = self.buffer[:x.numel() * x.element_size()].view(x.dtype)
        staged.copy_(flat)
        if algorithm == "one_shot":
            torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", self.group_name, out=flat)
        else:
            torch.ops.symm_mem.two_shot_all_reduce_out(staged, "sum", self.group_name, flat)
        return x


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
