"""DNS metrics under CoreDNS's names, so its dashboards and alerts apply.

Per-query counting is on the hot path, so the server keeps plain dicts in a
ServerStats per listener and calls one method per query (`fast_udp` on the
UDP fast path, `record` elsewhere); a custom collector turns them into metric
families only when /metrics is scraped. Every query is counted and timed:
coredns_dns_request_duration_seconds_count equals coredns_dns_requests_total.

Which part answered (the `plugin` label of coredns_dns_responses_total, as
CoreDNS names the plugin that wrote the reply):
- a prebuilt answer of the served zones (AA set, RA clear) -> "kubernetes";
- on the fast path, anything else is a forwarded answer from the cache -> "cache";
- in resolve(), the forwarder marks its answers `answered_by("cache")` or
  `answered_by("forward")`; an unmarked reply that is not a zone answer was
  written by the server itself (FORMERR, NOTIMP, REFUSED, SERVFAIL) -> "".
The answer of an upstream that sets AA without RA (an authoritative-only
server used as upstream) counts as "kubernetes". Those parts are the flags'
one server block, zone ".".

With a Corefile the `part` is a label id (`label(zone, plugin)`, interned once
per block and plugin, not per query): the zone key of the server block that
answered (the longest match of the question, as CoreDNS's prometheus plugin
names it) and the plugin that wrote the reply. A query no block took (REFUSED
before any chain, a malformed query, a panic) counts under zone "dropped"; a
block without `prometheus` is not counted at all (CoreDNS counts in that
plugin).

The cache and the forwarder are off the hot path and use ordinary
prometheus-client metrics; the cache's are exported with the server/zones/view
labels CoreDNS gives them.
"""
from __future__ import annotations

import contextvars
import weakref
from bisect import bisect_left
from time import perf_counter
from typing import Any, Iterable

import dnslib
from prometheus_client import Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from ..metrics import DNS as REGISTRY  # CoreDNS's series: served on --metrics-listen

# CoreDNS: prometheus.ExponentialBuckets(0.00025, 2, 16) for request durations.
DURATION_BUCKETS = tuple(0.00025 * 2 ** i for i in range(16))
_B0 = DURATION_BUCKETS[0]
SIZE_BUCKETS = (0, 100, 200, 300, 400, 511, 1023, 2047, 4095, 8291, 16e3, 32e3, 48e3, 64e3)
# Types CoreDNS labels by name; everything else is "other" (bounded cardinality).
MONITORED_TYPES = {int(getattr(dnslib.QTYPE, t)): t for t in (
    "A", "AAAA", "NS", "PTR", "SOA", "MX", "TXT", "SRV", "CNAME", "NAPTR", "DS", "DNSKEY",
    "HTTPS", "SVCB", "CAA", "HINFO", "ANY", "AXFR", "IXFR")}
RCODES = {0: "NOERROR", 1: "FORMERR", 2: "SERVFAIL", 3: "NXDOMAIN", 4: "NOTIMP", 5: "REFUSED",
          6: "YXDOMAIN", 7: "YXRRSET", 8: "NXRRSET", 9: "NOTAUTH", 10: "NOTZONE"}
RAW_LIMIT = 4096  # distinct per-query keys kept before folding
ZONE = "."   # the one server block: every query enters the "." chain

DROPPED = "dropped"   # CoreDNS's zone of queries that never entered a server block's chain

# The `part` of a raw key: how to name the plugin that answered (zone answers aside).
FAST, SLOW, CACHE, FORWARD, SERVER = 0, 1, 2, 3, 4
_PARTS = {"cache": CACHE, "forward": FORWARD}
_PART_NAMES = ("cache", "", "cache", "forward", "")
_answered: contextvars.ContextVar[int] = contextvars.ContextVar("clusterdns_answered_by", default=SLOW)
# parts beyond SERVER: (zone, plugin) of a Corefile's blocks, None for one not counted (SILENT)
_LABELS: list[tuple[str, str] | None] = [None] * (SERVER + 1)
_LABEL_IDS: dict[tuple[str, str] | None, int] = {}


def label(zone: str | None, plugin: str = "") -> int:
    """The part id of answers of `plugin` in the block of `zone` (None: a block not counted)."""
    key = None if zone is None else (zone, plugin)
    got = _LABEL_IDS.get(key)
    if got is None:
        got = _LABEL_IDS[key] = len(_LABELS)
        _LABELS.append(key)
    return got


