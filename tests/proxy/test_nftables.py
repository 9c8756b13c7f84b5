"""nft -f transactions: kube-proxy's expected rules, golden files, incremental syncs in a real namespace."""
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
    Service,
    ServicePort,
)
from clusterdns.proxy import nftables, readback
from clusterdns.sources.manifest import DEMO_MANIFEST
from clusterdns.state import state_from_records
from clusterdns.synthetic import synthetic_records
from tests.common import endpoint_slots, nft_elements
from tests.demo import DEMO_CFG, demo_state
from tests.nslib import nft, nft_table, requires

GOLDEN = Path(__file__).parent / "golden"
UPDATE = bool(os.environ.get("UPDATE_GOLDEN"))


P80 = ServicePort("p80", "TCP", 80)


def _svc(ns, name, ip, port, **kw):
    return ("Service", Service(ns, name, kw.pop("type", "ClusterIP"), (ip,), ports=(port,), **kw))


def _eps(ns, name, *endpoints):
    return ("EndpointSlice", EndpointSlice(ns, name + "-abc", name, "IPv4", tuple(endpoints),
                                           (EndpointPort("p80", "TCP", 80),)))


def kube_proxy_state():
    """The cluster of kube-proxy's overall nftables test (svc5 with ClientIP affinity)."""
    return state_from_records([
        _svc("ns1", "svc1", "172.30.0.41", P80),
        _eps("ns1", "svc1", Endpoint(("10.180.0.1",))),
        _svc("ns2", "svc2", "172.30.0.42", replace(P80, node_port=3001), type=LOAD_BALANCER,
             external_ips=("192.168.99.22",), lb_ips=("1.2.3.4",), external_local=True,
             health_check_node_port=30000),
        _eps("ns2", "svc2", Endpoint(("10.180.0.2",), node_name="node2")),
        _svc("ns3", "svc3", "172.30.0.43", replace(P80, node_port=3003), type=NODE_PORT),
        _eps("ns3", "svc3", Endpoint(("10.180.0.3",), node_name="node2")),
        _svc("ns4", "svc4", "172.30.0.44", P80, external_ips=("192.168.99.33",)),
        _eps("ns4", "svc4", Endpoint(("10.180.0.4",)), Endpoint(("10.180.0.5",), node_name="node2")),
        _svc("ns5", "svc5", "172.30.0.45", replace(P80, node_port=3002), type=LOAD_BALANCER,
             lb_ips=("5.6.7.8",), lb_source_ranges=("203.0.113.0/25",), affinity_timeout=10800),
        _eps("ns5", "svc5", Endpoint(("10.180.0.3",), node_name="node2")),
        _svc("ns6", "svc6", "172.30.0.46", P80),
    ])


KUBE_PROXY_CFG = Config.from_options(command="rules", node_name="test-node", node_ips=("192.168.0.2",),
                        cluster_cidrs=("10.0.0.0/8",), nodeport_addresses=("all",))

