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


class StepProfile:
    """This process's trace of the steps between `start` and `stop`, owned in one place for
    the in-process executor and rank 0's worker alike: a second start keeps the running
    trace, a stop without a start writes nothing."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._profiler: profile | None = None

    def start(self) -> None:
        """Trace this process's CPU work from now on, and the device's when it is CUDA."""
        if self._profiler is not None:
            return
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._profiler = profile(activities=activities)
        self._profiler.start()

    def stop(self, trace_path: str) -> None:
        """Wait for the steps launched so far (their kernels belong to the trace), stop,
        write the trace to `trace_path`."""
        if self._profiler is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._profiler.stop()
        self._profiler.export_chrome_trace(trace_path)
        self._profiler = None
