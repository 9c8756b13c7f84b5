"""iptables-restore text: kube-proxy's own expected output, golden files, features, real tools."""
from __future__ import annotations

import os
import subprocess
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest

from clusterdns.config import Config
from clusterdns.model import (
    LOAD_BALANCER,
    NODE_PORT,
    Endpoint,
    EndpointPort,
    EndpointSlice,
    Node,
    Service,
    ServicePort,
)
from clusterdns.proxy import iptables, iptsave
from clusterdns.sources.manifest import DEMO_MANIFEST
from clusterdns.state import state_from_records
from clusterdns.synthetic import synthetic_records
from tests.demo import DEMO_CFG, demo_state
from tests.nslib import requires

GOLDEN = Path(__file__).parent / "golden"
UPDATE = bool(os.environ.get("UPDATE_GOLDEN"))


# ---------------------------------------------------------------- helpers

def parse(text: str) -> dict[str, tuple[set[str], dict[str, list[str]]]]:
    """Restore text -> table -> (declared chains, chain -> rules in order); -I/-X kept per chain."""
    out: dict[str, tuple[set[str], dict[str, list[str]]]] = {}
    table = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#") or line == "COMMIT":
            continue
        if line.startswith("*"):
            table = line[1:]
            out.setdefault(table, (set(), {}))
        elif line.startswith(":"):
            out[table][0].add(line[1:].split()[0])
        else:
            parts = line.split(None, 2)
            out[table][1].setdefault(parts[1], []).append(line)
    return out


def assert_rules_equal(expected: str, got: str) -> None:
    """kube-proxy's normalising comparison: chain order free, rule order inside a chain kept."""
    e, g = parse(expected), parse(got)
    assert sorted(e) == sorted(g)
    for table in e:
        assert sorted(e[table][0]) == sorted(g[table][0]), table
        assert e[table][1] == g[table][1], table


def svc(ns, name, ip, *ports, **kw):
    return ("Service", Service(ns, name, kw.pop("type", "ClusterIP"), (ip,), ports=tuple(ports), **kw))


def eps(ns, name, *endpoints, port=80, pname="p80", proto="TCP", family="IPv4", slice_name=None):
    return ("EndpointSlice", EndpointSlice(ns, slice_name or name + "-abc", name, family, tuple(endpoints),
                                           (EndpointPort(pname, proto, port),)))


P80 = ServicePort("p80", "TCP", 80)


def kube_proxy_state():
    """The cluster of kube-proxy's TestOverallIPTablesRules."""
    return state_from_records([
        svc("ns1", "svc1", "172.30.0.41", P80),
        eps("ns1", "svc1", Endpoint(("10.180.0.1",))),
        svc("ns2", "svc2", "172.30.0.42", replace(P80, node_port=3001), type=LOAD_BALANCER,
            external_ips=("192.168.99.22",), lb_ips=("1.2.3.4",), external_local=True,
            health_check_node_port=30000),
        eps("ns2", "svc2", Endpoint(("10.180.0.2",), node_name="node2")),
        svc("ns3", "svc3", "172.30.0.43", replace(P80, node_port=3003), type=NODE_PORT),
        eps("ns3", "svc3", Endpoint(("10.180.0.3",), node_name="node2")),
        svc("ns4", "svc4", "172.30.0.44", P80, external_ips=("192.168.99.33",)),
        eps("ns4", "svc4", Endpoint(("10.180.0.4",)), Endpoint(("10.180.0.5",), node_name="node2")),
        svc("ns5", "svc5", "172.30.0.45", replace(P80, node_port=3002), type=LOAD_BALANCER,
            lb_ips=("5.6.7.8",), lb_source_ranges=("203.0.113.0/25",)),
        eps("ns5", "svc5", Endpoint(("10.180.0.3",), node_name="node2")),
        svc("ns6", "svc6", "172.30.0.46", P80),
    ])


KUBE_PROXY_CFG = Config.from_options(command="rules", node_name="test-node", node_ips=("192.168.0.2",),
                        cluster_cidrs=("10.0.0.0/8",))

