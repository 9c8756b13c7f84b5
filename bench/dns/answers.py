#!/usr/bin/env python3
"""The answer engine alone (no sockets): what a query costs the first time and after.

    python3 bench/dns/answers.py [--services 2000] [--rounds 5] [--big] [--peer DIR]

Prints medians over `rounds` runs, in microseconds per query:
  hit          fast() on a prebuilt answer (A, with and without EDNS; best of 5 x 20,000)
  first NX     fast() on never-seen names under svc (search-path misses): NXDOMAIN
  first A/AAAA fast() on Services asked once (A, AAAA NODATA)
  first SRV    headless Services asked SRV once
  first PTR    ClusterIP and endpoint addresses asked once
(a query fast() leaves to resolve() is answered there, in asyncio.run, and costs that).
`--peer DIR`: another checkout (e.g. `git worktree add /tmp/before main~3`, or a
`git archive` of it); its engine is measured in the same process, batch by
batch alternating with this tree's, and the ratio printed (this / peer).

With --big: the first SRV and A of one headless Service with 10,000 and 100,000
endpoints and the first SRV of a Service with 10,000 ports (ms), whether a
flood of 500,000 never-seen names left the names asked before prebuilt, and the
RSS after unique names under unique namespace labels (this tree only).

The machine is shared and small: read the figures as ratios between rows of one run.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import ipaddress
import os
import resource
import statistics
import sys
import tempfile
import time
import timeit
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import dns.message  # noqa: E402
import dns.reversename  # noqa: E402

from clusterdns.config import Config  # noqa: E402
from clusterdns.dns.engine import Engine  # noqa: E402
from clusterdns.model import Endpoint, EndpointPort, EndpointSlice, Service, ServicePort  # noqa: E402
from clusterdns.sources.manifest import publish  # noqa: E402
from clusterdns.state import StateStore  # noqa: E402


def wire(name: str, qtype: str = "A", **kw) -> bytes:
    return dns.message.make_query(name, qtype, **kw).to_wire()


class Impl:
    """One checkout's engine: its own modules (a peer tree is imported under another name)."""

    def __init__(self, label: str, pkg: str) -> None:
        import importlib
        self.label = label
        self.Config = importlib.import_module(f"{pkg}.config").Config
        self.Engine = importlib.import_module(f"{pkg}.dns.engine").Engine
        self.publish = importlib.import_module(f"{pkg}.sources.manifest").publish
        self.StateStore = importlib.import_module(f"{pkg}.state").StateStore
        self.synthetic = importlib.import_module(f"{pkg}.synthetic").synthetic_records

    def engine(self, records, **options):
        store = self.StateStore()
        self.publish(store, records)
        engine = self.Engine(self.Config().with_options(**options))
        engine.update(store.current)
        return engine


def engine_for(records, **options) -> Engine:
    store = StateStore()
    publish(store, records)
    engine = Engine(Config().with_options(**options))
    engine.update(store.current)
    return engine


def answer(engine, w: bytes, tcp: bool = False) -> bytes:
    r = engine.fast(w, tcp)
    if r is None:
        r = asyncio.run(engine.resolve(w, "10.0.0.1", tcp))
    return r


def per_query(impl: Impl, records, batch, repeat: int = 1) -> float:
    """us per query: a fresh engine, then each wire of `batch` answered `repeat` times."""
    engine = impl.engine(records)
    gc.collect()
    gc.freeze()   # as the server does once its start state is built
    t0 = time.perf_counter()
    for _ in range(repeat):
        for w in batch:
            answer(engine, w)
    took = time.perf_counter() - t0
    gc.unfreeze()
    return took / (len(batch) * repeat) * 1e6


def rss_mb() -> float:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def big_headless(n: int, ports: int = 1):
    eps = tuple(Endpoint((str(ipaddress.ip_address(int(ipaddress.ip_address("10.0.0.0")) + 1 + i)),))
                for i in range(n))
    pl = tuple(EndpointPort(f"p{i}", "TCP", 1000 + i) for i in range(ports))
    return [("Service", Service("big", "hl", headless=True)),
            ("EndpointSlice", EndpointSlice("big", "hl-1", "hl", "IPv4", eps, pl))]