# The per-service objects for kube-proxy's cluster in clusterdns's layout (docs/proxy.md): kube-proxy's
# chains and verdict-map elements, with endpoint choice through the shared endpoint maps (svc5 keeps
# per-endpoint chains for its affinity), hairpin pairs and no-endpoint sets instead of goto elements.
KUBE_PROXY_SERVICES = textwrap.dedent("""\
    add map ip kube-proxy endpoints-tcp-210 { typeof numgen random mod 65536 : ip daddr . tcp dport ; flags interval ; }
    add map ip kube-proxy endpoints-tcp-171 { typeof numgen random mod 65536 : ip daddr . tcp dport ; flags interval ; }
    add map ip kube-proxy endpoints-tcp-137 { typeof numgen random mod 65536 : ip daddr . tcp dport ; flags interval ; }
    add map ip kube-proxy endpoints-tcp-245 { typeof numgen random mod 65536 : ip daddr . tcp dport ; flags interval ; }
    add set ip kube-proxy affinity-GTK6MW7G-ns5/svc5/tcp/p80__10.180.0.3/80 { type ipv4_addr ; flags dynamic,timeout ; timeout 10800s ; }
    add map ip kube-proxy endpoints-tcp-132 { typeof numgen random mod 65536 : ip daddr . tcp dport ; flags interval ; }
    add rule ip kube-proxy service-ULMVA6XW-ns1/svc1/tcp/p80 ip daddr 172.30.0.41 tcp dport 80 ip saddr != 10.0.0.0/8 jump mark-for-masquerade
    add rule ip kube-proxy service-ULMVA6XW-ns1/svc1/tcp/p80 meta l4proto tcp dnat to numgen random mod 65536 offset 764084224 map @endpoints-tcp-210
    add rule ip kube-proxy service-42NFTM6N-ns2/svc2/tcp/p80 ip daddr 172.30.0.42 tcp dport 80 ip saddr != 10.0.0.0/8 jump mark-for-masquerade
    add rule ip kube-proxy service-42NFTM6N-ns2/svc2/tcp/p80 meta l4proto tcp dnat to numgen random mod 65536 offset 3440640000 map @endpoints-tcp-171
    add rule ip kube-proxy local-42NFTM6N-ns2/svc2/tcp/p80 meta l4proto tcp dnat to numgen random mod 65536 offset 2130051072 map @endpoints-tcp-171
    add rule ip kube-proxy external-42NFTM6N-ns2/svc2/tcp/p80 ip saddr 10.0.0.0/8 goto service-42NFTM6N-ns2/svc2/tcp/p80 comment "short-circuit pod traffic"
    add rule ip kube-proxy external-42NFTM6N-ns2/svc2/tcp/p80 fib saddr type local jump mark-for-masquerade comment "masquerade local traffic"
    add rule ip kube-proxy external-42NFTM6N-ns2/svc2/tcp/p80 fib saddr type local goto service-42NFTM6N-ns2/svc2/tcp/p80 comment "short-circuit local traffic"
    add rule ip kube-proxy external-42NFTM6N-ns2/svc2/tcp/p80 goto local-42NFTM6N-ns2/svc2/tcp/p80
    add rule ip kube-proxy service-4AT6LBPK-ns3/svc3/tcp/p80 ip daddr 172.30.0.43 tcp dport 80 ip saddr != 10.0.0.0/8 jump mark-for-masquerade
    add rule ip kube-proxy service-4AT6LBPK-ns3/svc3/tcp/p80 meta l4proto tcp dnat to numgen random mod 65536 offset 3644063744 map @endpoints-tcp-137
    add rule ip kube-proxy external-4AT6LBPK-ns3/svc3/tcp/p80 jump mark-for-masquerade
    add rule ip kube-proxy external-4AT6LBPK-ns3/svc3/tcp/p80 goto service-4AT6LBPK-ns3/svc3/tcp/p80
    add rule ip kube-proxy service-LAUZTJTB-ns4/svc4/tcp/p80 ip daddr 172.30.0.44 tcp dport 80 ip saddr != 10.0.0.0/8 jump mark-for-masquerade
    add rule ip kube-proxy service-LAUZTJTB-ns4/svc4/tcp/p80 meta l4proto tcp dnat to numgen random mod 65536 offset 1703018496 map @endpoints-tcp-245
    add rule ip kube-proxy external-LAUZTJTB-ns4/svc4/tcp/p80 jump mark-for-masquerade
    add rule ip kube-proxy external-LAUZTJTB-ns4/svc4/tcp/p80 goto service-LAUZTJTB-ns4/svc4/tcp/p80
    add rule ip kube-proxy service-HVFWP5L3-ns5/svc5/tcp/p80 ip daddr 172.30.0.45 tcp dport 80 ip saddr != 10.0.0.0/8 jump mark-for-masquerade
    add rule ip kube-proxy service-HVFWP5L3-ns5/svc5/tcp/p80 ip saddr @affinity-GTK6MW7G-ns5/svc5/tcp/p80__10.180.0.3/80 goto endpoint-GTK6MW7G-ns5/svc5/tcp/p80__10.180.0.3/80
    add rule ip kube-proxy service-HVFWP5L3-ns5/svc5/tcp/p80 numgen random mod 1 vmap { 0 : goto endpoint-GTK6MW7G-ns5/svc5/tcp/p80__10.180.0.3/80 }
    add rule ip kube-proxy external-HVFWP5L3-ns5/svc5/tcp/p80 jump mark-for-masquerade
    add rule ip kube-proxy external-HVFWP5L3-ns5/svc5/tcp/p80 goto service-HVFWP5L3-ns5/svc5/tcp/p80
    add rule ip kube-proxy firewall-HVFWP5L3-ns5/svc5/tcp/p80 ip saddr != { 203.0.113.0/25 } drop
    add rule ip kube-proxy endpoint-GTK6MW7G-ns5/svc5/tcp/p80__10.180.0.3/80 update @affinity-GTK6MW7G-ns5/svc5/tcp/p80__10.180.0.3/80 { ip saddr }
    add rule ip kube-proxy endpoint-GTK6MW7G-ns5/svc5/tcp/p80__10.180.0.3/80 meta l4proto tcp dnat to 10.180.0.3:80
    add rule ip kube-proxy service-Y3O5BOQO-ns6/svc6/tcp/p80 ip daddr 172.30.0.46 tcp dport 80 ip saddr != 10.0.0.0/8 jump mark-for-masquerade
    add rule ip kube-proxy service-Y3O5BOQO-ns6/svc6/tcp/p80 meta l4proto tcp dnat to numgen random mod 65536 offset 4141547520 map @endpoints-tcp-132
    add element ip kube-proxy endpoints-tcp-210 { 764084224-764149759 : 10.180.0.1 . 80 }
    add element ip kube-proxy endpoints-tcp-171 { 3440640000-3440705535 : 10.180.0.2 . 80 }
    add element ip kube-proxy endpoints-tcp-137 { 3644063744-3644129279 : 10.180.0.3 . 80 }
    add element ip kube-proxy endpoints-tcp-245 { 1703018496-1703051263 : 10.180.0.4 . 80 }
    add element ip kube-proxy endpoints-tcp-245 { 1703051264-1703084031 : 10.180.0.5 . 80 }
    add element ip kube-proxy hairpin { 10.180.0.1 . 10.180.0.1 }
    add element ip kube-proxy hairpin { 10.180.0.2 . 10.180.0.2 }
    add element ip kube-proxy hairpin { 10.180.0.3 . 10.180.0.3 }
    add element ip kube-proxy hairpin { 10.180.0.4 . 10.180.0.4 }
    add element ip kube-proxy hairpin { 10.180.0.5 . 10.180.0.5 }
    add element ip kube-proxy no-endpoint-reject { 172.30.0.46 . tcp . 80 comment "ns6/svc6:p80" }
    add element ip kube-proxy no-endpoint-drop { 1.2.3.4 . tcp . 80 comment "ns2/svc2:p80" }
    add element ip kube-proxy no-endpoint-drop { 192.168.99.22 . tcp . 80 comment "ns2/svc2:p80" }
    add element ip kube-proxy no-endpoint-nodeport-drop { tcp . 3001 comment "ns2/svc2:p80" }
    add element ip kube-proxy firewall-ips { 5.6.7.8 . tcp . 80 comment "ns5/svc5:p80" : goto firewall-HVFWP5L3-ns5/svc5/tcp/p80 }
    add element ip kube-proxy service-ips { 172.30.0.41 . tcp . 80 : goto service-ULMVA6XW-ns1/svc1/tcp/p80 }
    add element ip kube-proxy service-ips { 172.30.0.42 . tcp . 80 : goto service-42NFTM6N-ns2/svc2/tcp/p80 }
    add element ip kube-proxy service-ips { 192.168.99.22 . tcp . 80 : goto external-42NFTM6N-ns2/svc2/tcp/p80 }
    add element ip kube-proxy service-ips { 1.2.3.4 . tcp . 80 : goto external-42NFTM6N-ns2/svc2/tcp/p80 }
    add element ip kube-proxy service-ips { 172.30.0.43 . tcp . 80 : goto service-4AT6LBPK-ns3/svc3/tcp/p80 }
    add element ip kube-proxy service-ips { 172.30.0.44 . tcp . 80 : goto service-LAUZTJTB-ns4/svc4/tcp/p80 }
    add element ip kube-proxy service-ips { 192.168.99.33 . tcp . 80 : goto external-LAUZTJTB-ns4/svc4/tcp/p80 }
    add element ip kube-proxy service-ips { 172.30.0.45 . tcp . 80 : goto service-HVFWP5L3-ns5/svc5/tcp/p80 }
    add element ip kube-proxy service-ips { 5.6.7.8 . tcp . 80 : goto external-HVFWP5L3-ns5/svc5/tcp/p80 }
    add element ip kube-proxy service-ips { 172.30.0.46 . tcp . 80 : goto service-Y3O5BOQO-ns6/svc6/tcp/p80 }
    add element ip kube-proxy service-nodeports { tcp . 3001 : goto external-42NFTM6N-ns2/svc2/tcp/p80 }
    add element ip kube-proxy service-nodeports { tcp . 3003 : goto external-4AT6LBPK-ns3/svc3/tcp/p80 }
    add element ip kube-proxy service-nodeports { tcp . 3002 : goto external-HVFWP5L3-ns5/svc5/tcp/p80 }
    """)