# kube-proxy's expected output for that cluster (pkg/proxy/iptables), with two
# environment differences applied: our iptables supports --random-fully, and
# no nfacct counter rules are written (docs/proxy.md).
KUBE_PROXY_EXPECTED = textwrap.dedent("""\
    *mangle
    :KUBE-PROXY-CANARY - [0:0]
    COMMIT
    *filter
    :KUBE-PROXY-CANARY - [0:0]
    :KUBE-EXTERNAL-SERVICES - [0:0]
    :KUBE-FIREWALL - [0:0]
    :KUBE-FORWARD - [0:0]
    :KUBE-NODEPORTS - [0:0]
    :KUBE-SERVICES - [0:0]
    :KUBE-PROXY-FIREWALL - [0:0]
    -I INPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes externally-visible service portals" -j KUBE-EXTERNAL-SERVICES
    -I FORWARD -m conntrack --ctstate NEW -m comment --comment "kubernetes externally-visible service portals" -j KUBE-EXTERNAL-SERVICES
    -I INPUT -m comment --comment "kubernetes health check service ports" -j KUBE-NODEPORTS
    -I FORWARD -m conntrack --ctstate NEW -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
    -I OUTPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
    -I FORWARD -m comment --comment "kubernetes forwarding rules" -j KUBE-FORWARD
    -I INPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes load balancer firewall" -j KUBE-PROXY-FIREWALL
    -I OUTPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes load balancer firewall" -j KUBE-PROXY-FIREWALL
    -I FORWARD -m conntrack --ctstate NEW -m comment --comment "kubernetes load balancer firewall" -j KUBE-PROXY-FIREWALL
    -I INPUT -j KUBE-FIREWALL
    -I OUTPUT -j KUBE-FIREWALL
    -A KUBE-NODEPORTS -m comment --comment "ns2/svc2:p80 health check node port" -m tcp -p tcp --dport 30000 -j ACCEPT
    -A KUBE-SERVICES -m comment --comment "ns6/svc6:p80 has no endpoints" -m tcp -p tcp -d 172.30.0.46 --dport 80 -j REJECT
    -A KUBE-EXTERNAL-SERVICES -m comment --comment "ns2/svc2:p80 has no local endpoints" -m tcp -p tcp -d 192.168.99.22 --dport 80 -j DROP
    -A KUBE-EXTERNAL-SERVICES -m comment --comment "ns2/svc2:p80 has no local endpoints" -m tcp -p tcp -d 1.2.3.4 --dport 80 -j DROP
    -A KUBE-EXTERNAL-SERVICES -m comment --comment "ns2/svc2:p80 has no local endpoints" -m addrtype --dst-type LOCAL -m tcp -p tcp --dport 3001 -j DROP
    -A KUBE-FIREWALL -m comment --comment "block incoming localnet connections" -d 127.0.0.0/8 ! -s 127.0.0.0/8 -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP
    -A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP
    -A KUBE-FORWARD -m comment --comment "kubernetes forwarding rules" -m mark --mark 0x4000/0x4000 -j ACCEPT
    -A KUBE-FORWARD -m comment --comment "kubernetes forwarding conntrack rule" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT
    -A KUBE-PROXY-FIREWALL -m comment --comment "ns5/svc5:p80 traffic not accepted by KUBE-FW-NUKIZ6OKUXPJNT4C" -m tcp -p tcp -d 5.6.7.8 --dport 80 -j DROP
    COMMIT
    *nat
    :KUBE-PROXY-CANARY - [0:0]
    :KUBE-EXT-4SW47YFZTEDKD3PK - [0:0]
    :KUBE-EXT-GNZBNJ2PO5MGZ6GT - [0:0]
    :KUBE-EXT-NUKIZ6OKUXPJNT4C - [0:0]
    :KUBE-EXT-X27LE4BHSL4DOUIK - [0:0]
    :KUBE-FW-NUKIZ6OKUXPJNT4C - [0:0]
    :KUBE-MARK-MASQ - [0:0]
    :KUBE-NODEPORTS - [0:0]
    :KUBE-POSTROUTING - [0:0]
    :KUBE-SEP-C6EBXVWJJZMIWKLZ - [0:0]
    :KUBE-SEP-I77PXRDZVX7PMWMN - [0:0]
    :KUBE-SEP-OYPFS5VJICHGATKP - [0:0]
    :KUBE-SEP-RS4RBKLTHTF2IUXJ - [0:0]
    :KUBE-SEP-SXIVWICOYRO3J4NJ - [0:0]
    :KUBE-SEP-UKSFD7AGPMPPLUHC - [0:0]
    :KUBE-SERVICES - [0:0]
    :KUBE-SVC-4SW47YFZTEDKD3PK - [0:0]
    :KUBE-SVC-GNZBNJ2PO5MGZ6GT - [0:0]
    :KUBE-SVC-NUKIZ6OKUXPJNT4C - [0:0]
    :KUBE-SVC-X27LE4BHSL4DOUIK - [0:0]
    :KUBE-SVC-XPGD46QRK7WJZT7O - [0:0]
    -I OUTPUT -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
    -I PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
    -I POSTROUTING -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING
    -A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN
    -A KUBE-POSTROUTING -j MARK --xor-mark 0x4000
    -A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring SNAT" -j MASQUERADE --random-fully
    -A KUBE-MARK-MASQ -j MARK --or-mark 0x4000
    -A KUBE-NODEPORTS -m comment --comment ns2/svc2:p80 -m tcp -p tcp --dport 3001 -j KUBE-EXT-GNZBNJ2PO5MGZ6GT
    -A KUBE-NODEPORTS -m comment --comment ns3/svc3:p80 -m tcp -p tcp --dport 3003 -j KUBE-EXT-X27LE4BHSL4DOUIK
    -A KUBE-NODEPORTS -m comment --comment ns5/svc5:p80 -m tcp -p tcp --dport 3002 -j KUBE-EXT-NUKIZ6OKUXPJNT4C
    -A KUBE-SERVICES -m comment --comment "ns1/svc1:p80 cluster IP" -m tcp -p tcp -d 172.30.0.41 --dport 80 -j KUBE-SVC-XPGD46QRK7WJZT7O
    -A KUBE-SERVICES -m comment --comment "ns2/svc2:p80 cluster IP" -m tcp -p tcp -d 172.30.0.42 --dport 80 -j KUBE-SVC-GNZBNJ2PO5MGZ6GT
    -A KUBE-SERVICES -m comment --comment "ns2/svc2:p80 external IP" -m tcp -p tcp -d 192.168.99.22 --dport 80 -j KUBE-EXT-GNZBNJ2PO5MGZ6GT
    -A KUBE-SERVICES -m comment --comment "ns2/svc2:p80 loadbalancer IP" -m tcp -p tcp -d 1.2.3.4 --dport 80 -j KUBE-EXT-GNZBNJ2PO5MGZ6GT
    -A KUBE-SERVICES -m comment --comment "ns3/svc3:p80 cluster IP" -m tcp -p tcp -d 172.30.0.43 --dport 80 -j KUBE-SVC-X27LE4BHSL4DOUIK
    -A KUBE-SERVICES -m comment --comment "ns4/svc4:p80 cluster IP" -m tcp -p tcp -d 172.30.0.44 --dport 80 -j KUBE-SVC-4SW47YFZTEDKD3PK
    -A KUBE-SERVICES -m comment --comment "ns4/svc4:p80 external IP" -m tcp -p tcp -d 192.168.99.33 --dport 80 -j KUBE-EXT-4SW47YFZTEDKD3PK
    -A KUBE-SERVICES -m comment --comment "ns5/svc5:p80 cluster IP" -m tcp -p tcp -d 172.30.0.45 --dport 80 -j KUBE-SVC-NUKIZ6OKUXPJNT4C
    -A KUBE-SERVICES -m comment --comment "ns5/svc5:p80 loadbalancer IP" -m tcp -p tcp -d 5.6.7.8 --dport 80 -j KUBE-FW-NUKIZ6OKUXPJNT4C
    -A KUBE-SERVICES -m comment --comment "kubernetes service nodeports; NOTE: this must be the last rule in this chain" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS
    -A KUBE-EXT-4SW47YFZTEDKD3PK -m comment --comment "masquerade traffic for ns4/svc4:p80 external destinations" -j KUBE-MARK-MASQ
    -A KUBE-EXT-4SW47YFZTEDKD3PK -j KUBE-SVC-4SW47YFZTEDKD3PK
    -A KUBE-EXT-GNZBNJ2PO5MGZ6GT -m comment --comment "pod traffic for ns2/svc2:p80 external destinations" -s 10.0.0.0/8 -j KUBE-SVC-GNZBNJ2PO5MGZ6GT
    -A KUBE-EXT-GNZBNJ2PO5MGZ6GT -m comment --comment "masquerade LOCAL traffic for ns2/svc2:p80 external destinations" -m addrtype --src-type LOCAL -j KUBE-MARK-MASQ
    -A KUBE-EXT-GNZBNJ2PO5MGZ6GT -m comment --comment "route LOCAL traffic for ns2/svc2:p80 external destinations" -m addrtype --src-type LOCAL -j KUBE-SVC-GNZBNJ2PO5MGZ6GT
    -A KUBE-EXT-NUKIZ6OKUXPJNT4C -m comment --comment "masquerade traffic for ns5/svc5:p80 external destinations" -j KUBE-MARK-MASQ
    -A KUBE-EXT-NUKIZ6OKUXPJNT4C -j KUBE-SVC-NUKIZ6OKUXPJNT4C
    -A KUBE-EXT-X27LE4BHSL4DOUIK -m comment --comment "masquerade traffic for ns3/svc3:p80 external destinations" -j KUBE-MARK-MASQ
    -A KUBE-EXT-X27LE4BHSL4DOUIK -j KUBE-SVC-X27LE4BHSL4DOUIK
    -A KUBE-FW-NUKIZ6OKUXPJNT4C -m comment --comment "ns5/svc5:p80 loadbalancer IP" -s 203.0.113.0/25 -j KUBE-EXT-NUKIZ6OKUXPJNT4C
    -A KUBE-FW-NUKIZ6OKUXPJNT4C -m comment --comment "other traffic to ns5/svc5:p80 will be dropped by KUBE-PROXY-FIREWALL"
    -A KUBE-SEP-C6EBXVWJJZMIWKLZ -m comment --comment ns4/svc4:p80 -s 10.180.0.5 -j KUBE-MARK-MASQ
    -A KUBE-SEP-C6EBXVWJJZMIWKLZ -m comment --comment ns4/svc4:p80 -m tcp -p tcp -j DNAT --to-destination 10.180.0.5:80
    -A KUBE-SEP-I77PXRDZVX7PMWMN -m comment --comment ns5/svc5:p80 -s 10.180.0.3 -j KUBE-MARK-MASQ
    -A KUBE-SEP-I77PXRDZVX7PMWMN -m comment --comment ns5/svc5:p80 -m tcp -p tcp -j DNAT --to-destination 10.180.0.3:80
    -A KUBE-SEP-OYPFS5VJICHGATKP -m comment --comment ns3/svc3:p80 -s 10.180.0.3 -j KUBE-MARK-MASQ
    -A KUBE-SEP-OYPFS5VJICHGATKP -m comment --comment ns3/svc3:p80 -m tcp -p tcp -j DNAT --to-destination 10.180.0.3:80
    -A KUBE-SEP-RS4RBKLTHTF2IUXJ -m comment --comment ns2/svc2:p80 -s 10.180.0.2 -j KUBE-MARK-MASQ
    -A KUBE-SEP-RS4RBKLTHTF2IUXJ -m comment --comment ns2/svc2:p80 -m tcp -p tcp -j DNAT --to-destination 10.180.0.2:80
    -A KUBE-SEP-SXIVWICOYRO3J4NJ -m comment --comment ns1/svc1:p80 -s 10.180.0.1 -j KUBE-MARK-MASQ
    -A KUBE-SEP-SXIVWICOYRO3J4NJ -m comment --comment ns1/svc1:p80 -m tcp -p tcp -j DNAT --to-destination 10.180.0.1:80
    -A KUBE-SEP-UKSFD7AGPMPPLUHC -m comment --comment ns4/svc4:p80 -s 10.180.0.4 -j KUBE-MARK-MASQ
    -A KUBE-SEP-UKSFD7AGPMPPLUHC -m comment --comment ns4/svc4:p80 -m tcp -p tcp -j DNAT --to-destination 10.180.0.4:80
    -A KUBE-SVC-4SW47YFZTEDKD3PK -m comment --comment "ns4/svc4:p80 cluster IP" -m tcp -p tcp -d 172.30.0.44 --dport 80 ! -s 10.0.0.0/8 -j KUBE-MARK-MASQ
    -A KUBE-SVC-4SW47YFZTEDKD3PK -m comment --comment "ns4/svc4:p80 -> 10.180.0.4:80" -m statistic --mode random --probability 0.5000000000 -j KUBE-SEP-UKSFD7AGPMPPLUHC
    -A KUBE-SVC-4SW47YFZTEDKD3PK -m comment --comment "ns4/svc4:p80 -> 10.180.0.5:80" -j KUBE-SEP-C6EBXVWJJZMIWKLZ
    -A KUBE-SVC-GNZBNJ2PO5MGZ6GT -m comment --comment "ns2/svc2:p80 cluster IP" -m tcp -p tcp -d 172.30.0.42 --dport 80 ! -s 10.0.0.0/8 -j KUBE-MARK-MASQ
    -A KUBE-SVC-GNZBNJ2PO5MGZ6GT -m comment --comment "ns2/svc2:p80 -> 10.180.0.2:80" -j KUBE-SEP-RS4RBKLTHTF2IUXJ
    -A KUBE-SVC-NUKIZ6OKUXPJNT4C -m comment --comment "ns5/svc5:p80 cluster IP" -m tcp -p tcp -d 172.30.0.45 --dport 80 ! -s 10.0.0.0/8 -j KUBE-MARK-MASQ
    -A KUBE-SVC-NUKIZ6OKUXPJNT4C -m comment --comment "ns5/svc5:p80 -> 10.180.0.3:80" -j KUBE-SEP-I77PXRDZVX7PMWMN
    -A KUBE-SVC-X27LE4BHSL4DOUIK -m comment --comment "ns3/svc3:p80 cluster IP" -m tcp -p tcp -d 172.30.0.43 --dport 80 ! -s 10.0.0.0/8 -j KUBE-MARK-MASQ
    -A KUBE-SVC-X27LE4BHSL4DOUIK -m comment --comment "ns3/svc3:p80 -> 10.180.0.3:80" -j KUBE-SEP-OYPFS5VJICHGATKP
    -A KUBE-SVC-XPGD46QRK7WJZT7O -m comment --comment "ns1/svc1:p80 cluster IP" -m tcp -p tcp -d 172.30.0.41 --dport 80 ! -s 10.0.0.0/8 -j KUBE-MARK-MASQ
    -A KUBE-SVC-XPGD46QRK7WJZT7O -m comment --comment "ns1/svc1:p80 -> 10.180.0.1:80" -j KUBE-SEP-SXIVWICOYRO3J4NJ
    COMMIT
    """)


