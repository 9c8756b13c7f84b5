"""Every real Corefile (tests/corefile/real/: kubeadm, kind, k3s, RKE2, EKS, AKS, kubespray,
NodeLocal, the Kubernetes docs) served by `clusterdns dns --corefile` in a network namespace
of its own, on its own port 53 and bind addresses, with a stub upstream on every address its
forwards name (and the namespace's resolv.conf pointing at one more), the hosts and import
files it reads, and the behaviour its plugins make observable: cluster names from the state
(NodeLocal's forwards to the cluster DNS answered in-process), other names from the right
upstream, stub-domain blocks, hosts entries, templates, rewrites, whoami, and health, ready
and metrics on their ports.

The only changes made to a file: absolute paths of the files it reads moved under the
test's directory (/etc/coredns, /etc/localdns), and RKE2's unrendered Helm value
<CLUSTER_DNS_IP> given one. The Kubernetes docs' kube-dns equivalent names `federation`, not
a plugin of CoreDNS any more: it is refused with FILE:LINE, as CoreDNS refuses it.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clusterdns.config import Config
from clusterdns.corefile.build import load_corefile
from tests.nslib import Namespaces, requires, run

ROOT = Path(__file__).resolve().parents[2]
REAL = ROOT / "tests" / "corefile" / "real"
DEMO = str(ROOT / "examples" / "demo-cluster.yaml")
STUB = str(ROOT / "tests" / "corefile" / "stubdns.py")
RESOLVER = "10.99.0.53"          # the namespace's resolv.conf nameserver (a stub too)
SVC, SVC_IP = "testapp-svc.testapp.svc.cluster.local", "172.20.36.232"

# per file: environment (the kube-dns Service IP node-cache would see), --local-ip, extra checks
CASES: dict[str, dict] = {
    "kubeadm": {}, "kind": {}, "rke2": {}, "eks": {}, "kubespray-coredns": {},
    "k3s": {"files": {"NodeHosts": "10.77.0.5 node-a\n10.77.0.6 node-b\n"},
            "checks": [("node-a", "A", "10.77.0.5"), ("NODE-B", "A", "10.77.0.6")]},
    "aks": {"checks": [("x.reddog.microsoft.com", "A", "NXDOMAIN"), ("a.b.c.d.internal.cloudapp.net", "A", "NXDOMAIN")]},
    "aks-coredns-custom": {"cluster": False,
                           "checks": [("www.puglife.local", "A", "192.0.2.*"), ("host.abc.com", "A", "192.0.2.*"),
                                      # rewrite stop { name regex ... default.svc.cluster.local; answer name ... }
                                      ("foo.example.com", "A", "192.0.2.*")]},
    "aks-localdns": {"env": {"KUBE_DNS_SERVICE_HOST": "10.0.0.10"},
                     "files": {"hosts": "10.77.0.9 mcr.microsoft.com\n"},
                     "checks": [("mcr.microsoft.com", "A", "10.77.0.9"), ("x.reddog.microsoft.com", "A", "NXDOMAIN"),
                                ("health-check.localdns.local", "A", "whoami")]},
    "kubespray-nodelocaldns": {"env": {"KUBE_DNS_SERVICE_HOST": "10.233.0.3"}},
    "nodelocaldns": {"env": {"KUBE_DNS_SERVICE_HOST": "10.96.0.10"}, "local_ips": ["169.254.20.10"]},
    "rke2-nodelocal": {"env": {"KUBE_DNS_SERVICE_HOST": "10.96.0.10"}},
    "k8s-docs-customizing-dns": {"checks": [("web.consul.local", "A", "192.0.2.*")]},
}


def _prepare(name: str, tmp: Path) -> tuple[Path, dict]:
    case = CASES[name]
    text = (REAL / f"{name}.corefile").read_text()
    files = tmp / "etc"
    files.mkdir()
    for fname, body in case.get("files", {}).items():
        (files / fname).write_text(body)
    text = text.replace("/etc/coredns/", f"{files}/").replace("/etc/localdns/", f"{files}/")
    text = text.replace("<CLUSTER_DNS_IP>", "10.96.0.10")
    path = tmp / "Corefile"
    path.write_text(text)
    return path, case


def _plan(path: Path, case: dict):
    """What the namespace needs, from the Corefile as clusterdns reads it: the listener
    addresses, the upstreams of each block's forwards, the health/ready/metrics addresses."""
    resolv = path.parent / "resolv.conf"
    resolv.write_text(f"nameserver {RESOLVER}\n")
    # planned here as the server reads it in the namespace, whose /etc/resolv.conf is `resolv`
    plan = path.parent / "Corefile.plan"
    plan.write_text(path.read_text().replace("/etc/resolv.conf", str(resolv)))
    cfg = Config.from_options("dns", corefile=str(plan), local_ips=tuple(case.get("local_ips", ())),
                              resolv_conf=str(resolv))
    env = case.get("env", {})
    cf = load_corefile(str(plan), cfg, env=dict(os.environ, **env), dns_server=env.get("KUBE_DNS_SERVICE_HOST"))
    upstreams: set[tuple[str, int]] = {(RESOLVER, 53)}
    for b in cf.blocks:
        for p in b.plugins:
            if p.name == "forward":
                upstreams |= {(u.host, u.port) for u in p.fwd.upstreams}  # type: ignore[attr-defined]
    return cf, upstreams


