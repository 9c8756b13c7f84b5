"""The cache in front of the upstream forwarders (CoreDNS's `cache` plugin).

Only forwarded answers come here: names in the served zones are answered from
the current state and never cached (a new Service resolves at once).

An entry keeps the upstream reply (parsed once) and the duration it may be
served: the smallest TTL of the reply (the SOA's for a negative answer),
clamped to [min_ttl, max_ttl]. On a hit every record's TTL is rewritten to
what is left, so TTLs count down. Expired entries stay (within the size
bound) for `stale_for` seconds so they can be served when every upstream is
down (serve-stale), with TTL 0.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import cachetools
import dnslib

from . import metrics

NOERROR, NXDOMAIN = 0, 3
DEFAULT_STALE = 3600.0   # CoreDNS serve_stale's default duration
_HITS = {kind: metrics.cache_hits.labels(kind) for kind in ("success", "denial")}   # label lookups cost


@dataclass(frozen=True, slots=True)
class Entry:
    record: dnslib.DNSRecord   # parsed once when stored, never mutated: hits copy records from it
    stored: float              # clock time it was stored
    duration: float      # seconds it is fresh (clamped TTL)
    negative: bool


Key = tuple[str, int, int, bool, bool]


def cache_key(request: dnslib.DNSRecord) -> Key | None:
    """lower-cased qname, qtype, qclass, DO, CD (CoreDNS's key); None if uncacheable."""
    if len(request.questions) != 1:
        return None
    q = request.questions[0]
    do = False
    for rr in request.ar:
        if rr.rtype == dnslib.QTYPE.OPT:
            do = bool(rr.edns_do)
    return (str(q.qname).lower(), q.qtype, q.qclass, do, bool(request.header.cd))


def _ttl_of(reply: dnslib.DNSRecord) -> tuple[int, bool] | None:
    """The reply's cacheable TTL and whether it is negative; None when not cacheable."""
    h = reply.header
    if h.tc or h.rcode not in (NOERROR, NXDOMAIN):
        return None
    if h.rcode == NOERROR and reply.rr:
        ttls = [rr.ttl for rr in reply.rr + reply.auth + reply.ar if rr.rtype != dnslib.QTYPE.OPT]
        return min(ttls), False
    # NXDOMAIN, or NODATA: cacheable only with the SOA that says for how long (RFC 2308).
    for rr in reply.auth:
        if rr.rtype == dnslib.QTYPE.SOA:
            return min(rr.ttl, rr.rdata.times[-1]), True
    return None


def with_ttl(rrs: list[dnslib.RR], ttl: int) -> list[dnslib.RR]:
    opt = dnslib.QTYPE.OPT
    return [rr if rr.rtype == opt else dnslib.RR(rr.rname, rr.rtype, rr.rclass, ttl, rr.rdata) for rr in rrs]


class Cache:
    """Bounded, per-entry-TTL cache of forwarded replies."""

    def __init__(self, size: int = 9984, min_ttl: int = 5, max_ttl: int = 30,
                 stale_for: float = DEFAULT_STALE, clock: Callable[[], float] = time.monotonic) -> None:
        self.min_ttl, self.max_ttl, self.stale_for = min_ttl, max_ttl, stale_for
        self.clock = clock
        cache = self

        class _Store(cachetools.TLRUCache):
            def popitem(self):  # called only to make room: an eviction
                item = super().popitem()
                metrics.cache_evictions.labels("denial" if item[1].negative else "success").inc()
                return item

        # An entry lives for its fresh time plus the stale window.
        self._store = _Store(maxsize=max(1, size),
                             ttu=lambda _k, e, now: now + e.duration + cache.stale_for,
                             timer=clock)

    def __len__(self) -> int:
        return len(self._store)

    def counts(self) -> tuple[int, int]:
        """(positive, negative) entries, for the entries gauge."""
        neg = sum(1 for e in list(self._store.values()) if e.negative)
        return len(self._store) - neg, neg

    def put(self, key: Key | None, reply: dnslib.DNSRecord, wire: bytes) -> bool:
        if key is None:
            return False
        found = _ttl_of(reply)
        if found is None:
            return False
        ttl, negative = found
        duration = float(max(self.min_ttl, min(self.max_ttl, ttl)))
        # Parsed again from the wire so the caller may keep using `reply`.
        self._store[key] = Entry(dnslib.DNSRecord.parse(bytes(wire)), self.clock(), duration, negative)
        return True

    def get(self, key: Key | None, request: dnslib.DNSRecord, stale: bool = False) -> dnslib.DNSRecord | None:
        """A reply for the request from the cache, or None.

        `stale=False`: only fresh entries (a hit counts toward the metrics).
        `stale=True`: also entries past their TTL within the stale window,
        served with TTL 0 (used when every upstream failed).
        """
        if key is None:
            return None
        entry = self._store.get(key)
        kind = "denial" if entry is not None and entry.negative else "success"
        if not stale:
            metrics.cache_requests.inc()
        left = -1.0 if entry is None else entry.duration - (self.clock() - entry.stored)
        if entry is None or (left <= 0 and not stale):
            if not stale:
                metrics.cache_misses.inc()
            return None
        if stale:
            metrics.cache_served_stale.inc()
        else:
            _HITS[kind].inc()
        ttl = max(0, int(left)) if left > 0 else 0
        stored = entry.record
        # New RR objects with the remaining TTL (cheaper than parsing the wire again).
        reply = dnslib.DNSRecord(
            dnslib.DNSHeader(id=request.header.id, bitmap=stored.header.bitmap),
            questions=list(request.questions),       # the asker's spelling
            rr=with_ttl(stored.rr, ttl), auth=with_ttl(stored.auth, ttl), ar=with_ttl(stored.ar, ttl))
        return reply

    def peek(self, key: Key | None) -> Entry | None:
        """The stored entry (fresh or stale), not counted as a request."""
        return None if key is None else self._store.get(key)

    def fresh_hit(self, key: Key, entry: Entry) -> float:
        """Seconds `entry` stays fresh when it is still the one stored under `key`; that is a hit
        and counted as get() counts it. -1 otherwise (nothing counted: the caller then get()s)."""
        if self._store.get(key) is not entry:
            return -1.0
        left = entry.duration - (self.clock() - entry.stored)
        if left <= 0:
            return -1.0
        metrics.cache_requests.inc()
        _HITS["denial" if entry.negative else "success"].inc()
        return left

    def discard(self, key: Key | None) -> None:
        """Forget the entry under `key` (if any)."""
        if key is not None:
            self._store.pop(key, None)

    def clear(self) -> None:
        self._store.clear()
