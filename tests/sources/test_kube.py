"""KubeSource and list_once against a fake API server speaking the real list/watch
protocol over HTTP, through the official `kubernetes` client, into a real StateStore."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import pytest

from clusterdns.cli import UsageError
from clusterdns.config import load
from clusterdns.sources import kube
from clusterdns.sources.kube import KubeSource, list_once
from clusterdns.sources.reflector import CONNECTION_TROUBLE
from clusterdns.state import StateStore
from tests.common import dns_ask, eventually, sample
from tests.fakeapi import FakeAPIServer, endpoint_slice, namespace, node, pod, service

FAST = dict(watch_timeout=5, watch_jitter=0, backoff_initial=0.02, backoff_max=0.2)


@pytest.fixture
def api():
    server = FakeAPIServer().start()
    server.add(namespace("testapp"))
    server.add(service("testapp", "a", "10.0.0.1"))
    server.add(service("testapp", "b", "10.0.0.2"))
    server.add(endpoint_slice("testapp", "a", ["10.1.0.1", "10.1.0.2"]))
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def kubeconfig(api, tmp_path):
    return api.write_kubeconfig(tmp_path / "kubeconfig")


def config(kubeconfig: str, *extra: str):
    return load(["agent", "--kubeconfig", kubeconfig, *extra], env={})


@contextlib.asynccontextmanager
async def running(cfg, store, **opts):
    src = KubeSource(cfg, store, **{**FAST, **opts})
    task = asyncio.create_task(src.run())
    try:
        yield src
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def names(store: StateStore) -> set[str]:
    return {name for _, name in store.current.services}


async def call(fn, *args):
    """Fake-server controls block briefly; keep the source's loop running meanwhile."""
    return await asyncio.to_thread(fn, *args)


async def test_initial_list_is_paginated_and_published(api, kubeconfig):
    for i in range(23):
        api.add(service("bulk", f"s{i:02d}", f"10.0.1.{i + 1}"))
    store = StateStore()
    cfg = config(kubeconfig)
    async with running(cfg, store, page_size=10) as src:
        assert src.not_synced() == ["services", "endpointslices", "namespaces"]
        await asyncio.wait_for(src.synced.wait(), 5)
        assert src.not_synced() == []
        st = store.current
        assert len(st.services) == 25
        assert st.services[("bulk", "s07")].cluster_ips == ("10.0.1.8",)
        assert [e.addresses for e in st.slices[("testapp", "a-abc")].endpoints] == [("10.1.0.1",), ("10.1.0.2",)]
        assert set(st.namespaces) == {"testapp"}
        assert st.is_synced("Service", "EndpointSlice", "Namespace", "Pod", "Node")
        assert sample("clusterdns_kube_synced", resource="services") == 1
        await eventually(lambda: api.open_watches() == 3, what="watches")
    lists = api.requests_for("services", "list")
    assert [r.params.get("limit") for r in lists] == ["10", "10", "10"]
    assert "continue" not in lists[0].params and all("continue" in r.params for r in lists[1:])
    assert all(r.authorization.lower() == "bearer fake-token" for r in api.requests)
    watch = api.requests_for("services", "watch")[0].params
    assert watch["allowWatchBookmarks"] == "true"
    assert watch["timeoutSeconds"] == "5"
    assert watch["resourceVersion"] == str(api.resource_version)


async def test_first_kinds_are_listed_before_the_others(api, kubeconfig):
    """first=("Service",) (a restarted agent with rules in the kernel): the Services' pages all
    come before any other list, and are in the store before the rest is listed."""
    for i in range(23):
        api.add(service("bulk", f"s{i:02d}", f"10.0.1.{i + 1}"))
    store = StateStore()
    seen: list[frozenset] = []
    store.subscribe(lambda old, new, delta: seen.append(new.synced))
    async with running(config(kubeconfig), store, page_size=10, first=("Service",)) as src:
        await asyncio.wait_for(src.synced.wait(), 5)
    lists = [r for r in api.requests if r.verb == "list"]
    assert [r.resource for r in lists[:3]] == ["services"] * 3
    assert {r.resource for r in lists[3:]} == {"endpointslices", "namespaces"}
    assert lists[3].time >= lists[2].time
    assert any("Service" in s and "EndpointSlice" not in s for s in seen)   # published on their own


