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

Loop detection (CoreDNS's `loop`): at start a random `HINFO` name is sent to
each upstream; when that name comes back into this forwarder more than twice,
queries to us loop through that upstream, which is then disabled for good.
"""
from __future__ import annotations

import asyncio
import logging
import random
import socket
import struct
import time
from dataclasses import dataclass, field

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


@dataclass(eq=False)
class Upstream:
    host: str
    port: int
    fails: int = 0
    looped: bool = False
    _probe: asyncio.Task | None = field(default=None, repr=False)

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

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

    def __init__(self, addresses: list[tuple[str, int]], cache: Cache | None = None, *,
                 read_timeout: float = READ_TIMEOUT, overall_timeout: float = OVERALL_TIMEOUT,
                 max_fails: int = MAX_FAILS, health_interval: float = HEALTH_INTERVAL,
                 max_concurrent: int = MAX_CONCURRENT) -> None:
        self.upstreams = [Upstream(h, p) for h, p in addresses]
        self.cache = cache
        self.read_timeout, self.overall_timeout = read_timeout, overall_timeout
        self.max_fails, self.health_interval = max_fails, health_interval
        self.max_concurrent = max_concurrent
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
        return not up.looped and up.fails < self.max_fails

    def _order(self, qname: str) -> list[Upstream]:
        target = self.loop_probes.get(qname)
        if target is not None:   # a loop probe always goes through the upstream it tests
            return [target]
        live = [u for u in self.upstreams if not u.looped]
        random.shuffle(live)
        return [u for u in live if u.fails < self.max_fails] + [u for u in live if u.fails >= self.max_fails]

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
        if self._inflight >= self.max_concurrent:
            metrics.forward_rejects.inc()
            metrics.answered_by("forward")
            reply = request.reply()
            reply.header.ra, reply.header.rcode = 1, dnslib.RCODE.REFUSED
            return reply
        self._inflight += 1
        try:
            reply, wire = await self._forward(request, tcp, qname)
        finally:
            self._inflight -= 1
        if reply is None:
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

    async def _forward(self, request: dnslib.DNSRecord, tcp: bool, qname: str):
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.overall_timeout
        order = self._order(qname)
        if not order:
            return None, b""
        outgoing = request.pack()
        if self.cache is not None and all(not self.healthy(u) for u in order):
            # Everything is known down: a stale answer now beats a certain timeout.
            if self.cache.get(cache_key(request), request, stale=True) is not None:
                return None, b""
        for up in order:
            left = deadline - loop.time()
            if left <= 0:
                break
            query = dnslib.DNSRecord.parse(outgoing)
            query.header.id = random.getrandbits(16)
            wire = bytes(query.pack())
            started = time.perf_counter()
            metrics.forward_requests.labels(up.address).inc()
            try:
                try_end = loop.time() + min(self.read_timeout, left)   # one bound for this try
                data = await exchange(up, wire, tcp, try_end - loop.time())
                reply = self._check(query, data, up)
                if reply.header.tc and not tcp:
                    # Retry over TCP for the whole answer (cache it whole), within the same try.
                    data = await exchange(up, wire, True, max(0.0, try_end - loop.time()))
                    reply = self._check(query, data, up)
            except UnusableReply as exc:
                self._unusable(str(exc))
                self._failed(up, str(exc))
                continue
            except UpstreamError as exc:
                self._failed(up, str(exc))
                continue
            rcode = metrics.RCODES.get(reply.header.rcode, str(reply.header.rcode))
            metrics.forward_responses.labels(up.address, rcode).inc()
            metrics.proxy_duration.labels("forward", up.address, rcode).observe(time.perf_counter() - started)
            up.fails = 0
            return reply, data
        return None, b""

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
        if up.fails >= self.max_fails and not up.looped:
            if up._probe is None or up._probe.done():
                log.warning("upstream %s unhealthy: %s", up.address, reason)
                up._probe = asyncio.get_running_loop().create_task(self._health(up))
            if all(not self.healthy(u) for u in self.upstreams):
                metrics.healthcheck_broken.inc()

    async def _health(self, up: Upstream) -> None:
        """Probe `. IN NS` until the upstream answers."""
        probe = dnslib.DNSRecord.question(".", "NS")
        while up.fails >= self.max_fails and not up.looped:
            await asyncio.sleep(self.health_interval)
            probe.header.id = random.getrandbits(16)
            try:
                await exchange(up, bytes(probe.pack()), False, self.read_timeout)
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
