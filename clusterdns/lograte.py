"""Log lines about something that can happen on every query, at most once per interval.

A client or an upstream can make the same thing happen thousands of times a
second (a bug of ours that fails every query, a broken upstream, a client that
resets its connections): one line per interval says how many times it
happened since the last line, instead of one line each time.
"""
from __future__ import annotations

import time
from typing import Callable


class LogLimit:
    """Counts occurrences; `due()` says when the next line may be written and what it counts."""

    __slots__ = ("interval", "clock", "count", "last")

    def __init__(self, interval: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval, self.clock = interval, clock
        self.count, self.last = 0, float("-inf")

    def due(self) -> int:
        """Count one occurrence. When a line is due (the first, then once per interval): the
        number of occurrences it reports, this one included, and the count starts again;
        else 0 (counted for the next line)."""
        self.count += 1
        now = self.clock()
        if now - self.last < self.interval:
            return 0
        n, self.count, self.last = self.count, 0, now
        return n
