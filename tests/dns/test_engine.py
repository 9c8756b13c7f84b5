"""The answer engine, pure (no sockets): every answer parsed by dnspython, an independent parser.

Cases are (qname, qtype) -> (rcode, answer / authority / additional as zone-file lines).
Every query goes through resolve() twice and fast(): the helpers in conftest.py
assert the three replies are byte-identical whenever fast() answers.
"""
from __future__ import annotations

import asyncio
import struct

import dns.edns
import dns.flags
import dns.message
import dns.opcode
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.reversename
import dns.rrset
import pytest
from dnslib import QTYPE, RR, DNSRecord

from clusterdns.model import Endpoint, EndpointPort, EndpointSlice, Namespace, Service, ServicePort
from tests.dns.dnskit import SERIAL, ask, ask_wire, lines, make_engine, make_state, query_wire


def soa(zone: str = "cluster.local", ttl: int = 5, minimum: int = 5) -> str:
    return (f"{zone}. {ttl} in soa ns.dns.{zone}. hostmaster.{zone}. {SERIAL} 7200 1800 86400 {minimum}")


SOA = soa()
SOA_V4 = soa("in-addr.arpa")
SOA_V6 = soa("ip6.arpa")
CL = "svc.cluster.local."


V6_EP = dns.reversename.from_address("fd00:161::2").to_text(omit_final_dot=True)


def a(owner: str, *ips: str, ttl: int = 5) -> list[str]:
    return [f"{owner} {ttl} in {'aaaa' if ':' in ip else 'a'} {ip}" for ip in ips]


# --- the demo cluster, default options ----------------------------------------------------

DEMO = [
    # ClusterIP services
    ("testapp-svc.testapp.svc.cluster.local", "A", "NOERROR", a(f"testapp-svc.testapp.{CL}", "172.20.36.232"), [], []),
    ("testapp-svc.testapp.svc.cluster.local", "AAAA", "NOERROR", [], [SOA], []),
    ("testapp-svc.testapp.svc.cluster.local", "TXT", "NOERROR", [], [SOA], []),
    ("testapp-svc.testapp.svc.cluster.local", "MX", "NOERROR", [], [SOA], []),
    ("testapp-svc.testapp.svc.cluster.local", "CNAME", "NOERROR", [], [SOA], []),
    ("testapp-svc.testapp.svc.cluster.local", "SOA", "NOERROR", [], [SOA], []),
    ("testapp-svc.testapp.svc.cluster.local", "NS", "NOERROR", [], [SOA], []),
    ("testapp-svc.testapp.svc.cluster.local", "ANY", "NOERROR",
     [f'testapp-svc.testapp.{CL} 5 in hinfo "rfc8482" ""'], [], []),
    ("testapp-svc.testapp.svc.cluster.local", "SRV", "NOERROR",
     [f"testapp-svc.testapp.{CL} 5 in srv 0 100 8080 testapp-svc.testapp.{CL}"], [],
     a(f"testapp-svc.testapp.{CL}", "172.20.36.232")),
    ("nope.testapp.svc.cluster.local", "A", "NXDOMAIN", [], [SOA], []),
    ("nope.testapp.svc.cluster.local", "ANY", "NXDOMAIN", [], [SOA], []),
    # dual stack, named ports, SRV weights
    ("multiport.testapp.svc.cluster.local", "A", "NOERROR", a(f"multiport.testapp.{CL}", "172.20.50.5"), [], []),
    ("multiport.testapp.svc.cluster.local", "AAAA", "NOERROR", a(f"multiport.testapp.{CL}", "fd00:20::5"), [], []),
    ("multiport.testapp.svc.cluster.local", "SRV", "NOERROR",
     [f"multiport.testapp.{CL} 5 in srv 0 16 {p} multiport.testapp.{CL}" for p in (80, 443, 53)], [],
     a(f"multiport.testapp.{CL}", "172.20.50.5", "fd00:20::5")),
    ("_http._tcp.multiport.testapp.svc.cluster.local", "SRV", "NOERROR",
     [f"_http._tcp.multiport.testapp.{CL} 5 in srv 0 50 80 multiport.testapp.{CL}"], [],
     a(f"multiport.testapp.{CL}", "172.20.50.5", "fd00:20::5")),
    ("_HTTPS._TCP.multiport.testapp.svc.cluster.local", "SRV", "NOERROR",
     [f"_https._tcp.multiport.testapp.{CL} 5 in srv 0 50 443 multiport.testapp.{CL}"], [],
     a(f"multiport.testapp.{CL}", "172.20.50.5", "fd00:20::5")),
    ("dns.udp.multiport.testapp.svc.cluster.local", "SRV", "NOERROR",
     [f"dns.udp.multiport.testapp.{CL} 5 in srv 0 50 53 multiport.testapp.{CL}"], [],
     a(f"multiport.testapp.{CL}", "172.20.50.5", "fd00:20::5")),
    ("_http._udp.multiport.testapp.svc.cluster.local", "SRV", "NXDOMAIN", [], [SOA], []),
    ("_nope._tcp.multiport.testapp.svc.cluster.local", "SRV", "NXDOMAIN", [], [SOA], []),
    ("_http._tcp.multiport.testapp.svc.cluster.local", "A", "NOERROR",       # CoreDNS: the ClusterIP
     a(f"_http._tcp.multiport.testapp.{CL}", "172.20.50.5"), [], []),
    ("_http._tcp.multiport.testapp.svc.cluster.local", "TXT", "NOERROR", [], [SOA], []),
    ("kube-dns.kube-system.svc.cluster.local", "SRV", "NOERROR",            # 53/UDP + 53/TCP collapse
     [f"kube-dns.kube-system.{CL} 5 in srv 0 33 53 kube-dns.kube-system.{CL}",
      f"kube-dns.kube-system.{CL} 5 in srv 0 33 9153 kube-dns.kube-system.{CL}"], [],
     a(f"kube-dns.kube-system.{CL}", "172.20.0.10")),
    ("_dns._udp.kube-dns.kube-system.svc.cluster.local", "SRV", "NOERROR",
     [f"_dns._udp.kube-dns.kube-system.{CL} 5 in srv 0 100 53 kube-dns.kube-system.{CL}"], [],
     a(f"kube-dns.kube-system.{CL}", "172.20.0.10")),
    ("_dns._tcp.kube-dns.kube-system.svc.cluster.local", "SRV", "NXDOMAIN", [], [SOA], []),
    # headless: ready endpoints only, names from hostname or the dashed address
    ("testapp-headless.testapp.svc.cluster.local", "A", "NOERROR",
     a(f"testapp-headless.testapp.{CL}", "10.161.35.2", "10.161.35.3", "10.161.35.4"), [], []),
    ("testapp-headless.testapp.svc.cluster.local", "AAAA", "NOERROR", [], [SOA], []),
    ("_http._tcp.testapp-headless.testapp.svc.cluster.local", "SRV", "NOERROR",
     [f"_http._tcp.testapp-headless.testapp.{CL} 5 in srv 0 33 8080 {n}.testapp-headless.testapp.{CL}"
      for n in ("web-0", "web-1", "10-161-35-4")], [],
     a(f"web-0.testapp-headless.testapp.{CL}", "10.161.35.2") + a(f"web-1.testapp-headless.testapp.{CL}",
                                                                   "10.161.35.3")
     + a(f"10-161-35-4.testapp-headless.testapp.{CL}", "10.161.35.4")),
    ("testapp-headless.testapp.svc.cluster.local", "SRV", "NOERROR",
     [f"testapp-headless.testapp.{CL} 5 in srv 0 33 8080 {n}.testapp-headless.testapp.{CL}"
      for n in ("web-0", "web-1", "10-161-35-4")], [],
     a(f"web-0.testapp-headless.testapp.{CL}", "10.161.35.2") + a(f"web-1.testapp-headless.testapp.{CL}",
                                                                   "10.161.35.3")
     + a(f"10-161-35-4.testapp-headless.testapp.{CL}", "10.161.35.4")),
    ("web-0.testapp-headless.testapp.svc.cluster.local", "A", "NOERROR",
     a(f"web-0.testapp-headless.testapp.{CL}", "10.161.35.2"), [], []),
    ("web-0.testapp-headless.testapp.svc.cluster.local", "AAAA", "NOERROR", [], [SOA], []),
    ("10-161-35-4.testapp-headless.testapp.svc.cluster.local", "A", "NOERROR",
     a(f"10-161-35-4.testapp-headless.testapp.{CL}", "10.161.35.4"), [], []),
    ("web-2.testapp-headless.testapp.svc.cluster.local", "A", "NXDOMAIN", [], [SOA], []),
    ("web-3.testapp-headless.testapp.svc.cluster.local", "A", "NXDOMAIN", [], [SOA], []),   # not ready
    # endpoint names of ClusterIP services (CoreDNS extension), not-ready ones absent
    ("10-161-33-100.testapp-svc.testapp.svc.cluster.local", "A", "NOERROR",
     a(f"10-161-33-100.testapp-svc.testapp.{CL}", "10.161.33.100"), [], []),
    ("10-161-34-12.testapp2-svc.testapp.svc.cluster.local", "A", "NXDOMAIN", [], [SOA], []),
    ("fd00-161--2.multiport.testapp.svc.cluster.local", "AAAA", "NOERROR",
     a(f"fd00-161--2.multiport.testapp.{CL}", "fd00:161::2"), [], []),
    ("fd00-161--2.multiport.testapp.svc.cluster.local", "A", "NOERROR", [], [SOA], []),
    # ExternalName (no forwarder here: the out-of-zone target is not chased)
    ("external-db.testapp.svc.cluster.local", "CNAME", "NOERROR",
     [f"external-db.testapp.{CL} 5 in cname db.example.com."], [], []),
    ("external-db.testapp.svc.cluster.local", "A", "NOERROR",
     [f"external-db.testapp.{CL} 5 in cname db.example.com."], [], []),
    ("external-db.testapp.svc.cluster.local", "TXT", "NOERROR", [], [SOA], []),
    ("external-db.testapp.svc.cluster.local", "SRV", "NOERROR", [], [SOA], []),
    ("_pg._tcp.external-db.testapp.svc.cluster.local", "SRV", "NXDOMAIN", [], [SOA], []),
    ("x.external-db.testapp.svc.cluster.local", "A", "NXDOMAIN", [], [SOA], []),
    # PTR: ClusterIPs, ready endpoints (one per service), IPv6
    ("232.36.20.172.in-addr.arpa", "PTR", "NOERROR",
     [f"232.36.20.172.in-addr.arpa. 5 in ptr testapp-svc.testapp.{CL}"], [], []),
    ("2.35.161.10.in-addr.arpa", "PTR", "NOERROR",
     [f"2.35.161.10.in-addr.arpa. 5 in ptr web-0.testapp-headless.testapp.{CL}"], [], []),
    ("10.34.161.10.in-addr.arpa", "PTR", "NOERROR",
     [f"10.34.161.10.in-addr.arpa. 5 in ptr 10-161-34-10.testapp-lb.testapp.{CL}",
      f"10.34.161.10.in-addr.arpa. 5 in ptr 10-161-34-10.testapp2-svc.testapp.{CL}"], [], []),
    ("12.34.161.10.in-addr.arpa", "PTR", "NXDOMAIN", [], [SOA_V4], []),
    ("232.36.20.172.in-addr.arpa", "A", "NOERROR", [], [SOA_V4], []),
    ("36.20.172.in-addr.arpa", "PTR", "NXDOMAIN", [], [SOA_V4], []),
    ("5.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.2.0.0.0.0.d.f.ip6.arpa", "PTR", "NOERROR",
     [f"5.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.2.0.0.0.0.d.f.ip6.arpa. 5 in ptr multiport.testapp.{CL}"],
     [], []),
    (V6_EP, "PTR", "NOERROR", [f"{V6_EP}. 5 in ptr fd00-161--2.multiport.testapp.{CL}"], [], []),
    ("in-addr.arpa", "SOA", "NOERROR", [SOA_V4], [], []),
    # pods (insecure by default)
    ("10-161-37-5.testapp.pod.cluster.local", "A", "NOERROR",
     a("10-161-37-5.testapp.pod.cluster.local.", "10.161.37.5"), [], []),
    ("1-2-3-4.testapp.pod.cluster.local", "A", "NOERROR", a("1-2-3-4.testapp.pod.cluster.local.", "1.2.3.4"), [], []),
    ("1-2-3-4.testapp.pod.cluster.local", "AAAA", "NOERROR", [], [SOA], []),
    ("fd00--1.testapp.pod.cluster.local", "AAAA", "NOERROR",
     a("fd00--1.testapp.pod.cluster.local.", "fd00::1"), [], []),
    ("1-2-3-4.nope.pod.cluster.local", "A", "NXDOMAIN", [], [SOA], []),
    ("web.testapp.pod.cluster.local", "A", "NXDOMAIN", [], [SOA], []),
    ("testapp.pod.cluster.local", "A", "NOERROR", [], [SOA], []),
    # empty non-terminals and the grammar
    ("cluster.local", "A", "NOERROR", [], [SOA], []),
    ("svc.cluster.local", "A", "NOERROR", [], [SOA], []),
    ("pod.cluster.local", "A", "NOERROR", [], [SOA], []),
    ("testapp.svc.cluster.local", "A", "NOERROR", [], [SOA], []),
    ("testapp.svc.cluster.local", "ANY", "NOERROR", [], [SOA], []),
    ("nope.svc.cluster.local", "A", "NXDOMAIN", [], [SOA], []),
    ("foo.cluster.local", "A", "NXDOMAIN", [], [SOA], []),
    ("a.b._http._tcp.multiport.testapp.svc.cluster.local", "A", "NXDOMAIN", [], [SOA], []),
    ("*.testapp.svc.cluster.local", "A", "NXDOMAIN", [], [SOA], []),
    # apex and schema version
    ("cluster.local", "SOA", "NOERROR", [SOA], [], []),
    ("cluster.local", "NS", "NOERROR", [], [SOA], []),      # no non-loopback server address known
    ("dns-version.cluster.local", "TXT", "NOERROR", ['dns-version.cluster.local. 28800 in txt "1.1.0"'], [], []),
    ("dns-version.cluster.local", "A", "NOERROR", [], [SOA], []),
]


