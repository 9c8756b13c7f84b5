#!/usr/bin/env python3
"""Does a big hosts file stall answers for other names? `clusterdns dns --corefile` with a
hosts plugin (reload 1s) on a file of --lines lines in the `.` block beside kubernetes, and a
second block (template) on the same port; two threads ask a cluster name and the other
block's name every 10 ms.

    python3 bench/dns/hosts_reload.py [--lines 1000000] [--runs 3]

Per run it prints: seconds from exec to the first answer of each name (a big file is read
in the background: the other block answers at once, the hosts block, cluster name included,
once the file is in) and to the first hosts answer; then the longest gap between two answers
of each name (and the longest single query) while the file is replaced and re-read (until a
name only the new file has is answered, and 2 s more), and in a stretch as long right after
(no reload: the machine's own noise). Medians over runs last.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = "testapp-svc.testapp.svc.cluster.local"
OTHER = "www.other.example"


def query(name: str, qid: int) -> bytes:
    return struct.pack("!HHHHHH", qid, 0x0100, 1, 0, 0, 0) + b"".join(
        bytes([len(x)]) + x.encode() for x in name.split(".")) + b"\x00\x00\x01\x00\x01"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Asker(threading.Thread):
    """Asks NAME every 10 ms (a new query when the last is answered or after 10 ms, at most
    one outstanding); keeps the answer times and the longest query."""

    def __init__(self, port: int, name: str) -> None:
        super().__init__(daemon=True)
        self.port, self.name = port, name
        self.answers: list[float] = []
        self.slowest: list[tuple[float, float]] = []     # (sent, took)
        self.stop = False

    def run(self) -> None:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.connect(("127.0.0.1", self.port))
        qid = 0
        while not self.stop:
            qid = (qid + 1) & 0xFFFF
            sent = time.monotonic()
            s.send(query(self.name, qid))
            deadline = sent + 1.0
            while not self.stop:
                s.settimeout(max(0.001, deadline - time.monotonic()))
                try:
                    data = s.recv(4096)
                except (TimeoutError, socket.timeout):
                    break
                except ConnectionRefusedError:      # not listening yet
                    time.sleep(0.01)
                    break
                if len(data) >= 4 and struct.unpack("!H", data[:2])[0] == qid:
                    now = time.monotonic()
                    if data[3] & 0xF == 0:
                        self.answers.append(now)
                        self.slowest.append((sent, now - sent))
                    break
            left = sent + 0.01 - time.monotonic()
            if left > 0:
                time.sleep(left)

    def first(self) -> float | None:
        return self.answers[0] if self.answers else None

    def gap(self, start: float, end: float) -> tuple[float, float]:
        """The longest gap between answers within [start, end] (its edges included) and the
        longest query sent in it, in ms."""
        times = [start] + [t for t in self.answers if start < t < end] + [end]
        gap = max(b - a for a, b in zip(times, times[1:]))
        took = max((d for t, d in self.slowest if start <= t < end), default=0.0)
        return gap * 1000, took * 1000


def ask_once(port: int, name: str) -> bytes | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(1.0)
        try:
            s.sendto(query(name, 7), ("127.0.0.1", port))
            return s.recv(4096)
        except OSError:
            return None


def write_hosts(path: Path, lines: int, tag: int) -> None:
    """Written before the servers start: this process's own GIL must not be busy while it
    times answers (a rewrite here made 1-2 s gaps of its own)."""
    with open(path, "w") as f:
        f.write(f"192.0.2.{tag} marker{tag}.hosts.example\n")
        for i in range(lines - 1):
            f.write(f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255} host{i}.hosts.example alias{i}.hosts.example\n")


def one_run(lines: int, quiet: float, python: str, root: Path, watch: bool) -> dict:
    with tempfile.TemporaryDirectory(prefix="hostsbench-") as d:
        tmp = Path(d)
        port = free_port()
        hosts = tmp / "hosts"
        write_hosts(hosts, lines, 1)
        write_hosts(tmp / "hosts.new", lines, 2)
        (tmp / "Corefile").write_text(f""".:{port} {{
    bind 127.0.0.1
    hosts {hosts} {{
        reload 1s
        fallthrough
    }}
    kubernetes cluster.local in-addr.arpa ip6.arpa
}}
other.example:{port} {{
    bind 127.0.0.1
    template IN A other.example {{
        answer "{{{{ .Name }}}} 60 IN A 192.0.2.99"
    }}
}}
""")
        askers = [Asker(port, CLUSTER), Asker(port, OTHER)]
        for a in askers:
            a.start()
        t0 = time.monotonic()
        run = [python, str(ROOT / "bench" / "latency" / "stallwatch.py")] if watch else [python, "-m", "clusterdns"]
        errors = open(tmp / "stderr", "w+")
        proc = subprocess.Popen([*run, "dns", "--corefile", str(tmp / "Corefile"),
                                 "--manifest", str(ROOT / "examples" / "demo-cluster.yaml"),
                                 "--log-level", "warning"], cwd=root, stdout=subprocess.DEVNULL,
                                stderr=errors, text=True)
        out: dict = {}
        try:
            while not all(a.answers for a in askers) or ask_once(port, "marker1.hosts.example") is None:
                if proc.poll() is not None:
                    errors.seek(0)
                    raise SystemExit(f"clusterdns exited: {errors.read()}")
                if time.monotonic() - t0 > 600:
                    raise SystemExit("no answer in 600 s")
                time.sleep(0.01)
            out["first"] = [(a.first() - t0) for a in askers]   # type: ignore[operator]
            out["hosts_ready"] = time.monotonic() - t0
            time.sleep(quiet)
            r0 = time.monotonic()
            os.replace(tmp / "hosts.new", hosts)
            os.utime(hosts)
            wrote = time.monotonic()
            while True:
                reply = ask_once(port, "marker2.hosts.example")
                if reply is not None and reply[3] & 0xF == 0 and b"\xc0\x00\x02\x02" in reply:
                    break
                if time.monotonic() - r0 > 600:
                    raise SystemExit("the reload never showed")
                time.sleep(0.01)
            # a while longer: what the old table's release costs comes after the swap
            time.sleep(2.0)
            r1 = time.monotonic()
            out["reload"] = [a.gap(r0, r1) for a in askers]
            out["reload_took"] = r1 - 2.0 - wrote
            # the peer: as long a stretch without a reload (the machine's own stalls, which grow
            # with the time looked at)
            q0 = time.monotonic()
            time.sleep(r1 - r0)
            q1 = time.monotonic()
            out["quiet"] = [a.gap(q0, q1) for a in askers]
        finally:
            for a in askers:
                a.stop = True
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
            if watch:       # what stallwatch saw (STALL: the GIL or a CPU was away; GC: a collection)
                errors.seek(0)
                print(errors.read(), flush=True)
            errors.close()
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lines", type=int, default=1_000_000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--quiet", type=float, default=5.0, help="seconds to wait between the start and the reload")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--stallwatch", action="store_true",
                    help="run the server under bench/latency/stallwatch.py and print what it logged")
    ap.add_argument("--root", type=Path, default=ROOT, help="the checkout whose clusterdns runs (a peer: main's)")
    args = ap.parse_args()
    runs = []
    for i in range(args.runs):
        r = one_run(args.lines, args.quiet, args.python, args.root, args.stallwatch)
        runs.append(r)
        print(f"run {i + 1}: first answer cluster {r['first'][0]:.2f} s, other block {r['first'][1]:.2f} s, "
              f"hosts {r['hosts_ready']:.2f} s; reload seen after {r['reload_took']:.2f} s", flush=True)
        for label, key in (("quiet ", "quiet"), ("reload", "reload")):
            (cg, cq), (og, oq) = r[key]
            print(f"  {label}: longest gap cluster {cg:.0f} ms (slowest query {cq:.0f} ms), "
                  f"other block {og:.0f} ms ({oq:.0f} ms)", flush=True)
    load = open("/proc/loadavg").read().split()[:3]

    def med(f) -> float:
        return statistics.median(f(r) for r in runs)
    print(f"\n{args.lines} lines, median of {len(runs)} runs (load average {' '.join(load)}):")
    print(f"  start: first cluster answer {med(lambda r: r['first'][0]):.2f} s, other block "
          f"{med(lambda r: r['first'][1]):.2f} s, hosts entries {med(lambda r: r['hosts_ready']):.2f} s")
    for key in ("quiet", "reload"):
        print(f"  {key}: longest gap cluster {med(lambda r: r[key][0][0]):.0f} ms "
              f"(slowest query {med(lambda r: r[key][0][1]):.0f} ms), other block {med(lambda r: r[key][1][0]):.0f} ms "
              f"({med(lambda r: r[key][1][1]):.0f} ms)")


if __name__ == "__main__":
    main()