async def test_adds_updates_deletes_arrive(api, kubeconfig):
    store = StateStore()
    before = sample("clusterdns_kube_watch_events_total", resource="services", type="MODIFIED")
    async with running(config(kubeconfig), store) as src:
        await asyncio.wait_for(src.synced.wait(), 5)
        await call(api.add, service("testapp", "c", "10.0.0.3"))
        await eventually(lambda: "c" in names(store), what="added service")
        await call(api.update, service("testapp", "c", "10.0.0.33"))
        await eventually(lambda: store.current.services[("testapp", "c")].cluster_ips == ("10.0.0.33",),
                         what="updated service")
        await call(api.update, endpoint_slice("testapp", "a", ["10.1.0.9"]))
        await eventually(lambda: [e.addresses for e in store.current.slices_for("testapp", "a")[0].endpoints]
                         == [("10.1.0.9",)], what="updated slice")
        await call(api.delete, "services", "a", "testapp")
        await eventually(lambda: "a" not in names(store), what="deleted service")
        await call(api.delete, "namespaces", "testapp")
        await eventually(lambda: not store.current.namespaces, what="deleted namespace")
        assert names(store) == {"b", "c"}
    assert sample("clusterdns_kube_watch_events_total", resource="services", type="MODIFIED") == before + 1
    assert len(api.requests_for("services", "list")) == 1


async def test_bookmark_advances_the_version_the_next_watch_carries(api, kubeconfig):
    store = StateStore()
    async with running(config(kubeconfig), store) as src:
        await asyncio.wait_for(src.synced.wait(), 5)
        await eventually(lambda: api.open_watches("services") == 1, what="services watch")
        listed = src.reflectors["services"].resource_version
        # Other resources move the global version; services see only a bookmark.
        await call(api.add, namespace("other1"))
        await call(api.add, namespace("other2"))
        rv = await call(api.bookmark, "services")
        assert str(rv) != listed
        await eventually(lambda: src.reflectors["services"].resource_version == str(rv), what="bookmark")
        await call(api.drop_watches, "services")
        await eventually(lambda: len(api.requests_for("services", "watch")) == 2, what="re-watch")
        assert api.requests_for("services", "watch")[1].params["resourceVersion"] == str(rv)
    assert len(api.requests_for("services", "list")) == 1


@pytest.mark.parametrize("gone_as_http", [False, True], ids=["error-event", "http-410"])
async def test_410_relists_and_emits_exactly_the_changes(kubeconfig, api, gone_as_http):
    api.gone_as_http = gone_as_http
    store = StateStore()
    deltas = []
    store.subscribe(lambda old, new, delta: deltas.append((new, delta)))
    relists = sample("clusterdns_kube_relists_total", resource="services", reason="expired")
    async with running(config(kubeconfig), store) as src:
        await asyncio.wait_for(src.synced.wait(), 5)
        await eventually(lambda: api.open_watches() == 3, what="watches")
        api.stop()
        api.delete("services", "a", "testapp")              # vanishes while we are away
        api.add(service("testapp", "c", "10.0.0.3"))         # appears while we are away
        api.compact()                                        # ... and the history is gone
        deltas.clear()
        api.start()
        await eventually(lambda: names(store) == {"b", "c"}, what="re-listed state")
        await asyncio.sleep(0.2)
    assert sample("clusterdns_kube_relists_total", resource="services", reason="expired") == relists + 1
    assert len(api.requests_for("services", "list")) == 2
    changed = set().union(*(d.services for _, d in deltas))
    assert changed == {("testapp", "a"), ("testapp", "c")}   # b unchanged: nothing for it
    # No intermediate version lost b or served an empty list.
    assert all(("testapp", "b") in st.services for st, _ in deltas)
    # Slices and namespaces re-listed to identical content publish nothing.
    assert all(d.kinds <= {"Service"} for _, d in deltas)


async def test_watch_ended_by_the_server_is_renewed_from_its_version(api, kubeconfig):
    store = StateStore()
    async with running(config(kubeconfig), store, watch_timeout=1) as src:
        await asyncio.wait_for(src.synced.wait(), 5)
        await eventually(lambda: len(api.requests_for("services", "watch")) >= 3, what="renewed watches")
        await call(api.add, service("testapp", "later", "10.0.0.8"))
        await eventually(lambda: "later" in names(store), what="event on a renewed watch")
        ref = src.reflectors["services"]
        assert ref.resource_version == str(api.resource_version)
    watches = api.requests_for("services", "watch")
    assert all(w.params["resourceVersion"] for w in watches)
    gaps = [b.time - a.time for a, b in zip(watches, watches[1:])]
    assert min(gaps[:2]) >= 0.9   # each lasted its timeoutSeconds: no spinning
    assert len(api.requests_for("services", "list")) == 1


