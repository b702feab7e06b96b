"""The 429's Retry-After (drain.py): the time the queue takes to make room at the rate engine
requests left it lately, in whole seconds between 1 and the cap. Times are given, not
measured."""

from __future__ import annotations

from pagedserve.entrypoints.server.drain import MAX_RETRY_AFTER_S, DrainRate


def test_the_hint_is_the_time_for_that_many_departures_at_the_recent_rate():
    drain = DrainRate(now=0.0, window=30.0)
    for t in range(1, 21):  # one a second for 20 s
        drain.departed(1, now=float(t))
    assert drain.retry_after(1, now=20.0) == 1
    assert drain.retry_after(5, now=20.0) == 5
    drain.departed(20, now=20.0)  # twice the rate: 40 over 20 s
    assert drain.retry_after(5, now=20.0) == 3  # 2.5 s, rounded up


def test_only_the_window_counts():
    """A burst long ago says nothing about now: past the window only the recent, slower
    departures set the rate (the window's whole span, not the time since the first)."""
    drain = DrainRate(now=0.0, window=10.0)
    drain.departed(100, now=1.0)
    assert drain.retry_after(50, now=2.0) == 1
    drain.departed(2, now=25.0)
    drain.departed(3, now=30.0)  # 5 in the last 10 s: half a request a second
    assert drain.retry_after(4, now=30.0) == 8


def test_a_queue_that_does_not_move_says_the_cap():
    drain = DrainRate(now=0.0, window=10.0)
    assert drain.retry_after(1, now=5.0) == MAX_RETRY_AFTER_S  # nothing has left yet
    drain.departed(1, now=6.0)
    assert drain.retry_after(1, now=100.0) == MAX_RETRY_AFTER_S  # nothing for 94 s


def test_the_hint_is_whole_seconds_between_one_and_the_cap():
    drain = DrainRate(now=0.0, window=10.0)
    drain.departed(1000, now=10.0)
    assert drain.retry_after(1, now=10.0) == 1  # 0.01 s: at least a second
    assert drain.retry_after(0, now=10.0) == 1
    slow = DrainRate(now=0.0, window=10.0)
    slow.departed(1, now=10.0)  # one per 10 s
    assert slow.retry_after(5, now=10.0) == 50
    assert slow.retry_after(500, now=10.0) == MAX_RETRY_AFTER_S