needs_netns = requires("iptables-restore")


def restore(ns: str, text: str, family: int = 4, test: bool = False) -> subprocess.CompletedProcess:
    tool = "ip6tables-restore" if family == 6 else "iptables-restore"
    argv = ["ip", "netns", "exec", ns, tool, "--noflush"] + (["--test"] if test else [])
    return subprocess.run(argv, input=text, capture_output=True, text=True)


def save(ns: str, family: int = 4) -> str:
    tool = "ip6tables-save" if family == 6 else "iptables-save"
    out = subprocess.run(["ip", "netns", "exec", ns, tool], capture_output=True, text=True, check=True).stdout
    return "\n".join(line for line in out.splitlines() if not line.startswith("#")) + "\n"


# ---------------------------------------------------------------- kube-proxy's expectations

def test_matches_kube_proxy_overall_rules():
    got = iptables.render(kube_proxy_state(), KUBE_PROXY_CFG, 4)
    assert_rules_equal(KUBE_PROXY_EXPECTED, got.text)


def test_probability_has_ten_decimals():
    assert iptables.probability(74) == "0.0135135135"
    assert iptables.probability(2) == "0.5000000000"
    assert iptables.probability(3) == "0.3333333333"
    assert iptables.probability(100001) == "0.0000099999"


def test_demo_testapp_svc_probabilities():
    text = iptables.render(demo_state(), DEMO_CFG, 4).text
    rules = parse(text)["nat"][1]["KUBE-SVC-" + _hash("testapp/testapp-svc", "tcp")]
    lb = [r for r in rules if "KUBE-MARK-MASQ" not in r]
    assert len(lb) == 74
    assert "--probability 0.0135135135 " in lb[0]
    assert '"testapp/testapp-svc -> 10.161.33.100:8080"' in lb[0]
    assert "--probability 0.5000000000 " in lb[72]
    assert "statistic" not in lb[73]
    # endpoints ordered by their "IP:port" string
    order = [r.split(" -> ")[1].split('"')[0] for r in lb]
    assert order == sorted(order)


