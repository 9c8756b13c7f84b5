"""The DNS answer engine: bytes in, bytes out, no sockets.

`Engine.fast()` answers ordinary queries for names already answered once in
this state version from prebuilt wire replies (one dict lookup, an ID / question
/ EDNS splice); `Engine.resolve()` gives the full behaviour for everything
(zones, forwarding, fallthrough, ExternalName chasing, autopath, transfers,
errors) and memoises what it built so that the next identical question takes
the fast path. Both render through wire.render, so they answer byte for byte
the same.
"""
from __future__ import annotations

import asyncio
import logging
import random
import struct
from typing import Callable, Protocol, Sequence

import dnslib
from dnslib import RR, DNSError, DNSHeader, DNSQuestion, DNSRecord

from ..config import Config
from ..lograte import LogLimit
from ..state import ClusterState
from . import metrics, names, resolvconf, xfr
from .cache import cache_key
from .names import Labels
from .wire import (
    AA,
    AXFR,
    BADVERS,
    CD,
    EMPTY,
    FORMERR,
    IXFR,
    MAX_TCP,
    NOERROR,
    NOTIMP,
    NXDOMAIN,
    OPT_TYPE,
    QR,
    QUERY_FLAGS,
    REFUSED,
    SERVFAIL,
    TC,
    Body,
    Entry,
    opt_record,
    pack_body,
    qname_labels,
    question_end,
    question_labels,
    read_query,
    render,
    rotations,
    ttl_offsets,
    udp_limit,
    with_ttl,
)
from .zone import Answer, BigAnswer, Lru, ZoneView
from .zone import chain as chain_records
from .zone import label as zone_label

log = logging.getLogger(__name__)

PANIC_LOG_INTERVAL = 1.0     # seconds between logged tracebacks of our own failures
_FLAGS_MASK_UPSTREAM = 0x87FF  # QR..RCODE of an upstream reply, opcode cleared


class Forwarder(Protocol):
    async def query(self, request: dnslib.DNSRecord, tcp: bool) -> dnslib.DNSRecord | None:
        """Ask the upstreams; None when every upstream failed. The reply's id/question are the request's."""
        ...


def _upstream_body(labels: Sequence[bytes], reply: DNSRecord, prefix: list | None = None) -> tuple[int, Body]:
    """Our header flags and the packed records of an upstream's reply (its OPT is not ours to
    pass on) after the question `labels`; `prefix`: records put before its answer."""
    flags = (reply.header.bitmap & _FLAGS_MASK_UPSTREAM) | QR
    extra = [rr for rr in reply.ar if rr.rtype != OPT_TYPE]
    answer = (prefix or []) + list(reply.rr)
    return flags, pack_body(labels, answer, reply.auth, extra)


def _same_answer(a: DNSRecord, b: DNSRecord) -> bool:
    """The same header flags and records (dnslib compares records without their TTLs)."""
    return a.header.bitmap == b.header.bitmap and a.rr == b.rr and a.auth == b.auth and a.ar == b.ar


def _forwarded_key(data: bytes, qend: int, do: bool) -> bytes:
    """The key of a forwarded answer kept for the fast path: the question's name (lower case)
    and type, then the DO and CD bits (each pair its own answer, as in the forwarder's cache)."""
    return data[12:qend - 4].lower() + data[qend - 4:qend - 2] + _do_cd(data, do)


def _do_cd(data: bytes, do: bool) -> bytes:
    return _DO_CD[(2 if do else 0) | (1 if data[3] & CD else 0)]   # CD is in the low flags byte


_DO_CD = (b"\x00", b"\x01", b"\x02", b"\x03")


