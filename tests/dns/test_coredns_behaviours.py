"""CoreDNS kubernetes-plugin behaviours, table-driven, over real UDP and TCP sockets.

Each case is asked in lower case and in a mixed-case spelling: owner names echo the
question, names made from objects are the object names followed by the zone as the
question spells it (PTR targets: the configured primary zone).
"""
from __future__ import annotations

import dns.flags
import dns.message
import dns.query
import dns.rcode
import dns.rdatatype
import dns.zone
import pytest

from clusterdns.model import Endpoint, EndpointPort, EndpointSlice, Namespace, Service, ServicePort
from tests.dns.dnskit import LiveServer

HTTP = EndpointPort("http", "TCP", 8080)
METRICS = EndpointPort("metrics", "TCP", 9090)

RECORDS = [
    ("Namespace", Namespace("ns", (("team", "x"),))),
    ("Namespace", Namespace("other")),
    # ClusterIP, dual-stack, a named and an unnamed port; endpoints with and without hostname
    ("Service", Service("ns", "web", cluster_ips=("10.0.0.1", "fd00::1"),
                        ports=(ServicePort("http", "TCP", 80), ServicePort("", "TCP", 9000)))),
    ("EndpointSlice", EndpointSlice("ns", "web-1", "web", endpoints=(
        Endpoint(("10.1.0.1",), hostname="a"), Endpoint(("10.1.0.2",))), ports=(HTTP,))),
    # headless: two hostnames share 10.2.0.1; a second slice without ports
    ("Service", Service("ns", "hl", headless=True)),
    ("EndpointSlice", EndpointSlice("ns", "hl-1", "hl", endpoints=(
        Endpoint(("10.2.0.1",), hostname="a"), Endpoint(("10.2.0.1",), hostname="b"),
        Endpoint(("10.2.0.2",), hostname="c")), ports=(HTTP, METRICS))),
    ("EndpointSlice", EndpointSlice("ns", "hl-2", "hl", endpoints=(Endpoint(("10.2.0.9",), hostname="noports"),))),
    # a namespace without the label --namespace-labels selects
    ("Service", Service("other", "svc", cluster_ips=("10.0.9.9",))),
]


def spellings(name: str) -> list[str]:
    mixed = ".".join(label.upper() if i % 2 else label.capitalize() for i, label in enumerate(name.split(".")))
    return [name, mixed]


def zone_as_asked(qname: str, labels: int = 2) -> str:
    return ".".join(qname.rstrip(".").split(".")[-labels:]) + "."


@pytest.fixture(scope="module")
def server():
    srv = LiveServer(RECORDS, transfer=True)
    yield srv
    srv.close()


def exact(rrset) -> list[str]:
    """Records as text, the owner name spelled exactly as sent."""
    return sorted(f"{rrset.name.to_text()} {rd.to_text()}" for rd in rrset)


# (qname, SRV records as (weight, port, target object part), glue as (object part, address))
SRV_CASES = [
    ("_http._tcp.hl.ns.svc.cluster.local", [(33, 8080, "a.hl.ns.svc"), (33, 8080, "b.hl.ns.svc"),
                                            (33, 8080, "c.hl.ns.svc")],
     [("a.hl.ns.svc", "10.2.0.1"), ("b.hl.ns.svc", "10.2.0.1"), ("c.hl.ns.svc", "10.2.0.2")]),
    # 7 matches: 3 names x 2 ports, and the port-less endpoint (counted, as CoreDNS's sentinel port)
    ("hl.ns.svc.cluster.local", [(14, p, f"{n}.hl.ns.svc") for n in "abc" for p in (8080, 9090)],
     [("a.hl.ns.svc", "10.2.0.1"), ("b.hl.ns.svc", "10.2.0.1"), ("c.hl.ns.svc", "10.2.0.2")]),
    ("web.ns.svc.cluster.local", [(25, 80, "web.ns.svc"), (25, 9000, "web.ns.svc")],
     [("web.ns.svc", "10.0.0.1"), ("web.ns.svc", "fd00::1")]),
    ("_http._tcp.web.ns.svc.cluster.local", [(50, 80, "web.ns.svc")],
     [("web.ns.svc", "10.0.0.1"), ("web.ns.svc", "fd00::1")]),
    # SRV at an endpoint's own name: that endpoint's ports, its addresses as glue
    ("a.hl.ns.svc.cluster.local", [(50, 8080, "a.hl.ns.svc"), (50, 9090, "a.hl.ns.svc")],
     [("a.hl.ns.svc", "10.2.0.1")]),
    ("c.hl.ns.svc.cluster.local", [(50, 8080, "c.hl.ns.svc"), (50, 9090, "c.hl.ns.svc")],
     [("c.hl.ns.svc", "10.2.0.2")]),
    ("a.web.ns.svc.cluster.local", [(100, 8080, "a.web.ns.svc")], [("a.web.ns.svc", "10.1.0.1")]),
    ("10-1-0-2.web.ns.svc.cluster.local", [(100, 8080, "10-1-0-2.web.ns.svc")],
     [("10-1-0-2.web.ns.svc", "10.1.0.2")]),
]


@pytest.mark.parametrize("tcp", [False, True], ids=["udp", "tcp"])
@pytest.mark.parametrize("base,srvs,glue", SRV_CASES, ids=[c[0] for c in SRV_CASES])
def test_srv_target_and_glue_spell_the_zone_as_asked(server, base, srvs, glue, tcp):
    for qname in spellings(base):
        m = server.query(qname, "SRV", tcp=tcp)
        assert m.rcode() == dns.rcode.NOERROR and m.flags & dns.flags.AA
        zone = zone_as_asked(qname)
        [answer] = m.answer
        assert answer.name.to_text() == qname + "."          # the owner echoes the question
        assert sorted((rd.priority, rd.weight, rd.port, rd.target.to_text()) for rd in answer) == sorted(
            (0, w, p, f"{t}.{zone}") for w, p, t in srvs)
        targets = {rd.target.to_text() for rd in answer}
        got_glue = sorted((rrset.name.to_text(), rd.address) for rrset in m.additional for rd in rrset)
        assert got_glue == sorted((f"{t}.{zone}", ip) for t, ip in glue)
        # the glue owner is the target, spelled the same (byte for byte, not just case-insensitively)
        assert {name for name, _ in got_glue} <= targets


