"""BoundedFrequencyRunner under a fake clock: no real sleeping."""
import asyncio
import heapq
import itertools

import pytest

from clusterdns.proxy.runner import BoundedFrequencyRunner


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0
        self._timers: list = []
        self._seq = itertools.count()

    def __call__(self) -> float:
        return self.now

    async def sleep(self, delay: float) -> None:
        fut = asyncio.get_running_loop().create_future()
        heapq.heappush(self._timers, (self.now + delay, next(self._seq), fut))
        await fut

    async def advance(self, delta: float) -> None:
        """Move time forward, waking sleepers in order, letting the loop react."""
        end = self.now + delta
        await settle()
        while self._timers and self._timers[0][0] <= end:
            at, _, fut = heapq.heappop(self._timers)
            self.now = max(self.now, at)
            if not fut.done():
                fut.set_result(None)
            await settle()
        self.now = end
        await settle()


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


@pytest.fixture
async def rig():
    clock = FakeClock()
    times: list[float] = []

    async def fn():
        times.append(clock.now)

    runner = BoundedFrequencyRunner("test", fn, 1.0, 30.0, burst=2, clock=clock, sleep=clock.sleep)
    task = asyncio.create_task(runner.loop())
    await settle()
    yield clock, runner, times
    runner.stop()
    await asyncio.wait_for(task, 1)


async def test_first_request_runs_at_once(rig):
    clock, runner, times = rig
    runner.run()
    await settle()
    assert times == [1000.0]


async def test_requests_coalesce(rig):
    clock, runner, times = rig
    for _ in range(10):
        runner.run()
    await settle()
    assert times == [1000.0]


async def test_burst_then_min_interval(rig):
    clock, runner, times = rig
    runner.run()
    await settle()
    runner.run()
    await settle()
    runner.run()
    await settle()
    # Two tokens: two runs at once, the third waits for a token (1 s).
    assert times == [1000.0, 1000.0]
    await clock.advance(0.5)
    assert len(times) == 2
    await clock.advance(0.6)
    assert times == [1000.0, 1000.0, pytest.approx(1001.0)]
    # Sustained requests run at most once per min interval.
    for _ in range(5):
        runner.run()
        await clock.advance(0.25)
    gaps = [b - a for a, b in zip(times[2:], times[3:])]
    assert all(g >= 0.999 for g in gaps), gaps


async def test_runs_every_max_interval_without_requests(rig):
    clock, runner, times = rig
    await clock.advance(29.9)
    assert times == []
    await clock.advance(0.2)
    assert times == [pytest.approx(1030.0)]
    await clock.advance(30.0)
    assert times == [pytest.approx(1030.0), pytest.approx(1060.0)]


async def test_a_run_resets_the_max_interval(rig):
    clock, runner, times = rig
    await clock.advance(20)
    runner.run()
    await settle()
    await clock.advance(29)
    assert times == [1020.0]
    await clock.advance(1.5)
    assert times == [1020.0, pytest.approx(1050.0)]


async def test_retry_after(rig):
    clock, runner, times = rig
    runner.retry_after(5)
    await clock.advance(4.9)
    assert times == []
    await clock.advance(0.2)
    assert times == [pytest.approx(1005.0)]


async def test_retry_after_respects_min_interval(rig):
    clock, runner, times = rig
    runner.run()
    await settle()
    runner.run()
    await settle()
    runner.retry_after(0)
    await settle()
    assert len(times) == 2   # no token left
    await clock.advance(1.0)
    assert len(times) == 3


async def test_failure_is_retried_and_loop_survives():
    clock = FakeClock()
    calls = []

    async def fn():
        calls.append(clock.now)
        if len(calls) == 1:
            raise RuntimeError("boom")

    runner = BoundedFrequencyRunner("t", fn, 1.0, 30.0, clock=clock, sleep=clock.sleep)
    task = asyncio.create_task(runner.loop())
    runner.run()
    await settle()
    assert len(calls) == 1
    await clock.advance(1.1)
    assert len(calls) == 2
    runner.stop()
    await asyncio.wait_for(task, 1)


async def test_request_during_run_causes_one_more_run():
    clock = FakeClock()
    calls = []
    gate = asyncio.Event()

    async def fn():
        calls.append(clock.now)
        if len(calls) == 1:
            await gate.wait()

    runner = BoundedFrequencyRunner("t", fn, 0.0, 30.0, clock=clock, sleep=clock.sleep)
    task = asyncio.create_task(runner.loop())
    runner.run()
    await settle()
    runner.run()
    runner.run()
    gate.set()
    await settle()
    assert len(calls) == 2
    runner.stop()
    await asyncio.wait_for(task, 1)


def test_bad_intervals():
    async def fn():
        pass
    with pytest.raises(ValueError):
        BoundedFrequencyRunner("t", fn, 10, 1)