def check(m: dns.message.Message, rcode, answer, authority, additional):
    assert dns.rcode.to_text(m.rcode()) == rcode
    assert m.flags & dns.flags.AA, "zone answers are authoritative"
    assert not m.flags & dns.flags.RA
    assert lines(m.answer) == sorted(answer)
    assert lines(m.authority) == sorted(authority)
    assert lines(m.additional) == sorted(additional)


@pytest.fixture(scope="module")
def engine(demo_state):
    return make_engine(demo_state)


@pytest.mark.parametrize("qname,qtype,rcode,answer,authority,additional", DEMO,
                         ids=[f"{c[0]}/{c[1]}" for c in DEMO])
def test_demo(engine, qname, qtype, rcode, answer, authority, additional):
    check(ask(engine, qname, qtype), rcode, answer, authority, additional)


def test_demo_over_tcp_and_with_edns(engine):
    for kw in ({"tcp": True}, {"use_edns": 0}, {"use_edns": 0, "want_dnssec": True}):
        m = ask(engine, "testapp-svc.testapp.svc.cluster.local", "A", **kw)
        assert lines(m.answer) == a(f"testapp-svc.testapp.{CL}", "172.20.36.232")


# --- options -------------------------------------------------------------------------------

OPTIONS = [
    ({"pods": "disabled"}, [
        ("10-161-37-5.testapp.pod.cluster.local", "A", "NXDOMAIN", [], [SOA], []),
        ("testapp.pod.cluster.local", "A", "NXDOMAIN", [], [SOA], []),
        ("pod.cluster.local", "A", "NOERROR", [], [SOA], []),
    ]),
    ({"pods": "verified"}, [
        ("10-161-37-5.testapp.pod.cluster.local", "A", "NOERROR",
         a("10-161-37-5.testapp.pod.cluster.local.", "10.161.37.5"), [], []),
        ("1-2-3-4.testapp.pod.cluster.local", "A", "NXDOMAIN", [], [SOA], []),
        ("10-161-37-5.default.pod.cluster.local", "A", "NXDOMAIN", [], [SOA], []),
    ]),
    ({"namespaces": ("testapp",)}, [
        ("testapp-svc.testapp.svc.cluster.local", "A", "NOERROR",
         a(f"testapp-svc.testapp.{CL}", "172.20.36.232"), [], []),
        ("kube-dns.kube-system.svc.cluster.local", "A", "NXDOMAIN", [], [SOA], []),
        ("kube-system.svc.cluster.local", "A", "NXDOMAIN", [], [SOA], []),
        ("10.0.20.172.in-addr.arpa", "PTR", "NXDOMAIN", [], [SOA_V4], []),
        ("1-2-3-4.kube-system.pod.cluster.local", "A", "NXDOMAIN", [], [SOA], []),
    ]),
    ({"namespace_labels": "kubernetes.io/metadata.name in (kube-system, default)"}, [
        ("testapp-svc.testapp.svc.cluster.local", "A", "NXDOMAIN", [], [SOA], []),
        ("testapp.svc.cluster.local", "A", "NXDOMAIN", [], [SOA], []),
        ("kube-dns.kube-system.svc.cluster.local", "A", "NOERROR",
         a(f"kube-dns.kube-system.{CL}", "172.20.0.10"), [], []),
        ("232.36.20.172.in-addr.arpa", "PTR", "NXDOMAIN", [], [SOA_V4], []),
    ]),
    ({"endpoint_pod_names": True}, [
        ("web-2.testapp-headless.testapp.svc.cluster.local", "A", "NOERROR",
         a(f"web-2.testapp-headless.testapp.{CL}", "10.161.35.4"), [], []),
        ("10-161-35-4.testapp-headless.testapp.svc.cluster.local", "A", "NXDOMAIN", [], [SOA], []),
        ("web-0.testapp-headless.testapp.svc.cluster.local", "A", "NOERROR",
         a(f"web-0.testapp-headless.testapp.{CL}", "10.161.35.2"), [], []),
        ("4.35.161.10.in-addr.arpa", "PTR", "NOERROR",
         [f"4.35.161.10.in-addr.arpa. 5 in ptr web-2.testapp-headless.testapp.{CL}"], [], []),
    ]),
    ({"noendpoints": True}, [
        ("testapp-headless.testapp.svc.cluster.local", "A", "NXDOMAIN", [], [SOA], []),
        ("web-0.testapp-headless.testapp.svc.cluster.local", "A", "NXDOMAIN", [], [SOA], []),
        ("10-161-33-100.testapp-svc.testapp.svc.cluster.local", "A", "NXDOMAIN", [], [SOA], []),
        ("2.35.161.10.in-addr.arpa", "PTR", "NXDOMAIN", [], [SOA_V4], []),
        ("testapp-svc.testapp.svc.cluster.local", "A", "NOERROR",
         a(f"testapp-svc.testapp.{CL}", "172.20.36.232"), [], []),
        ("_dns._udp.kube-dns.kube-system.svc.cluster.local", "SRV", "NOERROR",
         [f"_dns._udp.kube-dns.kube-system.{CL} 5 in srv 0 100 53 kube-dns.kube-system.{CL}"], [],
         a(f"kube-dns.kube-system.{CL}", "172.20.0.10")),
    ]),
    ({"ttl": 30}, [
        ("testapp-svc.testapp.svc.cluster.local", "A", "NOERROR",
         a(f"testapp-svc.testapp.{CL}", "172.20.36.232", ttl=30), [], []),
        ("nope.testapp.svc.cluster.local", "A", "NXDOMAIN", [], [soa(ttl=30, minimum=30)], []),
        ("dns-version.cluster.local", "TXT", "NOERROR", ['dns-version.cluster.local. 28800 in txt "1.1.0"'], [], []),
    ]),
    ({"ttl": 600}, [
        ("nope.testapp.svc.cluster.local", "A", "NXDOMAIN", [], [soa(ttl=300, minimum=600)], []),
    ]),
    ({"zones": ("corp.example", "cluster.local", "in-addr.arpa")}, [
        ("testapp-svc.testapp.svc.corp.example", "A", "NOERROR",
         a("testapp-svc.testapp.svc.corp.example.", "172.20.36.232"), [], []),
        ("testapp-svc.testapp.svc.cluster.local", "A", "NOERROR",
         a(f"testapp-svc.testapp.{CL}", "172.20.36.232"), [], []),
        ("232.36.20.172.in-addr.arpa", "PTR", "NOERROR",      # PTR targets use the first zone
         ["232.36.20.172.in-addr.arpa. 5 in ptr testapp-svc.testapp.svc.corp.example."], [], []),
        ("nope.svc.corp.example", "A", "NXDOMAIN", [], [soa("corp.example")], []),
    ]),
]


