"""The C library's resolver against the server, in a network namespace.

`ip netns exec NS` bind-mounts /etc/netns/NS/resolv.conf over /etc/resolv.conf,
so getent uses a pod's resolver configuration (search list, ndots:5) and the
real glibc stub walks the search list against our server.
"""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.nslib import PY, requires, run, wait_until

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "clusterdns" / "demo" / "cluster.yaml"
ADDR = "10.53.0.10"

pytestmark = [pytest.mark.root, requires("getent")]


@pytest.fixture
def pod_netns(namespaces):
    ns = namespaces.add("pod")
    run("ip", "addr", "add", f"{ADDR}/32", "dev", "lo", ns=ns).check_returncode()
    namespaces.resolv_conf(ns, "search testapp.svc.cluster.local svc.cluster.local cluster.local\n"
                               f"nameserver {ADDR}\noptions ndots:5\n")
    proc = namespaces.spawn(
        ns, PY, "-m", "clusterdns", "dns", "--manifest", str(DEMO), "--listen", f"{ADDR}:53", "--no-upstream",
        "--metrics-listen", "none", "--health-listen", "none",
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def up() -> bool:
        if proc.poll() is not None:
            pytest.fail(f"server exited in {ns}: {proc.communicate()[0]}")
        return run("getent", "hosts", "kube-dns.kube-system.svc.cluster.local.", ns=ns).returncode == 0
    wait_until(up, 15, f"the server in {ns}", interval=0.2)
    return ns


@pytest.mark.parametrize("name", ["testapp-svc", "testapp-svc.testapp", "testapp-svc.testapp.svc.cluster.local."])
def test_getent_hosts_resolves_the_cluster_ip(pod_netns, name):
    r = run("getent", "hosts", name, ns=pod_netns)
    assert r.returncode == 0, r.stderr
    ip, canonical = r.stdout.split()[:2]
    assert ip == "172.20.36.232"
    assert canonical == "testapp-svc.testapp.svc.cluster.local"


def test_getent_unknown_name_fails_cleanly(pod_netns):
    r = run("getent", "hosts", "no-such-svc", ns=pod_netns)
    assert r.returncode == 2 and r.stdout == ""