def _hash(name: str, proto: str) -> str:
    from clusterdns.proxy import names
    return names.port_proto_hash(name, proto)


# ---------------------------------------------------------------- golden: the demo cluster

@pytest.mark.parametrize("family", [4, 6])
def test_demo_golden(family):
    got = iptables.render(demo_state(), DEMO_CFG, family).text
    path = GOLDEN / f"demo-iptables-v{family}.txt"
    if UPDATE:
        path.write_text(got)
    assert_rules_equal(path.read_text(), got)


def test_demo_v6_has_only_ipv6():
    text = iptables.render(demo_state(), DEMO_CFG, 6).text
    assert "172.20." not in text and "10.161." not in text
    assert "-d fd00:20::5 --dport 80" in text
    assert "--to-destination [fd00:161::2]:8080" in text
    assert "! -s fd00:161::/64" in text
    assert "-m addrtype --dst-type LOCAL ! -d ::1/128 -j KUBE-NODEPORTS" in text
    assert "KUBE-FIREWALL" not in text   # no localhost NodePorts on IPv6


# ---------------------------------------------------------------- features on small states

def one_service(*, service_kw=None, endpoints=None, port=P80, slices=None):
    records = [svc("ns1", "svc1", "172.30.0.41", port, **(service_kw or {}))]
    if slices is not None:
        records += slices
    else:
        records.append(eps("ns1", "svc1", *(endpoints or [Endpoint(("10.180.0.1",))])))
    records.append(("Node", Node("node-a", ("192.168.0.2",), (("topology.kubernetes.io/zone", "zone-a"),))))
    return state_from_records(records)


CFG = Config.from_options(command="rules", node_name="node-a", node_ips=("192.168.0.2",), cluster_cidrs=("10.0.0.0/8",))


def nat(text, chain):
    return parse(text)["nat"][1].get(chain, [])


def filt(text, chain):
    return parse(text)["filter"][1].get(chain, [])


SVC = "KUBE-SVC-XPGD46QRK7WJZT7O"
SVL = "KUBE-SVL-XPGD46QRK7WJZT7O"
EXT = "KUBE-EXT-XPGD46QRK7WJZT7O"