def many_ports(n: int):
    return [("Service", Service("big", "ports", cluster_ips=("10.96.200.1",),
                                ports=tuple(ServicePort(f"p{i}", "TCP", 1000 + i) for i in range(n))))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--services", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--big", action="store_true")
    ap.add_argument("--peer", help="another checkout to measure alongside (its clusterdns package)")
    args = ap.parse_args()
    n = args.services
    impls = [Impl("this tree", "clusterdns")]
    if args.peer:
        link = Path(tempfile.mkdtemp()) / "peer_clusterdns"
        link.symlink_to(Path(args.peer).resolve() / "clusterdns")
        sys.path.insert(0, str(link.parent))
        impls.append(Impl(f"peer {args.peer}", "peer_clusterdns"))
    records = {i.label: i.synthetic(n, 3, headless_every=10) for i in impls}
    rows: dict[str, dict[str, list[float]]] = {}

    hot = wire("svc-5.ns-5.svc.cluster.local")
    hot_edns = wire("svc-5.ns-5.svc.cluster.local", use_edns=0, payload=1232)
    nx = [wire(f"never-{i}.ns-{i % 10}.svc.cluster.local") for i in range(3000)]
    search = [wire(f"svc-{i}.ns-{i % 10}.ns-{(i + 1) % 10}.svc.cluster.local") for i in range(3000)]
    fresh_a = [wire(f"svc-{i}.ns-{i % 10}.svc.cluster.local") for i in range(1, n) if i % 10]
    fresh_aaaa = [wire(f"svc-{i}.ns-{i % 10}.svc.cluster.local", "AAAA") for i in range(1, n) if i % 10]
    fresh_srv = [wire(f"svc-{i}.ns-{i % 10}.svc.cluster.local", "SRV") for i in range(0, n, 10)]
    base4 = int(ipaddress.ip_address("10.96.0.0"))
    fresh_ptr = [wire(dns.reversename.from_address(str(ipaddress.ip_address(base4 + 1 + i))).to_text(), "PTR")
                 for i in range(1, n) if i % 10]
    base_ep = int(ipaddress.ip_address("10.0.0.0")) + 256
    fresh_ptr_ep = [wire(dns.reversename.from_address(str(ipaddress.ip_address(base_ep + i))).to_text(), "PTR")
                    for i in range(0, 3 * n, 3)]
    for _ in range(args.rounds):
        for label, batch in (("first NXDOMAIN (never-seen name under svc)", nx),
                             ("first NXDOMAIN (search-path candidate)", search),
                             ("first A of a Service", fresh_a),
                             ("first AAAA (NODATA) of a Service", fresh_aaaa),
                             ("first SRV of a headless Service", fresh_srv),
                             ("first PTR of a ClusterIP", fresh_ptr),
                             ("first PTR of an endpoint", fresh_ptr_ep)):
            for impl in impls:
                rows.setdefault(label, {}).setdefault(impl.label, []).append(
                    per_query(impl, records[impl.label], batch))
        for impl in impls:
            e = impl.engine(records[impl.label])
            for label, w in (("hit, A", hot), ("hit, A with EDNS", hot_edns)):
                answer(e, w)
                answer(e, w)
                best = min(timeit.repeat(lambda e=e, w=w: e.fast(w, False), number=20000, repeat=5))
                rows.setdefault(label, {}).setdefault(impl.label, []).append(best / 20000 * 1e6)
    print(f"engine, {n} services x 3 endpoints (10% headless), median of {args.rounds} (us per query):")
    head = "".join(f"{i.label[:22]:>24s}" for i in impls) + ("   ratio" if len(impls) > 1 else "")
    print(f"  {'':46s}{head}")
    for label, per in rows.items():
        meds = [statistics.median(per[i.label]) for i in impls]
        line = "".join(f"{m:24.2f}" for m in meds)
        if len(meds) > 1:
            line += f"   {meds[0] / meds[1]:5.2f}"
        print(f"  {label:46s}{line}")

    if args.big:
        print("\nbig answers (ms for the first answer, one run each):")
        for label, recs, name, qtype, tcp in (
                ("headless 10,000 endpoints, SRV over UDP", big_headless(10_000), "hl.big.svc.cluster.local", "SRV", False),
                ("headless 10,000 endpoints, SRV over TCP", big_headless(10_000), "hl.big.svc.cluster.local", "SRV", True),
                ("headless 100,000 endpoints, SRV over UDP", big_headless(100_000), "hl.big.svc.cluster.local", "SRV", False),
                ("headless 100,000 endpoints, SRV over TCP", big_headless(100_000), "hl.big.svc.cluster.local", "SRV", True),
                ("headless 100,000 endpoints, A over UDP", big_headless(100_000), "hl.big.svc.cluster.local", "A", False),
                ("10,000 ports, SRV over UDP", many_ports(10_000), "ports.big.svc.cluster.local", "SRV", False),
                ("10,000 ports, SRV over TCP", many_ports(10_000), "ports.big.svc.cluster.local", "SRV", True)):
            e = engine_for(recs)
            w = wire(name, qtype, use_edns=0, payload=1232)
            t0 = time.perf_counter()
            reply = answer(e, w, tcp)
            took = (time.perf_counter() - t0) * 1e3
            m = dns.message.from_wire(reply)
            print(f"  {label:46s} {took:9.1f} ms  ({len(reply)} bytes, TC={int(bool(m.flags & 0x200))})")

        records = records["this tree"]
        e = engine_for(records)
        hot_names = [wire(f"svc-{i}.ns-{i % 10}.svc.cluster.local") for i in range(1, 1000)]
        for w in hot_names * 2:        # names that matter: asked again and again
            answer(e, w)
        for i in range(500_000):
            e.fast(wire(f"flood-{i}.ns-{i % 10}.svc.cluster.local"), False)
            if i % 1000 == 0:
                answer(e, hot_names[(i // 1000) % len(hot_names)])
        kept = sum(1 for w in hot_names if w[12:-4].lower() + w[-4:-2] in e.view.memo)
        print(f"\nafter 500,000 never-seen names: {kept} of {len(hot_names)} names asked before still prebuilt")

        e = engine_for(records)
        before = rss_mb()
        for i in range(300_000):
            e.fast(wire(f"x.n{i}.svc.cluster.local"), False)
        gc.collect()
        print(f"RSS after 300,000 unique names under unique namespace labels: {before:.0f} -> {rss_mb():.0f} MB "
              f"(max RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB)")


if __name__ == "__main__":
    main()
