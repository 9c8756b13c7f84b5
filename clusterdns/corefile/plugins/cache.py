"""CoreDNS's `cache` plugin for Corefile server blocks.

    cache [TTL] [ZONES...] {
        success CAPACITY [TTL] [MINTTL]
        denial CAPACITY [TTL] [MINTTL]
        prefetch AMOUNT [[DURATION] [PERCENTAGE%]]
        serve_stale [DURATION] [REFRESH_MODE]
        servfail DURATION
        disable success|denial [ZONES...]
        keepttl
    }

As CoreDNS's (plugin/cache, pinned to its README, setup_test.go, cache_test.go,
prefetch_test.go and spoof_test.go):
- Two caches: success (NOERROR with answers, delegations, empty NOERROR) and
  denial (NXDOMAIN and NODATA with a SOA, SERVFAIL/NOTIMP). Capacity 9984 each
  (CoreDNS rounds to 256 shards of at least 4: effective capacity is
  256 * max(4, CAPACITY // 256)); max TTL 3600 s / 1800 s, min TTL 5 s; the TTL
  argument caps both. Eviction is least recently used (CoreDNS: random within
  a shard).
- The key is the lower-cased qname, qtype, DO and CD (CoreDNS's hash). Replies
  whose question does not match the query, or without QR, are not cached
  (coredns_cache_drops_total); neither are truncated replies, REFUSED, FORMERR,
  NXDOMAIN without SOA, transfers, NOTIFY/UPDATE, or (DO) expired RRSIGs.
- How long: the smallest TTL of the reply (3600 at most; 5 s when it has no
  records), clamped to [MINTTL, TTL]; SERVFAIL for `servfail` (default 5 s,
  0 = never, 5 m at most). Every reply passing through carries that TTL, and
  answers from the cache count it down (whole seconds), unless `keepttl`.
  One difference, on purpose: a negative answer's SOA counts as
  min(its TTL, its MINIMUM) (RFC 2308 section 5), where CoreDNS takes the SOA's TTL.
- Cache answers set AA (CoreDNS does, for old glibc stubs), copy RA and the
  rcode, keep AD only for DO or AD queries, and echo the asker's question.
- prefetch: an entry hit AMOUNT times with no gap of DURATION (1m) is fetched
  again in the background once its TTL drops to PERCENTAGE (10%) of the
  original (rounded up); the client gets the cached answer.
- serve_stale [DURATION (1h)] [immediate|verify]: an entry expired less than
  DURATION ago is still answered, with TTL 0; `immediate` answers at once and
  refreshes in the background, `verify` asks next first and answers stale only
  when that fails or is neither NOERROR nor NXDOMAIN. A cached SERVFAIL does not
  shadow a usable positive entry.
- disable success|denial [ZONES]: do not store that kind for names under
  ZONES (all without ZONES). Names outside the plugin's ZONES go to next uncached.

State zones (`ctx.state_zones`, the zones the block answers from the cluster
state): their entries live in stores of their own, retired on every state
change (on_state counts a generation up, O(1); the next lookup starts an empty
pair, and an answer whose query began before the change is not stored), so an
answer for a state-zone name is never served older than the state it came from. This is a deliberate difference:
CoreDNS keeps them up to the TTL cap, which would delay a new Service. The
plugin is transparent for those names (the DNS memo answers the current state,
the cache adds nothing there) and for names outside its ZONES.

Not implemented, refused at setup with FILE:LINE: `serve_stale_policy` and any
third `serve_stale` argument (options of CoreDNS releases after 1.14.7).
"""
from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import cachetools
import dnslib

from ...dns import metrics
from ..plugin import (
    NOERROR,
    NXDOMAIN,
    SERVFAIL,
    Next,
    Plugin,
    PluginError,
    Request,
    SetupContext,
    fqdn,
    match_zone,
    normalize_zones,
)
from ..syntax import Directive, duration, plugin_error

log = logging.getLogger(__name__)

SUCCESS, DENIAL = "success", "denial"
SHARDS, MIN_SHARD = 256, 4
DEFAULT_CAPACITY = 10000            # CoreDNS's defaultCap (9984 once sharded)
MAX_TTL, MAX_NTTL, MIN_TTL = 3600, 1800, 5
FAIL_TTL, MAX_FAIL_TTL = 5.0, 300.0
DEFAULT_STALE = 3600.0
NOTIMP = 4
OPT, SOA, NS, RRSIG = 41, 6, 2, 46
AXFR, IXFR = 252, 251
OPCODE_NOTIFY, OPCODE_UPDATE = 4, 5