def _dig(ns: str, host: str, port: int, name: str, qtype: str) -> str:
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    return run("dig", "+time=2", "+tries=2", f"@{host}", "-p", str(port), name, qtype, ns=ns).stdout


def _status(out: str) -> str:
    for line in out.splitlines():
        if "status:" in line:
            return line.split("status:")[1].split(",")[0].strip()
    return "NO REPLY"


def _answers(out: str) -> list[str]:
    lines, on = [], False
    for line in out.splitlines():
        if line.startswith(";; ANSWER SECTION"):
            on = True
            continue
        if on:
            if not line.strip():
                break
            lines.append(line.split()[-1])
    return lines


def _owners(out: str) -> set[str]:
    owners, on = set(), False
    for line in out.splitlines():
        if line.startswith(";; ANSWER SECTION"):
            on = True
            continue
        if on:
            if not line.strip():
                break
            owners.add(line.split()[0].lower())
    return owners


def _http(ns: str, addr: str, path: str) -> tuple[str, str]:
    host, port = addr.rsplit(":", 1)
    host = {"0.0.0.0": "127.0.0.1"}.get(host, host)
    r = run("curl", "-s", "-o", "-", "-w", "\n%{http_code}", "--max-time", "3", f"http://{host}:{port}{path}", ns=ns)
    body, _, code = r.stdout.rpartition("\n")
    return code, body


