"""DNS metrics under CoreDNS's names, so its dashboards and alerts apply.

Per-query counting is on the hot path, so the server keeps plain dicts and
integers in a ServerStats per listener, and a custom collector turns them into
metric families only when /metrics is scraped. The forwarder and the cache are
off the hot path and use ordinary prometheus-client metrics.
"""
from __future__ import annotations

import weakref
from time import perf_counter
from typing import Iterable

import dnslib
from prometheus_client import Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from .. import __version__ as VERSION
from ..metrics import DNS as REGISTRY  # CoreDNS's series: served on --metrics-listen

# CoreDNS: prometheus.ExponentialBuckets(0.00025, 2, 16) for request durations.
DURATION_BUCKETS = tuple(0.00025 * 2 ** i for i in range(16))
SIZE_BUCKETS = (0, 100, 200, 300, 400, 511, 1023, 2047, 4095, 8291, 16e3, 32e3, 48e3, 64e3)
# Types CoreDNS labels by name; everything else is "other" (bounded cardinality).
MONITORED_TYPES = {int(getattr(dnslib.QTYPE, t)): t for t in (
    "A", "AAAA", "NS", "PTR", "SOA", "MX", "TXT", "SRV", "CNAME", "NAPTR", "DS", "DNSKEY",
    "HTTPS", "SVCB", "CAA", "HINFO", "ANY", "AXFR", "IXFR")}
RCODES = {0: "NOERROR", 1: "FORMERR", 2: "SERVFAIL", 3: "NXDOMAIN", 4: "NOTIMP", 5: "REFUSED",
          6: "YXDOMAIN", 7: "YXRRSET", 8: "NXRRSET", 9: "NOTAUTH", 10: "NOTZONE"}
RAW_LIMIT = 4096  # distinct per-query keys kept before folding
SAMPLE = 32       # one UDP fast-path answer in SAMPLE is timed
ZONE = "."   # the one server block: every query enters the "." chain


class ServerStats:
    """Counters of one listener (`server` label `dns://HOST:PORT`), updated per query.

    Per query the hot path does one dict update keyed on bytes read straight
    from the two packets (see `count`); the scrape folds those into the
    exported families. Durations: every TCP query and every query answered
    through resolve() is timed; of the UDP fast-path answers (a synchronous
    call of a few microseconds) one in SAMPLE is timed and weighted SAMPLE,
    so the histogram's count and sum are estimates for that part.
    """

    __slots__ = ("server", "family", "udp", "tcp", "durations", "duration_sum", "requests", "responses",
                 "request_sizes", "response_sizes", "__weakref__")

    def __init__(self, server: str, family: int) -> None:
        self.server, self.family = server, family
        # (qtype high byte, low byte, reply flags byte 2, byte 3, request size, reply size) -> n;
        # the flag bytes are -1 for a dropped query. Cleared in place by fold().
        self.udp: dict[tuple[int, int, int, int, int, int], int] = {}
        self.tcp: dict[tuple[int, int, int, int, int, int], int] = {}
        self.durations: dict[int, list[float]] = {}       # qtype -> weighted counts per bucket (+Inf last)
        self.duration_sum: dict[int, float] = {}
        # folded totals
        self.requests: dict[tuple[bool, int], int] = {}       # (tcp, qtype) -> n
        self.responses: dict[tuple[int, bool], int] = {}      # (rcode, AA) -> n
        self.request_sizes: dict[tuple[bool, int], int] = {}
        self.response_sizes: dict[tuple[bool, int], int] = {}

    def count(self, table: dict, data: bytes, reply: bytes | None) -> None:
        """Count one query without timing it (the server inlines the same steps on its UDP fast path)."""
        i = data.find(0, 12)
        try:
            if reply is not None and len(reply) > 3:
                key = (data[i + 1], data[i + 2], reply[2], reply[3], len(data), len(reply))
            else:
                key = (data[i + 1], data[i + 2], -1, -1, len(data), 0)
        except IndexError:
            key = (255, 255, -1, -1, len(data), 0) if reply is None else (255, 255, reply[2], reply[3], len(data), len(reply))
        n = table.get(key)
        if n is None:
            self.new_key(table, key)
        else:
            table[key] = n + 1

    def new_key(self, table: dict, key: tuple) -> None:
        # Fold now and then so odd traffic (random types and sizes) cannot grow
        # the table between scrapes, or when nobody scrapes.
        if len(table) >= RAW_LIMIT:
            self.fold()
        table[key] = table.get(key, 0) + 1

    def record(self, data: bytes, reply: bytes | None, tcp: bool, started: float, weight: int = 1) -> None:
        """Count one query and its reply (None: dropped), timed from `started`."""
        elapsed = perf_counter() - started
        self.count(self.tcp if tcp else self.udp, data, reply)
        i = data.find(0, 12)
        qtype = data[i + 1] << 8 | data[i + 2] if 0 < i < len(data) - 2 else -1
        self.observe(qtype, elapsed, weight)

    def observe(self, qtype: int, elapsed: float, weight: int = 1) -> None:
        qtype = qtype if qtype in MONITORED_TYPES else -1
        counts = self.durations.get(qtype)
        if counts is None:
            counts = self.durations[qtype] = [0.0] * (len(DURATION_BUCKETS) + 1)
        self.duration_sum[qtype] = self.duration_sum.get(qtype, 0.0) + elapsed * weight
        for n, bound in enumerate(DURATION_BUCKETS):
            if elapsed <= bound:
                counts[n] += weight
                return
        counts[-1] += weight

    def fold(self) -> None:
        """Move the raw per-query counts into the totals (at scrape, or when a table is full)."""
        for tcp, table in ((False, self.udp), (True, self.tcp)):
            raw = dict(table)
            table.clear()           # in place: the server holds a reference to the table
            for (hi, lo, f2, f3, qsize, rsize), n in raw.items():
                qtype = hi << 8 | lo
                qtype = qtype if qtype in MONITORED_TYPES else -1     # "other": bounded totals
                k = (tcp, qtype)
                self.requests[k] = self.requests.get(k, 0) + n
                k = (tcp, qsize)
                self.request_sizes[k] = self.request_sizes.get(k, 0) + n
                if f2 >= 0:
                    k = (f3 & 15, bool(f2 & 4))
                    self.responses[k] = self.responses.get(k, 0) + n
                    k = (tcp, rsize)
                    self.response_sizes[k] = self.response_sizes.get(k, 0) + n


