"""The namespace test library itself: clean-up always runs, routed pods reach each other
through the node, backends answer with their name and the peer they saw."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.nslib import (
    POD_RESOLV,
    Namespaces,
    connect,
    missing,
    nft,
    nft_table,
    requires,
    run,
    wait_until,
    write_manifest,
)

pytestmark = requires()


def _exists(ns: str) -> bool:
    return ns in run("ip", "netns", "list").stdout.split()


def test_clean_up_runs_when_the_body_fails():
    with pytest.raises(RuntimeError, match="boom"):
        with Namespaces("nslib-fail") as nss:
            a = nss.add("a")
            nss.resolv_conf(a, POD_RESOLV)
            proc = nss.spawn(a, "sleep", "60")
            assert _exists(a) and str(os.getpid()) in a
            raise RuntimeError("boom")
    assert not _exists(a)
    assert not Path(f"/etc/netns/{a}").exists()
    assert proc.poll() is not None


def test_routed_pods_and_named_backends(namespaces):
    node, pod, client = namespaces.add("node"), namespaces.add("pod"), namespaces.add("client")
    namespaces.sysctl(node, net__ipv4__ip_forward="1")
    for dev, ns, ip in (("v0", pod, "10.99.1.10"), ("v1", client, "10.99.1.20")):
        namespaces.veth(node, dev, ns, "eth0")
        namespaces.routed_pod(node, dev, ns, ip, gw="10.99.0.1")
    namespaces.backend(pod, "pod0", 8080)
    out = {}

    def answered() -> bool:
        out.update(connect(client, "tcp", "10.99.1.10", 8080, 1, timeout=0.5))
        return bool(out["answers"])
    wait_until(answered, 10, "the backend in the pod")
    assert out["answers"] == [["pod0", "10.99.1.20"]]      # its name, and the client's own address
    udp = connect(client, "udp", "10.99.1.10", 8080, 2)
    assert udp["answers"] == [["pod0", "10.99.1.20"]] * 2 and not udp["errors"]


def test_resolv_conf_is_the_namespace_s_own(namespaces):
    ns = namespaces.add("r")
    namespaces.resolv_conf(ns, "nameserver 192.0.2.53\n")
    assert run("cat", "/etc/resolv.conf", ns=ns).stdout == "nameserver 192.0.2.53\n"


def test_missing_names_the_absent_tool_and_manifest_is_atomic(tmp_path):
    assert missing("no-such-tool-here", root=False) == "needs no-such-tool-here (not installed)"
    path = tmp_path / "m.json"
    write_manifest(path, [{"kind": "Namespace"}])
    assert path.read_text() == '{"apiVersion": "v1", "kind": "List", "items": [{"kind": "Namespace"}]}'
    assert not (tmp_path / "m.json.tmp").exists()


@requires("nft")
def test_nft_loads_checks_and_lists():
    script = "table ip kube-proxy {\n\tchain probe {\n\t\tcounter\n\t}\n}\n"
    with Namespaces("nslib-nft") as nss:
        a = nss.add("a")
        assert nft(a, script, check=True).returncode == 0
        assert "kube-proxy" not in run("nft", "list", "tables", ns=a).stdout     # -c changes nothing
        nft(a, script, strict=True)
        assert "chain probe" in nft_table(a) and nft_table(a, "ip") == nft_table(a, 4)
        assert nft(a, "add rule ip kube-proxy nosuch counter\n").returncode != 0
        with pytest.raises(AssertionError, match="nosuch"):
            nft(a, "add rule ip kube-proxy nosuch counter\n", strict=True)