@pytest.mark.parametrize("options,cases", OPTIONS, ids=[",".join(o) + str(list(o.values())) for o, _ in OPTIONS])
def test_options(demo_state, options, cases):
    engine = make_engine(demo_state, **options)
    for qname, qtype, rcode, answer, authority, additional in cases:
        check(ask(engine, qname, qtype), rcode, answer, authority, additional)


def test_ignore_empty_service():
    state = make_state([
        ("Namespace", Namespace("ns")),
        ("Service", Service("ns", "empty", cluster_ips=("10.0.0.1",), ports=(ServicePort("http", "TCP", 80),))),
        ("EndpointSlice", EndpointSlice("ns", "empty-1", "empty", endpoints=(Endpoint(("10.1.0.1",), ready=False),))),
        ("Service", Service("ns", "full", cluster_ips=("10.0.0.2",))),
        ("EndpointSlice", EndpointSlice("ns", "full-1", "full", endpoints=(Endpoint(("10.1.0.2",)),))),
    ])
    plain = make_engine(state)
    assert lines(ask(plain, "empty.ns.svc.cluster.local").answer) == a(f"empty.ns.{CL}", "10.0.0.1")
    engine = make_engine(state, ignore_empty_service=True)
    m = ask(engine, "empty.ns.svc.cluster.local")
    assert m.rcode() == dns.rcode.NXDOMAIN
    assert ask(engine, "_http._tcp.empty.ns.svc.cluster.local", "SRV").rcode() == dns.rcode.NXDOMAIN
    assert lines(ask(engine, "full.ns.svc.cluster.local").answer) == a(f"full.ns.{CL}", "10.0.0.2")


def test_headless_merges_slices_dedups_and_families():
    state = make_state([
        ("Service", Service("ns", "hl", headless=True)),
        ("EndpointSlice", EndpointSlice("ns", "hl-a", "hl", endpoints=(
            Endpoint(("10.1.0.1",)), Endpoint(("10.1.0.2",), hostname="two"), Endpoint(("10.1.0.9",), ready=False)),
            ports=(EndpointPort("http", "TCP", 8080), EndpointPort("", "TCP", 9000)))),
        ("EndpointSlice", EndpointSlice("ns", "hl-b", "hl", endpoints=(
            Endpoint(("10.1.0.1",)), Endpoint(("10.1.0.3",))),       # 10.1.0.1 again: same address twice
            ports=(EndpointPort("http", "TCP", 8080),))),
        ("EndpointSlice", EndpointSlice("ns", "hl-6", "hl", address_type="IPv6", endpoints=(
            Endpoint(("fd00::1",)),))),
        ("Service", Service("ns", "none", headless=True)),
        ("EndpointSlice", EndpointSlice("ns", "none-a", "none", endpoints=(Endpoint(("10.2.0.1",), ready=False),))),
        ("Service", Service("ns", "v6only", headless=True)),
        ("EndpointSlice", EndpointSlice("ns", "v6only-a", "v6only", address_type="IPv6",
                                        endpoints=(Endpoint(("fd00::2",)),))),
    ])
    engine = make_engine(state)
    assert lines(ask(engine, "hl.ns.svc.cluster.local").answer) == sorted(
        a(f"hl.ns.{CL}", "10.1.0.1", "10.1.0.2", "10.1.0.3"))
    assert lines(ask(engine, "hl.ns.svc.cluster.local", "AAAA").answer) == a(f"hl.ns.{CL}", "fd00::1")
    m = ask(engine, "_http._tcp.hl.ns.svc.cluster.local", "SRV")
    # 4 (endpoint, port) matches before de-duplication: weight 25; 10.1.0.1 collapses to one SRV
    assert lines(m.answer) == sorted(
        f"_http._tcp.hl.ns.{CL} 5 in srv 0 25 8080 {n}.hl.ns.{CL}" for n in ("10-1-0-1", "two", "10-1-0-3"))
    assert lines(m.additional) == sorted(
        a(f"10-1-0-1.hl.ns.{CL}", "10.1.0.1") + a(f"two.hl.ns.{CL}", "10.1.0.2") + a(f"10-1-0-3.hl.ns.{CL}",
                                                                                      "10.1.0.3"))
    assert ask(engine, "none.ns.svc.cluster.local").rcode() == dns.rcode.NXDOMAIN
    assert ask(engine, "none.ns.svc.cluster.local", "SRV").rcode() == dns.rcode.NXDOMAIN
    m = ask(engine, "v6only.ns.svc.cluster.local")
    assert m.rcode() == dns.rcode.NOERROR and not m.answer
    # an endpoint hostname shared by several endpoints returns them all
    state2 = make_state([
        ("Service", Service("ns", "hl", headless=True)),
        ("EndpointSlice", EndpointSlice("ns", "hl-a", "hl", endpoints=(
            Endpoint(("10.1.0.1",), hostname="db"), Endpoint(("10.1.0.2",), hostname="db")))),
    ])
    engine = make_engine(state2)
    assert lines(ask(engine, "db.hl.ns.svc.cluster.local").answer) == sorted(
        a(f"db.hl.ns.{CL}", "10.1.0.1", "10.1.0.2"))


def test_ns_and_ns_dns(demo_state):
    # the server is one of kube-dns's endpoints: NS names kube-dns, glue its ClusterIP
    engine = make_engine(demo_state, server_addresses=lambda: ["127.0.0.1", "10.161.0.2"])
    m = ask(engine, "cluster.local", "NS")
    assert lines(m.answer) == [f"cluster.local. 5 in ns kube-dns.kube-system.{CL}"]
    assert lines(m.additional) == a(f"kube-dns.kube-system.{CL}", "172.20.0.10")
    # not an endpoint of any service: ns.dns.<zone> with the server's addresses as glue
    engine = make_engine(demo_state, server_addresses=lambda: ["192.0.2.53", "127.0.0.1"])
    m = ask(engine, "cluster.local", "NS")
    assert lines(m.answer) == ["cluster.local. 5 in ns ns.dns.cluster.local."]
    assert lines(m.additional) == a("ns.dns.cluster.local.", "192.0.2.53")
    assert lines(ask(engine, "ns.dns.cluster.local").answer) == a("ns.dns.cluster.local.", "192.0.2.53")
    m = ask(engine, "dns.cluster.local")
    assert m.rcode() == dns.rcode.NOERROR and not m.answer
    m = ask(engine, "in-addr.arpa", "NS")
    assert lines(m.answer) == ["in-addr.arpa. 5 in ns ns.dns.cluster.local."]


# --- not synced ----------------------------------------------------------------------------

def test_servfail_until_synced(demo_records):
    engine = make_engine(None)
    assert not engine.synced
    m = ask(engine, "testapp-svc.testapp.svc.cluster.local")
    assert m.rcode() == dns.rcode.SERVFAIL and m.flags & dns.flags.AA
    assert lines(m.authority) == [soa().replace(str(SERIAL), "0")]
    # Services listed, EndpointSlices not yet: found names answer, missing ones SERVFAIL
    from clusterdns.state import StateStore
    store = StateStore(clock=lambda: SERIAL - 1)
    with store.batch():
        store.replace("Service", [r for k, r in demo_records if k == "Service"])
        store.replace("Namespace", [r for k, r in demo_records if k == "Namespace"])
        store.replace("EndpointSlice", [], synced=False)
    engine.update(store.current)
    assert not engine.synced
    m = ask(engine, "testapp-svc.testapp.svc.cluster.local")
    assert lines(m.answer) == a(f"testapp-svc.testapp.{CL}", "172.20.36.232")
    assert ask(engine, "nope.testapp.svc.cluster.local").rcode() == dns.rcode.SERVFAIL
    assert engine.fast(query_wire("nope.testapp.svc.cluster.local"), False) is None
    # a name found is answered by the fast path too (a restarted agent, before its first sync),
    # the same answer, never remembered for after the sync
    fast = dns.message.from_wire(engine.fast(query_wire("testapp-svc.testapp.svc.cluster.local"), False))
    assert fast.rcode() == dns.rcode.NOERROR and lines(fast.answer) == lines(m.answer)
    assert not engine.view.memo and not engine.view.probation
    store.mark_synced("EndpointSlice")
    engine.update(store.current)
    assert engine.synced
    assert ask(engine, "nope.testapp.svc.cluster.local").rcode() == dns.rcode.NXDOMAIN


