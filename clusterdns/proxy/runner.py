"""A bounded-frequency runner: kube-proxy's sync loop as an asyncio task.

`fn` runs at most `burst` times back to back and then no more often than once
per `min_interval` (a token bucket refilled at 1/min_interval), and at least
once per `max_interval` even when nobody asks. Requests made while a run is
pending or in progress coalesce into one more run. After a failure the caller
asks for `retry_after(d)`. Time comes from an injected clock and sleep so the
tests drive it without real waiting.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Awaitable, Callable

log = logging.getLogger(__name__)


class BoundedFrequencyRunner:
    def __init__(self, name: str, fn: Callable[[], Awaitable[None]], min_interval: float,
                 max_interval: float, burst: int = 2, *,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        if max_interval < min_interval:
            raise ValueError(f"{name}: max interval {max_interval} < min interval {min_interval}")
        self.name = name
        self.fn = fn
        self.min_interval = float(min_interval)
        self.max_interval = float(max_interval)
        self.burst = max(1, int(burst)) if min_interval > 0 else 1
        self.clock = clock
        self.sleep = sleep
        self._tokens = float(self.burst)
        self._last_refill = clock()
        self._requested = False
        self._retry_at: float | None = None
        self._next_periodic = self._last_refill + self.max_interval
        self._wake = asyncio.Event()
        self._stopped = False
        self.runs = 0

    # -- callers
    def run(self) -> None:
        """Ask for a run as soon as the rate allows; never blocks."""
        self._requested = True
        self._wake.set()

    def retry_after(self, delay: float) -> None:
        """Ask for a run no later than `delay` from now (still rate-limited)."""
        at = self.clock() + max(0.0, delay)
        if self._retry_at is None or at < self._retry_at:
            self._retry_at = at
        self._wake.set()

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()

    # -- token bucket
    def _refill(self, now: float) -> None:
        if self.min_interval <= 0:
            self._tokens = float(self.burst)
        else:
            self._tokens = min(float(self.burst), self._tokens + (now - self._last_refill) / self.min_interval)
        self._last_refill = now

    def _token_wait(self, now: float) -> float:
        """Seconds until a token is available (0 if one is)."""
        self._refill(now)
        if self._tokens >= 1.0 - 1e-9:
            return 0.0
        return (1.0 - self._tokens) * self.min_interval

    def _due(self, now: float) -> bool:
        return self._requested or now >= self._next_periodic or (
            self._retry_at is not None and now >= self._retry_at)

    async def _wait(self, timeout: float) -> None:
        """Sleep until `timeout` passes or someone calls run/retry_after/stop."""
        if self._wake.is_set() or timeout <= 0:
            return
        waiter = asyncio.ensure_future(self._wake.wait())
        sleeper = asyncio.ensure_future(self.sleep(timeout))
        try:
            await asyncio.wait({waiter, sleeper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (waiter, sleeper):
                if not t.done():
                    t.cancel()

    async def loop(self) -> None:
        """Run until stop(); exceptions from fn are logged and retried after min_interval."""
        while not self._stopped:
            now = self.clock()
            if self._due(now):
                wait = self._token_wait(now)
                if wait <= 0:
                    await self._run_once(now)
                    continue
            else:
                deadline = self._next_periodic
                if self._retry_at is not None:
                    deadline = min(deadline, self._retry_at)
                wait = max(0.0, deadline - now)
            self._wake.clear()
            await self._wait(wait if math.isfinite(wait) else 3600.0)

    async def _run_once(self, now: float) -> None:
        self._tokens -= 1.0
        self._requested = False
        self._retry_at = None
        self._next_periodic = now + self.max_interval
        self.runs += 1
        try:
            await self.fn()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("%s: run failed; retrying", self.name)
            self.retry_after(self.min_interval)


__all__ = ["BoundedFrequencyRunner"]
