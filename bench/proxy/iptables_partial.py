"""iptables partial syncs at scale: kube-proxy's partial text (top-level chains rewritten whole)
against clusterdns's (only what changed), one-endpoint changes, the same backend and table.

    sudo python3 bench/proxy/iptables_partial.py --services 10000 --endpoints 10 --runs 5
    sudo python3 bench/proxy/iptables_partial.py --backend nft --services 1000

Runs IptablesBackend.sync (render in a thread + iptables-restore --noflush) in a scratch
namespace, alternating the two kinds of partial text so that both see the same machine
load; prints medians of render+restore wall time and the lines each text holds, and the
cost of a restore that changes nothing (the floor the tool itself sets).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from dataclasses import replace

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--services", type=int, default=10000)
    p.add_argument("--endpoints", type=int, default=10)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--backend", choices=("legacy", "nft"), default="legacy")
    args = p.parse_args()
    if os.geteuid() != 0:
        print("needs root (a scratch network namespace)", file=sys.stderr)
        return 2
    from clusterdns.config import Config
    from clusterdns.model import Endpoint
    from clusterdns.proxy.apply import SubprocessRunner
    from clusterdns.proxy.proxier import IptablesBackend
    from clusterdns.state import StateStore
    from clusterdns.synthetic import synthetic_records

    ns = f"cdipt-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        cfg = Config.from_options(cluster_cidrs=("10.0.0.0/8",), sync_period=3600.0)
        store = StateStore()
        with store.batch():
            for kind, rec in synthetic_records(services=args.services, endpoints=args.endpoints):
                store.upsert(kind, rec)
        ipt = IptablesBackend(SubprocessRunner(prefix=("ip", "netns", "exec", ns)), cfg, 4)
        ipt.exe.backend = args.backend

        async def go():
            t = time.perf_counter()
            await ipt.sync(store.current, None, 0.0)
            full = time.perf_counter() - t
            kinds = ["kube-proxy", "clusterdns"] + (["clusterdns, tool"] if args.backend == "nft" else [])
            times: dict[str, list[float]] = {k: [] for k in kinds}
            lines: dict[str, list[int]] = {k: [] for k in kinds}
            paths: dict[str, str] = {}
            key = ("ns-1", "svc-1")
            for run in range(args.runs * len(kinds)):
                kind = kinds[run % len(kinds)]
                # nf_tables: the text over netlink (the default), or through iptables-nft-restore
                ipt.exe.netlink = kind != "clusterdns, tool"
                sl = store.current.slices[("ns-1", "svc-1-abcde")]
                eps = sl.endpoints[:-1] if run % (2 * len(kinds)) < len(kinds) \
                    else sl.endpoints + (Endpoint((f"10.255.9.{run}",)),)
                store.upsert("EndpointSlice", replace(sl, endpoints=eps))
                if kind == "kube-proxy":
                    ipt.previous = None     # the partial text rewrites the top-level chains whole
                from clusterdns.proxy import iptables
                original = iptables.render
                captured = {}

                def spy(*a, **kw):
                    rs = original(*a, **kw)
                    captured["n"] = rs.text.count("\n")
                    return rs
                iptables.render = spy
                try:
                    t = time.perf_counter()
                    await ipt.sync(store.current, {key}, 1.0 + run)
                    times[kind].append(time.perf_counter() - t)
                    paths[kind] = ipt.exe.last_path
                finally:
                    iptables.render = original
                lines[kind].append(captured["n"])
            noop = []
            for _ in range(args.runs):
                t = time.perf_counter()
                await ipt.exe.restore("*nat\n-A KUBE-POSTROUTING -j RETURN\n-D KUBE-POSTROUTING -j RETURN\nCOMMIT\n")
                noop.append(time.perf_counter() - t)
            return full, times, lines, noop, paths

        full, times, lines, noop, paths = asyncio.run(go())
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    print(f"iptables-{args.backend}, {args.services} Services x {args.endpoints} endpoints: full sync {full:.2f} s")
    print(f"{'partial text':>16} {'lines':>7} {'render+restore median':>22} {'runs':>5}")
    for kind in times:
        print(f"{kind:>16} {int(statistics.median(lines[kind])):>7} {statistics.median(times[kind]) * 1000:>19.0f} ms"
              f" {len(times[kind]):>5}   ({', '.join(f'{t * 1000:.0f}' for t in times[kind])}) via {paths.get(kind)}")
    print(f"a restore adding and deleting one rule in nat: median {statistics.median(noop) * 1000:.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
