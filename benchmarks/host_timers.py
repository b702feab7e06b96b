"""Host time per engine-step phase, for benchmarks that need to see where a step goes.

Wraps methods of one engine's objects with wall-clock timers: the step, scheduling, the
executor's launches, the structured-output manager's calls on the engine thread (handing a
job to its workers, waiting for a bitmask) and the wait for the device's tokens. A phase
that grows with the device's work shows up as `wait_for_tokens` (or inside `execute_model`,
which waits for its input buffers' previous uploads); one that grows with Python work shows
up in its own phase.
"""

from __future__ import annotations

import time

from pagedserve.device.model_runner import PendingRunnerOutput
from pagedserve.frontend.llm_engine import LLMEngine


class HostTimers:
    """Wall time per engine-step phase (ms per step), to see where a constrained step's time
    goes: the grammar's host work (submit, wait), the launches, and the wait for the
    device's tokens. Installed on the engine's objects; `take()` returns and resets."""

    def __init__(self, engine: LLMEngine) -> None:
        core = engine.engine_core
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._wrap(core, "step", "step")
        self._wrap(core.scheduler, "schedule", "schedule")
        self._wrap(core.executor, "execute_model", "execute_model")
        self._wrap(core.executor, "sample_tokens", "sample_tokens")
        # the grammar work runs on the manager's workers: `grammar_submit` is the engine
        # thread's share (planning the job), `grammar_wait` the part it waits for (not
        # hidden behind the engine thread's own work)
        self._wrap(core.structured, "submit", "grammar_submit")
        self._wrap(core.structured, "take_bitmask", "grammar_wait")
        self._wrap(PendingRunnerOutput, "result", "wait_for_tokens")

    def _wrap(self, owner, attr: str, name: str) -> None:
        inner = getattr(owner, attr)
        self.seconds[name], self.calls[name] = 0.0, 0

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start
                self.calls[name] += 1

        setattr(owner, attr, timed)

    def take(self) -> dict[str, float]:
        steps = max(self.calls["step"], 1)
        report = {f"{k}_ms_per_step": round(1e3 * v / steps, 3) for k, v in self.seconds.items()}
        report["steps"] = steps
        for k in self.seconds:
            self.seconds[k], self.calls[k] = 0.0, 0
        return report
