"""Sustained endpoint churn through `clusterdns agent`, as a user installs and runs it.

    sudo .venv/bin/python bench/scale/churn.py [--modes nftables,iptables] [--source kube|manifest]
        [--duration 300] [--rate 50] [--qps 2000] [--services 10000] [--endpoints 10]
        [--headless-every 10] [--sample-every 5] [--runs 1] [--venv DIR] [--min-sync-period S]
        [--manifest-period auto|S] [--py-spy BIN] [--keep]

1. `pip install .` of this tree into a fresh venv (or --venv DIR, one bench/scale/envelope.py made).
2. Per mode and run, in a scratch network namespace: clusterdns.synthetic's N Services x E
   ready endpoints (every --headless-every-th headless, the rest ClusterIP; one slice each), served
   by the fake API server (tests/fakeapi.py, the real list/watch protocol) or written to a JSON
   manifest; the venv's `clusterdns agent --apply --proxy-mode MODE` as a whole process, with the
   agent's defaults (--min-sync-period 1 unless given; iptables mode on the nf_tables backend, the
   one a fresh node picks).
3. Cold start: until `svc-1` answers and /ready.
4. For --duration seconds, --rate endpoint changes a second, each in a random Service: with even
   odds a ready endpoint's address replaced by a new one, or an endpoint's ready flag flipped.
   kube: one EndpointSlice update each through the watch (with the last-change-trigger-time the
   controller sets). manifest: the source reads a file only once it has settled (two polls 0.2 s
   apart) and parses all of it, so it cannot see 50 separate writes a second; the changes are made
   at the same rate and the file is rewritten with all changes so far (kubectl-style List, atomic
   rename) each time the agent has loaded the previous write (--manifest-period auto) or every S s.
   A change's clock starts at its API write, or at the rename that publishes it.
5. Meanwhile, in processes of their own:
   - a DNS load of --qps A queries a second over UDP (raw sockets, paced; dnsperf cannot check
     answers), half for Services changed in the last few seconds, half for any; every answer is
     checked against the change log: a headless Service's records must be ready endpoints of the
     version current when the answer came or the one before it, a ClusterIP Service's its
     ClusterIP; NOERROR with records. No answer within 2 s is a lost query.
   - a sampler, for every --sample-every-th change: a headless Service's, the time until its A
     answer is exactly the new ready set (polled every 5 ms); a ClusterIP Service's, the time until
     the kernel holds it, over nfnetlink (no nft/iptables process): nftables, the `hairpin` set's
     `a . a` pair of each endpoint address added (and gone for one removed); iptables, the
     endpoint's KUBE-SEP chain in table nat (polled every 2 ms). A sample overtaken by a later
     change of the same Service is dropped (counted).
6. The agent's CPU (utime+stime from /proc/PID/stat over the churn, and with its reaped children:
   restores, parse workers) / duration; VmRSS at the start and the end of the churn, every 10 s
   between, and VmHWM.

Prints per run, and per mode over runs, p50/p99 of change -> DNS and -> rules, the CPU, RSS
growth, wrong answers and lost queries against the floors (issue 17 item 4), with the load average.
"""
from __future__ import annotations

import argparse
import bisect
import collections
import json
import multiprocessing
import os
import queue as queue_mod
import random
import select
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

from bench.latency.run import percentile  # noqa: E402
from bench.scale.envelope import (  # noqa: E402
    DNS_METRICS,
    DNS_PORT,
    HEALTH,
    PROXY_METRICS,
    Netlink,
    loadavg,
    make_venv,
    scrape,
    setup_namespace,
    status_mb,
)

NEW_BASE = 0x0AF00001     # replacement addresses from 10.240.0.1 (synthetic endpoints end far below)
FLOORS = {"p99_s": 1.0, "cpu_core": 0.3, "rss_growth_mb": 10.0}


# ---------------------------------------------------------------- the cluster