_PER_SERVICE = ("service-", "endpoint-", "external-", "firewall-", "local-", "affinity-")
_MAPS = ("service-ips", "service-nodeports", "no-endpoint-reject", "no-endpoint-drop", "no-endpoint-nodeport-reject",
         "no-endpoint-nodeport-drop", "firewall-ips", "hairpin")


def per_service(text: str) -> dict[str, list[str]]:
    """Rules of per-service chains (order kept), elements of the dispatch maps and affinity sets (sorted)."""
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 5 or parts[0] != "add":
            continue
        kind, name = parts[1], parts[4]
        if kind == "rule" and name.startswith(_PER_SERVICE) and not name.endswith("-check"):
            out.setdefault(name, []).append(line)
        elif kind == "element" and (name in _MAPS or name.startswith("endpoints-")):
            # one statement per element, however the text groups them
            head, _, body = line.partition(" { ")
            out.setdefault(name, []).extend(f"{head} {{ {e} }}" for e in body[:-2].split(", "))
        elif kind in ("set", "map") and name.startswith(("affinity-", "endpoints-")):
            out.setdefault(name, []).append(line)
    return {k: sorted(v) if not k.startswith(_PER_SERVICE) or k.startswith("affinity-") else v
            for k, v in out.items()}


def elements(text: str, family: str = "ip") -> set[str]:
    """Every element of a text as "set { element }", however its statements group them."""
    out = set()
    for line in text.splitlines():
        head = f"add element {family} kube-proxy "
        if line.startswith(head):
            name, _, body = line[len(head):].partition(" { ")
            out |= {f"{name} {{ {e} }}" for e in body[:-2].split(", ")}
    return out


def test_kube_proxy_cluster_service_objects():
    got = nftables.render(kube_proxy_state(), KUBE_PROXY_CFG, 4).text
    assert per_service(got) == per_service(KUBE_PROXY_SERVICES)


def test_base_chains_and_jumps():
    text = nftables.render(kube_proxy_state(), KUBE_PROXY_CFG, 4).text
    for line in (
        "add chain ip kube-proxy filter-prerouting-pre-dnat { type filter hook prerouting priority -110 ; }",
        "add chain ip kube-proxy filter-output-pre-dnat { type filter hook output priority -110 ; }",
        "add chain ip kube-proxy filter-input { type filter hook input priority 0 ; }",
        "add chain ip kube-proxy filter-forward { type filter hook forward priority 0 ; }",
        "add chain ip kube-proxy filter-output { type filter hook output priority 0 ; }",
        "add chain ip kube-proxy nat-prerouting { type nat hook prerouting priority -100 ; }",
        "add chain ip kube-proxy nat-output { type nat hook output priority -100 ; }",
        "add chain ip kube-proxy nat-postrouting { type nat hook postrouting priority 100 ; }",
        "add rule ip kube-proxy filter-input ct state new jump nodeport-endpoints-check",
        "add rule ip kube-proxy filter-forward ct state new jump cluster-ips-check",
        "add rule ip kube-proxy nat-postrouting jump masquerading",
        "add rule ip kube-proxy mark-for-masquerade mark set mark or 0x4000",
        "add rule ip kube-proxy masquerading masquerade fully-random",
        "add rule ip kube-proxy services fib daddr type local ip daddr != 127.0.0.0/8 meta l4proto . th dport "
        "vmap @service-nodeports",
        'add rule ip kube-proxy cluster-ips-check ip daddr @cluster-ips reject comment "Reject traffic to invalid '
        'ports of ClusterIPs"',
    ):
        assert line in text.splitlines(), line
    assert "drop comment \"Drop traffic to unallocated ClusterIPs\"" not in text   # no --service-cidr


def test_service_cidr_drop_and_primary_nodeport_ip():
    text = nftables.render(demo_state(), DEMO_CFG, 4).text
    assert ('add rule ip kube-proxy cluster-ips-check ip daddr { 172.20.0.0/16 } drop comment '
            '"Drop traffic to unallocated ClusterIPs"') in text
    # kube-proxy's nftables default: NodePorts on the primary node IP only
    assert "nodeport-ips { 192.168.49.2 }" in elements(text)
    assert "ip daddr @nodeport-ips meta l4proto . th dport vmap @service-nodeports" in text
    assert "cluster-ips { 172.20.36.232 }" in elements(text)