async def test_compaction_then_a_dropped_watch_relists(api, kubeconfig):
    store = StateStore()
    async with running(config(kubeconfig), store) as src:
        await asyncio.wait_for(src.synced.wait(), 5)
        await eventually(lambda: api.open_watches() == 3, what="watches")
        await call(api.bookmark)     # the reflectors hold the newest version
        await eventually(lambda: src.reflectors["services"].resource_version == str(api.resource_version),
                         what="bookmark")
        rv = await call(api.compact)
        await call(api.drop_watches)
        await eventually(lambda: len(api.requests_for("services", "list")) == 2, what="re-list")
        await eventually(lambda: api.requests_for("services", "watch")[-1].params["resourceVersion"] == str(rv),
                         what="watch from the re-list's version")
        await call(api.add, service("testapp", "fresh", "10.0.0.7"))
        await eventually(lambda: "fresh" in names(store), what="events after the re-list")
    assert len(api.requests_for("services", "list")) == 2


async def test_dropped_connections_resume_without_relist_or_loss(api, kubeconfig):
    store = StateStore()
    async with running(config(kubeconfig), store) as src:
        await asyncio.wait_for(src.synced.wait(), 5)
        for i in range(6):
            await eventually(lambda: api.open_watches("services") == 1, what="services watch")
            await call(api.drop_watches)
            # Written while no watch is open: must come from the history on resume.
            await call(api.add, service("drop", f"d{i}", f"10.0.2.{i + 1}"))
        await eventually(lambda: {f"d{i}" for i in range(6)} <= names(store), what="all events")
    assert len(api.requests_for("services", "list")) == 1
    assert len(api.requests_for("endpointslices", "list")) == 1


async def test_outage_keeps_the_state_and_recovers(api, kubeconfig):
    store = StateStore()
    seen = []
    store.subscribe(lambda old, new, delta: seen.append(new))
    def broken() -> float:
        # a cut seen by the watch first (disconnected, connection) or by the probe first (unreachable)
        return sum(sample("clusterdns_kube_errors_total", resource="services", reason=r)
                   for r in sorted(CONNECTION_TROUBLE))
    errors = broken()
    async with running(config(kubeconfig), store) as src:
        await asyncio.wait_for(src.synced.wait(), 5)
        seen.clear()
        served = store.current
        await call(api.stop)
        # The cut watch is counted; the probe then declares the outage and the
        # reflectors wait for its first answer instead of reconnecting.
        await eventually(lambda: not src.api_ok, what="outage declared")
        await asyncio.sleep(0.3)
        assert store.current is served
        assert broken() > errors
        api.update(endpoint_slice("testapp", "a", ["10.1.0.7"]))
        api.add(service("testapp", "late", "10.0.0.9"))
        await call(api.start)
        await eventually(lambda: "late" in names(store), what="changes after the outage")
        await eventually(lambda: [e.addresses for e in store.current.slices_for("testapp", "a")[0].endpoints]
                         == [("10.1.0.7",)], what="slice change after the outage")
    assert all({"a", "b"} <= {n for _, n in st.services} for st in seen)
    # The history still covered the gap: resumed, not re-listed.
    assert len(api.requests_for("services", "list")) == 1


async def test_forbidden_names_verb_and_resource_and_retries(api, kubeconfig, caplog):
    api.forbid("endpointslices")
    store = StateStore()
    caplog.set_level(logging.ERROR, logger="clusterdns.sources.reflector")
    async with running(config(kubeconfig), store) as src:
        await eventually(lambda: len(api.requests_for("endpointslices")) >= 3, what="retries")
        await eventually(lambda: "Service" in store.current.synced, what="services synced")
        assert src.not_synced() == ["endpointslices"]
        assert not src.synced.is_set()
        assert names(store) == {"a", "b"}        # what is allowed is served meanwhile
        assert "forbidden: cannot list endpointslices.discovery.k8s.io at the cluster scope: " \
               "grant list,watch on endpointslices.discovery.k8s.io" in caplog.text
        api.allow("endpointslices")
        await asyncio.wait_for(src.synced.wait(), 5)
        assert src.not_synced() == []
        # Listing allowed, watching not: the error names the watch verb.
        api.forbid("services", ["watch"])
        await call(api.drop_watches, "services")
        await eventually(lambda: "cannot watch services at the cluster scope" in caplog.text, what="watch 403")
    assert sample("clusterdns_kube_errors_total", resource="endpointslices", reason="forbidden") >= 3


