"""Change-to-effect latency of `clusterdns agent`: from an object change at the source
to DNS answering for it and to its rules working in the kernel.

    sudo python3 bench/latency/run.py                       # 1,000 and 10,000 services, iptables
    sudo python3 bench/latency/run.py --services 1000 --changes 20 --mode nftables

Everything runs in a scratch network namespace created for the run and deleted
after it: the fake API server (tests/fakeapi.py, the real list/watch protocol),
the agent applying real rules (--min-sync-period 1), and the probes.

Each change creates a new Service (ClusterIP in 10.200.0.0/16, port 80) whose
EndpointSlice (one endpoint, 10.255.0.1:8080, a listener on the namespace's lo)
was created a sync period before; at the Service's creation the slice is
touched with a new last-change-trigger-time, as the EndpointSlice controller
does. The clock starts at the Service's creation. Then, concurrently:
- DNS: `<svc>.<ns>.svc.cluster.local A` over UDP every 5 ms until it answers;
- rules: a TCP connect to ClusterIP:80 (60 ms timeout) until it reaches the
  listener, which only the proxier's DNAT can make happen (10.200.0.0/16 is
  routed into a portless bridge, so without rules the SYN goes nowhere).
Changes are spaced by more than the minimum sync period, so each measures the
floor latency, not the rate limiter. When DNS answers, the probe is checked at
once: an address served before its rules work is counted as an ordering violation.

The machine is shared and small: figures are noisy; compare runs made together.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from datetime import datetime, timezone

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

BACKEND = "10.255.0.1"
HEALTH = "127.0.0.1:18095"
PROXY_METRICS = "127.0.0.1:18096"   # kubeproxy_* are served on --proxy-metrics-listen
DNS_METRICS = "127.0.0.1:18097"     # coredns_* on --metrics-listen
DNS_PORT = 5399


def sh(*argv: str, check: bool = True) -> str:
    res = subprocess.run(argv, capture_output=True, text=True)
    if check and res.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {res.stderr.strip()}")
    return res.stdout


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, int(round(q * (len(ordered) - 1)))))
    return ordered[k]


# ---------------------------------------------------------------- inside the namespace

def setup_namespace() -> None:
    sh("ip", "link", "set", "lo", "up")
    sh("ip", "addr", "add", f"{BACKEND}/32", "dev", "lo")
    sh("ip", "link", "add", "void0", "type", "bridge")
    sh("ip", "link", "set", "void0", "up")
    sh("ip", "addr", "add", "192.168.77.2/24", "dev", "void0")
    sh("ip", "route", "add", "10.200.0.0/16", "dev", "void0")
    sh("ip", "route", "add", "10.96.0.0/12", "dev", "void0")


def listener() -> None:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((BACKEND, 8080))
    s.listen(512)

    def serve() -> None:
        while True:
            c, _ = s.accept()
            c.close()
    threading.Thread(target=serve, daemon=True).start()


def base_objects(services: int) -> list[dict]:
    from clusterdns.synthetic import synthetic_records, to_manifest
    return json.loads(to_manifest(synthetic_records(services=services, endpoints=3)))["items"]


def new_objects(i: int) -> tuple[list[dict], str, str]:
    from tests.fakeapi import endpoint_slice, service
    ns, name = "bench", f"new-{i}"
    ip = f"10.200.{i // 250}.{i % 250 + 1}"
    svc = service(ns, name, ip, ports=(("http", 80, "TCP"),))
    svc["spec"]["ports"][0]["targetPort"] = 8080
    sl = endpoint_slice(ns, name, [BACKEND], port=8080)
    return [svc, sl], f"{name}.{ns}.svc.cluster.local.", ip


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


async def dns_answers(name: str) -> bool:
    import dns.asyncquery
    import dns.message
    q = dns.message.make_query(name, "A")
    try:
        r = await dns.asyncquery.udp(q, "127.0.0.1", port=DNS_PORT, timeout=0.5)
    except Exception:
        return False
    return bool(r.answer)


async def rules_work(ip: str, timeout: float = 0.06) -> bool:
    try:
        _, w = await asyncio.wait_for(asyncio.open_connection(ip, 80), timeout)
    except (OSError, asyncio.TimeoutError):
        return False
    w.close()
    return True


async def measure_one(api, i: int, gap: float, rules: bool = True) -> dict:
    (svc, sl), name, ip = new_objects(i)
    # The EndpointSlice first (untimed), then the timed change: creating the Service.
    # Created together, a sync may catch the Service before its slice and rightly
    # program a REJECT; the figure would then measure the rate limiter's wait.
    api.add(sl)
    await asyncio.sleep(gap)
    sl = dict(sl, metadata=dict(sl["metadata"], annotations={
        "endpoints.kubernetes.io/last-change-trigger-time": _now()}))
    t0 = time.monotonic()
    api.add(svc)
    api.update(sl)   # as the EndpointSlice controller does once the Service exists
    out: dict = {}

    async def poll_dns():
        while not await dns_answers(name):
            await asyncio.sleep(0.005)
        out["dns"] = time.monotonic() - t0
        # A generous timeout: on a busy machine a working DNAT may take a while to answer,
        # while a missing rule never does.
        out["rules_at_dns"] = await rules_work(ip, 1.0)

    async def poll_rules():
        while not await rules_work(ip):
            await asyncio.sleep(0.005)
        out["rules"] = time.monotonic() - t0

    polls = [poll_dns()] + ([poll_rules()] if rules else [])
    await asyncio.wait_for(asyncio.gather(*polls), 30)
    if not rules:   # --mode none: DNS follows the source alone
        out["rules"], out["rules_at_dns"] = out["dns"], True
    return out


def scrape(names: tuple[str, ...]) -> dict[str, str]:
    text = "".join(urllib.request.urlopen(f"http://{at}/metrics", timeout=5).read().decode()
                   for at in (PROXY_METRICS, DNS_METRICS))
    return {line.split(" ")[0]: line.split(" ")[1] for line in text.splitlines()
            if line.startswith(names) and ("_sum" in line or "_count" in line)}


def inner(args) -> dict:
    from tests.fakeapi import FakeAPIServer, namespace
    setup_namespace()
    listener()
    api = FakeAPIServer(history=100000).start()
    tmp = f"/tmp/cdbench-{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    api.add_all(base_objects(args.services) + [namespace("bench")])
    kubeconfig = api.write_kubeconfig(os.path.join(tmp, "kubeconfig"))
    log = open(os.path.join(tmp, "agent.log"), "w")
    agent = subprocess.Popen(
        [sys.executable, "-m", "clusterdns", "agent", "--kubeconfig", kubeconfig,
         "--listen", f"127.0.0.1:{DNS_PORT}", "--proxy-mode", args.mode, "--apply",
         "--min-sync-period", "1", "--sync-period", "60", "--no-upstream", "--lameduck", "0",
         "--cluster-cidr", "10.0.0.0/8", "--health-listen", HEALTH, "--metrics-listen", DNS_METRICS,
         "--proxy-metrics-listen", PROXY_METRICS,
         "--log-level", "warning"], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        t_start = time.monotonic()
        while True:
            try:
                if urllib.request.urlopen(f"http://{HEALTH}/ready", timeout=2).status == 200:
                    break
            except OSError:
                pass
            if agent.poll() is not None or time.monotonic() - t_start > 300:
                raise RuntimeError("agent did not become ready; see " + log.name)
            time.sleep(0.1)
        ready_after = time.monotonic() - t_start
        time.sleep(args.gap)
        results = []
        for i in range(args.changes):
            results.append(asyncio.run(measure_one(api, i, args.gap, args.mode != "none")))
            time.sleep(args.gap)
        metrics = scrape(("kubeproxy_network_programming_duration_seconds",
                          "coredns_kubernetes_dns_programming_duration_seconds",
                          "kubeproxy_sync_proxy_rules_duration_seconds"))
    finally:
        agent.terminate()
        agent.wait(20)
        api.close()
    dns = [r["dns"] for r in results]
    rules = [r["rules"] for r in results]
    both = [max(r["dns"], r["rules"]) for r in results]
    return {"services": args.services, "mode": args.mode, "changes": len(results),
            "ready_after_s": round(ready_after, 2),
            "dns_median": statistics.median(dns), "dns_p99": percentile(dns, 0.99),
            "rules_median": statistics.median(rules), "rules_p99": percentile(rules, 0.99),
            "both_median": statistics.median(both), "both_p99": percentile(both, 0.99),
            "ordering_violations": sum(1 for r in results if not r["rules_at_dns"]),
            "metrics": metrics}


# ---------------------------------------------------------------- restart (--restart)

def _agent_argv(kubeconfig: str, mode: str, lameduck: float, ports: tuple[int, int, int],
                watch: bool = False, handover: float = 20.0) -> list[str]:
    health, dns_metrics, proxy_metrics = ports
    run = ([os.path.join(os.path.dirname(os.path.abspath(__file__)), "stallwatch.py")] if watch
           else ["-m", "clusterdns"])
    return [sys.executable, *run, "agent", "--kubeconfig", kubeconfig,
            "--listen", f"127.0.0.1:{DNS_PORT}", "--proxy-mode", mode, "--apply",
            "--min-sync-period", "1", "--sync-period", "60", "--no-upstream", "--lameduck", str(lameduck),
            "--lameduck-handover", str(handover), "--cluster-cidr", "10.0.0.0/8", "--health-listen", f"127.0.0.1:{health}",
            "--metrics-listen", f"127.0.0.1:{dns_metrics}", "--proxy-metrics-listen", f"127.0.0.1:{proxy_metrics}",
            "--log-level", "info"]


def _hwm_mb(pid: int) -> float | None:
    """A process's peak RSS (VmHWM) in MB, or None once it is gone."""
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


