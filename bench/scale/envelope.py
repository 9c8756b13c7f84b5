"""Kubernetes' scalability envelope through `clusterdns agent`, as a user installs and runs it.

    sudo .venv/bin/python bench/scale/envelope.py [--modes nftables,iptables] [--runs 3] [--changes 10]
        [--services 10000] [--endpoints 150000] [--big 5000] [--headless 1000] [--venv DIR]

1. `pip install .` of this tree into a fresh venv (or --venv DIR, one made so before).
2. Per mode and run, in a scratch network namespace: the fake API server (tests/fakeapi.py,
   the real list/watch protocol) holding clusterdns.synthetic.envelope_records (10,000
   Services, 150,000 endpoints: `big` (ClusterIP) and `big-headless` over the same 5,000
   Pods in slices of 100, 1,000 headless Services) and `probe`, a Service whose endpoint
   is a listener of the namespace; the venv's `clusterdns agent --kubeconfig K --apply
   --proxy-mode MODE` as a whole process (iptables mode: the nf_tables backend, the one
   a fresh node picks).
3. Cold start: seconds from exec to the first right A answer for `probe` (checked
   rule-backed: a connect to its ClusterIP reaches the listener at that moment), and
   to /ready.
4. `--changes` one-endpoint changes in the 5,000-endpoint Service, `--gap` seconds apart
   (more than the default minimum sync period): a Pod replaced, i.e. one address changed in
   one slice of `big` and of `big-headless` (one API write each, in one go, with the
   last-change-trigger-time annotation the controller sets). The clock starts at the
   write; then polled every ~1 ms until both hold:
   - DNS: the new Pod's name `<dashed-ip>.big-headless.ns-0.svc.cluster.local A` answers
     its address (UDP);
   - kernel, over nfnetlink (no nft/iptables process, which would read the whole table):
     nftables: the `hairpin` set holds the new address's pair (written in the same
     transaction as the endpoint map); iptables: the new endpoint's KUBE-SEP chain exists
     in the nat table (kube-proxy's name; the restore that adds it rewrites KUBE-SVC).
   After each change, untimed: the endpoint map (nftables) holds the new address and not
   the old one; the old name is NXDOMAIN.
5. After the changes, `big-headless` A and SRV over UDP (EDNS 1232, and plain 512) and TCP:
   every record one of the Service's current endpoints, none twice; TC set exactly when
   records were left out, and then no further record would have fitted (CoreDNS fits every
   reply, TCP ones to 65535 bytes, and sets TC even over TCP: request.Scrub).

Prints per mode the medians (min, max) over runs of the cold start, and of the change
latencies the medians and maxima over all changes; the load average with each run.
"""
from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

BACKEND = "10.255.0.1"           # the probe Service's endpoint: a listener on the namespace's lo
PROBE_IP = "10.111.255.254"      # the probe Service's ClusterIP (in 10.96.0.0/12, unused by the generator)
DNS_PORT = 5399
HEALTH, DNS_METRICS, PROXY_METRICS = 18095, 18097, 18096
NS = "ns-0"


def sh(*argv: str) -> str:
    r = subprocess.run(argv, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"{' '.join(argv)}: {r.stderr.strip()}")
    return r.stdout


def make_venv(path: Path) -> Path:
    """A venv with `pip install .` of a copy of this tree (no build output lands in the tree)."""
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    src = path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".venv", ".git", "*.egg-info", "__pycache__",
                                                             "build", ".pytest_cache", ".mypy_cache"))
    r = subprocess.run([str(path / "bin" / "pip"), "install", "-q", str(src)], capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"pip install . failed:\n{r.stdout}{r.stderr}")
    return path / "bin" / "clusterdns"


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


# ---------------------------------------------------------------- netlink reads (inside the namespace)

