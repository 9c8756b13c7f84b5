"""Proxier rule generation and apply times, full sync and a one-endpoint change.

    python3 bench/proxy/bench_proxy.py [--sizes 1000,10000] [--endpoints 10] [--runs 3] [--modes iptables,nftables]

Rules are applied in a scratch network namespace (needs root; created and
deleted here), through the same executors the proxier uses, so "apply"
includes the subprocess and the kernel transaction. Python time is
process time of the render alone; peak memory is tracemalloc's peak during
one full render, and the process's ru_maxrss at the end. Prints medians.
The machine is shared: expect noise of tens of percent.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import os
import resource
import statistics
import subprocess
import sys
import time
import tracemalloc

from clusterdns.config import load
from clusterdns.proxy.apply import IptablesExecutor, NftExecutor, SubprocessRunner
from clusterdns.state import StateStore
from clusterdns.synthetic import synthetic_records


def cfg_for():
    return load(["proxy", "--node-ip", "192.168.0.2", "--node-name", "node-0",
                 "--cluster-cidr", "10.0.0.0/8", "--apply"], env={})


def states(n: int, endpoints: int):
    """The state, and the state after one endpoint of one Service changed address."""
    records = synthetic_records(services=n, endpoints=endpoints)
    store = StateStore()
    from clusterdns.sources.manifest import publish
    publish(store, records)
    before = store.current
    key = sorted(before.slices)[n // 2]
    sl = before.slices[key]
    eps = list(sl.endpoints)
    eps[0] = dataclasses.replace(eps[0], addresses=("10.250.0.1",))
    store.upsert("EndpointSlice", dataclasses.replace(sl, endpoints=tuple(eps)))
    return before, store.current, sl.service_key


def timed(fn, *args, **kw):
    c0, w0 = time.process_time(), time.perf_counter()
    out = fn(*args, **kw)
    return out, time.process_time() - c0, time.perf_counter() - w0


async def atimed(coro):
    w0 = time.perf_counter()
    out = await coro
    return out, time.perf_counter() - w0


def cold_renders(render, state, cfg, runs):
    """CPU seconds of renders from scratch (no cache): the floor is for these, not for warm
    ones, which reuse the blocks of unchanged Services (the backend's render cache)."""
    return [timed(render, state, cfg, 4)[1] for _ in range(runs)]


def med(xs):
    return statistics.median(xs) if xs else float("nan")


async def bench_iptables(ns, cfg, before, after, key, runs, backend="legacy"):
    from clusterdns.proxy import iptables
    exe = IptablesExecutor(SubprocessRunner(["ip", "netns", "exec", ns]), 4, backend)
    r = {"render_full_cpu": [], "render_full_wall": [], "apply_full": [],
         "render_change_cpu": [], "change_e2e": [], "lines": 0}
    r["render_cold_cpu"] = cold_renders(iptables.render, before, cfg, max(runs, 5))
    cache = iptables.RenderCache()   # as the backend keeps it
    tracemalloc.start()
    iptables.render(before, cfg, 4, cache=cache)
    r["peak_mb"] = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    for i in range(runs):
        rs, cpu, wall = timed(iptables.render, before, cfg, 4, jumps=(i == 0), cache=cache)
        r["render_full_cpu"].append(cpu)
        r["render_full_wall"].append(wall)
        r["lines"] = rs.text.count("\n")
        _, t = await atimed(exe.restore(rs.text))
        r["apply_full"].append(t)
    for i in range(runs):
        state = after if i % 2 == 0 else before
        w0 = time.perf_counter()
        rs, cpu, _ = timed(iptables.render, state, cfg, 4, only={key}, cache=cache)
        await exe.restore(rs.text)
        r["change_e2e"].append(time.perf_counter() - w0)
        r["render_change_cpu"].append(cpu)
    r["change_lines"] = rs.text.count("\n")
    return r


async def bench_nftables(ns, cfg, before, after, key, runs, backend=None):
    from clusterdns.proxy import nftables
    exe = NftExecutor(SubprocessRunner(["ip", "netns", "exec", ns]), 4)
    r = {"render_full_cpu": [], "render_full_wall": [], "apply_full": [],
         "render_change_cpu": [], "change_e2e": [], "lines": 0}
    r["render_cold_cpu"] = cold_renders(nftables.render, before, cfg, max(runs, 5))
    cache = nftables.RenderCache()   # as the backend keeps it
    tracemalloc.start()
    nftables.render(before, cfg, 4, cache=cache)
    r["peak_mb"] = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    prev = None
    for _ in range(runs):
        rs, cpu, wall = timed(nftables.render, before, cfg, 4, cache=cache)
        r["render_full_cpu"].append(cpu)
        r["render_full_wall"].append(wall)
        r["lines"] = rs.text.count("\n")
        _, t = await atimed(exe.apply(rs.text))
        r["apply_full"].append(t)
        prev = rs.state
    paths = set()
    for i in range(max(runs * 2, 6)):
        state = after if i % 2 == 0 else before
        w0 = time.perf_counter()
        # What the proxier does on a partial sync: only the changed Service is
        # rendered, and the transaction goes in over netlink when it can.
        rs, cpu, _ = timed(nftables.render, state, cfg, 4, previous=prev, changed={key}, cache=cache)
        paths.add(await exe.apply_small(rs.text, rs.ops))
        r["change_e2e"].append(time.perf_counter() - w0)
        r["render_change_cpu"].append(cpu)
        prev = rs.state
    r["path"] = "+".join(sorted(paths))
    r["change_lines"] = rs.text.count("\n")
    return r


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1000,10000")
    p.add_argument("--endpoints", type=int, default=10)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--modes", default="iptables,nftables")
    p.add_argument("--iptables-backend", choices=("legacy", "nft"), default="legacy",
                   help="iptables-nft-restore 1.8.9 is quadratic in the number of chains "
                        "(~7 s for 1,000 x 10 here, minutes for 10,000 x 10), so legacy is the default")
    a = p.parse_args()
    if os.geteuid() != 0:
        print("needs root (a scratch network namespace)", file=sys.stderr)
        return 2
    cfg = cfg_for()
    modes = [m for m in a.modes.split(",") if m]
    if "nftables" in modes and importlib.util.find_spec("clusterdns.proxy.nftables") is None:
        print("nftables: clusterdns.proxy.nftables not available, skipped", file=sys.stderr)
        modes.remove("nftables")
    print("render cold: CPU of a full render from scratch (median of >= 5); render full: warm, as the")
    print("proxier's syncs run it (blocks of unchanged Services reused)")
    print(f"{'mode':16} {'services':>8} {'eps':>4} {'lines':>8} {'render cold':>12} {'render full':>12} {'(cpu)':>8} "
          f"{'apply full':>11} {'1-ep change e2e':>16} {'(render cpu)':>13} {'peak MB':>8}")
    for n in [int(x) for x in a.sizes.split(",")]:
        before, after, key = states(n, a.endpoints)
        for mode in modes:
            ns = f"cdn-bench-{os.getpid()}"
            subprocess.run(["ip", "netns", "add", ns], check=True)
            try:
                fn = bench_iptables if mode == "iptables" else bench_nftables
                r = asyncio.run(fn(ns, cfg, before, after, key, a.runs, a.iptables_backend))
            finally:
                subprocess.run(["ip", "netns", "del", ns])
            label = f"{mode}-{a.iptables_backend}" if mode == "iptables" else f"{mode}-{r['path']}"
            print(f"{label:16} {n:>8} {a.endpoints:>4} {r['lines']:>8} {med(r['render_cold_cpu']):>11.3f}s "
                  f"{med(r['render_full_wall']):>11.3f}s "
                  f"{med(r['render_full_cpu']):>7.3f}s {med(r['apply_full']):>10.3f}s "
                  f"{med(r['change_e2e']) * 1000:>14.1f}ms {med(r['render_change_cpu']) * 1000:>11.1f}ms "
                  f"{r['peak_mb']:>8.1f}", flush=True)
    print(f"ru_maxrss {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB "
          f"(includes building the synthetic states)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