SILENT = label(None)


def answered_by(part: str) -> None:
    """The forwarder's mark on the query being resolved (its task's context): "cache" or "forward"."""
    _answered.set(_PARTS[part])


def answered_as(part: int) -> None:
    """The mark of a Corefile's answer: a label() id (the zone and the plugin that wrote it)."""
    _answered.set(part)


def begin_resolve() -> None:
    """Called by the server at the start of a resolve() task: no mark yet."""
    _answered.set(SLOW)


class ServerStats:
    """Counters of one listener (`server` label `dns://HOST:PORT`), updated per query.

    Per query: one dict update keyed on bytes read straight from the two
    packets and the duration's bucket; the value holds the count and the sum
    of durations. The scrape folds those into the exported families.
    """

    __slots__ = ("server", "family", "plugins", "corefile", "udp", "tcp", "requests", "do_requests", "durations",
                 "duration_sum", "responses", "request_sizes", "response_sizes", "__weakref__")

    def __init__(self, server: str, family: int, plugins: Iterable[str | tuple[str, str]] = (),
                 corefile: bool = False) -> None:
        self.server, self.family = server, family
        # coredns_plugin_enabled: (zone, name), a bare name for zone "."
        self.plugins = tuple(p if isinstance(p, tuple) else (ZONE, p) for p in plugins)
        # a Corefile's listener: the flags' parts are replies no block wrote (zone "dropped")
        self.corefile = corefile
        # (qtype hi, lo, reply flags byte 2, byte 3, request size, reply size, duration bucket, DO, part)
        # -> [n, seconds]; the flag bytes are -1 for a dropped query. Cleared in place by fold().
        self.udp: dict[tuple, list] = {}
        self.tcp: dict[tuple, list] = {}
        # folded totals, by zone first
        self.requests: dict[tuple[str, bool, int], int] = {}       # (zone, tcp, qtype) -> n
        self.do_requests: dict[str, int] = {}
        self.durations: dict[tuple[str, int], list[int]] = {}      # (zone, qtype) -> count per bucket (+Inf last)
        self.duration_sum: dict[tuple[str, int], float] = {}
        self.responses: dict[tuple[str, int, str], int] = {}       # (zone, rcode, plugin) -> n
        self.request_sizes: dict[tuple[str, bool, int], int] = {}
        self.response_sizes: dict[tuple[str, bool, int], int] = {}

    def fast_udp(self, data: bytes, reply: bytes, started: float, part: int = FAST) -> None:
        """A UDP query answered by the engine's fast path; `started`: perf_counter() on arrival;
        `part`: FAST, or the label() id of the Corefile block's answer."""
        elapsed = perf_counter() - started
        i = data.find(0, 12)
        try:
            key = (data[i + 1], data[i + 2], reply[2], reply[3], len(data), len(reply),
                   0 if elapsed <= _B0 else bisect_left(DURATION_BUCKETS, elapsed),
                   data[i + 12] >> 7 if data[11] == 1 and data[i + 7] == 41 else 0, part)
        except IndexError:
            key = self._odd_key(data, reply, elapsed, part)
        v = self.udp.get(key)
        if v is None:
            self._new_key(self.udp, key, elapsed)
        else:
            v[0] += 1
            v[1] += elapsed

    def record(self, data: bytes, reply: bytes | None, tcp: bool, started: float, part: int = SLOW) -> None:
        """Count one query and its reply (None: dropped), timed from `started` (perf_counter()).

        `part`: FAST for an answer of engine.fast(), SLOW for one of resolve()
        (then the forwarder's mark in this task's context says who answered),
        SERVER for a reply the server wrote itself (SERVFAIL after a panic)."""
        elapsed = perf_counter() - started
        if part == SLOW:
            part = _answered.get()
        i = data.find(0, 12)
        try:
            if reply is not None and len(reply) > 3:
                f2, f3, rsize = reply[2], reply[3], len(reply)
            else:
                f2, f3, rsize = -1, -1, 0
            key = (data[i + 1], data[i + 2], f2, f3, len(data), rsize,
                   0 if elapsed <= _B0 else bisect_left(DURATION_BUCKETS, elapsed),
                   data[i + 12] >> 7 if data[11] == 1 and data[i + 7] == 41 else 0, part)
        except IndexError:
            key = self._odd_key(data, reply, elapsed, part)
        table = self.tcp if tcp else self.udp
        v = table.get(key)
        if v is None:
            self._new_key(table, key, elapsed)
        else:
            v[0] += 1
            v[1] += elapsed

    @staticmethod
    def _odd_key(data: bytes, reply: bytes | None, elapsed: float, part: int) -> tuple:
        """A query whose question could not be delimited: type "other", no DO."""
        b = 0 if elapsed <= _B0 else bisect_left(DURATION_BUCKETS, elapsed)
        if reply is None or len(reply) < 4:
            return (255, 255, -1, -1, len(data), 0, b, 0, part)
        return (255, 255, reply[2], reply[3], len(data), len(reply), b, 0, part)

    def _new_key(self, table: dict, key: tuple, elapsed: float) -> None:
        # Fold now and then so odd traffic (random types and sizes) cannot grow
        # the table between scrapes, or when nobody scrapes.
        if len(table) >= RAW_LIMIT:
            self.fold()
        table[key] = [1, elapsed]   # the callers found no entry for key

    def fold(self) -> None:
        """Move the raw per-query counts into the totals (at scrape, or when a table is full)."""
        nbuckets = len(DURATION_BUCKETS) + 1
        labels = _LABELS
        for tcp, table in ((False, self.udp), (True, self.tcp)):
            raw = list(table.items())
            table.clear()           # in place: the server holds a reference to the table
            for (hi, lo, f2, f3, qsize, rsize, bucket, do, part), (n, seconds) in raw:
                if part > SERVER:
                    zp = labels[part]
                    if zp is None:          # a block without prometheus: CoreDNS counts nothing
                        continue
                    zone, plugin = zp
                elif self.corefile:
                    zone, plugin = DROPPED, ""
                else:
                    zone, plugin = ZONE, _plugin(f2, f3, part)
                qtype = hi << 8 | lo
                qtype = qtype if qtype in MONITORED_TYPES else -1     # "other": bounded totals
                k = (zone, tcp, qtype)
                self.requests[k] = self.requests.get(k, 0) + n
                if do:
                    self.do_requests[zone] = self.do_requests.get(zone, 0) + n
                zq = (zone, qtype)
                counts = self.durations.get(zq)
                if counts is None:
                    counts = self.durations[zq] = [0] * nbuckets
                counts[bucket] += n
                self.duration_sum[zq] = self.duration_sum.get(zq, 0.0) + seconds
                k = (zone, tcp, qsize)
                self.request_sizes[k] = self.request_sizes.get(k, 0) + n
                if f2 >= 0:
                    r = (zone, f3 & 15, plugin)
                    self.responses[r] = self.responses.get(r, 0) + n
                    k = (zone, tcp, rsize)
                    self.response_sizes[k] = self.response_sizes.get(k, 0) + n

    def absorb(self, other: "ServerStats") -> None:
        """Take over the folded totals of another listener on the same address (a reload's
        predecessor or successor), leaving it at zero: the address keeps one series."""
        pairs: list[tuple[dict[Any, Any], dict[Any, Any]]] = [
            (self.requests, other.requests), (self.responses, other.responses),
            (self.request_sizes, other.request_sizes), (self.response_sizes, other.response_sizes),
            (self.duration_sum, other.duration_sum), (self.do_requests, other.do_requests)]
        for mine, theirs in pairs:
            for k, n in list(theirs.items()):
                mine[k] = mine.get(k, 0) + n
            theirs.clear()
        for qtype, counts in list(other.durations.items()):
            have = self.durations.setdefault(qtype, [0] * len(counts))
            for i, n in enumerate(counts):
                have[i] += n
        other.durations.clear()


