"""Packet flows decided by the real kernel, in the style of kube-proxy's packet-flow tests.

Each row: a first packet (source namespace and address, protocol, destination
ip:port) and what the rules must do with it: the set of endpoints it can
reach and whether the backend sees it masqueraded, or refused / dropped.
Thirty connections per row make missing one of three endpoints by chance
about a 1-in-60,000 event.
"""
import pytest

from tests.integration.harness import (
    DNS_IP,
    DRAINING,
    EMPTY,
    EXT_IPS,
    EXTERNAL_IP,
    HAIRPIN,
    ITP_LOCAL,
    ITP_NONE_LOCAL,
    LB_IP,
    LOCAL_SVC,
    NODE_IP,
    NP_CLUSTER,
    NP_LOCAL,
    PART_DRAINING,
    WEB,
)

ALL = frozenset({"pod0", "pod1", "pod2"})
LOCAL = frozenset({"pod0"})          # web-local's only endpoint on node-a
REFUSED, DROPPED = ("refused",), ("timeout",)


def ok(endpoints, masq):
    return ("ok", endpoints, masq)


# name, source namespace, bind address, protocol, destination, port, expected (None: mode-specific)
FLOWS = [
    ("ClusterIP from pod", "client", "", "tcp", WEB, 80, ok(ALL, False)),
    ("ClusterIP from node", "node", "", "tcp", WEB, 80, ok(ALL, True)),
    ("ClusterIP UDP from pod", "client", "", "udp", DNS_IP, 53, ok(ALL, False)),
    ("ClusterIP from external", "ext", "", "tcp", WEB, 80, ok(ALL, True)),
    ("hairpin: endpoint to its own service", "pod0", "", "tcp", HAIRPIN, 80, ok(LOCAL, True)),
    ("NodePort eTP Cluster from external", "ext", "", "tcp", NODE_IP, NP_CLUSTER, ok(ALL, True)),
    ("NodePort eTP Cluster from pod", "client", "", "tcp", NODE_IP, NP_CLUSTER, ok(ALL, True)),
    ("NodePort eTP Cluster from node", "node", "", "tcp", NODE_IP, NP_CLUSTER, ok(ALL, True)),
    ("NodePort on localhost from node", "node", "", "tcp", "127.0.0.1", NP_CLUSTER, None),
    ("externalIP eTP Cluster from external", "ext", "", "tcp", EXTERNAL_IP, 80, ok(ALL, True)),
    ("NodePort eTP Local from external", "ext", "", "tcp", NODE_IP, NP_LOCAL, ok(LOCAL, False)),
    ("NodePort eTP Local ignores source ranges", "ext", EXT_IPS[1], "tcp", NODE_IP, NP_LOCAL, ok(LOCAL, False)),
    ("NodePort eTP Local from pod: short-circuit", "client", "", "tcp", NODE_IP, NP_LOCAL, ok(ALL, False)),
    ("NodePort eTP Local from node: short-circuit, masqueraded", "node", "", "tcp", NODE_IP, NP_LOCAL,
     ok(ALL, True)),
    ("ClusterIP of eTP Local service from pod", "client", "", "tcp", LOCAL_SVC, 80, ok(ALL, False)),
    ("LB IP from allowed source range", "ext", EXT_IPS[0], "tcp", LB_IP, 80, ok(LOCAL, False)),
    ("LB IP from outside the source ranges", "ext", EXT_IPS[1], "tcp", LB_IP, 80, DROPPED),
    ("iTP Local: only the local endpoint", "client", "", "tcp", ITP_LOCAL, 80, ok(LOCAL, False)),
    ("iTP Local from node", "node", "", "tcp", ITP_LOCAL, 80, ok(LOCAL, True)),
    ("iTP Local without a local endpoint: dropped", "client", "", "tcp", ITP_NONE_LOCAL, 80, DROPPED),
    ("only serving-terminating endpoints: used as a fallback", "client", "", "tcp", DRAINING, 80,
     ok(frozenset({"pod1", "pod2"}), False)),
    ("ready endpoints exist: terminating one unused", "client", "", "tcp", PART_DRAINING, 80,
     ok(frozenset({"pod0", "pod1"}), False)),
    ("no endpoints, TCP", "client", "", "tcp", EMPTY, 80, REFUSED),
    ("no endpoints, UDP", "client", "", "udp", EMPTY, 53, REFUSED),
    ("no endpoints, from external", "ext", "", "tcp", EMPTY, 80, REFUSED),
    ("ClusterIP on a port the service lacks", "client", "", "tcp", WEB, 81, None),
]

# Where the modes differ on purpose (kube-proxy's own differences).
MODE_SPECIFIC = {
    # iptables accepts NodePorts on 127.0.0.1 (route_localnet); nftables never does.
    ("NodePort on localhost from node", "iptables"): ok(ALL, True),
    ("NodePort on localhost from node", "nftables"): REFUSED,
    # iptables leaves other ports of a ClusterIP alone (nothing listens: the node
    # routes the packet out and nobody answers); nftables rejects them.
    ("ClusterIP on a port the service lacks", "iptables"): DROPPED,
    ("ClusterIP on a port the service lacks", "nftables"): REFUSED,
}


@pytest.mark.parametrize("name,src,bind,proto,dst,port,expected", FLOWS, ids=[f[0] for f in FLOWS])
def test_flow(proxy, cluster, name, src, bind, proto, dst, port, expected):
    if expected is None:
        expected = MODE_SPECIFIC[(name, proxy.mode)]
    count = 30 if expected[0] == "ok" else 2
    timeout = 1.0 if expected[0] == "ok" else 0.6
    if proto == "udp":
        # one flow per datagram, so every datagram is balanced anew
        out = None
        for i in range(count):
            o = cluster.connect(src, proto, dst, port, 1, bind=bind, sport=44000 + i, timeout=timeout)
            if out is None:
                out = o
            else:
                out.answers += o.answers
                for k, v in o.errors.items():
                    out.errors[k] = out.errors.get(k, 0) + v
                out.local = out.local or o.local
    else:
        out = cluster.connect(src, proto, dst, port, count, bind=bind, timeout=timeout)
    assert out.verdict() == expected, f"{name}: {out.verdict()}"