def test_a_new_service_resolves_at_once(demo_records):
    from clusterdns.sources.manifest import publish
    from clusterdns.state import StateStore
    store = StateStore()
    publish(store, demo_records)
    engine = make_engine(store.current)
    assert ask(engine, "new.testapp.svc.cluster.local").rcode() == dns.rcode.NXDOMAIN   # memoised
    store.upsert("Service", Service("testapp", "new", cluster_ips=("172.20.99.9",)))
    engine.update(store.current)
    assert lines(ask(engine, "new.testapp.svc.cluster.local").answer) == a(f"new.testapp.{CL}", "172.20.99.9")


def test_prebuilt_answers_survive_unrelated_changes(demo_records):
    from dataclasses import replace as dc_replace

    from clusterdns.sources.manifest import publish
    from clusterdns.state import StateStore
    store = StateStore()
    publish(store, demo_records)
    engine = make_engine(store.current, namespace_labels="kubernetes.io/metadata.name")
    kept = [query_wire(name, qtype) for name, qtype in (
        ("testapp-svc.testapp.svc.cluster.local", "A"), ("web-0.testapp-headless.testapp.svc.cluster.local", "A"),
        ("_http._tcp.multiport.testapp.svc.cluster.local", "SRV"), ("external-db.testapp.svc.cluster.local", "CNAME"))]
    nodata = query_wire("testapp-svc.testapp.svc.cluster.local", "AAAA")
    kube_dns = query_wire("kube-dns.kube-system.svc.cluster.local", "A")
    before = [ask_wire(engine, w) for w in kept]
    ask_wire(engine, nodata)
    ask_wire(engine, kube_dns)
    # another Service changes: positive answers of untouched Services stay prebuilt
    svc = store.current.services[("testapp", "testapp2-svc")]
    store.upsert("Service", dc_replace(svc, cluster_ips=("172.20.41.99",)))
    engine.update(store.current)
    assert [engine.fast(w, False) for w in kept] == before
    # NODATA of an unchanged Service too, with the new serial in its SOA
    m = dns.message.from_wire(engine.fast(nodata, False))
    assert m.rcode() == dns.rcode.NOERROR and not m.answer
    assert m.authority[0][0].serial == store.current.serial != SERIAL
    # the Service itself changes: the old answer is not taken over; fast() builds the new one
    dns_svc = store.current.services[("kube-system", "kube-dns")]
    store.upsert("Service", dc_replace(dns_svc, cluster_ips=("172.20.0.11",)))
    engine.update(store.current)
    assert engine._carry(engine.view, kube_dns[12:-4].lower() + kube_dns[-4:-2]) is None
    assert lines(dns.message.from_wire(engine.fast(kube_dns, False)).answer) == a(
        f"kube-dns.kube-system.{CL}", "172.20.0.11")
    assert lines(ask(engine, "kube-dns.kube-system.svc.cluster.local").answer) == a(
        f"kube-dns.kube-system.{CL}", "172.20.0.11")
    # its namespace stops matching --namespace-labels: the unchanged Service is no longer served
    store.upsert("Namespace", Namespace("testapp", ()))
    engine.update(store.current)
    assert dns.message.from_wire(engine.fast(kept[0], False)).rcode() == dns.rcode.NXDOMAIN
    assert ask(engine, "testapp-svc.testapp.svc.cluster.local").rcode() == dns.rcode.NXDOMAIN


# --- wire ----------------------------------------------------------------------------------

def resolve(engine, wire: bytes, tcp: bool = False, client: str = "10.161.37.5"):
    return asyncio.run(engine.resolve(wire, client, tcp))


def test_question_echoed_exactly_and_case_kept(engine):
    q = dns.message.make_query("TestApp-SVC.testapp.SVC.Cluster.Local", "A")
    q.id = 4242
    q.flags |= dns.flags.CD
    wire = q.to_wire()
    reply = ask_wire(engine, wire)
    qlen = len(wire) - 12
    assert reply[:2] == wire[:2]
    assert reply[12:12 + qlen] == wire[12:]
    m = dns.message.from_wire(reply)
    assert m.id == 4242 and m.flags & dns.flags.RD and m.flags & dns.flags.CD and m.flags & dns.flags.QR
    assert m.answer[0].name.to_text() == "TestApp-SVC.testapp.SVC.Cluster.Local."


def test_edns_echo_payload_and_do(engine):
    m = ask(engine, "testapp-svc.testapp.svc.cluster.local", use_edns=0, payload=4096, want_dnssec=True)
    assert m.edns == 0 and m.payload == 1232 and m.ednsflags & dns.flags.DO
    m = ask(engine, "testapp-svc.testapp.svc.cluster.local", use_edns=0, payload=512)
    assert m.edns == 0 and m.payload == 1232 and not m.ednsflags & dns.flags.DO
    m = ask(engine, "testapp-svc.testapp.svc.cluster.local")
    assert m.edns == -1
    # an EDNS option (cookie) is ignored: same answer, no option echoed
    opt = dns.edns.GenericOption(10, b"\x01" * 8)
    m = ask(engine, "testapp-svc.testapp.svc.cluster.local", use_edns=0, options=[opt])
    assert m.edns == 0 and not m.options and len(m.answer) == 1


def strip_options(wire: bytes) -> bytes:
    """The query with its (last-record) OPT's options removed."""
    qend = wire.index(b"\x00", 12) + 5
    assert wire[qend + 2] == 41
    return wire[:qend + 9] + b"\x00\x00"


