"""DrainRate: how long a client refused for a full waiting queue should wait (the 429's
Retry-After), from how fast engine requests have recently left the server.

Every engine request that leaves (finished, aborted, timed out) frees its running slot or
its place in the queue, and the queue's head moves up; so the departures of the last
`window` seconds, per second, are the rate at which the queue drains. A refused request
needs `ahead` departures before it would fit; at that rate they take `ahead / rate` seconds.
A fixed hint would be wrong both ways: a second is too soon behind long generations (the
client comes back to another 429) and too late behind short ones.

The hint is a whole number of seconds (RFC 9110's delay-seconds), at least 1 and at most
`MAX_RETRY_AFTER_S`: OpenAI's Python SDK follows a Retry-After of up to two minutes and
replaces a longer one by its own backoff of a few seconds, so a longer honest hint would
bring its clients back sooner, not later; at the cap they come back and get the hint of
then. With no departure in the window (the queue is not moving) the hint is the cap.
"""

from __future__ import annotations

import math
from collections import deque

MAX_RETRY_AFTER_S = 120
DRAIN_WINDOW_S = 30.0


class DrainRate:
    def __init__(self, now: float, window: float = DRAIN_WINDOW_S) -> None:
        """`now`: when counting starts (time.monotonic()); before a whole window has passed
        the rate is over the time since."""
        self._start, self._window = now, window
        self._departures: deque[tuple[float, int]] = deque()  # (when, how many)
        self._count = 0  # the sum of the counts in `_departures`

    def departed(self, count: int, now: float) -> None:
        """`count` engine requests left at `now`."""
        self._forget(now)
        if count > 0:
            self._departures.append((now, count))
            self._count += count

    def retry_after(self, ahead: int, now: float) -> int:
        """Seconds until `ahead` more engine requests have left, at the recent rate."""
        self._forget(now)
        span = min(self._window, now - self._start)
        if self._count == 0 or span <= 0:
            return MAX_RETRY_AFTER_S
        seconds = max(ahead, 1) * span / self._count
        return min(MAX_RETRY_AFTER_S, max(1, math.ceil(seconds)))

    def _forget(self, now: float) -> None:
        while self._departures and self._departures[0][0] < now - self._window:
            self._count -= self._departures.popleft()[1]
