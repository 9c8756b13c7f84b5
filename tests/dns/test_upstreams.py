"""Hostile and broken upstreams, as real sockets on loopback, behind the real server.

RawUpstream is a UDP+TCP server in a thread whose `handler(query_bytes, proto)`
returns what to send back (a list of (delay, bytes, from_other_port)), so a test
can echo the query, answer from another address, send malformed names or trickle
a TCP answer. Clients ask through the in-process DNS server (real sockets) or the
forwarder itself.
"""
from __future__ import annotations

import asyncio
import logging
import socket
import struct
import threading
import time

import dns.flags
import dns.message
import dns.name
import dns.rcode
import dns.rrset
import dnslib
import pytest

from clusterdns.dns import metrics
from clusterdns.dns.cache import Cache
from clusterdns.dns.forward import Forward
from tests.dns.dnskit import LiveServer


class RawUpstream:
    def __init__(self, handler) -> None:
        self.handler = handler
        self.received: list[tuple[str, bytes]] = []
        self.sent: list[tuple[float, bytes]] = []
        for _ in range(20):
            self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            self.udp.bind(("127.0.0.1", 0))
            self.port = self.udp.getsockname()[1]
            self.tcp = socket.socket()
            self.tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                self.tcp.bind(("127.0.0.1", self.port))
                break
            except OSError:
                self.udp.close()
                self.tcp.close()
        self.tcp.listen(16)
        self.other = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)   # "another address"
        self.other.bind(("127.0.0.1", 0))
        self.closing = False
        self.conns: list[socket.socket] = []
        self.threads = [threading.Thread(target=t, daemon=True) for t in (self._serve_udp, self._serve_tcp)]
        for t in self.threads:
            t.start()

    @property
    def address(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)

    def _serve_udp(self) -> None:
        while not self.closing:
            try:
                data, addr = self.udp.recvfrom(65535)
            except OSError:
                return
            if self.closing:
                return
            self.received.append(("udp", data))
            threading.Thread(target=self._reply_udp, args=(data, addr), daemon=True).start()

    def _reply_udp(self, data: bytes, addr) -> None:
        for delay, out, other in self.handler(data, "udp"):
            time.sleep(delay)
            (self.other if other else self.udp).sendto(out, addr)
            self.sent.append((time.monotonic(), out))

    def _serve_tcp(self) -> None:
        while not self.closing:
            try:
                conn, _ = self.tcp.accept()
            except OSError:
                return
            if self.closing:
                conn.close()
                return
            self.conns.append(conn)
            t = threading.Thread(target=self._reply_tcp, args=(conn,), daemon=True)
            self.threads.append(t)
            t.start()

    def _reply_tcp(self, conn: socket.socket) -> None:
        with conn:
            try:
                size = struct.unpack("!H", conn.recv(2))[0]
                data = b""
                while len(data) < size:
                    data += conn.recv(size - len(data))
                self.received.append(("tcp", data))
                for delay, out, _ in self.handler(data, "tcp"):
                    time.sleep(delay)
                    conn.sendall(out)
                    self.sent.append((time.monotonic(), out))
            except OSError:
                pass

    def close(self) -> None:
        """Stop serving: the threads are woken (closing a socket leaves a thread blocked in
        recvfrom or accept on it) and gone before this returns, so none outlives the test."""
        self.closing = True
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.sendto(b"", self.address)
        try:
            socket.create_connection(self.address, timeout=2).close()
        except OSError:
            pass
        for conn in self.conns:     # a client's open connection holds its reply thread in recv
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in list(self.threads):
            t.join(5)
        for s in (self.udp, self.tcp, self.other):
            s.close()


def answer(query: bytes, text: str | None = "93.184.215.14", rcode: int = 0, tc: bool = False) -> bytes:
    q = dns.message.from_wire(query)
    r = dns.message.make_response(q)
    r.set_rcode(rcode)
    if text:
        r.answer.append(dns.rrset.from_text(q.question[0].name, 60, "IN", "A", text))
    if tc:
        r.flags |= dns.flags.TC
        r.answer = []
    return r.to_wire()


def long_cname(query: bytes) -> bytes:
    """A reply whose CNAME target is 325 octets (names may have 255): made by hand."""
    qend = 12
    while query[qend]:
        qend += query[qend] + 1
    qend += 5
    target = b"".join(bytes([53]) + b"x" * 53 for _ in range(6)) + b"\x00"
    rr = b"\xc0\x0c" + struct.pack("!HHIH", 5, 1, 60, len(target)) + target
    return query[:2] + b"\x81\x80" + struct.pack("!HHHH", 1, 1, 0, 0) + query[12:qend] + rr


def ask(fwd: Forward, name: str = "www.example.", tcp: bool = False):
    return asyncio.run(fwd.query(dnslib.DNSRecord.question(name, "A"), tcp))


def test_an_echoed_query_is_not_taken_as_the_reply():
    up = RawUpstream(lambda q, proto: [(0, q, False), (0.05, answer(q), False)])
    try:
        reply = ask(Forward([up.address], None, read_timeout=2.0))
        assert reply is not None and reply.header.qr and str(reply.rr[0].rdata) == "93.184.215.14"
    finally:
        up.close()