def _plugin(f2: int, f3: int, part: int) -> str:
    if f2 & 4 and not f3 & 0x80:     # AA without RA: an answer of the served zones
        return "kubernetes"          # (also an ExternalName's CNAME + the upstream's records)
    return _PART_NAMES[part]


def plugins_for(cfg, forwarder) -> tuple[str, ...]:
    """The CoreDNS plugins whose job this configuration does (coredns_plugin_enabled)."""
    names = ["errors", "kubernetes", "loadbalance"]
    if cfg.agent.health_listen != "none":
        names += ["health", "ready"]
    if cfg.agent.metrics_listen != "none":
        names.append("prometheus")
    if forwarder is not None:
        names += ["forward", "loop"]
        if getattr(forwarder, "cache", None) is not None:
            names.append("cache")
    if cfg.dns.autopath:
        names.append("autopath")
    if cfg.dns.transfer:
        names.append("transfer")
    if cfg.agent.config_file:
        names.append("reload")
    return tuple(sorted(names))


_servers: "weakref.WeakSet[ServerStats]" = weakref.WeakSet()
_caches: "weakref.WeakSet" = weakref.WeakSet()
_corefile_caches: "weakref.WeakSet" = weakref.WeakSet()   # Corefile `cache` plugins: own labels
_panics = [0]


