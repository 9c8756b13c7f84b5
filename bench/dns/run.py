#!/usr/bin/env python3
"""DNS benchmark: clusterdns next to unbound on the same names, measured in the same run.

    python3 bench/dns/run.py [--services 10000] [--endpoints 10] [--seconds 4] [--rounds 3]

Generates a state of N services (10% headless, `endpoints` ready endpoints
each), starts `clusterdns dns` (uvloop when installed) and unbound serving the
same names as local-data, writes dnsperf query files for two mixes, and runs
dnsperf against each server in alternating short rounds. Prints per server and
mix the medians of: queries per second, queries per server CPU-second (the
server's utime+stime from /proc/PID/stat around the round), dnsperf's average
latency, a p99 latency from a rate-limited verbose run, loss, and the ratio to
unbound; then the server's RSS, a sustained-rate loss check, and the socket
loop alone with a trivial engine (with and without per-query metrics).

The machine is shared and small: figures are noisy, read them as ratios.
"""
from __future__ import annotations

import argparse
import ipaddress
import os
import random
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from clusterdns.dns.resolvconf import ResolvConf, candidates  # noqa: E402
from clusterdns.synthetic import synthetic_records, to_manifest  # noqa: E402

ZONE = "cluster.local"
TICK = os.sysconf("SC_CLK_TCK")
EXTERNAL = 1000   # outside names, answered by unbound as clusterdns's upstream


def free_port() -> int:
    for _ in range(50):
        u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        u.bind(("127.0.0.1", 0))
        port = u.getsockname()[1]
        t = socket.socket()
        try:
            t.bind(("127.0.0.1", port))
            return port
        except OSError:
            continue
        finally:
            u.close()
            t.close()
    raise RuntimeError("no free port")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK    # utime, stime


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def endpoint_name(ip: str) -> str:
    return ip.replace(".", "-").replace(":", "-")


def build_state(services: int, endpoints: int):
    records = synthetic_records(services=services, endpoints=endpoints, namespaces=100, headless_every=10)
    svcs = [r for k, r in records if k == "Service"]
    slices = {(r.namespace, r.service): r for k, r in records if k == "EndpointSlice"}
    return records, svcs, slices


def unbound_conf(path: Path, port: int, svcs, slices) -> None:
    """The same names as local-data in static zones (unknown names NXDOMAIN, known names NODATA)."""
    lines = [
        "server:", f"  interface: 127.0.0.1@{port}", "  do-ip6: no", "  do-daemonize: no", '  chroot: ""',
        '  username: ""', f'  directory: "{path.parent}"', '  pidfile: ""', "  use-syslog: no", '  logfile: ""',
        "  verbosity: 0", "  num-threads: 1", "  so-rcvbuf: 4m", "  access-control: 127.0.0.0/8 allow",
        '  module-config: "iterator"', "  minimal-responses: yes",
        f'  local-zone: "{ZONE}." static', '  local-zone: "10.in-addr.arpa." static',
        # Never recurse (no traffic leaves loopback); example. names stand for the
        # outside world clusterdns forwards to (its upstream in this benchmark).
        '  local-zone: "." static', '  local-zone: "example." static',
        '  local-data: "example. 300 IN SOA ns.example. hostmaster.example. 1 7200 1800 86400 300"',
        f'  local-data: "{ZONE}. 5 IN SOA ns.dns.{ZONE}. hostmaster.{ZONE}. 1 7200 1800 86400 5"',
        f'  local-data: "10.in-addr.arpa. 5 IN SOA ns.dns.{ZONE}. hostmaster.{ZONE}. 1 7200 1800 86400 5"',
    ]
    for s in svcs:
        fq = f"{s.name}.{s.namespace}.svc.{ZONE}."
        if s.headless:
            for e in slices[(s.namespace, s.name)].endpoints:
                ip = e.addresses[0]
                ep = f"{endpoint_name(ip)}.{fq}"
                lines += [f'  local-data: "{fq} 5 IN A {ip}"', f'  local-data: "{ep} 5 IN A {ip}"',
                          f'  local-data: "_http._tcp.{fq} 5 IN SRV 0 10 80 {ep}"',
                          f'  local-data-ptr: "{ip} 5 {ep}"']
        else:
            ip = s.cluster_ips[0]
            lines += [f'  local-data: "{fq} 5 IN A {ip}"', f'  local-data: "_http._tcp.{fq} 5 IN SRV 0 100 80 {fq}"',
                      f'  local-data-ptr: "{ip} 5 {fq}"']
    lines += [f'  local-data: "ext-{i}.example. 300 IN A 192.0.2.{i % 250 + 1}"' for i in range(EXTERNAL)]
    lines += ["remote-control:", "  control-enable: no"]
    path.write_text("\n".join(lines) + "\n")