def test_srv_at_an_endpoint_without_ports_or_unknown(server):
    for qname in spellings("noports.hl.ns.svc.cluster.local"):
        m = server.query(qname, "SRV")
        assert m.rcode() == dns.rcode.NOERROR and not m.answer and m.authority[0].rdtype == dns.rdatatype.SOA
        assert [rd.address for rd in server.query(qname, "A").answer[0]] == ["10.2.0.9"]
    for qname in spellings("zz.hl.ns.svc.cluster.local"):
        assert server.query(qname, "SRV").rcode() == dns.rcode.NXDOMAIN


PTR_CASES = [
    ("1.0.2.10.in-addr.arpa", ["a.hl.ns.svc.cluster.local.", "b.hl.ns.svc.cluster.local."]),   # shared address
    ("2.0.2.10.in-addr.arpa", ["c.hl.ns.svc.cluster.local."]),
    ("1.0.0.10.in-addr.arpa", ["web.ns.svc.cluster.local."]),
    ("2.0.1.10.in-addr.arpa", ["10-1-0-2.web.ns.svc.cluster.local."]),
]


@pytest.mark.parametrize("tcp", [False, True], ids=["udp", "tcp"])
@pytest.mark.parametrize("base,targets", PTR_CASES, ids=[c[0] for c in PTR_CASES])
def test_ptr_answers_every_name_of_an_address(server, base, targets, tcp):
    for qname in spellings(base):
        m = server.query(qname, "PTR", tcp=tcp)
        assert m.rcode() == dns.rcode.NOERROR
        [answer] = m.answer
        assert answer.name.to_text() == qname + "."
        assert sorted(rd.target.to_text() for rd in answer) == targets


def test_shared_address_ptr_after_an_incremental_update():
    srv = LiveServer(RECORDS)
    try:
        assert len(srv.query("1.0.2.10.in-addr.arpa", "PTR").answer[0]) == 2
        # unrelated change (incremental compile), then a third name for the shared address
        srv.store.upsert("Service", Service("ns", "new", cluster_ips=("10.0.0.7",)))
        assert len(srv.query("1.0.2.10.in-addr.arpa", "PTR").answer[0]) == 2
        srv.store.upsert("EndpointSlice", EndpointSlice("ns", "hl-3", "hl", endpoints=(
            Endpoint(("10.2.0.1",), hostname="d"),)))
        got = sorted(rd.target.to_text() for rd in srv.query("1.0.2.10.in-addr.arpa", "PTR").answer[0])
        assert got == [f"{n}.hl.ns.svc.cluster.local." for n in "abd"]
    finally:
        srv.close()


def transfer(server, zone: str) -> list[tuple[str, int, int, int, str]]:
    """(owner, priority, weight, port, target) of every SRV in an AXFR over TCP, names as sent."""
    out = []
    for m in dns.query.xfr("127.0.0.1", zone, port=server.port, timeout=5, lifetime=10, relativize=False):
        for rrset in m.answer:
            if rrset.rdtype == dns.rdatatype.SRV:
                out += [(rrset.name.to_text(), rd.priority, rd.weight, rd.port, rd.target.to_text()) for rd in rrset]
    return sorted(out)


@pytest.mark.parametrize("zone", spellings("cluster.local"))
def test_transfer_srv_weights_per_name_and_port(server, zone):
    z = zone + "."
    got = [r for r in transfer(server, zone) if ".ns.svc." in r[0].lower()]
    assert got == sorted([
        # headless: one record per endpoint name at the port's name: 100 / 3
        *[(f"_http._tcp.hl.ns.svc.{z}", 0, 33, 8080, f"{n}.hl.ns.svc.{z}") for n in "abc"],
        *[(f"_metrics._tcp.hl.ns.svc.{z}", 0, 33, 9090, f"{n}.hl.ns.svc.{z}") for n in "abc"],
        # ClusterIP: one record per (name, port), weight 100 (a query counts both addresses: 25 / 50)
        (f"web.ns.svc.{z}", 0, 100, 80, f"web.ns.svc.{z}"),
        (f"web.ns.svc.{z}", 0, 100, 9000, f"web.ns.svc.{z}"),
        (f"_http._tcp.web.ns.svc.{z}", 0, 100, 80, f"web.ns.svc.{z}"),
    ])


def test_namespace_labels_hide_ptr_of_unselected_namespaces():
    """Deliberate difference (docs/dns.md): CoreDNS answers this PTR, we keep the namespace hidden."""
    srv = LiveServer(RECORDS, namespace_labels="team=x")
    try:
        for qname in spellings("9.9.0.10.in-addr.arpa"):
            m = srv.query(qname, "PTR")
            assert m.rcode() == dns.rcode.NXDOMAIN and m.authority[0].name.to_text().lower() == "in-addr.arpa."
        assert srv.query("svc.other.svc.cluster.local").rcode() == dns.rcode.NXDOMAIN
        for qname in spellings("1.0.0.10.in-addr.arpa"):       # the selected namespace still answers
            assert [rd.target.to_text() for rd in srv.query(qname, "PTR").answer[0]] == ["web.ns.svc.cluster.local."]
    finally:
        srv.close()