def register_server(stats: ServerStats) -> None:
    """Export a new listener's counters. One on an address another server counted for (the
    one a reload replaces) carries on that one's totals: one series per address, continuing
    across the reload as CoreDNS's do."""
    for old in [s for s in _servers if s.server == stats.server and s is not stats]:
        old.fold()
        stats.absorb(old)
        _servers.discard(old)
    _servers.add(stats)


def retire_server(stats: ServerStats) -> None:
    """A stopped listener: what it counted since goes to the one now counting for its
    address; with none, it stays exported (a stopped server's counts do not vanish)."""
    stats.fold()
    for s in list(_servers):
        if s is not stats and s.server == stats.server:
            s.absorb(stats)
            _servers.discard(stats)
            return


def register_cache(cache) -> None:
    _caches.add(cache)


def register_corefile_cache(cache) -> None:
    """A Corefile cache plugin: its metric_samples() (family, labels, value) join the cache families."""
    _corefile_caches.add(cache)


def unregister_corefile_cache(cache) -> None:
    _corefile_caches.discard(cache)


def panic() -> None:
    """A query handler raised: counted as CoreDNS counts recovered panics."""
    _panics[0] += 1


def _type_name(qtype: int) -> str:
    return MONITORED_TYPES.get(qtype, "other")


def _cumulative(counts: list, buckets: Iterable[float]) -> list[tuple[str, float]]:
    """Per-bucket counts (the last one above every bound) as Prometheus cumulative buckets."""
    out, total = [], 0.0
    for bound, n in zip(buckets, counts):
        total += n
        out.append((floatToGoString(bound), total))
    out.append(("+Inf", float(sum(counts))))
    return out


def _size_histogram(sizes: dict[int, int]) -> tuple[list[float], float]:
    counts = [0.0] * (len(SIZE_BUCKETS) + 1)
    total = 0.0
    for size, n in sizes.items():
        total += size * n
        for k, bound in enumerate(SIZE_BUCKETS):
            if size <= bound:
                counts[k] += n
                break
        else:
            counts[-1] += n
    return counts, total


def _relabel(family, name: str, drop: str, documentation: str):
    """A copy of a labelled family under another name without one label (samples summed)."""
    kind = {"counter": CounterMetricFamily, "histogram": HistogramMetricFamily}[family.type]
    out = kind(name, documentation, labels=None)
    merged: dict[tuple, float] = {}
    order: list[tuple] = []
    for s in family.samples:
        labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != drop))
        key = (s.name[len(family.name):], labels)
        if key not in merged:
            order.append(key)
        merged[key] = merged.get(key, 0.0) + s.value
    for suffix, labels in order:
        if suffix == "_created":
            continue
        out.add_sample(name + suffix, dict(labels), merged[(suffix, labels)])
    return out


