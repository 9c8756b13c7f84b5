"""Forwarding names outside the served zones to upstream resolvers (CoreDNS's `forward`).

The transport follows the client (UDP -> UDP, TCP -> TCP); a truncated UDP
reply is retried over TCP so the cache holds whole answers (the server then
fits the reply to the client's size). Upstreams are tried in random order,
healthy ones first; `max_fails` consecutive failures mark one unhealthy and a
`. IN NS` probe every `health_interval` seconds brings it back. Each try
(connect, send and read, a TCP retry after TC included) takes at most
`read_timeout`, a whole query at most `overall_timeout`: one deadline across
the tries. When everything failed, a stale cached answer is served if there is
one, else None (the engine answers SERVFAIL).

A reply is taken only if it is one: QR set, our ID and question, from the
address asked (a connected UDP socket; the TCP stream), and every name in it
a name (at most 255 octets). Anything else (an echoed query, a stray or
spoofed datagram) is ignored while the try waits on; an unusable reply fails
the try, is never cached, and is logged at most once per `LOG_INTERVAL`.

The Corefile's `forward` (clusterdns.corefile.plugins.forward) sets the rest of
CoreDNS's knobs, all off by default so the flag-driven forwarder is as above:
`policy` (random, round_robin, sequential), `force_tcp` / `prefer_udp`, DNS over
TLS upstreams (`Upstream.tls`, an ssl context, SNI per upstream), idle TCP/TLS
connections kept for reuse up to `expire` seconds (`max_idle` per upstream,
0 = no cap; `expire` 0 = a new connection per query), the health probe's
name and RD bit and transport, `failfast` (SERVFAIL at once when every
upstream is down, instead of trying them anyway), `failover` rcodes (try the
next upstream on those), `max_connect_attempts`. `max_fails` 0 never marks an
upstream down; `max_concurrent` 0 is no limit. `ask()` is `query()` without
the cache and loop probes, failing with ForwardFailed / ForwardRefused.

Loop detection (CoreDNS's `loop`): at start a random `HINFO` name is sent to
each upstream; when that name comes back into this forwarder more than twice,
queries to us loop through that upstream, which is then disabled for good.
"""
from __future__ import annotations

import asyncio
import logging
import random
import socket
import ssl
import struct
import time
from dataclasses import dataclass, field
from typing import Sequence

import dnslib
from dnslib.buffer import BufferError as DNSBufferError
from dnslib.label import DNSLabelError

from ..config import Config, parse_hostport
from ..lograte import LogLimit
from . import metrics, resolvconf
from .cache import Cache, cache_key
from .wire import question_end

log = logging.getLogger(__name__)

READ_TIMEOUT = 2.0
OVERALL_TIMEOUT = 5.0
MAX_FAILS = 2
HEALTH_INTERVAL = 0.5
MAX_UPSTREAMS = 15
MAX_CONCURRENT = 1000
LOOP_THRESHOLD = 2     # the probe seen more than this many times = loop
LOG_INTERVAL = 10.0    # seconds between warnings about unusable upstream replies


class UpstreamError(Exception):
    """One try at one upstream failed (timeout, refused, bad reply)."""


class UnusableReply(UpstreamError):
    """The upstream's reply cannot be used (unparsable, or a name longer than a name may be)."""


class ForwardFailed(Exception):
    """No upstream gave a usable answer (the reason names the last failure)."""


class ForwardRefused(Exception):
    """More queries in flight than max_concurrent: REFUSED, not an upstream failure."""


POLICIES = ("random", "round_robin", "sequential")


