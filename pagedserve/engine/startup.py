"""Start-up phases, timed: the engine logs them in one line when it is ready, so a user (and
benchmarks/startup.py) sees where a slow start goes without a profiler."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator


class StartupPhases:
    """Seconds per named phase, in the order they ran."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def timed(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def __str__(self) -> str:
        total = sum(self.seconds.values())
        parts = ", ".join(f"{name} {s:.2f}" for name, s in self.seconds.items())
        return f"{total:.2f} s ({parts})"