def test_an_upstream_that_only_echoes_fails_over_to_the_next():
    echo = RawUpstream(lambda q, proto: [(0, q if proto == "udp" else struct.pack("!H", len(q)) + q, False)])
    good = RawUpstream(lambda q, proto: [(0, answer(q), False)])
    try:
        fwd = Forward([echo.address, good.address], None, read_timeout=0.5)
        fwd.upstreams[1].fails = fwd.max_fails     # the echoing one is tried first
        reply = ask(fwd)
        assert str(reply.rr[0].rdata) == "93.184.215.14"
        assert echo.received and good.received
        # over TCP an echo is a failed try too
        fwd = Forward([echo.address], None, read_timeout=0.5, overall_timeout=1.0)
        assert ask(fwd, tcp=True) is None
    finally:
        echo.close()
        good.close()


def test_a_reply_from_another_address_is_ignored():
    spoof = RawUpstream(lambda q, proto: [(0, answer(q, "6.6.6.6"), True), (0.05, answer(q), False)])
    try:
        reply = ask(Forward([spoof.address], None, read_timeout=2.0))
        assert [str(rr.rdata) for rr in reply.rr] == ["93.184.215.14"]
        assert any(b"\x06\x06\x06\x06" in out for _, out in spoof.sent)    # the spoofed one was sent
    finally:
        spoof.close()


def test_a_reply_with_another_id_or_question_is_ignored():
    def handler(q, proto):
        other_id = bytes([q[0] ^ 0xFF]) + q[1:]
        wrong = dns.message.from_wire(q)
        wrong.question[0].name = dns.name.from_text("other.example.")
        wrong.id = dns.message.from_wire(q).id
        return [(0, answer(other_id, "6.6.6.6"), False), (0, answer(wrong.to_wire(), "6.6.6.7"), False),
                (0.05, answer(q), False)]
    up = RawUpstream(handler)
    try:
        reply = ask(Forward([up.address], None, read_timeout=2.0))
        assert [str(rr.rdata) for rr in reply.rr] == ["93.184.215.14"]
        assert len(up.sent) >= 2            # both wrong ones went out before the right one
    finally:
        up.close()


def test_tc_then_a_slow_tcp_answer_keeps_one_deadline():
    """UDP answers TC late, TCP sends the length then the body late: each step within the read
    timeout, all together past the overall deadline. The answer that comes after it is not used."""
    def handler(q, proto):
        if proto == "udp":
            return [(0.4, answer(q, tc=True), False)]
        body = answer(q)
        return [(0.4, struct.pack("!H", len(body)), False), (0.4, body, False)]
    up = RawUpstream(handler)
    try:
        fwd = Forward([up.address], None, read_timeout=0.5, overall_timeout=1.0)
        assert ask(fwd) is None
        assert [p for p, _ in up.received] == ["udp", "tcp"]
        # the same upstream, fast enough: the TCP retry answers
        fast = RawUpstream(lambda q, proto: [(0, answer(q, tc=True), False)] if proto == "udp" else
                           [(0, struct.pack("!H", len(answer(q))) + answer(q), False)])
        try:
            reply = ask(Forward([fast.address], None, read_timeout=0.5, overall_timeout=1.0))
            assert not reply.header.tc and str(reply.rr[0].rdata) == "93.184.215.14"
        finally:
            fast.close()
    finally:
        up.close()


@pytest.fixture
def bad_then_good():
    state = {"bad": True}
    def handler(q, proto):
        out = long_cname(q) if state["bad"] else answer(q)
        return [(0, out if proto == "udp" else struct.pack("!H", len(out)) + out, False)]
    up = RawUpstream(handler)
    yield up, state
    up.close()


def test_an_overlong_cname_from_upstream_is_not_cached_not_a_panic_and_logged_once(bad_then_good, caplog):
    up, state = bad_then_good
    fwd = Forward([up.address], Cache(), read_timeout=1.0, overall_timeout=2.0, max_fails=1000)
    srv = LiveServer([], forwarder=fwd)
    panics = metrics._panics[0]
    try:
        with caplog.at_level(logging.WARNING):
            for tcp in (False, True) * 10:
                m = srv.query("www.example.", "A", tcp=tcp)
                assert m.rcode() == dns.rcode.SERVFAIL
        assert len(up.received) >= 20, "nothing was cached: every query asked the upstream"
        assert metrics._panics[0] == panics, "an upstream's bad reply is not our bug"
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING and "upstream" in r.getMessage()]
        assert 1 <= len(warnings) <= 2
        assert not any(r.exc_info for r in caplog.records), "no tracebacks"
        state["bad"] = False                        # the upstream recovers: answered at once
        for tcp in (False, True):
            m = srv.query("www.example.", "A", tcp=tcp)
            assert m.rcode() == dns.rcode.NOERROR and m.answer[0][0].address == "93.184.215.14"
    finally:
        srv.close()
