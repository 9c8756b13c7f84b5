"""The zone view: incremental compiles equal fresh ones; the reverse index; exposure rules."""
from __future__ import annotations

import random
from dataclasses import replace

import pytest

from clusterdns.config import Config
from clusterdns.dns.zone import ZoneView
from clusterdns.model import Endpoint, EndpointSlice, Namespace, Service, ServicePort
from clusterdns.sources.manifest import publish
from clusterdns.state import StateStore
from clusterdns.synthetic import synthetic_records


def snapshot(view: ZoneView):
    """Everything a view derived from its state, in comparable form."""
    services = {k: (sd.kind, sd.ips4, sd.ips6, sd.ready) for k, sd in view.services.items()}
    by_service = {k: tuple(s.key for s in v) for k, v in view.by_service.items()}
    cips = {ip: sorted((sd.svc.key, n or "") for sd, n in lst) for ip, lst in view.cips.items()}
    eps = {ip: sorted((sd.svc.key, n or "") for sd, n in view.endpoints_at(ip)) for ip in view.eps}
    names = {k: {n: (sd.endpoint_entries(n), sd.endpoint_ips(n)) for n, _, _ in sd.ready}
             for k, sd in view.services.items() if sd.kind == "headless"}
    return services, by_service, cips, eps, names


def mutate(store: StateStore, rng: random.Random) -> None:
    st = store.current
    op = rng.randrange(6)
    if op == 0 and st.slices:
        key = rng.choice(sorted(st.slices))
        sl = st.slices[key]
        eps = list(sl.endpoints)
        if eps:
            i = rng.randrange(len(eps))
            eps[i] = replace(eps[i], ready=not eps[i].ready)
        eps.append(Endpoint((f"10.250.{rng.randrange(256)}.{rng.randrange(256)}",), hostname=f"h{rng.randrange(9)}"))
        store.upsert("EndpointSlice", replace(sl, endpoints=tuple(eps)))
    elif op == 1 and st.slices:
        store.delete("EndpointSlice", rng.choice(sorted(st.slices)))
    elif op == 2 and st.services:
        key = rng.choice(sorted(st.services))
        svc = st.services[key]
        if svc.cluster_ips:
            store.upsert("Service", replace(svc, cluster_ips=(f"10.99.{rng.randrange(256)}.{rng.randrange(256)}",)))
    elif op == 3 and st.services:
        store.delete("Service", rng.choice(sorted(st.services)))
    elif op == 4:
        ns = f"ns-{rng.randrange(4)}"
        name = f"new-{rng.randrange(1000)}"
        store.upsert("Service", Service(ns, name, cluster_ips=(f"10.98.{rng.randrange(256)}.1",),
                                        ports=(ServicePort("http", "TCP", 80),)))
        store.upsert("EndpointSlice", EndpointSlice(ns, f"{name}-x", name, endpoints=(
            Endpoint(("10.97.0.1",)), Endpoint(("10.97.0.2",), ready=False))))
    else:
        # a second slice for an existing service (slices merge)
        key = rng.choice(sorted(st.services))
        store.upsert("EndpointSlice", EndpointSlice(key[0], f"{key[1]}-extra{rng.randrange(3)}", key[1],
                                                    endpoints=(Endpoint((f"10.96.200.{rng.randrange(256)}",)),)))


def replace_in_big(store: StateStore, rng: random.Random) -> None:
    """A Pod of the big Services recreated: one address changes in one of their slices."""
    st = store.current
    key = rng.choice(sorted(k for k in st.slices if k[1].startswith("big-")))
    sl = st.slices[key]
    i = rng.randrange(len(sl.endpoints))
    eps = list(sl.endpoints)
    eps[i] = replace(eps[i], addresses=(f"10.251.{rng.randrange(256)}.{rng.randrange(256)}",),
                     ready=rng.random() < 0.9)
    store.upsert("EndpointSlice", replace(sl, endpoints=tuple(eps)))


