"""The C library's resolver against the server, in a network namespace.

`ip netns exec NS` bind-mounts /etc/netns/NS/resolv.conf over /etc/resolv.conf,
so getent uses a pod's resolver configuration (search list, ndots:5) and the
real glibc stub walks the search list against our server.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "clusterdns" / "demo" / "cluster.yaml"
ADDR = "10.53.0.10"

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces"),
    pytest.mark.skipif(shutil.which("ip") is None or shutil.which("getent") is None,
                       reason="needs iproute2 and getent"),
]


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=20, check=check)


@pytest.fixture
def pod_netns():
    ns = f"cdns-getent-{os.getpid()}"
    etc = Path("/etc/netns") / ns
    proc = None
    try:
        sh("ip", "netns", "add", ns)
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "-n", ns, "addr", "add", f"{ADDR}/32", "dev", "lo")
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "resolv.conf").write_text(
            "search testapp.svc.cluster.local svc.cluster.local cluster.local\n"
            f"nameserver {ADDR}\noptions ndots:5\n")
        proc = subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, "-m", "clusterdns", "dns", "--manifest", str(DEMO),
             "--listen", f"{ADDR}:53", "--no-upstream", "--metrics-listen", "none", "--health-listen", "none"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 15
        while True:
            r = sh("ip", "netns", "exec", ns, "getent", "hosts", "kube-dns.kube-system.svc.cluster.local.",
                   check=False)
            if r.returncode == 0:
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"server did not come up in {ns}: {proc.communicate()[0]}")
            time.sleep(0.2)
        yield ns
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        sh("ip", "netns", "del", ns, check=False)
        shutil.rmtree(etc, ignore_errors=True)


@pytest.mark.parametrize("name", ["testapp-svc", "testapp-svc.testapp", "testapp-svc.testapp.svc.cluster.local."])
def test_getent_hosts_resolves_the_cluster_ip(pod_netns, name):
    r = sh("ip", "netns", "exec", pod_netns, "getent", "hosts", name, check=False)
    assert r.returncode == 0, r.stderr
    ip, canonical = r.stdout.split()[:2]
    assert ip == "172.20.36.232"
    assert canonical == "testapp-svc.testapp.svc.cluster.local"


def test_getent_unknown_name_fails_cleanly(pod_netns):
    r = sh("ip", "netns", "exec", pod_netns, "getent", "hosts", "no-such-svc", check=False)
    assert r.returncode == 2 and r.stdout == ""