@pytest.mark.parametrize("family", [4, 6])
def test_demo_golden(family):
    got = nftables.render(demo_state(), DEMO_CFG, family).text
    path = GOLDEN / f"demo-nftables-v{family}.nft"
    if UPDATE:
        path.write_text(got)
    assert sorted(path.read_text().splitlines()) == sorted(got.splitlines())
    # rule order inside each chain is kept
    assert per_service(path.read_text()) == per_service(got)


def test_demo_v6():
    text = nftables.render(demo_state(), DEMO_CFG, 6).text
    assert "add table ip6 kube-proxy" in text and " ip kube-proxy" not in text
    assert any(e.startswith("service-ips { fd00:20::5 . tcp . 80 : goto service-") for e in elements(text, "ip6"))
    assert any(e.endswith(" : fd00:161::2 . 8080 }") for e in elements(text, "ip6"))
    assert "dnat to numgen random mod 65536" in text
    assert "ip6 daddr fd00:20::5 tcp dport 80 ip6 saddr != fd00:161::/64 jump mark-for-masquerade" in text
    assert "add chain ip6 kube-proxy endpoint-" not in text   # no affinity in the demo: no endpoint chains


def test_masquerade_all_and_no_detector():
    cfg = KUBE_PROXY_CFG.with_options(masquerade_all=True)
    text = nftables.render(kube_proxy_state(), cfg, 4).text
    assert ("add rule ip kube-proxy service-ULMVA6XW-ns1/svc1/tcp/p80 ip daddr 172.30.0.41 tcp dport 80 "
            "jump mark-for-masquerade") in text
    text = nftables.render(kube_proxy_state(), KUBE_PROXY_CFG.with_options(cluster_cidrs=()), 4).text
    assert "short-circuit pod traffic" not in text and "saddr !=" not in text.split("firewall-")[0]


def test_incremental_only_touches_changes():
    st = state_from_records(synthetic_records(200, 5))
    cfg = Config.from_options(command="rules", node_name="node-0", node_ips=("192.168.0.2",), cluster_cidrs=("10.0.0.0/8",))
    full = nftables.render(st, cfg, 4)
    same = nftables.render(st, cfg, 4, previous=full.state)
    assert same.text == "" and same.changes == 0 and not same.full
    records = synthetic_records(200, 5)
    records = [(k, replace(r, endpoints=r.endpoints[1:])) if k == "EndpointSlice" and r.service == "svc-7" else (k, r)
               for k, r in records]
    one = nftables.render(state_from_records(records), cfg, 4, previous=full.state)
    lines = one.text.splitlines()
    # an endpoint change touches only elements: the endpoint map's ranges of svc-7 and one hairpin pair
    svc7 = full.state.owned[("ns-7", "svc-7")]
    (bucket, slot), = svc7.slots
    endpoints_map = nftables.endpoints_map(bucket)
    assert all(line.split()[1] == "element" for line in lines), lines
    assert {line.split()[4] for line in lines} == {endpoints_map, "hairpin"}
    assert sum(1 for line in lines if line.startswith("delete element") and "hairpin" in line) == 1
    assert not any(line.startswith("add element") and "hairpin" in line for line in lines)
    # the 4 remaining endpoints share the slot evenly
    ranges = [line.split("{ ")[1].split(" :")[0] for line in lines if line.startswith("add element")]
    assert ranges == [f"{lo}-{hi}" for lo, hi in nftables.shares(4, slot * nftables.SLOT)]
    assert one.state.chains == full.state.chains or dict(one.state.chains) == dict(full.state.chains)


def test_cleanup_text():
    assert nftables.cleanup_text(6) == "add table ip6 kube-proxy\ndelete table ip6 kube-proxy\n"


# ---------------------------------------------------------------- the real nft

needs_netns = requires("nft")


def listing(ns: str, family: int = 4) -> list[str]:
    return normalise(nft_table(ns, family))


def normalise(listing_text: str) -> list[str]:
    """nft's listing as sorted lines per chain/set block, keeping rule order inside a chain."""
    blocks: list[str] = []
    current: list[str] = []
    for line in listing_text.splitlines():
        s = line.strip()
        if s.startswith(("chain ", "set ", "map ")):
            current = [s]
        elif s == "}" and current:
            blocks.append("\n".join(current))
            current = []
        elif current:
            current.append(s)
    # element lists are printed in nft's own order: compare them as sets
    return sorted(_sort_elements(b) for b in blocks)


def _sort_elements(block: str) -> str:
    if "elements = {" not in block:
        return block
    head, _, rest = block.partition("elements = {")
    body, _, tail = rest.rpartition("}")
    items = [x.strip() for x in body.replace("\n", " ").split(",") if x.strip()]
    if head.startswith("map " + nftables.ENDPOINTS_PREFIX):
        items = _slots(items)
    return head + "elements = {" + ", ".join(sorted(items)) + "}" + tail


def _slots(items) -> list[str]:
    return endpoint_slots(items)


def _statements(text: str) -> list[str]:
    """An nft -f text's statements, one element per element statement (a sync may send a
    slot's elements in one statement, a diff of the whole table one by one)."""
    out = []
    for line in text.splitlines():
        head, sep, rest = line.partition(" { ")
        if sep and line.split()[1] == "element":
            out += [f"{head} {{ {item.strip()} }}" for item in rest.rstrip(" }").split(", ")]
        else:
            out.append(line)
    return sorted(out)


