"""Cold and warm full renders: what the per-Service caches save when nothing changed.

    python3 bench/proxy/render_cache.py [--services 2000] [--endpoints 10] [--runs 5] [--modes iptables,nftables,ipvs]

A cold render starts with a new render cache (each backend owns one: iptables.RenderCache,
nftables.RenderCache, servicemap.PortsCache for ipvs); a warm one renders the same state
again with it. Process time of the render alone, medians of
--runs, and the warm/cold ratio measured in the same run (the machine is shared: compare
ratios, not absolute figures).
"""
from __future__ import annotations

import argparse
import statistics
import time

from clusterdns.config import Config
from clusterdns.proxy import iptables, ipvs, nftables, servicemap
from clusterdns.state import state_from_records
from clusterdns.synthetic import synthetic_records

CFG = Config.from_options(command="rules", node_name="node-0", node_ips=("192.168.0.2",), cluster_cidrs=("10.0.0.0/8",))
RENDERS = {   # (render, the cache its backend owns)
    "iptables": (lambda st, c: iptables.render(st, CFG, 4, cache=c), iptables.RenderCache),
    "nftables": (lambda st, c: nftables.render(st, CFG, 4, cache=c), nftables.RenderCache),
    "ipvs": (lambda st, c: ipvs.render(st, CFG, 4, cache=c), servicemap.PortsCache),
}


def timed(fn) -> float:
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--services", type=int, default=2000)
    p.add_argument("--endpoints", type=int, default=10)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--modes", default="iptables,nftables,ipvs")
    a = p.parse_args()
    st = state_from_records(synthetic_records(a.services, a.endpoints))
    print(f"{a.services} Services x {a.endpoints} endpoints, medians of {a.runs} runs (process time)")
    for mode in a.modes.split(","):
        render, new_cache = RENDERS[mode]
        cold, warm = [], []
        for _ in range(a.runs):
            c = new_cache()
            cold.append(timed(lambda: render(st, c)))
            warm.append(timed(lambda: render(st, c)))
        c, w = statistics.median(cold), statistics.median(warm)
        print(f"  {mode:9s} cold {c * 1000:8.1f} ms   warm {w * 1000:8.1f} ms   warm/cold {w / c:.2f}")


if __name__ == "__main__":
    main()
