"""Two kubernetes-plugin behaviours pinned to CoreDNS: the PTR of an endpoint address that two
Services' slices hold names both (also across state changes), and AXFR SRV weights computed per
EndpointSlice (100 / that slice's ready addresses), as CoreDNS's transfer writes them."""
from __future__ import annotations

import dns.message
import dns.rdatatype

from clusterdns.model import Endpoint, EndpointPort, EndpointSlice, Service, ServicePort
from clusterdns.sources.manifest import publish
from clusterdns.state import StateStore
from tests.dns.dnskit import ask, make_engine, make_state, query_wire


def _svc(name: str, ip: str, addr: str) -> list:
    return [("Service", Service("ns", name, cluster_ips=(ip,), ports=(ServicePort("http", "TCP", 80),))),
            ("EndpointSlice", EndpointSlice("ns", f"{name}-1", name, "IPv4", (Endpoint((addr,)),),
                                            (EndpointPort("http", "TCP", 8080),)))]


def _ptr(engine, name: str) -> list[str]:
    r = ask(engine, name, "PTR")
    return sorted(rd.target.to_text() for rrset in r.answer for rd in rrset)


def test_ptr_of_an_address_two_services_hold_names_both_and_follows_changes():
    store = StateStore()
    publish(store, _svc("a", "10.96.0.1", "10.1.0.5"))
    engine = make_engine(store.current)
    assert _ptr(engine, "5.0.1.10.in-addr.arpa") == ["10-1-0-5.a.ns.svc.cluster.local."]
    publish(store, _svc("a", "10.96.0.1", "10.1.0.5") + _svc("b", "10.96.0.2", "10.1.0.5"))
    engine.update(store.current)
    for spelling in ("5.0.1.10.in-addr.arpa", "5.0.1.10.IN-ADDR.ARPA"):
        assert _ptr(engine, spelling) == ["10-1-0-5.a.ns.svc.cluster.local.", "10-1-0-5.b.ns.svc.cluster.local."]
    publish(store, _svc("b", "10.96.0.2", "10.1.0.5"))
    engine.update(store.current)
    assert _ptr(engine, "5.0.1.10.in-addr.arpa") == ["10-1-0-5.b.ns.svc.cluster.local."]


def test_transfer_srv_weights_are_per_endpointslice():
    ports = (EndpointPort("http", "TCP", 8080),)
    small = tuple(Endpoint((f"10.2.0.{i}",), hostname=f"s{i}") for i in range(1, 4))          # 3: 33
    large = tuple(Endpoint((f"10.2.1.{i}",), hostname=f"l{i}") for i in range(1, 6))          # 5: 20
    large += (Endpoint(("10.2.1.9",), hostname="down", ready=False),)                          # not counted
    records = [("Service", Service("ns", "hl", headless=True)),
               ("EndpointSlice", EndpointSlice("ns", "hl-a", "hl", "IPv4", small, ports)),
               ("EndpointSlice", EndpointSlice("ns", "hl-b", "hl", "IPv4", large, ports)),
               ("Service", Service("ns", "web", cluster_ips=("10.96.0.9",), ports=(ServicePort("http", "TCP", 80),)))]
    engine = make_engine(make_state(records), transfer=True)
    import asyncio
    messages = asyncio.run(engine.resolve(query_wire("cluster.local", "AXFR"), "127.0.0.1", True))
    got = {}
    for raw in messages:
        for rrset in dns.message.from_wire(raw, xfr=True).answer:
            if rrset.rdtype == dns.rdatatype.SRV:
                for rd in rrset:
                    got[(rrset.name.to_text(), rd.target.to_text())] = rd.weight
    base = "_http._tcp.hl.ns.svc.cluster.local."
    assert {t: w for (o, t), w in got.items() if o == base} == {
        **{f"s{i}.hl.ns.svc.cluster.local.": 33 for i in range(1, 4)},
        **{f"l{i}.hl.ns.svc.cluster.local.": 20 for i in range(1, 6)}}
    assert got[("_http._tcp.web.ns.svc.cluster.local.", "web.ns.svc.cluster.local.")] == 100
    assert got[("web.ns.svc.cluster.local.", "web.ns.svc.cluster.local.")] == 100