def cluster(args) -> tuple[list[dict], list[dict]]:
    """(manifest items, one row per Service: ns, name, headless, cip, its slice dict in items)."""
    from clusterdns.synthetic import synthetic_records, to_manifest
    items = json.loads(to_manifest(synthetic_records(services=args.services, endpoints=args.endpoints,
                                                     headless_every=args.headless_every)))["items"]
    svcs = {(it["metadata"]["namespace"], it["metadata"]["name"]): it for it in items if it["kind"] == "Service"}
    rows = []
    for it in items:
        if it["kind"] != "EndpointSlice":
            continue
        ns, svc = it["metadata"]["namespace"], it["metadata"]["labels"]["kubernetes.io/service-name"]
        cip = svcs[(ns, svc)]["spec"]["clusterIP"]
        rows.append({"ns": ns, "name": svc, "headless": cip == "None", "cip": cip, "slice": it})
    rows.sort(key=lambda r: int(r["name"].split("-")[1]))
    return items, rows


def ready_set(sl: dict) -> frozenset:
    return frozenset(ep["addresses"][0] for ep in sl["endpoints"] if ep["conditions"].get("ready", True))


def fqdn(row: dict) -> str:
    return f"{row['name']}.{row['ns']}.svc.cluster.local."


def question(name: str) -> bytes:
    """A query's wire form after its 2-byte id: flags RD, one A question."""
    return struct.pack(">HHHHH", 0x0100, 1, 0, 0, 0) + b"".join(
        bytes([len(p)]) + p.encode() for p in name.strip(".").split(".")) + b"\0\0\1\0\1"


def parse_answer(data: bytes, qlen: int) -> tuple[int, int, list[str], bool]:
    """(id, rcode, A addresses, TC) of a reply to a query of `qlen` bytes (the question echoed)."""
    qid, flags, _qd, an = struct.unpack_from(">HHHH", data)
    pos, addrs = qlen, []
    for _ in range(an):
        if pos >= len(data):
            break
        if data[pos] & 0xC0 == 0xC0:
            pos += 2
        else:
            while data[pos]:
                pos += data[pos] + 1
            pos += 1
        rtype, _cls, _ttl, rdlen = struct.unpack_from(">HHIH", data, pos)
        pos += 10
        if rtype == 1 and rdlen == 4:
            addrs.append(socket.inet_ntoa(data[pos:pos + 4]))
        pos += rdlen
    return qid, flags & 15, addrs, bool(flags & 0x0200)


