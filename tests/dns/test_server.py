"""The DNS server over real sockets.

Part 1 drives the socket layer (DnsService) with a small engine double, so
the server's own duties are tested alone: fast path vs resolve(), TCP
framing and pipelining, panics, metrics. Part 2 runs the real engine
in-process and as `python3 -m clusterdns dns` subprocesses, queried with
dnspython and dig.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import dns.asyncquery
import dns.edns
import dns.flags
import dns.message
import dns.query
import dns.rcode
import dns.rdatatype
import dnslib
import pytest
from prometheus_client import generate_latest

from clusterdns.config import load
from clusterdns.dns import metrics
from clusterdns.dns.server import DnsService, error_reply
from clusterdns.metrics import REGISTRY
from clusterdns.state import StateStore

ROOT = Path(__file__).resolve().parents[2]


class EngineDouble:
    """Answers `fast.*` on the fast path, the rest through resolve()."""

    synced = True

    def __init__(self) -> None:
        self.states = []
        self.clients = []

    def update(self, state) -> None:
        self.states.append(state.version)

    def fast(self, data: bytes, tcp: bool) -> bytes | None:
        name = self._name(data)
        if name and name.startswith("boom."):
            raise RuntimeError("engine bug on the fast path")
        if name and name.startswith("fast."):
            q = dnslib.DNSRecord.parse(data)
            r = q.reply()
            r.add_answer(dnslib.RR(q.q.qname, rdata=dnslib.A("192.0.2.1"), ttl=5))
            return bytes(r.pack())
        return None

    async def resolve(self, data: bytes, client_ip: str, tcp: bool):
        try:
            q = dnslib.DNSRecord.parse(data)
        except Exception:
            return None
        name = str(q.q.qname)
        self.clients.append(client_ip)
        if name.startswith("crash."):
            raise ValueError("engine bug in resolve")
        if name.startswith("slow"):
            await asyncio.sleep(float(name.split(".")[1]) / 1000)
        if name.startswith("xfr.") and tcp:
            out = []
            for i in range(3):
                r = q.reply()
                r.add_answer(dnslib.RR(q.q.qname, dnslib.QTYPE.TXT, rdata=dnslib.TXT(str(i)), ttl=5))
                out.append(bytes(r.pack()))
            return out
        r = q.reply()
        r.add_answer(dnslib.RR(q.q.qname, dnslib.QTYPE.TXT, rdata=dnslib.TXT(name), ttl=5))
        return bytes(r.pack())

    @staticmethod
    def _name(data: bytes) -> str | None:
        try:
            return str(dnslib.DNSRecord.parse(data).q.qname)
        except Exception:
            return None


def cfg_for(*extra: str):
    return load(["dns", "--manifest", "unused.yaml", "--listen", "127.0.0.1:0", "--no-upstream",
                 "--metrics-listen", "none", "--health-listen", "none", *extra])


@pytest.fixture
async def double_server():
    store = StateStore()
    engine = EngineDouble()
    service = DnsService(cfg_for(), store, engine=engine)
    await service.start()
    yield service, engine
    await service.stop()


def addr(service) -> tuple[str, int]:
    return service.bound[0]


async def test_fast_path_and_resolve_over_udp(double_server):
    service, engine = double_server
    host, port = addr(service)
    r = await dns.asyncquery.udp(dns.message.make_query("fast.example.", "A"), host, port=port, timeout=2)
    assert r.answer[0][0].address == "192.0.2.1"
    r = await dns.asyncquery.udp(dns.message.make_query("other.example.", "A"), host, port=port, timeout=2)
    assert r.answer[0][0].strings == (b"other.example.",)
    assert engine.clients == ["127.0.0.1"]


async def test_engine_follows_the_store(double_server):
    service, engine = double_server
    service.store.mark_synced("Service")
    assert engine.states[-1] == service.store.current.version and len(engine.states) == 2


async def test_panic_answers_servfail_and_server_survives(double_server):
    service, _ = double_server
    host, port = addr(service)
    before = metrics._panics[0]
    for name in ("boom.example.", "crash.example."):
        for query in (dns.asyncquery.udp, dns.asyncquery.tcp):
            r = await query(dns.message.make_query(name, "A"), host, port=port, timeout=2)
            assert r.rcode() == dns.rcode.SERVFAIL and r.question[0].name.to_text() == name
    assert metrics._panics[0] == before + 4
    r = await dns.asyncquery.udp(dns.message.make_query("fast.example.", "A"), host, port=port, timeout=2)
    assert r.rcode() == dns.rcode.NOERROR


async def test_tcp_pipelined_answers_out_of_order(double_server):
    """Several queries on one connection; a slow one does not hold back the others."""
    service, _ = double_server
    host, port = addr(service)
    reader, writer = await asyncio.open_connection(host, port)
    names = ["slow.300.example.", "fast.a.example.", "x.example.", "fast.b.example."]
    ids = {}
    for n in names:
        m = dns.message.make_query(n, "A")
        ids[m.id] = n
        wire = m.to_wire()
        writer.write(struct.pack("!H", len(wire)) + wire)
    await writer.drain()
    got = []
    for _ in names:
        size = struct.unpack("!H", await asyncio.wait_for(reader.readexactly(2), 3))[0]
        r = dns.message.from_wire(await reader.readexactly(size))
        got.append(ids[r.id])
    writer.close()
    assert sorted(got) == sorted(names)
    assert got[-1] == "slow.300.example."        # answered last, the others did not wait


async def test_tcp_multi_message_reply(double_server):
    service, _ = double_server
    host, port = addr(service)
    reader, writer = await asyncio.open_connection(host, port)
    wire = dns.message.make_query("xfr.example.", "TXT").to_wire()
    writer.write(struct.pack("!H", len(wire)) + wire)
    texts = []
    for _ in range(3):
        size = struct.unpack("!H", await asyncio.wait_for(reader.readexactly(2), 3))[0]
        texts.append(dns.message.from_wire(await reader.readexactly(size)).answer[0][0].strings[0])
    writer.close()
    assert texts == [b"0", b"1", b"2"]


async def test_tcp_garbage_and_eof_do_not_hurt(double_server):
    service, _ = double_server
    host, port = addr(service)
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(b"\x00\x05hello\x00")      # a 5-byte "query", then half a length prefix
    writer.close()
    r = await dns.asyncquery.tcp(dns.message.make_query("fast.example.", "A"), host, port=port, timeout=2)
    assert r.rcode() == dns.rcode.NOERROR


async def test_metrics_count_requests(double_server):
    service, _ = double_server
    host, port = addr(service)
    for _ in range(3):
        await dns.asyncquery.udp(dns.message.make_query("fast.example.", "AAAA"), host, port=port, timeout=2)
    await dns.asyncquery.tcp(dns.message.make_query("other.example.", "SRV"), host, port=port, timeout=2)
    text = generate_latest(REGISTRY).decode()
    server = f'server="dns://127.0.0.1:{port}"'
    lines = [ln for ln in text.splitlines() if server in ln]
    assert any(ln.startswith("coredns_dns_requests_total") and 'proto="udp"' in ln and 'type="AAAA"' in ln
               and ln.endswith(" 3.0") for ln in lines)
    assert any(ln.startswith("coredns_dns_requests_total") and 'proto="tcp"' in ln and 'type="SRV"' in ln
               for ln in lines)
    assert any(ln.startswith("coredns_dns_responses_total") and 'rcode="NOERROR"' in ln for ln in lines)
    assert any(ln.startswith("coredns_dns_request_duration_seconds_count") and 'type="AAAA"' in ln
               and ln.endswith(" 3.0") for ln in lines)
    assert "coredns_build_info" in text and "coredns_panics_total" in text


def test_receive_buffer_is_large():
    from clusterdns.dns.server import _bind
    udp, tcp = _bind("127.0.0.1", 0)
    try:
        assert udp.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) >= 1 << 20
        assert tcp.getsockname()[1] == udp.getsockname()[1]
    finally:
        udp.close()
        tcp.close()


async def test_address_in_use_is_an_oserror_naming_it(double_server):
    service, _ = double_server
    host, port = addr(service)
    other = DnsService(cfg_for("--listen", f"{host}:{port}"), StateStore(), engine=EngineDouble())
    with pytest.raises(OSError, match=f"127.0.0.1:{port}"):
        await other.start()


def test_error_reply_from_raw_bytes():
    q = dnslib.DNSRecord.question("Example.ORG", "MX")
    q.header.rd = 1
    r = dnslib.DNSRecord.parse(error_reply(bytes(q.pack()), 2))
    assert r.header.id == q.header.id and r.header.rcode == 2 and r.header.qr == 1 and r.header.rd == 1
    assert str(r.q.qname) == "Example.ORG." and r.q.qtype == dnslib.QTYPE.MX
    assert error_reply(b"\x01\x02", 2) is None
    assert dnslib.DNSRecord.parse(error_reply(b"\x12\x34" + b"\x00" * 4 + b"\x00" * 6 + b"\x05ab", 1)).header.q == 0