def test_masquerade_all_and_no_detector():
    text = iptables.render(one_service(), CFG.with_options(masquerade_all=True), 4).text
    assert nat(text, SVC)[0] == ('-A KUBE-SVC-XPGD46QRK7WJZT7O -m comment --comment "ns1/svc1:p80 cluster IP" '
                                 "-m tcp -p tcp -d 172.30.0.41 --dport 80 -j KUBE-MARK-MASQ")
    text = iptables.render(one_service(), CFG.with_options(cluster_cidrs=()), 4).text
    assert not any("KUBE-MARK-MASQ" in r for r in nat(text, SVC))


def test_masquerade_bit():
    text = iptables.render(one_service(), CFG.with_options(masquerade_bit=5), 4).text
    assert "-A KUBE-MARK-MASQ -j MARK --or-mark 0x20" in text
    assert "-m mark ! --mark 0x20/0x20 -j RETURN" in text


def test_nodeport_addresses_and_localhost():
    st = one_service(service_kw={"type": NODE_PORT}, port=replace(P80, node_port=30001))
    cfg = CFG.with_options(node_ips=("192.168.0.2", "10.1.1.1"), nodeport_addresses=("192.168.0.0/24", "127.0.0.0/8"))
    text = iptables.render(st, cfg, 4).text
    last = [r for r in nat(text, "KUBE-SERVICES") if "nodeports" in r]
    assert [r.split(" -d ")[1] for r in last] == ["192.168.0.2 -j KUBE-NODEPORTS", "127.0.0.1 -j KUBE-NODEPORTS"]
    assert "KUBE-FIREWALL" in text
    text = iptables.render(st, cfg.with_options(localhost_nodeports=False), 4).text
    last = [r for r in nat(text, "KUBE-SERVICES") if "nodeports" in r]
    assert len(last) == 1 and "-d 192.168.0.2 " in last[0]
    assert "KUBE-FIREWALL" not in text
    text = iptables.render(st, CFG.with_options(localhost_nodeports=False), 4).text
    assert "-m addrtype --dst-type LOCAL ! -d 127.0.0.0/8 -j KUBE-NODEPORTS" in text
    # nodeport addresses that exclude loopback also turn localhost NodePorts off
    text = iptables.render(st, CFG.with_options(nodeport_addresses=("192.168.0.0/24",)), 4).text
    assert "KUBE-FIREWALL" not in text


def test_internal_local_without_local_endpoints_drops_in_filter():
    st = one_service(service_kw={"internal_local": True},
                     endpoints=[Endpoint(("10.180.0.1",), node_name="node-b")])
    text = iptables.render(st, CFG, 4).text
    assert filt(text, "KUBE-SERVICES") == [
        '-A KUBE-SERVICES -m comment --comment "ns1/svc1:p80 has no local endpoints" -m tcp -p tcp '
        "-d 172.30.0.41 --dport 80 -j DROP"]
    assert SVL not in text and SVC not in text
    assert not any("DROP" in r for t in ("nat",) for rules in parse(text)[t][1].values() for r in rules)


def test_internal_local_with_local_endpoint():
    st = one_service(service_kw={"internal_local": True},
                     endpoints=[Endpoint(("10.180.0.1",), node_name="node-a"),
                                Endpoint(("10.180.0.2",), node_name="node-b")])
    text = iptables.render(st, CFG, 4).text
    assert f"-d 172.30.0.41 --dport 80 -j {SVL}" in text
    assert [r.split(" -j ")[-1] for r in nat(text, SVL)] == ["KUBE-MARK-MASQ", "KUBE-SEP-" + _sep("10.180.0.1:80")]


def _sep(ep):
    from clusterdns.proxy import names
    return names.sep_chain("ns1/svc1:p80", "tcp", ep)[9:]


def test_external_local_with_local_endpoint_and_health_check():
    st = one_service(service_kw={"type": LOAD_BALANCER, "external_local": True, "lb_ips": ("5.6.7.8",),
                                 "health_check_node_port": 30000},
                     port=replace(P80, node_port=3001),
                     endpoints=[Endpoint(("10.180.0.1",), node_name="node-a"),
                                Endpoint(("10.180.0.2",), node_name="node-b")])
    text = iptables.render(st, CFG, 4).text
    assert nat(text, EXT)[-1] == f"-A {EXT} -j {SVL}"
    assert len(nat(text, SVC)) == 3 and len(nat(text, SVL)) == 1
    assert filt(text, "KUBE-NODEPORTS") == [
        '-A KUBE-NODEPORTS -m comment --comment "ns1/svc1:p80 health check node port" -m tcp -p tcp '
        "--dport 30000 -j ACCEPT"]
    assert filt(text, "KUBE-EXTERNAL-SERVICES") == []


def test_no_endpoints_rejects_everywhere():
    st = one_service(service_kw={"type": LOAD_BALANCER, "lb_ips": ("5.6.7.8",), "external_ips": ("1.2.3.4",)},
                     port=replace(P80, node_port=3001), endpoints=[Endpoint(("10.180.0.1",), ready=False,
                                                                            serving=False)])
    text = iptables.render(st, CFG, 4).text
    assert len(filt(text, "KUBE-SERVICES")) == 1 and filt(text, "KUBE-SERVICES")[0].endswith("-j REJECT")
    ext = filt(text, "KUBE-EXTERNAL-SERVICES")
    assert len(ext) == 3 and all('--comment "ns1/svc1:p80 has no endpoints" ' in r for r in ext)
    assert all(r.endswith("-j REJECT") for r in ext)
    assert "KUBE-SVC-" not in text and "KUBE-SEP-" not in text