class _Query:
    """What resolve() learnt from a query's bytes."""
    __slots__ = ("data", "qend", "labels", "raw_labels", "qtype", "edns", "do", "tcp", "client_ip", "record")

    def __init__(self, data: bytes, tcp: bool, client_ip: str) -> None:
        self.data, self.tcp, self.client_ip = data, tcp, client_ip
        self.qend = -1
        self.labels: Labels = ()
        self.raw_labels: tuple[bytes, ...] = ()
        self.qtype = 0
        self.edns: int | None = None   # the client's UDP payload size, None without EDNS
        self.do = False
        self.record: DNSRecord | None = None

    @property
    def question(self) -> bytes:
        return self.data[12:self.qend] if self.qend > 0 else b""


class _Forwarded:
    """A forwarded answer held in the forwarder's cache, as wire bytes for the fast path: the body
    as packed for the query that brought it, where its TTLs are, and the last TTL variant made."""
    __slots__ = ("ckey", "centry", "flags", "body", "offsets", "ttl", "at_ttl")

    def __init__(self, ckey, centry, flags: int, body: Body) -> None:
        self.ckey, self.centry, self.flags, self.body = ckey, centry, flags, body
        self.offsets = ttl_offsets(body)
        self.ttl, self.at_ttl = -1, body

    def at(self, ttl: int) -> Body:
        if ttl != self.ttl:
            self.at_ttl, self.ttl = with_ttl(self.body, self.offsets, ttl), ttl
        return self.at_ttl