async def test_server_errors_back_off_then_sync(api, kubeconfig):
    api.fail_next("services", 500, 3)
    before = sample("clusterdns_kube_errors_total", resource="services", reason="http_500")
    store = StateStore()
    async with running(config(kubeconfig), store) as src:
        await asyncio.wait_for(src.synced.wait(), 5)
    assert sample("clusterdns_kube_errors_total", resource="services", reason="http_500") == before + 3
    times = [r.time for r in api.requests_for("services", "list")]
    assert len(times) == 4
    assert times[-1] - times[0] >= 0.02 * 0.5 * (1 + 2 + 4) * 0.9   # jittered exponential waits


async def test_dead_connection_is_noticed_by_the_read_timeout(api, kubeconfig):
    store = StateStore()
    before = sample("clusterdns_kube_errors_total", resource="services", reason="timeout")
    async with running(config(kubeconfig), store, watch_timeout=30, read_timeout=0.5) as src:
        await asyncio.wait_for(src.synced.wait(), 5)
        await eventually(lambda: api.open_watches("services") == 1, what="services watch")
        await call(api.stall_watches, "services")
        await call(api.add, service("testapp", "after-stall", "10.0.0.4"))
        await eventually(lambda: "after-stall" in names(store), timeout=3, what="resume after stall")
        # The fake notices the abandoned connection: one services watch again.
        await eventually(lambda: api.open_watches("services") == 1, what="stalled watch closed")
    assert sample("clusterdns_kube_errors_total", resource="services", reason="timeout") >= before + 1
    assert len(api.requests_for("services", "list")) == 1


async def test_invalid_objects_are_skipped_with_a_metric(api, kubeconfig, caplog):
    bad = service("testapp", "bad", "10.0.0.5")
    bad["spec"]["clusterIP"] = 167772165          # an integer, not an address
    bad["spec"].pop("clusterIPs")
    api.add(bad)
    before = sample("clusterdns_invalid_objects_total", kind="Service")
    store = StateStore()
    caplog.set_level(logging.WARNING)
    async with running(config(kubeconfig), store) as src:
        await asyncio.wait_for(src.synced.wait(), 5)
        assert names(store) == {"a", "b"}
        assert sample("clusterdns_invalid_objects_total", kind="Service") == before + 1
        assert "skipped Service testapp/bad" in caplog.text
        # A watched object turning invalid leaves the state, as a re-list would have it.
        broken = service("testapp", "b", "10.0.0.2")
        broken["spec"]["ports"][0]["port"] = "eighty"
        await call(api.update, broken)
        await eventually(lambda: names(store) == {"a"}, what="invalid update removed")
        await call(api.add, service("testapp", "good", "10.0.0.6"))
        await eventually(lambda: names(store) == {"a", "good"}, what="valid objects still served")
    assert sample("clusterdns_invalid_objects_total", kind="Service") == before + 2


async def test_a_burst_of_events_publishes_few_versions(api, kubeconfig):
    store = StateStore()
    async with running(config(kubeconfig), store) as src:
        await asyncio.wait_for(src.synced.wait(), 5)
        await eventually(lambda: api.open_watches() == 3, what="watches")
        start = store.current.version
        burst = [service("burst", f"s{i}", f"10.0.3.{i + 1}") for i in range(100)]
        burst += [endpoint_slice("burst", f"s{i}", [f"10.2.3.{i + 1}"]) for i in range(100)]
        await call(api.add_all, burst)
        await eventually(lambda: len(store.current.services) == 102 and len(store.current.slices) == 101,
                         what="burst applied")
        versions = store.current.version - start
    assert 1 <= versions <= 20, versions


async def test_pods_and_own_node_only_when_needed(api, kubeconfig):
    api.add(pod("testapp", "client", "10.161.37.5"))
    api.add(node("node-a", "192.168.49.2", zone="z1"))
    api.add(node("node-b", "192.168.49.3"))
    store = StateStore()
    async with running(config(kubeconfig), store) as src:
        await asyncio.wait_for(src.synced.wait(), 5)
        assert not store.current.pods and not store.current.nodes
        assert store.current.is_synced("Pod", "Node")
    assert not api.requests_for("pods") and not api.requests_for("nodes")

    store = StateStore()
    cfg = config(kubeconfig, "--pods", "verified", "--node-name", "node-a")
    async with running(cfg, store) as src:
        assert src.not_synced() == ["services", "endpointslices", "namespaces", "pods", "nodes"]
        await asyncio.wait_for(src.synced.wait(), 5)
        assert set(store.current.pods) == {("testapp", "client")}
        assert set(store.current.nodes) == {"node-a"}
        await call(api.update, node("node-a", "192.168.49.2", zone="z2"))
        await call(api.update, node("node-b", "192.168.49.30"))
        await eventually(lambda: store.current.nodes["node-a"].zone == "z2", what="own node update")
        await call(api.delete, "pods", "client", "testapp")
        await eventually(lambda: not store.current.pods, what="pod delete")
        assert set(store.current.nodes) == {"node-a"}
    assert all(r.params.get("fieldSelector") == "metadata.name=node-a" for r in api.requests_for("nodes"))


