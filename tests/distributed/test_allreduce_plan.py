"""The all-reduce choice (model/allreduce.py): which groups get peer memory, and which
messages take one-shot, two-shot or NCCL. The reductions themselves need GPUs
(tests/gpu/test_gpu_tensor_parallel.py); a gloo group takes NCCL's place here."""

from __future__ import annotations

import pytest
import torch

from pagedserve.model import allreduce, parallel
from pagedserve.model.allreduce import AllReducePlan
from tests.distributed.ranks import run_on_ranks

MiB = 1 << 20


@pytest.mark.parametrize("size", [2, 4, 8])
def test_one_host_of_peer_gpus_gets_peer_memory_up_to_the_limit(size):
    plan = allreduce.plan(size, 8 * MiB, "cuda", one_host=True, peer_access=True)
    assert plan is not None and plan.max_bytes == 8 * MiB
    assert 0 < plan.one_shot_max_bytes < plan.max_bytes
    assert plan.algorithm(8 << 10, torch.bfloat16, True) == "one_shot"  # a decode token
    assert plan.algorithm(plan.one_shot_max_bytes, torch.bfloat16, True) == "one_shot"
    assert plan.algorithm(plan.one_shot_max_bytes + 16, torch.bfloat16, True) == "two_shot"
    assert plan.algorithm(8 * MiB, torch.float32, True) == "two_shot"
    assert plan.algorithm(8 * MiB + 16, torch.bfloat16, True) == "nccl"


@pytest.mark.parametrize("device,one_host,peer,size,limit", [
    ("cpu", True, True, 2, 8 * MiB),    # gloo
    ("cuda", False, True, 2, 8 * MiB),  # ranks on several hosts
    ("cuda", True, False, 2, 8 * MiB),  # PCIe without peer access
    ("cuda", True, True, 3, 8 * MiB),   # a world size the kernels lack
    ("cuda", True, True, 2, 0),         # turned off
])
def test_no_peer_memory_means_nccl_for_everything(device, one_host, peer, size, limit):
    assert allreduce.plan(size, limit, device, one_host, peer) is None


def test_messages_the_kernels_cannot_take_go_to_nccl():
    plan = AllReducePlan(max_bytes=8 * MiB, one_shot_max_bytes=512 << 10,
                         fused_one_shot_max_bytes=2 * MiB)
    assert plan.algorithm(0, torch.bfloat16, True) == "nccl"
    assert plan.algorithm(8 << 10, torch.float16, True) == "nccl"  # no half kernel
    assert plan.algorithm(8 << 10, torch.bfloat16, False) == "nccl"  # a strided view
    assert plan.algorithm((8 << 10) + 2, torch.bfloat16, True) == "nccl"  # not 16-aligned
    assert plan.algorithm(4 * MiB, torch.bfloat16, True) == "two_shot"


def test_the_fused_one_shot_takes_sums_up_to_its_own_limit():
    """The fused sum + add + RMSNorm of `fuses_norm` is a one-shot: a decode token's message,
    up to its own limit, which may pass the unfused one-shot's (two-shot's sizes above it have
    a fused kernel of their own, `parallel.fuses_norm`); NCCL's and the types the kernels
    lack are summed apart from the norm."""
    plan = AllReducePlan(max_bytes=8 * MiB, one_shot_max_bytes=512 << 10,
                         fused_one_shot_max_bytes=2 * MiB)
    assert plan.fuses_norm(8 << 10, torch.bfloat16)  # one token of a 4096-wide model
    assert plan.fuses_norm(512 << 10, torch.float32)
    assert plan.fuses_norm((512 << 10) + 16, torch.bfloat16)  # unfused: two-shot
    assert plan.algorithm((512 << 10) + 16, torch.bfloat16, True) == "two_shot"
    assert plan.fuses_norm(2 * MiB, torch.bfloat16)
    assert not plan.fuses_norm(2 * MiB + 16, torch.bfloat16)  # the fused two-shot's
    assert not plan.fuses_norm(16 * MiB, torch.bfloat16)  # NCCL
    assert not plan.fuses_norm(8 << 10, torch.float16)
    assert not plan.fuses_norm(0, torch.bfloat16)


@pytest.mark.parametrize("size", [2, 4, 8])
def test_the_fused_one_shot_limit_is_never_below_the_unfused_ones(size):
    plan = allreduce.plan(size, 8 * MiB, "cuda", one_host=True, peer_access=True)
    assert plan.one_shot_max_bytes <= plan.fused_one_shot_max_bytes <= plan.max_bytes
    small = allreduce.plan(size, 64 << 10, "cuda", one_host=True, peer_access=True)
    assert small.fused_one_shot_max_bytes == small.max_bytes == 64 << 10


def gloo_fusion_and_target() -> tuple[bool, bool, bool, bool, bool]:
    """On a gloo rank: (fused kernel set up, a decode token's sum fused with its norm, a
    peer-memory place to write its partial product, fused two-shot kernel set up, a
    two-shot-sized sum fused with its norm)."""
    tp = parallel.init_tensor_parallel(parallel.get_tp().rank, parallel.get_tp().size,
                                       torch.device("cpu"), "unused",
                                       peer_all_reduce_max_bytes=8 * MiB)
    shape = (1, 64)
    return (tp.fused is not None, parallel.fuses_norm(shape, torch.float32),
            parallel.partial_target(shape, torch.float32) is not None,
            tp.fused_two_shot is not None, parallel.fuses_norm((256, 4096), torch.bfloat16))


def test_a_cpu_group_never_fuses_nor_writes_into_peer_memory():
    results = run_on_ranks(gloo_fusion_and_target, size=2)
    assert results == [(False, False, False, False, False)] * 2


def small_limit_plan_and_sum(limit: int) -> tuple[bool, list[float]]:
    """On a gloo rank: is there a peer all-reduce, and all_reduce_'s sums."""
    tp = parallel.init_tensor_parallel(parallel.get_tp().rank, parallel.get_tp().size,
                                       torch.device("cpu"), "unused",
                                       peer_all_reduce_max_bytes=limit)
    x = torch.full((8,), float(tp.rank + 1))
    return tp.peer is not None, parallel.all_reduce_(x).tolist()


def test_a_cpu_group_sums_through_gloo_whatever_the_limit():
    results = run_on_ranks(small_limit_plan_and_sum, 8 * MiB, size=2)
    assert results == [(False, [3.0] * 8)] * 2