@dataclass(eq=False)
class Upstream:
    host: str
    port: int
    fails: int = 0
    looped: bool = False
    tls: bool = False                  # DNS over TLS (RFC 7858)
    server_name: str | None = None     # its SNI and the name its certificate must carry
    _probe: asyncio.Task | None = field(default=None, repr=False)
    # idle connections for reuse: (reader, writer, idle since)
    _idle: list = field(default_factory=list, repr=False)

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def to(self) -> str:
        """As a Corefile would write it: `tls://1.1.1.1:853`, `127.0.0.1:53`."""
        return ("tls://" if self.tls else "") + self.address

    @property
    def family(self) -> int:
        return socket.AF_INET6 if ":" in self.host else socket.AF_INET


def upstreams_from(cfg: Config) -> list[tuple[str, int]]:
    """--upstream, else the nameservers of --resolv-conf (empty if unreadable)."""
    if cfg.dns.upstream:
        found = [parse_hostport(u, 53) for u in cfg.dns.upstream]
    else:
        try:
            conf = resolvconf.read(cfg.dns.resolv_conf)
        except OSError as exc:
            log.warning("cannot read %s (%s): no upstreams", cfg.dns.resolv_conf, exc.strerror or exc)
            return []
        found = []
        for ns in conf.nameservers:
            try:
                found.append(parse_hostport(ns.split("%", 1)[0], 53))
            except ValueError:
                log.warning("%s: ignoring nameserver %r", cfg.dns.resolv_conf, ns)
    if len(found) > MAX_UPSTREAMS:
        log.warning("using the first %d of %d upstreams", MAX_UPSTREAMS, len(found))
    return found[:MAX_UPSTREAMS]


def is_reply_to(data: bytes, wire: bytes) -> bool:
    """Is `data` a response (QR set) with the ID and question of the query `wire`? Question
    names compare case-insensitively (some resolvers change the case, as 0x20 probing does)."""
    if len(data) < 12 or data[:2] != wire[:2] or not data[2] & 0x80:
        return False
    qend = question_end(wire)
    if qend < 0:
        return False
    question = wire[12:qend]
    return data[4:6] == b"\x00\x01" and data[12:12 + len(question)].lower() == question.lower()


