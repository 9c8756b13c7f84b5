"""The DNS server: UDP and TCP sockets around the engine.

Per query the UDP path is: engine.fast(bytes) in datagram_received (a
precomputed answer, no task, no parse); only when that returns None does a
task run engine.resolve(). TCP reads length-prefixed queries, answers
pipelined queries as they complete (several in flight per connection, RFC
7766), closes idle connections and bounds how many are open.

A bug while answering one query never stops the server: the exception is
logged, counted in coredns_panics_total, and the client gets SERVFAIL (or
nothing when the packet has no readable header).
"""
from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import socket
import struct
import subprocess
from time import monotonic, perf_counter
from typing import Any, Callable

from ..config import Config
from ..state import ClusterState, Delta, StateStore
from . import metrics
from .forward import Forward

log = logging.getLogger(__name__)

RCVBUF = 4 << 20          # the kernel default (208 KiB here) drops queries far below capacity
SNDBUF = 1 << 20
TCP_IDLE_TIMEOUT = 10.0    # CoreDNS's idle timeout for TCP
TCP_MAX_CONNECTIONS = 1024
TCP_MAX_INFLIGHT = 64      # unanswered queries per TCP connection
MAX_INFLIGHT = 2000        # resolve() tasks for UDP; beyond, queries are dropped (the client retries)
SERVFAIL = 2
PANIC_LOG_INTERVAL = 1.0   # seconds between logged tracebacks when every query fails


def error_reply(data: bytes, rcode: int) -> bytes | None:
    """A minimal reply with `rcode` built from the raw query (no parse); None if no header."""
    if len(data) < 12:
        return None
    flags = data[2] & 0x79 | 0x80          # QR set; opcode and RD kept; AA/TC cleared
    # Echo the first question if it can be delimited; else none.
    i, end, qd = 12, None, 0
    if data[4:6] != b"\x00\x00":
        while i < len(data) and i < 12 + 255:
            n = data[i]
            if n == 0:
                if i + 5 <= len(data):
                    end, qd = i + 5, 1
                break
            if n & 0xC0:
                break
            i += n + 1
    header = data[:2] + bytes((flags, rcode & 15)) + struct.pack("!HHHH", qd, 0, 0, 0)
    return header + (data[12:end] if end else b"")


def _family(host: str) -> int:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _show(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _bind(host: str, port: int, reuse_port: bool = False) -> tuple[socket.socket, socket.socket]:
    """A UDP and a TCP socket on the same address; port 0 picks one free for both.

    reuse_port: SO_REUSEPORT on both (the agent: a restarted process shares the
    port with the previous one during its lameduck)."""
    fam = _family(host)
    for _attempt in range(20):
        udp = socket.socket(fam, socket.SOCK_DGRAM)
        tcp = socket.socket(fam, socket.SOCK_STREAM)
        try:
            for s in (udp, tcp):
                if fam == socket.AF_INET6:
                    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            _set_buffers(udp)
            tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port and port:   # never for port 0: autobind could pick a shared port
                for s in (udp, tcp):
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            udp.bind((host, port))
            real = udp.getsockname()[1]
            tcp.bind((host, real))
            tcp.listen(1024)
            udp.setblocking(False)
            tcp.setblocking(False)
            return udp, tcp
        except OSError as exc:
            udp.close()
            tcp.close()
            if port == 0 and exc.errno == errno.EADDRINUSE:
                continue   # the UDP port was free but not the TCP one: pick another
            raise OSError(exc.errno, f"cannot listen on {_show(host, port)}: {exc.strerror or exc}") from None
    raise OSError(errno.EADDRINUSE, f"cannot listen on {_show(host, port)}: no free port")


def _set_buffers(sock: socket.socket) -> None:
    # SO_RCVBUFFORCE (root) passes net.core.rmem_max; SO_RCVBUF is capped by it.
    for force, plain, size in ((getattr(socket, "SO_RCVBUFFORCE", None), socket.SO_RCVBUF, RCVBUF),
                               (getattr(socket, "SO_SNDBUFFORCE", None), socket.SO_SNDBUF, SNDBUF)):
        for opt in (force, plain):
            if opt is None:
                continue
            try:
                sock.setsockopt(socket.SOL_SOCKET, opt, size)
                break
            except OSError:
                continue


def interface_addresses() -> list[str]:
    """Every address on this host's interfaces (for a wildcard listener's NS records)."""
    try:
        out = subprocess.run(["ip", "-j", "addr", "show"], capture_output=True, text=True, timeout=5).stdout
        return [a["local"] for link in json.loads(out or "[]") for a in link.get("addr_info", []) if "local" in a]
    except (OSError, ValueError, subprocess.SubprocessError):
        return []


class _Udp(asyncio.DatagramProtocol):
    def __init__(self, service: "DnsService", stats: metrics.ServerStats) -> None:
        self.service = service
        self.stats = stats
        self.fast = service.engine.fast
        self.count = stats.fast_udp
        self.record = stats.record
        self.transport: Any = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr) -> None:
        # The hot path: no task, no parse; every query is counted and timed by one call.
        started = perf_counter()
        try:
            reply = self.fast(data, False)
        except Exception:
            reply = self.service.panic(data)
            if reply is not None:
                self.transport.sendto(reply, addr)
            self.record(data, reply, False, started, metrics.SERVER)
            return
        if reply is not None:
            self.transport.sendto(reply, addr)
            self.count(data, reply, started)
            return
        service = self.service
        if len(service.tasks) >= MAX_INFLIGHT:
            self.record(data, None, False, started)
            return
        task = asyncio.ensure_future(self.resolve(data, addr, started))
        service.tasks.add(task)
        task.add_done_callback(service.tasks.discard)

    async def resolve(self, data: bytes, addr, started: float) -> None:
        metrics.begin_resolve()
        reply = await self.service.resolve(data, addr[0], False)
        if isinstance(reply, list):      # a transfer is TCP only; the engine refuses it on UDP
            reply = reply[0] if reply else None
        if reply is not None and self.transport is not None and not self.transport.is_closing():
            self.transport.sendto(reply, addr)
        self.record(data, reply, False, started)

    def error_received(self, exc) -> None:   # ICMP errors for replies: nothing to do
        pass