_servers: "weakref.WeakSet[ServerStats]" = weakref.WeakSet()
_caches: "weakref.WeakSet" = weakref.WeakSet()
_panics = [0]


def register_server(stats: ServerStats) -> None:
    _servers.add(stats)


def register_cache(cache) -> None:
    _caches.add(cache)


def panic() -> None:
    """A query handler raised: counted as CoreDNS counts recovered panics."""
    _panics[0] += 1


def _type_name(qtype: int) -> str:
    return MONITORED_TYPES.get(qtype, "other")


def _cumulative(counts: list[float], buckets: Iterable[float]) -> list[tuple[str, float]]:
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


class DnsCollector:
    """Exports every live ServerStats and cache at scrape time."""

    def describe(self):
        return []

    def collect(self):
        requests = CounterMetricFamily("coredns_dns_requests", "Counter of DNS requests made per zone, protocol and family.",
                                       labels=["server", "zone", "view", "proto", "family", "type"])
        responses = CounterMetricFamily("coredns_dns_responses", "Counter of response status codes.",
                                        labels=["server", "zone", "view", "rcode", "plugin"])
        duration = HistogramMetricFamily("coredns_dns_request_duration_seconds",
                                         "Histogram of the time (in seconds) each request took per zone.",
                                         labels=["server", "zone", "view", "type"])
        req_size = HistogramMetricFamily("coredns_dns_request_size_bytes", "Size of the EDNS0 UDP buffer in bytes (64K for TCP) per zone and protocol.",
                                         labels=["server", "zone", "view", "proto"])
        resp_size = HistogramMetricFamily("coredns_dns_response_size_bytes", "Size of the returned response in bytes.",
                                          labels=["server", "zone", "view", "proto"])
        for s in list(_servers):
            s.fold()
            agg: dict[tuple[str, str], int] = {}
            for (tcp, qtype), n in list(s.requests.items()):
                k = ("tcp" if tcp else "udp", _type_name(qtype))
                agg[k] = agg.get(k, 0) + n
            for (proto, tname), n in sorted(agg.items()):
                requests.add_metric([s.server, ZONE, "", proto, str(s.family), tname], n)
            ragg: dict[tuple[str, str], int] = {}
            for (rcode, aa), n in list(s.responses.items()):
                # AA marks answers from the served zones; forwarded ones carry the upstream's flags.
                k = (RCODES.get(rcode, str(rcode)), "kubernetes" if aa else "forward")
                ragg[k] = ragg.get(k, 0) + n
            for (rcode, plugin), n in sorted(ragg.items()):
                responses.add_metric([s.server, ZONE, "", rcode, plugin], n)
            for qtype, counts in sorted(s.durations.items()):
                duration.add_metric([s.server, ZONE, "", _type_name(qtype)], _cumulative(counts, DURATION_BUCKETS),
                                    s.duration_sum.get(qtype, 0.0))
            for family, table in ((req_size, s.request_sizes), (resp_size, s.response_sizes)):
                for tcp in (False, True):
                    sizes = {size: n for (t, size), n in list(table.items()) if t == tcp}
                    if sizes:
                        counts, total = _size_histogram(sizes)
                        family.add_metric([s.server, ZONE, "", "tcp" if tcp else "udp"],
                                          _cumulative(counts, SIZE_BUCKETS), total)
        yield from (requests, responses, duration, req_size, resp_size)

        panics = CounterMetricFamily("coredns_panics", "A metrics that counts the number of panics.")
        panics.add_metric([], _panics[0])
        yield panics
        build = GaugeMetricFamily("coredns_build_info", "A metric with a constant '1' value labeled by version, revision, and goversion from which CoreDNS was built.",
                                  labels=["version", "revision", "goversion"])
        build.add_metric([VERSION, "clusterdns", "python"], 1)
        yield build

        entries = GaugeMetricFamily("coredns_cache_entries", "The number of elements in the cache.",
                                    labels=["server", "type", "zones", "view"])
        pos = neg = 0
        for c in list(_caches):
            p, n = c.counts()
            pos, neg = pos + p, neg + n
        entries.add_metric(["dns://", "success", ZONE, ""], pos)
        entries.add_metric(["dns://", "denial", ZONE, ""], neg)
        yield entries


REGISTRY.register(DnsCollector())

# Off the hot path: the cache and the forwarder.
cache_requests = Counter("coredns_cache_requests", "The count of cache requests.", registry=REGISTRY)
cache_hits = Counter("coredns_cache_hits", "The count of cache hits.", ["type"], registry=REGISTRY)
cache_misses = Counter("coredns_cache_misses", "The count of cache misses.", registry=REGISTRY)
cache_served_stale = Counter("coredns_cache_served_stale", "The number of requests served from stale cache entries.",
                             registry=REGISTRY)
cache_evictions = Counter("coredns_cache_evictions", "The count of cache evictions.", ["type"], registry=REGISTRY)

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
