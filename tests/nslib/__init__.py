"""The namespace test library: network namespaces, veth pairs, backends, resolv.conf, manifests.

Every test that needs the kernel (iptables, nft, conntrack, getent against a
pod's resolver, real traffic) builds what it needs from these pieces:

    with Namespaces("flow") as nss:           # clean-up always runs, even on failure
        node, pod = nss.add("node"), nss.add("pod")
        nss.veth(node, "vp0", pod, "eth0")
        nss.routed_pod(node, "vp0", pod, "10.161.1.10", gw="10.161.0.1")
        nss.backend(pod, "pod0", tcp_port=8080)       # answers "pod0 <peer address>\n"
        nss.resolv_conf(pod, POD_RESOLV)              # getent in the pod walks this search list

Names carry the test process id, so parallel runs never collide. `missing()`
gives the one reason a test cannot run here (not root, a tool or kernel feature
absent); `requires()` turns it into a skip marker.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
PY = sys.executable
NETSERVER = str(HERE / "netserver.py")
NETCLIENT = str(HERE / "netclient.py")

# A pod's resolver configuration in namespace testapp (the design's path).
POD_RESOLV = ("search testapp.svc.cluster.local svc.cluster.local cluster.local\n"
              "nameserver 172.20.0.10\noptions ndots:5\n")


# ---------------------------------------------------------------- running commands

def run(*argv: str, ns: str | None = None, input: str | None = None,
        timeout: float = 30) -> subprocess.CompletedProcess:
    """Run argv (inside namespace `ns` when given); never raises on a non-zero exit."""
    full = (["ip", "netns", "exec", ns] if ns else []) + list(argv)
    return subprocess.run(full, capture_output=True, text=True, input=input, timeout=timeout)


def sh(*argv: str, ns: str | None = None, check: bool = True, input: str | None = None,
       timeout: float = 30) -> str:
    """Run argv and return its stdout; a failure (when `check`) raises with the tool's message."""
    res = run(*argv, ns=ns, input=input, timeout=timeout)
    if check and res.returncode != 0:
        cmd = " ".join((["ip", "netns", "exec", ns] if ns else []) + list(argv))
        raise AssertionError(f"{cmd}: exit {res.returncode}: {res.stderr.strip() or res.stdout.strip()}")
    return res.stdout


# ---------------------------------------------------------------- what this machine can do

def kernel_has_ipvs() -> bool:
    return os.path.exists("/proc/net/ip_vs")


def missing(*tools: str, root: bool = True, ipvs: bool = False) -> str:
    """Why a namespace test cannot run here ("" when it can): root, iproute2, `tools`, kernel features."""
    if root and os.geteuid() != 0:
        return "needs root for network namespaces"
    for tool in (("ip",) if root else ()) + tools:
        if shutil.which(tool) is None:
            return f"needs {tool} (not installed)"
    if ipvs and not kernel_has_ipvs():
        return "this kernel has no IPVS (ip_vs module absent)"
    return ""


def requires(*tools: str, root: bool = True, ipvs: bool = False) -> pytest.MarkDecorator:
    """A skip marker carrying the reason from missing()."""
    reason = missing(*tools, root=root, ipvs=ipvs)
    return pytest.mark.skipif(bool(reason), reason=reason or "available")


def skip_unless(*tools: str, root: bool = True, ipvs: bool = False) -> None:
    """Skip the running test (or fixture) with missing()'s reason."""
    reason = missing(*tools, root=root, ipvs=ipvs)
    if reason:
        pytest.skip(reason)


# ---------------------------------------------------------------- namespaces

def ns_name(tag: str) -> str:
    return f"cdt-{tag}-{os.getpid()}"