class Netlink:
    """Single-object nf_tables GETs: a chain by name, a set element by key."""
    GETCHAIN, GETSETELEM, NLMSG_ERROR = 4, 13, 2

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 12)   # NETLINK_NETFILTER
        self.sock.bind((0, 0))
        self.seq = 1

    @staticmethod
    def _attr(kind: int, payload: bytes) -> bytes:
        data = struct.pack("=HH", 4 + len(payload), kind) + payload
        return data + b"\0" * (-len(data) % 4)

    def _get(self, kind: int, body: bytes) -> bool:
        """True when the kernel answers the object, False on ENOENT."""
        self.seq += 1
        payload = struct.pack("=BBH", 2, 0, 0) + body   # NFPROTO_IPV4
        msg = struct.pack("=IHHII", 16 + len(payload), (10 << 8) | kind, 1, self.seq, 0) + payload
        self.sock.send(msg)
        while True:
            reply = self.sock.recv(1 << 16)
            pos = 0
            while pos + 16 <= len(reply):
                length, mtype, _, seq, _ = struct.unpack_from("=IHHII", reply, pos)
                if seq == self.seq:
                    if mtype == self.NLMSG_ERROR:
                        (err,) = struct.unpack_from("=i", reply, pos + 16)
                        if err in (-2, 0):     # ENOENT (0 would be a bare ack)
                            return err == 0
                        raise OSError(-err, os.strerror(-err))
                    return True
                pos += (length + 3) & ~3

    def chain(self, table: str, name: str) -> bool:
        return self._get(self.GETCHAIN, self._attr(1, table.encode() + b"\0") + self._attr(3, name.encode() + b"\0"))

    def element(self, table: str, set_name: str, key: bytes) -> bool:
        elem = self._attr(1 | 0x8000, self._attr(1, key))              # NFTA_SET_ELEM_KEY { NFTA_DATA_VALUE }
        elems = self._attr(3 | 0x8000, self._attr(1 | 0x8000, elem))  # ELEMENTS { LIST_ELEM { ... } }
        return self._get(self.GETSETELEM, self._attr(1, table.encode() + b"\0")
                         + self._attr(2, set_name.encode() + b"\0") + elems)


def endpoint_map_holds(addr: str, port: int) -> tuple[str, bool] | None:
    """Which endpoints-* map of table ip kube-proxy holds `addr . port` as data (a dump of every
    endpoint map over netlink; untimed)."""
    from clusterdns.proxy import nflink
    table = nflink._attr(1, b"kube-proxy\0")
    names = [m[2][0].rstrip(b"\0").decode() for m in nflink.dump(nflink.GETSET, 4, table)]
    want = socket.inet_aton(addr) + struct.pack(">H", port) + b"\0\0"
    for name in names:
        if name.startswith("endpoints-"):
            for m in nflink.dump(nflink.GETSETELEM, 4, table + nflink._attr(2, name.encode() + b"\0")):
                if want in b"".join(m.get(3, [])):
                    return name, True
    return None


# ---------------------------------------------------------------- DNS (inside the namespace)

def dns_query(name: str, rdtype: str, tcp: bool = False, payload: int | None = 1232, timeout: float = 2.0):
    import dns.message
    import dns.query
    q = dns.message.make_query(name, rdtype, use_edns=payload is not None, payload=payload or 512)
    if tcp:
        return dns.query.tcp(q, "127.0.0.1", port=DNS_PORT, timeout=timeout)
    return dns.query.udp(q, "127.0.0.1", port=DNS_PORT, timeout=timeout, ignore_trailing=True)


class UdpProbe:
    """One prebuilt A query sent again and again; right when the reply holds exactly `want`."""

    def __init__(self, name: str) -> None:
        import dns.message
        self.q = dns.message.make_query(name, "A")
        self.wire = self.q.to_wire()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.connect(("127.0.0.1", DNS_PORT))
        self.sock.setblocking(False)

    def ask(self, timeout: float = 0.05) -> tuple[int, list[str]] | None:
        import dns.message
        try:
            while True:
                self.sock.recv(65535)      # a late reply to an earlier probe
        except BlockingIOError:
            pass
        except ConnectionRefusedError:
            return None
        try:
            self.sock.send(self.wire)
        except ConnectionRefusedError:
            return None
        if not select.select([self.sock], [], [], timeout)[0]:
            return None
        try:
            r = dns.message.from_wire(self.sock.recv(65535))
        except (ConnectionRefusedError, BlockingIOError):
            return None
        return r.rcode(), [rd.address for rrset in r.answer for rd in rrset if rrset.rdtype == 1]