class DnsCollector:
    """Exports every live ServerStats, the caches and the forward_* aliases at scrape time."""

    def describe(self):
        return []

    def collect(self):
        requests = CounterMetricFamily("coredns_dns_requests", "Counter of DNS requests made per zone, protocol and family.",
                                       labels=["server", "zone", "view", "proto", "family", "type"])
        do_requests = CounterMetricFamily("coredns_dns_do_requests", "Counter of DNS requests with DO bit set per zone.",
                                          labels=["server", "zone", "view"])
        responses = CounterMetricFamily("coredns_dns_responses", "Counter of response status codes.",
                                        labels=["server", "zone", "view", "rcode", "plugin"])
        duration = HistogramMetricFamily("coredns_dns_request_duration_seconds",
                                         "Histogram of the time (in seconds) each request took per zone.",
                                         labels=["server", "zone", "view", "type"])
        req_size = HistogramMetricFamily("coredns_dns_request_size_bytes", "Size of the EDNS0 UDP buffer in bytes (64K for TCP) per zone and protocol.",
                                         labels=["server", "zone", "view", "proto"])
        resp_size = HistogramMetricFamily("coredns_dns_response_size_bytes", "Size of the returned response in bytes.",
                                          labels=["server", "zone", "view", "proto"])
        enabled = GaugeMetricFamily("coredns_plugin_enabled", "A metric that indicates whether a plugin is enabled on per server and zone basis.",
                                    labels=["server", "zone", "view", "name"])
        servers = sorted(_servers, key=lambda s: s.server)
        for s in servers:
            s.fold()
            agg: dict[tuple[str, str, str], int] = {}
            for (zone, tcp, qtype), n in list(s.requests.items()):
                k = (zone, "tcp" if tcp else "udp", _type_name(qtype))
                agg[k] = agg.get(k, 0) + n
            for (zone, proto, tname), n in sorted(agg.items()):
                requests.add_metric([s.server, zone, "", proto, str(s.family), tname], n)
            for zone in sorted({z for z, _t, _q in s.requests} | set(s.do_requests) | (set() if s.corefile else {ZONE})):
                do_requests.add_metric([s.server, zone, ""], s.do_requests.get(zone, 0))
            ragg: dict[tuple[str, str, str], int] = {}
            for (zone, rcode, plugin), n in list(s.responses.items()):
                k = (zone, RCODES.get(rcode, str(rcode)), plugin)
                ragg[k] = ragg.get(k, 0) + n
            for (zone, rcode, plugin), n in sorted(ragg.items()):
                responses.add_metric([s.server, zone, "", rcode, plugin], n)
            for (zone, qtype), counts in sorted(s.durations.items()):
                duration.add_metric([s.server, zone, "", _type_name(qtype)], _cumulative(counts, DURATION_BUCKETS),
                                    s.duration_sum.get((zone, qtype), 0.0))
            for family, table in ((req_size, s.request_sizes), (resp_size, s.response_sizes)):
                by: dict[tuple[str, bool], dict[int, int]] = {}
                for (zone, tcp, size), n in list(table.items()):
                    by.setdefault((zone, tcp), {})[size] = n
                for (zone, tcp), sizes in sorted(by.items()):
                    counts, total = _size_histogram(sizes)
                    family.add_metric([s.server, zone, "", "tcp" if tcp else "udp"],
                                      _cumulative(counts, SIZE_BUCKETS), total)
            for zone, name in s.plugins:
                enabled.add_metric([s.server, zone, "", name], 1)
        yield from (requests, do_requests, responses, duration, req_size, resp_size, enabled)

        panics = CounterMetricFamily("coredns_panics", "A metrics that counts the number of panics.")
        panics.add_metric([], _panics[0])
        yield panics
        build = GaugeMetricFamily("coredns_build_info", "A metric with a constant '1' value labeled by version, revision, and goversion from which CoreDNS was built.",
                                  labels=["version", "revision", "goversion"])
        from ..version import build_info, python_version  # at the scrape: it may ask git once
        b = build_info()   # CoreDNS's revision is the short commit id, goversion runtime.Version()
        build.add_metric([b.version, b.short_revision, python_version()], 1)
        yield build

        # A stopped server's counters stay exported, but the cache belongs to the one serving now.
        serving = [s for s in servers if getattr(s, "receivers", None)] or servers
        yield from self._cache(serving[0].server if serving else "dns://")
        yield from self._forward()

    @staticmethod
    def _cache(server: str):
        """The cache's counters with CoreDNS's labels. One cache serves every listener of the
        DNS server, so its series carry the first serving listener's `server` label. The
        Corefile caches' series (their own server/zones labels) join the same families."""
        extra = {"server": server, "zones": ZONE, "view": ""}
        corefile: dict[str, dict[tuple, float]] = {}
        for c in list(_corefile_caches):
            for name, labels, value in c.metric_samples():
                k = tuple(sorted(labels.items()))
                table = corefile.setdefault(name, {})
                table[k] = table.get(k, 0.0) + value   # two blocks with the same labels: one series
        for metric in (cache_requests, cache_hits, cache_misses, cache_served_stale, cache_evictions):
            for family in metric.collect():
                table = corefile.pop(family.name, {})
                for s in family.samples:
                    if s.name.endswith("_total"):
                        k = tuple(sorted({**extra, **s.labels}.items()))
                        table[k] = table.get(k, 0.0) + s.value   # one series per label set
                out = CounterMetricFamily(family.name, family.documentation, labels=None)
                for labels, value in table.items():
                    out.add_sample(family.name + "_total", dict(labels), value)
                yield out
        for name, doc in (("coredns_cache_prefetch", "The number of times the cache has prefetched a cached item."),
                          ("coredns_cache_drops", "The number responses that are not cached, because the reply is malformed.")):
            if name in corefile:
                out = CounterMetricFamily(name, doc, labels=None)
                for labels, value in corefile.pop(name).items():
                    out.add_sample(name + "_total", dict(labels), value)
                yield out
        entries = GaugeMetricFamily("coredns_cache_entries", "The number of elements in the cache.", labels=None)
        pos = neg = 0
        for c in list(_caches):
            p, n = c.counts()
            pos, neg = pos + p, neg + n
        table = corefile.pop("coredns_cache_entries", {})
        for kind, n in (("success", pos), ("denial", neg)):
            k = tuple(sorted({**extra, "type": kind}.items()))
            table[k] = table.get(k, 0.0) + n
        for labels, value in table.items():
            entries.add_sample("coredns_cache_entries", dict(labels), value)
        yield entries

    @staticmethod
    def _forward():
        # CoreDNS >= 1.11 names these coredns_proxy_*{proxy_name}; the mixins' alerts read the
        # forward_* names of earlier releases. Both are exported, from one observation.
        for family in proxy_duration.collect():
            yield _relabel(family, "coredns_forward_request_duration_seconds", "proxy_name",
                           "Histogram of the time each request took.")
        for family in healthcheck_failures.collect():
            yield _relabel(family, "coredns_forward_healthcheck_failures", "proxy_name",
                           "Counter of the number of failed healthchecks.")


