"""Engine.update at scale: the first build of the zone view, and the update after one
EndpointSlice changed.

    python3 bench/dns/zone_update.py [--services 10000] [--endpoints 10] [--runs 3]

Wall time of Engine.update, medians of --runs (each run builds a new engine), and the
incremental/full ratio measured in the same run (the machine is shared: compare ratios).
"""
from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

from clusterdns.config import Config
from clusterdns.dns.engine import Engine
from clusterdns.sources.manifest import publish
from clusterdns.state import StateStore
from clusterdns.synthetic import synthetic_records


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--services", type=int, default=10000)
    p.add_argument("--endpoints", type=int, default=10)
    p.add_argument("--runs", type=int, default=3)
    a = p.parse_args()
    full, incremental = [], []
    for _ in range(a.runs):
        store = StateStore()
        publish(store, synthetic_records(a.services, a.endpoints))
        engine = Engine(Config())
        t0 = time.perf_counter()
        engine.update(store.current)
        full.append(time.perf_counter() - t0)
        key = next(iter(store.current.slices))
        sl = store.current.slices[key]
        store.upsert("EndpointSlice", replace(sl, endpoints=sl.endpoints[: max(1, len(sl.endpoints) // 2)]))
        t0 = time.perf_counter()
        engine.update(store.current)
        incremental.append(time.perf_counter() - t0)
    f, i = statistics.median(full), statistics.median(incremental)
    print(f"Engine.update at {a.services} Services x {a.endpoints} endpoints, medians of {a.runs} runs:")
    print(f"  first build {f * 1000:.0f} ms   after one EndpointSlice changed {i * 1000:.1f} ms   ratio {i / f:.3f}")


if __name__ == "__main__":
    main()
