"""Real traffic through the rules `clusterdns proxy` applies, in iptables and nftables modes."""
import time

import pytest

from tests.integration.harness import (
    DNS_IP,
    EMPTY,
    EXTERNAL_IP,
    HCNP,
    LATE,
    NODE_IP,
    NODE_POD_GW,
    NP_CLUSTER,
    PODS,
    STICKY,
    WEB,
    manifest,
)
from tests.nslib import sh, write_manifest

READY = {"pod0", "pod1", "pod2"}


def assert_spread(outcome, expected, n):
    counts = {name: sum(1 for a in outcome.answers if a[0] == name) for name in outcome.names}
    assert not outcome.errors, outcome.errors
    assert set(counts) == expected, counts
    for name, c in counts.items():
        assert 0.15 * n <= c <= 0.55 * n, counts


@pytest.mark.parametrize("src", ["client", "node"])
def test_cluster_ip_reaches_every_ready_endpoint(proxy, cluster, src):
    out = cluster.connect(src, "tcp", WEB, 80, 300)
    assert_spread(out, READY, 300)
    # Pod traffic keeps its source; the node's own traffic is masqueraded.
    if src == "client":
        assert out.peers == {PODS["client"]}
    else:
        assert out.peers == {NODE_POD_GW}


def test_cluster_ip_udp(proxy, cluster):
    # A fresh source port per datagram: each one is a new flow.
    answers = []
    for sport in range(41000, 41060):
        answers += cluster.connect("client", "udp", DNS_IP, 53, 1, sport=sport).answers
    assert {a[0] for a in answers} == READY


def test_nodeport_and_external_ip_from_outside(proxy, cluster):
    for host, port in ((NODE_IP, NP_CLUSTER), (EXTERNAL_IP, 80)):
        out = cluster.connect("ext", "tcp", host, port, 150)
        assert_spread(out, READY, 150)
        assert out.peers == {NODE_POD_GW}    # external traffic with eTP Cluster: masqueraded


def test_session_affinity_pins_a_client(proxy, cluster):
    out = cluster.connect("client", "tcp", STICKY, 80, 40)
    assert not out.errors and len(out.names) == 1, out.answers
    out2 = cluster.connect("node", "tcp", STICKY, 80, 40)
    assert not out2.errors and len(out2.names) == 1


def test_service_without_endpoints_is_refused_at_once(proxy, cluster):
    tcp = cluster.connect("client", "tcp", EMPTY, 80, 3, timeout=3)
    udp = cluster.connect("client", "udp", EMPTY, 53, 3, timeout=3)
    assert tcp.verdict() == ("refused",), tcp   # rejected (RST / ICMP), not dropped: no "timeout"
    assert udp.verdict() == ("refused",), udp


def test_health_check_node_port(proxy, cluster):
    out = cluster.connect("ext", "http", NODE_IP, HCNP, 1)
    assert out.answers == [["200", ""]], out   # pod0 is the local endpoint


def _conntrack_to(cluster, ip):
    out = sh("conntrack", "-L", "-p", "udp", "--reply-src", ip, ns=cluster.node, check=False)
    return [line for line in out.splitlines() if "udp" in line]


def test_removed_endpoint_leaves_rotation_and_conntrack(proxy, cluster):
    sport = 42000
    first = cluster.connect("client", "udp", DNS_IP, 53, 1, sport=sport)
    (victim, _), = first.answers
    # The same source port keeps its conntrack entry, so it keeps the endpoint.
    again = cluster.connect("client", "udp", DNS_IP, 53, 5, sport=sport)
    assert again.names == {victim}
    assert _conntrack_to(cluster, PODS[victim])
    keep = tuple(p for p in ("pod0", "pod1", "pod2") if p != victim)
    write_manifest(proxy.path, manifest(dns_pods=keep))
    try:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            out = cluster.connect("client", "udp", DNS_IP, 53, 1, sport=sport, timeout=0.5)
            if out.answers and out.names != {victim}:
                break
            time.sleep(0.05)
        else:
            pytest.fail(f"{victim} still answers for its old flow: {proxy.logs()}")
        assert not _conntrack_to(cluster, PODS[victim])
        fresh = []
        for sp in range(43000, 43040):
            fresh += cluster.connect("client", "udp", DNS_IP, 53, 1, sport=sp).answers
        assert {a[0] for a in fresh} == set(keep)
        if proxy.mode == "nftables":   # the small change went in as a netlink batch, not nft -f
            assert "incremental transaction" in proxy.logs() and "via netlink" in proxy.logs()
            # and the first, full, sync went in as one netlink batch too
            assert any("full transaction" in line and line.endswith("via netlink")
                       for line in proxy.logs().splitlines())
    finally:
        write_manifest(proxy.path, manifest())
        time.sleep(0.6)


def test_new_service_clears_flows_created_before_its_rules(proxy, cluster):
    """UDP sent to an address before its Service had rules got a conntrack entry
    without DNAT; unless the proxier deletes it, that flow never reaches an endpoint."""
    sport = 42500
    before = cluster.connect("client", "udp", LATE, 53, 1, sport=sport, timeout=0.3)
    assert before.verdict() == ("timeout",)
    assert sh("conntrack", "-L", "-p", "udp", "--orig-dst", LATE, ns=cluster.node, check=False).strip()
    write_manifest(proxy.path, manifest(late=True))
    try:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            out = cluster.connect("client", "udp", LATE, 53, 1, sport=sport, timeout=0.3)
            if out.names == {"pod1"}:
                break
        else:
            pytest.fail(f"the old flow never reached the new endpoint: {out.verdict()}")
    finally:
        write_manifest(proxy.path, manifest())
        time.sleep(0.6)


def test_metrics_and_healthz(proxy, cluster):
    out = cluster.connect("node", "http", "127.0.0.1", 10256, 1, path="/healthz")
    assert out.answers == [["200", ""]]
    text = sh("python3", "-c", "import urllib.request;print(urllib.request.urlopen("
              "'http://127.0.0.1:10249/metrics').read().decode())", ns=cluster.node)   # kube-proxy's metrics port
    assert "kubeproxy_sync_proxy_rules_duration_seconds_count" in text
    assert "kubeproxy_sync_proxy_rules_last_timestamp_seconds" in text


@pytest.mark.parametrize("src", ["client", "node"])
def test_dual_stack_service_over_ipv6(proxy, cluster, src):
    """The node has an IPv6 --node-ip too: the proxier programs the IPv6 family as well."""
    from tests.integration.harness import NODE_POD_GW6, PODS6, WEB_DS, WEB_DS6
    out6 = cluster.connect(src, "tcp", WEB_DS6, 80, 150)
    assert_spread(out6, READY, 150)
    assert out6.peers == ({PODS6["client"]} if src == "client" else {NODE_POD_GW6})
    out4 = cluster.connect(src, "tcp", WEB_DS, 80, 60)
    assert out4.names == READY and not out4.errors


def test_cleanup_restores_the_tables(proxy, cluster):
    """Stop, clean up, compare with the tables before the proxy; then start it again, so the
    module's other tests find it running whatever order they run in."""
    proxy.stop()
    try:
        assert proxy.proc.returncode == 0, proxy.logs()   # SIGTERM is a clean exit
        res = proxy.cleanup()
        assert res.returncode == 0, res.stderr
        assert cluster.save_rules() == proxy.rules_before
    finally:
        proxy.start()
