"""nftables layout at scale: full load, one-endpoint change, new Service.

    python3 bench/proxy/nft_layout.py [--services 10000] [--endpoints 10] [--runs 20] [--loads 3]

Needs root. In a scratch network namespace (created and deleted here):
* full load: `nft -f` of the full render into an empty namespace, and again
  over the existing table (the full text deletes and recreates it), `--loads`
  times each; the same objects as one netlink batch, and an in-place resync
  (render(previous=..., resync=True)) as one netlink batch; the render is
  timed separately;
* one-endpoint change: render(previous=..., changed={key}) + the netlink batch
  (what the proxier does), `--runs` times, each on another Service;
* a new Service (10 endpoints): render + netlink batch, `--runs` times;
* nftables.programmed(): what a restarted agent reads back from the kernel.
Prints medians (min, max). The old layout's figures (kube-proxy's per-endpoint
chains, measured on this machine) are the baseline:
full load 170 s, one-endpoint change 221-306 ms. The machine is shared by
several sessions: expect tens of percent of noise.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import subprocess
import sys
import time

from clusterdns.config import Config
from clusterdns.model import Endpoint, EndpointPort, EndpointSlice, Service, ServicePort
from clusterdns.proxy import nflink, nftables
from clusterdns.sources.manifest import publish
from clusterdns.state import StateStore
from clusterdns.synthetic import synthetic_records

CFG = Config.from_options(command="proxy", node_name="node-0", node_ips=("192.168.0.2",),
             cluster_cidrs=("10.0.0.0/8",), service_cidrs=("10.96.0.0/12",))
OLD_FULL_S = 170.0
OLD_CHANGE_MS = (221.0, 306.0)


def nft(ns: str, text: str) -> float:
    t0 = time.perf_counter()
    r = subprocess.run(["ip", "netns", "exec", ns, "nft", "-f", "-"], input=text, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"nft -f failed: {r.stderr.strip()[:2000]}")
    return time.perf_counter() - t0


def med(values, unit=1e3, suffix="ms") -> str:
    return (f"median {statistics.median(values) * unit:8.1f} {suffix} "
            f"(min {min(values) * unit:.1f}, max {max(values) * unit:.1f}, n={len(values)})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--services", type=int, default=10000)
    ap.add_argument("--endpoints", type=int, default=10)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--loads", type=int, default=3)
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("needs root (network namespace, nftables)", file=sys.stderr)
        return 2
    print("command: python3 bench/proxy/nft_layout.py " + " ".join(sys.argv[1:]))
    ns = f"cdns-nftlayout-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        store = StateStore()
        publish(store, synthetic_records(services=args.services, endpoints=args.endpoints))
        cache = nftables.RenderCache()
        t0 = time.perf_counter()
        full = nftables.render(store.current, CFG, cache=cache)
        render_s = time.perf_counter() - t0
        s = full.state.summary()
        print(f"table: {args.services} services x {args.endpoints} endpoints: {s['chains']} chains, "
              f"{s['rules']} rules, {s['sets']} sets/maps, {s['elements']} elements; "
              f"full text {len(full.text) / 1e6:.1f} MB, rendered in {render_s:.2f} s")
        empty, existing = [], []
        for _ in range(args.loads):
            subprocess.run(["ip", "netns", "exec", ns, "nft", "flush", "ruleset"], check=True)
            empty.append(nft(ns, full.text))
            existing.append(nft(ns, full.text))
        print(f"full nft -f into an empty namespace:  {med(empty, 1, 's')}   (old layout: {OLD_FULL_S:.0f} s, "
              f"{OLD_FULL_S / statistics.median(empty):.0f}x)")
        print(f"full nft -f over the existing table:  {med(existing, 1, 's')}")
        nl_empty, nl_resync = [], []
        for _ in range(args.loads):
            subprocess.run(["ip", "netns", "exec", ns, "nft", "flush", "ruleset"], check=True)
            t0 = time.perf_counter()
            nflink.apply(full.ops, 4, netns=ns, full=True)
            nl_empty.append(time.perf_counter() - t0)
            resync = nftables.render(store.current, CFG, previous=full.state, resync=True, cache=cache)
            t0 = time.perf_counter()
            nflink.apply(resync.ops, 4, netns=ns, full=True)
            nl_resync.append(time.perf_counter() - t0)
        print(f"full netlink batch into an empty namespace: {med(nl_empty, 1, 's')}")
        print(f"full resync (in place) as a netlink batch:  {med(nl_resync, 1, 's')}")

        reads = []
        for _ in range(args.loads):
            t0 = time.perf_counter()
            found = nftables.programmed(4, netns=ns)
            reads.append(time.perf_counter() - t0)
        if len(found) != args.services or any(len(eps) != args.endpoints for eps in found.values()):
            raise SystemExit(f"programmed() read {len(found)} service ports back, not {args.services}")
        print(f"programmed() (restart adoption read, netlink): {med(reads)}")

        previous = full.state
        slices = sorted(store.current.slices)
        totals, applies, sizes = [], [], []
        for i in range(args.runs):
            sl = store.current.slices[slices[(i * 7919) % len(slices)]]
            eps = list(sl.endpoints)
            eps[0] = dataclasses.replace(eps[0], addresses=(f"10.250.{i // 250}.{i % 250 + 1}",))
            store.upsert("EndpointSlice", dataclasses.replace(sl, endpoints=tuple(eps)))
            t0 = time.perf_counter()
            rs = nftables.render(store.current, CFG, previous=previous, changed={sl.service_key}, cache=cache)
            t1 = time.perf_counter()
            nflink.apply(rs.ops, 4, netns=ns)
            t2 = time.perf_counter()
            totals.append(t2 - t0)
            applies.append(t2 - t1)
            sizes.append(rs.changes)
            if any(not line.split(" ", 2)[1] == "element" for line in rs.text.splitlines()):
                raise SystemExit("an endpoint change touched more than elements:\n" + rs.text)
            previous = rs.state
        listed = subprocess.run(["ip", "netns", "exec", ns, "nft", "list", "table", "ip", "kube-proxy"],
                                capture_output=True, text=True).stdout
        if f"10.250.{(args.runs - 1) // 250}.{(args.runs - 1) % 250 + 1} . 8080" not in listed:
            raise SystemExit("the last netlink change is not in the kernel")
        lo, hi = OLD_CHANGE_MS
        print(f"one-endpoint change, render+apply:    {med(totals)}   (old layout: {lo:.0f}-{hi:.0f} ms, "
              f"{lo / (statistics.median(totals) * 1e3):.0f}x); apply alone {med(applies)}; "
              f"{statistics.median(sizes):.0f} element statements")

        new_totals = []
        for i in range(args.runs):
            name = f"bench-new-{i}"
            svc = Service("bench", name, cluster_ips=(f"10.100.{i // 250}.{i % 250 + 1}",),
                          ports=(ServicePort("http", "TCP", 80, 0, 8080),))
            eps = tuple(Endpoint((f"10.251.{i}.{j + 1}",), node_name="node-1") for j in range(args.endpoints))
            store.upsert("Service", svc)
            store.upsert("EndpointSlice", EndpointSlice("bench", f"{name}-x", name, "IPv4", eps,
                                                        (EndpointPort("http", "TCP", 8080),)))
            t0 = time.perf_counter()
            rs = nftables.render(store.current, CFG, previous=previous, changed={("bench", name)}, cache=cache)
            if not nflink.supported(rs.ops):
                raise SystemExit("a new Service's transaction is not one netlink encodes:\n" + rs.text)
            nflink.apply(rs.ops, 4, netns=ns)
            new_totals.append(time.perf_counter() - t0)
            previous = rs.state
        print(f"new Service ({args.endpoints} endpoints), render+apply: {med(new_totals)}")
        return 0
    finally:
        nflink.close_all()
        subprocess.run(["ip", "netns", "del", ns], check=False)


if __name__ == "__main__":
    sys.exit(main())
