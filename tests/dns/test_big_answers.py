"""Big answers never stall the server (real sockets, the in-process server).

A headless Service with 50,000 endpoints and a Service with 5,000 ports: their
first SRV answers are built off the event loop and only as far as a reply can
carry. While one is being built, other queries keep being answered: the test
holds the build until a query sent after the big one is answered (an order
the test decides, not a clock). UDP replies never exceed 1232 bytes; TCP carries more, and
both set TC for what does not fit.
"""
from __future__ import annotations

import ipaddress
import socket

import dns.flags
import dns.message
import dns.rcode
import dns.rdatatype
import pytest

from clusterdns.model import Endpoint, EndpointPort, EndpointSlice, Service, ServicePort
from tests.dns.dnskit import LiveServer, make_engine, make_state, query_wire

N_ENDPOINTS = 50_000
N_PORTS = 5_000


def records():
    base = int(ipaddress.ip_address("10.8.0.0"))
    eps = tuple(Endpoint((str(ipaddress.ip_address(base + 1 + i)),)) for i in range(N_ENDPOINTS))
    return [
        ("Service", Service("big", "hl", headless=True)),
        ("EndpointSlice", EndpointSlice("big", "hl-1", "hl", "IPv4", eps, (EndpointPort("http", "TCP", 8080),))),
        ("Service", Service("big", "ports", cluster_ips=("10.96.200.1",),
                            ports=tuple(ServicePort(f"p{i}", "TCP", 1000 + i) for i in range(N_PORTS)))),
        ("Service", Service("big", "small", cluster_ips=("10.96.200.2",), ports=(ServicePort("http", "TCP", 80),))),
    ]


@pytest.fixture
def server():
    srv = LiveServer(records())
    yield srv
    srv.close()


def udp_ask(sock: socket.socket, port: int, name: str, rdtype: str, qid: int, **kw) -> None:
    q = dns.message.make_query(name, rdtype, **kw)
    q.id = qid
    sock.sendto(q.to_wire(), ("127.0.0.1", port))


@pytest.mark.parametrize("name", ["hl.big.svc.cluster.local", "_http._tcp.hl.big.svc.cluster.local",
                                  "ports.big.svc.cluster.local"])
def test_other_queries_are_answered_while_a_big_answer_is_built(server, name):
    """The big answer's build is held until a small query sent after it has been answered:
    that can only happen when the build stalls nobody (the test decides the order, no clock)."""
    import threading
    engine = server.service.engine
    build = engine._big_entry
    started, answered, waited = threading.Event(), threading.Event(), []

    def held_build(*args):
        started.set()
        waited.append(answered.wait(10))
        return build(*args)
    engine._big_entry = held_build
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(10)
        udp_ask(s, server.port, name, "SRV", 1, use_edns=0, payload=4096)
        assert started.wait(10), "the big answer was not built off the loop"
        udp_ask(s, server.port, "small.big.svc.cluster.local", "A", 2)
        small = s.recv(65535)
        assert small[:2] == b"\x00\x02"
        assert dns.message.from_wire(small).answer[0][0].address == "10.96.200.2"
        answered.set()
        big = s.recv(65535)
    assert waited == [True] and big[:2] == b"\x00\x01"
    m = dns.message.from_wire(big)
    assert len(big) <= 1232 and m.flags & dns.flags.TC and m.rcode() == dns.rcode.NOERROR
    assert m.answer and all(rd.port for rd in m.answer[0])
    # asked again: the prebuilt answer, byte for byte the same but for the ID
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(10)
        udp_ask(s, server.port, name, "SRV", 1, use_edns=0, payload=4096)
        assert s.recv(65535) == big
    assert waited == [True], "built once"


@pytest.mark.parametrize("name", ["hl.big.svc.cluster.local", "ports.big.svc.cluster.local"])
def test_big_answers_fill_udp_and_tcp_limits(server, name):
    plain = server.query(name, "SRV")
    edns = server.query(name, "SRV", use_edns=0, payload=65000)
    tcp = server.query(name, "SRV", tcp=True)
    for m, limit in ((plain, 512), (edns, 1232), (tcp, 65535)):
        assert m.flags & dns.flags.TC, "not every record fits: TC"
        assert len(m.to_wire()) <= limit
        assert m.answer[0].rdtype == dns.rdatatype.SRV
    n_udp, n_tcp = len(edns.answer[0]), len(tcp.answer[0])
    assert 10 < n_udp < n_tcp and n_tcp > 500
    assert n_tcp < N_PORTS      # cut at what a TCP message carries, not every record built


def test_big_address_answers(server):
    m = server.query("hl.big.svc.cluster.local", "A", use_edns=0)
    assert m.flags & dns.flags.TC and len(m.to_wire()) <= 1232 and len(m.answer[0]) > 50
    m = server.query("hl.big.svc.cluster.local", "AAAA")
    assert m.rcode() == dns.rcode.NOERROR and not m.answer          # NODATA: no IPv6 endpoint
    m = server.query("10-8-0-7.hl.big.svc.cluster.local", "A")
    assert [rd.address for rd in m.answer[0]] == ["10.8.0.7"]
    m = server.query("7.0.8.10.in-addr.arpa", "PTR")
    assert [rd.target.to_text() for rd in m.answer[0]] == ["10-8-0-7.hl.big.svc.cluster.local."]


def test_autopath_to_a_big_service(demo_records):
    """A pod's search-path candidate that is a big Service: answered (CNAME first), its records
    made off the loop and cut at what the reply carries."""
    import asyncio
    state = make_state(list(demo_records) + records()[:2])
    engine = make_engine(state, autopath=True, resolv_conf="/nonexistent")
    wire = query_wire("hl.big.testapp.svc.cluster.local", "A", use_edns=0)
    m = dns.message.from_wire(asyncio.run(engine.resolve(wire, "10.161.37.5", False)))   # pod testapp/client
    assert m.rcode() == dns.rcode.NOERROR and m.flags & dns.flags.TC and len(m.to_wire()) <= 1232
    assert m.answer[0].rdtype == dns.rdatatype.CNAME and m.answer[0][0].target.to_text() == "hl.big.svc.cluster.local."
    assert len(m.answer[1]) > 50