def test_list_once_publishes_one_complete_version(api, kubeconfig):
    store = StateStore()
    list_once(config(kubeconfig), store)
    assert store.current.version == 1
    assert names(store) == {"a", "b"}
    assert set(store.current.slices) == {("testapp", "a-abc")}
    assert store.current.is_synced("Service", "EndpointSlice", "Namespace", "Pod", "Node")


def test_demo_cluster_through_the_api_matches_the_manifest(tmp_path):
    from clusterdns.sources.manifest import DEMO_MANIFEST, load_files, publish
    expected = StateStore()
    publish(expected, load_files([DEMO_MANIFEST])[0])
    with FakeAPIServer() as server:
        assert server.load_manifest(DEMO_MANIFEST) > 80
        kc = server.write_kubeconfig(tmp_path / "kubeconfig")
        store = StateStore()
        list_once(load(["rules", "--kubeconfig", kc, "--pods", "verified"], env={}), store)
    want, got = expected.current, store.current
    assert dict(got.services) == dict(want.services)
    assert dict(got.slices) == dict(want.slices)
    assert dict(got.namespaces) == dict(want.namespaces)
    assert dict(got.pods) == dict(want.pods)


def test_list_once_unreachable_or_forbidden_is_a_usage_error(api, kubeconfig):
    api.forbid("services")
    with pytest.raises(UsageError, match="cannot list services at the cluster scope"):
        list_once(config(kubeconfig), StateStore())
    api.stop()
    with pytest.raises(UsageError, match=r"cannot list services from http://127\.0\.0\.1:\d+"):
        list_once(config(kubeconfig), StateStore(), connect_timeout=2)


def test_bad_kubeconfig_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="no such file"):
        KubeSource(config(str(tmp_path / "missing")), StateStore())
    garbage = tmp_path / "garbage"
    garbage.write_text("clusters: [unterminated\n")
    with pytest.raises(UsageError, match="kubeconfig .*garbage"):
        KubeSource(config(str(garbage)), StateStore())
    scalar = tmp_path / "scalar"
    scalar.write_text("just text\n")
    with pytest.raises(UsageError, match="not a kubeconfig"):
        KubeSource(config(str(scalar)), StateStore())
    empty = tmp_path / "empty"
    empty.write_text("apiVersion: v1\nkind: Config\n")
    with pytest.raises(UsageError) as info:
        list_once(config(str(empty)), StateStore())
    assert "\n" not in str(info.value)


def test_kubeconfig_list_skips_missing_files(api, kubeconfig, tmp_path):
    store = StateStore()
    list_once(config(f"{tmp_path}/missing:{kubeconfig}"), store)
    assert names(store) == {"a", "b"}


def test_cli_exit_code_2_for_unreadable_kubeconfig(tmp_path, capsys):
    from clusterdns.cli import main
    with contextlib.suppress(ModuleNotFoundError):   # `rules` belongs to another part
        code = main(["rules", "--kubeconfig", str(tmp_path / "missing")])
        assert code == 2
        assert "no such file" in capsys.readouterr().err


def test_in_cluster_config(tmp_path, monkeypatch):
    from kubernetes.aio.config import incluster_config
    token, ca = tmp_path / "token", tmp_path / "ca.crt"
    token.write_text("sa-token\n")
    ca.write_text("-----BEGIN CERTIFICATE-----\n")   # read only when connecting
    monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(token))
    monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(ca))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "192.168.49.2")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "6443")
    cfg = load(["agent"], env={"KUBERNETES_SERVICE_HOST": "192.168.49.2"})
    assert cfg.source.kubeconfig == kube.IN_CLUSTER
    src = KubeSource(cfg, StateStore())
    assert src.host == "https://192.168.49.2:6443"
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST")
    with pytest.raises(UsageError, match="in-cluster config"):
        KubeSource(cfg, StateStore())