def proc_cpu(pid: int) -> tuple[float, float]:
    """(utime+stime, cutime+cstime) of a process in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / tick, (int(fields[13]) + int(fields[14])) / tick


# ---------------------------------------------------------------- the DNS load (a process of its own)

def dns_load(rows: list[dict], qps: float, changes, results, timeout: float = 2.0) -> None:
    """Paced A queries until ("stop",) comes; every answer checked once the change log is known
    up to the time it came (the driver's heartbeats)."""
    rng = random.Random(7)
    n = len(rows)
    wires = [question(fqdn(r)) for r in rows]
    headless = [r["headless"] for r in rows]
    cips = [r["cip"] for r in rows]
    times: list[list[float]] = [[-1e18] for _ in rows]
    versions: list[list[frozenset]] = [[frozenset(r["ready"])] for r in rows]
    recent: collections.deque = collections.deque(maxlen=250)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    sock.connect(("127.0.0.1", DNS_PORT))
    sock.setblocking(False)
    outstanding: dict[int, tuple[float, int]] = {}
    pending: collections.deque = collections.deque()    # (t_recv, idx, rcode, addrs, tc)
    known_until = -1e18
    counts = collections.Counter()
    examples: list = []
    qid = 0
    sent = 0
    stopping_at = None
    results.put(("up",))
    t0 = time.monotonic()
    cpu0 = sum(os.times()[:2])

    def check(t_recv: float, idx: int, rcode: int, addrs: list[str], tc: bool) -> None:
        counts["answers"] += 1
        if tc:
            counts["tc"] += 1
        if not headless[idx]:
            ok = rcode == 0 and addrs == [cips[idx]]
            counts["clusterip"] += 1
            if not ok:
                counts["wrong"] += 1
                counts["wrong_clusterip"] += 1
                if len(examples) < 10:
                    examples.append([rows[idx]["name"], rcode, addrs, cips[idx]])
            return
        counts["headless"] += 1
        k = bisect.bisect_right(times[idx], t_recv) - 1
        cur = versions[idx][k]
        prev = versions[idx][k - 1] if k > 0 else cur
        if rcode != 0 or (not addrs and (cur or prev)):
            counts["wrong"] += 1
            counts["wrong_rcode_or_empty"] += 1
            if len(examples) < 10:
                examples.append([rows[idx]["name"], rcode, addrs, sorted(cur)])
            return
        if not set(addrs) <= (cur | prev):
            counts["wrong"] += 1
            counts["wrong_address"] += 1
            if len(examples) < 10:
                examples.append([rows[idx]["name"], rcode, sorted(addrs), sorted(cur), sorted(prev)])
            return
        if len(addrs) != len(set(addrs)):
            counts["duplicate_records"] += 1
        if frozenset(addrs) not in (cur, prev):
            counts["inexact"] += 1   # every record valid, but the set is neither version's

    while True:
        now = time.monotonic()
        while True:
            try:
                msg = changes.get_nowait()
            except queue_mod.Empty:
                break
            if msg[0] == "chg":
                _, t, idx, ready = msg[:4]
                if times[idx][-1] == t:    # changes published together (one manifest write): one version
                    versions[idx][-1] = frozenset(ready)
                else:
                    times[idx].append(t)
                    versions[idx].append(frozenset(ready))
                recent.append(idx)
            elif msg[0] == "hb":
                known_until = max(known_until, msg[1])
            elif msg[0] == "stop":
                stopping_at = now
        if stopping_at is None:
            due = int((now - t0) * qps) - sent
            for _ in range(min(due, 200)):
                idx = rng.choice(recent) if recent and rng.random() < 0.5 else rng.randrange(n)
                qid = (qid + 1) & 0xFFFF
                if qid in outstanding:
                    counts["lost"] += 1
                    del outstanding[qid]
                try:
                    sock.send(struct.pack(">H", qid) + wires[idx])
                except OSError:
                    counts["send_errors"] += 1
                outstanding[qid] = (time.monotonic(), idx)
                sent += 1
        ready_socks = select.select([sock], [], [], 0.002)[0]
        if ready_socks:
            while True:
                try:
                    data = sock.recv(65535)
                except (BlockingIOError, InterruptedError):
                    break
                except ConnectionRefusedError:
                    counts["refused"] += 1
                    break
                t_recv = time.monotonic()
                got = outstanding.pop(struct.unpack_from(">H", data)[0], None)
                if got is None:
                    counts["late_or_stray"] += 1
                    continue
                _, rcode, addrs, tc = parse_answer(data, len(wires[got[1]]) + 2)
                pending.append((t_recv, got[1], rcode, addrs, tc))
        now = time.monotonic()
        while outstanding:
            first = next(iter(outstanding))
            if outstanding[first][0] > now - timeout:
                break
            del outstanding[first]
            counts["lost"] += 1
        while pending and pending[0][0] <= known_until:
            check(*pending.popleft())
        if stopping_at is not None and (not outstanding or now - stopping_at > timeout + 0.5):
            break
    counts["lost"] += len(outstanding)
    while pending:
        check(*pending.popleft())
    cpu = sum(os.times()[:2]) - cpu0
    elapsed = (stopping_at or time.monotonic()) - t0
    results.put(("load", {"sent": sent, "qps": sent / elapsed, "cpu_core": cpu / elapsed,
                          **counts, "examples": examples}))


# ---------------------------------------------------------------- the sampler (a process of its own)

def sampler(rows: list[dict], mode: str, changes, results, limit: float = 30.0) -> None:
    """Times sampled changes: headless ones until DNS answers the new ready set, ClusterIP ones
    until the kernel holds them (nfnetlink GETs)."""
    from clusterdns.proxy import names
    nl = Netlink()
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.connect(("127.0.0.1", DNS_PORT))
    sock.setblocking(False)
    wires = {}
    active: dict[int, dict] = {}     # Service index -> its sampled change being timed
    out = {"dns_s": [], "rules_s": [], "superseded": 0, "unseen": 0, "unseen_examples": []}
    qid = 0
    stop = False
    results.put(("up",))

    def in_kernel(row: dict, addr: str) -> bool:
        if mode == "nftables":
            return nl.element("kube-proxy", "hairpin", socket.inet_aton(addr) * 2)
        return nl.chain("nat", names.sep_chain(f"{row['ns']}/{row['name']}:http", "tcp", f"{addr}:8080"))

    while not stop or active:
        while True:
            try:
                msg = changes.get_nowait()
            except queue_mod.Empty:
                break
            if msg[0] == "stop":
                stop = True
                stop_at = time.monotonic()
            elif msg[0] == "chg":
                _, t, idx, ready, kernel, sampled = msg
                if idx in active:
                    del active[idx]
                    out["superseded"] += 1
                if sampled:
                    active[idx] = {"t": t, "ready": frozenset(ready), "kernel": kernel, "next_dns": 0.0}
        now = time.monotonic()
        for idx, s in list(active.items()):
            row = rows[idx]
            if now - s["t"] > limit or (stop and now - stop_at > limit):
                del active[idx]
                out["unseen"] += 1
                if len(out["unseen_examples"]) < 5:
                    out["unseen_examples"].append([row["name"], s["kernel"], sorted(s["ready"])])
                continue
            if row["headless"]:
                if now >= s["next_dns"]:
                    qid = (qid + 1) & 0xFFFF
                    w = wires.get(idx) or wires.setdefault(idx, question(fqdn(row)))
                    s["qid"] = qid
                    try:
                        sock.send(struct.pack(">H", qid) + w)
                    except OSError:
                        pass
                    s["next_dns"] = now + 0.005
            elif all(in_kernel(row, a) == present for a, present in s["kernel"]):
                out["rules_s"].append(time.monotonic() - s["t"])
                del active[idx]
        if select.select([sock], [], [], 0.002)[0]:
            while True:
                try:
                    data = sock.recv(65535)
                except (BlockingIOError, InterruptedError, ConnectionRefusedError):
                    break
                t_recv = time.monotonic()
                got_id = struct.unpack_from(">H", data)[0]
                for idx, s in list(active.items()):
                    if s.get("qid") == got_id and rows[idx]["headless"]:
                        _, rcode, addrs, _ = parse_answer(data, len(wires[idx]) + 2)
                        if rcode == 0 and frozenset(addrs) == s["ready"]:
                            out["dns_s"].append(t_recv - s["t"])
                            del active[idx]
                        break
    results.put(("sampler", out))


# ---------------------------------------------------------------- inside the namespace

def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


def _ready(port: int) -> bool:
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2).status == 200
    except OSError:
        return False


