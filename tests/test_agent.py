"""The agent: the DNS view's ordering against the proxier, and the running agent."""
import time

from clusterdns.agent import DNS_PROGRAMMING, DnsView, needs_rules
from clusterdns.metrics import REGISTRY
from clusterdns.model import (
    EXTERNAL_NAME, Endpoint, EndpointPort, EndpointSlice, Namespace, Service, ServicePort,
)
from clusterdns.state import StateStore

PORT = ServicePort("http", "TCP", 8080, target_port=8080)


def svc(name, ip="10.96.0.5", **kw):
    kw.setdefault("ports", (PORT,))
    return Service("ns", name, cluster_ips=(ip,) if ip else (), **kw)


def eps(name, *ips, trigger=None, ready=True):
    return EndpointSlice("ns", f"{name}-abc", name, "IPv4",
                         tuple(Endpoint((ip,), ready=ready) for ip in ips),
                         (EndpointPort("http", "TCP", 8080),), trigger)


def view_ips(view, name):
    s = view.current.services.get(("ns", name))
    return s.cluster_ips if s else None


def view_eps(view, name):
    return sorted(a for sl in view.current.slices_for("ns", name) for e in sl.endpoints if e.ready
                  for a in e.addresses)


def test_needs_rules():
    assert needs_rules(svc("a"))
    assert not needs_rules(svc("h", ip=None, headless=True))
    assert not needs_rules(Service("ns", "x", EXTERNAL_NAME, external_name="db.example.com"))
    assert not needs_rules(svc("noports", ports=()))
    assert not needs_rules(svc("other", proxy_name="someone-else"))


def test_new_service_waits_for_rules_then_appears():
    store = StateStore()
    view = DnsView(store)
    seen = []
    view.subscribe(lambda old, new, delta: seen.append(delta.services))
    store.upsert("Namespace", Namespace("ns"))
    store.upsert("Service", svc("a"))
    store.upsert("EndpointSlice", eps("a", "10.0.0.1"))
    assert view_ips(view, "a") is None          # no rules yet: not in DNS
    assert view.current.namespaces == store.current.namespaces   # other kinds follow at once
    view.applied(store.current.version - 1)     # an older sync (service, no slice yet)
    assert view_ips(view, "a") == ("10.96.0.5",)
    assert view_eps(view, "a") == []             # its endpoint is not routed yet
    view.applied(store.current.version)
    assert view_eps(view, "a") == ["10.0.0.1"]
    assert any(("ns", "a") in d for d in seen)


def test_delete_and_endpoint_removal_leave_dns_first():
    store = StateStore()
    view = DnsView(store)
    with store.batch():
        store.upsert("Service", svc("a"))
        store.upsert("EndpointSlice", eps("a", "10.0.0.1", "10.0.0.2"))
        store.upsert("Service", svc("b", "10.96.0.6"))
    view.applied(store.current.version)
    store.upsert("EndpointSlice", eps("a", "10.0.0.2"))          # 10.0.0.1 went away
    assert view_eps(view, "a") == ["10.0.0.2"]                    # before any sync
    store.upsert("EndpointSlice", eps("a", "10.0.0.2", "10.0.0.3"))
    assert view_eps(view, "a") == ["10.0.0.2"]                    # a new one waits for rules
    store.delete("Service", ("ns", "b"))
    assert view_ips(view, "b") is None                           # deleted: gone from DNS at once
    view.applied(store.current.version)
    assert view_eps(view, "a") == ["10.0.0.2", "10.0.0.3"]


def test_clusterip_change_keeps_old_address_until_synced():
    store = StateStore()
    view = DnsView(store)
    store.upsert("Service", svc("a", "10.96.0.5"))
    view.applied(store.current.version)
    store.upsert("Service", svc("a", "10.96.0.9"))
    assert view_ips(view, "a") == ("10.96.0.5",)   # the old address still has its rules
    view.applied(store.current.version)
    assert view_ips(view, "a") == ("10.96.0.9",)


def test_services_without_rules_follow_the_store():
    store = StateStore()
    view = DnsView(store)
    store.upsert("Service", svc("h", ip=None, headless=True))
    store.upsert("EndpointSlice", eps("h", "10.0.0.7"))
    store.upsert("Service", Service("ns", "ext", EXTERNAL_NAME, external_name="db.example.com"))
    assert view_eps(view, "h") == ["10.0.0.7"]
    assert ("ns", "ext") in view.current.services
    # a Service turning into an ExternalName leaves its ClusterIP in DNS at once
    store.upsert("Service", svc("a"))
    view.applied(store.current.version)
    store.upsert("Service", Service("ns", "a", EXTERNAL_NAME, external_name="x.example.com"))
    assert view.current.services[("ns", "a")].is_external_name


def test_full_replace_and_unknown_applied_version():
    store = StateStore()
    view = DnsView(store)
    store.replace("Service", [svc("a"), svc("b", "10.96.0.6")])
    view.applied(store.current.version)
    assert set(view.current.services) == {("ns", "a"), ("ns", "b")}
    store.replace("Service", [svc("b", "10.96.0.6"), svc("c", "10.96.0.7")])
    assert set(view.current.services) == {("ns", "b")}
    view.applied(store.current.version + 100)     # unknown: the newest known at or below is used
    assert set(view.current.services) == {("ns", "b"), ("ns", "c")}
    view.applied(1)                               # older than applied: ignored
    assert set(view.current.services) == {("ns", "b"), ("ns", "c")}


def test_view_states_are_immutable_snapshots():
    store = StateStore()
    view = DnsView(store)
    store.upsert("Service", svc("a"))
    view.applied(store.current.version)
    before = view.current
    store.delete("Service", ("ns", "a"))
    assert ("ns", "a") in before.services and ("ns", "a") not in view.current.services
    assert view.current.version > before.version


def _count(kind):
    return REGISTRY.get_sample_value("coredns_kubernetes_dns_programming_duration_seconds_count",
                                     {"service_kind": kind}) or 0


def test_dns_programming_duration_observed_when_served():
    store = StateStore()
    view = DnsView(store)
    store.upsert("Service", svc("a"))
    view.applied(store.current.version)
    before = _count("cluster_ip")
    store.upsert("EndpointSlice", eps("a", "10.0.0.1", trigger=time.time() - 0.5))
    assert _count("cluster_ip") == before          # added endpoint not served yet
    view.applied(store.current.version)
    assert _count("cluster_ip") == before + 1
    h_before = _count("headless_with_selector")
    store.upsert("Service", svc("h", ip=None, headless=True))
    store.upsert("EndpointSlice", eps("h", "10.0.0.9", trigger=time.time()))
    assert _count("headless_with_selector") == h_before + 1
    assert DNS_PROGRAMMING is not None