@needs_netns
def test_texts_accepted_by_nft(netns):
    for text in (nftables.render(demo_state(), DEMO_CFG, 4).text,
                 nftables.render(demo_state(), DEMO_CFG, 6).text,
                 nftables.render(kube_proxy_state(), KUBE_PROXY_CFG, 4).text,
                 nftables.render(demo_state(), DEMO_CFG.with_options(masquerade_all=True, cluster_cidrs=(),
                                                       nodeport_addresses=("all",)), 4).text,
                 nftables.render(_v6_state(), DEMO_CFG.with_options(node_ips=("fd00:1::2",)), 6).text):
        r = nft(netns, text, check=True)
        assert r.returncode == 0, r.stderr[:2000]


def _v6_state():
    """IPv6 with LB source ranges (node inside one), eTP Local, affinity, NodePort and an endpoint-less port."""
    return state_from_records([
        ("Service", Service("ns1", "svc1", LOAD_BALANCER, ("fd00:20::41",), ports=(replace(P80, node_port=3001),),
                            external_ips=("2001:db8::5",), lb_ips=("2001:db8::8",),
                            lb_source_ranges=("2001:db8:1::/48", "fd00:1::/64"), external_local=True,
                            affinity_timeout=600)),
        ("EndpointSlice", EndpointSlice("ns1", "s6", "svc1", "IPv6",
                                        (Endpoint(("fd00:161::1",), node_name="node-a"), Endpoint(("fd00:161::2",))),
                                        (EndpointPort("p80", "TCP", 80),))),
        ("Service", Service("ns2", "none", cluster_ips=("fd00:20::42",), ports=(P80,))),
    ])


def test_v6_features():
    text = nftables.render(_v6_state(), DEMO_CFG.with_options(node_ips=("fd00:1::2",)), 6).text
    assert "ip6 saddr != { 2001:db8:1::/48, fd00:1::/64, 2001:db8::8 } drop" in text
    assert "{ type ipv6_addr ; flags dynamic,timeout ; timeout 600s ; }" in text
    assert "update @affinity-" in text and "{ ip6 saddr }" in text
    assert 'no-endpoint-reject { fd00:20::42 . tcp . 80 comment "ns2/none:p80" }' in elements(text, "ip6")
    assert "nodeport-ips { fd00:1::2 }" in elements(text, "ip6")


def _mutations():
    """A sequence of states: endpoints change, services go and come, affinity and policies change."""
    base = synthetic_records(40, 3, nodeport_every=4, node_name="node-0")
    yield base

    def edit(records, fn):
        return [fn(k, r) for k, r in records]

    def drop_ep(k, r):
        return (k, replace(r, endpoints=r.endpoints[1:])) if k == "EndpointSlice" and r.service == "svc-2" else (k, r)
    s1 = edit(base, drop_ep)
    yield s1
    s2 = [x for x in s1 if x[1].__class__.__name__ not in ("Service", "EndpointSlice")
          or getattr(x[1], "service", getattr(x[1], "name", "")) not in ("svc-3",)]
    yield s2

    def affinity(k, r):
        if k == "Service" and r.name in ("svc-5", "svc-6"):
            return (k, replace(r, affinity_timeout=30))
        if k == "Service" and r.name == "svc-8":
            return (k, replace(r, external_local=True, type=NODE_PORT,
                               ports=(replace(r.ports[0], node_port=31999),)))
        if k == "EndpointSlice" and r.service == "svc-9":
            return (k, replace(r, endpoints=tuple(replace(e, ready=False, serving=True, terminating=True)
                                                  for e in r.endpoints)))
        return (k, r)
    s3 = edit(s2, affinity)
    yield s3

    def timeout(k, r):
        return (k, replace(r, affinity_timeout=60)) if k == "Service" and r.name == "svc-5" else (k, r)
    s4 = edit(s3, timeout) + [("Service", Service("ns-0", "new", cluster_ips=("10.96.9.9",),
                                                  ports=(ServicePort("http", "UDP", 53),)))]
    yield s4
    yield base


@needs_netns
def test_incremental_equals_full_in_the_kernel(netns):
    cfg = Config.from_options(command="rules", node_name="node-0", node_ips=("192.168.0.2",), cluster_cidrs=("10.0.0.0/8",),
                 service_cidrs=("10.96.0.0/12",))
    previous, previous_st = None, None
    for i, records in enumerate(_mutations()):
        st = state_from_records(records)
        # alternate between the targeted path (changed keys known) and the compare-everything path
        changed = _changed(previous_st, st) if previous_st is not None and i % 2 else None
        rs = nftables.render(st, cfg, 4, previous=previous, changed=changed)
        _assert_same_state(rs.state, nftables.build(st, cfg, 4))
        r = nft(netns, rs.text)
        assert r.returncode == 0, r.stderr[:3000]
        got = listing(netns)
        # the same state from scratch, in a fresh table
        r = nft(netns, nftables.render(st, cfg, 4).text)
        assert r.returncode == 0, r.stderr[:3000]
        assert got == listing(netns)
        previous, previous_st = rs.state, st
    r = nft(netns, nftables.cleanup_text(4))
    assert r.returncode == 0, r.stderr
    out = subprocess.run(["ip", "netns", "exec", netns, "nft", "list", "ruleset"], capture_output=True, text=True)
    assert "kube-proxy" not in out.stdout
    # cleanup of an absent table is harmless
    assert nft(netns, nftables.cleanup_text(4)).returncode == 0


def _changed(old, new) -> set:
    keys = set(old.services) | set(new.services) | {s.service_key for s in old.slices.values()} | \
        {s.service_key for s in new.slices.values()}
    return {k for k in keys if old.services.get(k) != new.services.get(k)
            or old.slices_for(*k) != new.slices_for(*k)}


def _assert_same_state(a, b):
    assert dict(a.chains) == dict(b.chains)
    assert dict(a.chain_decls) == dict(b.chain_decls)
    assert dict(a.sets) == dict(b.sets)
    assert nft_elements(a) == nft_elements(b)    # placement within a slot: see endpoint_slots