def dig_query_bytes(*args: str) -> bytes:
    """What dig really sends (its defaults: EDNS with a COOKIE), caught on a local socket."""
    import socket
    import subprocess
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.settimeout(5)
    proc = subprocess.Popen(["dig", "@127.0.0.1", "-p", str(sock.getsockname()[1]), "+time=1", "+tries=1",
                             *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        return sock.recv(4096)
    finally:
        proc.kill()
        proc.wait()
        sock.close()


@pytest.mark.skipif(__import__("shutil").which("dig") is None, reason="dig (bind9-dnsutils) not installed")
@pytest.mark.parametrize("args", [("testapp-svc.testapp.svc.cluster.local",),
                                  ("+dnssec", "TestApp-Svc.testapp.svc.cluster.local", "SRV"),
                                  ("nope.testapp.svc.cluster.local",),
                                  ("+bufsize=512", "testapp-headless.testapp.svc.cluster.local")])
def test_dig_default_cookie_query_takes_the_fast_path(engine, args):
    wire = dig_query_bytes(*args)
    plain = strip_options(wire)
    assert len(wire) > len(plain)                    # dig did send an option (its COOKIE)
    first = ask_wire(engine, wire)                 # resolve() answers it; fast() agrees byte for byte
    assert first == ask_wire(engine, plain)        # the option changes nothing in the answer
    assert engine.fast(wire, False) == first         # and it is answered on the fast path
    m = dns.message.from_wire(first)
    assert m.edns == 0 and not m.options


@pytest.mark.parametrize("optdata", [
    b"\x00\x0a\x00\x08" + b"\x01" * 7,                 # option longer than the OPT data
    b"\x00\x0a\x00",                                    # a partial option header
    b"\x00\x0a\x00\x02\x01\x02\x00\x0b",                # a second, partial option
])
def test_malformed_edns_options_are_not_taken_on_the_fast_path(engine, optdata):
    base = query_wire("testapp-svc.testapp.svc.cluster.local", use_edns=0)
    wire = base[:-2] + struct.pack(">H", len(optdata)) + optdata
    assert engine.fast(wire, False) is None
    reply = resolve(engine, wire)
    assert reply is None or (reply[3] & 0xF) in (dns.rcode.NOERROR, dns.rcode.FORMERR)


def test_two_well_formed_options_are_ignored(engine):
    opts = [dns.edns.GenericOption(10, b"\x01" * 8), dns.edns.GenericOption(65001, b"")]
    wire = query_wire("testapp-svc.testapp.svc.cluster.local", use_edns=0, options=opts)
    assert engine.fast(wire, False) is not None
    assert ask_wire(engine, wire) == ask_wire(engine, strip_options(wire))


def test_badvers(engine):
    wire = dns.message.make_query("testapp-svc.testapp.svc.cluster.local", "A", use_edns=1).to_wire()
    assert engine.fast(wire, False) is None
    m = dns.message.from_wire(resolve(engine, wire))
    assert m.rcode() == dns.rcode.BADVERS and m.edns == 0 and not m.answer


def big_headless(n=40):
    return make_state([
        ("Service", Service("ns", "big", headless=True)),
        ("EndpointSlice", EndpointSlice("ns", "big-1", "big", endpoints=tuple(
            Endpoint((f"10.3.{i // 250}.{i % 250 + 1}",)) for i in range(n)))),
    ])


@pytest.mark.parametrize("kw,tcp,limit,full", [
    ({}, False, 512, False),
    ({"use_edns": 0, "payload": 512}, False, 512, False),
    ({"use_edns": 0, "payload": 100}, False, 512, False),       # below 512 counts as 512
    ({"use_edns": 0, "payload": 1232}, False, 1232, True),
    ({"use_edns": 0, "payload": 4096}, False, 1232, True),
    ({}, True, 65535, True),
])
def test_truncation_40_records(kw, tcp, limit, full):
    engine = make_engine(big_headless())
    wire = query_wire("big.ns.svc.cluster.local", "A", **kw)
    reply = ask_wire(engine, wire, tcp=tcp)
    assert len(reply) <= limit
    m = dns.message.from_wire(reply)
    n = sum(len(r) for r in m.answer)
    if full:
        assert n == 40 and not m.flags & dns.flags.TC
    else:
        assert 0 < n < 40 and m.flags & dns.flags.TC
        assert n == 29 if "payload" not in kw else n >= 28   # CoreDNS: 29 of 40 fit in 512 bytes
    assert (m.edns == 0) == ("use_edns" in kw)


def test_udp_never_exceeds_1232():
    engine = make_engine(big_headless(200))
    reply = ask_wire(engine, query_wire("big.ns.svc.cluster.local", "A", use_edns=0, payload=65000))
    m = dns.message.from_wire(reply)
    assert len(reply) <= 1232 and m.flags & dns.flags.TC and m.payload == 1232
    reply = ask_wire(engine, query_wire("big.ns.svc.cluster.local", "A"), tcp=True)
    assert sum(len(r) for r in dns.message.from_wire(reply).answer) == 200


@pytest.mark.parametrize("n,qtype", [(2, "A"), (3, "A"), (10, "A"), (40, "A"), (9, "AAAA")])
def test_rotations_by_reordering_equal_packing_each_rotation(n, qtype):
    from clusterdns.dns import names
    from clusterdns.dns.wire import pack_body, rotations
    v6 = qtype == "AAAA"
    state = make_state([
        ("Service", Service("ns", "big", headless=True)),
        ("EndpointSlice", EndpointSlice("ns", "big-1", "big", address_type="IPv6" if v6 else "IPv4",
                                        endpoints=tuple(Endpoint((f"fd00::{i + 1:x}" if v6 else f"10.3.0.{i + 1}",))
                                                        for i in range(n)))),
    ])
    engine = make_engine(state)
    raw = (b"Big", b"ns", b"svc", b"cluster", b"local")
    ans = engine.view.lookup(names.split_name("big.ns.svc.cluster.local"), getattr(QTYPE, qtype))
    entry = engine._entry_for(raw, ans)
    lower = tuple(x.lower() for x in raw)
    expected = [pack_body(lower, v) for v in rotations(ans.answer)]
    assert len(entry.bodies) == min(n, 8)
    assert [(b.data, b.ends, b.an, b.ns, b.ar) for b in entry.bodies] == [
        (b.data, b.ends, b.an, b.ns, b.ar) for b in expected]


def test_packing_equals_dnslibs_own_encoder(demo_state):
    """wire._Buffer compresses names as dnslib's DNSBuffer does (below 16 KiB, where they agree)."""
    from dnslib.label import DNSBuffer

    from clusterdns.dns import names, wire
    engine = make_engine(demo_state, server_addresses=lambda: ["10.161.0.2"])
    ours_buffer = wire._Buffer
    compared = 0
    for qname, qtype, *_ in DEMO:
        labels = names.split_name(qname)
        if names.zone_of(labels, engine.view.zones) is None:
            continue
        ans = engine.view.lookup(labels, getattr(QTYPE, qtype))
        raw = tuple(x.encode() for x in labels)
        ours = wire.pack_body(raw, ans.answer, ans.authority, ans.additional)
        try:
            wire._Buffer = DNSBuffer
            theirs = wire.pack_body(raw, ans.answer, ans.authority, ans.additional)
        finally:
            wire._Buffer = ours_buffer
        assert (ours.data, ours.ends) == (theirs.data, theirs.ends), (qname, qtype)
        compared += 1
    assert compared > 40


def test_loadbalance_rotates_addresses():
    engine = make_engine(big_headless(10))
    firsts, sets = set(), set()
    for qid in range(16):
        q = dns.message.make_query("big.ns.svc.cluster.local", "A")
        q.id = qid
        m = dns.message.from_wire(ask_wire(engine, q.to_wire()))
        rrs = [r.to_text() for r in m.answer[0]]
        firsts.add(rrs[0])
        sets.add(frozenset(rrs))
    assert len(firsts) > 1 and len(sets) == 1


def header(qid=7, flags=0x0100, qd=1, an=0, ns=0, ar=0) -> bytes:
    return struct.pack(">HHHHHH", qid, flags, qd, an, ns, ar)


QUESTION = b"\x0btestapp-svc\x07testapp\x03svc\x07cluster\x05local\x00\x00\x01\x00\x01"


@pytest.mark.parametrize("wire,rcode,qd", [
    (header(flags=0x0100 | (4 << 11)) + QUESTION, dns.rcode.NOTIMP, 1),        # NOTIFY
    (header(flags=0x0100 | (5 << 11)) + QUESTION, dns.rcode.NOTIMP, 1),        # UPDATE
    (header() + QUESTION[:-2] + b"\x00\x03", dns.rcode.REFUSED, 1),              # class CH
    (header() + QUESTION[:-2] + b"\x00\xff", dns.rcode.REFUSED, 1),              # class ANY
    (header(qd=0), dns.rcode.SERVFAIL, 0),                                       # empty question
    (header(qd=2) + QUESTION + QUESTION, dns.rcode.FORMERR, 0),
    (header() + b"\x05abc", dns.rcode.FORMERR, 0),                               # cut short
    (header(an=1) + QUESTION, dns.rcode.FORMERR, 0),                             # promised record missing
    (header() + b"\xc0\x0c\x00\x01\x00\x01", dns.rcode.FORMERR, 0),              # pointer in the question
])
def test_error_replies(engine, wire, rcode, qd):
    reply = resolve(engine, wire)
    assert engine.fast(wire, False) is None
    qid, flags, qdcount, an, ns, ar = struct.unpack_from(">HHHHHH", reply)
    assert (qid, flags & 0x7800, flags & 0xF, qdcount, an, ns, ar) == (7, wire[2] << 8 & 0x7800, rcode, qd, 0, 0, 0)
    assert flags & dns.flags.QR and flags & dns.flags.RD and not flags & dns.flags.AA
    if wire[2] >> 3 & 0xF != 5:     # dnspython reads UPDATE messages by other rules
        m = dns.message.from_wire(reply)
        assert m.rcode() == rcode and len(m.question) == qd


@pytest.mark.parametrize("wire", [b"", b"\x00" * 11, header(flags=0x8100) + QUESTION])
def test_dropped(engine, wire):
    assert resolve(engine, wire) is None
    assert engine.fast(wire, False) is None


# --- upstream --------------------------------------------------------------------------------

class FakeForwarder:
    """A test double for the upstream: answers from a table, records every call."""

    def __init__(self, table=None, down=False):
        self.table = table or {}
        self.down = down
        self.calls: list[tuple[str, str, bool]] = []

    async def query(self, request: DNSRecord, tcp: bool):
        name, qtype = str(request.q.qname).lower(), QTYPE[request.q.qtype]
        self.calls.append((name, qtype, tcp))
        if self.down:
            return None
        reply = request.reply(ra=1, aa=0)
        rcode, records, tc = self.table.get((name, qtype), (3, [], False))
        reply.header.rcode = rcode
        reply.header.tc = int(tc)
        for text in records:
            for rr in RR.fromZone(text):
                reply.add_answer(rr)
        return reply


UPSTREAM = {
    ("example.com.", "A"): (0, ["example.com. 300 IN A 93.184.215.14"], False),
    ("db.example.com.", "A"): (0, ["db.example.com. 60 IN A 192.0.2.7", "db.example.com. 60 IN A 192.0.2.8"], True),
    ("db.example.com.", "AAAA"): (0, [], False),
}


def test_out_of_zone_forwarded(demo_state):
    fwd = FakeForwarder(UPSTREAM)
    engine = make_engine(demo_state, forwarder=fwd)
    q = dns.message.make_query("Example.COM", "A", use_edns=0)
    q.id = 999
    reply = resolve(engine, q.to_wire())
    m = dns.message.from_wire(reply)
    assert m.id == 999 and m.question[0].name.to_text() == "Example.COM."
    assert m.flags & dns.flags.RA and not m.flags & dns.flags.AA and m.rcode() == dns.rcode.NOERROR
    assert lines(m.answer) == ["example.com. 300 in a 93.184.215.14"]
    assert m.edns == 0 and m.payload == 1232
    assert fwd.calls == [("example.com.", "A", False)]
    m = dns.message.from_wire(resolve(engine, query_wire("missing.example.org"), tcp=True))
    assert m.rcode() == dns.rcode.NXDOMAIN and fwd.calls[-1] == ("missing.example.org.", "A", True)
    assert engine.fast(query_wire("example.com"), False) is None    # never memoised


def test_out_of_zone_refused_or_servfail(demo_state):
    for engine in (make_engine(demo_state), make_engine(demo_state, forwarder=FakeForwarder(), no_upstream=True)):
        m = dns.message.from_wire(resolve(engine, query_wire("example.com")))
        assert m.rcode() == dns.rcode.REFUSED and len(m.question) == 1
    engine = make_engine(demo_state, forwarder=FakeForwarder(down=True))
    m = dns.message.from_wire(resolve(engine, query_wire("example.com")))
    assert m.rcode() == dns.rcode.SERVFAIL


def test_external_name_chased_upstream(demo_state):
    fwd = FakeForwarder(UPSTREAM)
    engine = make_engine(demo_state, forwarder=fwd)
    m = dns.message.from_wire(resolve(engine, query_wire("external-db.testapp.svc.cluster.local")))
    assert m.rcode() == dns.rcode.NOERROR and m.flags & dns.flags.AA
    assert m.flags & dns.flags.TC, "the upstream's TC is passed on"
    assert m.answer[0].rdtype == dns.rdatatype.CNAME, "the CNAME comes first"
    assert lines(m.answer) == sorted([f"external-db.testapp.{CL} 5 in cname db.example.com.",
                                        "db.example.com. 60 in a 192.0.2.7", "db.example.com. 60 in a 192.0.2.8"])
    m = dns.message.from_wire(resolve(engine, query_wire("external-db.testapp.svc.cluster.local", "AAAA")))
    assert lines(m.answer) == [f"external-db.testapp.{CL} 5 in cname db.example.com."]
    engine = make_engine(demo_state, forwarder=FakeForwarder(down=True))
    m = dns.message.from_wire(resolve(engine, query_wire("external-db.testapp.svc.cluster.local")))
    assert m.rcode() == dns.rcode.SERVFAIL


def test_external_name_in_zone_chase_and_loops():
    state = make_state([
        ("Service", Service("ns", "alias", type="ExternalName", external_name="real.ns.svc.cluster.local")),
        ("Service", Service("ns", "real", cluster_ips=("10.0.0.5",))),
        ("Service", Service("ns", "ghost", type="ExternalName", external_name="missing.ns.svc.cluster.local")),
        ("Service", Service("ns", "loop1", type="ExternalName", external_name="loop2.ns.svc.cluster.local")),
        ("Service", Service("ns", "loop2", type="ExternalName", external_name="loop1.ns.svc.cluster.local")),
    ])
    fwd = FakeForwarder()
    engine = make_engine(state, forwarder=fwd)
    m = ask(engine, "alias.ns.svc.cluster.local")
    assert [r.to_text().lower() for r in m.answer] == [
        f"alias.ns.{CL} 5 in cname real.ns.{CL}", f"real.ns.{CL} 5 in a 10.0.0.5"]
    m = ask(engine, "ghost.ns.svc.cluster.local")
    assert m.rcode() == dns.rcode.NOERROR and lines(m.answer) == [f"ghost.ns.{CL} 5 in cname missing.ns.{CL}"]
    m = ask(engine, "loop1.ns.svc.cluster.local")
    assert lines(m.answer) == sorted([f"loop1.ns.{CL} 5 in cname loop2.ns.{CL}",
                                        f"loop2.ns.{CL} 5 in cname loop1.ns.{CL}"])
    assert fwd.calls == []


def test_unusable_names_are_not_served():
    state = make_state([
        ("Service", Service("ns", "bad1", type="ExternalName", external_name="a..b")),
        ("Service", Service("ns", "bad2", type="ExternalName", external_name="x" * 70 + ".example.com")),
        ("Service", Service("ns", "hl", headless=True)),
        ("EndpointSlice", EndpointSlice("ns", "hl-1", "hl", endpoints=(Endpoint(("10.1.0.1",), hostname="h" * 70),))),
    ])
    engine = make_engine(state)
    for name in ("bad1", "bad2"):
        assert ask(engine, f"{name}.ns.svc.cluster.local").rcode() == dns.rcode.NXDOMAIN
    # an over-long hostname falls back to the dashed address
    assert lines(ask(engine, "10-1-0-1.hl.ns.svc.cluster.local").answer) == a(f"10-1-0-1.hl.ns.{CL}", "10.1.0.1")


def test_fallthrough(demo_state):
    fwd = FakeForwarder({("9.9.9.9.in-addr.arpa.", "PTR"): (0, ["9.9.9.9.in-addr.arpa. 60 IN PTR dns9.example."],
                                                           False)})
    engine = make_engine(demo_state, forwarder=fwd, fallthrough=("in-addr.arpa", "ip6.arpa"))
    m = dns.message.from_wire(resolve(engine, query_wire("9.9.9.9.in-addr.arpa", "PTR")))
    assert lines(m.answer) == ["9.9.9.9.in-addr.arpa. 60 in ptr dns9.example."] and not m.flags & dns.flags.AA
    # a name found, or NODATA, never falls through; cluster.local is not listed
    assert lines(ask(engine, "232.36.20.172.in-addr.arpa", "PTR").answer)
    assert ask(engine, "nope.testapp.svc.cluster.local").rcode() == dns.rcode.NXDOMAIN
    assert [c[0] for c in fwd.calls] == ["9.9.9.9.in-addr.arpa."]
    engine = make_engine(demo_state, forwarder=fwd, fallthrough=())
    m = dns.message.from_wire(resolve(engine, query_wire("nope.testapp.svc.cluster.local")))
    assert m.rcode() == dns.rcode.NXDOMAIN and not m.flags & dns.flags.AA     # the upstream's answer
    assert fwd.calls[-1][0] == "nope.testapp.svc.cluster.local."


# --- autopath ----------------------------------------------------------------------------------

def test_autopath(demo_state):
    fwd = FakeForwarder(UPSTREAM)
    engine = make_engine(demo_state, forwarder=fwd, autopath=True, resolv_conf="/nonexistent")
    client = "10.161.37.5"   # pod testapp/client
    m = dns.message.from_wire(resolve(engine, query_wire("kube-dns.kube-system.testapp.svc.cluster.local"),
                                      client=client))
    assert m.rcode() == dns.rcode.NOERROR and m.question[0].name.to_text() == \
        "kube-dns.kube-system.testapp.svc.cluster.local."
    assert [r.to_text().lower() for r in m.answer] == [
        f"kube-dns.kube-system.testapp.{CL} 5 in cname kube-dns.kube-system.{CL}",
        f"kube-dns.kube-system.{CL} 5 in a 172.20.0.10"]
    # out of the cluster: base. through the upstream, TTL of the CNAME from the first record
    m = dns.message.from_wire(resolve(engine, query_wire("example.com.testapp.svc.cluster.local"), client=client))
    assert [r.to_text().lower() for r in m.answer] == [
        f"example.com.testapp.{CL} 300 in cname example.com.", "example.com. 300 in a 93.184.215.14"]
    # NODATA stops the walk, without a CNAME
    m = dns.message.from_wire(resolve(engine, query_wire("kube-dns.kube-system.testapp.svc.cluster.local",
                                                          "AAAA"), client=client))
    assert m.rcode() == dns.rcode.NOERROR and not m.answer and lines(m.authority) == [SOA]
    # nothing found anywhere: the original NXDOMAIN
    m = dns.message.from_wire(resolve(engine, query_wire("nothing.testapp.svc.cluster.local"), client=client))
    assert m.rcode() == dns.rcode.NXDOMAIN
    # an unknown client, or a name outside its first search domain: no autopath
    m = dns.message.from_wire(resolve(engine, query_wire("kube-dns.kube-system.testapp.svc.cluster.local"),
                                      client="192.0.2.1"))
    assert m.rcode() == dns.rcode.NXDOMAIN
    m = dns.message.from_wire(resolve(engine, query_wire("kube-dns.kube-system.default.svc.cluster.local"),
                                      client=client))
    assert m.rcode() == dns.rcode.NXDOMAIN
    # such NXDOMAINs are per client: never taken by the fast path
    assert engine.fast(query_wire("kube-dns.kube-system.testapp.svc.cluster.local"), False) is None


# --- zone transfer ---------------------------------------------------------------------------

def test_transfer(demo_state):
    wire = query_wire("cluster.local", "AXFR")
    plain = make_engine(demo_state)
    assert dns.message.from_wire(resolve(plain, wire, tcp=True)).rcode() == dns.rcode.REFUSED
    engine = make_engine(demo_state, transfer=True)
    assert dns.message.from_wire(resolve(engine, wire, tcp=False)).rcode() == dns.rcode.REFUSED
    assert dns.message.from_wire(resolve(engine, query_wire("testapp.svc.cluster.local", "AXFR"),
                                         tcp=True)).rcode() == dns.rcode.REFUSED
    messages = resolve(engine, wire, tcp=True)
    assert isinstance(messages, list) and messages
    records = []
    for raw in messages:
        m = dns.message.from_wire(raw, xfr=True)
        assert m.rcode() == dns.rcode.NOERROR and m.flags & dns.flags.AA and len(raw) <= 65535
        records += [line for rrset in m.answer for line in rrset.to_text().lower().splitlines()]
    assert records[0] == SOA and records[-1] == SOA
    assert f"testapp-svc.testapp.{CL} 5 in a 172.20.36.232" in records
    assert f"external-db.testapp.{CL} 5 in cname db.example.com." in records
    # transfer weights are per owner name and port (CoreDNS transfer), not per query match
    assert f"_http._tcp.multiport.testapp.{CL} 5 in srv 0 100 80 multiport.testapp.{CL}" in records
    assert f"web-0.testapp-headless.testapp.{CL} 5 in a 10.161.35.2" in records
    # IXFR with the current serial: only the SOA; with an older one: the whole zone; without: SERVFAIL
    for serial, expect in ((SERIAL, 1), (SERIAL - 10, len(records))):
        q = dns.message.make_query("cluster.local", "IXFR")
        q.authority.append(dns.rrset.from_text("cluster.local.", 0, "IN", "SOA",
                                               f"ns.dns.cluster.local. hostmaster.cluster.local. {serial} 1 1 1 1"))
        out = resolve(engine, q.to_wire(), tcp=True)
        got = [line for raw in out for rrset in dns.message.from_wire(raw, xfr=True).answer
               for line in rrset.to_text().splitlines()]
        assert len(got) == expect
    m = dns.message.from_wire(resolve(engine, query_wire("cluster.local", "IXFR"), tcp=True))
    assert m.rcode() == dns.rcode.SERVFAIL


def test_transfer_splits_large_zones():
    from clusterdns.synthetic import synthetic_records
    engine = make_engine(make_state(synthetic_records(3000, 1)), transfer=True)
    messages = resolve(engine, query_wire("cluster.local", "AXFR"), tcp=True)
    assert len(messages) > 1 and all(len(raw) <= 65535 for raw in messages)
    n = sum(len(rrset) for raw in messages for rrset in dns.message.from_wire(raw, xfr=True).answer)
    # SOA twice; per service one A, one SRV at its name and one at its named port (no NS: no server address)
    assert n == 2 + 3000 * 3


# --- properties (hypothesis) -----------------------------------------------------------------

from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

NAMES = sorted({c[0] for c in DEMO} | {"example.com", "db.example.com", ".", "in-addr.arpa", "ip6.arpa",
                                       "testapp-svc.testapp.testapp.svc.cluster.local"})
TYPES = ["A", "AAAA", "SRV", "PTR", "TXT", "ANY", "MX", "CNAME", "NS", "SOA", "HINFO", "CAA", "HTTPS"]


@st.composite
def queries(draw):
    name = draw(st.sampled_from(NAMES))
    if draw(st.booleans()):
        prefix = draw(st.sampled_from(["x", "web-0", "_http._tcp", "10-1-2-3", "Nope", "ns.dns", "hostmaster",
                                       "a.b.c", "svc", "dns"]))
        name = prefix if name == "." else prefix + "." + name
    name = "".join(c.upper() if draw(st.booleans()) else c for c in name) if draw(st.booleans()) else name
    q = dns.message.make_query(name, draw(st.sampled_from(TYPES)))
    q.id = draw(st.integers(0, 0xFFFF))
    if not draw(st.booleans()):
        q.flags &= ~dns.flags.RD
    if draw(st.booleans()):
        q.flags |= dns.flags.CD
    edns = draw(st.sampled_from([None, 0, 0, 1]))
    if edns is not None:
        q.use_edns(edns, dns.flags.DO if draw(st.booleans()) else 0, draw(st.integers(0, 65535)))
    return q.to_wire(), draw(st.booleans())


@pytest.fixture(scope="module")
def busy_engine(demo_state):
    return make_engine(demo_state, forwarder=FakeForwarder(UPSTREAM), fallthrough=("ip6.arpa",),
                         server_addresses=lambda: ["10.161.0.2"])


# Every branch of the properties below, whatever hypothesis draws: a zone answer (fast() answers),
# a forwarded one, with and without EDNS, over UDP and TCP.
ALWAYS = [(query_wire("testapp-svc.testapp.svc.cluster.local"), False),
          (query_wire("Testapp-Svc.testapp.svc.cluster.local", "SRV", use_edns=0), True),
          (query_wire("example.com", use_edns=0), False),
          (query_wire("nope.testapp.svc.cluster.local", "AAAA", use_edns=0, payload=4096), False)]


def always(test):
    for case in reversed(ALWAYS):
        test = example(case)(test)
    return test


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(queries())
@always
def test_fast_path_equals_full_path(busy_engine, query):
    wire, tcp = query
    first = resolve(busy_engine, wire, tcp)
    fast = busy_engine.fast(wire, tcp)
    again = resolve(busy_engine, wire, tcp)
    assert isinstance(first, bytes) and again == first
    assert fast is None or fast == first
    m = dns.message.from_wire(first)
    q = dns.message.from_wire(wire)
    assert m.id == q.id and m.question == q.question
    assert first[12:len(wire) - (11 if q.edns >= 0 else 0)] == wire[12:len(wire) - (11 if q.edns >= 0 else 0)]
    assert len(first) <= (65535 if tcp else (1232 if q.edns >= 0 else 512))
    if q.edns >= 0:
        assert m.edns == 0 and m.payload == 1232
    else:
        assert m.edns < 0
    if q.edns == 0 and m.question[0].name.is_subdomain(dns.name.from_text("cluster.local")) \
            and m.rcode() in (dns.rcode.NOERROR, dns.rcode.NXDOMAIN) and m.question[0].rdtype != dns.rdatatype.NS \
            and m.flags & dns.flags.AA and not any(r.rdtype == dns.rdatatype.CNAME and
                                                   not r[0].target.is_subdomain(dns.name.from_text("cluster.local"))
                                                   for r in m.answer):
        assert fast is not None, "a zone answer is prebuilt after its first resolve()"


def fresh_tables(engine) -> None:
    """Forget every prebuilt answer (this version's, carried ones, the SOA templates)."""
    view = engine.view
    view.memo.clear()
    view.probation.clear()
    view.replies.clear()
    engine._nx_entries.clear()
    for memo in view.carried:
        memo.clear()


def fast_should_answer(engine, wire: bytes, reply: bytes) -> bool:
    """Must fast() answer this query the first time it is asked? Yes for every ordinary query
    (read_query accepts it) of a zone name, unless its answer depends on the client or the
    upstream (NXDOMAIN that falls through, ExternalName targets outside the zones), it is a
    transfer, or it comes from a big Service (built off the loop)."""
    from clusterdns.dns import names
    from clusterdns.dns.wire import qname_labels, question_end, read_query
    r = read_query(wire, False, 1232)
    if r is None or question_end(wire) != r[1]:
        return False
    labels = tuple(x.lower().decode("latin-1") for x in qname_labels(wire, r[1]))
    zone = names.zone_of(labels, engine.view.zones)
    qtype = wire[r[0] + 1] << 8 | wire[r[0] + 2]
    if zone is None or qtype in (251, 252) or not engine.synced:
        return False
    m = dns.message.from_wire(reply)
    if m.rcode() == dns.rcode.NXDOMAIN and engine._fall is not None and engine._falls_through(labels):
        return False
    cluster = dns.name.from_text("cluster.local")
    if any(r.rdtype == dns.rdatatype.CNAME and not r[0].target.is_subdomain(cluster) for r in m.answer) \
            and qtype in (1, 28):
        return False
    return True


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(queries())
@always
def test_first_time_fast_answers_equal_the_full_path(busy_engine, query):
    """fast() builds a question's first answer itself, the bytes resolve() gives; and it does
    so for every kind of question it should (it fails if fast() stops answering one)."""
    wire, tcp = query
    fresh_tables(busy_engine)
    fast = busy_engine.fast(wire, tcp)
    fresh_tables(busy_engine)
    first = resolve(busy_engine, wire, tcp)
    if fast_should_answer(busy_engine, wire, first):
        assert fast == first, "fast() declined a question it answers" if fast is None else "fast() differs"
    else:
        assert fast is None, "fast() answered a question whose answer depends on the client or upstream"


# One question of every kind the zone answers: (name, type, does fast() answer it the first time)
KINDS = [
    ("testapp-svc.testapp.svc.cluster.local", "A", True),            # ClusterIP
    ("testapp-svc.testapp.svc.cluster.local", "AAAA", True),         # NODATA
    ("testapp-svc.testapp.svc.cluster.local", "SRV", True),
    ("testapp-svc.testapp.svc.cluster.local", "TXT", True),
    ("testapp-svc.testapp.svc.cluster.local", "ANY", True),
    ("multiport.testapp.svc.cluster.local", "AAAA", True),           # dual-stack
    ("_http._tcp.multiport.testapp.svc.cluster.local", "SRV", True), # named port
    ("_http._tcp.multiport.testapp.svc.cluster.local", "A", True),
    ("_nope._tcp.multiport.testapp.svc.cluster.local", "SRV", True), # no such port
    ("testapp-headless.testapp.svc.cluster.local", "A", True),       # headless
    ("testapp-headless.testapp.svc.cluster.local", "SRV", True),
    ("_http._tcp.testapp-headless.testapp.svc.cluster.local", "SRV", True),
    ("web-0.testapp-headless.testapp.svc.cluster.local", "A", True), # endpoint
    ("web-0.testapp-headless.testapp.svc.cluster.local", "SRV", True),
    ("10-161-33-100.testapp-svc.testapp.svc.cluster.local", "A", True),
    ("external-db.testapp.svc.cluster.local", "CNAME", True),        # ExternalName
    ("external-db.testapp.svc.cluster.local", "A", False),           # target asked upstream
    ("x.external-db.testapp.svc.cluster.local", "A", True),
    ("232.36.20.172.in-addr.arpa", "PTR", True),                     # PTR ClusterIP
    ("2.35.161.10.in-addr.arpa", "PTR", True),                       # PTR endpoint
    ("12.34.161.10.in-addr.arpa", "PTR", True),                      # unknown address
    ("36.20.172.in-addr.arpa", "PTR", True),                         # partial
    (V6_EP, "PTR", True),
    ("10-161-37-5.testapp.pod.cluster.local", "A", True),            # pod
    ("testapp.pod.cluster.local", "A", True),
    ("cluster.local", "SOA", True),                                  # apex
    ("cluster.local", "NS", True),
    ("cluster.local", "A", True),
    ("in-addr.arpa", "SOA", True),
    ("ns.dns.cluster.local", "A", True),
    ("ns.dns.cluster.local", "AAAA", True),
    ("hostmaster.cluster.local", "A", True),
    ("dns-version.cluster.local", "TXT", True),
    ("dns-version.cluster.local", "A", True),
    ("svc.cluster.local", "A", True),                                # empty non-terminals
    ("testapp.svc.cluster.local", "A", True),
    ("nope.testapp.svc.cluster.local", "A", True),                   # NXDOMAIN under svc
    ("nope.nons.svc.cluster.local", "SRV", True),
    ("a.b.c.d.e.f.svc.cluster.local", "A", True),                    # NXDOMAIN by grammar
    ("foo.cluster.local", "A", True),
    ("example.com", "A", False),                                     # outside the zones
    ("cluster.local", "AXFR", False),
]


@pytest.mark.parametrize("case", ["lower", "Mixed"])
@pytest.mark.parametrize("name,qtype,answered", KINDS, ids=[f"{k[0]}/{k[1]}" for k in KINDS])
def test_fast_path_equals_full_path_for_every_kind(demo_state, name, qtype, answered, case):
    if case == "Mixed":
        name = "".join(c.upper() if i % 3 == 0 else c for i, c in enumerate(name))
    for kw in ({}, {"use_edns": 0}, {"use_edns": 0, "want_dnssec": True, "payload": 4096}):
        wire = query_wire(name, qtype, **kw)
        fast_engine = make_engine(demo_state, forwarder=FakeForwarder(UPSTREAM),
                                    server_addresses=lambda: ["10.161.0.2"], transfer=True)
        full_engine = make_engine(demo_state, forwarder=FakeForwarder(UPSTREAM),
                                    server_addresses=lambda: ["10.161.0.2"], transfer=True)
        fast = fast_engine.fast(wire, False)
        full = resolve(full_engine, wire)
        if answered:
            assert fast is not None and fast == full
            assert fast_engine.fast(wire, False) == full      # again: from the table
        else:
            assert fast is None
            resolve(fast_engine, wire)
            # what the upstream says (or a transfer) is never prebuilt, even once resolve() gave it
            assert fast_engine.fast(wire, False) is None


def test_a_flood_of_new_names_keeps_the_names_that_matter(demo_state):
    """Names asked more than once stay prebuilt while never-seen names stream through."""
    engine = make_engine(demo_state, memo_probation=5000)
    # (NS and ns.dns answers depend on the server's addresses: never prebuilt)
    hot = [query_wire(n, t) for n, t, ok in KINDS if ok and t != "NS" and not n.startswith("ns.dns")]
    for w in hot * 2:
        assert engine.fast(w, False) is not None
    keys = [w[12:-4].lower() + w[-4:-2] for w in hot]
    assert all(k in engine.view.memo for k in keys)
    for i in range(5000 * 3):
        assert engine.fast(query_wire(f"flood-{i}.testapp.svc.cluster.local"), False) is not None
    assert all(k in engine.view.memo for k in keys), "a flood of new names evicted the names that matter"
    assert len(engine.view.probation) == 5000


def test_memo_limits_are_flags_and_the_least_recently_used_go(demo_state):
    from clusterdns.config import ConfigError, load
    cfg = load(["dns", "--memo-size", "3", "--memo-probation", "2"], env={})
    assert (cfg.dns.memo_size, cfg.dns.memo_probation) == (3, 2)
    for bad in (["--memo-size", "-1"], ["--memo-probation", "20000000"]):
        with pytest.raises(ConfigError, match=bad[0]):
            load(["dns", *bad], env={})
    engine = make_engine(demo_state, memo_size=3, memo_probation=2)
    names = [query_wire(f"{n}.testapp.svc.cluster.local") for n in ("testapp-svc", "testapp2-svc", "missing-a",
                                                                     "missing-b")]
    key = [w[12:-4].lower() + w[-4:-2] for w in names]
    for w in names:
        assert engine.fast(w, False) is not None
    assert list(engine.view.probation) == key[2:]          # asked once: the 2 most recent kept
    for w in names[2:] + names[:2]:
        engine.fast(w, False)
    # asked again: into the memo; the first two had been dropped from probation, so are new again
    assert list(engine.view.memo) == key[2:] and list(engine.view.probation) == key[:2]
    engine.fast(names[2], False)                            # a use: missing-a is now the most recent
    engine.fast(names[0], False)                            # the memo's 3rd entry
    engine.fast(names[1], False)                            # a 4th: missing-b, the least recently used, goes
    assert list(engine.view.memo) == [key[2], key[0], key[1]]
    off = make_engine(demo_state, memo_size=0, memo_probation=0)
    for w in names * 2:
        assert off.fast(w, False) is not None               # still answered, nothing kept
    assert not off.view.memo and not off.view.probation and not off.view.replies


def _with_id(wire: bytes, qid: int) -> bytes:
    return struct.pack(">H", qid) + wire[2:]


def test_whole_replies_are_kept_per_state_version_and_never_outlive_it():
    """A UDP query asked again is answered from view.replies (the reply but its ID, by the
    query's other bytes), with its own ID; a new state version starts without them, so the
    next answer is the new state's. Rotated answers depend on the ID and TCP has its own
    limit: neither is kept."""
    from dataclasses import replace
    web = Service("ns", "web", cluster_ips=("10.96.0.10",))
    hl = Service("ns", "hl", headless=True)
    eps = EndpointSlice("ns", "hl-1", "hl", "IPv4", tuple(Endpoint((f"10.1.0.{i}",)) for i in range(1, 5)))
    engine = make_engine(make_state([("Service", web), ("Service", hl), ("EndpointSlice", eps)]))
    wire = query_wire("Web.ns.svc.cluster.local")
    nx = query_wire("nope.ns.svc.cluster.local", "AAAA", use_edns=0, want_dnssec=True)
    for i in range(4):
        for w in (_with_id(wire, i), _with_id(nx, i)):
            reply = engine.fast(w, False)
            assert reply == asyncio.run(engine.resolve(w, "10.0.0.1", False)) and reply[:2] == w[:2]
    assert wire[2:] in engine.view.replies and nx[2:] in engine.view.replies
    reply = engine.fast(_with_id(wire, 0xBEEF), False)
    m = dns.message.from_wire(reply)
    assert m.id == 0xBEEF and lines(m.answer) == a("web.ns.svc.cluster.local.", "10.96.0.10")
    assert m.question[0].name.to_text() == "Web.ns.svc.cluster.local."
    engine.update(make_state([("Service", replace(web, cluster_ips=("10.96.0.99",))), ("Service", hl),
                              ("EndpointSlice", eps)]))
    assert not engine.view.replies
    for i in range(3):
        m = dns.message.from_wire(engine.fast(_with_id(wire, i), False))
        assert lines(m.answer) == a("web.ns.svc.cluster.local.", "10.96.0.99")
    hw = query_wire("hl.ns.svc.cluster.local")
    orders = set()
    for i in range(8):
        m = dns.message.from_wire(engine.fast(_with_id(hw, i), False))
        orders.add(tuple(r.address for r in m.answer[0]))
        assert engine.fast(_with_id(wire, i), True) is not None
    assert len(orders) > 1 and hw[2:] not in engine.view.replies
    assert list(engine.view.replies) == [wire[2:]]


def test_unique_names_under_unique_namespaces_stay_bounded(demo_state):
    """x.n<i>.svc.cluster.local for ever new i: every per-name table stays bounded, and so does
    the memory the engine holds (traced allocations, not a clock)."""
    import gc
    import tracemalloc

    engine = make_engine(demo_state, memo_size=1000, memo_probation=1000)
    view = engine.view

    def ask(lo, hi):
        for i in range(lo, hi):
            w = query_wire(f"x.n{i}.svc.cluster.local")
            assert engine.fast(w, False) is not None
            if i % 2:
                engine.fast(w, False)        # asked twice: into the memo
    tracemalloc.start()
    try:
        ask(0, 2500)                          # fills every table to its bound
        gc.collect()
        full = tracemalloc.get_traced_memory()[0]
        ask(2500, 8500)
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - full
    finally:
        tracemalloc.stop()
    assert len(view.memo) <= 1000 and len(view.probation) <= 1000
    assert len(view._exposed) <= len(demo_state.namespaces) + len(view.svc_namespaces)
    assert len(engine._nx_entries) <= 64
    assert grown < 128 * 1024, f"{grown} bytes more after 6,000 more unique names"


@pytest.mark.parametrize("name", ["never.ns-new.svc.cluster.local", "x.testapp.svc.cluster.local",
                                  "testapp-svc.testapp.testapp.svc.cluster.local", "NoPe.TestApp.SVC.cluster.local",
                                  "a.b.c.d.e.f.svc.cluster.local", "nope.svc.cluster.local",
                                  "x.external-db.testapp.svc.cluster.local", "web-9.testapp-headless.testapp.svc.cluster.local",
                                  "hostmaster.svc.cluster.local", "ns.dns.svc.cluster.local"])
def test_nxdomain_under_svc_is_answered_from_the_template(demo_state, name):
    engine = make_engine(demo_state)
    other = make_engine(demo_state)
    for qtype in ("A", "SRV", "ANY"):
        wire = query_wire(name, qtype, use_edns=0)
        fast = engine.fast(wire, False)
        assert fast is not None and fast == ask_wire(other, wire)
        assert dns.message.from_wire(fast).rcode() == dns.rcode.NXDOMAIN
    assert engine._nx_entries


def test_first_time_answers_not_taken_by_fast(demo_state):
    """Per-client or upstream-dependent answers stay with resolve()."""
    engine = make_engine(demo_state, autopath=True)
    assert engine.fast(query_wire("nope.testapp.svc.cluster.local"), False) is None        # autopath may apply
    engine = make_engine(demo_state, forwarder=FakeForwarder(UPSTREAM), fallthrough=())
    assert engine.fast(query_wire("nope.testapp.svc.cluster.local"), False) is None        # falls through
    assert engine.fast(query_wire("external-db.testapp.svc.cluster.local"), False) is None  # chased upstream
    assert engine.fast(query_wire("cluster.local", "AXFR"), True) is None
    assert engine.fast(query_wire("example.com"), False) is None


mutations = st.tuples(st.integers(0, 80), st.integers(0, 255))


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.one_of(
    st.binary(max_size=120),
    st.tuples(queries(), st.lists(mutations, min_size=1, max_size=6)).map(
        lambda t: (bytes(_mutate(t[0][0], t[1])), t[0][1])),
    st.tuples(queries(), st.integers(0, 80)).map(lambda t: (t[0][0][:t[1]], t[0][1])),
))
def test_malformed_input_never_raises(busy_engine, caplog, data):
    wire, tcp = (data, False) if isinstance(data, bytes) else data
    caplog.clear()
    busy_engine.fast(wire, tcp)
    reply = resolve(busy_engine, wire, tcp)
    assert not [r for r in caplog.records if r.levelname == "ERROR"], "the engine hit an internal error"
    if reply is None:
        assert len(wire) < 12 or wire[2] & 0x80
    else:
        assert isinstance(reply, (bytes, list))
        if isinstance(reply, bytes):
            assert reply[:2] == wire[:2] and reply[2] & 0x80


def _mutate(wire: bytes, changes) -> bytearray:
    out = bytearray(wire)
    for pos, value in changes:
        if pos < len(out):
            out[pos] = value
    return out


def test_interface_the_server_codes_against():
    import inspect

    from clusterdns.dns import Engine, Forwarder
    assert list(inspect.signature(Engine.__init__).parameters) == ["self", "cfg", "forwarder", "server_addresses"]
    assert list(inspect.signature(Engine.update).parameters) == ["self", "state", "changed", "since"]
    assert list(inspect.signature(Engine.fast).parameters) == ["self", "data", "tcp"]
    assert list(inspect.signature(Engine.resolve).parameters) == ["self", "data", "client_ip", "tcp"]
    assert inspect.iscoroutinefunction(Engine.resolve) and inspect.iscoroutinefunction(Forwarder.query)
    assert isinstance(Engine.synced, property)
