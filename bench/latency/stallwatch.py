"""Run `python -m clusterdns ...` with a watchdog that logs where the process stalls.

    python bench/latency/stallwatch.py agent --kubeconfig ...

A thread sleeps 10 ms at a time; when it wakes more than STALL_MS (default 60) late,
something held the GIL (or the machine was busy): it logs the delay with the wall time
and the top frames of every other thread at that moment (the holder has usually just
released it, so its frame is near the cause). gc.callbacks log every collection over
20 ms with its generation. Output goes to stderr (the agent's log), prefixed `STALL`/`GC`.
With STALL_DNS=HOST:PORT a third thread asks that address for STALL_DNS_NAME (A) every
20 ms and logs every thread's frames (`DNS-WAIT`) when no answer came in 150 ms.
"""
from __future__ import annotations

import gc
import os
import runpy
import sys
import threading
import time
import traceback
from datetime import datetime

LIMIT = float(os.environ.get("STALL_MS", "60")) / 1000


def _stamp() -> str:
    return datetime.now().strftime("%Y-%m-%d %H:%M:%S,%f")[:-3]


def _frames() -> str:
    me = threading.get_ident()
    names = {t.ident: t.name for t in threading.enumerate()}
    out = []
    for ident, frame in sys._current_frames().items():
        if ident == me:
            continue
        stack = traceback.extract_stack(frame)[-6:]
        where = " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno}:{f.name}" for f in reversed(stack))
        out.append(f"    [{names.get(ident, ident)}] {where}")
    return "\n".join(out)


def _watch() -> None:
    while True:
        t = time.monotonic()
        time.sleep(0.01)
        late = time.monotonic() - t - 0.01
        if late > LIMIT:
            sys.stderr.write(f"{_stamp()} STALL {late * 1000:.0f} ms\n{_frames()}\n")
            sys.stderr.flush()


def _dns_watch(host: str, port: int) -> None:
    """Ask our own DNS every 20 ms; when no answer came in 150 ms, log every thread's frames
    at that moment (where the receive thread and the loop are while a query waits)."""
    import socket
    name = os.environ.get("STALL_DNS_NAME", "svc-1.ns-1.svc.cluster.local")
    q = (bytes.fromhex("abcd01000001000000000000")
         + b"".join(bytes([len(x)]) + x.encode() for x in name.split(".")) + b"\x00\x00\x01\x00\x01")
    while True:
        time.sleep(0.02)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.settimeout(0.15)
            try:
                s.sendto(q, (host, port))
                s.recvfrom(512)
            except socket.timeout:
                sys.stderr.write(f"{_stamp()} DNS-WAIT 150 ms\n{_frames()}\n")
                sys.stderr.flush()
            except OSError:
                time.sleep(0.1)   # not listening yet


_gc_start = [0.0]


def _gc(phase: str, info: dict) -> None:
    if phase == "start":
        _gc_start[0] = time.monotonic()
        return
    took = time.monotonic() - _gc_start[0]
    if took > 0.02:
        sys.stderr.write(f"{_stamp()} GC gen{info['generation']} {took * 1000:.0f} ms "
                         f"collected {info['collected']}\n")
        sys.stderr.flush()


if __name__ == "__main__":
    threading.Thread(target=_watch, name="stallwatch", daemon=True).start()
    gc.callbacks.append(_gc)
    if os.environ.get("STALL_DNS"):
        h, _, p = os.environ["STALL_DNS"].rpartition(":")
        threading.Thread(target=_dns_watch, args=(h, int(p)), name="stallwatch-dns", daemon=True).start()
    sys.argv = ["clusterdns"] + sys.argv[1:]
    runpy.run_module("clusterdns", run_name="__main__", alter_sys=True)