class Engine:
    """Answers DNS queries from the current zone view."""

    def __init__(self, cfg: Config, forwarder: Forwarder | None = None,
                 server_addresses: Callable[[], list[str]] = lambda: []) -> None:
        self.cfg = cfg
        self.forwarder = None if cfg.dns.no_upstream else forwarder
        self.server_addresses = server_addresses
        self.selector = names.parse_selector(cfg.dns.namespace_labels) if cfg.dns.namespace_labels else None
        self.udp_size = cfg.dns.udp_size
        self._opt = opt_record(cfg.dns.udp_size, False)
        self._opt_do = opt_record(cfg.dns.udp_size, True)
        self._fall = None if cfg.dns.fallthrough is None else [names.split_name(z) for z in cfg.dns.fallthrough]
        self._search: tuple[str, ...] = ()
        if cfg.dns.autopath:
            try:
                self._search = tuple(s for s in resolvconf.read(cfg.dns.resolv_conf).search
                                     if s.strip(".").lower() != cfg.dns.cluster_domain)
            except OSError:
                pass
        self._view = ZoneView(cfg, None, None, self.selector, server_addresses)
        # forwarded answers the forwarder's cache holds, by lower-cased qname wire + qtype + DO/CD
        self._fcache = getattr(self.forwarder, "cache", None)
        self._probes = getattr(self.forwarder, "loop_probes", None) or {}
        # bounded like the cache it mirrors (least recently used go)
        self._fwd = Lru(max(1024, cfg.dns.cache_size))
        # the SOA authority under svc.<zone> of the current view, by (zone, offset of the zone)
        self._nx_view: ZoneView | None = None
        self._nx_entries: dict[tuple, Body] = {}
        self._building: dict[tuple, asyncio.Future] = {}    # big answers being built, by (view, key)
        self._panic_log = LogLimit(PANIC_LOG_INTERVAL)

    # --- state -------------------------------------------------------------------------

    def update(self, state: ClusterState, changed=None, since: ClusterState | None = None) -> None:
        """Compile the zone view of `state` and swap it in (one assignment). changed: the
        Service keys that differ from `since`, the state the current view was made of
        (a store's delta); only those are rebuilt then."""
        prev = self._view
        if since is None or prev.state is not since:
            changed = None
        self._view = ZoneView(self.cfg, state, prev, self.selector, self.server_addresses, changed)

    @property
    def synced(self) -> bool:
        return self._view.synced

    @property
    def view(self) -> ZoneView:
        return self._view

    # --- fast path -----------------------------------------------------------------------

    def fast(self, data: bytes, tcp: bool) -> bytes | None:
        """A prebuilt answer for an ordinary query, or None (then call resolve()).

        A question not answered yet in this state version is answered here too when its
        answer is the same for every client: the one lookup, packed, remembered. A UDP
        query whose bytes after the ID were answered from the memo before in this state
        version gets that reply again with its own ID (view.replies: one lookup)."""
        view = self._view
        if not tcp:
            tail = view.replies.get(data[2:])
            if tail is not None:
                return data[:2] + tail
        r = read_query(data, tcp, self.udp_size)
        if r is None:
            return None
        end, qend, edns, limit = r
        opt = b"" if edns < 0 else (self._opt_do if edns else self._opt)
        key = data[12:end + 1].lower() + data[end + 1:end + 3]
        memo = view.memo
        entry = memo.get(key)
        hot = entry is not None
        if hot:
            memo.move_to_end(key)
        else:
            entry = self._memo_miss(view, key)
            if entry is None:
                if self._fwd:
                    # the memo key is the question's name and type in lower case: the forwarded key's start
                    reply = self._fast_forwarded(key + _do_cd(data, edns > 0), data, qend, opt, limit)
                    if reply is not None:
                        return reply
                entry = self._first(view, data, end, qend, key)
                if entry is None:
                    return None
        bodies = entry.bodies
        body = bodies[data[1] % len(bodies)] if len(bodies) > 1 else bodies[0]
        spots = body.spots
        if spots:   # SRV targets take the zone as the question spells it; most ask in lower case
            zone = data[qend - 5 - body.zlen:qend - 5]
            spots = zone != zone.lower()
        if spots or qend + len(body.data) + len(opt) > limit:
            reply = render(body, entry.flags, data, data[12:qend], 1, opt, limit)
        else:
            reply = b"".join((data[:2], struct.pack(">HHHHH", entry.flags | ((data[2] << 8 | data[3]) & QUERY_FLAGS),
                                                    1, body.an, body.ns, body.ar + (1 if opt else 0)),
                              data[12:qend], body.data, opt))
        if hot and not tcp and len(bodies) == 1:
            # asked again: the whole reply but its ID is a function of the query's other bytes
            # (rotated answers depend on the ID, so they are not kept)
            view.remember_reply(data[2:], reply[2:])
        return reply

    def _memo_miss(self, view: ZoneView, key: bytes) -> Entry | None:
        """An answer asked once before (moved up to the memo now) or carried over from an
        earlier state version; None when it must be built."""
        entry = view.probation.pop(key, None)
        if entry is not None:
            view.memo[key] = entry
            return entry
        return self._carry(view, key) if view.carried else None

    def _first(self, view: ZoneView, data: bytes, end: int, qend: int, key: bytes) -> Entry | None:
        """The first time a zone question is asked in this state version: ZoneView.lookup
        decides, the answer is packed and remembered. None when resolve() must answer
        (outside the zones, transfers, big Services, answers that depend on the client or
        the upstream; before the state is synced, any answer but NOERROR: a name found is
        right then too, as a restarted agent finds the Services the kernel routes)."""
        qtype = data[end + 1] << 8 | data[end + 2]
        if qtype == AXFR or qtype == IXFR:
            return None
        raw = question_labels(data, end)
        if raw is None:
            return None
        lower = tuple(l.lower() for l in raw)
        labels = tuple(l.decode("latin-1") for l in lower)
        if names.zone_of(labels, view.zones) is None:
            return None
        try:
            ans = view.lookup(labels, qtype, big_ok=False)
        except BigAnswer:
            return None
        if ans.chase is not None or (ans.rcode == NXDOMAIN and not self._nx_memoisable(labels, view)):
            return None
        if ans.rcode != NOERROR and not view.synced:
            return None
        entry = self._entry_for(raw, ans, end, view, lower, labels)
        self._remember(view, key, entry)
        return entry

    @staticmethod
    def _remember(view: ZoneView, key: bytes, entry: Entry) -> None:
        if entry.cacheable and view.synced:
            view.probation[key] = entry

    def _soa_body(self, view: ZoneView, zone: Labels, raw: tuple[bytes, ...], end: int) -> Body:
        """The zone's SOA as the authority of a negative answer: its names compress only onto
        the zone's labels in the question, so the bytes depend on where the zone starts."""
        if self._nx_view is not view:
            self._nx_view, self._nx_entries = view, {}
        at = (zone, end)
        body = self._nx_entries.get(at)
        if body is None:
            body = self._nx_entries[at] = pack_body(tuple(l.lower() for l in raw), (), [view.soa(zone)],
                                                    zone_len=len(zone))
        return body

    def _fast_forwarded(self, key: bytes, data: bytes, qend: int, opt: bytes, limit: int) -> bytes | None:
        """A forwarded answer still fresh in the cache: counted as a cache hit, TTLs counted down."""
        f = self._fwd.hit(key)
        if f is None or self._probes:
            return None
        left = self._fcache.fresh_hit(f.ckey, f.centry)
        if left < 0:                         # expired or replaced: resolve() asks the cache again
            del self._fwd[key]
            return None
        body = f.at(int(left))
        if qend + len(body.data) + len(opt) > limit:
            return render(body, f.flags, data, data[12:qend], 1, opt, limit)
        flags = f.flags | ((data[2] << 8 | data[3]) & QUERY_FLAGS)
        return b"".join((data[:2], struct.pack(">HHHHH", flags, 1, body.an, body.ns, body.ar + (1 if opt else 0)),
                         data[12:qend], body.data, opt))

    def _remember_forwarded(self, q: _Query, reply: DNSRecord, flags: int, body: Body) -> None:
        """Keep the wire form of the answer the cache now holds for q (fresh only): `body`, packed
        for `reply`, when the cache holds that answer (the usual case: it was stored or hit just
        now), else the cache's own (a concurrent query's, when `reply` was not cacheable)."""
        ckey = cache_key(q.record)
        centry = self._fcache.peek(ckey)
        if centry is None or centry.duration - (self._fcache.clock() - centry.stored) <= 0:
            return
        rec = centry.record
        if not _same_answer(rec, reply):
            flags, body = _upstream_body(q.raw_labels, rec)
        self._fwd[_forwarded_key(q.data, q.qend, q.do)] = _Forwarded(ckey, centry, flags, body)

    # --- full path -----------------------------------------------------------------------

    async def resolve(self, data: bytes, client_ip: str, tcp: bool) -> bytes | list[bytes] | None:
        """Answer any query; a list of messages only for zone transfers; None to drop it."""
        try:
            return await self._resolve(data, client_ip, tcp)
        except Exception:  # our bug; never raise into the server: count it, answer SERVFAIL
            metrics.panic()
            n = self._panic_log.due()
            if n:                       # one traceback per interval
                log.exception("failed to answer a query (%d since the last report)", n)
            if len(data) < 12 or data[2] & 0x80:
                return None
            q = _Query(data, tcp, client_ip)
            qe = question_end(data) if data[4:6] == b"\x00\x01" else -1
            q.qend = qe
            return self._error(q, SERVFAIL, qdcount=1 if qe > 0 else 0)

    def _limit(self, q: _Query) -> int:
        return MAX_TCP if q.tcp else udp_limit(q.edns, self.udp_size)

    def _opt_for(self, q: _Query) -> bytes:
        if q.edns is None:
            return b""
        return self._opt_do if q.do else self._opt

    def _error(self, q: _Query, rcode: int, qdcount: int | None = None, aa: bool = False) -> bytes:
        if qdcount is None:
            qdcount = 1 if q.qend > 0 else 0
        flags = QR | (AA if aa else 0) | (q.data[2] << 8 & 0x7800) | rcode
        question = q.question if qdcount else b""
        return render(EMPTY, flags, q.data, question, qdcount, self._opt_for(q), self._limit(q))

    def _render_entry(self, q: _Query, entry: Entry) -> bytes:
        bodies = entry.bodies
        body = bodies[q.data[1] % len(bodies)] if len(bodies) > 1 else bodies[0]
        return render(body, entry.flags, q.data, q.question, 1, self._opt_for(q), self._limit(q))

    async def _resolve(self, data: bytes, client_ip: str, tcp: bool) -> bytes | list[bytes] | None:
        if len(data) < 12 or data[2] & 0x80:    # unreadable header, or a response: drop
            return None
        q = _Query(data, tcp, client_ip)
        qdcount = data[4] << 8 | data[5]
        opcode = (data[2] >> 3) & 0xF
        if qdcount == 1:
            q.qend = question_end(data)
        if opcode != 0:
            return self._error(q, NOTIMP, qdcount=1 if q.qend > 0 else 0)
        try:
            record = DNSRecord.parse(data)
        except (DNSError, Exception):
            q.qend = -1
            return self._error(q, FORMERR, qdcount=0)
        q.record = record
        opts = [rr for rr in record.ar if rr.rtype == OPT_TYPE]
        if len(opts) > 1 or (opts and opts[0].rname.label != ()):
            return self._error(q, FORMERR)
        if opts:
            q.edns = opts[0].rclass
            q.do = bool(opts[0].ttl & 0x8000)
            if (opts[0].ttl >> 16) & 0xFF:
                flags = QR | (data[2] << 8 & 0x7800)
                opt = opt_record(self.udp_size, q.do, BADVERS >> 4)
                return render(EMPTY, flags, data, q.question, 1 if q.qend > 0 else 0, opt, self._limit(q))
        if qdcount == 0:
            return self._error(q, SERVFAIL)
        if qdcount > 1 or q.qend < 0:
            return self._error(q, FORMERR, qdcount=0 if q.qend < 0 else None)
        qtype, qclass = struct.unpack_from(">HH", data, q.qend - 4)
        q.qtype = qtype
        if qclass != 1:
            return self._error(q, REFUSED)
        q.raw_labels = qname_labels(data, q.qend)
        q.labels = tuple(l.lower().decode("latin-1") for l in q.raw_labels)
        view = self._view
        if qtype in (AXFR, IXFR):
            return await self._transfer(q, view)
        key = data[12:q.qend - 4].lower() + data[q.qend - 4:q.qend - 2]
        entry = view.memo.hit(key) or self._memo_miss(view, key)
        if entry is not None:
            return self._render_entry(q, entry)
        zone = names.zone_of(q.labels, view.zones)
        if zone is None:
            return await self._forward(q, remember=True)
        try:
            ans = view.lookup(q.labels, qtype, big_ok=False)
        except BigAnswer:
            return self._render_entry(q, await self._big(view, q, key))
        if ans.rcode == NXDOMAIN:
            if self._fall is not None and self._falls_through(q.labels):
                if self.forwarder is not None:
                    return await self._forward(q)
            if self.cfg.dns.autopath:
                reply = await self._autopath(q, view)
                if reply is not None:
                    return reply
        if ans.chase is not None:
            return await self._chase_upstream(q, ans)
        entry = self._entry_for(q.raw_labels, ans, q.qend - 5, view, None, q.labels)
        if ans.rcode != NXDOMAIN or self._nx_memoisable(q.labels, view):
            self._remember(view, key, entry)
        return self._render_entry(q, entry)

    async def _big(self, view: ZoneView, q: _Query, key: bytes) -> Entry:
        """An answer from a big Service, built in a worker thread (the event loop keeps
        answering: the interpreter switches threads every few ms) and only as far as a reply
        can carry (pack_body's budget). Concurrent askers of one name share the build."""
        building = self._building.get((id(view), key))
        if building is None:
            loop = asyncio.get_running_loop()
            building = loop.run_in_executor(None, self._big_entry, view, q.labels, q.raw_labels, q.qtype)
            self._building[(id(view), key)] = building
            try:
                entry = await building
            finally:
                self._building.pop((id(view), key), None)
            if entry.cacheable and view.synced:
                view.memo[key] = entry      # straight to the memo: it cost a build
            return entry
        return await asyncio.shield(building)

    def _big_entry(self, view: ZoneView, labels: Labels, raw: tuple[bytes, ...], qtype: int) -> Entry:
        return self._entry_for(raw, view.lookup(labels, qtype), None, view)

    @staticmethod
    def _view_serial(ans: Answer) -> int:
        return ans.authority[0].rdata.times[0]

    @staticmethod
    def _carry(view: ZoneView, key: bytes) -> Entry | None:
        """A prebuilt answer of an earlier state version that is still true: it came from one
        Service whose data is unchanged (and still served). Taken into this version's table."""
        for memo in view.carried:
            entry = memo.get(key)
            if entry is None:
                continue
            if entry.dep is None:
                return None
            skey, sd = entry.dep
            if view.services.get(skey) is not sd or not view.exposed(skey[0]) or not view.synced:
                return None
            if entry.serial is not None and entry.serial != view.serial:
                entry = entry.with_serial(view.serial)
            view.memo[key] = entry
            return entry
        return None

    def _entry(self, q: _Query, ans: Answer) -> Entry:
        return self._entry_for(q.raw_labels, ans, None, self._view)

    def _entry_for(self, raw_labels: tuple[bytes, ...], ans: Answer, end: int | None = None,
                   view: ZoneView | None = None, lower: tuple[bytes, ...] | None = None,
                   labels: Labels | None = None) -> Entry:
        """Pack a zone answer for the question `raw_labels` (its name ends at offset `end`
        of the message: negative answers then take the zone's SOA template). `lower` and
        `labels`: the question lower-cased, as bytes and as str, when the caller has them."""
        view = view or self._view
        if lower is None:
            lower = tuple(l.lower() for l in raw_labels)
        if labels is None:
            labels = tuple(l.decode("latin-1") for l in lower)
        flags = QR | AA | ans.rcode
        answer = ans.answer
        zone = ans.zone
        zl: int | None = len(zone)
        if not zl or labels[len(labels) - len(zone):] != zone:
            zl = None
        negative = not answer and len(ans.authority) == 1 and not ans.additional
        if negative:
            serial = self._view_serial(ans)
            if end is not None and zl is not None and view is self._view and ans.authority[0] is view.soa(zone) \
                    and not _names_in_soa(lower, zl):
                return Entry(flags, [self._soa_body(view, zone, lower, end)], ans.cacheable, ans.dep, serial)
            return Entry(flags, [pack_body(lower, (), ans.authority, (), zone_len=zl)], ans.cacheable, ans.dep,
                         serial)
        first = pack_body(lower, answer, ans.authority, ans.additional, zone_len=zl)
        bodies = [first]
        if first.an > 1:
            bodies = _rotated(first) if not ans.authority and not ans.additional else None
            if bodies is None:
                bodies = [first]
                variants = rotations(answer) if isinstance(answer, list) else []
                if len(variants) > 1:      # the first variant is the answer as packed already
                    bodies += [pack_body(lower, v, ans.authority, ans.additional, zone_len=zl)
                               for v in variants[1:]]
        return Entry(flags, bodies, ans.cacheable, ans.dep, None)

    def _nx_memoisable(self, labels: Labels, view: ZoneView) -> bool:
        """An NXDOMAIN that is the same for every client: no fallthrough, no autopath may apply."""
        if self._fall is not None and self._falls_through(labels):
            return False
        if self.cfg.dns.autopath:
            zone = view.primary
            k = len(labels) - len(zone)
            if k >= 3 and labels[k - 1] == "svc" and labels[k:] == zone:
                return False
        return True

    def _falls_through(self, labels: Labels) -> bool:
        if not self._fall:
            return True
        return any(names.is_subdomain(labels, z) for z in self._fall)

    # --- upstream ------------------------------------------------------------------------

    async def _forward(self, q: _Query, remember: bool = False) -> bytes:
        """A name outside the zones (or falling through): the upstream's answer, our ID and question.

        `remember`: the name is outside every zone (no state can change its answer), so the
        cached answer may be kept as wire bytes for the fast path."""
        if self.forwarder is None:
            return self._error(q, REFUSED)
        request = q.record
        reply = await self.forwarder.query(request, q.tcp)
        if reply is None:
            return self._error(q, SERVFAIL)
        try:
            flags, body = _upstream_body(q.raw_labels, reply)      # packed once: the reply and the memo
            if remember and self._fcache is not None and not self._probes:
                self._remember_forwarded(q, reply, flags, body)
            return render(body, flags, q.data, q.question, 1, self._opt_for(q), self._limit(q))
        except Exception:
            # a failure of ours must not outlive this query: forget what the cache holds for it
            if self._fcache is not None and q.record is not None:
                self._fcache.discard(cache_key(q.record))
            self._fwd.pop(_forwarded_key(q.data, q.qend, q.do), None)
            raise

    def _upstream_reply(self, q: _Query, reply: DNSRecord, prefix: list | None = None) -> bytes:
        flags, body = _upstream_body(q.raw_labels, reply, prefix)
        return render(body, flags, q.data, q.question, 1, self._opt_for(q), self._limit(q))

    async def _chase_upstream(self, q: _Query, ans: Answer) -> bytes:
        """ExternalName with an out-of-zone target: CNAME(s) + the upstream's records, TC passed on."""
        if self.forwarder is None:
            return self._render_entry(q, self._entry(q, ans))
        target = ".".join(ans.chase) + "."
        request = DNSRecord(DNSHeader(id=random.randint(0, 0xFFFF), rd=1),
                            q=DNSQuestion(target, q.qtype))
        reply = await self.forwarder.query(request, q.tcp)
        if reply is None:
            return self._error(q, SERVFAIL, aa=False)
        records = [rr for rr in reply.rr]
        flags = QR | AA | (reply.header.bitmap & TC)
        body = pack_body(tuple(l.lower() for l in q.raw_labels), ans.answer + records, [], [])
        return render(body, flags, q.data, q.question, 1, self._opt_for(q), self._limit(q))

    # --- autopath ----------------------------------------------------------------------

    async def _autopath(self, q: _Query, view: ZoneView) -> bytes | None:
        """Server-side search-path completion for a pod's NXDOMAIN (CoreDNS autopath @kubernetes).

        The asked name must lie under the pod's first search domain <ns>.svc.<zone>; the
        other candidates are tried in the pod's order and the first that exists answers,
        with a CNAME from the asked name when it has records. None: no autopath here.
        """
        pods = view.state.pods_by_ip.get(q.client_ip)
        if not pods:
            return None
        zone = names.split_name(self.cfg.dns.cluster_domain)
        first = (pods[0].namespace, "svc") + zone
        n = len(q.labels) - len(first)
        if n <= 0 or q.labels[n:] != first:
            return None
        base = q.labels[:n]
        candidates = [base + ("svc",) + zone, base + zone]
        candidates += [base + names.split_name(s) for s in self._search]
        candidates.append(base)
        for cand in candidates:
            if names.zone_of(cand, view.zones) is None:
                if self.forwarder is None:
                    continue
                request = DNSRecord(DNSHeader(id=random.randint(0, 0xFFFF), rd=1),
                                    q=DNSQuestion(".".join(cand) + ".", q.qtype))
                reply = await self.forwarder.query(request, q.tcp)
                if reply is None or reply.header.rcode == NXDOMAIN:
                    continue
                if not reply.rr:
                    return self._upstream_reply(q, reply)
                cname = RR(label_of(q.raw_labels), 5, ttl=reply.rr[0].ttl, rdata=dnslib.CNAME(zone_label(cand)))
                return self._upstream_reply(q, reply, prefix=[cname])
            big = False
            try:
                ans = view.lookup(cand, q.qtype, big_ok=False)
            except BigAnswer:     # a big Service: its records made and packed off the loop
                big = True
                ans = await asyncio.get_running_loop().run_in_executor(None, view.lookup, cand, q.qtype)
            if ans.rcode == NXDOMAIN:
                continue
            if ans.rcode != NOERROR:
                return None
            if ans.chase is not None:
                continue   # an ExternalName leading outside: let the client walk on
            if ans.answer:
                first_ttl = ans.answer[0].ttl if isinstance(ans.answer, list) else view.ttl
                cname = RR(label_of(q.raw_labels), 5, ttl=first_ttl, rdata=dnslib.CNAME(zone_label(cand)))
                ans.answer = chain_records([cname], ans.answer)
            if big:
                entry = await asyncio.get_running_loop().run_in_executor(None, self._entry, q, ans)
            else:
                entry = self._entry(q, ans)
            return self._render_entry(q, entry)
        return None

    # --- zone transfer -------------------------------------------------------------------

    async def _transfer(self, q: _Query, view: ZoneView) -> bytes | list[bytes]:
        """AXFR/IXFR of a served forward zone: over TCP with --transfer only."""
        if not self.cfg.dns.transfer or not q.tcp:
            return self._error(q, REFUSED)
        zone = names.zone_of(q.labels, view.zones)
        if zone is None or zone != q.labels or names.is_reverse(zone):
            return self._error(q, REFUSED)
        if not view.synced:
            return self._error(q, SERVFAIL, aa=True)
        if q.qtype == IXFR:
            soas = [rr for rr in q.record.auth if rr.rtype == 6]
            if not soas:
                return self._error(q, SERVFAIL, aa=True)
            if not _serial_newer(view.serial, soas[0].rdata.times[0]):
                body = pack_body(tuple(l.lower() for l in q.raw_labels), [view.soa(zone)])
                return [render(body, QR | AA, q.data, q.question, 1, self._opt_for(q), MAX_TCP)]
        # a whole zone is big: built in a worker thread, so queries keep being answered meanwhile
        bodies = await asyncio.get_running_loop().run_in_executor(None, xfr.transfer_bodies, view, zone,
                                                                   q.raw_labels)
        return [render(body, QR | AA, q.data, q.question, 1, self._opt_for(q), MAX_TCP) for body in bodies]