def test_targeted_incremental_matches_full_diff():
    cfg = Config.from_options(command="rules", node_name="node-0", node_ips=("192.168.0.2",), cluster_cidrs=("10.0.0.0/8",))
    states = [state_from_records(r) for r in _mutations()]
    for old, new in zip(states, states[1:]):
        prev = nftables.render(old, cfg, 4).state
        targeted = nftables.render(new, cfg, 4, previous=prev, changed=_changed(old, new))
        general = nftables.render(new, cfg, 4, previous=prev)
        _assert_same_state(targeted.state, general.state)
        assert _statements(targeted.text) == _statements(general.text)


@needs_netns
def test_incremental_v6_and_config_change(netns):
    st = demo_state()
    full = nftables.render(st, DEMO_CFG, 6)
    assert nft(netns, full.text).returncode == 0
    cfg2 = DEMO_CFG.with_options(service_cidrs=("fd00:20::/112",), nodeport_addresses=("all",))
    inc = nftables.render(st, cfg2, 6, previous=full.state)
    r = nft(netns, inc.text)
    assert r.returncode == 0, r.stderr
    got = listing(netns, 6)
    assert nft(netns, nftables.render(st, cfg2, 6).text).returncode == 0
    assert got == listing(netns, 6)


# ---------------------------------------------------------------- size and speed

def test_sizes_and_speed_10k():
    st = state_from_records(synthetic_records(10000, 10))
    cfg = Config.from_options(command="rules", node_name="node-0", node_ips=("192.168.0.2",), cluster_cidrs=("10.0.0.0/8",))
    full = nftables.render(st, cfg, 4)
    records = synthetic_records(10000, 10)
    records = [(k, replace(r, endpoints=r.endpoints[1:])) if k == "EndpointSlice" and r.service == "svc-77" else (k, r)
               for k, r in records]
    st2 = state_from_records(records)
    inc = nftables.render(st2, cfg, 4, previous=full.state, changed={("ns-7", "svc-77")})
    # speed is measured in bench/proxy; here: the change is 10 + 9 range elements and one hairpin pair
    lines = _statements(inc.text)
    assert len(lines) == 20 and all(line.split()[1] == "element" for line in lines), lines
    assert not any(c.startswith("endpoint-") for c in inc.state.chains)
    assert len(full.state.chains) < 12 + 10000 * 2


def test_rules_command_prints_nft_script(capsys):
    from clusterdns.cli import main
    rc = main(["rules", "--mode", "nftables", "--manifest", DEMO_MANIFEST, "--node-name", "node-a",
               "--node-ip", "192.168.49.2", "--cluster-cidr", "10.161.0.0/16", "--service-cidr", "172.20.0.0/16"])
    out = capsys.readouterr().out
    assert rc == 0
    cfg = DEMO_CFG.with_options(cluster_cidrs=("10.161.0.0/16",), service_cidrs=("172.20.0.0/16",))
    assert out == nftables.render(demo_state(), cfg, 4).text


@needs_netns
def test_resync_repairs_drift_and_keeps_affinity(netns):
    cfg = Config.from_options(command="rules", node_name="node-0", node_ips=("192.168.0.2",), cluster_cidrs=("10.0.0.0/8",),
                 service_cidrs=("10.96.0.0/12",))
    states = [state_from_records(r) for r in _mutations()]
    first = nftables.render(states[3], cfg, 4)          # svc-5 and svc-6 have ClientIP affinity
    assert nft(netns, first.text).returncode == 0
    aff = next(s for s in first.state.sets if s.startswith("affinity-"))
    # a client pinned by the kernel, and drift: a rule and a map element removed behind our back
    svc_chain = next(c for c in first.state.chains if c.startswith("service-") and "svc-7/" in c)
    key = next(iter(first.state.elements["service-ips"]))
    drift = (f"add element ip kube-proxy {aff} {{ 10.0.9.9 }}\n"
             f"flush chain ip kube-proxy {svc_chain}\n"
             f"delete element ip kube-proxy service-ips {{ {key} }}\n")
    r = nft(netns, drift)
    assert r.returncode == 0, r.stderr
    for st in (states[3], states[4]):     # the same state, then one where the affinity timeout changed
        rs = nftables.render(st, cfg, 4, previous=first.state, resync=True)
        r = nft(netns, rs.text)
        assert r.returncode == 0, r.stderr[:2000]
        got = [b for b in listing(netns) if not b.startswith("set affinity-")]
        keep = "10.0.9.9" in subprocess.run(["ip", "netns", "exec", netns, "nft", "list", "set", "ip", "kube-proxy",
                                             aff], capture_output=True, text=True).stdout
        assert nft(netns, nftables.render(st, cfg, 4).text).returncode == 0
        want = [b for b in listing(netns) if not b.startswith("set affinity-")]
        assert got == want
        if st is states[3]:
            assert keep   # the pinned client survived the full resync
        first = nftables.render(st, cfg, 4)
        assert nft(netns, first.text).returncode == 0
        assert nft(netns, f"add element ip kube-proxy {aff} {{ 10.0.9.9 }}\n").returncode == 0


def test_resync_text_shape():
    st = kube_proxy_state()
    full = nftables.render(st, KUBE_PROXY_CFG, 4)
    rs = nftables.render(st, KUBE_PROXY_CFG, 4, previous=full.state, resync=True)
    lines = rs.text.splitlines()
    assert rs.full and "delete table ip kube-proxy" not in lines
    assert "flush map ip kube-proxy service-ips" in lines
    assert not any(line.startswith("flush set ip kube-proxy affinity-") for line in lines)
    assert sorted(x for x in lines if x.startswith("add rule")) == \
        sorted(x for x in full.text.splitlines() if x.startswith("add rule"))
    assert elements(rs.text) == elements(full.text)


# ---------------------------------------------------------------- what a previous process left (restart adoption)