async def test_event_batcher_groups_what_arrives_together_and_flushes_a_lone_event():
    from clusterdns.sources.objects import convert
    from clusterdns.sources.reflector import EventBatcher
    from tests.fakeapi import service as svc_dict
    store = StateStore()
    batcher = EventBatcher(store, window=0.002, max_pending=50)
    recs = [convert("Service", svc_dict("ns", f"s{i}", f"10.0.4.{i + 1}")) for i in range(120)]
    for r in recs[:40]:
        batcher.upsert("Service", r)
    assert store.current.version == 0             # not yet: waits for the window
    await asyncio.sleep(0.05)
    assert store.current.version == 1 and len(store.current.services) == 40
    for r in recs[40:120]:
        batcher.upsert("Service", r)              # 80 > max_pending: one early flush
    assert store.current.version == 2
    await asyncio.sleep(0.05)
    assert store.current.version == 3 and len(store.current.services) == 120
    batcher.delete("Service", ("ns", "s0"))
    assert store.current.version == 3             # a lone event waits for the window too...
    await eventually(lambda: store.current.version == 4, what="single event")   # ...and no longer
    batcher.delete("Service", ("ns", "s1"))
    batcher.replace("Service", recs[2:3])         # pending events go first, then the list
    assert set(store.current.services) == {("ns", "s2")}


async def test_event_batcher_spaces_versions_under_churn_and_publishes_a_change_after_quiet_at_once():
    from clusterdns.sources.objects import convert
    from clusterdns.sources.reflector import EventBatcher
    from tests.fakeapi import service as svc_dict
    store = StateStore()
    batcher = EventBatcher(store, window=0.002, spacing=0.3)
    recs = [convert("Service", svc_dict("ns", f"s{i}", f"10.0.5.{i + 1}")) for i in range(10)]
    t0 = time.monotonic()
    batcher.upsert("Service", recs[0])            # after a quiet spell: the window only
    await eventually(lambda: store.current.version == 1, what="first event")
    assert time.monotonic() - t0 < 0.25
    for r in recs[1:6]:                           # churn: gathered until the spacing is over
        batcher.upsert("Service", r)
        await asyncio.sleep(0.02)
    assert store.current.version == 1
    await eventually(lambda: store.current.version == 2, what="spaced flush")
    assert len(store.current.services) == 6 and time.monotonic() - t0 >= 0.3
    await asyncio.sleep(0.35)                     # quiet again: the next one goes at once
    t1 = time.monotonic()
    batcher.upsert("Service", recs[6])
    await eventually(lambda: store.current.version == 3, what="event after quiet")
    assert time.monotonic() - t1 < 0.25


# -- a silent API server -------------------------------------------------------

# Short, but a probe answered slowly on a loaded machine must not look like a stall.
PROBE_FAST = {"probe_interval": 0.3, "probe_retry": 0.2, "probe_timeout": 1.0}


def test_watch_read_timeout_follows_the_bookmarks_the_server_sends():
    from clusterdns.sources.reflector import Options
    opts = Options()
    # kube-apiserver's watch cache sends a BOOKMARK 2 s before timeoutSeconds and at
    # least once a minute: the read timeout is that gap plus grace, well within 30 s.
    assert opts.read_timeout_for(15) == 13 + opts.read_grace
    assert opts.read_timeout_for(300) == 60 + opts.read_grace
    assert opts.effective_read_timeout < 30
    assert Options(read_timeout=2.5).read_timeout_for(300) == 2.5


async def test_watches_ask_for_jittered_timeouts_and_end_before_the_read_timeout(api, kubeconfig):
    store = StateStore()
    timeouts = sample("clusterdns_kube_errors_total", resource="services", reason="timeout")
    async with running(config(kubeconfig), store, watch_timeout=2, watch_jitter=1.0) as src:
        await asyncio.wait_for(src.synced.wait(), 5)
        await eventually(lambda: len(api.requests_for("services", "watch")) >= 4, timeout=15,
                         what="renewed watches")
    asked = [int(r.params["timeoutSeconds"]) for r in api.requests_for("services", "watch")]
    assert all(2 <= t <= 4 for t in asked), asked
    # Each watch was ended by the server, none cut by our read timeout.
    assert sample("clusterdns_kube_errors_total", resource="services", reason="timeout") == timeouts
    assert len(api.requests_for("services", "list")) == 1