REGISTRY.register(DnsCollector())

# Off the hot path: the cache and the forwarder. The cache's counters are exported by
# DnsCollector with the server/zones/view labels (registry=None here).
cache_requests = Counter("coredns_cache_requests", "The count of cache requests.", registry=None)
cache_hits = Counter("coredns_cache_hits", "The count of cache hits.", ["type"], registry=None)
cache_misses = Counter("coredns_cache_misses", "The count of cache misses.", registry=None)
cache_served_stale = Counter("coredns_cache_served_stale", "The number of requests served from stale cache entries.",
                             registry=None)
cache_evictions = Counter("coredns_cache_evictions", "The count of cache evictions.", ["type"], registry=None)

forward_requests = Counter("coredns_forward_requests", "Counter of requests made per upstream.", ["to"],
                           registry=REGISTRY)
forward_responses = Counter("coredns_forward_responses", "Counter of responses received per upstream.",
                            ["to", "rcode"], registry=REGISTRY)
proxy_duration = Histogram("coredns_proxy_request_duration_seconds", "Histogram of the time each request took.",
                           ["proxy_name", "to", "rcode"], buckets=DURATION_BUCKETS, registry=REGISTRY)
healthcheck_failures = Counter("coredns_proxy_healthcheck_failures", "Counter of the number of failed healthchecks.",
                               ["proxy_name", "to"], registry=REGISTRY)
healthcheck_broken = Counter("coredns_forward_healthcheck_broken",
                             "Counter of the number of complete failures of the healthchecks.", registry=REGISTRY)
forward_loops = Counter("clusterdns_forward_loop_detected", "Upstreams disabled because queries to them came back to us.",
                        ["to"], registry=REGISTRY)
forward_rejects = Counter("coredns_forward_max_concurrent_rejects",
                          "Counter of the number of queries rejected because the concurrent queries were at maximum.",
                          registry=REGISTRY)

# The Corefile's reload plugin (CoreDNS's names).
reload_failed = Counter("coredns_reload_failed", "Counter of the number of failed reload attempts.", registry=REGISTRY)
