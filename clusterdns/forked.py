"""Half of a big one-shot computation in a forked child, while this process does the other half.

Only where it pays and is safe: a fork copies no other thread (so never in a process
with several), and the child's answer costs a pickle or marshal round trip, which is
only won back when the child gets a CPU of its own. Fork early, while the heap is
small: after it, every page either process touches is copied (reading an object writes
its reference count), so splitting the iptables render of a built 10,000-Service state
cost the parent about as much CPU in copied pages as the half of the work it gave away.
"""
from __future__ import annotations

import os
import pickle
from typing import Any, Callable

# Tasks waited for a CPU more than this share of the last 10 s (/proc/pressure/cpu, "some
# avg10"): the machine is contended, and a child would mostly wait (a busy 2-CPU machine
# shared with other work reads 10-15 %, an idle one 0).
PRESSURE_MAX = 5.0


def idle_cpu(loadavg: str = "/proc/loadavg", pressure: str = "/proc/pressure/cpu") -> bool:
    """Whether a CPU this process may use is idle now and has lately been: fewer runnable
    tasks (this one included, /proc/loadavg's fourth field) than CPUs, and little CPU
    pressure over the last 10 s where the kernel reports it. Only a fork that finds a CPU
    of its own pays; one that does not costs its overhead (~0.2-0.4 s) on top."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return False
    if cpus < 2:
        return False
    try:
        with open(loadavg, "rb") as fh:
            running = int(fh.read().split()[3].split(b"/")[0])
    except (OSError, ValueError, IndexError):
        return False
    if running >= cpus:
        return False
    try:
        with open(pressure, "rb") as fh:
            some = fh.readline().split()   # b"some avg10=1.23 avg60=... avg300=... total=..."
        avg10 = float(some[1].split(b"=")[1])
    except FileNotFoundError:
        return True   # no PSI in this kernel: the run queue alone
    except (OSError, ValueError, IndexError):
        return False
    return avg10 < PRESSURE_MAX


def worth_forking() -> bool:
    """A fork is safe (this process has one thread) and a CPU is idle to run the child."""
    if not hasattr(os, "fork"):
        return False
    import threading
    return threading.active_count() == 1 and idle_cpu()


class ChildFailed(Exception):
    """The child raised, died or sent nothing readable: do its part here instead."""


class Child:
    """fn() running in a forked child from construction; result() waits for its return value.

    The value travels through a pipe as dumps(value) (pickle by default; marshal is
    faster for tuples of strings). An exception in fn, or a child that dies, makes
    result() raise ChildFailed. The child exits with os._exit: no atexit handlers, no
    buffered output flushed twice."""

    def __init__(self, fn: Callable[[], Any], dumps: Callable[[Any], bytes] | None = None,
                 loads: Callable[[bytes], Any] | None = None) -> None:
        self._loads = loads or pickle.loads
        dumps = dumps or (lambda v: pickle.dumps(v, protocol=pickle.HIGHEST_PROTOCOL))
        rfd, wfd = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.close(rfd)
                data = dumps(fn())
                with os.fdopen(wfd, "wb") as out:
                    out.write(data)
                code = 0
            finally:
                os._exit(code)
        os.close(wfd)
        self._pid = pid
        self._rfd = rfd

    def result(self) -> Any:
        try:
            with os.fdopen(self._rfd, "rb") as fh:
                data = fh.read()
        finally:
            _, status = os.waitpid(self._pid, 0)
        if status != 0 or not data:
            raise ChildFailed(f"the child ended with status {status}")
        try:
            return self._loads(data)
        except Exception as exc:
            raise ChildFailed(f"unreadable answer from the child: {exc}") from None