def connects(ip: str, port: int = 80, timeout: float = 1.0) -> bool:
    try:
        socket.create_connection((ip, port), timeout).close()
        return True
    except OSError:
        return False


def dashed(ip: str) -> str:
    return ip.replace(".", "-")


def check_big_answers(addresses: set[str]) -> dict:
    """big-headless A and SRV over UDP (EDNS 1232, no EDNS) and TCP: the records are current
    endpoints, none twice; TC exactly when some were left out, and then nothing more fitted."""
    zone = "svc.cluster.local."
    name = f"big-headless.{NS}.{zone}"
    out: dict = {}
    for rdtype, qname in (("A", name), ("SRV", f"_http._tcp.{name}")):
        for transport, tcp, payload, limit in (("udp1232", False, 1232, 1232), ("udp512", False, None, 512),
                                               ("tcp", True, 1232, 65535)):
            r = dns_query(qname, rdtype, tcp=tcp, payload=payload, timeout=5.0)
            size = len(r.to_wire(max_size=70000))
            tc = bool(r.flags & 0x0200)
            problems = []
            if rdtype == "A":
                got = [rd.address for rrset in r.answer for rd in rrset]
                per = 16                                   # a pointer-owned A record
            else:
                targets = [(rd.target.to_text(), rd.port) for rrset in r.answer for rd in rrset]
                glue = {rrset.name.to_text(): [rd.address for rd in rrset] for rrset in r.additional
                        if rrset.rdtype == 1}
                got = []
                for target, port in targets:
                    label = target.split(".", 1)[0]
                    ip = label.replace("-", ".")
                    if not target.endswith("." + name) or port != 8080:
                        problems.append(f"SRV target {target} port {port}")
                    got.append(ip)
                    if target in glue and glue[target] != [ip]:
                        problems.append(f"glue of {target}: {glue[target]}")
                per = 12 + 2 + len(dashed("10.0.0.1")) + 1   # the smallest SRV record (no glue)
            if len(got) != len(set(got)):
                problems.append("a record twice")
            stray = [ip for ip in got if ip not in addresses]
            if stray:
                problems.append(f"{len(stray)} not endpoints, e.g. {stray[:3]}")
            complete = len(got) == len(addresses)
            if tc == complete:
                problems.append(f"TC={tc} with {len(got)} of {len(addresses)}")
            if size > limit:
                problems.append(f"{size} bytes over {limit}")
            if tc and size + per <= limit and rdtype == "A":
                problems.append(f"TC at {size} bytes: another record would fit")
            out[f"{rdtype} {transport}"] = {"records": len(got), "bytes": size, "tc": tc, "problems": problems}
    return out


# ---------------------------------------------------------------- inside the namespace

def setup_namespace() -> None:
    sh("ip", "link", "set", "lo", "up")
    sh("ip", "addr", "add", f"{BACKEND}/32", "dev", "lo")
    sh("ip", "link", "add", "void0", "type", "bridge")
    sh("ip", "link", "set", "void0", "up")
    sh("ip", "addr", "add", "192.168.77.2/24", "dev", "void0")
    sh("ip", "route", "add", "10.96.0.0/12", "dev", "void0")   # ClusterIPs go nowhere without DNAT
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((BACKEND, 8080))
    s.listen(512)

    def serve() -> None:
        while True:
            s.accept()[0].close()
    threading.Thread(target=serve, daemon=True).start()


def objects(args) -> list[dict]:
    from clusterdns.synthetic import envelope_records, to_manifest
    from tests.fakeapi import endpoint_slice, service
    items = json.loads(to_manifest(envelope_records(args.services - 1, args.endpoints - 1, args.big,
                                                    args.headless)))["items"]
    svc = service(NS, "probe", PROBE_IP)
    svc["spec"]["ports"][0]["targetPort"] = 8080
    return items + [svc, endpoint_slice(NS, "probe", [BACKEND], port=8080)]


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