def _dns_ok(name: str, want: str) -> bool:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(0.3)
    wire = question(name)
    try:
        s.sendto(b"\0\1" + wire, ("127.0.0.1", DNS_PORT))
        _, rcode, addrs, _ = parse_answer(s.recv(4096), len(wire) + 2)
        return rcode == 0 and addrs == [want]
    except OSError:
        return False
    finally:
        s.close()


class Churn:
    """The change stream: a random Service each time, an address replaced or a ready flag flipped."""

    def __init__(self, rows: list[dict], seed: int, sample_every: int) -> None:
        self.rows = rows
        self.rng = random.Random(seed)
        self.sample_every = sample_every
        self.next_ip = NEW_BASE
        self.made = 0
        self.kinds = collections.Counter()

    def make(self) -> tuple[int, dict, tuple]:
        """Change one slice in place; (Service index, the slice, the message without its time)."""
        idx = self.rng.randrange(len(self.rows))
        row = self.rows[idx]
        sl = row["slice"]
        eps = sl["endpoints"]
        ready = [j for j, ep in enumerate(eps) if ep["conditions"].get("ready", True)]
        kernel: list[tuple[str, bool]]
        if ready and self.rng.random() < 0.5:
            j = self.rng.choice(ready)
            old = eps[j]["addresses"][0]
            new = socket.inet_ntoa(struct.pack(">I", self.next_ip))
            self.next_ip += 1
            eps[j] = dict(eps[j], addresses=[new], targetRef=dict(eps[j]["targetRef"], name=f"churn-{self.made}"))
            kernel = [(new, True), (old, False)]
            self.kinds["replaced"] += 1
        else:
            j = self.rng.randrange(len(eps))
            flag = not eps[j]["conditions"].get("ready", True)
            eps[j] = dict(eps[j], conditions={"ready": flag})
            kernel = [(eps[j]["addresses"][0], flag)]
            self.kinds["ready" if flag else "not ready"] += 1
        sl["metadata"].setdefault("annotations", {})["endpoints.kubernetes.io/last-change-trigger-time"] = _now()
        sampled = self.made % self.sample_every == 0
        self.made += 1
        return idx, sl, (idx, tuple(ready_set(sl)), None if row["headless"] else kernel, sampled)