def _ready(port: int) -> bool:
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2).status == 200
    except OSError:
        return False


def _probe(name: str, want: str, timeout: float = 0.2) -> str:
    """'ok', or what went wrong: 'timeout', 'refused', the rcode, 'wrong'."""
    import dns.exception
    import dns.message
    import dns.query
    import dns.rcode
    q = dns.message.make_query(name, "A")
    try:
        r = dns.query.udp(q, "127.0.0.1", port=DNS_PORT, timeout=timeout)
    except dns.exception.Timeout:
        return "timeout"
    except OSError:
        return "refused"
    if r.rcode() != dns.rcode.NOERROR:
        return dns.rcode.to_text(r.rcode())
    got = [rd.to_text() for rrset in r.answer for rd in rrset]
    return "ok" if got == [want] else "wrong"


def _prober(name: str, want: str, stop, queue) -> None:
    """A probe every 20 ms (200 ms timeout) until `stop`; (monotonic time, outcome) pairs to `queue`."""
    results = []
    nxt = time.monotonic()
    while not stop.is_set():
        results.append((time.monotonic(), _probe(name, want)))
        nxt += 0.02
        time.sleep(max(0.0, nxt - time.monotonic()))
    queue.put(results)


def inner_restart(args) -> dict:
    """Cold start to the first right answer, then SIGTERM + an immediate second agent
    with a DNS probe every 20 ms (200 ms timeout) throughout."""
    import ipaddress

    from clusterdns.synthetic import SERVICE_BASE
    from tests.fakeapi import FakeAPIServer
    setup_namespace()
    if args.mode == "iptables" and args.iptables_backend == "legacy":
        # The backend holding more rules wins (as iptables-wrappers): make it legacy.
        sh("iptables-legacy", "-t", "filter", "-N", "BENCH-LEGACY")
        sh("iptables-legacy", "-t", "filter", "-A", "BENCH-LEGACY", "-j", "RETURN")
    api = FakeAPIServer(history=100000).start()
    tmp = f"/tmp/cdbench-{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    from clusterdns.synthetic import synthetic_records, to_manifest
    api.add_all(json.loads(to_manifest(synthetic_records(services=args.services,
                                                         endpoints=args.endpoints)))["items"])
    kubeconfig = api.write_kubeconfig(os.path.join(tmp, "kubeconfig"))
    # svc-1 in ns-1 (synthetic: ClusterIPs from 10.96.0.1 in order)
    name, want = "svc-1.ns-1.svc.cluster.local.", str(ipaddress.ip_address(SERVICE_BASE + 2))
    logs = [open(os.path.join(tmp, f"agent{i}.log"), "w") for i in (1, 2)]
    ports1, ports2 = (18095, 18096, 18097), (18195, 18196, 18197)
    if args.watch:
        os.environ["STALL_DNS"] = f"127.0.0.1:{DNS_PORT}"   # stallwatch: frames while a query waits
    t0 = time.monotonic()
    first = subprocess.Popen(_agent_argv(kubeconfig, args.mode, args.lameduck, ports1, args.watch, args.handover),
                             stdout=logs[0], stderr=subprocess.STDOUT, cwd=ROOT)
    second = None
    try:
        while _probe(name, want) != "ok":
            if first.poll() is not None or time.monotonic() - t0 > 900:
                raise RuntimeError("first agent never answered; see " + logs[0].name)
            time.sleep(0.02)
        cold_answer = time.monotonic() - t0
        while not _ready(ports1[0]):
            time.sleep(0.05)
        cold_ready = time.monotonic() - t0
        time.sleep(1.0)
        first_hwm = _hwm_mb(first.pid)

        # The prober is a process of its own: in this one the fake API server's thread holds
        # the GIL while it serves the second agent's list, which would delay the probes.
        import multiprocessing
        ctx = multiprocessing.get_context("spawn")
        stop = ctx.Event()
        queue = ctx.Queue()
        th = ctx.Process(target=_prober, args=(name, want, stop, queue), daemon=True)
        th.start()
        time.sleep(1.0)
        t_term = time.monotonic()
        wall_term = datetime.now().strftime("%H:%M:%S.%f")[:-3]
        old_exit = None
        if args.overlap:
            # A DaemonSet rollout with maxSurge: the new pod starts next to the old one (same
            # health and metrics ports: SO_REUSEPORT), the old one gets SIGTERM once the new
            # one serves. The clock (t_term) starts at the new agent's start here.
            second = subprocess.Popen(_agent_argv(kubeconfig, args.mode, args.lameduck, ports1, args.watch,
                                                  args.handover), stdout=logs[1], stderr=subprocess.STDOUT, cwd=ROOT)
            while "clusterdns agent " not in open(logs[1].name).read():
                if second.poll() is not None or time.monotonic() - t_term > 900:
                    raise RuntimeError("second agent never listened; see " + logs[1].name)
                time.sleep(0.05)
            t_sigterm = time.monotonic() - t_term
            first.terminate()
            first.wait(120)
            old_exit = time.monotonic() - t_term
            restart_ready = t_sigterm
            time.sleep(2.0)
            stop.set()
            results = queue.get(timeout=60)
            th.join(10)
        else:
            first.terminate()
            second = subprocess.Popen(_agent_argv(kubeconfig, args.mode, args.lameduck, ports2, args.watch,
                                                  args.handover), stdout=logs[1], stderr=subprocess.STDOUT, cwd=ROOT)
        while not args.overlap and not _ready(ports2[0]):
            if second.poll() is not None or time.monotonic() - t_term > 900:
                raise RuntimeError("second agent never became ready; see " + logs[1].name)
            if old_exit is None and first.poll() is not None:
                old_exit = time.monotonic() - t_term
            time.sleep(0.05)
        if not args.overlap:
            restart_ready = time.monotonic() - t_term
            first.wait(60)
            if old_exit is None:
                old_exit = time.monotonic() - t_term
            time.sleep(2.0)
            stop.set()
            results = queue.get(timeout=60)
            th.join(10)
        second_hwm = _hwm_mb(second.pid) if second is not None else None
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.terminate()
                time.sleep(0.3)
                p.terminate()      # a second signal ends the lameduck at once
                p.wait(30)
        api.close()
    during = [(t, r) for t, r in results if t >= t_term]
    failures = [(round(t - t_term, 3), r) for t, r in during if r != "ok"]
    kinds: dict[str, int] = {}
    for _, r in failures:
        kinds[r] = kinds.get(r, 0) + 1
    first_ok = next((round(t - t_term, 3) for t, r in during if r == "ok"), None)
    adopted = ""
    for line in open(logs[1].name):
        if "restart adoption ends" in line:
            adopted = line.strip().split("restart adoption ", 1)[-1]
    return {"services": args.services, "endpoints": args.endpoints, "mode": args.mode,
            "cold_first_answer_s": round(cold_answer, 2), "cold_ready_s": round(cold_ready, 2),
            "probes": len(during), "failures": len(failures), "failure_kinds": kinds,
            "first_failures": failures[:10], "all_failures": failures, "sigterm_at": wall_term,
            "logs": os.path.dirname(logs[1].name), "last_failure_s": failures[-1][0] if failures else None,
            "restart_ready_s": round(restart_ready, 2), "first_right_answer_s": first_ok,
            "old_exit_s": round(old_exit, 2), "adoption": adopted,
            "first_hwm_mb": first_hwm, "second_hwm_mb": second_hwm}