async def test_stuck_server_is_noticed_by_the_probe_and_watches_resume_from_their_version(api, kubeconfig):
    store = StateStore()
    outages = sample("clusterdns_kube_api_outages_total", reason="timeout")
    # Read timeouts far beyond the test: only the probe can notice the stall.
    async with running(config(kubeconfig), store, read_timeout=60, **PROBE_FAST) as src:
        await asyncio.wait_for(src.synced.wait(), 5)
        await eventually(lambda: api.open_watches() == 3, what="watches")
        await eventually(lambda: len(api.probes()) >= 2, what="probes while healthy")
        assert src.api_ok and sample("clusterdns_kube_api_up") == 1
        rv = src.reflectors["services"].resource_version
        served = store.current
        await call(api.stall)
        await eventually(lambda: not src.api_ok, timeout=6, what="stall declared")
        assert sample("clusterdns_kube_api_up") == 0
        assert sample("clusterdns_kube_api_outages_total", reason="timeout") == outages + 1
        await asyncio.sleep(0.5)
        assert store.current is served          # nothing published while stuck
        watches = len(api.requests_for("services", "watch"))
        await call(api.add, service("testapp", "after-stall", "10.0.0.4"))
        api.unstall()
        await eventually(lambda: "after-stall" in names(store), timeout=5, what="resume after the stall")
        assert src.api_ok and sample("clusterdns_kube_api_up") == 1
        resumed = api.requests_for("services", "watch")[watches:]
        assert resumed and resumed[-1].params["resourceVersion"] == rv
    assert sample("clusterdns_kube_errors_total", resource="services", reason="unreachable") >= 1
    assert len(api.requests_for("services", "list")) == 1     # re-watched, not re-listed


async def test_outage_ends_when_the_probe_gets_an_answer_not_after_the_backoff(api, kubeconfig):
    store = StateStore()
    outages = sample("clusterdns_kube_api_outages_total", reason="connection")
    # A long backoff: only the probe can bring the watches back quickly.
    async with running(config(kubeconfig), store, backoff_initial=20, backoff_max=20, **PROBE_FAST) as src:
        await asyncio.wait_for(src.synced.wait(), 5)
        await eventually(lambda: api.open_watches() == 3, what="watches")
        await call(api.stop)
        await eventually(lambda: not src.api_ok, timeout=6, what="outage declared")
        assert sample("clusterdns_kube_api_outages_total", reason="connection") == outages + 1
        await asyncio.sleep(0.5)
        await call(api.start)
        await call(api.add, service("testapp", "back", "10.0.0.5"))
        await eventually(lambda: "back" in names(store), timeout=5, what="change after the outage")
        assert src.api_ok
    assert len(api.requests_for("services", "list")) == 1


async def test_any_http_answer_counts_as_alive(api, kubeconfig):
    store = StateStore()
    async with running(config(kubeconfig), store, probe_path="/no-such-path", **PROBE_FAST) as src:
        await asyncio.wait_for(src.synced.wait(), 5)
        await asyncio.sleep(1.0)      # ~5 probes, each a 404
        assert src.api_ok


# -- the agent, with the source's own defaults, through DNS and /ready ------------

@contextlib.asynccontextmanager
async def agent_on(kubeconfig: str):
    import aiohttp

    from clusterdns.agent import Agent
    cfg = load(["agent", "--kubeconfig", kubeconfig, "--proxy-mode", "none", "--no-upstream",
                "--listen", "127.0.0.1:0", "--health-listen", "127.0.0.1:0", "--metrics-listen", "none"],
               env={})
    agent = Agent(cfg)
    await agent.start()
    try:
        async with aiohttp.ClientSession() as http:
            async def ready() -> tuple[int, str]:
                async with http.get(f"http://127.0.0.1:{agent.health.bound[0][1]}/ready") as r:
                    return r.status, await r.text()
            agent.ready = ready
            yield agent
    finally:
        await agent.stop()


async def resolve(agent, name: str) -> tuple[str, list[str]]:
    rcode, answers, _ = await dns_ask(agent.dns.bound[0][1], f"{name}.testapp.svc.cluster.local.")
    return rcode, sorted(answers)