@pytest.mark.parametrize("seed", range(4))
def test_incremental_compile_equals_fresh(seed):
    """Views made from the previous one (comparing every Service, or told which changed, as
    the server does from the store's deltas) equal a view compiled afresh, after every change."""
    from clusterdns.synthetic import envelope_records
    rng = random.Random(seed)
    store = StateStore()
    publish(store, synthetic_records(60, 3, namespaces=4, headless_every=5)
            + [r for r in envelope_records(services=2, endpoints=2 * 450, big=450, headless=1) if r[0] != "Node"])
    deltas = []
    store.subscribe(lambda old, new, delta: deltas.append((old, new, delta)))
    cfg = Config()
    view = told = ZoneView(cfg, store.current)
    for _ in range(40):
        deltas.clear()
        (mutate if rng.random() < 0.6 else replace_in_big)(store, rng)
        view = ZoneView(cfg, store.current, view)
        for old, new, delta in deltas:
            assert told.state is old
            told = ZoneView(cfg, new, told, changed=None if delta.full else delta.services)
        assert told.state is store.current
        fresh = snapshot(ZoneView(cfg, store.current))
        assert snapshot(view) == fresh
        assert snapshot(told) == fresh


def test_unchanged_services_are_reused():
    store = StateStore()
    publish(store, synthetic_records(50, 2))
    cfg = Config()
    v1 = ZoneView(cfg, store.current)
    sl = store.current.slices[("ns-3", "svc-3-abcde")]
    store.upsert("EndpointSlice", replace(sl, endpoints=sl.endpoints[:1]))
    v2 = ZoneView(cfg, store.current, v1)
    changed = [k for k in v2.services if v2.services[k] is not v1.services[k]]
    assert changed == [("ns-3", "svc-3")]
    assert v2.services[("ns-3", "svc-3")].ready != v1.services[("ns-3", "svc-3")].ready


def test_a_different_config_compiles_afresh():
    store = StateStore()
    publish(store, synthetic_records(5, 2))
    v1 = ZoneView(Config(), store.current)
    v2 = ZoneView(Config().with_options(endpoint_pod_names=True), store.current, v1)
    names1 = {n for sd in v1.services.values() for n, _, _ in sd.ready}
    names2 = {n for sd in v2.services.values() for n, _, _ in sd.ready}
    assert all(n.startswith("10-") for n in names1)
    assert all(n.startswith("svc-") for n in names2)


def test_exposure():
    store = StateStore()
    publish(store, [
        ("Namespace", Namespace("a", (("team", "x"),))),
        ("Namespace", Namespace("b")),
        ("Service", Service("a", "s", cluster_ips=("10.0.0.1",))),
        ("Service", Service("c", "s", cluster_ips=("10.0.0.3",))),   # no Namespace object
    ])
    view = ZoneView(Config(), store.current)
    assert view.exposed("a") and view.exposed("b") and view.exposed("c") and not view.exposed("d")
    view = ZoneView(Config().with_options(namespaces=("a",)), store.current)
    assert view.exposed("a") and not view.exposed("b") and not view.exposed("c")
    from clusterdns.dns.names import parse_selector
    view = ZoneView(Config().with_options(namespace_labels="team=x"), store.current, selector=parse_selector("team=x"))
    assert view.exposed("a") and not view.exposed("b") and not view.exposed("c")
    assert view.reverse("10.0.0.1") and not view.reverse("10.0.0.3")


def test_one_slice_change_recompiles_only_its_service():
    """An update after one EndpointSlice changed compiles that Service again and reuses every
    other Service's compiled data (bench/dns/zone_update.py times it at 10,000 Services)."""
    cfg = Config()
    store = StateStore()
    publish(store, synthetic_records(200, 10))
    before = ZoneView(cfg, store.current)
    sl = store.current.slices[("ns-5", "svc-5-abcde")]
    store.upsert("EndpointSlice", replace(sl, endpoints=sl.endpoints[:5]))
    after = ZoneView(cfg, store.current, before)
    assert after.services.keys() == before.services.keys() and len(before.services) == 200
    recompiled = {k for k in before.services if after.services[k] is not before.services[k]}
    assert recompiled == {sl.service_key}
    assert snapshot(after) == snapshot(ZoneView(cfg, store.current))


@pytest.mark.parametrize("qname,qtype", [
    ("hl.ns.svc.cluster.local", "A"), ("hl.ns.svc.cluster.local", "AAAA"), ("hl.ns.svc.cluster.local", "SRV"),
    ("_http._tcp.hl.ns.svc.cluster.local", "SRV"), ("_http._tcp.hl.ns.svc.cluster.local", "A"),
    ("_dns._udp.hl.ns.svc.cluster.local", "SRV"), ("_nope._tcp.hl.ns.svc.cluster.local", "SRV"),
    ("ep-7.hl.ns.svc.cluster.local", "SRV"), ("ports.ns.svc.cluster.local", "SRV"),
    ("_p3._tcp.ports.ns.svc.cluster.local", "SRV")])