# ---------------------------------------------------------------- crash restart (--restart --kill)

def _query(qid: int, name: str) -> bytes:
    import struct
    head = struct.pack(">HHHHHH", qid, 0x0100, 1, 0, 0, 0)
    return head + b"".join(bytes([len(p)]) + p.encode() for p in name.strip(".").split(".")) + b"\0\0\1\0\1"


def _answer(data: bytes) -> tuple[int, int, str | None]:
    """(query id, rcode, the last A record's address or None) of a response."""
    import struct
    qid, flags, _qd, an = struct.unpack_from(">HHHH", data)
    addr = socket.inet_ntoa(data[-4:]) if an and len(data) >= 16 else None
    return qid, flags & 15, addr


def _kill_prober(t_start: float, names: list[tuple[str, str]], late_ip: str, queue, limit: float = 300.0) -> None:
    """From t_start (monotonic, shared by the processes): a query for each name every 5 ms on one
    UDP socket, answers read as they come. Reports per name the first right answer's time (s
    after t_start), the answers before it by rcode, and for the last name (a Service whose rules
    were not in the kernel at the start) whether its DNAT worked when DNS first answered it."""
    import select
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setblocking(False)
    first: dict[int, float] = {}
    early: dict[int, dict[str, int]] = {i: {} for i in range(len(names))}
    late_rules = None
    seq = 0
    nxt = t_start
    while time.monotonic() < t_start:
        time.sleep(0.001)
    while len(first) < len(names) and time.monotonic() - t_start < limit:
        now = time.monotonic()
        if now >= nxt:
            for i, (name, _want) in enumerate(names):
                if i not in first:
                    seq = (seq + 1) & 0x3FFF
                    try:
                        s.sendto(_query((i << 14) | seq, name), ("127.0.0.1", DNS_PORT))
                    except OSError:
                        pass
            nxt += 0.005
        ready, _, _ = select.select([s], [], [], max(0.0, nxt - time.monotonic()))
        while ready:
            try:
                data = s.recv(4096)
            except BlockingIOError:
                break
            at = time.monotonic() - t_start
            qid, rcode, addr = _answer(data)
            i = qid >> 14
            if i >= len(names) or i in first:
                continue
            if rcode == 0 and addr == names[i][1]:
                first[i] = at
                if i == len(names) - 1:
                    c = socket.socket()
                    c.settimeout(1.0)
                    late_rules = c.connect_ex((late_ip, 80)) == 0
                    c.close()
            else:
                kind = {0: "wrong" if addr else "NODATA", 2: "SERVFAIL", 3: "NXDOMAIN", 5: "REFUSED"}.get(rcode, str(rcode))
                early[i][kind] = early[i].get(kind, 0) + 1
    queue.put({"first": [round(first[i], 3) if i in first else None for i in range(len(names))],
               "early": [early[i] for i in range(len(names))], "late_rules": late_rules})


