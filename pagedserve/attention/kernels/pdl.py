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
next kernel to launch, then wait for the previous one) and are launched with `LAUNCH`: each
one's launch overlaps the previous one's run. The weight GEMVs go further: their weights do
not depend on the previous kernel, so they load their first weight tile before they wait.

A kernel launched with PDL must wait before its first access to memory that an earlier
kernel may write or read, and every program must wait (a program that returns early without
waiting could let the grid complete before its predecessor has). All of this is a no-op
where PDL is unavailable (the interpreter, GPUs before sm_90, `PAGEDSERVE_PDL=0`).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def _supported() -> bool:
    if os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("PAGEDSERVE_PDL") == "0":
        return False
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


# Read once, at import: griddepcontrol is sm_90 PTX, so kernels only emit it where it exists.
ENABLED = _supported()
_ENABLED = tl.constexpr(ENABLED)

if ENABLED:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
else:  # never called: the branches below are pruned at compile time
    gdc_launch_dependents = gdc_wait = None


# keyword arguments of a launch of a kernel that starts with `step_entry` or waits itself
LAUNCH = {"launch_pdl": True} if ENABLED else {}


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