def scrape(at: int, prefix: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{at}/metrics", timeout=5).read().decode()
    return {ln.split(" ")[0]: float(ln.split(" ")[1]) for ln in text.splitlines()
            if ln.startswith(prefix) and ("_sum" in ln or "_count" in ln)}


def status_mb(pid: int, field: str) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


def inner(args) -> dict:
    from clusterdns.proxy import names
    from tests.fakeapi import FakeAPIServer
    setup_namespace()
    items = objects(args)
    api = FakeAPIServer(history=100000).start()
    api.add_all(items)
    big = {it["metadata"]["name"]: it for it in items
           if it["kind"] == "EndpointSlice" and it["metadata"]["name"].startswith("big-")}
    slices = sorted(n for n in big if not n.startswith("big-headless-"))
    tmp = tempfile.mkdtemp(prefix="cdns-envelope-")
    kubeconfig = api.write_kubeconfig(os.path.join(tmp, "kubeconfig"))
    log = open(os.path.join(tmp, "agent.log"), "w")
    argv = [args.clusterdns, "agent", "--kubeconfig", kubeconfig, "--listen", f"127.0.0.1:{DNS_PORT}",
            "--proxy-mode", args.mode, "--apply", "--no-upstream", "--lameduck", "0",
            "--cluster-cidr", "10.0.0.0/8", "--health-listen", f"127.0.0.1:{HEALTH}",
            "--metrics-listen", f"127.0.0.1:{DNS_METRICS}", "--proxy-metrics-listen", f"127.0.0.1:{PROXY_METRICS}",
            "--log-level", args.agent_log_level]
    out: dict = {"mode": args.mode, "load_start": loadavg()}
    t0 = time.monotonic()
    agent = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        probe = UdpProbe(f"probe.{NS}.svc.cluster.local.")
        while True:
            got = probe.ask()
            if got and got[1] == [PROBE_IP]:
                break
            if agent.poll() is not None or time.monotonic() - t0 > args.timeout:
                raise RuntimeError(f"no right answer within {args.timeout} s; see {log.name}")
            time.sleep(0.02)
        out["cold_answer_s"] = time.monotonic() - t0
        out["cold_rule_backed"] = connects(PROBE_IP)
        while True:
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{HEALTH}/ready", timeout=2).status == 200:
                    break
            except OSError:
                pass
            if agent.poll() is not None:
                raise RuntimeError(f"the agent exited; see {log.name}")
            time.sleep(0.05)
        out["cold_ready_s"] = time.monotonic() - t0
        out["hwm_ready_mb"] = status_mb(agent.pid, "VmHWM")
        nl = Netlink()
        spy = None
        if args.py_spy:   # where the agent's time goes during the changes (collapsed stacks)
            spy = subprocess.Popen([args.py_spy, "record", "-p", str(agent.pid), "-r", "250", "--format", "raw",
                                    "-o", os.path.join(tmp, "changes.spy"), "--nonblocking"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(2)
        current = {e["addresses"][0] for n in slices for e in big[n]["endpoints"]}
        home = endpoint_map_holds(sorted(current)[0], 8080) if args.mode == "nftables" else None
        changes = []
        for i in range(args.changes):
            time.sleep(args.gap)
            name = slices[i % len(slices)]
            j = (i * 37) % len(big[name]["endpoints"])
            old = big[name]["endpoints"][j]["addresses"][0]
            new = f"10.250.{i // 250}.{i % 250 + 1}"
            writes = []
            for sl_name in (name, name.replace("big-", "big-headless-", 1)):
                sl = json.loads(json.dumps(big[sl_name]))
                sl["endpoints"][j]["addresses"] = [new]
                sl["endpoints"][j]["targetRef"]["name"] = f"big-new-{i}"
                sl["metadata"].setdefault("annotations", {})[
                    "endpoints.kubernetes.io/last-change-trigger-time"] = _now()
                big[sl_name] = sl
                writes.append(sl)
            dns_probe = UdpProbe(f"{dashed(new)}.big-headless.{NS}.svc.cluster.local.")
            if args.mode == "nftables":
                key = socket.inet_aton(new) * 2

                def in_kernel() -> bool:
                    return nl.element("kube-proxy", "hairpin", key)
            else:
                sep = names.sep_chain(f"{NS}/big:http", "tcp", f"{new}:8080")

                def in_kernel() -> bool:
                    return nl.chain("nat", sep)
            t = time.monotonic()
            api.add_all(writes)
            t_dns = t_kernel = None
            while t_dns is None or t_kernel is None:
                now = time.monotonic()
                if now - t > args.change_timeout:
                    raise RuntimeError(f"change {i} not seen in {args.change_timeout:.0f} s (dns {t_dns}, kernel {t_kernel}); see {log.name}")
                if t_dns is None:
                    got = dns_probe.ask(0.002)
                    if got and got[1] == [new]:
                        t_dns = time.monotonic() - t
                if t_kernel is None and in_kernel():
                    t_kernel = time.monotonic() - t
                time.sleep(0.0005)
            current.discard(old)
            current.add(new)
            row = {"dns_ms": t_dns * 1000, "kernel_ms": t_kernel * 1000}
            gone = dns_query(f"{dashed(old)}.big-headless.{NS}.svc.cluster.local.", "A")
            row["old_name_nxdomain"] = gone.rcode() == 3
            if args.mode == "nftables" and home:
                got_new = endpoint_map_holds(new, 8080)
                got_old = endpoint_map_holds(old, 8080)
                row["map_right"] = bool(got_new and got_new[0] == home[0] and not got_old)
            else:
                row["map_right"] = not nl.chain("nat", names.sep_chain(f"{NS}/big:http", "tcp", f"{old}:8080"))
            changes.append(row)
        out["changes"] = changes
        if spy is not None:
            spy.send_signal(2)
            spy.wait(60)
            out["spy"] = os.path.join(tmp, "changes.spy")
        out["answers"] = check_big_answers(current)
        out["metrics"] = scrape(PROXY_METRICS, "kubeproxy_network_programming_duration_seconds")
        out["metrics"].update(scrape(PROXY_METRICS, "kubeproxy_sync_proxy_rules_duration_seconds"))
        out["hwm_end_mb"] = status_mb(agent.pid, "VmHWM")
        out["load_end"] = loadavg()
        backend = [ln.strip() for ln in open(log.name) if "iptables backend:" in ln]
        out["backend"] = backend[0].split("iptables backend:", 1)[1].strip() if backend else ""
    finally:
        agent.terminate()
        try:
            agent.wait(30)
        except subprocess.TimeoutExpired:
            agent.kill()
        api.close()
    if args.keep:
        out["log"] = log.name
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


# ---------------------------------------------------------------- outside

def med(values: list[float], fmt: str = "{:.2f}") -> str:
    if not values:
        return "-"
    return f"{fmt.format(statistics.median(values))} (min {fmt.format(min(values))}, max {fmt.format(max(values))})"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="nftables,iptables")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--changes", type=int, default=10)
    p.add_argument("--gap", type=float, default=1.5, help="seconds between changes (> the minimum sync period)")
    p.add_argument("--services", type=int, default=10000)
    p.add_argument("--endpoints", type=int, default=150000)
    p.add_argument("--big", type=int, default=5000)
    p.add_argument("--headless", type=int, default=1000)
    p.add_argument("--venv", help="a venv made by an earlier run (its bin/clusterdns is used)")
    p.add_argument("--timeout", type=float, default=900, help="seconds for the cold start")
    p.add_argument("--change-timeout", type=float, default=60, help="seconds for one change")
    p.add_argument("--agent-log-level", default="info")
    p.add_argument("--py-spy", help="a py-spy binary: record the agent during the changes (kept with --keep)")
    p.add_argument("--keep", action="store_true", help="keep the agents' logs (their paths are printed)")
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
    print("command: " + " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]))
    with tempfile.TemporaryDirectory(prefix="cdns-envelope-venv-") as tmp:
        clusterdns = str(Path(args.venv) / "bin" / "clusterdns") if args.venv else str(make_venv(Path(tmp) / "venv"))
        rows: dict[str, list[dict]] = {m: [] for m in args.modes.split(",")}
        for run in range(args.runs):
            for mode in rows:     # interleaved: a burst of load elsewhere spreads over both modes
                ns = f"cdns-env-{os.getpid()}-{run}-{mode}"
                subprocess.run(["ip", "netns", "add", ns], check=True)
                try:
                    cmd = ["ip", "netns", "exec", ns, sys.executable, os.path.abspath(__file__), "--inner",
                           "--mode", mode, "--clusterdns", clusterdns, "--changes", str(args.changes),
                           "--gap", str(args.gap), "--services", str(args.services), "--endpoints",
                           str(args.endpoints), "--big", str(args.big), "--headless", str(args.headless),
                           "--timeout", str(args.timeout), "--change-timeout", str(args.change_timeout)] + (["--keep"] if args.keep else []) + ["--agent-log-level", args.agent_log_level] + (["--py-spy", args.py_spy] if args.py_spy else [])
                    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
                    if r.returncode:
                        print(r.stdout[-2000:], r.stderr[-4000:], file=sys.stderr)
                        return 1
                    row = json.loads(r.stdout.strip().splitlines()[-1])
                finally:
                    subprocess.run(["ip", "netns", "del", ns], capture_output=True)
                rows[mode].append(row)
                ch = row["changes"]
                print(f"run {run + 1} {mode}{' (' + row['backend'] + ')' if row['backend'] else ''}: "
                      f"cold answer {row['cold_answer_s']:.1f} s (rule-backed: {row['cold_rule_backed']}), "
                      f"ready {row['cold_ready_s']:.1f} s; change -> DNS median "
                      f"{statistics.median(c['dns_ms'] for c in ch):.1f} ms max {max(c['dns_ms'] for c in ch):.1f}, "
                      f"-> kernel median {statistics.median(c['kernel_ms'] for c in ch):.1f} ms "
                      f"max {max(c['kernel_ms'] for c in ch):.1f}; agent VmHWM {row['hwm_end_mb']:.0f} MB; "
                      f"load {row['load_start']} -> {row['load_end']}" + (f"; log {row['log']}" if args.keep else ""), flush=True)
    print(f"\n{args.services} Services, {args.endpoints} endpoints, one of {args.big} (and its headless twin), "
          f"{args.headless} headless; {args.runs} runs x {args.changes} changes; medians (min, max):")
    for mode, rs in rows.items():
        ch = [c for r in rs for c in r["changes"]]
        print(f"{mode}:")
        print(f"  cold start -> first rule-backed answer  {med([r['cold_answer_s'] for r in rs])} s; "
              f"rule-backed in {sum(r['cold_rule_backed'] for r in rs)}/{len(rs)}")
        print(f"  cold start -> /ready                    {med([r['cold_ready_s'] for r in rs])} s")
        print(f"  one-endpoint change -> DNS              {med([c['dns_ms'] for c in ch], '{:.1f}')} ms")
        print(f"  one-endpoint change -> kernel           {med([c['kernel_ms'] for c in ch], '{:.1f}')} ms")
        print("  per run, the slowest change (DNS, kernel): "
              + ", ".join(f"{max(c['dns_ms'] for c in r['changes']):.1f}/{max(c['kernel_ms'] for c in r['changes']):.1f}"
                          for r in rs) + " ms")
        bad = [c for c in ch if not (c["old_name_nxdomain"] and c["map_right"])]
        print(f"  after each change: old name NXDOMAIN and kernel map right in {len(ch) - len(bad)}/{len(ch)}")
        last = rs[-1]["answers"]
        print("  big-headless answers (last run): " + "; ".join(
            f"{k}: {v['records']} records {v['bytes']} B TC={int(v['tc'])}{' PROBLEMS ' + str(v['problems']) if v['problems'] else ''}"
            for k, v in last.items()))
        wrong = sum(bool(v["problems"]) for r in rs for v in r["answers"].values())
        print(f"  answer checks with problems over all runs: {wrong}")
        m = rs[-1]["metrics"]
        for key in sorted(k for k in m if k.endswith("_count")):
            if m[key]:
                print(f"  {key[:-6]}: {int(m[key])} observations, mean {m[key[:-6] + '_sum'] / m[key] * 1000:.1f} ms")
        print(f"  agent VmHWM at the end {med([r['hwm_end_mb'] for r in rs], '{:.0f}')} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
