"""iptables mode on the nf_tables backend: what a full restore costs, and where.

    sudo python3 bench/proxy/iptables_nft_full.py [--sizes 1000,2000,4000,10000] [--endpoints 10]
        [--runs 3] [--plain-limit 2000] [--legacy]

For each size it writes a synthetic manifest, prints the rules as a user would
(`clusterdns rules --mode iptables --manifest M`, a subprocess) and times, each in a
fresh scratch network namespace, whole processes as the proxier runs them:

- plain:    `iptables-nft-restore -w 5 --noflush --counters` of the printed text
            (kube-proxy's call; quadratic, so only up to --plain-limit Services)
- flush:    the same without --noflush (what the tool costs when it may flush the tables;
            not usable by a proxier, it would wipe other components' rules)
- listed:   the text as the tool gets it when netlink is off (apply.whole_table_cache:
            a `-S` line first in the nat table), cold (empty namespace) and warm (the
            same again on the filled tables: a periodic full sync)
- netlink:  the same text as the proxier now sends it on nf_tables: one nfnetlink batch of
            the objects iptables-nft makes (proxy/iptnl.py: read the chains, encode, send),
            in this process, cold and warm ("nl-warm")
- sync:     the proxier's whole first full sync (iptables-save, render, netlink) through
            IptablesBackend, in this process, into an empty namespace
- legacy:   iptables-legacy-restore --noflush of the printed text (with --legacy)

Prints medians of --runs runs (plain: one run per size, it is slow), and the load average
at the start and end of each size; under each row, the median CPU time (user + system) of
the tool's process, or of this process for the netlink load (the kernel's work is done in
its sendmsg). 2 shared cores: expect tens of percent of noise in the wall times.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from clusterdns.config import load  # noqa: E402
from clusterdns.proxy import iptnl  # noqa: E402
from clusterdns.proxy.apply import SubprocessRunner, whole_table_cache  # noqa: E402
from clusterdns.proxy.proxier import IptablesBackend  # noqa: E402
from clusterdns.sources.manifest import publish  # noqa: E402
from clusterdns.state import StateStore  # noqa: E402
from clusterdns.synthetic import synthetic_records, to_manifest  # noqa: E402

NODE = ["--node-ip", "192.168.0.2", "--node-name", "node-0", "--cluster-cidr", "10.0.0.0/8"]


def netns(name: str) -> None:
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    subprocess.run(["ip", "netns", "add", name], check=True)


CPU: dict[str, list[float]] = {}


def children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def timed_restore(ns: str, argv: list[str], text: str, timeout: float, key: str = "") -> float:
    t0, c0 = time.perf_counter(), children_cpu()
    try:
        res = subprocess.run(["ip", "netns", "exec", ns, *argv], input=text, text=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=timeout)
    except subprocess.TimeoutExpired:
        return float("inf")
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed: {res.stderr.strip()[:500]}")
    if key:
        CPU.setdefault(key, []).append(children_cpu() - c0)
    return time.perf_counter() - t0


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1000,2000,4000,10000")
    ap.add_argument("--endpoints", type=int, default=10)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--plain-limit", type=int, default=2000, help="largest size timed with plain --noflush")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--legacy", action="store_true")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("needs root (network namespaces)")
    ns = f"ipt-nft-bench-{os.getpid()}"
    tool = ["iptables-nft-restore", "-w", "5", "--noflush", "--counters"]
    cfg = load(["proxy", *NODE, "--apply"], env={})
    print(f"{'services':>8} {'lines':>7} {'plain':>8} {'flush':>7} {'listed':>7} {'warm':>7} {'netlink':>7} "
          f"{'nl-warm':>7} {'sync':>7}" + (f" {'legacy':>7}" if args.legacy else "") + "  load average")
    try:
        for size in (int(s) for s in args.sizes.split(",")):
            records = synthetic_records(services=size, endpoints=args.endpoints)
            with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
                fh.write(to_manifest(records))
            try:
                text = subprocess.run([sys.executable, "-m", "clusterdns", "rules", "--mode", "iptables",
                                       "--manifest", fh.name, *NODE], check=True, capture_output=True,
                                      text=True).stdout
            finally:
                os.unlink(fh.name)
            listed = whole_table_cache(text)
            r: dict[str, list[float]] = {k: [] for k in ("plain", "flush", "listed", "warm", "netlink", "nl-warm",
                                                         "sync", "legacy")}
            load0 = os.getloadavg()[0]
            if size <= args.plain_limit:
                netns(ns)
                r["plain"].append(timed_restore(ns, tool, text, args.timeout))
            store = StateStore()
            publish(store, records)
            for _ in range(args.runs):
                netns(ns)
                r["flush"].append(timed_restore(ns, ["iptables-nft-restore", "-w", "5", "--counters"], text,
                                                args.timeout, "flush"))
                netns(ns)
                r["listed"].append(timed_restore(ns, tool, listed, args.timeout, "listed"))
                r["warm"].append(timed_restore(ns, tool, listed, args.timeout, "warm"))
                netns(ns)
                for key in ("netlink", "nl-warm"):
                    t0, c0 = time.perf_counter(), time.process_time()
                    iptnl.apply(text, 4, netns=ns)
                    r[key].append(time.perf_counter() - t0)
                    CPU.setdefault(key, []).append(time.process_time() - c0)   # the kernel's work included
                netns(ns)
                backend = IptablesBackend(SubprocessRunner(("ip", "netns", "exec", ns)), cfg, 4)
                backend.exe.backend = "nft"
                t0, c0 = time.perf_counter(), time.process_time() + children_cpu()
                asyncio.run(backend.sync(store.current, None, 0.0))
                r["sync"].append(time.perf_counter() - t0)
                CPU.setdefault("sync", []).append(time.process_time() + children_cpu() - c0)
                if backend.exe.last_path != "netlink":
                    raise SystemExit(f"the proxier's full sync went through {backend.exe.last_path}")
                if args.legacy:
                    netns(ns)
                    r["legacy"].append(timed_restore(ns, ["iptables-legacy-restore", "-w", "5", "--noflush",
                                                          "--counters"], text, args.timeout, "legacy"))

            def f(k: str) -> str:
                v = med(r[k])
                return "-" if v != v else (">%.0f" % args.timeout if v == float("inf") else f"{v:.2f}")
            print(f"{size:>8} {text.count(chr(10)):>7} {f('plain'):>8} {f('flush'):>7} {f('listed'):>7} "
                  f"{f('warm'):>7} {f('netlink'):>7} {f('nl-warm'):>7} {f('sync'):>7}"
                  + (f" {f('legacy'):>7}" if args.legacy else "")
                  + f"  {load0:.1f} -> {os.getloadavg()[0]:.1f}", flush=True)
            print(f"{'':>8} {'cpu s':>7} {'':>8} " + " ".join(
                f"{med(CPU.get(k, [])):>7.2f}" if CPU.get(k) else f"{'-':>7}"
                for k in ("flush", "listed", "warm", "netlink", "nl-warm", "sync"))
                + (f" {med(CPU['legacy']):>7.2f}" if CPU.get("legacy") else ""), flush=True)
            CPU.clear()
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


if __name__ == "__main__":
    main()