def test_big_services_answer_what_small_ones_do(monkeypatch, qname, qtype):
    """A big Service's records are made lazily; packed, they are the records the eager
    path makes (same order, weights, glue), for every kind of name."""
    from dnslib import QTYPE

    from clusterdns.dns import names, zone
    from clusterdns.dns.wire import pack_body
    from clusterdns.model import EndpointPort
    eps = tuple(Endpoint((f"10.7.{i // 200}.{i % 200 + 1}",), hostname=f"ep-{i}" if i % 3 else "")
                for i in range(250))
    records = [
        ("Namespace", Namespace("ns")),
        ("Service", Service("ns", "hl", headless=True)),
        ("EndpointSlice", EndpointSlice("ns", "hl-1", "hl", endpoints=eps[:200], ports=(
            EndpointPort("http", "TCP", 8080), EndpointPort("dns", "UDP", 53)))),
        ("EndpointSlice", EndpointSlice("ns", "hl-2", "hl", endpoints=eps[150:])),        # no ports, overlaps
        ("Service", Service("ns", "ports", cluster_ips=("10.0.0.9", "fd00::9"),
                            ports=tuple(ServicePort(f"p{i}", "TCP", 1000 + i) for i in range(300)))),
    ]
    store = StateStore()
    publish(store, records)
    labels = names.split_name(qname)
    raw = tuple(x.encode() for x in labels)
    out = []
    lazy_above = zone.BIG
    for big in (lazy_above, 10_000):
        monkeypatch.setattr(zone, "BIG", big)
        view = ZoneView(Config(), store.current)
        assert view.services[("ns", "hl")].big == (big == lazy_above)
        ans = view.lookup(labels, getattr(QTYPE, qtype))
        body = pack_body(raw, ans.answer, ans.authority, ans.additional, zone_len=2)
        out.append((ans.rcode, body.data, body.an, body.ns, body.ar))
    assert out[0] == out[1]


def test_endpoint_names_by_address_whether_or_not_entries_were_made():
    """PTR owners of endpoint addresses: read from the slices before a Service's entries are
    made, from its entries (an index when big) after; the same names, every name once."""
    from clusterdns.dns.zone import BIG
    hosts = [Endpoint(("10.5.0.1",), hostname="a"), Endpoint(("10.5.0.1",), hostname="b"),
             Endpoint(("10.5.0.1",), hostname="a"), Endpoint(("10.5.0.2",)), Endpoint(("10.5.0.3",), ready=False)]
    many = tuple(Endpoint((f"10.6.{i // 250}.{i % 250 + 1}",)) for i in range(BIG + 50))
    records = [("Namespace", Namespace("ns"))]
    for name, eps in (("small", hosts), ("big", tuple(hosts) + many)):
        records += [("Service", Service("ns", name, cluster_ips=(f"10.96.0.{len(records)}",))),
                    ("EndpointSlice", EndpointSlice("ns", f"{name}-1", name, endpoints=tuple(eps)))]
    store = StateStore()
    publish(store, records)
    lazy, made = ZoneView(Config(), store.current), ZoneView(Config(), store.current)
    for sd in made.services.values():
        assert sd.ready                                      # entries made first
    assert all(sd._ready is None for sd in lazy.services.values())
    ips = ["10.5.0.1", "10.5.0.2", "10.5.0.3", "10.6.0.1", "10.6.0.250", "10.9.9.9"]
    got = {ip: sorted((sd.svc.name, n) for sd, n in lazy.endpoints_at(ip)) for ip in ips}
    assert got == {ip: sorted((sd.svc.name, n) for sd, n in made.endpoints_at(ip)) for ip in ips}
    assert got["10.5.0.1"] == [("big", "a"), ("big", "b"), ("small", "a"), ("small", "b")]
    assert got["10.5.0.2"] == [("big", "10-5-0-2"), ("small", "10-5-0-2")]
    assert got["10.6.0.250"] == [("big", "10-6-0-250")] and got["10.5.0.3"] == got["10.9.9.9"] == []
    assert lazy.services[("ns", "small")]._ready is None     # a small Service's were never made