# response.Typify's classes
NOERROR_T, NAMEERROR_T, SERVERERROR_T, NODATA_T, DELEGATION_T, OTHER_T = range(6)

Key = tuple[str, int, bool, bool]   # qname (lower), qtype, DO, CD


def effective_capacity(capacity: int) -> int:
    """What CoreDNS's sharded cache holds for CAPACITY: whole shards, at least 4 items each."""
    return SHARDS * max(MIN_SHARD, capacity // SHARDS)   # (a negative one: 4 per shard, as Go's)


@dataclass
class Options:
    zones: list[str]
    pcap: int = effective_capacity(DEFAULT_CAPACITY)
    pttl: int = MAX_TTL
    minpttl: int = MIN_TTL
    ncap: int = effective_capacity(DEFAULT_CAPACITY)
    nttl: int = MAX_NTTL
    minnttl: int = MIN_TTL
    failttl: float = FAIL_TTL
    prefetch: int = 0
    window: float = 60.0
    percentage: int = 10
    stale: float = 0.0
    verify: bool = False
    pexcept: list[str] = field(default_factory=list)
    nexcept: list[str] = field(default_factory=list)
    keepttl: bool = False


class Item:
    """One cached reply: what a later answer is made of, and its prefetch frequency."""

    __slots__ = ("rcode", "ad", "ra", "answer", "ns", "extra", "orig_ttl", "stored", "hits", "last",
                 "refreshing")

    def __init__(self, reply: dnslib.DNSRecord, now: float, seconds: float) -> None:
        h = reply.header
        self.rcode, self.ad, self.ra = h.rcode, bool(h.ad), bool(h.ra)
        self.answer = _copy(reply.rr)
        self.ns = _copy(reply.auth)
        self.extra = _copy(reply.ar)          # OPT is hop-by-hop: never stored
        self.orig_ttl = int(seconds)
        self.stored = now
        self.hits, self.last = 0, -math.inf
        self.refreshing = False

    def ttl(self, now: float) -> int:
        return self.orig_ttl - int(now - self.stored)


def _probe_rr_layout() -> bool:
    rr = dnslib.RR("a.", 1, 1, 7, dnslib.A("192.0.2.1"))
    return set(vars(rr)) == {"_rname", "_rtype", "_rclass", "_ttl", "rdata"} and rr._ttl == 7


# dnslib's RR() validates every field through descriptors (~8x a dict copy); a copy of an
# RR that is already valid need not, when the layout is the one this was written against.
_PLAIN_RR = _probe_rr_layout()


def _copy(rrs: list[dnslib.RR], ttl: int | None = None) -> list[dnslib.RR]:
    """New RR objects (the reply's may be shared or changed later), OPT dropped."""
    if not _PLAIN_RR:
        return [dnslib.RR(rr.rname, rr.rtype, rr.rclass, rr.ttl if ttl is None else ttl, rr.rdata)
                for rr in rrs if rr.rtype != OPT]
    out = []
    new = object.__new__
    for rr in rrs:
        d = rr.__dict__
        if d["_rtype"] == OPT:
            continue
        c = new(dnslib.RR)
        c.__dict__.update(d)
        if ttl is not None:
            c.__dict__["_ttl"] = ttl
        out.append(c)
    return out


class _Store(cachetools.TLRUCache):
    """An entry lives while it can be served (fresh, then the stale window)."""

    def __init__(self, capacity: int, stale: float, clock: Callable[[], float]) -> None:
        window = int(stale)                  # CoreDNS compares whole seconds
        super().__init__(maxsize=capacity, ttu=lambda _k, item, _now: item.stored + item.orig_ttl + window,
                         timer=clock)
        self.evicted = 0

    def popitem(self):  # cachetools calls it only to make room
        item = super().popitem()
        self.evicted += 1
        return item


class _Stores:
    __slots__ = ("p", "n", "gen")

    def __init__(self, opts: Options, clock: Callable[[], float], gen: int = -1) -> None:
        self.p = _Store(opts.pcap, opts.stale, clock)
        self.n = _Store(opts.ncap, opts.stale, clock)
        self.gen = gen          # the state generation a state-zone pair belongs to


def classify(reply: dnslib.DNSRecord, do: bool) -> int:
    """CoreDNS's response.Typify."""
    h = reply.header
    if h.opcode in (OPCODE_UPDATE, OPCODE_NOTIFY):
        return OTHER_T
    if reply.questions and reply.questions[0].qtype in (AXFR, IXFR):
        return OTHER_T
    if do and _expired_signature(reply):
        return OTHER_T
    if reply.rr and h.rcode == NOERROR:
        return NOERROR_T
    soa = any(rr.rtype == SOA for rr in reply.auth)
    if soa and h.rcode == NOERROR:
        return NODATA_T
    if soa and h.rcode == NXDOMAIN:
        return NAMEERROR_T
    if h.rcode in (SERVFAIL, NOTIMP):
        return SERVERERROR_T
    if h.rcode == NOERROR and any(rr.rtype == NS for rr in reply.auth):
        return DELEGATION_T
    if h.rcode == NOERROR:
        return NOERROR_T
    return OTHER_T


def _expired_signature(reply: dnslib.DNSRecord) -> bool:
    """Any RRSIG outside its validity period now (RFC 4034 serial arithmetic, as miekg/dns)."""
    now = int(time.time())
    year68 = 1 << 31
    for rr in reply.rr + reply.auth + reply.ar:
        if rr.rtype != RRSIG:
            continue
        inc, exp = int(rr.rdata.sig_inc), int(rr.rdata.sig_exp)
        ti = inc + int((inc - now) / year68) * year68
        te = exp + int((exp - now) / year68) * year68
        if not (ti <= now <= te):
            return True
    return False


def minimal_ttl(reply: dnslib.DNSRecord, kind: int) -> int:
    """CoreDNS's dnsutil.MinimalTTL (seconds), with a negative answer's SOA at min(TTL, MINIMUM)."""
    if kind not in (NOERROR_T, NAMEERROR_T, NODATA_T):
        return MIN_TTL
    extra = [rr for rr in reply.ar if rr.rtype != OPT]
    if not reply.rr and not reply.auth and not extra:
        return MIN_TTL
    lowest = MAX_TTL
    negative = kind in (NAMEERROR_T, NODATA_T)
    for rr in reply.rr + reply.auth + extra:
        ttl = rr.ttl
        if negative and rr.rtype == SOA:
            ttl = min(ttl, rr.rdata.times[-1])
        lowest = min(lowest, ttl)
    return lowest


def _under(zones: list[str]) -> Callable[[str], bool]:
    """Is a name (lower-case FQDN) at or under any of `zones`? One C call per name (the
    receive threads ask transparent() for every name the memo answers)."""
    if "." in zones:
        return lambda name: True
    if not zones:
        return lambda name: False
    exact, suffixes = frozenset(zones), tuple("." + z for z in zones)
    return lambda name: name in exact or name.endswith(suffixes)


def _clamp(ttl: int, low: int, high: int) -> int:
    """CoreDNS's computeTTL: raised to low, then capped at high (high wins)."""
    return min(max(ttl, low), high)


class Cache(Plugin):
    name = "cache"

    def __init__(self, opts: Options, *, server: str = "", state_zones: list[str] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.opts = opts
        self.zones = opts.zones
        self.server = server
        # only the state zones this cache sees matter
        self.state_zones = [z for z in (state_zones or []) if match_zone(self.zones, z)
                            or any(match_zone([z], c) for c in self.zones)]
        self._in_zones, self._in_state = _under(self.zones), _under(self.state_zones)
        self.clock = clock
        self.zones_label = ",".join(opts.zones)
        self._main = _Stores(opts, self._now)
        # The state zones' pair belongs to one state generation: on_state only counts one up
        # (O(1), whatever thread calls it); the next lookup makes a new pair, and an answer
        # whose query began under an older generation is not stored.
        self._gen = 0
        self._state = _Stores(opts, self._now, self._gen)
        self.pending: set[asyncio.Task] = set()        # background refreshes (prefetch, stale)
        self._counts: dict[tuple[str, str, str], int] = {}   # (metric, server, type) -> n
        self._stored_by: set[str] = set()              # servers whose queries stored entries

    def _now(self) -> float:
        return self.clock()

    # -- the contract ------------------------------------------------------------------------

    def transparent(self, qname: str, qtype: int) -> bool:
        return not self._in_zones(qname) or self._in_state(qname)

    def on_state(self, state) -> None:
        # Called once the new state is the one answered: everything cached before is older.
        self._gen += 1

    async def start(self) -> None:
        metrics.register_corefile_cache(self)

    async def stop(self) -> None:
        metrics.unregister_corefile_cache(self)
        for task in list(self.pending):
            task.cancel()
        if self.pending:
            await asyncio.gather(*self.pending, return_exceptions=True)

    def describe(self) -> str:
        o = self.opts
        parts = [f"zones={','.join(o.zones)}",
                 f"success={o.pcap} ttl {o.pttl}s min {o.minpttl}s",
                 f"denial={o.ncap} ttl {o.nttl}s min {o.minnttl}s",
                 f"servfail={_secs(o.failttl)}" if o.failttl else "servfail=off"]
        parts.append(f"prefetch={o.prefetch} {_secs(o.window)} {o.percentage}%" if o.prefetch else "prefetch=off")
        parts.append(f"serve_stale={_secs(o.stale)} {'verify' if o.verify else 'immediate'}" if o.stale
                     else "serve_stale=off")
        if o.pexcept:
            parts.append(f"disable success={','.join(o.pexcept)}")
        if o.nexcept:
            parts.append(f"disable denial={','.join(o.nexcept)}")
        if o.keepttl:
            parts.append("keepttl")
        if self.state_zones:
            parts.append(f"dropped on state change={','.join(self.state_zones)}")
        return "; ".join(parts)

    # -- serving ------------------------------------------------------------------------------

    async def serve(self, req: Request, next: Next) -> dnslib.DNSRecord:
        qname = req.qname
        if not self._in_zones(qname):
            return await next(req)
        now = self.clock()
        server = req.server or self.server
        header = req.record.header
        do, cd, ad = req.do, bool(header.cd), bool(header.ad)
        key: Key = (qname, req.qtype, do, cd)
        stores = self._stores(qname)
        item = self._get(now, key, stores, server)
        if item is None:
            req.note("cache: miss")
            reply = await self._fetch(req, next, key, stores, server, ad)
            assert reply is not None
            return reply
        ttl = item.ttl(now)
        req.data["cache"] = "hit" if ttl >= 0 else "stale"
        req.note(f"cache: {'hit' if ttl >= 0 else 'stale'} ({'success' if item.rcode == 0 and item.answer else 'denial'}, "
                 f"stored {now - item.stored:.0f}s ago)")
        if ttl < 0:
            if self.opts.verify:
                try:
                    fresh = await self._fetch(req, next, key, stores, server, ad, verify=True)
                except PluginError:
                    fresh = None
                if fresh is not None:
                    return fresh
            # a reply built from a stale item has TTL 0 (_to_msg floors it)
            if not self.opts.verify:
                self._try_prefetch(item, req, next, key, stores, server, ad, now)
            self._count("served_stale", server)
        elif self._should_prefetch(item, now):
            self._try_prefetch(item, req, next, key, stores, server, ad, now)
        if self.opts.keepttl:
            now = item.stored
        return _to_msg(item, req.record, now, do, ad)

    def _stores(self, qname: str) -> _Stores:
        if self._in_state(qname):
            s, gen = self._state, self._gen
            if s.gen != gen:
                s = self._state = _Stores(self.opts, self._now, gen)
            return s
        return self._main

    def _usable(self, item: Item | None, now: float) -> bool:
        if item is None:
            return False
        ttl = item.ttl(now)
        stale = int(self.opts.stale)
        return ttl > 0 or (stale > 0 and -ttl < stale)

    def _get(self, now: float, key: Key, stores: _Stores, server: str) -> Item | None:
        """CoreDNS's getIfNotStale: a fresh entry, or one within the stale window; counted."""
        self._count("requests", server)
        n = stores.n.get(key)
        if n is not None and self._usable(n, now):
            if n.rcode == SERVFAIL:
                # SERVFAIL is transient: a usable positive entry wins over it
                p = stores.p.get(key)
                if p is not None and self._usable(p, now):
                    self._count("hits", server, SUCCESS)
                    return p
            self._count("hits", server, DENIAL)
            return n
        p = stores.p.get(key)
        if p is not None and self._usable(p, now):
            self._count("hits", server, SUCCESS)
            return p
        self._count("misses", server)
        return None

    async def _fetch(self, req: Request, next: Next, key: Key, stores: _Stores, server: str, ad: bool,
                     prefetch: bool = False, verify: bool = False) -> dnslib.DNSRecord | None:
        """Ask next, store what may be stored, and return the reply as the client gets it
        (None for a prefetch, or for a verify whose answer is neither NOERROR nor NXDOMAIN)."""
        reply = await next(req)
        if verify and reply.header.rcode not in (NOERROR, NXDOMAIN):
            return None
        do = key[2]
        kind = classify(reply, any(rr.rtype == OPT and rr.edns_do for rr in reply.ar))
        o = self.opts
        if kind in (NAMEERROR_T, NODATA_T):
            seconds: float = _clamp(minimal_ttl(reply, kind), o.minnttl, o.nttl)
        elif kind == SERVERERROR_T:
            seconds = o.failttl
        else:
            seconds = _clamp(minimal_ttl(reply, kind), o.minpttl, o.pttl)
        if not reply.header.tc and kind != OTHER_T and seconds > 0:
            if _matches(req, reply):
                self._set(reply, key, kind, seconds, stores, server, prefetch)
            else:
                self._count("drops", server)
        if prefetch:
            return None
        # the clamped TTL on this reply too (no 1799 -> 8 jump between the first and a cached answer)
        ttl = int(seconds)
        h = reply.header
        out = dnslib.DNSRecord(dnslib.DNSHeader(id=h.id, bitmap=h.bitmap), questions=list(reply.questions),
                               rr=_copy(reply.rr, ttl), auth=_copy(reply.auth, ttl), ar=_copy(reply.ar, ttl))
        if not do and not ad:
            out.header.ad = 0
        return out

    def _set(self, reply: dnslib.DNSRecord, key: Key, kind: int, seconds: float, stores: _Stores,
             server: str, prefetch: bool) -> None:
        if stores is not self._main and stores.gen != self._gen:
            return          # the state changed while next answered: that answer may be of the old one
        qname = key[0]
        if kind in (NOERROR_T, DELEGATION_T):
            if match_zone(self.opts.pexcept, qname) is not None:
                return
            store, kind_label = stores.p, SUCCESS
        elif kind in (NAMEERROR_T, NODATA_T, SERVERERROR_T):
            if match_zone(self.opts.nexcept, qname) is not None:
                return
            store, kind_label = stores.n, DENIAL
        else:
            return
        before = store.evicted
        store[key] = Item(reply, self.clock(), seconds)
        if store.evicted > before:
            self._count("evictions", server, kind_label, store.evicted - before)
        if prefetch and kind_label == SUCCESS:
            stores.n.pop(key, None)
        self._stored_by.add(server)

    def _should_prefetch(self, item: Item, now: float) -> bool:
        o = self.opts
        if o.prefetch <= 0:
            return False
        # plugin/cache/freq: hits with no gap of `window` between them
        if item.last < now - o.window:
            item.hits = 1
        else:
            item.hits += 1
        item.last = now
        threshold = math.ceil(o.percentage / 100 * item.orig_ttl)
        return item.hits >= o.prefetch and item.ttl(now) <= threshold

    def _try_prefetch(self, item: Item, req: Request, next: Next, key: Key, stores: _Stores, server: str,
                      ad: bool, now: float) -> None:
        if item.refreshing:          # one refresh per entry in flight
            return
        item.refreshing = True
        task = asyncio.get_running_loop().create_task(
            self._prefetch(item, req, next, key, stores, server, ad, now))
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)

    async def _prefetch(self, item: Item, req: Request, next: Next, key: Key, stores: _Stores, server: str,
                        ad: bool, now: float) -> None:
        self._count("prefetch", server)
        # as CoreDNS: over "TCP", so the refreshed answer is whole
        preq = Request(record=dnslib.DNSRecord.parse(req.record.pack()), client=req.client, tcp=True,
                       server=req.server, zone=req.zone, wire=req.wire, size=65535, data=dict(req.data))
        try:
            await self._fetch(preq, next, key, stores, server, ad, prefetch=True)
        except PluginError as exc:
            log.debug("cache refresh of %s failed: %s", key[0], exc.reason)
        except Exception:                       # a background refresh must not kill anything
            log.exception("cache refresh of %s", key[0])
        finally:
            item.refreshing = False
        # the new entry keeps the frequency gathered so far
        fresh = stores.n.get(key) or stores.p.get(key)
        if fresh is not None and fresh is not item:
            fresh.last, fresh.hits = now, item.hits

    # -- metrics --------------------------------------------------------------------------------

    def _count(self, metric: str, server: str, kind: str = "", n: int = 1) -> None:
        k = (metric, server, kind)
        self._counts[k] = self._counts.get(k, 0) + n

    def metric_samples(self) -> Iterator[tuple[str, dict[str, str], float]]:
        """(family, labels, value) for coredns_cache_*, labelled as CoreDNS labels them."""
        for (metric, server, kind), n in list(self._counts.items()):
            labels = {"server": server, "zones": self.zones_label, "view": ""}
            if kind:
                labels["type"] = kind
            yield f"coredns_cache_{metric}", labels, float(n)
        pos, neg = len(self._main.p), len(self._main.n)
        state = self._state
        if state.gen == self._gen:
            pos, neg = pos + len(state.p), neg + len(state.n)
        for server in sorted(self._stored_by):
            for kind, n in ((SUCCESS, pos), (DENIAL, neg)):
                yield "coredns_cache_entries", {"server": server, "type": kind, "zones": self.zones_label,
                                                "view": ""}, float(n)


def _matches(req: Request, reply: dnslib.DNSRecord) -> bool:
    """CoreDNS's request.Match: a response to this very question."""
    if not reply.header.qr or len(reply.questions) != 1:
        return False
    q = reply.questions[0]
    return fqdn(str(q.qname)) == req.qname and q.qtype == req.qtype


def _to_msg(item: Item, query: dnslib.DNSRecord, now: float, do: bool, ad: bool) -> dnslib.DNSRecord:
    """The cached reply tailored to this query (CoreDNS's item.toMsg)."""
    qbits = query.header.bitmap
    opcode = qbits & 0x7800
    # QR, the query's opcode and RD (and CD for a QUERY), AA, RA and AD as stored, the rcode
    bits = 0x8000 | opcode | 0x0400 | (qbits & 0x0100) | (item.rcode & 0xF)
    if opcode == 0:
        bits |= qbits & 0x0010
    if item.ra:
        bits |= 0x0080
    if item.ad and (do or ad):
        bits |= 0x0020
    ttl = max(0, item.ttl(now))
    return dnslib.DNSRecord(dnslib.DNSHeader(id=query.header.id, bitmap=bits), questions=list(query.questions[:1]),
                            rr=_copy(item.answer, ttl), auth=_copy(item.ns, ttl), ar=_copy(item.extra, ttl))


def _secs(seconds: float) -> str:
    return f"{seconds:g}s"


# -- setup ------------------------------------------------------------------------------------

_ATOI = re.compile(r"[+-]?[0-9]+")
_BARE_NUMBER = re.compile(r"[+-]?[0-9]*\.?[0-9]+")


def _atoi(text: str) -> int | None:
    """Go's strconv.Atoi: an optional sign and digits, nothing else."""
    return int(text) if _ATOI.fullmatch(text) else None


def _go_duration(d: Directive, what: str, text: str) -> float:
    """Go's time.ParseDuration: a unit is required except for 0."""
    if _BARE_NUMBER.fullmatch(text) and text.lstrip("+-") != "0":
        raise plugin_error(d, f"{what}: invalid duration {text!r} (missing unit, e.g. {text}s)", "cache")
    try:
        return duration(text)
    except ValueError:
        raise plugin_error(d, f"{what}: invalid duration {text!r}", "cache") from None


def _int(d: Directive, what: str, text: str) -> int:
    n = _atoi(text)
    if n is None:
        raise plugin_error(d, f"{what} {text!r} is not an integer", "cache")
    return n


def _capacity_ttls(line: Directive) -> tuple[int, int | None, int | None]:
    args = line.values
    what = line.name
    if not args or len(args) > 3:
        raise plugin_error(line, f"{what} takes CAPACITY [TTL] [MINTTL], got {len(args)} arguments", "cache")
    capacity = effective_capacity(_int(line, f"{what} capacity", args[0]))
    ttl = minttl = None
    if len(args) > 1:
        ttl = _int(line, f"{what} TTL", args[1])
        if ttl <= 0:
            raise plugin_error(line, f"cache TTL can not be zero or negative: {ttl}", "cache")
    if len(args) > 2:
        minttl = _int(line, f"{what} MINTTL", args[2])
        if minttl < 0:
            raise plugin_error(line, f"cache min TTL can not be negative: {minttl}", "cache")
    return capacity, ttl, minttl


def setup(directive: Directive, ctx: SetupContext) -> Cache:
    args = directive.values
    opts = Options(zones=[])
    if args:
        ttl = _atoi(args[0])
        if ttl is not None:                 # a first argument that is a number is the TTL, else a zone
            if ttl <= 0:
                raise plugin_error(directive, f"cache TTL can not be zero or negative: {ttl}")
            opts.pttl = opts.nttl = ttl
            args = args[1:]
    opts.zones = normalize_zones(args, ctx.zones, directive, "cache")

    for line in directive.lines():
        if line.body is not None:
            raise plugin_error(line, f"{line.name} takes no block", "cache")
        name, values = line.name, line.values
        if name == SUCCESS:
            opts.pcap, ttl_, min_ = _capacity_ttls(line)
            opts.pttl = opts.pttl if ttl_ is None else ttl_
            opts.minpttl = opts.minpttl if min_ is None else min_
        elif name == DENIAL:
            opts.ncap, ttl_, min_ = _capacity_ttls(line)
            opts.nttl = opts.nttl if ttl_ is None else ttl_
            opts.minnttl = opts.minnttl if min_ is None else min_
        elif name == "prefetch":
            if not values or len(values) > 3:
                raise plugin_error(line, "prefetch takes AMOUNT [[DURATION] [PERCENTAGE%]]", "cache")
            amount = _int(line, "prefetch amount", values[0])
            if amount < 0:
                raise plugin_error(line, f"prefetch amount should be positive: {amount}", "cache")
            opts.prefetch = amount
            if len(values) > 1:
                opts.window = _go_duration(line, "prefetch", values[1])
            if len(values) > 2:
                pct = values[2]
                if not pct.endswith("%"):
                    raise plugin_error(line, f"last character of percentage should be `%`, but is: {pct[-1:]!r}",
                                       "cache")
                num = _int(line, "prefetch percentage", pct[:-1])
                if not 10 <= num <= 90:
                    raise plugin_error(line, f"percentage should fall in range [10, 90]: {num}", "cache")
                opts.percentage = num
        elif name == "serve_stale":
            if len(values) > 2:
                raise plugin_error(line, "serve_stale takes [DURATION] [immediate|verify]; a third argument "
                                   "(later CoreDNS releases) is not supported", "cache")
            opts.stale, opts.verify = DEFAULT_STALE, False
            if values:
                stale = _go_duration(line, "serve_stale", values[0])
                if stale < 0:
                    raise plugin_error(line, "invalid negative duration for serve_stale", "cache")
                opts.stale = stale
            if len(values) > 1:
                mode = values[1].lower()
                if mode not in ("immediate", "verify"):
                    raise plugin_error(line, f"invalid value for serve_stale refresh mode: {mode}", "cache")
                opts.verify = mode == "verify"
        elif name == "servfail":
            if len(values) != 1:
                raise plugin_error(line, "servfail takes one DURATION", "cache")
            fail = _go_duration(line, "servfail", values[0])
            if fail < 0:
                raise plugin_error(line, "invalid negative ttl for servfail", "cache")
            if fail > MAX_FAIL_TTL:
                # RFC 2308 section 7.1
                raise plugin_error(line, "caching SERVFAIL responses over 5 minutes is not permitted", "cache")
            opts.failttl = fail
        elif name == "disable":
            if not values:
                raise plugin_error(line, "disable takes success|denial [ZONES...]", "cache")
            zones = normalize_zones(values[1:], ["."], line, "cache")
            if values[0] == DENIAL:
                opts.nexcept = zones
            elif values[0] == SUCCESS:
                opts.pexcept = zones
            else:
                raise plugin_error(line, f'cache type for disable must be "success" or "denial", not {values[0]!r}',
                                   "cache")
        elif name == "keepttl":
            if values:
                raise plugin_error(line, "keepttl takes no arguments", "cache")
            opts.keepttl = True
        elif name == "serve_stale_policy":
            raise plugin_error(line, "serve_stale_policy (CoreDNS after 1.14.7) is not supported", "cache")
        else:
            raise plugin_error(line, f"unknown option {name!r} (cache takes success, denial, prefetch, "
                               "serve_stale, servfail, disable, keepttl)", "cache")

    return Cache(opts, server=ctx.server, state_zones=list(ctx.state_zones))