def _expected_programmed(st, cfg, family):
    """(ClusterIP, protocol, port) -> endpoints of its Cluster and Local dispatch, from the state."""
    from clusterdns.proxy import servicemap
    out = {}
    for info, cat in servicemap.service_ports(st, cfg, family):
        eps = set()
        if not info.internal_local or info.externally_accessible:
            eps |= {e.endpoint for e in cat.cluster}
        if info.uses_local_endpoints:
            eps |= {e.endpoint for e in cat.local}
        out[(info.cluster_ip, info.protocol.upper(), info.port_number)] = frozenset(eps)
    return out


@needs_netns
def test_programmed_reads_back_the_kernel(netns):
    from clusterdns.proxy import nflink
    assert nftables.programmed(4, netns=netns) == {}      # nothing there yet
    cfg = Config.from_options(command="rules", node_name="node-0", node_ips=("192.168.0.2",), cluster_cidrs=("10.0.0.0/8",),
                 service_cidrs=("10.96.0.0/12",))
    try:
        # every feature: affinity (per-endpoint chains), eTP/iTP Local, LB, no endpoints, terminating, IPv6
        for st, c, fam in ((kube_proxy_state(), KUBE_PROXY_CFG, 4), (demo_state(), DEMO_CFG, 4),
                           (demo_state(), DEMO_CFG, 6), (_v6_state(), DEMO_CFG.with_options(node_ips=("fd00:1::2",)), 6)):
            assert nft(netns, nftables.render(st, c, fam).text).returncode == 0
            got = nftables.programmed(fam, netns=netns)
            assert got == _expected_programmed(st, c, fam)
            assert readback.nftables_ports(fam, netns) == set(got)     # the ports alone, read first
        # and after incremental changes sent over netlink, as the proxier leaves the table
        states = [state_from_records(r) for r in _mutations()]
        rs = nftables.render(states[0], cfg, 4)
        assert nft(netns, rs.text).returncode == 0
        for old, new in zip(states, states[1:]):
            rs = nftables.render(new, cfg, 4, previous=rs.state, changed=_changed(old, new))
            if nflink.supported(rs.ops):
                nflink.apply(rs.ops, 4, netns=netns)
            else:
                assert nft(netns, rs.text).returncode == 0
            assert nftables.programmed(4, netns=netns) == _expected_programmed(new, cfg, 4)
    finally:
        nflink.close_all()


@needs_netns
def test_backend_programmed(netns):
    import asyncio

    from clusterdns.proxy.apply import RecordingRunner, SubprocessRunner
    from clusterdns.proxy.proxier import NftablesBackend
    assert nft(netns, nftables.render(kube_proxy_state(), KUBE_PROXY_CFG, 4).text).returncode == 0
    backend = NftablesBackend(SubprocessRunner(("ip", "netns", "exec", netns)), KUBE_PROXY_CFG, 4)
    found = asyncio.run(backend.programmed())
    assert found == _expected_programmed(kube_proxy_state(), KUBE_PROXY_CFG, 4)
    assert found[("172.30.0.45", "TCP", 80)] == {"10.180.0.3:80"}     # the affinity Service
    assert found[("172.30.0.46", "TCP", 80)] == frozenset()           # no endpoints
    assert asyncio.run(backend.programmed_ports()) == set(found)
    assert readback.nftables_ports(6, netns) == set()      # no table of that family
    # a runner that is not the kernel's is never read behind its back
    assert asyncio.run(NftablesBackend(RecordingRunner(), KUBE_PROXY_CFG, 4).programmed()) == {}
    assert asyncio.run(NftablesBackend(RecordingRunner(), KUBE_PROXY_CFG, 4).programmed_ports()) is None


def _random_steps(rnd, steps: int):
    """(records, endpoints_only) after each of `steps` random changes to a 30-Service cluster."""
    records = synthetic_records(30, 4, nodeport_every=3, node_name="node-0")
    extra = 0
    for _ in range(steps):
        kind = rnd.choice(["drop-ep", "add-ep", "ready", "terminating", "move", "drop-ep", "add-ep",
                           "add-svc", "del-svc", "etp", "itp", "affinity", "nodeport", "zero", "replace", "replace"])
        services = [r for k, r in records if k == "Service"]
        target = rnd.choice(services)
        key = (target.namespace, target.name)
        endpoints_only = kind in ("drop-ep", "add-ep", "ready", "terminating", "move", "zero", "replace")
        out = []
        for k, r in records:
            if k == "EndpointSlice" and (r.namespace, r.service) == key and endpoints_only:
                eps = list(r.endpoints)
                i = rnd.randrange(len(eps)) if eps else 0
                if kind == "drop-ep" and eps:
                    eps.pop(i)
                elif kind == "add-ep":
                    extra += 1
                    eps.append(Endpoint((f"10.200.{extra // 250}.{extra % 250 + 1}",),
                                        node_name=rnd.choice(["node-0", "node-1"])))
                elif kind == "replace" and eps:     # a Pod recreated: another address in its place
                    extra += 1
                    eps[i] = replace(eps[i], addresses=(f"10.202.{extra // 250}.{extra % 250 + 1}",))
                elif kind == "ready" and eps:
                    eps[i] = replace(eps[i], ready=not eps[i].ready)
                elif kind == "terminating" and eps:
                    eps[i] = replace(eps[i], ready=False, serving=True, terminating=True)
                elif kind == "move" and eps:
                    eps[i] = replace(eps[i], node_name="node-1" if eps[i].node_name == "node-0" else "node-0")
                elif kind == "zero":
                    eps = []
                r = replace(r, endpoints=tuple(eps))
            elif k == "Service" and (r.namespace, r.name) == key:
                if kind == "del-svc":
                    continue
                if kind == "etp":
                    r = replace(r, type=NODE_PORT, external_local=not r.external_local,
                                ports=(replace(r.ports[0], node_port=r.ports[0].node_port or 32000 + extra),))
                elif kind == "itp":
                    r = replace(r, internal_local=not r.internal_local)
                elif kind == "affinity":
                    r = replace(r, affinity_timeout=0 if r.affinity_timeout else 60)
                elif kind == "nodeport":
                    r = replace(r, type=NODE_PORT, ports=(replace(r.ports[0], node_port=31000 + rnd.randrange(500)),))
            out.append((k, r))
        if kind == "add-svc":
            extra += 1
            name = f"rnd-{extra}"
            out.append(("Service", Service("ns-0", name, cluster_ips=(f"10.96.200.{extra % 250 + 1}",),
                                           ports=(ServicePort("http", rnd.choice(["TCP", "UDP"]), 80),))))
            out.append(("EndpointSlice", EndpointSlice(
                "ns-0", f"{name}-x", name, "IPv4",
                tuple(Endpoint((f"10.201.{extra % 250}.{j + 1}",), node_name="node-0") for j in range(3)),
                (EndpointPort("http", out[-1][1].ports[0].protocol, 8080),))))
        records = out
        yield records, endpoints_only