class Namespaces:
    """A set of network namespaces and the processes and files that belong to them.

    close() (or leaving the `with` block) kills the processes, deletes the
    namespaces and their /etc/netns directories, whatever happened before."""

    def __init__(self, tag: str = "t") -> None:
        self.tag = tag
        self.names: list[str] = []
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> Namespaces:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def name(self, short: str) -> str:
        return ns_name(f"{self.tag}-{short}")

    def add(self, short: str) -> str:
        """A new namespace with lo up; returns its full name."""
        name = self.name(short)
        sh("ip", "netns", "add", name)
        self.names.append(name)
        sh("ip", "link", "set", "lo", "up", ns=name)
        return name

    def veth(self, ns_a: str, dev_a: str, ns_b: str, dev_b: str) -> None:
        """A veth pair, both ends up: dev_a in ns_a, dev_b in ns_b."""
        sh("ip", "link", "add", dev_a, "netns", ns_a, "type", "veth", "peer", "name", dev_b, "netns", ns_b)
        sh("ip", "link", "set", dev_a, "up", ns=ns_a)
        sh("ip", "link", "set", dev_b, "up", ns=ns_b)

    def routed_pod(self, node: str, node_dev: str, pod: str, ip: str, gw: str, pod_dev: str = "eth0") -> None:
        """A routed pod, as with a routed CNI: the pod holds ip/32 (or /128) and a default route via
        gw; the node holds gw on its end and a host route to ip. Every packet between pods
        crosses the node's netfilter hooks."""
        v6 = ":" in ip
        plen, ipcmd = ("128", ["ip", "-6"]) if v6 else ("32", ["ip"])
        extra = ["nodad"] if v6 else []
        sh("ip", "addr", "add", f"{gw}/{plen}", "dev", node_dev, *extra, ns=node)
        sh(*ipcmd, "route", "add", f"{ip}/{plen}", "dev", node_dev, ns=node)
        sh("ip", "addr", "add", f"{ip}/{plen}", "dev", pod_dev, *extra, ns=pod)
        sh(*ipcmd, "route", "add", gw, "dev", pod_dev, ns=pod)
        sh(*ipcmd, "route", "add", "default", "via", gw, "dev", pod_dev, ns=pod)

    def sysctl(self, ns: str, **settings: str) -> None:
        """sysctl keys with dots written as __ (net__ipv4__ip_forward="1")."""
        for key, value in settings.items():
            sh("sysctl", "-qw", f"{key.replace('__', '.')}={value}", ns=ns)

    def resolv_conf(self, ns: str, text: str = POD_RESOLV) -> Path:
        """The namespace's own resolv.conf: `ip netns exec` bind-mounts it over /etc/resolv.conf,
        so the C library resolver (getent) inside uses it."""
        etc = Path("/etc/netns") / ns
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "resolv.conf").write_text(text)
        return etc / "resolv.conf"

    def spawn(self, ns: str | None, *argv: str, **popen: object) -> subprocess.Popen:
        """A process (inside ns when given) killed at close()."""
        full = (["ip", "netns", "exec", ns] if ns else []) + list(argv)
        popen.setdefault("stdout", subprocess.DEVNULL)
        popen.setdefault("stderr", subprocess.DEVNULL)
        proc = subprocess.Popen(full, **popen)  # type: ignore[call-overload]
        self.procs.append(proc)
        return proc

    def backend(self, ns: str, name: str, tcp_port: int, udp_port: int | None = None) -> subprocess.Popen:
        """tests/nslib/netserver.py in ns: answers "<name> <peer address>\\n" on TCP and UDP, IPv4
        and IPv6, so a test sees which endpoint it reached and whether it was masqueraded."""
        return self.spawn(ns, PY, NETSERVER, name, str(tcp_port), str(udp_port if udp_port else tcp_port))

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        self.procs.clear()
        for name in self.names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            shutil.rmtree(Path("/etc/netns") / name, ignore_errors=True)
        self.names.clear()


@contextmanager
def netns(tag: str) -> Iterator[str]:
    """One namespace (lo up), deleted on exit."""
    with Namespaces(tag) as nss:
        yield nss.add("ns")


# ---------------------------------------------------------------- nftables

def nft(ns: str, script: str, *, check: bool = False, strict: bool = False) -> subprocess.CompletedProcess:
    """`nft -f -` of script in namespace ns; check: `nft -c` (parse and check only, change nothing).
    Returns the result; strict: a failure raises, with nft's message and the script."""
    res = run("nft", *(["-c"] if check else []), "-f", "-", ns=ns, input=script)
    if strict and res.returncode != 0:
        raise AssertionError(f"nft -f in {ns}: exit {res.returncode}: {res.stderr.strip()}\n{script}")
    return res


def nft_table(ns: str, family: int | str = 4, table: str = "kube-proxy") -> str:
    """`nft list table` of the proxier's table in ns; family 4/6 or nft's "ip"/"ip6"."""
    fam = {4: "ip", 6: "ip6"}.get(family, family) if isinstance(family, int) else family
    return sh("nft", "list", "table", fam, table, ns=ns)


# ---------------------------------------------------------------- traffic

def connect(ns: str, proto: str, host: str, port: int, count: int, *, bind: str = "", sport: int = 0,
            timeout: float = 1.0, path: str = "/") -> dict:
    """tests/nslib/netclient.py from ns: {"answers": [[name, peer], ...], "errors": {kind: n}, "local": ip}."""
    argv = [PY, NETCLIENT, proto, host, str(port), str(count), "--timeout", str(timeout), "--path", path]
    if bind:
        argv += ["--bind", bind]
    if sport:
        argv += ["--sport", str(sport)]
    return json.loads(sh(*argv, ns=ns, timeout=30 + count * timeout))


def wait_until(pred, timeout: float, what: str, interval: float = 0.05) -> None:
    """Poll pred() until it is true; fail with `what` after timeout seconds."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


# ---------------------------------------------------------------- manifests

def write_manifest(path: str | os.PathLike, items: Iterable[dict] | dict) -> None:
    """Write a manifest (a kind: List of `items`, or a whole document) atomically: a reader never sees half."""
    doc = items if isinstance(items, dict) else {"apiVersion": "v1", "kind": "List", "items": list(items)}
    tmp = f"{os.fspath(path)}.tmp"
    with open(tmp, "w") as fh:
        json.dump(doc, fh)
    os.replace(tmp, path)