async def test_agent_survives_a_20s_stall_and_serves_the_change_made_when_it_ends(api, kubeconfig):
    outages = sample("clusterdns_kube_api_outages_total", reason="timeout")
    async with agent_on(kubeconfig) as agent:
        await eventually(lambda: _is_ready(agent), 10, "/ready")
        assert await resolve(agent, "a") == ("NOERROR", ["10.0.0.1"])
        lists = len(api.requests_for("services", "list"))
        version = agent.store.current.version
        stall_end = time.monotonic() + 20
        await call(api.stall, 20)
        # Meanwhile: the last state answers, /ready names the trouble, the gauge shows it.
        noticed = None
        while time.monotonic() < stall_end - 0.3:
            assert await resolve(agent, "a") == ("NOERROR", ["10.0.0.1"])
            assert await resolve(agent, "b") == ("NOERROR", ["10.0.0.2"])
            status, text = await agent.ready()
            if status == 503:
                assert "kube API not answering" in text, text
                assert sample("clusterdns_kube_api_up") == 0
                noticed = noticed or 20 - (stall_end - time.monotonic())
            await asyncio.sleep(0.5)
        assert noticed is not None, "/ready never reported the stalled API server"
        assert sample("clusterdns_kube_api_outages_total", reason="timeout") == outages + 1
        assert agent.store.current.version == version     # nothing published while stuck
        while api.stalling:
            await asyncio.sleep(0.01)
        await call(api.add, service("testapp", "after", "10.0.0.9"))
        took = await eventually(lambda: _resolves(agent, "after", "10.0.0.9"), 15, "the change in DNS")
        await eventually(lambda: _is_ready(agent), 5, "/ready again")
        assert sample("clusterdns_kube_api_up") == 1
    # Resumed from the last versions: no re-list.
    assert len(api.requests_for("services", "list")) == lists
    print(f"stall noticed by /ready after {noticed:.1f}s; "
          f"change made at the end of the 20 s stall answered after {took:.2f}s")


async def test_agent_serves_a_change_made_when_the_api_returns_within_3s(api, kubeconfig):
    async with agent_on(kubeconfig) as agent:
        await eventually(lambda: _is_ready(agent), 10, "/ready")
        await call(api.stop)
        await asyncio.sleep(15)
        assert await resolve(agent, "a") == ("NOERROR", ["10.0.0.1"])
        status, text = await agent.ready()
        assert status == 503 and "kube API not answering" in text, text
        await call(api.start)
        await call(api.add, service("testapp", "returned", "10.0.0.10"))
        took = await eventually(lambda: _resolves(agent, "returned", "10.0.0.10"), 3, "the change in DNS")
        await eventually(lambda: _is_ready(agent), 3, "/ready again")
    print(f"change made when the API returned after 15 s answered after {took:.2f}s")


async def _is_ready(agent) -> bool:
    return (await agent.ready())[0] == 200


async def _resolves(agent, name: str, ip: str) -> bool:
    return await resolve(agent, name) == ("NOERROR", [ip])


def _exec_kubeconfig(api, tmp_path) -> str:
    """A kubeconfig whose user's token comes from an exec plugin handing out tok-1, tok-2, ..."""
    import json
    import sys
    counter = tmp_path / "count"
    plugin = tmp_path / "plugin.py"
    plugin.write_text(
        "import json, pathlib\n"
        f"p = pathlib.Path({str(counter)!r})\n"
        "n = int(p.read_text()) + 1 if p.exists() else 1\n"
        "p.write_text(str(n))\n"
        "print(json.dumps({'apiVersion': 'client.authentication.k8s.io/v1beta1', 'kind': 'ExecCredential',\n"
        "                  'status': {'token': f'tok-{n}'}}))\n")
    path = tmp_path / "kubeconfig"
    api.write_kubeconfig(path)
    doc = json.loads(path.read_text())
    doc["users"][0]["user"] = {"exec": {"apiVersion": "client.authentication.k8s.io/v1beta1",
                                        "command": sys.executable, "args": [str(plugin)]}}
    path.write_text(json.dumps(doc))
    return str(path)


async def test_exec_plugin_token_is_refreshed(api, tmp_path, monkeypatch):
    monkeypatch.setattr(kube, "TOKEN_REFRESH_INTERVAL", 0.05)
    conf, loader = await kube._load_configuration(_exec_kubeconfig(api, tmp_path))
    assert conf.api_key["BearerToken"].endswith("tok-1")
    task = asyncio.create_task(kube._token_refresher(loader, conf))
    try:
        await eventually(lambda: conf.api_key["BearerToken"].endswith("tok-3"), timeout=20, what="two refreshes")
        assert not task.done()              # it keeps refreshing
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_static_token_needs_no_refresher(api, kubeconfig, tmp_path):
    conf, loader = await kube._load_configuration(kubeconfig)
    # returns at once: nothing to refresh for a token written in the kubeconfig...
    await asyncio.wait_for(kube._token_refresher(loader, conf), 5)
    # ...nor for a context without a user, nor in-cluster (no loader)
    import json
    doc = json.loads(open(kubeconfig).read())
    del doc["contexts"][0]["context"]["user"]
    (tmp_path / "anon").write_text(json.dumps(doc))
    conf, loader = await kube._load_configuration(str(tmp_path / "anon"))
    await asyncio.wait_for(kube._token_refresher(loader, conf), 5)
    await asyncio.wait_for(kube._token_refresher(None, conf), 5)