def _rotated(body: Body) -> list[Body] | None:
    """wire.rotations() of an answer of address records owned by the question name, made by
    reordering the packed records (each is the same bytes wherever it stands: a pointer to the
    question, then fixed fields); None when the answer is not of that shape."""
    data, ends = body.data, body.ends
    chunks, start = [], 0
    for end in ends:
        rec = data[start:end]
        if rec[:2] != b"\xc0\x0c" or rec[2:4] not in (b"\x00\x01", b"\x00\x1c"):
            return None
        chunks.append(rec)
        start = end
    n = len(chunks)
    size = len(chunks[0])
    if any(len(c) != size for c in chunks):
        return None
    v = min(n, 8)
    out = []
    for i in range(v):
        k = i * n // v
        out.append(Body(b"".join(chunks[k:] + chunks[:k]), body.ends, n, 0, 0, cut=body.cut))
    return out


def _names_in_soa(lower: tuple[bytes, ...], zone_len: int) -> bool:
    """Is the question one of the SOA's own names (ns.dns.<zone>, hostmaster.<zone>)? Then the
    SOA compresses onto the whole question and the per-position template does not apply."""
    rest = lower[:len(lower) - zone_len]
    return rest == (b"ns", b"dns") or rest == (b"hostmaster",)


def label_of(raw: tuple[bytes, ...]) -> dnslib.DNSLabel:
    return dnslib.DNSLabel(tuple(raw))


def _serial_newer(ours: int, theirs: int) -> bool:
    """RFC 1982 serial arithmetic: is `ours` ahead of `theirs`?"""
    return ours != theirs and ((ours - theirs) & 0xFFFFFFFF) < 0x80000000


__all__ = ["Engine", "Forwarder"]
