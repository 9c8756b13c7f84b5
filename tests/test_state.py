from clusterdns.model import Endpoint, EndpointSlice, Service
from clusterdns.state import StateStore


def svc(name, ip="10.96.0.1"):
    return Service("ns", name, cluster_ips=(ip,))


def test_versions_are_immutable_and_deltas_name_services():
    store = StateStore()
    seen = []
    store.subscribe(lambda old, new, delta: seen.append((old, new, delta)))
    store.upsert("Service", svc("a"))
    v1 = store.current
    store.upsert("EndpointSlice", EndpointSlice("ns", "a-1", "a", endpoints=(Endpoint(("10.0.0.1",)),)))
    v2 = store.current
    assert v1.version + 1 == v2.version
    assert ("ns", "a-1") not in v1.slices          # the old version is untouched
    assert seen[-1][2].services == {("ns", "a")}
    assert v2.slices_for("ns", "a")[0].endpoints[0].addresses == ("10.0.0.1",)


def test_unchanged_upsert_publishes_nothing():
    store = StateStore()
    store.upsert("Service", svc("a"))
    version = store.current.version
    store.upsert("Service", svc("a"))
    assert store.current.version == version


def test_batch_publishes_once_and_replace_diffs():
    store = StateStore()
    deltas = []
    store.subscribe(lambda o, n, d: deltas.append(d))
    with store.batch():
        store.replace("Service", [svc("a"), svc("b", "10.96.0.2")])
        store.replace("EndpointSlice", [])
    assert len(deltas) == 1 and store.current.is_synced("Service", "EndpointSlice")
    store.replace("Service", [svc("a"), svc("c", "10.96.0.3")])
    assert deltas[-1].services == {("ns", "b"), ("ns", "c")}
    assert set(store.current.services) == {("ns", "a"), ("ns", "c")}


def test_failing_subscriber_does_not_stop_others():
    store = StateStore()
    got = []

    def bad(*_):
        raise RuntimeError("boom")
    store.subscribe(bad)
    store.subscribe(lambda o, n, d: got.append(n.version))
    store.upsert("Service", svc("a"))
    assert got == [store.current.version]


def test_unsubscribe_stops_calls():
    store = StateStore()
    got = []
    fn = lambda o, n, d: got.append(n.version)  # noqa: E731
    store.subscribe(fn)
    store.upsert("Service", svc("a"))
    store.unsubscribe(fn)
    store.unsubscribe(fn)   # twice is harmless
    store.upsert("Service", svc("b", "10.96.0.2"))
    assert got == [1]


def test_slice_index_kept_incrementally_equals_a_rebuild():
    import random

    from clusterdns.state import ClusterState
    rng = random.Random(7)
    store = StateStore()
    for step in range(300):
        svc_name = f"s{rng.randrange(8)}"
        name = f"{svc_name}-{rng.randrange(3)}"
        op = rng.random()
        if op < 0.5:
            eps = (Endpoint((f"10.0.{step % 250}.{rng.randrange(250)}",)),)
            store.upsert("EndpointSlice", EndpointSlice("ns", name, svc_name, endpoints=eps))
        elif op < 0.8:
            store.delete("EndpointSlice", ("ns", name))
        else:
            keep = [s for s in store.current.slices.values() if rng.random() < 0.7]
            store.replace("EndpointSlice", keep)
        cur = store.current
        rebuilt = ClusterState.slices_by_service.func(cur)   # the cached_property's own computation
        assert dict(cur.slices_by_service) == dict(rebuilt), step


def test_prepared_replace_equals_the_usual_replace():
    """prepare_replace_all (a worker thread's part) + commit gives the same version, delta and
    index as replace() of every kind in one batch, and is refused once the store moved on."""
    from clusterdns.state import StateStore
    from clusterdns.synthetic import synthetic_records

    def by_kind(records):
        out = {}
        for kind, rec in records:
            out.setdefault(kind, []).append(rec)
        return out

    first = synthetic_records(services=30, endpoints=3)
    second = synthetic_records(services=40, endpoints=2)[:-7] + [r for r in first if r[0] == "Node"]
    results = []
    for prepared in (False, True):
        store = StateStore(clock=lambda: 1000.0)
        seen = []
        store.subscribe(lambda old, new, delta: seen.append(delta))
        with store.batch():
            for kind, recs in by_kind(first).items():
                store.replace(kind, recs)
        if prepared:
            p = store.prepare_replace_all(by_kind(second))
            assert store.commit(p)
        else:
            with store.batch():
                for kind in ("Namespace", "Service", "EndpointSlice", "Pod", "Node"):
                    store.replace(kind, by_kind(second).get(kind, []))
        cur = store.current
        results.append((cur.version, dict(cur.services), dict(cur.slices), dict(cur.nodes),
                        dict(cur.slices_by_service), cur.synced, seen[-1]))
        # a commit prepared against an older state is refused
        stale = store.prepare_replace_all(by_kind(first))
        store.upsert(*first[-1])
        store.delete("EndpointSlice", (first[-1][1].namespace, first[-1][1].name))
        assert not store.commit(stale)
    assert results[0] == results[1]
    assert results[1][-1].services and results[1][-1].full


def test_a_reload_keeps_the_served_object_of_an_unchanged_record():
    store = StateStore()
    a, b = svc("a"), svc("b", "10.96.0.2")
    sl = EndpointSlice("ns", "a-1", "a", endpoints=(Endpoint(("10.0.0.1",)),))
    with store.batch():
        store.replace("Service", [a, b])
        store.replace("EndpointSlice", [sl])
    # a reload parses fresh copies: the equal ones are dropped for the served objects
    a2, b2, sl2 = svc("a"), svc("b", "10.96.0.9"), EndpointSlice("ns", "a-1", "a",
                                                                 endpoints=(Endpoint(("10.0.0.1",)),))
    assert a2 == a and a2 is not a and sl2 == sl and sl2 is not sl
    store.replace("Service", [a2, b2])
    assert store.current.services[("ns", "a")] is a
    assert store.current.services[("ns", "b")] is b2          # a changed record is the new one
    prepared = store.prepare_replace_all({"Service": [svc("a"), b2], "EndpointSlice": [sl2]})
    assert prepared.changed == frozenset()
    assert store.commit(prepared)
    assert store.current.services[("ns", "a")] is a and store.current.services[("ns", "b")] is b2
    assert store.current.slices[("ns", "a-1")] is sl and store.current.slices_for("ns", "a") == (sl,)
    assert store.current.slices_for("ns", "a")[0] is sl