class DnsService:
    """The DNS half the agent composes: engine + listeners, fed by a StateStore.

        service = DnsService(cfg, store)
        await service.start()          # binds every cfg.listen_addresses() pair, UDP and TCP
        service.bound                  # [(host, port)] actually bound
        await service.stop()
    """

    def __init__(self, cfg: Config, store: StateStore, *, forwarder=None, engine=None,
                 reuse_port: bool = False) -> None:
        self.cfg = cfg
        self.reuse_port = reuse_port
        self.store = store
        self.forwarder = forwarder if forwarder is not None else Forward.from_config(cfg)
        if engine is None:
            from .engine import Engine  # the answer engine (zone view, wire building)
            engine = Engine(cfg, self.forwarder, server_addresses=self.server_addresses)
        self.engine = engine
        self.bound: list[tuple[str, int]] = []
        self.tasks: set[asyncio.Future] = set()
        self._transports: list[Any] = []
        self._servers: list[asyncio.AbstractServer] = []
        self._stats: list[metrics.ServerStats] = []
        self._tcp_connections = 0
        self._iface_addresses: list[str] | None = None
        self._panics = 0
        self._panic_logged = -PANIC_LOG_INTERVAL
        store.subscribe(self._on_state)
        self.engine.update(store.current)

    # -- state ---------------------------------------------------------

    def _on_state(self, _old: ClusterState, new: ClusterState, _delta: Delta) -> None:
        self.engine.update(new)

    @property
    def synced(self) -> bool:
        return bool(self.engine.synced)

    def server_addresses(self) -> list[str]:
        """The IPs this server answers on (wildcards expanded), for the zone's NS records."""
        out: list[str] = []
        for host, _port in self.bound:
            if host in ("0.0.0.0", "::"):
                if self._iface_addresses is None:
                    self._iface_addresses = interface_addresses()
                fam = _family(host)
                out += [a for a in self._iface_addresses if _family(a) == fam]
            else:
                out.append(host)
        return list(dict.fromkeys(out))

    # -- queries -------------------------------------------------------

    def panic(self, data: bytes) -> bytes | None:
        """Called from an except block: count, log (rate-limited), and build SERVFAIL."""
        metrics.panic()
        self._panics += 1
        now = monotonic()
        if now - self._panic_logged >= PANIC_LOG_INTERVAL:
            log.exception("answering a query failed (%d since the last report); replying SERVFAIL",
                          self._panics)
            self._panic_logged, self._panics = now, 0
        return error_reply(data, SERVFAIL)

    async def resolve(self, data: bytes, client_ip: str, tcp: bool) -> bytes | list[bytes] | None:
        try:
            return await self.engine.resolve(data, client_ip, tcp)
        except asyncio.CancelledError:
            raise
        except Exception:
            return self.panic(data)

    # -- TCP -----------------------------------------------------------

    def _tcp_handler(self, stats: metrics.ServerStats) -> Callable:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            if self._tcp_connections >= TCP_MAX_CONNECTIONS:
                writer.close()
                return
            self._tcp_connections += 1
            try:
                await self._tcp_session(reader, writer, stats)
            except (ConnectionError, OSError):
                pass
            except Exception:
                metrics.panic()
                log.exception("TCP connection handler failed")
            finally:
                self._tcp_connections -= 1
                writer.close()
        return handle

    async def _tcp_session(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                           stats: metrics.ServerStats) -> None:
        peer = writer.get_extra_info("peername") or ("", 0)
        client_ip = peer[0]
        fast = self.engine.fast
        pending: set[asyncio.Future] = set()
        lock = asyncio.Lock()   # keeps each framed reply contiguous on the stream

        async def send(replies: list[bytes]) -> None:
            async with lock:
                for reply in replies:
                    writer.write(struct.pack("!H", len(reply)) + reply)
                try:
                    # A client that stops reading must not hold the connection forever.
                    await asyncio.wait_for(writer.drain(), TCP_IDLE_TIMEOUT)
                except asyncio.TimeoutError:
                    writer.transport.abort()
                    raise ConnectionError("client stopped reading") from None

        async def slow(data: bytes, started: float) -> None:
            metrics.begin_resolve()
            reply = await self.resolve(data, client_ip, True)
            replies = reply if isinstance(reply, list) else ([] if reply is None else [reply])
            if replies and not writer.is_closing():
                try:
                    await send(replies)
                except (ConnectionError, OSError):
                    pass
            stats.record(data, replies[0] if replies else None, True, started)

        while True:
            try:
                size = struct.unpack("!H", await asyncio.wait_for(reader.readexactly(2), TCP_IDLE_TIMEOUT))[0]
                data = await asyncio.wait_for(reader.readexactly(size), TCP_IDLE_TIMEOUT)
            except (asyncio.IncompleteReadError, asyncio.TimeoutError, ConnectionError):
                break
            started = perf_counter()
            part = metrics.FAST
            try:
                reply = fast(data, True)
            except Exception:
                reply, part = self.panic(data), metrics.SERVER
            if reply is not None:
                await send([reply])
                stats.record(data, reply, True, started, part)
                continue
            if len(pending) >= TCP_MAX_INFLIGHT:
                await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            task = asyncio.ensure_future(slow(data, started))
            pending.add(task)
            task.add_done_callback(pending.discard)
        if pending:   # the client finished sending: let its last answers go out
            await asyncio.wait(pending, timeout=6.0)

    # -- lifecycle -----------------------------------------------------

    async def start(self) -> None:
        """Bind every listen address (UDP and TCP); raises OSError naming the address that failed."""
        loop = asyncio.get_running_loop()
        try:
            for host, port in self.cfg.listen_addresses():
                udp, tcp = _bind(host, port, self.reuse_port)
                real = udp.getsockname()[1]
                stats = metrics.ServerStats(f"dns://{_show(host, real)}", 2 if _family(host) == socket.AF_INET6 else 1,
                                            metrics.plugins_for(self.cfg, self.forwarder))
                metrics.register_server(stats)
                self._stats.append(stats)
                transport, _ = await loop.create_datagram_endpoint(lambda: _Udp(self, stats), sock=udp)
                self._transports.append(transport)
                server = await asyncio.start_server(self._tcp_handler(stats), sock=tcp, limit=70000)
                self._servers.append(server)
                self.bound.append((host, real))
        except BaseException:
            await self.stop()
            raise
        if self.forwarder is not None and getattr(self.forwarder, "upstreams", None):
            task = asyncio.ensure_future(self._detect_loops())
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _detect_loops(self) -> None:
        try:
            await self.forwarder.detect_loops()
        except Exception:
            log.exception("loop detection failed")

    async def stop(self) -> None:
        for t in self._transports:
            t.close()
        for s in self._servers:
            s.close()
        for t in list(self.tasks):
            t.cancel()
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=1.0)
        for s in self._servers:
            try:
                await asyncio.wait_for(s.wait_closed(), 1.0)
            except asyncio.TimeoutError:
                pass
        self._transports.clear()
        self._servers.clear()
        if self.forwarder is not None and hasattr(self.forwarder, "close"):
            await self.forwarder.close()


def banner(service: DnsService) -> str:
    addrs = " ".join(_show(h, p) for h, p in service.bound)
    up = getattr(service.forwarder, "upstreams", None)
    if service.forwarder is None:
        ups = "none (--no-upstream: REFUSED)"
    else:
        ups = ", ".join(u.address for u in up) if up else "none found (SERVFAIL)"
    return (f"clusterdns dns {os.getpid()}: serving {', '.join(service.cfg.zones)} on {addrs} "
            f"(UDP+TCP); upstreams: {ups}")
