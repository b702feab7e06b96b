"""Where a device's time goes over some steps: torch.profiler started and stopped on request
(`Executor.start_profile` / `stop_profile`), off unless asked for, so a step pays nothing.

Only one process traces: the in-process runner's, or tensor-parallel rank 0's (the ranks run
the same kernels, and one trace is what a person reads). The trace is a Chrome trace (a
`.json.gz` path is written compressed), which chrome://tracing and Perfetto open and
benchmarks summarise (kernels, the CUDA graph launch each came from, the gaps between them).
CUDA kernels replayed from a graph are in it: CUPTI reports them under the correlation id of
their `cudaGraphLaunch`.
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile


def start(device: torch.device) -> profile:
    """A running profiler over this process's CPU work, and the device's when it is CUDA."""
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    profiler = profile(activities=activities)
    profiler.start()
    return profiler


def stop(profiler: profile, device: torch.device, trace_path: str) -> None:
    """Wait for the steps launched so far (their kernels belong to the trace), stop, write."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    profiler.stop()
    profiler.export_chrome_trace(trace_path)
