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

import logging
import random
import socket
import struct
from typing import Callable, Protocol

import dnslib
from dnslib import RR, DNSError, DNSHeader, DNSQuestion, DNSRecord

from ..config import Config
from ..state import ClusterState
from . import names, resolvconf, xfr
from .cache import _with_ttl as records_with_ttl
from .cache import cache_key
from .names import Labels
from .wire import (
    AA,
    AAAA,
    AXFR,
    BADVERS,
    EMPTY,
    FORMERR,
    IXFR,
    MAX_TCP,
    NOERROR,
    NOTIMP,
    NXDOMAIN,
    OPT_TYPE,
    QR,
    REFUSED,
    SERVFAIL,
    TC,
    A,
    Body,
    Entry,
    opt_record,
    pack_body,
    qname_labels,
    question_end,
    render,
    rotations,
    ttl_offsets,
    udp_limit,
    with_ttl,
)
from .zone import Answer, ZoneView
from .zone import label as zone_label

log = logging.getLogger(__name__)

MEMO_LIMIT = 100_000          # prebuilt answers kept per state version (then emptied)
_FLAGS_MASK_UPSTREAM = 0x87FF  # QR..RCODE of an upstream reply, opcode cleared


class Forwarder(Protocol):
    async def query(self, request: dnslib.DNSRecord, tcp: bool) -> dnslib.DNSRecord | None:
        """Ask the upstreams; None when every upstream failed. The reply's id/question are the request's."""
        ...


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
    packed against the lower-cased question, where its TTLs are, and the last TTL variant made."""
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
        self.forwarder = None if cfg.no_upstream else forwarder
        self.server_addresses = server_addresses
        self.selector = names.parse_selector(cfg.namespace_labels) if cfg.namespace_labels else None
        self.udp_size = cfg.udp_size
        self._opt = opt_record(cfg.udp_size, False)
        self._opt_do = opt_record(cfg.udp_size, True)
        self._fall = None if cfg.fallthrough is None else [names.split_name(z) for z in cfg.fallthrough]
        self._search: tuple[str, ...] = ()
        if cfg.autopath:
            try:
                self._search = tuple(s for s in resolvconf.read(cfg.resolv_conf).search
                                     if s.strip(".").lower() != cfg.cluster_domain)
            except OSError:
                pass
        self._view = ZoneView(cfg, None, None, self.selector, server_addresses)
        # forwarded answers the forwarder's cache holds, by lower-cased qname wire + qtype + DO/CD
        self._fcache = getattr(self.forwarder, "cache", None)
        self._probes = getattr(self.forwarder, "_probes", None) or {}
        self._fwd: dict[bytes, _Forwarded] = {}
        # the SOA authority under svc.<zone> of the current view, by (zone, offset of the zone)
        self._nx_view: ZoneView | None = None
        self._nx_entries: dict[tuple, Body] = {}

    # --- state -------------------------------------------------------------------------

    def update(self, state: ClusterState) -> None:
        """Compile the zone view of `state` and swap it in (one assignment)."""
        self._view = ZoneView(self.cfg, state, self._view, self.selector, self.server_addresses)

    @property
    def synced(self) -> bool:
        return self._view.synced

    @property
    def view(self) -> ZoneView:
        return self._view

    # --- fast path -----------------------------------------------------------------------

    def fast(self, data: bytes, tcp: bool) -> bytes | None:
        """A prebuilt answer for an ordinary query, or None (then call resolve())."""
        n = len(data)
        if n < 17 or data[2] & 0xF8:          # QR set or opcode != QUERY
            return None
        counts = data[4:12]
        end = data.find(b"\x00", 12)
        if end < 0:
            return None
        qend = end + 5
        if counts == b"\x00\x01\x00\x00\x00\x00\x00\x00":
            if qend != n:
                return None
            opt, limit = b"", (MAX_TCP if tcp else 512)
        elif counts == b"\x00\x01\x00\x00\x00\x00\x00\x01":
            # exactly one OPT: root owner, version 0 (extended rcode 0). Its options (a COOKIE from
            # dig and many resolvers) are ignored as RFC 6891 says for options one does not
            # implement: we implement none, so they are only checked to be well-formed.
            if n < qend + 11 or data[qend + 2] != 41 or data[qend] or data[qend + 1] or data[qend + 5] \
                    or data[qend + 6]:
                return None
            if n != qend + 11:
                pos = qend + 11
                if n != pos + (data[qend + 9] << 8 | data[qend + 10]):
                    return None
                while pos < n:      # option TLVs must fill the OPT's data exactly
                    if pos + 4 > n:
                        return None
                    pos += 4 + (data[pos + 2] << 8 | data[pos + 3])
                if pos != n:
                    return None
            elif data[qend + 9] or data[qend + 10]:
                return None
            opt = self._opt_do if data[qend + 7] & 0x80 else self._opt
            if tcp:
                limit = MAX_TCP
            else:
                size = data[qend + 3] << 8 | data[qend + 4]
                limit = 512 if size < 512 else (size if size < self.udp_size else self.udp_size)
        else:
            return None
        if data[end + 3] or data[end + 4] != 1:     # class IN only
            return None
        view = self._view
        key = data[12:end + 1].lower() + data[end + 1:end + 3]
        entry = view.memo.get(key)
        if entry is None:
            entry = self._carry(view, key)
            if entry is None:
                if self._fwd:
                    reply = self._fast_forwarded(key + (b"\x02" if opt is self._opt_do else b"\x00"),
                                                 data, qend, opt, limit)
                    if reply is not None:
                        return reply
                entry = self._build(view, data, end, qend, key)
                if entry is None:
                    return None
        bodies = entry.bodies
        body = bodies[data[1] % len(bodies)] if len(bodies) > 1 else bodies[0]
        flags = entry.flags | ((data[2] << 8 | data[3]) & 0x0110)
        if qend + len(body.data) + len(opt) > limit or body.spots:
            return render(body, entry.flags, data, data[12:qend], 1, opt, limit)
        return b"".join((data[:2], struct.pack(">HHHHH", flags, 1, body.an, body.ns, body.ar + (1 if opt else 0)),
                         data[12:qend], body.data, opt))

    def _build(self, view: ZoneView, data: bytes, end: int, qend: int, key: bytes) -> Entry | None:
        """The first time a zone question is asked in this state version: its answer built here,
        without a parse or a task, exactly as resolve() builds it. None when resolve() must decide
        (outside the zones, transfers, not synced, answers that depend on the client or upstream)."""
        if not view.synced or question_end(data) != qend:
            return None
        qtype = data[end + 1] << 8 | data[end + 2]
        if qtype == AXFR or qtype == IXFR:
            return None
        raw = qname_labels(data, qend)
        labels = tuple(l.lower().decode("latin-1") for l in raw)
        zone = names.zone_of(labels, view.zones)
        if zone is None:
            return None
        k = len(labels) - len(zone)
        if k and labels[k - 1] == "svc" and not names.is_reverse(zone) and _svc_nx(view, labels[:k]):
            # the common miss (search-path candidates, unknown services): one template per
            # position of the zone in the question; pointers only aim at the zone's labels
            if self.cfg.autopath or (self._fall is not None and self._falls_through(labels)):
                return None
            entry = Entry(QR | AA | NXDOMAIN, [self._soa_body(view, zone, raw, end)], True, None, view.serial)
        elif k == 3 and (qtype == A or qtype == AAAA) and labels[2] == "svc" and not names.is_reverse(zone) \
                and (entry := self._service_addresses(view, zone, raw, end, qtype)) is not None:
            pass
        else:
            ans = view.lookup(labels, qtype)
            if ans.chase is not None or (ans.rcode == NXDOMAIN and (
                    self.cfg.autopath or (self._fall is not None and self._falls_through(labels)))):
                return None
            entry = self._entry_for(raw, ans)
            if not entry.cacheable:
                return entry
        memo = view.memo
        if len(memo) >= MEMO_LIMIT:
            memo.clear()
        memo[key] = entry
        return entry

    def _soa_body(self, view: ZoneView, zone: Labels, raw: tuple[bytes, ...], end: int) -> Body:
        """The zone's SOA as the authority of a name under svc.<zone>: its names compress only
        onto the zone's labels in the question, so the bytes depend on where the zone starts."""
        if self._nx_view is not view:
            self._nx_view, self._nx_entries = view, {}
        at = (zone, end - sum(len(l) + 1 for l in zone))
        body = self._nx_entries.get(at)
        if body is None:
            body = self._nx_entries[at] = pack_body(tuple(l.lower() for l in raw), (), [view.soa(zone)])
        return body

    def _service_addresses(self, view: ZoneView, zone: Labels, raw: tuple[bytes, ...], end: int,
                           qtype: int) -> Entry | None:
        """<svc>.<ns>.svc A/AAAA of a ClusterIP or headless Service, packed directly (what
        lookup() + packing give: records owned by the question, so a pointer to it, then fixed
        fields; NODATA with the SOA); None for anything else."""
        sd = view.service(raw[1].lower().decode("latin-1"), raw[0].lower().decode("latin-1"))
        if sd is None or sd.kind == "external":
            return None
        v6 = qtype == AAAA
        if sd.kind == "cluster":
            ips = [ip for ip in sd.svc.cluster_ips if (":" in ip) == v6]
        else:
            ips = sd.ready_ips(v6)
        dep = (sd.svc.key, sd)
        if not ips:
            return Entry(QR | AA, [self._soa_body(view, zone, raw, end)], True, dep, view.serial)
        fam, size = (socket.AF_INET6, 16) if v6 else (socket.AF_INET, 4)
        head = b"\xc0\x0c" + struct.pack(">HHIH", qtype, 1, view.ttl, size)
        chunks = [head + socket.inet_pton(fam, ip) for ip in ips]
        step = len(head) + size
        body = Body(b"".join(chunks), tuple(step * (i + 1) for i in range(len(chunks))), len(chunks), 0, 0)
        return Entry(QR | AA, _rotated(body) if len(chunks) > 1 else [body], True, dep, None)

    def _fast_forwarded(self, key: bytes, data: bytes, qend: int, opt: bytes, limit: int) -> bytes | None:
        """A forwarded answer still fresh in the cache: counted as a cache hit, TTLs counted down."""
        if data[3] & 0x10:                   # CD: a key of its own
            key = key[:-1] + bytes((key[-1] | 1,))
        f = self._fwd.get(key)
        if f is None or self._probes:
            return None
        left = self._fcache.fresh_hit(f.ckey, f.centry)
        if left < 0:                         # expired or replaced: resolve() asks the cache again
            del self._fwd[key]
            return None
        body = f.at(int(left))
        if qend + len(body.data) + len(opt) > limit:
            return render(body, f.flags, data, data[12:qend], 1, opt, limit)
        flags = f.flags | ((data[2] << 8 | data[3]) & 0x0110)
        return b"".join((data[:2], struct.pack(">HHHHH", flags, 1, body.an, body.ns, body.ar + (1 if opt else 0)),
                         data[12:qend], body.data, opt))

    def _remember_forwarded(self, q: _Query) -> None:
        """Keep the wire form of the answer the cache now holds for q (fresh only)."""
        ckey = cache_key(q.record)
        centry = self._fcache.peek(ckey)
        if centry is None or centry.duration - (self._fcache.clock() - centry.stored) <= 0:
            return
        rec = centry.record
        ar = [rr for rr in rec.ar if rr.rtype != OPT_TYPE]
        lower = tuple(l.lower() for l in q.raw_labels)
        body = pack_body(lower, records_with_ttl(rec.rr, 0), records_with_ttl(rec.auth, 0),
                         records_with_ttl(ar, 0))
        flags = (rec.header.bitmap & _FLAGS_MASK_UPSTREAM) | QR
        key = q.data[12:q.qend - 4].lower() + q.data[q.qend - 4:q.qend - 2] + bytes(
            ((2 if q.do else 0) | (1 if q.data[3] & 0x10 else 0),))
        fwd = self._fwd
        if len(fwd) >= max(1024, 2 * len(self._fcache)):
            fwd.clear()
        fwd[key] = _Forwarded(ckey, centry, flags, body)

    # --- full path -----------------------------------------------------------------------

    async def resolve(self, data: bytes, client_ip: str, tcp: bool) -> bytes | list[bytes] | None:
        """Answer any query; a list of messages only for zone transfers; None to drop it."""
        try:
            return await self._resolve(data, client_ip, tcp)
        except Exception:  # never raise into the server: answer SERVFAIL
            log.exception("failed to answer a query")
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
        entry = view.memo.get(key) or self._carry(view, key)
        if entry is not None:
            return self._render_entry(q, entry)
        zone = names.zone_of(q.labels, view.zones)
        if zone is None:
            return await self._forward(q, remember=True)
        ans = view.lookup(q.labels, qtype)
        if ans.rcode == NXDOMAIN:
            if self._fall is not None and self._falls_through(q.labels):
                if self.forwarder is not None:
                    return await self._forward(q)
            if self.cfg.autopath:
                reply = await self._autopath(q, view)
                if reply is not None:
                    return reply
        if ans.chase is not None:
            return await self._chase_upstream(q, ans)
        entry = self._entry(q, ans)
        if entry.cacheable and view.synced and (ans.rcode != NXDOMAIN or self._nx_memoisable(q.labels, view)):
            memo = view.memo
            if len(memo) >= MEMO_LIMIT:
                memo.clear()
            memo[key] = entry
        return self._render_entry(q, entry)

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
            if len(view.memo) >= MEMO_LIMIT:
                view.memo.clear()
            view.memo[key] = entry
            return entry
        return None

    def _entry(self, q: _Query, ans: Answer) -> Entry:
        return self._entry_for(q.raw_labels, ans)

    def _entry_for(self, raw_labels: tuple[bytes, ...], ans: Answer) -> Entry:
        lower = tuple(l.lower() for l in raw_labels)
        flags = QR | AA | ans.rcode
        answer = ans.answer
        zl = len(ans.zone)
        if not zl or tuple(l.decode("latin-1") for l in lower[len(lower) - zl:]) != ans.zone:
            zl = None
        first = pack_body(lower, answer, ans.authority, ans.additional, zone_len=zl)
        bodies = [first]
        if len(answer) > 1:
            bodies = _rotated(first) if not ans.authority and not ans.additional else None
            if bodies is None:
                bodies = [pack_body(lower, v, ans.authority, ans.additional, zone_len=zl) for v in rotations(answer)]
        negative = not ans.answer and len(ans.authority) == 1 and not ans.additional
        return Entry(flags, bodies, ans.cacheable, ans.dep, self._view_serial(ans) if negative else None)

    def _nx_memoisable(self, labels: Labels, view: ZoneView) -> bool:
        """An NXDOMAIN that is the same for every client: no fallthrough, no autopath may apply."""
        if self._fall is not None and self._falls_through(labels):
            return False
        if self.cfg.autopath:
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
        if remember and self._fcache is not None and not self._probes:
            self._remember_forwarded(q)
        return self._upstream_reply(q, reply)

    def _upstream_reply(self, q: _Query, reply: DNSRecord, prefix: list | None = None) -> bytes:
        flags = (reply.header.bitmap & _FLAGS_MASK_UPSTREAM) | QR
        extra = [rr for rr in reply.ar if rr.rtype != OPT_TYPE]
        answer = (prefix or []) + list(reply.rr)
        body = pack_body(q.raw_labels, answer, reply.auth, extra)
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
        zone = names.split_name(self.cfg.cluster_domain)
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
            ans = view.lookup(cand, q.qtype)
            if ans.rcode == NXDOMAIN:
                continue
            if ans.rcode != NOERROR:
                return None
            if ans.chase is not None:
                continue   # an ExternalName leading outside: let the client walk on
            if ans.answer:
                cname = RR(label_of(q.raw_labels), 5, ttl=ans.answer[0].ttl, rdata=dnslib.CNAME(zone_label(cand)))
                ans.answer = [cname] + ans.answer
            entry = self._entry(q, ans)
            return self._render_entry(q, entry)
        return None

    # --- zone transfer -------------------------------------------------------------------

    async def _transfer(self, q: _Query, view: ZoneView) -> bytes | list[bytes]:
        """AXFR/IXFR of a served forward zone: over TCP with --transfer only."""
        if not self.cfg.transfer or not q.tcp:
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
        return [render(body, QR | AA, q.data, q.question, 1, self._opt_for(q), MAX_TCP)
                for body in xfr.transfer_bodies(view, zone, q.raw_labels)]


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
        out.append(Body(b"".join(chunks[k:] + chunks[:k]), body.ends, n, 0, 0))
    return out


def _svc_nx(view: ZoneView, rest: Labels) -> bool:
    """Does the name `rest` + zone (rest ending in "svc") surely not exist? (ZoneView.lookup's rules)"""
    p = names.parse(rest)
    kind = p.kind
    if kind == "nx":
        return True
    if kind in ("service", "endpoint", "port"):
        sd = view.service(p.namespace, p.service)
        if sd is None:
            return True
        if kind == "endpoint":
            return sd.kind == "external" or not sd.by_name().get(p.endpoint)
        return False
    if kind == "namespace":
        return not view.exposed(p.namespace)
    return False


def label_of(raw: tuple[bytes, ...]) -> dnslib.DNSLabel:
    return dnslib.DNSLabel(tuple(raw))


def _serial_newer(ours: int, theirs: int) -> bool:
    """RFC 1982 serial arithmetic: is `ours` ahead of `theirs`?"""
    return ours != theirs and ((ours - theirs) & 0xFFFFFFFF) < 0x80000000


__all__ = ["Engine", "Forwarder"]