def test_serving_terminating_fallback():
    st = one_service(endpoints=[Endpoint(("10.180.0.1",), ready=False, serving=True, terminating=True),
                                Endpoint(("10.180.0.2",), ready=False, serving=False, terminating=True)])
    text = iptables.render(st, CFG, 4).text
    lb = [r for r in nat(text, SVC) if "MARK-MASQ" not in r]
    assert len(lb) == 1 and "10.180.0.1:80" in lb[0]
    # a ready endpoint wins over terminating ones
    st = one_service(endpoints=[Endpoint(("10.180.0.1",), ready=False, serving=True, terminating=True),
                                Endpoint(("10.180.0.3",))])
    lb = [r for r in nat(iptables.render(st, CFG, 4).text, SVC) if "MARK-MASQ" not in r]
    assert len(lb) == 1 and "10.180.0.3:80" in lb[0]


def test_topology_hints():
    endpoints = [Endpoint(("10.180.0.1",), hint_zones=("zone-a",)), Endpoint(("10.180.0.2",), hint_zones=("zone-b",)),
                 Endpoint(("10.180.0.3",), hint_zones=("zone-a",))]
    st = one_service(service_kw={"topology_aware": True}, endpoints=endpoints)
    lb = [r for r in nat(iptables.render(st, CFG, 4).text, SVC) if "MARK-MASQ" not in r]
    assert [r.split(" -> ")[1].split('"')[0] for r in lb] == ["10.180.0.1:80", "10.180.0.3:80"]
    # an endpoint without hints disables topology
    st = one_service(service_kw={"topology_aware": True}, endpoints=endpoints + [Endpoint(("10.180.0.4",))])
    assert len([r for r in nat(iptables.render(st, CFG, 4).text, SVC) if "MARK-MASQ" not in r]) == 4
    # unknown node zone: no topology
    lb = [r for r in nat(iptables.render(one_service(service_kw={"topology_aware": True}, endpoints=endpoints),
                                         CFG.with_options(node_name="other"), 4).text, SVC) if "MARK-MASQ" not in r]
    assert len(lb) == 3


def test_affinity():
    st = one_service(service_kw={"affinity_timeout": 300},
                     endpoints=[Endpoint(("10.180.0.1",)), Endpoint(("10.180.0.2",))])
    text = iptables.render(st, CFG, 4).text
    rules = nat(text, SVC)
    sep1 = "KUBE-SEP-" + _sep("10.180.0.1:80")
    assert rules[1] == (f'-A {SVC} -m comment --comment "ns1/svc1:p80 -> 10.180.0.1:80" -m recent --name {sep1} '
                        f"--rcheck --seconds 300 --reap -j {sep1}")
    assert nat(text, sep1)[1] == (f"-A {sep1} -m comment --comment ns1/svc1:p80 -m recent --name {sep1} --set "
                                  "-m tcp -p tcp -j DNAT --to-destination 10.180.0.1:80")


def test_firewall_allows_node_and_lb_ip():
    st = one_service(service_kw={"type": LOAD_BALANCER, "lb_ips": ("5.6.7.8",),
                                 "lb_source_ranges": ("192.168.0.0/24", "203.0.113.0/25")},
                     port=replace(P80, node_port=3001))
    fw = nat(iptables.render(st, CFG, 4).text, "KUBE-FW-XPGD46QRK7WJZT7O")
    assert [r.split(" -s ")[1] if " -s " in r else "end" for r in fw] == [
        f"192.168.0.0/24 -j {EXT}", f"203.0.113.0/25 -j {EXT}", f"5.6.7.8 -j {EXT}", "end"]


def test_unnamed_port_and_udp():
    st = state_from_records([
        svc("ns1", "dns", "172.30.0.10", ServicePort("", "UDP", 53)),
        eps("ns1", "dns", Endpoint(("10.180.0.9",)), port=5353, pname="", proto="UDP")])
    text = iptables.render(st, CFG, 4).text
    assert '-m comment --comment "ns1/dns cluster IP" -m udp -p udp -d 172.30.0.10 --dport 53' in text
    assert "-m comment --comment ns1/dns -m udp -p udp -j DNAT --to-destination 10.180.0.9:5353" in text


def test_skipped_services():
    st = state_from_records([
        ("Service", Service("ns1", "h", cluster_ips=(), headless=True, ports=(P80,))),
        ("Service", Service("ns1", "x", "ExternalName", external_name="a.example", ports=(P80,))),
        ("Service", Service("ns1", "p", cluster_ips=("172.30.0.9",), ports=(P80,), proxy_name="other")),
    ])
    text = iptables.render(st, CFG, 4).text
    assert "ns1/" not in text


def test_large_cluster_drops_endpoint_comments():
    st = state_from_records(synthetic_records(101, 10))
    ruleset = iptables.render(st, CFG, 4)
    assert ruleset.large_cluster
    sep_rules = [r for c, rules in parse(ruleset.text)["nat"][1].items() if c.startswith("KUBE-SEP-") for r in rules]
    assert sep_rules and not any("comment" in r for r in sep_rules)
    small = iptables.render(state_from_records(synthetic_records(100, 10)), CFG, 4)
    assert not small.large_cluster


# ---------------------------------------------------------------- partial syncs and cleanup

def test_partial_sync_writes_only_changed_services():
    st = kube_proxy_state()
    full = iptables.render(st, KUBE_PROXY_CFG, 4)
    part = iptables.render(st, KUBE_PROXY_CFG, 4, only={("ns4", "svc4")})
    declared = parse(part.text)["nat"][0]
    assert "KUBE-SVC-4SW47YFZTEDKD3PK" in declared and "KUBE-SVC-XPGD46QRK7WJZT7O" not in declared
    assert "KUBE-PROXY-CANARY" not in part.text and "-I " not in part.text
    # top-level chains are rewritten whole
    assert nat(part.text, "KUBE-SERVICES") == nat(full.text, "KUBE-SERVICES")
    assert parse(part.text)["filter"][1] == {k: v for k, v in parse(full.text)["filter"][1].items()
                                             if k not in ("INPUT", "OUTPUT", "FORWARD")}
    assert part.chains["nat"] == full.chains["nat"]