def _log_times(path: str, t_wall: float) -> dict[str, float]:
    """Seconds after t_wall (time.time() at the start) of the agent's milestones, from its log."""
    marks = {"manifest loaded": "clusterdns.sources.manifest: loaded ", "kernel read": "restart adoption:",
             "watch starts": "clusterdns.sources.kube: watching",
             "dns listens": "DNS listens", "listed": "all resources synced",
             "endpoints read": "restart adoption: endpoints", "first sync": "restart adoption ends"}
    out: dict[str, float] = {}
    for line in open(path, errors="replace"):
        try:
            at = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        except ValueError:
            continue
        for mark, text in marks.items():
            if mark not in out and text in line:
                out[mark] = round(at - t_wall, 2)
    return out


def inner_kill(args) -> dict:
    """One cold start, then `runs` times: SIGKILL the agent (its rules stay in the kernel), add a
    Service the kernel does not have, start a new agent at once and time its first right answer
    (from the new process's exec), and check the added Service is not answered before its rules
    work. `clusterdns dns` alone on the same source (the file, or the fake API server) is the peer."""
    import ipaddress
    import multiprocessing

    from clusterdns.synthetic import SERVICE_BASE, synthetic_records, to_manifest
    from tests.fakeapi import FakeAPIServer, endpoint_slice, namespace, service
    setup_namespace()
    listener()
    if args.mode == "iptables" and args.iptables_backend == "legacy":
        sh("iptables-legacy", "-t", "filter", "-N", "BENCH-LEGACY")
        sh("iptables-legacy", "-t", "filter", "-A", "BENCH-LEGACY", "-j", "RETURN")
    tmp = f"/tmp/cdbench-{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    items = json.loads(to_manifest(synthetic_records(services=args.services, endpoints=args.endpoints)))["items"]
    items.append(namespace("bench"))
    api = None
    manifest = os.path.join(tmp, "cluster.json")
    if args.source == "kube":
        api = FakeAPIServer(history=100000).start()
        api.add_all(items)
        src = ["--kubeconfig", api.write_kubeconfig(os.path.join(tmp, "kubeconfig"))]
    else:
        src = ["--manifest", manifest]

    def write_manifest() -> None:
        with open(manifest + ".tmp", "w") as f:
            json.dump({"apiVersion": "v1", "kind": "List", "items": items}, f)
        os.replace(manifest + ".tmp", manifest)

    def late(i: int) -> tuple[list[dict], str, str]:
        ns, name, ip = "bench", f"late-{i}", f"10.200.{i // 250}.{i % 250 + 1}"
        svc = service(ns, name, ip, ports=(("http", 80, "TCP"),))
        svc["spec"]["ports"][0]["targetPort"] = 8080
        return [svc, endpoint_slice(ns, name, [BACKEND], port=8080)], f"{name}.{ns}.svc.cluster.local.", ip

    if api is None:
        write_manifest()
    ports = (18095, 18096, 18097)

    def argv() -> list[str]:
        a = _agent_argv("", args.mode, 0, ports, handover=0)
        i = a.index("--kubeconfig")
        return a[:i] + src + a[i + 2:]

    name, want = "svc-1.ns-1.svc.cluster.local.", str(ipaddress.ip_address(SERVICE_BASE + 2))
    ctx = multiprocessing.get_context("spawn")
    log_path = os.path.join(tmp, "agent0.log")
    t0 = time.monotonic()
    # each agent leads a process group: a crash takes its children (iptables-nft-save...) too,
    # as an OOM kill of the container does; left running, they would load the next start
    agent = subprocess.Popen(argv(), stdout=open(log_path, "w"), stderr=subprocess.STDOUT, cwd=ROOT,
                             start_new_session=True)
    runs = []
    try:
        while _probe(name, want) != "ok":
            if agent.poll() is not None or time.monotonic() - t0 > 900:
                raise RuntimeError("first agent never answered; see " + log_path)
            time.sleep(0.05)
        cold_answer = time.monotonic() - t0
        while not _ready(ports[0]):
            time.sleep(0.1)
        cold_ready = time.monotonic() - t0
        for r in range(args.runs):
            time.sleep(1.0)
            os.killpg(agent.pid, signal.SIGKILL)   # a crash (OOM kill): the rules stay, nothing drains
            agent.wait(30)
            peer = _peer_dns(src, name, want, ctx)
            objs, late_name, late_ip = late(r)
            if api is not None:
                for o in objs:
                    api.add(o)
            else:
                items.extend(objs)
                write_manifest()
            queue = ctx.Queue()
            t_start = time.monotonic() + 0.5   # the prober is up by then
            prober = ctx.Process(target=_kill_prober, args=(t_start, [(name, want), (late_name, late_ip)],
                                                            late_ip, queue), daemon=True)
            prober.start()
            while time.monotonic() < t_start:
                time.sleep(0.0005)
            log_path = os.path.join(tmp, f"agent{r + 1}.log")
            t_wall = time.time()
            load = os.getloadavg()[0]
            agent = subprocess.Popen(argv(), stdout=open(log_path, "w"), stderr=subprocess.STDOUT, cwd=ROOT,
                                     start_new_session=True)
            while not _ready(ports[0]):
                if agent.poll() is not None or time.monotonic() - t_start > 900:
                    raise RuntimeError("restarted agent never became ready; see " + log_path)
                time.sleep(0.05)
            ready = time.monotonic() - t_start
            got = queue.get(timeout=600)
            prober.join(10)
            run = {"first_right_answer_s": got["first"][0], "before_it": got["early"][0],
                   "late_answer_s": got["first"][1], "late_before": got["early"][1],
                   "late_rules_at_answer": got["late_rules"], "ready_s": round(ready, 2),
                   "load": round(load, 2), "log": _log_times(log_path, t_wall)}
            if peer is not None:
                run["peer_dns_s"] = peer
            runs.append(run)
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGTERM)
            agent.wait(30)
        if api is not None:
            api.close()
    return {"services": args.services, "endpoints": args.endpoints, "mode": args.mode, "source": args.source,
            "cold_first_answer_s": round(cold_answer, 2), "cold_ready_s": round(cold_ready, 2), "runs": runs,
            "logs": tmp}


