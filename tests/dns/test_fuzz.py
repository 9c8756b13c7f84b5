"""Malformed packets never crash the server; well-formed queries still get answers.

Hypothesis generates random bytes and mutations of valid queries (flipped
bytes, cut lengths, bad counts, compression pointers, odd EDNS); they are sent
over UDP and TCP to a running `clusterdns dns` process. Each packet gets a
reply that dnspython parses, or none; afterwards the process is alive, a valid
query gets the right answer on both transports and nothing was logged as a
traceback. Each test has its own server, so no test depends on another's order.
"""
from __future__ import annotations

import socket
import struct

import dns.flags
import dns.message
import dnslib
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.dns.dnskit import DEMO, ServerProcess

NAME = "testapp-svc.testapp.svc.cluster.local."
VALID = [
    bytes(dns.message.make_query(NAME, "A").to_wire()),
    bytes(dns.message.make_query("kube-dns.kube-system.svc.cluster.local.", "SRV", use_edns=0, payload=1232).to_wire()),
    bytes(dns.message.make_query("232.36.20.172.in-addr.arpa.", "PTR", want_dnssec=True).to_wire()),
    bytes(dnslib.DNSRecord.question("www.example.org", "AAAA").pack()),
]


@pytest.fixture
def server():
    srv = ServerProcess("--manifest", str(DEMO), "--no-upstream")
    yield srv
    srv.stop()


def mutate(data: bytes, edits: list[tuple[int, int]], cut: int | None) -> bytes:
    b = bytearray(data)
    for pos, val in edits:
        b[pos % len(b)] = val
    if cut is not None:
        b = b[:cut % (len(b) + 1)]
    return bytes(b)


packets = st.one_of(
    st.binary(max_size=600),
    st.builds(mutate, st.sampled_from(VALID),
              st.lists(st.tuples(st.integers(0, 200), st.integers(0, 255)), max_size=6),
              st.none() | st.integers(0, 200)),
    # header-level oddities on a valid question: counts, opcode, QR, compression pointer loops
    st.builds(lambda flags, counts, tail: struct.pack("!HH", 0x1234, flags) + counts + tail,
              st.integers(0, 0xFFFF), st.binary(min_size=8, max_size=8),
              st.sampled_from([VALID[0][12:], b"\xc0\x0c\x00\x01\x00\x01", b"\x3f" + b"a" * 63 + b"\x00\x00\x01\x00\x01",
                               VALID[1][12:] + b"\x00\x00\x29\x10\x00\x07\x00\x00\x00\x00\x04\x00\x0a\x00\x00"])),
)


def check_reply(data: bytes, query: bytes) -> None:
    """A reply must be a DNS message dnspython reads, a response to the query's ID."""
    assert len(data) >= 12
    assert data[2] & 0x80, "reply without QR"
    assert data[:2] == query[:2]
    # dnspython reads an UPDATE's sections by RFC 2136's rules (zone section = one SOA question):
    # the sections' structure is checked as a plain message, opcode bits cleared
    m = dns.message.from_wire(data[:2] + bytes((data[2] & 0x87,)) + data[3:])
    assert m.flags & dns.flags.QR


def probe(payload: bytes) -> bytes:
    """A query the server answers through resolve() (EDNS version 1: BADVERS), as it does every
    malformed packet, in arrival order: once this probe's reply is in, the reply to the packet
    sent before it (if it has one) has come too. Its ID differs from the packet's."""
    q = dns.message.make_query(NAME, "A", use_edns=1)
    q.id = 0xBEEF if payload[:2] != b"\xbe\xef" else 0xBEEE
    return q.to_wire()


def udp_roundtrip(port: int, payload: bytes) -> list[bytes]:
    """Replies to `payload` (none or one), on a socket of its own, with a realistic timeout."""
    p = probe(payload)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(5.0)
        s.sendto(payload, ("127.0.0.1", port))
        s.sendto(p, ("127.0.0.1", port))
        got = []
        while True:
            data = s.recv(65535)
            if data[:2] == p[:2]:
                return got
            got.append(data)


def assert_still_serving(server: ServerProcess) -> None:
    assert server.proc.poll() is None, "server died"
    for tcp in (False, True):
        r = server.query(NAME, tcp=tcp)
        assert r.answer[0][0].address == "172.20.36.232"
    out = server.stop()
    # Bad packets are answered FORMERR or dropped by design, not by an exception caught late.
    assert "Traceback" not in out, out[-3000:]


def test_udp_garbage(server):
    @settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(payload=packets)
    def run(payload):
        replies = udp_roundtrip(server.port, payload)
        assert len(replies) <= 1
        for reply in replies:
            check_reply(reply, payload)
    run()
    assert_still_serving(server)


def test_tcp_garbage(server):
    """Framed garbage, some with a length prefix that lies, on one connection."""
    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(payloads=st.lists(packets, min_size=1, max_size=4), lie=st.integers(-3, 3))
    def run(payloads, lie):
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
            for p in payloads:
                s.sendall(struct.pack("!H", max(0, min(0xFFFF, len(p) + lie))) + p)
            s.shutdown(socket.SHUT_WR)
            buf = b""
            try:
                while chunk := s.recv(65535):
                    buf += chunk
            except ConnectionResetError:
                pass
        while len(buf) >= 2:
            size = struct.unpack("!H", buf[:2])[0]
            if len(buf) < 2 + size:
                break
            reply = buf[2:2 + size]
            check_reply(reply, reply)       # a lying length frames another ID: only parse it
            buf = buf[2 + size:]
    run()
    assert_still_serving(server)
