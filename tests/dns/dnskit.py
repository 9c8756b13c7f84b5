"""Helpers of the DNS tests, imported as a module (`from tests.dns.dnskit import ask`).

The demo cluster at a fixed serial and an engine factory (make_state, make_engine,
ask, ask_wire, lines); the real server in-process (LiveServer) or as a
`python3 -m clusterdns dns` subprocess (ServerProcess); FakeUpstream, a small
dnspython server (UDP and TCP) on an ephemeral loopback port that answers from
a table, can be slow, can truncate UDP replies, and counts what it received.
"""
from __future__ import annotations

import asyncio
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import dns.exception
import dns.flags
import dns.message
import dns.name
import dns.query
import dns.rcode
import dns.rdatatype
import dns.rrset

from clusterdns.config import Config
from clusterdns.dns.engine import Engine
from clusterdns.sources.manifest import publish
from clusterdns.state import ClusterState, StateStore
from tests.netutil import free_port

ROOT = Path(__file__).resolve().parents[2]


SERIAL = 1_700_000_001


def make_state(records, clock: float = SERIAL - 1) -> ClusterState:
    store = StateStore(clock=lambda: clock)
    publish(store, records)
    return store.current


def make_engine(state: ClusterState | None, forwarder=None, server_addresses=lambda: [], **options) -> Engine:
    engine = Engine(Config().with_options(**options), forwarder, server_addresses)
    if state is not None:
        engine.update(state)
    return engine


def query_wire(name: str, qtype: str = "A", **kw) -> bytes:
    return dns.message.make_query(name, qtype, **kw).to_wire()


def ask_wire(engine: Engine, wire: bytes, client_ip: str = "10.161.37.5", tcp: bool = False):
    """resolve() the query twice and fast() it: the three answers must be byte-identical."""
    first = asyncio.run(engine.resolve(wire, client_ip, tcp))
    fast = engine.fast(wire, tcp)
    if fast is not None:
        assert fast == first, "fast() and resolve() disagree"
    again = asyncio.run(engine.resolve(wire, client_ip, tcp))
    assert again == first
    return first


def ask(engine: Engine, name: str, qtype: str = "A", client_ip: str = "10.161.37.5", tcp: bool = False, **kw):
    wire = query_wire(name, qtype, **kw)
    reply = ask_wire(engine, wire, client_ip, tcp)
    assert isinstance(reply, bytes)
    return dns.message.from_wire(reply)


def lines(section) -> list[str]:
    """A message section as sorted zone-file lines, names lower-cased."""
    out = []
    for rrset in section:
        for line in rrset.to_text().splitlines():
            out.append(line.lower())
    return sorted(out)


