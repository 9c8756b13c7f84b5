"""The process-wide Prometheus registry and the metrics shared across components.

Component metrics (DNS, proxier) live with their components but register here,
so one /metrics endpoint exports everything.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

REGISTRY = CollectorRegistry(auto_describe=True)

invalid_objects = Counter(
    "clusterdns_invalid_objects_total",
    "Objects skipped because they failed validation.",
    ["kind"], registry=REGISTRY)

source_errors = Counter(
    "clusterdns_source_errors_total",
    "Failed loads of a state source (unreadable manifest, failed list/watch).",
    ["source"], registry=REGISTRY)

state_version = Gauge(
    "clusterdns_state_version",
    "Version number of the published cluster state.", registry=REGISTRY)