def query_files(tmp: Path, svcs, slices, n: int = 100_000) -> dict[str, Path]:
    """dnsperf input for the two query mixes, `mix` and `search` (see README.md)."""
    rnd = random.Random(42)
    fq = [f"{s.name}.{s.namespace}.svc.{ZONE}." for s in svcs]
    ptrs = []
    for s in svcs:
        ip = s.cluster_ips[0] if not s.headless else slices[(s.namespace, s.name)].endpoints[0].addresses[0]
        ptrs.append(ipaddress.ip_address(ip).reverse_pointer + ".")
    mix = []
    for i in range(n):
        k = i % 20
        if k < 14:                                    # 70% A hits
            mix.append(f"{rnd.choice(fq)} A")
        elif k < 16:                                  # 10% AAAA of IPv4-only services: NODATA
            mix.append(f"{rnd.choice(fq)} AAAA")
        elif k < 18:                                  # 10% NXDOMAIN, from a pool as large as the services
            j = rnd.randrange(len(svcs))
            mix.append(f"missing-{j}.ns-{j % 100}.svc.{ZONE}. A")
        elif k == 18:                                 # 5% SRV
            mix.append(f"_http._tcp.{rnd.choice(fq)} SRV")
        else:                                         # 5% PTR
            mix.append(f"{rnd.choice(ptrs)} PTR")
    rnd.shuffle(mix)
    # A pod in ns-0 with the kubelet's resolv.conf asks short names; glibc walks the
    # search list (A and AAAA each) until the name exists.
    conf = ResolvConf(search=(f"ns-0.svc.{ZONE}", f"svc.{ZONE}", ZONE), ndots=5)
    exists = {n.lower() for n in fq}
    search = []
    while len(search) < n:
        s = rnd.choice(svcs)
        short = s.name if s.namespace == "ns-0" and rnd.random() < 0.5 else f"{s.name}.{s.namespace}"
        for cand in candidates(short, conf):
            search += [f"{cand} A", f"{cand} AAAA"]
            if cand.lower() in exists:
                break
    files = {}
    kinds = {
        "A": [f"{rnd.choice(fq)} A" for _ in range(n // 5)],
        "AAAA": [f"{rnd.choice(fq)} AAAA" for _ in range(n // 5)],
        "NX-new": [f"never-{i}.ns-{i % 100}.svc.{ZONE}. A" for i in range(n)],   # each name once
        "SRV": [f"_http._tcp.{rnd.choice(fq)} SRV" for _ in range(n // 5)],
        "PTR": [f"{rnd.choice(ptrs)} PTR" for _ in range(n // 5)],
        "fwd-hit": [f"ext-{rnd.randrange(EXTERNAL)}.example. A" for _ in range(n // 5)],
    }
    for name, lines in [("mix", mix), ("search", search[:n])] + list(kinds.items()):
        p = tmp / f"{name}.txt"
        p.write_text("\n".join(lines) + "\n")
        files[name] = p
    return files


def start_unbound(tmp: Path, svcs, slices) -> tuple[int, subprocess.Popen]:
    """unbound on a free port with unbound_conf's zones (the peer of every comparison): (port, process)."""
    port = free_port()
    conf = tmp / "unbound.conf"
    unbound_conf(conf, port, svcs, slices)
    return port, subprocess.Popen(["unbound", "-d", "-c", str(conf)], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)


def wait_answering(port: int, proc: subprocess.Popen, name: str, timeout: float = 120) -> None:
    import dns.message
    import dns.query
    deadline = time.monotonic() + timeout
    q = dns.message.make_query(name, "A")
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            r = dns.query.udp(q, "127.0.0.1", port=port, timeout=0.5)
            if r.answer:
                return
        except Exception:
            pass
        time.sleep(0.2)
    raise RuntimeError("server did not answer in time")


def dnsperf(port: int, data: Path, seconds: float, pid: int, rate: int = 0, verbose: bool = False,
            passes: int = 0) -> dict:
    """One dnsperf run for `seconds` (or `passes` times through the file)."""
    argv = ["dnsperf", "-s", "127.0.0.1", "-p", str(port), "-d", str(data), "-q", "200", "-t", "2"]
    argv += ["-n", str(passes)] if passes else ["-l", str(seconds)]
    if rate:
        argv += ["-Q", str(rate)]
    if verbose:
        argv += ["-v"]
    before = cpu_seconds(pid)
    out = subprocess.run(argv, capture_output=True, text=True, timeout=(seconds or 0) + 300).stdout
    cpu = cpu_seconds(pid) - before

    def num(pattern: str) -> float:
        m = re.search(pattern, out)
        return float(m.group(1)) if m else 0.0
    sent, done, lost = num(r"Queries sent:\s+(\d+)"), num(r"Queries completed:\s+(\d+)"), num(r"Queries lost:\s+(\d+)")
    res = {"qps": num(r"Queries per second:\s+([\d.]+)"), "completed": done, "sent": sent,
           "loss": 100.0 * lost / sent if sent else 100.0, "avg_ms": 1000 * num(r"Average Latency \(s\):\s+([\d.]+)"),
           "cpu": cpu, "per_cpu": done / cpu if cpu > 0 else 0.0}
    if verbose:
        lat = sorted(float(m) for m in re.findall(r"^> \S+ \S+ \S+ ([\d.]+)$", out, re.M))
        res["p99_ms"] = 1000 * lat[int(len(lat) * 0.99)] if lat else float("nan")
    return res


def median(rounds: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rounds)


def start_loop_double(port: int, stats: bool, slow: bool) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(Path(__file__).with_name("loop_server.py")), "--port", str(port)]
                            + ([] if stats else ["--no-stats"]) + (["--slow"] if slow else []),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--services", type=int, default=10_000)
    ap.add_argument("--endpoints", type=int, default=10)
    ap.add_argument("--seconds", type=float, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-unbound", action="store_true")
    ap.add_argument("--no-loop", action="store_true", help="skip the socket-loop rows (saves ~1 min)")
    args = ap.parse_args()
    for tool in ("dnsperf",) + (() if args.no_unbound else ("unbound",)):
        if shutil.which(tool) is None:
            print(f"{tool} is not installed (Debian package {tool})", file=sys.stderr)
            return 2

    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="clusterdns-bench-") as d:
        tmp = Path(d)
        try:
            records, svcs, slices = build_state(args.services, args.endpoints)
            n_eps = sum(len(s.endpoints) for s in slices.values())
            manifest = tmp / "state.json"
            manifest.write_text(to_manifest(records))
            files = query_files(tmp, svcs, slices)
            probe = f"{svcs[1].name}.{svcs[1].namespace}.svc.{ZONE}."

            servers: dict[str, tuple[int, subprocess.Popen]] = {}
            upstream = ["--no-upstream"]
            if not args.no_unbound:
                uport, u = start_unbound(tmp, svcs, slices)
                procs.append(u)
                wait_answering(uport, u, probe)
                upstream = ["--upstream", f"127.0.0.1:{uport}"]
            port = free_port()
            started = time.monotonic()
            p = subprocess.Popen([sys.executable, "-m", "clusterdns", "dns", "--manifest", str(manifest),
                                  "--listen", f"127.0.0.1:{port}", *upstream, "--metrics-listen", "none",
                                  "--health-listen", "none", "--log-level", "warning"], cwd=ROOT)
            procs.append(p)
            wait_answering(port, p, probe)
            load_s = time.monotonic() - started
            servers["clusterdns"] = (port, p)
            if not args.no_unbound:
                servers["unbound"] = (uport, u)

            print(f"state: {len(svcs)} services ({sum(s.headless for s in svcs)} headless), {n_eps} endpoints; "
                  f"clusterdns loaded and answering after {load_s:.1f} s")
            kinds = {k: files.pop(k) for k in ("A", "AAAA", "NX-new", "SRV", "PTR", "fwd-hit")}
            if "unbound" not in servers:
                kinds.pop("fwd-hit")
            # No warm-up: the first pass through each mix right after loading, every question
            # new to the server (what a restart or a fresh state version costs).
            print("first pass, no warm-up (every question asked for the first time):")
            for mix in ("mix", "search"):
                for name, (prt, proc) in servers.items():
                    r = dnsperf(prt, files[mix], 0, proc.pid, passes=1)
                    print(f"  {name:<11} {mix:<7} {r['qps']:>9.0f} q/s {r['per_cpu']:>9.0f} q/CPU-s  "
                          f"loss {r['loss']:.3f} %")
            # Warm-up: one pass through each file. The engine builds an answer the first
            # time a question is asked and serves it from prebuilt bytes afterwards; the
            # cold cost is measured separately below (NX-new).
            for name, (prt, proc) in servers.items():
                for f in files.values():
                    dnsperf(prt, f, 0, proc.pid, passes=1)
            results: dict[tuple[str, str], list[dict]] = {}
            for _ in range(args.rounds):
                for mix, f in files.items():
                    for name, (prt, proc) in servers.items():
                        results.setdefault((name, mix), []).append(dnsperf(prt, f, args.seconds, proc.pid))
            for mix, f in files.items():
                for name, (prt, proc) in servers.items():
                    results[(name, mix)][0]["p99_ms"] = dnsperf(prt, f, 2, proc.pid, rate=10000, verbose=True)["p99_ms"]

            print(f"\n{'server':<11} {'mix':<7} {'qps':>9} {'q/CPU-s':>9} {'avg ms':>7} {'p99 ms*':>7} "
                  f"{'loss %':>7} {'vs unbound':>10}   (median of {args.rounds} x {args.seconds:g} s)")
            for mix in files:
                for name in servers:
                    rs = results[(name, mix)]
                    per_cpu = median(rs, "per_cpu")
                    ratio = ""
                    if "unbound" in servers and name != "unbound":
                        ratio = f"{per_cpu / median(results[('unbound', mix)], 'per_cpu'):.2f}"
                    print(f"{name:<11} {mix:<7} {median(rs, 'qps'):>9.0f} {per_cpu:>9.0f} {median(rs, 'avg_ms'):>7.2f} "
                          f"{rs[0]['p99_ms']:>7.2f} {median(rs, 'loss'):>7.3f} {ratio:>10}")
            print("* p99 from a separate 2 s run at 10,000 q/s with per-query latencies (dnsperf -v)")
            port, proc = servers["clusterdns"]
            print(f"\nclusterdns RSS at {len(svcs)} services / {n_eps} endpoints: {rss_mib(proc.pid):.0f} MiB")
            if "unbound" in servers:
                print(f"unbound RSS with the same local-data: {rss_mib(servers['unbound'][1].pid):.0f} MiB")

            # Sustained rate: 80% of the measured throughput on the mix, loss must stay <= 0.1%.
            rate = int(0.8 * median(results[("clusterdns", "mix")], "qps"))
            r = dnsperf(port, files["mix"], args.seconds, proc.pid, rate=rate)
            print(f"sustained {rate} q/s on the mix for {args.seconds:g} s: {r['qps']:.0f} q/s answered, "
                  f"loss {r['loss']:.3f} %, {r['per_cpu']:.0f} q/CPU-s")

            print("\nclusterdns per query kind (one round each; NX-new = never-seen NXDOMAIN names, the slow path;\n"
                  f"fwd-hit = {EXTERNAL} outside names forwarded to unbound, answered from the forwarder's cache):")
            for kind, f in kinds.items():
                if kind != "NX-new":
                    dnsperf(port, f, 0, proc.pid, passes=1)
                r = dnsperf(port, f, args.seconds, proc.pid)
                print(f"  {kind:<7} {r['qps']:>9.0f} q/s {r['per_cpu']:>9.0f} q/CPU-s  loss {r['loss']:.3f} %")

            # The socket loop alone: an engine that answers every query from its own bytes.
            if args.no_loop:
                return 0
            print("\nsocket loop with a trivial engine (answers = the query with QR set):")
            for stats, slow in ((True, False), (False, False), (True, True)):
                lport = free_port()
                lp = start_loop_double(lport, stats, slow)
                procs.append(lp)
                time.sleep(1.5)
                dnsperf(lport, files["mix"], 1, lp.pid)
                rs = [dnsperf(lport, files["mix"], args.seconds, lp.pid) for _ in range(args.rounds)]
                what = "every query through resolve() (a task)" if slow else f"fast path, per-query metrics {'on ' if stats else 'off'}"
                print(f"  {what:<42}: {median(rs, 'qps'):>9.0f} q/s "
                      f"{median(rs, 'per_cpu'):>9.0f} q/CPU-s  loss {median(rs, 'loss'):.3f} %")
                lp.terminate()
                lp.wait(timeout=10)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.terminate()
                    try:
                        p.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        p.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
