"""Prometheus registries, one per listener, so each series is served in one place only.

- DNS: `coredns_*` (the DNS server, cache, forwarder, DNS programming, NodeLocal
  setup errors: the last defined here, see below), served on --metrics-listen (CoreDNS's :9153).
- PROXY: `kubeproxy_*`, served on --proxy-metrics-listen (kube-proxy's :10249).
- SHARED: the API client (`rest_client_*`, client-go's names) and clusterdns's
  own series (`clusterdns_*`: sources, state, reloads). Served on the proxy
  listener when the process has one (kube-proxy's dashboards read
  rest_client_* there), else on the DNS listener.
DNS and PROXY each carry a process collector (`process_*`), as every Go
component's registry does, so each scrape job sees CPU and memory.

`REGISTRY` is every series of the process at once (what tests read); a metric
registered on it lands in SHARED.
"""
from __future__ import annotations

import time
from typing import Iterable, Iterator
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.registry import Collector

DNS = CollectorRegistry(auto_describe=True)
PROXY = CollectorRegistry(auto_describe=True)
SHARED = CollectorRegistry(auto_describe=True)
ProcessCollector(registry=DNS)
ProcessCollector(registry=PROXY)


class UnionRegistry(CollectorRegistry):
    """Reads several registries as one (a family present in two is yielded once);
    register() adds to the first."""

    def __init__(self, parts: Iterable[CollectorRegistry]) -> None:
        super().__init__(auto_describe=True)
        self.parts = tuple(parts)

    def register(self, collector: Collector) -> None:
        self.parts[0].register(collector)

    def unregister(self, collector: Collector) -> None:
        self.parts[0].unregister(collector)

    def collect(self) -> Iterator:
        seen: set[str] = set()
        for part in self.parts:
            for family in part.collect():
                if family.name not in seen:
                    seen.add(family.name)
                    yield family


REGISTRY = UnionRegistry((SHARED, DNS, PROXY))

invalid_objects = Counter(
    "clusterdns_invalid_objects_total",
    "Objects skipped because they failed validation.",
    ["kind"], registry=SHARED)

source_errors = Counter(
    "clusterdns_source_errors_total",
    "Failed loads of a state source (unreadable manifest, failed list/watch).",
    ["source"], registry=SHARED)

state_version = Gauge(
    "clusterdns_state_version",
    "Version number of the published cluster state.", registry=SHARED)

# NodeLocal DNSCache's setup errors, a coredns_* series on the DNS listener. Here, not in
# clusterdns.dns, because localdns.py counts them and the proxier (proxy --cleanup) imports
# localdns: the proxy half must not import the DNS half. Every type starts at 0, as node-cache's.
SETUP_ERROR_TYPES = ("interface_add", "interface_check", "iptables", "iptables_lock", "configmap")
nodecache_setup_errors = Counter("coredns_nodecache_setup_errors",
                                 "The number of errors during periodic network setup for node-cache",
                                 ["errortype"], registry=DNS)
for _t in SETUP_ERROR_TYPES:
    nodecache_setup_errors.labels(_t)

# ------------------------------------------------------------------ the API client (client-go's names)
# client-go's buckets and labels; `code` is "<error>" when no response came.
REST_BUCKETS = (0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0)
rest_requests = Counter(
    "rest_client_requests_total",
    "Number of HTTP requests, partitioned by status code, method, and host.",
    ["code", "method", "host"], registry=SHARED)
rest_duration = Histogram(
    "rest_client_request_duration_seconds",
    "Request latency in seconds. Broken down by verb, and host.",
    ["verb", "host"], buckets=REST_BUCKETS, registry=SHARED)


def api_request(method: str, url: str, started: float, status: int | None) -> None:
    """One request to the Kubernetes API: `status` None when it failed without a response.

    Called by the Kubernetes source's HTTP layer once the response headers are in
    (for a watch: when the stream starts), as client-go measures."""
    host = urlsplit(url).netloc
    rest_requests.labels("<error>" if status is None else str(status), method, host).inc()
    rest_duration.labels(method, host).observe(max(0.0, time.monotonic() - started))