def _peer_dns(src: list[str], name: str, want: str, ctx) -> float | None:
    """`clusterdns dns` alone on the same source, same port: its first right answer after exec."""
    queue = ctx.Queue()
    t_start = time.monotonic() + 0.5
    prober = ctx.Process(target=_kill_prober, args=(t_start, [(name, want)], "", queue, 120.0), daemon=True)
    prober.start()
    while time.monotonic() < t_start:
        time.sleep(0.0005)
    p = subprocess.Popen([sys.executable, "-m", "clusterdns", "dns", *src,
                          "--listen", f"127.0.0.1:{DNS_PORT}", "--no-upstream", "--health-listen", "none",
                          "--metrics-listen", "none"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    try:
        got = queue.get(timeout=200)
    finally:
        p.kill()
        p.wait(30)
        prober.join(10)
    return got["first"][0]


# ---------------------------------------------------------------- outside

def use_bytecode() -> None:
    """The agents import compiled modules, as after `pip install .`: with PYTHONDONTWRITEBYTECODE
    (set in some development shells) every start would compile the tree's modules again (~0.5 s
    here). Compiled once into a cache directory outside the tree."""
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    os.environ.setdefault("PYTHONPYCACHEPREFIX", "/tmp/cdbench-pycache")
    subprocess.run([sys.executable, "-m", "compileall", "-q", os.path.join(ROOT, "clusterdns")],
                   check=True, stdout=subprocess.DEVNULL)


def print_kill(rows: list[dict]) -> None:
    for r in rows:
        print(f"{r['services']} Services x {r['endpoints']} endpoints, {r['mode']}, source {r['source']}: "
              f"cold first answer {r['cold_first_answer_s']} s, ready {r['cold_ready_s']} s (logs {r['logs']})")
        print(f"  {'run':>3} {'load':>5} {'first right':>11} {'peer dns':>8} {'late svc':>8} {'its DNAT':>8} "
              f"{'ready':>7}  answers before the first right one; milestones (s after exec)")
        for i, run in enumerate(r["runs"]):
            peer = run.get("peer_dns_s")
            print(f"  {i + 1:>3} {run['load']:>5.2f} {_s(run['first_right_answer_s']):>11} {_s(peer):>8} "
                  f"{_s(run['late_answer_s']):>8} {str(run['late_rules_at_answer']):>8} {run['ready_s']:>6.2f}s  "
                  f"{run['before_it']}; {run['log']}")
        firsts = [x["first_right_answer_s"] for x in r["runs"] if x["first_right_answer_s"] is not None]
        peers = [x["peer_dns_s"] for x in r["runs"] if x.get("peer_dns_s") is not None]
        line = f"  median first right answer {statistics.median(firsts):.3f} s" if firsts else "  no right answer"
        if peers:
            line += (f"; peer `clusterdns dns` {statistics.median(peers):.3f} s "
                     f"(ratio {statistics.median(firsts) / statistics.median(peers):.2f})")
        line += f"; median ready {statistics.median(x['ready_s'] for x in r['runs']):.2f} s"
        bad = sum(1 for x in r["runs"] if x["late_rules_at_answer"] is False)
        line += f"; late Service answered before its DNAT worked: {bad} of {len(r['runs'])}"
        print(line)


def _s(v) -> str:
    return "-" if v is None else f"{v:.3f}s"



def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--services", type=int, action="append", help="cluster sizes (default 1000 and 10000)")
    p.add_argument("--changes", type=int, default=30)
    p.add_argument("--gap", type=float, default=1.3, help="seconds between changes (> min sync period)")
    p.add_argument("--mode", choices=("iptables", "nftables", "none"), default="iptables",
                   help="proxier mode; none measures the DNS half alone")
    p.add_argument("--restart", action="store_true",
                   help="measure a cold start and a restart (SIGTERM + a new agent at once) instead")
    p.add_argument("--endpoints", type=int, default=10, help="endpoints per Service (--restart)")
    p.add_argument("--kill", action="store_true",
                   help="(--restart) SIGKILL the first agent (a crash: rules left in the kernel), then start "
                        "the second; first_right_answer_s counts from the second's start")
    p.add_argument("--lameduck", type=float, default=5.0, help="the first agent's --lameduck (--restart)")
    p.add_argument("--overlap", action="store_true",
                   help="(--restart) start the second agent first, on the same ports, and SIGTERM the first "
                        "once the second listens (a maxSurge rollout)")
    p.add_argument("--handover", type=float, default=20.0,
                   help="the agents' --lameduck-handover (--restart; 0: the lameduck alone)")
    p.add_argument("--iptables-backend", choices=("legacy", "nft"), default="legacy",
                   help="iptables mode (--restart): the backend the namespace prefers")
    p.add_argument("--watch", action="store_true",
                   help="run the agents under bench/latency/stallwatch.py (logs GIL stalls and slow GCs) (--restart)")
    p.add_argument("--all-failures", action="store_true", help="print every failed probe (--restart)")
    p.add_argument("--source", choices=("kube", "manifest"), default="kube",
                   help="(--restart --kill) the agents' source: the fake API server, or a manifest file")
    p.add_argument("--runs", type=int, default=3, help="(--restart --kill) SIGKILL restarts after one cold start")
    p.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.inner:
        args.services = args.services[0]
        print(json.dumps((inner_kill(args) if args.kill else inner_restart(args)) if args.restart else inner(args)))
        return 0
    if os.geteuid() != 0:
        print("needs root (a scratch network namespace)", file=sys.stderr)
        return 2
    use_bytecode()
    rows = []
    for n in args.services or [1000, 10000]:
        ns = f"cdbench-{os.getpid()}-{n}"
        subprocess.run(["ip", "netns", "add", ns], check=True)
        try:
            extra = (["--restart", "--endpoints", str(args.endpoints), "--lameduck", str(args.lameduck),
                      "--handover", str(args.handover), "--iptables-backend", args.iptables_backend]
                     + (["--overlap"] if args.overlap else [])
                     + (["--kill", "--source", args.source, "--runs", str(args.runs)] if args.kill else [])
                     + (["--watch"] if args.watch else []) if args.restart else [])
            out = subprocess.run(["ip", "netns", "exec", ns, sys.executable, os.path.abspath(__file__), "--inner",
                                  "--services", str(n), "--changes", str(args.changes), "--gap", str(args.gap),
                                  "--mode", args.mode, *extra], capture_output=True, text=True, cwd=ROOT)
            if out.returncode != 0:
                print(out.stderr, file=sys.stderr)
                return 1
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        finally:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    if args.restart and args.kill:
        print_kill(rows)
        return 0
    if args.restart:
        print(f"{'services':>8} {'eps':>4} {'mode':>8} {'cold answer':>11} {'cold ready':>10} "
              f"{'probes':>6} {'failed':>6} {'restart ready':>13} {'old exit':>8}")
        for r in rows:
            print(f"{r['services']:>8} {r['endpoints']:>4} {r['mode']:>8} {r['cold_first_answer_s']:>10.2f}s "
                  f"{r['cold_ready_s']:>9.2f}s {r['probes']:>6} {r['failures']:>6} {r['restart_ready_s']:>12.2f}s "
                  f"{r['old_exit_s']:>7.2f}s")
            print(f"  failures by kind: {r['failure_kinds']}; first: {r['first_failures']}; "
                  f"last at {r['last_failure_s']}s after SIGTERM")
            print(f"  second agent: {r['adoption']}; first right answer {r['first_right_answer_s']}s after SIGTERM")
            print(f"  agent peak RSS (VmHWM): first {r['first_hwm_mb']} MB once ready, "
                  f"second {r['second_hwm_mb']} MB 2 s after it was ready")
            if args.all_failures:
                print(f"  SIGTERM at {r['sigterm_at']} (logs in {r['logs']}); all failures: {r['all_failures']}")
        return 0
    print(f"{'services':>8} {'mode':>8} {'changes':>7} {'DNS med':>8} {'DNS p99':>8} {'rules med':>9} "
          f"{'rules p99':>9} {'both med':>8} {'both p99':>8} {'order viol':>10}")
    for r in rows:
        print(f"{r['services']:>8} {r['mode']:>8} {r['changes']:>7} {r['dns_median']:>8.3f} {r['dns_p99']:>8.3f} "
              f"{r['rules_median']:>9.3f} {r['rules_p99']:>9.3f} {r['both_median']:>8.3f} {r['both_p99']:>8.3f} "
              f"{r['ordering_violations']:>10}")
    for r in rows:
        m = r["metrics"]
        for metric in ("kubeproxy_network_programming_duration_seconds",
                       "coredns_kubernetes_dns_programming_duration_seconds",
                       "kubeproxy_sync_proxy_rules_duration_seconds"):
            for key in sorted(k for k in m if k.startswith(metric + "_count")):
                count = float(m[key])
                total = float(m.get(key.replace("_count", "_sum"), "0"))
                if count:
                    print(f"  {r['services']:>6} services: {key.replace('_count', '')}: "
                          f"{int(count)} observations, mean {total / count:.3f}s")
        print(f"  {r['services']:>6} services: agent ready {r['ready_after_s']}s after start")
    return 0


if __name__ == "__main__":
    sys.exit(main())