@requires("ip", "dig", "curl")
@pytest.mark.parametrize("name", sorted(CASES))
def test_real_corefile_serves_in_a_namespace(name, tmp_path):
    path, case = _prepare(name, tmp_path)
    cf, upstreams = _plan(path, case)
    with Namespaces("cf") as nss:
        # the node holds the Corefile's bind addresses; the upstreams are off the node, in a
        # namespace of their own reached over a veth (as a VPC resolver or a consul server)
        node, far = nss.add("node"), nss.add("up")
        nss.resolv_conf(node, f"nameserver {RESOLVER}\n")
        nss.veth(node, "vu0", far, "eth0")
        run("ip", "addr", "add", "10.98.0.1/30", "dev", "vu0", ns=node)
        run("ip", "addr", "add", "10.98.0.2/30", "dev", "eth0", ns=far)
        addresses = {h for h, _ in cf.listeners if h not in ("0.0.0.0", "::")} | set(case.get("local_ips", ()))
        for ip in sorted(addresses):
            run("ip", "addr", "add", f"{ip}/32", "dev", "lo", ns=node)
        tags: dict[tuple[str, int], str] = {}
        for i, up in enumerate(sorted(upstreams), 1):
            tags[up] = str(i)
            run("ip", "addr", "add", f"{up[0]}/32", "dev", "lo", ns=far)
            run("ip", "route", "add", f"{up[0]}/32", "via", "10.98.0.2", ns=node)
            nss.spawn(far, sys.executable, STUB, up[0], str(up[1]), str(i))
        argv = [sys.executable, "-m", "clusterdns", "dns", "--corefile", str(path), "--manifest", DEMO,
                "--resolv-conf", str(path.parent / "resolv.conf")]
        for ip in case.get("local_ips", ()):
            argv += ["--local-ip", ip]
        log = tmp_path / "clusterdns.log"
        proc = nss.spawn(node, *argv, cwd=str(ROOT), env=dict(os.environ, **case.get("env", {})),
                         stdout=open(log, "w"), stderr=subprocess.STDOUT)
        cluster_listeners = [(h, p) for (h, p), li in cf.listeners.items()
                             if li.block_for("cluster.local.") is not None and case.get("cluster", True)
                             and any(pl.name == "kubernetes" for pl in li.block_for("cluster.local.")[1].plugins)]
        root_listeners = [(h, p, li.blocks["."]) for (h, p), li in cf.listeners.items() if "." in li.blocks]
        assert root_listeners or not case.get("cluster", True), "every real Corefile has a root block"
        first = (cluster_listeners or [(h, p) for h, p, _ in root_listeners] or list(cf.listeners))[0]
        deadline, out = time.monotonic() + 30, ""
        probe = SVC if cluster_listeners else "www.example.org" if root_listeners else case["checks"][0][0]
        while time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()
            out = _dig(node, first[0], first[1], probe, "A")
            if _status(out) == "NOERROR" and _answers(out):
                break
            time.sleep(0.2)
        assert _answers(out), f"{name}: no answer for {probe}:\n{out}\n{log.read_text()}"

        for host, port in cluster_listeners:
            out = _dig(node, host, port, SVC, "A")
            assert _answers(out) == [SVC_IP], f"{name} {host}:{port}\n{out}"
            out = _dig(node, host, port, "nosuch.testapp.svc.cluster.local", "A")
            assert _status(out) == "NXDOMAIN", f"{name} {host}:{port}\n{out}"
        for host, port, block in root_listeners:
            fwd = [p for p in block.plugins if p.name == "forward" and p.from_zone == "."]  # type: ignore[attr-defined]
            if not fwd:
                continue
            want = {f"192.0.2.{tags[(u.host, u.port)]}" for u in fwd[0].fwd.upstreams}  # type: ignore[attr-defined]
            out = _dig(node, host, port, "www.example.org", "A")
            assert set(_answers(out)) <= want and _answers(out), f"{name} {host}:{port} want {want}\n{out}"
            out = _dig(node, host, port, "nx.example.org", "A")
            assert _status(out) == "NXDOMAIN", f"{name}\n{out}"
        for qname, qtype, expect in case.get("checks", []):
            host, port = first if not root_listeners else root_listeners[0][:2]
            out = _dig(node, host, port, qname, qtype)
            if expect in ("NXDOMAIN", "SERVFAIL", "REFUSED"):
                assert _status(out) == expect, f"{name} {qname}\n{out}"
            elif expect == "whoami":
                wh = [(h, p) for (h, p), li in cf.listeners.items() if li.block_for(qname.lower() + ".")]
                out = _dig(node, wh[0][0], wh[0][1], qname, qtype)
                assert _status(out) == "NOERROR" and "_udp." + qname in out, f"{name}\n{out}"
            elif expect.endswith("*"):
                got = _answers(out)
                assert got and all(a.startswith(expect[:-1]) for a in got), f"{name} {qname}\n{out}"
                assert _owners(out) == {qname.lower() + "."}, f"{name} {qname}: the answer names the question\n{out}"
            else:
                assert _answers(out) == [expect], f"{name} {qname}\n{out}"

        if cf.health_listen:
            assert _http(node, cf.health_listen, "/health") == ("200", "OK"), name
        for addr in filter(None, cf.ready_listen.split(",")):
            deadline = time.monotonic() + 10
            while _http(node, addr, "/ready")[0] != "200" and time.monotonic() < deadline:
                time.sleep(0.2)
            assert _http(node, addr, "/ready")[0] == "200", name
        if cf.metrics_listen:
            code, text = _http(node, cf.metrics_listen, "/metrics")
            assert code == "200" and "coredns_dns_requests_total" in text, name
        proc.terminate()
        assert proc.wait(timeout=20) == 0, log.read_text()


def test_the_kube_dns_equivalent_names_federation_and_is_refused(tmp_path):
    text = (REAL / "k8s-docs-kubedns-equivalent.corefile").read_text()
    path = tmp_path / "Corefile"
    path.write_text(text)
    r = subprocess.run([sys.executable, "-m", "clusterdns", "config", "check", "--corefile", str(path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=30)
    line = next(n for n, t in enumerate(text.splitlines(), 1) if t.strip().startswith("federation"))
    assert r.returncode == 2
    assert r.stderr.strip().endswith(f"{path}:{line}: plugin 'federation' is not supported by clusterdns")