def test_stale_chains_are_deleted():
    st = kube_proxy_state()
    existing = {"nat": {"KUBE-SVC-OLDOLDOLDOLDOLD1", "KUBE-SEP-OLDOLDOLDOLDOLD2", "KUBE-SERVICES",
                        "KUBE-SVC-XPGD46QRK7WJZT7O", "OTHER-CHAIN"}}
    rs = iptables.render(st, KUBE_PROXY_CFG, 4, only=set(), existing=existing)
    assert rs.deleted == {"nat": frozenset({"KUBE-SVC-OLDOLDOLDOLDOLD1", "KUBE-SEP-OLDOLDOLDOLDOLD2"})}
    assert "-X KUBE-SVC-OLDOLDOLDOLDOLD1" in rs.text and ":KUBE-SVC-OLDOLDOLDOLDOLD1 - [0:0]" in rs.text
    assert "OTHER-CHAIN" not in rs.text and "-X KUBE-SVC-XPGD" not in rs.text


def test_jump_rules_match_full_text():
    text = iptables.render(kube_proxy_state(), KUBE_PROXY_CFG, 4).text
    jumps = iptables.jump_rules(KUBE_PROXY_CFG, 4)
    assert {chain for _, chain, _ in jumps} >= {"PREROUTING", "OUTPUT", "POSTROUTING", "FORWARD", "INPUT"}
    for table, chain, spec in jumps:
        assert f"-I {chain} {spec}" in parse(text)[table][1][chain]
    text = iptables.render(kube_proxy_state(), KUBE_PROXY_CFG, 4, jumps=False).text
    assert "-I " not in text


# ---------------------------------------------------------------- the real tools

V6_CFG = Config.from_options(command="rules", node_name="node-a", node_ips=("fd00:1::2",), cluster_cidrs=("fd00:10::/64",))


def v6_feature_state():
    """IPv6 with every feature at once: LB with source ranges, eTP Local, affinity, NodePort, externalIP."""
    return state_from_records([
        ("Service", Service("ns1", "svc1", LOAD_BALANCER, ("fd00:30::41",), ports=(replace(P80, node_port=3001),),
                            external_ips=("2001:db8::5",), lb_ips=("2001:db8::8",),
                            lb_source_ranges=("2001:db8:1::/48", "fd00:1::/64"), external_local=True,
                            affinity_timeout=600, health_check_node_port=30000)),
        eps("ns1", "svc1", Endpoint(("fd00:10::1",), node_name="node-a"), Endpoint(("fd00:10::2",)),
            family="IPv6"),
        ("Service", Service("ns2", "none", cluster_ips=("fd00:30::42",), ports=(P80,))),
    ])


def test_v6_features():
    text = iptables.render(v6_feature_state(), V6_CFG, 6).text
    assert "--to-destination [fd00:10::1]:80" in text
    assert "-m recent --name KUBE-SEP-" in text
    assert "-s 2001:db8::8 -j KUBE-EXT-" in text        # node inside a source range: the LB IP may come back
    assert '"ns2/none:p80 has no endpoints" -m tcp -p tcp -d fd00:30::42 --dport 80 -j REJECT' in text
    text = iptables.render(v6_feature_state(), V6_CFG.with_options(nodeport_addresses=("fd00:1::/64", "::1/128")), 6).text
    # loopback never takes NodePorts on IPv6
    assert [r for r in nat(text, "KUBE-SERVICES") if "nodeports" in r][0].endswith("-d fd00:1::2 -j KUBE-NODEPORTS")
    assert "::1 -j KUBE-NODEPORTS" not in text


@needs_netns
def test_texts_accepted_by_iptables_restore(netns):
    cases = [
        (iptables.render(demo_state(), DEMO_CFG, 4).text, 4),
        (iptables.render(demo_state(), DEMO_CFG, 6).text, 6),
        (iptables.render(kube_proxy_state(), KUBE_PROXY_CFG, 4).text, 4),
        (iptables.render(demo_state(), DEMO_CFG.with_options(masquerade_all=True, cluster_cidrs=(),
                                               nodeport_addresses=("192.168.49.0/24",)), 4).text, 4),
        (iptables.render(one_service(service_kw={"affinity_timeout": 30, "internal_local": True}), CFG, 4).text, 4),
        (iptables.render(state_from_records(synthetic_records(101, 10)), CFG, 4).text, 4),
        (iptables.render(v6_feature_state(), V6_CFG, 6).text, 6),
        (iptables.render(v6_feature_state(), V6_CFG.with_options(nodeport_addresses=("fd00:1::/64", "::1/128")), 6).text, 6),
    ]
    for text, family in cases:
        # --test still needs the tables to exist: apply an empty table first
        result = restore(netns, text, family, test=True)
        assert result.returncode == 0, result.stderr


