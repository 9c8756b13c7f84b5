"""One-endpoint change in nftables mode at scale: netlink batch (proxy/nflink.py) versus `nft -f`.

    python3 bench/proxy/nft_incremental.py [--services 10000] [--endpoints 10] [--runs 20]

Needs root. Loads synthetic_records(services, endpoints) with `nft -f` into a
scratch network namespace (created and deleted here; a few seconds at
10,000 Services), then times
`runs` one-endpoint changes (each on another Service: one endpoint gets a
new address) both ways, end to end: render(previous=..., changed={key}) plus
the apply. nft's time includes its process start and `ip netns exec`. Prints
medians and min/max. The machine is shared: expect noise of tens of percent.
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
from clusterdns.proxy import nflink, nftables
from clusterdns.sources.manifest import publish
from clusterdns.state import StateStore
from clusterdns.synthetic import synthetic_records

CFG = Config.from_options(command="proxy", node_name="node-0", node_ips=("192.168.0.2",),
             cluster_cidrs=("10.0.0.0/8",), service_cidrs=("10.96.0.0/12",))


def nft(ns: str, text: str) -> None:
    r = subprocess.run(["ip", "netns", "exec", ns, "nft", "-f", "-"], input=text, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"nft -f failed: {r.stderr.strip()}")


def changes(store: StateStore, count: int, offset: int):
    """(state, Service key) after each of `count` one-endpoint changes, on different Services."""
    slices = sorted(store.current.slices)
    for i in range(count):
        key = slices[(offset + i * 7919) % len(slices)]
        sl = store.current.slices[key]
        eps = list(sl.endpoints)
        eps[0] = dataclasses.replace(eps[0], addresses=(f"10.250.{offset // 250}.{offset % 250 + i % 5}",))
        store.upsert("EndpointSlice", dataclasses.replace(sl, endpoints=tuple(eps)))
        yield store.current, sl.service_key


def timed(ns: str, store: StateStore, previous, runs: int, offset: int, via_netlink: bool):
    totals, applies, lines = [], [], []
    key = None
    for state, key in changes(store, runs, offset):
        t0 = time.perf_counter()
        rs = nftables.render(state, CFG, previous=previous, changed={key})
        t1 = time.perf_counter()
        if via_netlink:
            nflink.apply(rs.ops, 4, netns=ns)
        else:
            nft(ns, rs.text)
        t2 = time.perf_counter()
        totals.append(t2 - t0)
        applies.append(t2 - t1)
        lines.append(rs.changes)
        previous = rs.state
    return previous, totals, applies, lines, key


def ms(values) -> str:
    return f"median {statistics.median(values) * 1e3:8.1f} ms  (min {min(values) * 1e3:.1f}, max {max(values) * 1e3:.1f})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--services", type=int, default=10000)
    ap.add_argument("--endpoints", type=int, default=10)
    ap.add_argument("--runs", type=int, default=20)
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("needs root (network namespace, nftables)", file=sys.stderr)
        return 2
    ns = f"cdns-nftbench-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        store = StateStore()
        publish(store, synthetic_records(services=args.services, endpoints=args.endpoints))
        t0 = time.perf_counter()
        full = nftables.render(store.current, CFG)
        t1 = time.perf_counter()
        nft(ns, full.text)
        t2 = time.perf_counter()
        s = full.state.summary()
        print(f"table: {args.services} services x {args.endpoints} endpoints: {s['chains']} chains, "
              f"{s['rules']} rules, {s['elements']} map elements")
        print(f"full render {t1 - t0:.2f} s, full nft -f {t2 - t1:.1f} s")
        previous = full.state
        previous, nl_total, nl_apply, nl_lines, key = timed(ns, store, previous, args.runs, 0, True)
        # the netlink changes are in the kernel: the last changed Service's endpoint map holds the new address
        (bucket, _), = previous.owned[key].slots
        name = nftables.endpoints_map(bucket)
        listed = subprocess.run(["ip", "netns", "exec", ns, "nft", "list", "map", "ip", "kube-proxy", name],
                                capture_output=True, text=True).stdout
        if ": 10.250." not in listed:
            raise SystemExit(f"netlink change missing from the kernel: {name}")
        previous, nf_total, nf_apply, nf_lines, _ = timed(ns, store, previous, args.runs, 1000, False)
        print(f"one-endpoint change ({statistics.median(nl_lines):.0f}-line transaction), {args.runs} runs each:")
        print(f"  netlink batch  render+apply {ms(nl_total)};  apply {ms(nl_apply)}")
        print(f"  nft -f         render+apply {ms(nf_total)};  apply {ms(nf_apply)}")
        return 0
    finally:
        nflink.close_all()
        subprocess.run(["ip", "netns", "del", ns], check=False)


if __name__ == "__main__":
    sys.exit(main())