def inner(args) -> dict:
    from tests.fakeapi import FakeAPIServer
    setup_namespace()
    items, rows = cluster(args)
    tmp = tempfile.mkdtemp(prefix="cdns-churn-")
    api = None
    manifest = os.path.join(tmp, "cluster.json")

    def write_manifest() -> None:
        with open(manifest + ".tmp", "w") as f:
            json.dump({"apiVersion": "v1", "kind": "List", "items": items}, f, separators=(",", ":"))
        os.replace(manifest + ".tmp", manifest)

    if args.source == "kube":
        api = FakeAPIServer(history=200000).start()
        api.add_all(items)
        src = ["--kubeconfig", api.write_kubeconfig(os.path.join(tmp, "kubeconfig"))]
    else:
        write_manifest()
        src = ["--manifest", manifest]
    log_path = os.path.join(tmp, "agent.log")
    log = open(log_path, "w")
    argv = [args.clusterdns, "agent", *src, "--listen", f"127.0.0.1:{DNS_PORT}",
            "--proxy-mode", args.mode, "--apply", "--no-upstream", "--lameduck", "0",
            "--cluster-cidr", "10.0.0.0/8", "--health-listen", f"127.0.0.1:{HEALTH}",
            "--metrics-listen", f"127.0.0.1:{DNS_METRICS}", "--proxy-metrics-listen", f"127.0.0.1:{PROXY_METRICS}",
            "--log-level", "info"]
    if args.min_sync_period is not None:
        argv += ["--min-sync-period", str(args.min_sync_period)]
    out: dict = {"mode": args.mode, "source": args.source, "load_start": loadavg()}
    t0 = time.monotonic()
    agent = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    ctx = multiprocessing.get_context("spawn")
    helpers = []
    try:
        probe = rows[1] if not rows[1]["headless"] else next(r for r in rows if not r["headless"])
        while not _dns_ok(fqdn(probe), probe["cip"]):
            if agent.poll() is not None or time.monotonic() - t0 > args.timeout:
                raise RuntimeError(f"no right answer within {args.timeout} s; see {log_path}")
            time.sleep(0.05)
        out["cold_answer_s"] = time.monotonic() - t0
        while not _ready(HEALTH):
            if agent.poll() is not None or time.monotonic() - t0 > args.timeout:
                raise RuntimeError(f"not ready within {args.timeout} s; see {log_path}")
            time.sleep(0.1)
        out["cold_ready_s"] = time.monotonic() - t0
        time.sleep(args.settle)   # past the first syncs' aftermath (collections, the first partial sync)

        light = [{"ns": r["ns"], "name": r["name"], "headless": r["headless"], "cip": r["cip"],
                  "ready": sorted(ready_set(r["slice"]))} for r in rows]
        results = ctx.Queue()
        load_q, sample_q = ctx.Queue(), ctx.Queue()
        helpers = [ctx.Process(target=dns_load, args=(light, args.qps, load_q, results), daemon=True),
                   ctx.Process(target=sampler, args=(light, args.mode, sample_q, results), daemon=True)]
        for h in helpers:
            h.start()
        for _ in helpers:
            results.get(timeout=120)
        time.sleep(1.0)

        churn = Churn(rows, args.seed, args.sample_every)
        spy = None
        if args.py_spy:
            spy = subprocess.Popen([args.py_spy, "record", "-p", str(agent.pid), "-r", "100", "--format", "raw",
                                    "-d", str(int(args.duration)), "-o", os.path.join(tmp, "churn.spy"),
                                    "--nonblocking"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        rss = [(0.0, status_mb(agent.pid, "VmRSS"))]
        out["rss_start_mb"] = rss[0][1]
        out["hwm_start_mb"] = status_mb(agent.pid, "VmHWM")
        cpu0 = proc_cpu(agent.pid)
        start = time.monotonic()
        next_rss = start + 10
        writes, write_s = 0, []
        pending: list[tuple] = []
        loads_before = _count_loaded(log_path)   # the first load; each write makes one more
        last_write = start

        def send(msg: tuple) -> None:
            load_q.put(msg[:4])
            sample_q.put(msg)

        def heartbeat() -> None:
            t = time.monotonic()
            load_q.put(("hb", t))

        while True:
            now = time.monotonic()
            if now - start >= args.duration:
                break
            if now >= next_rss:
                rss.append((now - start, status_mb(agent.pid, "VmRSS")))
                next_rss += 10
            due = start + churn.made / args.rate if args.rate > 0 else float("inf")   # 0: the DNS load alone
            if due > now:
                heartbeat()
                time.sleep(min(due - now, 0.02))
                continue
            idx, sl, msg = churn.make()
            if api is not None:
                t = time.monotonic()
                send(("chg", t) + msg)
                api.update(sl)
                writes += 1
                heartbeat()
                continue
            pending.append(msg)
            if args.manifest_period == "auto":
                publish = _count_loaded(log_path) >= loads_before + writes or now - last_write > 30
            else:
                publish = now - last_write >= float(args.manifest_period)
            if publish:
                w0 = time.monotonic()
                with open(manifest + ".tmp", "w") as f:
                    json.dump({"apiVersion": "v1", "kind": "List", "items": items}, f, separators=(",", ":"))
                t = time.monotonic()
                for m in pending:
                    send(("chg", t) + m)
                os.replace(manifest + ".tmp", manifest)
                write_s.append(time.monotonic() - w0)
                last_write = t
                writes += 1
                pending = []
                heartbeat()
        end = time.monotonic()
        cpu1 = proc_cpu(agent.pid)
        out["rss_end_mb"] = status_mb(agent.pid, "VmRSS")
        rss.append((end - start, out["rss_end_mb"]))
        out["hwm_end_mb"] = status_mb(agent.pid, "VmHWM")
        elapsed = end - start
        out["churn_s"] = elapsed
        out["changes"] = churn.made - len(pending)
        out["change_rate"] = out["changes"] / elapsed
        out["kinds"] = dict(churn.kinds)
        out["writes"] = writes
        if write_s:
            out["write_s_median"] = statistics.median(write_s)
            out["write_interval_s"] = elapsed / max(1, writes)
        out["cpu_core"] = (cpu1[0] - cpu0[0]) / elapsed
        out["cpu_core_with_children"] = (cpu1[0] + cpu1[1] - cpu0[0] - cpu0[1]) / elapsed
        out["rss_series"] = rss
        heartbeat()
        for q in (load_q, sample_q):
            q.put(("stop",))
        got = {}
        for _ in helpers:
            kind, body = results.get(timeout=120)
            got[kind] = body
        heartbeat()
        out["load"] = got["load"]
        out["sampler"] = got["sampler"]
        if spy is not None:
            spy.wait(60)
            out["spy"] = os.path.join(tmp, "churn.spy")
        out["metrics"] = scrape(PROXY_METRICS, "kubeproxy_sync_proxy_rules_duration_seconds")
        out["metrics"].update(scrape(PROXY_METRICS, "kubeproxy_network_programming_duration_seconds"))
        out["metrics"].update(scrape(DNS_METRICS, "coredns_kubernetes_dns_programming_duration_seconds"))
        out["load_end"] = loadavg()
        backend = [ln.strip() for ln in open(log_path, errors="replace") if "iptables backend:" in ln]
        out["backend"] = backend[0].split("iptables backend:", 1)[1].strip() if backend else ""
        out["agent_alive"] = agent.poll() is None
    finally:
        for h in helpers:
            if h.is_alive():
                h.terminate()
        if agent.poll() is None:
            os.killpg(agent.pid, 15)
            try:
                agent.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(agent.pid, 9)
        if api is not None:
            api.close()
    if args.keep or args.py_spy:
        out["dir"] = tmp
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _count_loaded(path: str) -> int:
    """How many times the agent's log says it loaded the manifest."""
    with open(path, errors="replace") as f:
        return sum(1 for ln in f if "clusterdns.sources.manifest" in ln and " loaded " in ln)


# ---------------------------------------------------------------- outside

def _ms(values: list[float], q: float) -> str:
    return f"{percentile(values, q) * 1000:.0f}" if values else "-"


def _verdict(ok: bool) -> str:
    return "ok" if ok else "MISSED"


def report_run(label: str, r: dict) -> None:
    s, ld = r["sampler"], r["load"]
    print(f"{label}{' (' + r['backend'] + ')' if r['backend'] else ''}: cold answer {r['cold_answer_s']:.1f} s, "
          f"ready {r['cold_ready_s']:.1f} s; {r['changes']} changes in {r['churn_s']:.0f} s "
          f"({r['change_rate']:.1f}/s, {r['writes']} writes{', median write ' + format(r['write_s_median'], '.2f') + ' s every ' + format(r['write_interval_s'], '.2f') + ' s' if 'write_s_median' in r else ''}); "
          f"change -> DNS p50/p99 {_ms(s['dns_s'], 0.5)}/{_ms(s['dns_s'], 0.99)} ms (n={len(s['dns_s'])}), "
          f"-> rules {_ms(s['rules_s'], 0.5)}/{_ms(s['rules_s'], 0.99)} ms (n={len(s['rules_s'])}); "
          f"superseded {s['superseded']}, unseen {s['unseen']}; "
          f"agent CPU {r['cpu_core']:.3f} core ({r['cpu_core_with_children']:.3f} with children); "
          f"VmRSS {r['rss_start_mb']:.1f} -> {r['rss_end_mb']:.1f} MB (max {max(v for _, v in r['rss_series']):.1f}), "
          f"VmHWM {r['hwm_end_mb']:.1f} MB; DNS {ld['sent']} queries ({ld['qps']:.0f}/s, loader {ld['cpu_core']:.2f} core), "
          f"{ld.get('wrong', 0)} wrong, {ld.get('inexact', 0)} inexact, {ld.get('lost', 0)} lost; "
          f"load {r['load_start']} -> {r['load_end']}" + (f"; dir {r['dir']}" if "dir" in r else ""), flush=True)
    print("  VmRSS every 10 s (MB): " + " ".join(f"{v:.0f}" for _, v in r["rss_series"]))
    if ld.get("examples"):
        print(f"  wrong answers, e.g. {ld['examples'][:5]}")
    if s["unseen_examples"]:
        print(f"  unseen samples, e.g. {s['unseen_examples']}")


def summary(mode: str, rs: list[dict]) -> None:
    dns = [v for r in rs for v in r["sampler"]["dns_s"]]
    rules = [v for r in rs for v in r["sampler"]["rules_s"]]
    cpu = statistics.median(r["cpu_core"] for r in rs)
    cpu_c = statistics.median(r["cpu_core_with_children"] for r in rs)
    growth = statistics.median(r["rss_end_mb"] - r["rss_start_mb"] for r in rs)
    wrong = sum(r["load"].get("wrong", 0) for r in rs)
    lost = sum(r["load"].get("lost", 0) for r in rs)
    answers = sum(r["load"].get("answers", 0) for r in rs)
    p99 = max(percentile(dns, 0.99) if dns else 0.0, percentile(rules, 0.99) if rules else 0.0)
    print(f"{mode}, {len(rs)} run(s):")
    print(f"  change -> DNS    p50 {_ms(dns, 0.5)} ms, p99 {_ms(dns, 0.99)} ms, max {_ms(dns, 1.0)} ms (n={len(dns)})")
    print(f"  change -> rules  p50 {_ms(rules, 0.5)} ms, p99 {_ms(rules, 0.99)} ms, max {_ms(rules, 1.0)} ms "
          f"(n={len(rules)})   p99 <= 1 s: {_verdict(p99 <= FLOORS['p99_s'])}")
    print(f"  agent CPU        {cpu:.3f} core ({cpu_c:.3f} with its children) (median of runs)   "
          f"<= 0.3: {_verdict(cpu_c <= FLOORS['cpu_core'])}")
    print(f"  VmRSS growth     {growth:+.1f} MB (median; start {statistics.median(r['rss_start_mb'] for r in rs):.1f}, "
          f"end {statistics.median(r['rss_end_mb'] for r in rs):.1f}, VmHWM {statistics.median(r['hwm_end_mb'] for r in rs):.1f})"
          f"   <= 10 MB: {_verdict(growth <= FLOORS['rss_growth_mb'])}")
    print(f"  DNS answers      {answers} checked, {wrong} wrong, {lost} lost   0 wrong: {_verdict(wrong == 0)}")
    m = rs[-1]["metrics"]
    for key in sorted(k for k in m if "_count" in k):
        if m[key]:
            total = m.get(key.replace("_count", "_sum"), 0.0)
            print(f"  {key.replace('_count', '')}: {int(m[key])} observations, mean {total / m[key] * 1000:.1f} ms")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="nftables,iptables")
    p.add_argument("--source", choices=("kube", "manifest"), default="kube")
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--duration", type=float, default=300)
    p.add_argument("--rate", type=float, default=50, help="endpoint changes a second")
    p.add_argument("--qps", type=float, default=2000, help="DNS queries a second")
    p.add_argument("--services", type=int, default=10000)
    p.add_argument("--endpoints", type=int, default=10)
    p.add_argument("--headless-every", type=int, default=10, help="every N-th Service is headless")
    p.add_argument("--sample-every", type=int, default=5, help="time every N-th change")
    p.add_argument("--min-sync-period", type=float, help="the agent's --min-sync-period (default: its own, 1 s)")
    p.add_argument("--manifest-period", default="auto",
                   help="(manifest) rewrite the file every S s, or 'auto': once the agent loaded the last write")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--settle", type=float, default=5.0, help="seconds between /ready and the churn")
    p.add_argument("--venv", help="a venv made by an earlier run (its bin/clusterdns is used)")
    p.add_argument("--timeout", type=float, default=900, help="seconds for the cold start")
    p.add_argument("--py-spy", help="a py-spy binary: record the agent during the churn (raw stacks, kept)")
    p.add_argument("--keep", action="store_true", help="keep the agent's log (its directory is printed)")
    p.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    p.add_argument("--clusterdns", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.inner:
        print(json.dumps(inner(args)))
        return 0
    if os.geteuid() != 0:
        print("needs root (a scratch network namespace)", file=sys.stderr)
        return 2
    print("command: " + " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]), flush=True)
    passthrough = ["--source", args.source, "--duration", str(args.duration), "--rate", str(args.rate),
                   "--qps", str(args.qps), "--services", str(args.services), "--endpoints", str(args.endpoints),
                   "--headless-every", str(args.headless_every), "--sample-every", str(args.sample_every),
                   "--manifest-period", args.manifest_period, "--seed", str(args.seed), "--settle", str(args.settle),
                   "--timeout", str(args.timeout)]
    passthrough += ["--min-sync-period", str(args.min_sync_period)] if args.min_sync_period is not None else []
    passthrough += ["--py-spy", args.py_spy] if args.py_spy else []
    passthrough += ["--keep"] if args.keep else []
    with tempfile.TemporaryDirectory(prefix="cdns-churn-venv-") as tmp:
        clusterdns = str(Path(args.venv) / "bin" / "clusterdns") if args.venv else str(make_venv(Path(tmp) / "venv"))
        rows: dict[str, list[dict]] = {m: [] for m in args.modes.split(",")}
        for run in range(args.runs):
            for mode in rows:
                ns = f"cdns-churn-{os.getpid()}-{run}-{mode}"
                subprocess.run(["ip", "netns", "add", ns], check=True)
                try:
                    cmd = ["ip", "netns", "exec", ns, sys.executable, os.path.abspath(__file__), "--inner",
                           "--mode", mode, "--clusterdns", clusterdns, *passthrough]
                    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
                    if r.returncode:
                        print(r.stdout[-2000:], r.stderr[-4000:], file=sys.stderr)
                        return 1
                    row = json.loads(r.stdout.strip().splitlines()[-1])
                finally:
                    subprocess.run(["ip", "netns", "del", ns], capture_output=True)
                rows[mode].append(row)
                report_run(f"run {run + 1} {mode}/{args.source}", row)
    print(f"\n{args.services} Services x {args.endpoints} endpoints (every {args.headless_every}th headless), "
          f"source {args.source}, {args.rate:g} changes/s for {args.duration:g} s, {args.qps:g} DNS queries/s; "
          f"floors: p99 <= 1 s, CPU <= 0.3 core, RSS growth <= 10 MB, 0 wrong answers")
    for mode, rs in rows.items():
        summary(mode, rs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
