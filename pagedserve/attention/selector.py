"""The choice of attention backend for a device, apart from the interface (`backend.py`) that
every backend imports."""

from __future__ import annotations

import os
import sys

import torch

from pagedserve.attention import cpu_backend
from pagedserve.attention.backend import AttentionBackend, AttentionShape
from pagedserve.attention.torch_ref import TorchRefBackend
from pagedserve.kernels.native import attention as native_attention


def get_attention_backend(name: str | None, device: torch.device | str,
                          shape: AttentionShape | None = None) -> AttentionBackend:
    """None/"auto" picks "triton" on CUDA, "cpu" on the CPU when the native kernels can be
    built and take the model's attention (`shape`; None: a shape they take), and "torch"
    elsewhere. "cpu" asked for a model the kernel does not take is a ValueError saying why.

    "triton" on a CPU device runs the kernels under the Triton interpreter; TRITON_INTERPRET
    must be set before triton compiles the kernels, so it is set here when the kernels have
    not been imported yet.
    """
    device = torch.device(device)
    reason = None if shape is None else cpu_backend.unsupported(shape)
    if name in (None, "auto"):
        cpu_kernels = device.type == "cpu" and native_attention.available() and reason is None
        name = "triton" if device.type == "cuda" else "cpu" if cpu_kernels else "torch"
    if name == "torch":
        return TorchRefBackend()
    if name == "cpu":
        if device.type != "cpu" or not native_attention.available():
            raise ValueError(f"the cpu attention backend needs a CPU device and the native "
                             f"kernels (device {device.type}; see "
                             "pagedserve.kernels.native.build)")
        if reason is not None:
            raise ValueError(f"attention_backend cpu: {reason}; use auto or torch")
        return cpu_backend.CpuBackend()
    if name == "triton":
        if device.type not in ("cuda", "cpu"):
            raise ValueError(f"the triton attention backend does not run on {device.type}")
        if device.type == "cpu":
            _require_interpreter()
        from pagedserve.attention.triton_backend import TritonBackend  # jits the kernels

        return TritonBackend()
    raise ValueError(f"unknown attention backend {name!r}; expected 'auto', 'torch', 'cpu' or "
                     "'triton'")


# the attention kernels and the helpers they jit with (model_ops: the rotation the K/V store
# applies)
_ATTENTION_KERNELS = tuple(f"pagedserve.kernels.triton.{name}" for name in
                           ("attention", "arrivals", "e4m3", "model_ops", "pdl", "precision"))


def _require_interpreter() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        return
    if any(m.startswith(_ATTENTION_KERNELS) for m in sys.modules):
        raise RuntimeError("the triton backend on CPU needs TRITON_INTERPRET=1 set before "
                           "pagedserve.kernels.triton.attention is imported")
    os.environ["TRITON_INTERPRET"] = "1"