@needs_netns
def test_random_changes_over_netlink_equal_a_fresh_full_load(namespaces):
    """Many random changes, each applied as the proxier does (netlink batch), against a fresh full load."""
    import random

    from clusterdns.proxy import nflink
    rnd = random.Random(20261201)
    live, fresh = namespaces.add("live"), namespaces.add("fresh")
    cfg = Config.from_options(command="rules", node_name="node-0", node_ips=("192.168.0.2",), cluster_cidrs=("10.0.0.0/8",),
                 service_cidrs=("10.96.0.0/12",))
    records = synthetic_records(30, 4, nodeport_every=3, node_name="node-0")
    st = state_from_records(records)
    rs = nftables.render(st, cfg, 4)
    assert nft(live, rs.text).returncode == 0
    element_only = 0
    try:
        for step, (records, endpoints_only) in enumerate(_random_steps(rnd, 60)):
            new = state_from_records(records)
            rs = nftables.render(new, cfg, 4, previous=rs.state, changed=_changed(st, new))
            lines = rs.text.splitlines()
            aff = any(s.affinity_timeout for s in new.services.values() if s.key in _changed(st, new))
            if endpoints_only and not aff:
                # an endpoint change touches elements only: the kernel never re-validates the table for it
                assert all(line.split()[1] == "element" for line in lines), (step, lines)
                element_only += 1
            assert nflink.supported(rs.ops), rs.text
            nflink.apply(rs.ops, 4, netns=live)
            _assert_same_state(rs.state, nftables.build(new, cfg, 4))
            if step % 6 == 5 or step == 59:
                r = nft(fresh, nftables.render(new, cfg, 4).text)
                assert r.returncode == 0, r.stderr[:2000]
                assert listing(live) == listing(fresh), step
                assert nftables.programmed(4, netns=live) == _expected_programmed(new, cfg, 4)
            st = new
    finally:
        nflink.close_all()
    assert element_only >= 15


def test_a_replaced_endpoint_takes_the_share_of_the_one_it_replaces():
    """A Pod recreated in a Service of 500 endpoints in 5 slices: one range element changes
    its endpoint and one hairpin pair is swapped; every other endpoint keeps its share."""
    from clusterdns.synthetic import envelope_records
    cfg = Config.from_options(command="rules", node_name="node-0", node_ips=("192.168.0.2",),
                              cluster_cidrs=("10.0.0.0/8",))
    records = envelope_records(services=20, endpoints=1180, big=500, headless=2)
    st = state_from_records(records)
    full = nftables.render(st, cfg, 4)
    key = ("ns-0", "big")
    (name, offset, before), = full.state.owned[key].ranges
    assert len(before) == 500
    prev, cur = full.state, records
    for i, victim in enumerate(("10.0.1.30", "10.0.2.200", "10.250.0.1")):   # the last: a replacement's
        new_ip = f"10.250.0.{i + 1}"
        cur = [(k, replace(r, endpoints=tuple(replace(e, addresses=(new_ip,)) if e.addresses == (victim,) else e
                                             for e in r.endpoints)))
               if k == "EndpointSlice" and r.service == "big" else (k, r) for k, r in cur]
        new = state_from_records(cur)
        rs = nftables.render(new, cfg, 4, previous=prev, changed={key})
        assert _statements(rs.text) == sorted([
            f"delete element ip kube-proxy {name} {{ {_range_of(before, victim, offset)} }}",
            f"add element ip kube-proxy {name} {{ {_range_of(before, victim, offset)} : {new_ip} . 8080 }}",
            f"delete element ip kube-proxy hairpin {{ {victim} . {victim} }}",
            f"add element ip kube-proxy hairpin {{ {new_ip} . {new_ip} }}"]), i
        (_, _, after), = rs.state.owned[key].ranges
        assert [e.endpoint for e in after] == [e.endpoint if e.ip != victim else f"{new_ip}:8080" for e in before]
        # the same table as a render of the state from scratch, but for who holds which share
        _assert_same_state(rs.state, nftables.build(new, cfg, 4))
        targeted_general = nftables.render(new, cfg, 4, previous=prev)
        _assert_same_state(rs.state, targeted_general.state)
        assert _statements(targeted_general.text) == _statements(rs.text)
        prev, before = rs.state, after
    # one endpoint fewer: every share moves
    cur = [(k, replace(r, endpoints=r.endpoints[1:])) if k == "EndpointSlice" and r.name == "big-000" else (k, r)
           for k, r in cur]
    rs = nftables.render(state_from_records(cur), cfg, 4, previous=prev, changed={key})
    added = [s for s in _statements(rs.text) if s.startswith(f"add element ip kube-proxy {name} ")]
    assert len(added) == 499


def _range_of(eps, ip: str, offset: int) -> str:
    i = next(i for i, e in enumerate(eps) if e.ip == ip)
    lo, hi = nftables.shares(len(eps), offset)[i]
    return f"{lo}-{hi}"
