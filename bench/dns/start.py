#!/usr/bin/env python3
"""Where `clusterdns dns` spends its start at 10,000 Services / 100,000 endpoints.

    python3 bench/dns/start.py [--services 10000] [--runs 3]

Runs the steps of `clusterdns dns --manifest FILE` one by one in a fresh
interpreter (imports; the manifest source's first load; DnsService, whose
engine compiles the zone view; binding; the health and metrics listeners,
which the command starts once DNS answers) and prints seconds and RSS after
each, medians of --runs. bench/dns/user.py measures the whole, from exec to
the first answer.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

CHILD = r'''
import json, sys, time
t0 = time.perf_counter()
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
out = []
def step(name, t):
    out.append((name, t, rss()))
import asyncio, gc
import uvloop
from clusterdns.config import load
from clusterdns.lifetime import gc_paused
from clusterdns.sources import loader
from clusterdns.state import StateStore
import clusterdns.commands.dns
import clusterdns.dns.server as server
t = time.perf_counter(); step("imports", t - t0)
cfg = load(["dns", "--manifest", sys.argv[1], "--listen", "127.0.0.1:0", "--no-upstream"])
store = StateStore()
with gc_paused():   # as the dns command: the whole start in one pause, then frozen
    loader.make_source(cfg, store)
    t2 = time.perf_counter(); step("manifest load (parse, records, publish)", t2 - t)
    service = server.DnsService(cfg, store)
    gc.freeze()
t3 = time.perf_counter(); step("zone view compiled (DnsService)", t3 - t2)
async def main():
    await service.start()
    t4 = time.perf_counter(); step("sockets bound, receive threads up", t4 - t3)
    from clusterdns.health import HealthServer
    health = HealthServer(cfg)
    await health.start()
    step("health/metrics up (after DNS answers)", time.perf_counter() - t4)
    await health.stop()
    await service.stop()
uvloop.run(main())
print(json.dumps(out))
'''


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--services", type=int, default=10_000)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(ROOT))
    from run import build_state

    from clusterdns.synthetic import to_manifest
    with tempfile.TemporaryDirectory(prefix="clusterdns-bench-start-") as d:
        manifest = Path(d) / "state.json"
        records, svcs, slices = build_state(args.services, 10)
        manifest.write_text(to_manifest(records))
        runs = []
        for _ in range(args.runs):
            out = subprocess.run([sys.executable, "-c", CHILD, str(manifest)], capture_output=True, text=True,
                                 cwd=ROOT, check=True).stdout
            runs.append(json.loads(out.splitlines()[-1]))
        n_eps = sum(len(s.endpoints) for s in slices.values())
        print(f"{len(svcs)} services / {n_eps} endpoints ({manifest.stat().st_size / 1e6:.0f} MB manifest), "
              f"median of {args.runs} runs:")
        total = 0.0
        for k, (name, _t, _r) in enumerate(runs[0]):
            secs = statistics.median(r[k][1] for r in runs)
            total += secs
            print(f"  {name:<42} {secs:6.2f} s   RSS {statistics.median(r[k][2] for r in runs):5.0f} MiB")
        print(f"  {'total':<42} {total:6.2f} s   (the first answer comes before the last step)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
