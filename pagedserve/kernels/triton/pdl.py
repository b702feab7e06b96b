"""Programmatic dependent launch (Hopper and later): overlap a kernel's start with the end of
the kernel before it in the stream.

A kernel launched with `launch_pdl=True` may begin while the kernel before it still runs,
once every program of that kernel has called `allow_dependents` (or exited). It must call
`wait_for_previous` before it reads anything the earlier kernel wrote, and before it writes
anything: the wait returns when the earlier kernel has completed and its writes are visible.

Why: a decode step at batch 1 is a chain of ~10 launches per layer (norm, QKV, RoPE, KV
store, attention, output projection, norm, gate/up, SiLU, down), each of a few microseconds.
Launched in order, each pays its launch and its first round trip to memory after the one
before has fully drained. So the step's Triton kernels all start with `step_entry` (allow the
next kernel to launch, then wait for the previous one) and are launched with
`launch_options()`: each one's launch overlaps the previous one's run. The weight GEMVs go
further: their weights do not depend on the previous kernel, so they load their first weight
tile before they wait.

A kernel launched with PDL must wait before its first access to memory that an earlier
kernel may write or read, and every program must wait (a program that returns early without
waiting could let the grid complete before its predecessor has). All of this is a no-op
where PDL is unavailable (the interpreter, GPUs before sm_90, `PAGEDSERVE_PDL=0`): the
branches are pruned when the kernels compile.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without grid dependency control: never enabled
    gdc_launch_dependents = gdc_wait = None


def _supported() -> bool:
    if (os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("PAGEDSERVE_PDL") == "0"
            or gdc_wait is None):
        return False
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


# Decided at the first launch, not at import: asking the device's capability initializes CUDA
# on the current device, which a tensor-parallel worker has not chosen yet when it imports
# this. Kernels compile after that first call, so they see the final value.
_ENABLED = tl.constexpr(False)
_decided = False


def launch_options() -> dict:
    """Keyword arguments for the launch of a kernel that starts with `step_entry` (or waits
    itself): PDL where the GPU has it."""
    global _ENABLED, _decided
    if not _decided:
        _ENABLED, _decided = tl.constexpr(_supported()), True
    return {"launch_pdl": True} if _ENABLED else {}


@triton.jit
def step_entry():
    """First thing in a decode-step kernel: let the next one launch, wait for the last one."""
    allow_dependents()
    wait_for_previous()


@triton.jit
def allow_dependents():
    """Let the next kernel, if launched with PDL, start now (it waits for our writes)."""
    if _ENABLED:
        gdc_launch_dependents()


@triton.jit
def wait_for_previous():
    """Block until the kernel before this one has completed and its writes are visible."""
    if _ENABLED:
        gdc_wait()