async def exchange(upstream: Upstream, wire: bytes, tcp: bool, timeout: float) -> bytes:
    """One query to one upstream; returns the reply bytes or raises UpstreamError.

    `timeout` bounds the whole exchange (connect, send, every read). Datagrams that are not
    the reply (an echo of the query, another ID or question) are ignored; over TCP the
    answer must be the reply."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout

    def left() -> float:
        return max(0.0, deadline - loop.time())
    try:
        if tcp:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(upstream.host, upstream.port), left())
            try:
                writer.write(struct.pack("!H", len(wire)) + wire)
                size = struct.unpack("!H", await asyncio.wait_for(reader.readexactly(2), left()))[0]
                data = await asyncio.wait_for(reader.readexactly(size), left())
            finally:
                writer.close()
            if not is_reply_to(data, wire):
                raise UpstreamError(f"{upstream.address}: the TCP answer is not a reply to the query")
            return data
        sock = socket.socket(upstream.family, socket.SOCK_DGRAM)
        try:
            sock.setblocking(False)
            # Connected: only datagrams from the address asked arrive, and ICMP
            # port-unreachable surfaces as ConnectionRefusedError at once.
            sock.connect((upstream.host, upstream.port))
            await loop.sock_sendall(sock, wire)
            while True:
                data = await asyncio.wait_for(loop.sock_recv(sock, 65535), left())
                if is_reply_to(data, wire):
                    return data
                # an echo, a stray or spoofed datagram: keep waiting for ours
        finally:
            sock.close()
    except (asyncio.TimeoutError, OSError, asyncio.IncompleteReadError, struct.error) as exc:
        raise UpstreamError(f"{upstream.address}: {type(exc).__name__} {exc}".strip()) from None


class Forward:
    """Forwarder for the engine: `await query(request, tcp)` -> reply or None."""

    def __init__(self, addresses: Sequence[tuple[str, int] | Upstream], cache: Cache | None = None, *,
                 read_timeout: float = READ_TIMEOUT, overall_timeout: float = OVERALL_TIMEOUT,
                 max_fails: int = MAX_FAILS, health_interval: float = HEALTH_INTERVAL,
                 max_concurrent: int = MAX_CONCURRENT, policy: str = "random",
                 force_tcp: bool = False, prefer_udp: bool = False,
                 tls_context: ssl.SSLContext | None = None, expire: float = 0.0, max_idle: int = 0,
                 health_rd: bool = True, health_domain: str = ".", failfast: bool = False,
                 failover: Sequence[int] = (), max_connect_attempts: int = 0) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}")
        self.upstreams = [a if isinstance(a, Upstream) else Upstream(a[0], a[1]) for a in addresses]
        self.cache = cache
        self.read_timeout, self.overall_timeout = read_timeout, overall_timeout
        self.max_fails, self.health_interval = max_fails, health_interval
        self.max_concurrent = max_concurrent
        self.policy, self._robin = policy, 0
        self.force_tcp, self.prefer_udp = force_tcp, prefer_udp
        self.tls_context = tls_context
        self.expire, self.max_idle = expire, max_idle
        self.health_rd, self.health_domain = health_rd, health_domain
        self.failfast, self.failover = failfast, frozenset(failover)
        self.max_connect_attempts = max_connect_attempts
        self._inflight = 0
        self.loop_probes: dict[str, Upstream] = {}    # loop-probe name -> upstream probed
        self._probe_seen: dict[str, int] = {}
        self._bad_log = LogLimit(LOG_INTERVAL)
        if cache is not None:
            metrics.register_cache(cache)

    @classmethod
    def from_config(cls, cfg: Config) -> "Forward | None":
        """The forwarder cfg asks for; None with --no-upstream."""
        if cfg.dns.no_upstream:
            return None
        cache = Cache(cfg.dns.cache_size, cfg.dns.cache_min_ttl, cfg.dns.cache_max_ttl) if cfg.dns.cache_size > 0 else None
        return cls(upstreams_from(cfg), cache)

    def healthy(self, up: Upstream) -> bool:
        return not up.looped and (self.max_fails == 0 or up.fails < self.max_fails)

    def _order(self, qname: str) -> list[Upstream]:
        """The upstreams to try, in policy order, the healthy ones first."""
        target = self.loop_probes.get(qname)
        if target is not None:   # a loop probe always goes through the upstream it tests
            return [target]
        live = [u for u in self.upstreams if not u.looped]
        if self.policy == "random":
            random.shuffle(live)
        elif self.policy == "round_robin" and live:
            # CoreDNS's roundRobin: the counter moves first, so the first query starts at the
            # second upstream; the chosen one leads, the others keep their configured order.
            self._robin += 1
            i = self._robin % len(live)
            live = [live[i]] + live[:i] + live[i + 1:]
        healthy = [u for u in live if self.healthy(u)]
        down = [u for u in live if not self.healthy(u)]
        if not healthy:
            random.shuffle(down)   # all down: health checking is assumed broken, any one may do
        return healthy + down

    def _transport(self, tcp: bool) -> bool:
        """TCP to the upstream? force_tcp wins over prefer_udp; else the client's transport."""
        if self.force_tcp:
            return True
        return False if self.prefer_udp else tcp

    async def query(self, request: dnslib.DNSRecord, tcp: bool) -> dnslib.DNSRecord | None:
        key = cache_key(request)
        qname = str(request.q.qname).lower() if request.questions else ""
        if qname in self.loop_probes:
            seen = self._probe_seen[qname] = self._probe_seen.get(qname, 0) + 1
            if seen > LOOP_THRESHOLD:
                self._loop_found(qname)
                return None
        if self.cache is not None:
            hit = self.cache.get(key, request)
            if hit is not None:
                metrics.answered_by("cache")     # coredns_dns_responses_total{plugin}
                return hit
        try:
            reply, wire = await self._ask(request, tcp, qname)
        except ForwardRefused:
            metrics.answered_by("forward")
            reply = request.reply()
            reply.header.ra, reply.header.rcode = 1, dnslib.RCODE.REFUSED
            return reply
        except ForwardFailed:
            if self.cache is not None:
                stale = self.cache.get(key, request, stale=True)
                if stale is not None:
                    metrics.answered_by("cache")
                    return stale
            return None
        metrics.answered_by("forward")
        if self.cache is not None:
            self.cache.put(key, reply, wire)
        reply.header.id = request.header.id
        reply.questions = list(request.questions)
        return reply

    async def ask(self, request: dnslib.DNSRecord, tcp: bool, tried: list | None = None) -> dnslib.DNSRecord:
        """The upstreams' answer to `request` with its ID and question (no cache, no loop
        probes); ForwardRefused beyond max_concurrent, ForwardFailed when none answered.
        `tried` gets each try as (upstream, transport, rcode or failure, whether its reply
        is the one returned)."""
        qname = str(request.q.qname).lower() if request.questions else ""
        reply, _ = await self._ask(request, tcp, qname, tried)
        reply.header.id = request.header.id
        reply.questions = list(request.questions)
        return reply

    async def _ask(self, request: dnslib.DNSRecord, tcp: bool, qname: str,
                   tried: list | None = None) -> tuple[dnslib.DNSRecord, bytes]:
        if self.max_concurrent and self._inflight >= self.max_concurrent:
            metrics.forward_rejects.inc()
            raise ForwardRefused(f"concurrent queries exceeded maximum {self.max_concurrent}")
        self._inflight += 1
        try:
            reply, wire, reason = await self._forward(request, tcp, qname, [] if tried is None else tried)
        finally:
            self._inflight -= 1
        if reply is None:
            raise ForwardFailed(reason)
        return reply, wire

    async def _forward(self, request: dnslib.DNSRecord, tcp: bool, qname: str, tried: list):
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.overall_timeout
        order = self._order(qname)
        if not order:
            return None, b"", "no upstreams"
        if self.failfast and not self.healthy(order[0]) and qname not in self.loop_probes:
            metrics.healthcheck_broken.inc()
            return None, b"", "no healthy upstreams (failfast_all_unhealthy_upstreams)"
        outgoing = request.pack()
        if self.cache is not None and all(not self.healthy(u) for u in order):
            # Everything is known down: a stale answer now beats a certain timeout.
            if self.cache.get(cache_key(request), request, stale=True) is not None:
                return None, b"", "every upstream is down"
        over_tcp = self._transport(tcp)
        reason = "overall timeout before any upstream was tried"
        last: tuple[dnslib.DNSRecord, bytes] | None = None    # a failover rcode's reply
        last_try = -1
        if self.max_connect_attempts:
            order = order[:self.max_connect_attempts]
        for n, up in enumerate(order):
            left = deadline - loop.time()
            if left <= 0:
                reason = f"overall timeout ({self.overall_timeout:g}s); last: {reason}"
                break
            query = dnslib.DNSRecord.parse(outgoing)
            query.header.id = random.getrandbits(16)
            wire = bytes(query.pack())
            started = time.perf_counter()
            metrics.forward_requests.labels(up.address).inc()
            proto = "tls" if up.tls else "tcp" if over_tcp else "udp"
            try:
                try_end = loop.time() + min(self.read_timeout, left)   # one bound for this try
                data = await self._exchange(up, wire, over_tcp, try_end - loop.time())
                reply = self._check(query, data, up)
                if reply.header.tc and not over_tcp and not up.tls:
                    # Retry over TCP for the whole answer (cache it whole), within the same try.
                    proto = "udp, truncated, then tcp"
                    data = await self._exchange(up, wire, True, max(0.0, try_end - loop.time()))
                    reply = self._check(query, data, up)
            except UnusableReply as exc:
                reason = str(exc)
                self._unusable(reason)
                self._failed(up, reason)
                tried.append((up.address, proto, reason, False))
                continue
            except UpstreamError as exc:
                reason = str(exc)
                self._failed(up, reason)
                tried.append((up.address, proto, reason, False))
                continue
            rcode = metrics.RCODES.get(reply.header.rcode, str(reply.header.rcode))
            tried.append((up.address, proto, rcode, False))
            metrics.forward_responses.labels(up.address, rcode).inc()
            metrics.proxy_duration.labels("forward", up.address, rcode).observe(time.perf_counter() - started)
            up.fails = 0
            if reply.header.rcode in self.failover and n + 1 < len(order):
                last, reason = (reply, data), f"{up.address}: {rcode} (failover)"
                last_try = len(tried) - 1
                continue
            tried[-1] = tried[-1][:3] + (True,)
            return reply, data, ""
        if last is not None:
            tried[last_try] = tried[last_try][:3] + (True,)
            return last[0], last[1], ""
        return None, b"", reason

    async def _exchange(self, up: Upstream, wire: bytes, tcp: bool, timeout: float, pooled: bool = True) -> bytes:
        """One query to one upstream over its transport (TLS; else TCP or UDP as asked)."""
        if not up.tls and not (tcp and self.expire > 0 and pooled):
            return await exchange(up, wire, tcp, timeout)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        proto = "TLS" if up.tls else "TCP"
        try:
            for attempt in (0, 1):
                conn = self._take(up) if pooled and attempt == 0 else None
                reused = conn is not None
                if conn is None:
                    conn = await self._connect(up, max(0.0, deadline - loop.time()))
                reader, writer = conn
                try:
                    writer.write(struct.pack("!H", len(wire)) + wire)
                    try:
                        head = await asyncio.wait_for(reader.readexactly(2), max(0.0, deadline - loop.time()))
                    except (asyncio.IncompleteReadError, ConnectionError):
                        if reused:
                            writer.close()
                            continue    # the upstream closed the idle connection: once more, anew
                        raise
                    size = struct.unpack("!H", head)[0]
                    data = await asyncio.wait_for(reader.readexactly(size), max(0.0, deadline - loop.time()))
                except BaseException:
                    writer.close()
                    raise
                if not is_reply_to(data, wire):
                    writer.close()
                    raise UpstreamError(f"{up.address}: the {proto} answer is not a reply to the query")
                if pooled:
                    self._give(up, reader, writer)
                else:
                    writer.close()
                return data
        except (asyncio.TimeoutError, OSError, asyncio.IncompleteReadError, struct.error) as exc:
            raise UpstreamError(f"{up.address}: {proto} {type(exc).__name__} {exc}".strip()) from None
        raise UpstreamError(f"{up.address}: {proto} connection closed")

    async def _connect(self, up: Upstream, timeout: float):
        if not up.tls:
            return await asyncio.wait_for(asyncio.open_connection(up.host, up.port), timeout)
        if self.tls_context is None:   # the system CAs, loaded once
            self.tls_context = ssl.create_default_context()
        ctx = self.tls_context
        return await asyncio.wait_for(asyncio.open_connection(
            up.host, up.port, ssl=ctx, server_hostname=up.server_name or up.host,
            ssl_handshake_timeout=max(timeout, 0.001)), timeout)

    def _take(self, up: Upstream):
        """An idle connection to `up` younger than `expire`, or None."""
        now = time.monotonic()
        while up._idle:
            reader, writer, since = up._idle.pop()
            if now - since <= self.expire and not reader.at_eof() and not writer.is_closing():
                return reader, writer
            writer.close()
        return None

    def _give(self, up: Upstream, reader, writer) -> None:
        if self.expire <= 0 or (self.max_idle and len(up._idle) >= self.max_idle):
            writer.close()
            return
        up._idle.append((reader, writer, time.monotonic()))

    @staticmethod
    def _check(query: dnslib.DNSRecord, data: bytes, up: Upstream) -> dnslib.DNSRecord:
        try:
            reply = dnslib.DNSRecord.parse(data)
        except (dnslib.DNSError, DNSLabelError, DNSBufferError, ValueError, IndexError, struct.error) as exc:
            raise UnusableReply(f"{up.address}: unparsable reply ({exc})") from None
        if not reply.header.qr or reply.header.id != query.header.id or [
                (str(q.qname).lower(), q.qtype, q.qclass) for q in reply.questions] != [
                (str(q.qname).lower(), q.qtype, q.qclass) for q in query.questions]:
            raise UpstreamError(f"{up.address}: reply does not match the query")
        try:
            # every name must be one (RFC 1035: at most 255 octets): a reply we could not
            # write back is the upstream's fault, not ours, and must never be cached
            reply.pack()
        except (dnslib.DNSError, DNSLabelError, DNSBufferError, ValueError, IndexError, struct.error) as exc:
            raise UnusableReply(f"{up.address}: unusable reply ({exc})") from None
        return reply

    def _unusable(self, reason: str) -> None:
        """An upstream sent a reply we cannot use: a warning at most every LOG_INTERVAL."""
        n = self._bad_log.due()
        if n:
            log.warning("upstream reply ignored (%d since the last report): %s", n, reason)

    def _failed(self, up: Upstream, reason: str) -> None:
        up.fails += 1
        log.debug("upstream %s failed (%d in a row): %s", up.address, up.fails, reason)
        if self.max_fails and up.fails >= self.max_fails and not up.looped:
            if up._probe is None or up._probe.done():
                log.warning("upstream %s unhealthy: %s", up.address, reason)
                up._probe = asyncio.get_running_loop().create_task(self._health(up))
            if all(not self.healthy(u) for u in self.upstreams):
                metrics.healthcheck_broken.inc()

    async def _health(self, up: Upstream) -> None:
        """Probe `. IN NS` (or health_domain; RD as health_rd) until the upstream answers, over
        its own transport: TLS for a TLS upstream, TCP with force_tcp, else UDP."""
        probe = dnslib.DNSRecord.question(self.health_domain, "NS")
        probe.header.rd = 1 if self.health_rd else 0
        while up.fails >= self.max_fails and not up.looped:
            await asyncio.sleep(self.health_interval)
            probe.header.id = random.getrandbits(16)
            try:
                await self._exchange(up, bytes(probe.pack()), self.force_tcp, self.read_timeout, pooled=False)
            except UpstreamError:
                metrics.healthcheck_failures.labels("forward", up.address).inc()
                continue
            log.info("upstream %s healthy again", up.address)
            up.fails = 0

    # -- loop detection --------------------------------------------------

    async def detect_loops(self, timeout: float = 2.0) -> list[Upstream]:
        """Send a random HINFO name through each upstream; returns those that loop."""
        found = []
        for up in list(self.upstreams):
            name = f"{random.getrandbits(63)}.{random.getrandbits(63)}."
            self.loop_probes[name] = up
            try:
                probe = dnslib.DNSRecord.question(name, "HINFO")
                try:
                    await exchange(up, bytes(probe.pack()), False, timeout)
                except UpstreamError:
                    pass   # a down upstream is the health check's business, not a loop
                if up.looped:
                    found.append(up)
            finally:
                self.loop_probes.pop(name, None)
                self._probe_seen.pop(name, None)
        return found

    def _loop_found(self, qname: str) -> None:
        up = self.loop_probes.get(qname)
        if up is None or up.looped:
            return
        up.looped = True
        metrics.forward_loops.labels(up.address).inc()
        log.error("forwarding loop detected: queries sent to upstream %s come back to this server "
                  "(probe %s HINFO); disabling that upstream", up.address, qname)

    async def close(self) -> None:
        for up in self.upstreams:
            if up._probe is not None:
                up._probe.cancel()
            while up._idle:
                up._idle.pop()[1].close()