class LiveServer:
    """The real DNS server (DnsService: UDP and TCP sockets) on 127.0.0.1, its event loop in a
    thread, answering from `records`; queried with dnspython over real sockets."""

    def __init__(self, records, **options) -> None:
        import threading

        from clusterdns.dns.server import DnsService
        forwarder = options.pop("forwarder", None)
        options.setdefault("no_upstream", forwarder is None)
        self.cfg = Config().with_options(listen=("127.0.0.1:0",), **options)
        self.store = StateStore(clock=lambda: SERIAL - 1)
        publish(self.store, records)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.service = DnsService(self.cfg, self.store, forwarder=forwarder)
        self._call(self.service.start())
        self.port = self.service.bound[0][1]

    def _call(self, coro, timeout: float = 10.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def query(self, name: str, rdtype: str = "A", tcp: bool = False, timeout: float = 5.0, **kw):
        import dns.query
        q = dns.message.make_query(name, rdtype, **kw)
        send = dns.query.tcp if tcp else dns.query.udp
        return send(q, "127.0.0.1", port=self.port, timeout=timeout)

    def close(self) -> None:
        self._call(self.service.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


# ---------------------------------------------------------------- the server as a command

DEMO = ROOT / "clusterdns" / "demo" / "cluster.yaml"


class ServerProcess:
    """`python3 -m clusterdns dns ...` as a subprocess, waited for until it answers."""

    def __init__(self, *args: str, port: int | None = None, http: bool = False) -> None:
        self.port = port or free_port()
        self.http_port = free_port() if http else None
        hl = f"127.0.0.1:{self.http_port}" if http else "none"
        self.argv = [sys.executable, "-m", "clusterdns", "dns", "--listen", f"127.0.0.1:{self.port}",
                     "--metrics-listen", hl, "--health-listen", hl, *args]
        self.proc = subprocess.Popen(self.argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}: {self.proc.stdout.read()}")
            try:
                dns.query.udp(dns.message.make_query("dns-version.cluster.local.", "TXT"), "127.0.0.1",
                              port=self.port, timeout=0.2)
                return
            except (dns.exception.Timeout, OSError, dns.query.BadResponse):
                # BadResponse: a late reply to an earlier try that timed out, reaching a new
                # socket the kernel gave the same port
                continue
        self.stop()
        raise RuntimeError("server did not answer within 15 s")

    def query(self, name: str, rdtype: str = "A", tcp: bool = False, **kw) -> dns.message.Message:
        q = dns.message.make_query(name, rdtype, **kw)
        send = dns.query.tcp if tcp else dns.query.udp
        return send(q, "127.0.0.1", port=self.port, timeout=3)

    def dig(self, *args: str) -> str:
        return subprocess.run(["dig", "@127.0.0.1", "-p", str(self.port), "+time=3", "+tries=1", *args],
                              capture_output=True, text=True, timeout=10).stdout

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.kill()
        out, _ = self.proc.communicate(timeout=10)
        return out


# ---------------------------------------------------------------- upstream servers

SOA = "example. 60 IN SOA ns.example. host.example. 1 7200 1800 86400 30"


def soa_rrset():
    name, ttl, cls, rtype, rdata = SOA.split(" ", 4)
    return dns.rrset.from_text(name, int(ttl), cls, rtype, rdata)


class FakeUpstream:
    """A real DNS server on 127.0.0.1 answering from `records` (name -> list of rrset texts)."""

    def __init__(self, records: dict[str, list[str]] | None = None, *, delay: float = 0.0,
                 truncate_udp: bool = False, rcode: int | None = None) -> None:
        self.records = records or {}
        self.delay, self.truncate_udp, self.rcode = delay, truncate_udp, rcode
        self.received: list[tuple[str, str, int]] = []   # (proto, qname, qtype), once answered
        self.asked: list[str] = []                          # proto of each query, on arrival
        self.port = 0
        self._udp = None
        self._tcp = None

    def answer(self, wire: bytes, proto: str) -> bytes | None:
        try:
            q = dns.message.from_wire(wire)
        except Exception:
            return None
        question = q.question[0]
        self.received.append((proto, question.name.to_text().lower(), question.rdtype))
        r = dns.message.make_response(q)
        if self.rcode is not None:
            r.set_rcode(self.rcode)
            return r.to_wire()
        texts = self.records.get(question.name.to_text().lower())
        if texts is None:
            r.set_rcode(dns.rcode.NXDOMAIN)
            r.authority.append(soa_rrset())
            return r.to_wire()
        for text in texts:
            name, ttl, cls, rtype, rdata = text.split(" ", 4)
            if dns.rdatatype.from_text(rtype) == question.rdtype:
                r.answer.append(dns.rrset.from_text(name, int(ttl), cls, rtype, rdata))
        if not r.answer:
            r.authority.append(soa_rrset())
        if proto == "udp" and self.truncate_udp:
            r.answer = []
            r.flags |= dns.flags.TC
        return r.to_wire()

    async def start(self, port: int = 0) -> "FakeUpstream":
        loop = asyncio.get_running_loop()
        up = self

        class Proto(asyncio.DatagramProtocol):
            def connection_made(self, transport):
                self.transport = transport

            def datagram_received(self, data, addr):
                up.asked.append("udp")

                async def reply():
                    if up.delay:
                        await asyncio.sleep(up.delay)
                    out = up.answer(data, "udp")
                    if out is not None:
                        self.transport.sendto(out, addr)
                loop.create_task(reply())

        for _attempt in range(20):   # port 0: the UDP port may be taken for TCP; pick again
            self._udp, _ = await loop.create_datagram_endpoint(Proto, local_addr=("127.0.0.1", port))
            self.port = self._udp.get_extra_info("sockname")[1]
            try:
                self._tcp = await asyncio.start_server(self._handle, "127.0.0.1", self.port)
                return self
            except OSError:
                self._udp.close()
                if port:
                    raise
        raise OSError("no free port for the fake upstream")

    async def _handle(self, reader, writer):
        up = self
        try:
            while True:
                size = struct.unpack("!H", await reader.readexactly(2))[0]
                data = await reader.readexactly(size)
                up.asked.append("tcp")
                if up.delay:
                    await asyncio.sleep(up.delay)
                out = up.answer(data, "tcp")
                if out is not None:
                    writer.write(struct.pack("!H", len(out)) + out)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    @property
    def address(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)

    async def stop(self) -> None:
        if self._udp:
            self._udp.close()
        if self._tcp:
            self._tcp.close()
            await self._tcp.wait_closed()


def closed_port() -> int:
    """A loopback UDP/TCP port nobody listens on (queries get ICMP/RST)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


RECORDS = {
    "www.example.": ["www.example. 300 IN A 192.0.2.1", "www.example. 300 IN AAAA 2001:db8::1"],
    "short.example.": ["short.example. 1 IN A 192.0.2.2"],
    "big.example.": [f"big.example. 60 IN A 198.51.100.{i}" for i in range(1, 61)],
}