@needs_netns
def test_apply_full_partial_cleanup(netns):
    before4, before6 = save(netns, 4), save(netns, 6)
    st = kube_proxy_state()
    full = iptables.render(st, KUBE_PROXY_CFG, 4)
    r = restore(netns, full.text)
    assert r.returncode == 0, r.stderr
    saved = save(netns)
    chains = iptsave.chains(saved)
    for table in ("filter", "nat", "mangle"):
        assert {c for c in chains[table] if c.startswith("KUBE-")} == set(full.chains[table])
    # iptables-save spells every jump exactly as jump_rules says (appliers check with -C / by text)
    present = set(saved.splitlines())
    assert all(f"-A {chain} {spec}" in present for _, chain, spec in iptables.jump_rules(KUBE_PROXY_CFG, 4))
    # the built-in chains got their jumps, in kube-proxy's order (last inserted first)
    assert parse(saved)["nat"][1]["PREROUTING"] == [
        '-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES']
    assert [r.split()[-1] for r in parse(saved)["filter"][1]["INPUT"]] == [
        "KUBE-FIREWALL", "KUBE-PROXY-FIREWALL", "KUBE-NODEPORTS", "KUBE-EXTERNAL-SERVICES"]

    # ns4/svc4 loses an endpoint, ns1/svc1 disappears: a partial sync with the previous chains as `existing`
    records = [r for r in _kube_proxy_records() if r[1].namespace != "ns1"]
    records = [eps("ns4", "svc4", Endpoint(("10.180.0.4",))) if r[0] == "EndpointSlice" and r[1].namespace == "ns4"
               else r for r in records]
    st2 = state_from_records(records)
    part = iptables.render(st2, KUBE_PROXY_CFG, 4, only={("ns1", "svc1"), ("ns4", "svc4")},
                           existing={k: set(v) for k, v in full.chains.items()})
    r = restore(netns, part.text)
    assert r.returncode == 0, r.stderr
    after_partial = save(netns)
    assert "KUBE-SVC-XPGD46QRK7WJZT7O" not in after_partial and "KUBE-SEP-C6EBXVWJJZMIWKLZ" not in after_partial

    # cleanup returns the tables to what they were
    clean = iptables.cleanup_saved(after_partial)
    r = restore(netns, clean)
    assert r.returncode == 0, r.stderr
    assert _tables_content(save(netns)) == _tables_content(before4)
    assert save(netns, 6) == before6

    # a fresh full render of the new state, applied to clean tables, gives the same kernel state
    fresh = iptables.render(st2, KUBE_PROXY_CFG, 4)
    assert restore(netns, fresh.text).returncode == 0
    want = save(netns)
    assert _tables_content(want) == _tables_content(after_partial)


BUILTIN = {"INPUT", "OUTPUT", "FORWARD", "PREROUTING", "POSTROUTING"}


def _tables_content(text: str) -> dict:
    """User chains and all rules per table (a table that only exists empty counts as absent)."""
    out = {}
    for table, (chains, rules) in parse(text).items():
        user = sorted(chains - BUILTIN)
        if user or rules:
            out[table] = (user, rules)
    return out


def _kube_proxy_records():
    st = kube_proxy_state()
    return [("Service", s) for s in st.services.values()] + [("EndpointSlice", s) for s in st.slices.values()]


@needs_netns
def test_cleanup_without_save_text(netns):
    full = iptables.render(kube_proxy_state(), KUBE_PROXY_CFG, 4)
    assert restore(netns, full.text).returncode == 0
    clean = iptables.cleanup_text({k: set(v) for k, v in full.chains.items()}, 4)
    r = restore(netns, clean)
    assert r.returncode == 0, r.stderr
    assert "KUBE-" not in save(netns)


# ---------------------------------------------------------------- speed

# ---------------------------------------------------------------- the command

def test_rules_command_prints_iptables_text(capsys):
    from clusterdns.cli import main
    rc = main(["rules", "--mode", "iptables", "--manifest", DEMO_MANIFEST, "--node-name", "node-a",
               "--node-ip", "192.168.49.2", "--cluster-cidr", "10.161.0.0/16"])
    out = capsys.readouterr().out
    assert rc == 0
    assert_rules_equal(iptables.render(demo_state(), DEMO_CFG.with_options(cluster_cidrs=("10.161.0.0/16",),
                                                             service_cidrs=()), 4).text, out)
    rc = main(["rules", "--mode", "iptables", "--manifest", DEMO_MANIFEST, "--ip-family", "ipv6"])
    out = capsys.readouterr().out
    assert rc == 0 and "-d fd00:20::5 --dport 443" in out


def test_rules_command_bad_manifest(tmp_path, capsys):
    from clusterdns.cli import main
    bad = tmp_path / "bad.yaml"
    bad.write_text("items: [")
    assert main(["rules", "--mode", "iptables", "--manifest", str(bad)]) == 2
    assert "clusterdns:" in capsys.readouterr().err


def test_source_ranges_of_the_other_family_block_this_one():
    st = state_from_records([
        ("Service", Service("ns1", "svc1", LOAD_BALANCER, ("172.30.0.41", "fd00::41"),
                            ports=(replace(P80, node_port=3001),), lb_ips=("5.6.7.8", "2001:db8::8"),
                            lb_source_ranges=("203.0.113.0/25",))),
        eps("ns1", "svc1", Endpoint(("10.180.0.1",))),
        eps("ns1", "svc1", Endpoint(("fd00::1",)), family="IPv6", slice_name="svc1-v6")])
    v6 = iptables.render(st, CFG, 6).text
    assert nat(v6, "KUBE-FW-XPGD46QRK7WJZT7O") == [
        '-A KUBE-FW-XPGD46QRK7WJZT7O -m comment --comment "other traffic to ns1/svc1:p80 will be dropped by '
        'KUBE-PROXY-FIREWALL"']
    assert "-d 2001:db8::8 --dport 80 -j DROP" in v6
    v4 = iptables.render(st, CFG, 4).text
    assert "-s 203.0.113.0/25 -j KUBE-EXT-XPGD46QRK7WJZT7O" in v4


def test_cleanup_saved_leaves_the_kubelet_alone():
    kubelet = "*nat\n:POSTROUTING ACCEPT [0:0]\n:KUBE-KUBELET-CANARY - [0:0]\n" \
              "-A POSTROUTING -j KUBE-KUBELET-CANARY\nCOMMIT\n"
    assert iptables.cleanup_saved(kubelet) == ""
    ours = kubelet.replace("COMMIT", ":KUBE-SERVICES - [0:0]\n-A POSTROUTING -j KUBE-SERVICES\nCOMMIT")
    assert iptables.cleanup_saved(ours) == (
        "*nat\n:KUBE-SERVICES - [0:0]\n-D POSTROUTING -j KUBE-SERVICES\n-X KUBE-SERVICES\nCOMMIT\n")
