import os
import time

import pytest

from clusterdns import metrics
from clusterdns.sources.manifest import (
    DEMO_MANIFEST,
    ManifestError,
    ManifestSource,
    load_files,
    read_documents,
)
from clusterdns.state import StateStore, record_key

GOOD = """
apiVersion: v1
kind: List
items:
- apiVersion: v1
  kind: Service
  metadata: {name: web, namespace: shop}
  spec: {clusterIP: 10.96.0.5, ports: [{port: 80}]}
- apiVersion: v1
  kind: Service
  metadata: {name: bad, namespace: shop}
  spec: {clusterIP: 167772165, ports: [{port: 80}]}
---
apiVersion: v1
kind: Namespace
metadata: {name: shop}
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: ignored}
"""


def write(path, text):
    path.write_text(text)
    # A new mtime even on coarse clocks.
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))


def test_demo_manifest_loads_cleanly():
    records, skipped = load_files([DEMO_MANIFEST])
    assert skipped == []
    kinds = {k for k, _ in records}
    assert kinds == {"Namespace", "Service", "EndpointSlice", "Pod", "Node"}
    svc = next(r for k, r in records if k == "Service" and r.name == "testapp-svc")
    assert svc.cluster_ips == ("172.20.36.232",)
    eps = [e for k, r in records if k == "EndpointSlice" and r.service == "testapp-svc" for e in r.endpoints]
    assert len(eps) == 74 and all(e.ready for e in eps)


def test_invalid_object_skipped_with_metric(tmp_path):
    f = tmp_path / "m.yaml"
    write(f, GOOD)
    before = metrics.REGISTRY.get_sample_value("clusterdns_invalid_objects_total", {"kind": "Service"}) or 0
    store = StateStore()
    src = ManifestSource(store, [str(f)])
    assert src.load()
    assert set(store.current.services) == {("shop", "web")}
    assert "shop" in store.current.namespaces
    after = metrics.REGISTRY.get_sample_value("clusterdns_invalid_objects_total", {"kind": "Service"})
    assert after == before + 1


def test_broken_file_reports_line_and_keeps_last_good(tmp_path, caplog):
    f = tmp_path / "m.yaml"
    write(f, GOOD)
    store = StateStore()
    src = ManifestSource(store, [str(f)])
    src.load()
    version = store.current.version
    write(f, "apiVersion: v1\nkind: List\nitems:\n- {a: [1, 2\n")
    assert not src.load()
    assert store.current.version == version and ("shop", "web") in store.current.services
    err = src.errors[str(f)]
    assert err.line is not None and err.path == str(f)
    assert f"{f}:" in caplog.text
    write(f, GOOD.replace("10.96.0.5", "10.96.0.6"))
    assert src.load()
    assert store.current.services[("shop", "web")].cluster_ips == ("10.96.0.6",)


def test_unreadable_and_json(tmp_path):
    with pytest.raises(ManifestError, match="No such file"):
        read_documents(str(tmp_path / "missing.yaml"))
    j = tmp_path / "m.json"
    j.write_text('{"apiVersion": "v1", "kind": "List", "items": [\n{"apiVersion": "v1", "kind": "Namespace", '
                 '"metadata": {"name": "x"}}]}')
    records, _ = load_files([str(j)])
    assert records[0][1].name == "x"
    j.write_text('{"apiVersion": "v1",\n "kind": }')
    with pytest.raises(ManifestError) as exc:
        read_documents(str(j))
    assert exc.value.line == 2


async def test_source_reloads_a_changed_file(tmp_path):
    import asyncio
    f = tmp_path / "m.yaml"
    write(f, GOOD)
    store = StateStore()
    src = ManifestSource(store, [str(f)], interval=0.1)
    task = asyncio.create_task(src.run())
    try:
        await asyncio.sleep(0.2)
        write(f, GOOD.replace("name: web,", "name: web2,"))
        start = time.monotonic()
        while ("shop", "web2") not in store.current.services:
            assert time.monotonic() - start < 30, "never reloaded"
            await asyncio.sleep(0.02)
    finally:
        task.cancel()


# -- hostile and broken input ------------------------------------------------------------

import asyncio  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import resource  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402

from clusterdns.config import load  # noqa: E402
from clusterdns.sources.manifest import Limits, records_from_documents  # noqa: E402
from clusterdns.state import state_from_records  # noqa: E402


def svc(name, ns="shop", ip="10.96.0.10", port_name="http", port=80):
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": ns},
            "spec": {"clusterIP": ip, "ports": [{"name": port_name, "port": port, "protocol": "TCP"}]}}


def eps(service, ns="shop", ip="10.1.0.10", port_name="http", name=None):
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": name or f"{service}-abc", "namespace": ns,
                         "labels": {"kubernetes.io/service-name": service}},
            "addressType": "IPv4", "endpoints": [{"addresses": [ip], "conditions": {"ready": True}}],
            "ports": [{"name": port_name, "port": 8080, "protocol": "TCP"}]}


def cluster(n, prefix="svc"):
    items = [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "shop"}}]
    for i in range(n):
        items += [svc(f"{prefix}-{i}", ip=f"10.96.1.{i + 1}"), eps(f"{prefix}-{i}", ip=f"10.1.1.{i + 1}")]
    return items


def as_list(items):
    return {"apiVersion": "v1", "kind": "List", "items": items}


def write_json(path, items):
    write(path, json.dumps(as_list(items)))


HOSTILE_NAMES = ["sp ace", 'qu"ote', "semi;colon", "caf\u00e9", "MySvc", "my_svc", "x" * 100, "a\nb", "a'b"]


def hostile_cluster():
    """Good Services, and Services/ports/namespaces named as the API server never would."""
    items = cluster(5)
    for i, bad in enumerate(HOSTILE_NAMES):
        ip = f"10.96.2.{i + 1}"
        items += [svc(bad, ip=ip), eps(bad, ip=f"10.1.2.{i + 1}")]
        items += [svc(f"port-{i}", ip=f"10.96.3.{i + 1}", port_name=bad), eps(f"port-{i}", port_name=bad)]
        items += [svc(f"ns-{i}", ns=bad, ip=f"10.96.4.{i + 1}")]
    return items


def run_in_netns(argv, text):
    ns = f"cdns-src-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True)
    try:
        return subprocess.run(["ip", "netns", "exec", ns, *argv], input=text, text=True, capture_output=True)
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip"), reason="needs root and ip(8) for a namespace")
@pytest.mark.parametrize("mode,check", [("nftables", ["nft", "-c", "-f", "-"]),
                                        ("iptables", ["iptables-restore", "--test"])])
def test_hostile_names_leave_every_other_service_with_rules(tmp_path, mode, check):
    if not shutil.which(check[0]):
        pytest.skip(f"{check[0]} is not installed")
    from clusterdns.commands.rules import render_text
    f = tmp_path / "hostile.json"
    write_json(f, hostile_cluster())
    records, skipped = load_files([str(f)])
    bad_names = {s.name for s in skipped}
    # each hostile Service and its slice, port (Service and slice) and namespace
    assert len(skipped) == 5 * len(HOSTILE_NAMES)
    assert all(n.isascii() and n.isprintable() for n in bad_names)   # escaped for the log
    cfg = load(["rules", "--mode", mode, "--manifest", str(f), "--node-name", "n1", "--node-ip", "192.168.0.2"])
    text = render_text(state_from_records(records), cfg, mode, 4)
    for i in range(5):
        assert f"10.96.1.{i + 1}" in text and f"10.1.1.{i + 1}" in text
    for bad in HOSTILE_NAMES:
        assert bad not in text
    for i in range(len(HOSTILE_NAMES)):
        assert f"10.96.2.{i + 1}" not in text and f"10.96.3.{i + 1}" not in text and f"10.96.4.{i + 1}" not in text
    done = run_in_netns(check, text)
    assert done.returncode == 0, done.stderr[-2000:]


def test_hostile_names_are_counted_as_invalid(tmp_path):
    f = tmp_path / "hostile.yaml"
    write(f, "\n---\n".join(json.dumps(o) for o in hostile_cluster()))
    before = metrics.REGISTRY.get_sample_value("clusterdns_invalid_objects_total", {"kind": "Service"}) or 0
    store = StateStore()
    ManifestSource(store, [str(f)], worker=False).load()
    after = metrics.REGISTRY.get_sample_value("clusterdns_invalid_objects_total", {"kind": "Service"})
    assert after - before == 3 * len(HOSTILE_NAMES)   # each name as a Service, port and namespace name
    assert {name for _, name in store.current.services} == {f"svc-{i}" for i in range(5)}


@pytest.mark.parametrize("text", ["[" * 200_000, "[" * 200_000 + "]" * 200_000, "a: " + "[" * 200_000,
                                  "- " * 100_000 + "x", '{"a":' * 100_000 + "1" + "}" * 100_000])
def test_deep_nesting_is_a_broken_file_not_a_crash(tmp_path, text):
    f = tmp_path / "deep.yaml"
    write(f, text)
    with pytest.raises(ManifestError):
        load_files([str(f)])


@pytest.mark.parametrize("text", [": : broken [yaml\n", "apiVersion: v1\nkind: List\nitems:\n: : broken [yaml\n",
                                  "kind: List\napiVersion: v1\nitems:\n- {? [a]: b}\n"])
def test_mappings_with_keys_that_are_not_strings_are_a_broken_file(tmp_path, text):
    # YAML 1.2 reads these as mappings with null or list keys; kubectl's YAML refuses them.
    f = tmp_path / "broken.yaml"
    write(f, text)
    with pytest.raises(ManifestError, match="not a string"):
        load_files([str(f)])


ALIAS_BOMB = """a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
h: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]
i: &i [*h,*h,*h,*h,*h,*h,*h,*h,*h]
"""

LIST_BOMB = """apiVersion: v1
kind: List
items: &x [{kind: Service}, {kind: Service}, {kind: Service}, {kind: Service}, {kind: Service}]
more: [*x, *x, *x]
""" + "".join(f"l{i}: &l{i} [*{'x' if i == 0 else f'l{i - 1}'}, *{'x' if i == 0 else f'l{i - 1}'}, "
              f"*{'x' if i == 0 else f'l{i - 1}'}, *{'x' if i == 0 else f'l{i - 1}'}]\n" for i in range(12))


@pytest.mark.parametrize("bomb", [ALIAS_BOMB, LIST_BOMB])
def test_yaml_alias_bomb_is_refused(tmp_path, bomb, caplog):
    f = tmp_path / "bomb.yaml"
    write(f, bomb)
    assert len(bomb) < 2000
    with pytest.raises(ManifestError, match="alias"):
        load_files([str(f)])
    store = StateStore()
    src = ManifestSource(store, [str(f)], worker=False)
    caplog.clear()
    src.load()
    assert len(caplog.records) < 5 and not store.current.services


def test_small_anchors_and_aliases_still_work(tmp_path):
    f = tmp_path / "anchors.yaml"
    write(f, "apiVersion: v1\nkind: List\nitems:\n"
             "- {apiVersion: v1, kind: Service, metadata: {name: a, namespace: shop},\n"
             "   spec: {clusterIP: 10.96.0.1, ports: &p [{name: http, port: 80}]}}\n"
             "- {apiVersion: v1, kind: Service, metadata: {name: b, namespace: shop},\n"
             "   spec: {clusterIP: 10.96.0.2, ports: *p}}\n")
    records, skipped = load_files([str(f)])
    assert not skipped and [(r.name, r.ports[0].port) for _, r in records] == [("a", 80), ("b", 80)]


def test_file_and_object_budgets(tmp_path):
    f = tmp_path / "m.json"
    write_json(f, cluster(30))
    with pytest.raises(ManifestError, match="manifest-max-bytes"):
        load_files([str(f)], Limits(max_bytes=1000))
    with pytest.raises(ManifestError, match="manifest-max-objects"):
        load_files([str(f)], Limits(max_objects=10))
    assert len(load_files([str(f)], Limits(max_objects=61))[0]) == 61


def test_limits_come_from_flags(tmp_path):
    f = tmp_path / "m.json"
    write_json(f, cluster(30))
    from clusterdns.cli import main
    assert main(["rules", "--manifest", str(f), "--manifest-max-objects", "10"]) == 2
    assert main(["rules", "--manifest", str(f), "--manifest-max-bytes", "100"]) == 2


def test_duplicate_objects_are_warned_about(tmp_path, caplog):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    write_json(a, cluster(3))
    write_json(b, [svc("svc-1", ip="10.96.9.9"), svc("solo", ip="10.96.9.8"), svc("solo", ip="10.96.9.7")])
    store = StateStore()
    with caplog.at_level(logging.WARNING):
        ManifestSource(store, [str(a), str(b)], worker=False).load()
    assert "Service shop/svc-1 is also given in" in caplog.text
    assert "Service shop/solo is also given in" in caplog.text
    assert store.current.services[("shop", "svc-1")].cluster_ips == ("10.96.9.9",)   # the later one


async def poll_until(src, cond, polls=20):
    for _ in range(polls):
        await src.poll()
        if cond():
            return True
        await asyncio.sleep(src.interval)
    return False


async def test_a_file_is_read_only_once_it_has_settled(tmp_path):
    f = tmp_path / "m.json"
    write_json(f, cluster(30))
    store = StateStore()
    src = ManifestSource(store, [str(f)], interval=0.01, worker=False)
    await src.poll()
    assert not store.current.services          # seen once: not settled yet
    await src.poll()
    assert len(store.current.services) == 30
    # A writer rewriting in place, caught half way: the half file is never read.
    full = json.dumps(as_list(cluster(40, prefix="new")))
    write(f, full[: len(full) // 2])
    await src.poll()
    write(f, full[: len(full) // 2 + 100])
    await src.poll()
    assert set(store.current.services) == {("shop", f"svc-{i}") for i in range(30)}
    assert not src.errors                      # the partial content was never parsed
    write(f, full)
    assert await poll_until(src, lambda: ("shop", "new-39") in store.current.services)
    assert len(store.current.services) == 40 and not src.problems()


@pytest.mark.parametrize("shrink", ["empty", "cut at an item", "truncated"])
async def test_an_emptied_or_shrunk_file_is_refused_loudly(tmp_path, caplog, shrink):
    f = tmp_path / "m.yaml"
    docs = [json.dumps(o) for o in cluster(30)]
    write(f, "\n---\n".join(docs))
    store = StateStore()
    src = ManifestSource(store, [str(f)], interval=0.01, worker=False)
    src.load(strict=True)
    version = store.current.version
    errors = metrics.REGISTRY.get_sample_value("clusterdns_source_errors_total", {"source": "manifest"}) or 0
    text = {"empty": "", "cut at an item": "\n---\n".join(docs[:9]),
            "truncated": "\n---\n".join(docs)[: 2 * len(docs[0]) + 5]}[shrink]
    write(f, text)
    caplog.clear()
    await poll_until(src, lambda: src.problems(), polls=10)
    assert store.current.version == version and len(store.current.services) == 30
    assert src.problems() and str(f) in src.problems()[0]
    assert any(r.levelno == logging.ERROR for r in caplog.records)
    assert metrics.REGISTRY.get_sample_value("clusterdns_source_errors_total", {"source": "manifest"}) > errors
    # the file written back whole is taken again
    write(f, "\n---\n".join(docs[:-2]))   # one Service fewer: a normal edit
    assert await poll_until(src, lambda: len(store.current.services) == 29)
    assert not src.problems()


async def test_allow_shrink_takes_an_emptied_file(tmp_path):
    f = tmp_path / "m.json"
    write_json(f, cluster(30))
    store = StateStore()
    src = ManifestSource(store, [str(f)], interval=0.01, worker=False, limits=Limits(allow_shrink=True))
    src.load(strict=True)
    write(f, "")
    assert await poll_until(src, lambda: not store.current.services)
    assert not src.problems()


async def test_a_failed_read_is_retried_without_a_change(tmp_path):
    f = tmp_path / "m.json"
    write_json(f, cluster(3))
    store = StateStore()
    src = ManifestSource(store, [str(f)], interval=0.01, worker=False)
    await src.poll()                            # seen once (settling)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowest_free = os.open(os.devnull, os.O_RDONLY)   # the number the next open would get
    os.close(lowest_free)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))   # the next open fails: too many open files
    try:
        await src.poll()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert str(f) in src.errors and not store.current.services
    # the file did not change; the read is tried again and succeeds
    assert await poll_until(src, lambda: len(store.current.services) == 3)
    assert not src.errors


async def test_missing_path_does_not_end_the_source(tmp_path):
    from clusterdns.sources.loader import make_source
    f = tmp_path / "later.json"
    cfg = load(["dns", "--manifest", str(f)])
    store = StateStore()
    old = state_from_records(records_from_documents([as_list(cluster(2))])[0])
    store.current = old
    src = make_source(cfg, store, strict=False)
    src.interval = 0.02
    task = asyncio.create_task(src.run())
    try:
        await asyncio.sleep(0.2)
        assert not task.done() and store.current is old and src.problems()
        write_json(f, cluster(4))
        for _ in range(100):
            if len(store.current.services) == 4:
                break
            await asyncio.sleep(0.02)
        assert len(store.current.services) == 4 and not task.done() and not src.problems()
    finally:
        task.cancel()


async def test_big_reload_is_parsed_off_the_event_loop(tmp_path):
    """While a big file is parsed (in the worker), the loop keeps running and the last good state is served."""
    from clusterdns.synthetic import synthetic_records, to_manifest
    f = tmp_path / "m.json"
    write_json(f, cluster(3))
    store = StateStore()
    src = ManifestSource(store, [str(f)], interval=0.02)
    src.load(strict=True)
    old = store.current
    write(f, to_manifest(synthetic_records(services=4000, endpoints=10)))
    ticks, served_old = 0, 0
    task = asyncio.create_task(src.run())
    try:
        while len(store.current.services) != 4000:
            await asyncio.sleep(0.005)
            ticks += 1
            served_old += store.current is old
            assert ticks < 20000 and not task.done()
        assert served_old >= 10      # many turns of the loop while the worker parsed
        assert not src.problems()
    finally:
        task.cancel()


def test_worker_reports_broken_files_like_the_in_process_parse(tmp_path):
    from clusterdns.sources.manifest import parse_in_worker
    f = tmp_path / "m.yaml"
    write(f, "apiVersion: v1\nkind: List\nitems:\n- {a: [1, 2\n")
    with pytest.raises(ManifestError) as exc:
        parse_in_worker(str(f))
    assert exc.value.path == str(f) and not exc.value.transient
    write_json(f, cluster(2) + [svc("Bad_Name")])
    records, skipped = parse_in_worker(str(f))
    assert len(records) == 5 and [s.name for s in skipped] == ["shop/Bad_Name"]


async def test_agent_reload_to_a_missing_manifest_keeps_serving_and_loads_it_later(tmp_path):
    """A reload to a manifest path that does not exist keeps the source running: later
    manifest edits are loaded."""
    from clusterdns.agent import Agent
    from tests.common import eventually
    from tests.test_agent import A_NAME, B_NAME, SlowKernel, _answers, manifest
    manifest(tmp_path / "a.json", {"a": ("10.96.0.5", ["10.0.0.1"])})
    conf = tmp_path / "agent.yaml"
    conf.write_text(f"manifest: [{tmp_path / 'a.json'}]\nmin-sync-period: 0\n")
    argv = ["agent", "--listen", "127.0.0.1:0", "--no-upstream", "--health-listen", "127.0.0.1:0", "--metrics-listen",
            "none", "--proxy-metrics-listen", "none", "--lameduck", "0", "--config", str(conf)]
    agent = Agent(load(argv, env={}), argv=argv, executor=SlowKernel())
    await agent.start()
    try:
        agent.source.interval = 0.05
        port = agent.dns.bound[0][1]
        await eventually(lambda: _answers(port, A_NAME, "10.96.0.5"), what="the first answer")
        waiting = asyncio.ensure_future(agent.wait())
        conf.write_text(f"manifest: [{tmp_path / 'later.json'}]\nmin-sync-period: 0\n")
        await eventually(lambda: agent.reloads == 1, timeout=10, what="the reload")
        agent.source.interval = 0.05
        await eventually(lambda: bool(agent.source.problems()), timeout=5, what="the missing file reported")
        assert "later.json" in agent.source.problems()[0]
        assert "manifest not loaded (see log)" in agent.not_ready()   # what /ready names
        assert await _answers(port, A_NAME, "10.96.0.5")          # the last state, still served
        assert not waiting.done()                                  # the agent and its source run on
        manifest(tmp_path / "later.json", {"b": ("10.96.0.6", ["10.0.0.2"])})
        await eventually(lambda: _answers(agent.dns.bound[0][1], B_NAME, "10.96.0.6"), timeout=10,
                         what="the later file's Service answered")
        assert not agent.source.problems() and not waiting.done()
        agent.begin_shutdown()
        assert await asyncio.wait_for(waiting, 10) == 0
    finally:
        await agent.stop()


def test_one_shot_load_warns_about_duplicates_too(tmp_path, caplog):
    a = tmp_path / "a.json"
    write_json(a, cluster(2) + [svc("svc-0", ip="10.96.9.9")])
    with caplog.at_level(logging.WARNING):
        records, _ = load_files([str(a)])
    assert "Service shop/svc-0 is also given in" in caplog.text


# A JSON List read item by item must give what the whole-document parse gives, and leave
# every other shape (and every error) to that parse.
_LIST = {"apiVersion": "v1", "items": cluster(3) + [svc("Bad_Name"), {"kind": "Deployment"}, [svc("in-a-list")]],
         "kind": "List", "metadata": {"resourceVersion": ""}}
JSON_LISTS = [
    json.dumps(_LIST),                                           # kubectl's key order: items before kind
    json.dumps(_LIST, indent=2),
    "\ufeff \r\n" + json.dumps({"kind": "ServiceList", "items": cluster(1)}) + "\n\t ",
    json.dumps({"kind": "List", "items": []}),
    json.dumps({"kind": "List", "items": [{"kind": "List", "items": cluster(2)}]}),   # a List in a List
    json.dumps({"kind": "List", "meta": {"items": [1]}, "items": cluster(1), "kind2": ["]", "}"]}),
]
NOT_JSON_LISTS = [
    json.dumps({"kind": "List", "items": cluster(1)}) + " " + json.dumps(svc("x")),   # a stream of two documents
    json.dumps({"kind": "List", "items": cluster(1)}).replace('"items"', '"items": [], "items"', 1),  # last wins
    json.dumps({"kind": "Service", "items": cluster(1)}),      # not a List: one (odd) object
    json.dumps({"kind": "List", "items": {"a": 1}}),
    json.dumps({"items": cluster(1)}),
    json.dumps(cluster(2)),                                     # a bare array
    json.dumps(svc("one")),
    '{"kind": "List", "items": [' + json.dumps(svc("a")) + ",]}",   # broken: trailing comma
    '{"kind": "List", "items": [' + json.dumps(svc("a")) + "",      # broken: cut short
    '{"kind": "List", "items": [' + "[" * 100_000 + "]" * 100_000 + "]}",   # nested too deeply
    "kind: List\nitems: []\n",
]


@pytest.mark.parametrize("text", JSON_LISTS)
def test_a_json_list_read_item_by_item_equals_the_whole_parse(tmp_path, text):
    from clusterdns.sources.manifest import parse_file, parse_json_list
    f = tmp_path / "m.json"
    f.write_text(text)
    assert parse_json_list(text.encode()) == records_from_documents(read_documents(str(f)))
    assert parse_json_list(text.encode(), str(f)) == parse_file(str(f))


@pytest.mark.parametrize("text", NOT_JSON_LISTS)
def test_other_shapes_and_broken_json_are_left_to_the_whole_parse(tmp_path, text):
    from clusterdns.sources.manifest import NotAJsonList, parse_file, parse_file_lean, parse_json_list
    with pytest.raises(NotAJsonList):
        parse_json_list(text.encode())
    f = tmp_path / "m.json"
    f.write_text(text)
    try:
        expected = parse_file(str(f))
    except ManifestError as exc:
        with pytest.raises(ManifestError) as got:
            parse_file_lean(str(f))
        assert str(got.value) == str(exc)
    else:
        assert parse_file_lean(str(f)) == expected


@pytest.mark.parametrize("window", [1, 2, 3, 7, 64, 1 << 20])
def test_a_json_list_read_a_window_at_a_time_equals_the_whole_parse(tmp_path, monkeypatch, window):
    """parse_file_lean reads a file's text STREAM_BYTES at a time: wherever a window ends (in a
    number, a key, a multi-byte character, the byte order mark, an item longer than the window)
    every file reads as parse_file reads it, errors worded the same."""
    from clusterdns.sources import manifest
    from clusterdns.sources.manifest import parse_file, parse_file_lean
    monkeypatch.setattr(manifest, "STREAM_BYTES", window)
    extra = [
        json.dumps({"kind": "List", "items": cluster(1), "n": 12345678901234567890, "f": -1.5e-3, "t": True}),
        json.dumps({"kind": "List", "items": cluster(1), "x": "\u00e9\u4e2d\U0001f600"}, ensure_ascii=False),
        json.dumps({"kind": "List", "items": cluster(1)}) + " 1",      # a number after the object
        json.dumps({"kind": "List", "items": cluster(1)}) + "\u00a0",  # not JSON's whitespace
        "\u00a0" + json.dumps({"kind": "List", "items": cluster(1)}),
        " " * 50 + json.dumps({"kind": "List", "items": cluster(1)})[:-1],   # cut short
    ]
    for i, text in enumerate(JSON_LISTS + NOT_JSON_LISTS + extra):
        f = tmp_path / f"m{i}.json"
        f.write_text(text, encoding="utf-8")
        try:
            expected = parse_file(str(f))
        except ManifestError as exc:
            with pytest.raises(ManifestError) as got:
                parse_file_lean(str(f))
            assert str(got.value) == str(exc), text[:80]
        else:
            assert parse_file_lean(str(f)) == expected, text[:80]
    bad = tmp_path / "bad.json"      # not UTF-8 after the JSON began
    bad.write_bytes(json.dumps({"kind": "List", "items": cluster(1)}).encode()[:-2] + b"\xff]}")
    with pytest.raises(ManifestError, match="not UTF-8"):
        parse_file_lean(str(bad))


def test_a_json_list_growing_past_the_limit_while_read_is_a_transient_error(tmp_path, monkeypatch):
    from clusterdns.sources import manifest
    from clusterdns.sources.manifest import parse_file_lean
    monkeypatch.setattr(manifest, "STREAM_BYTES", 64)
    f = tmp_path / "m.json"
    text = json.dumps(as_list(cluster(3)))
    write(f, text)
    limit = len(text.encode()) + 10
    assert len(parse_file_lean(str(f), Limits(max_bytes=limit))[0]) == 6 + 1
    real = manifest._Window._read

    def growing(self, n):       # the file grows after its size was read
        data = real(self, n)
        if data and self.total >= 100:
            with open(f, "a") as fh:
                fh.write(" " * 20)
        return data
    monkeypatch.setattr(manifest._Window, "_read", growing)
    with pytest.raises(ManifestError, match="over the limit") as info:
        parse_file_lean(str(f), Limits(max_bytes=limit))
    assert info.value.transient


def test_a_json_list_read_item_by_item_keeps_the_object_budget(tmp_path):
    from clusterdns.sources.manifest import parse_json_list
    with pytest.raises(ManifestError, match="more than 6 objects"):
        parse_json_list(json.dumps(as_list(cluster(3) + [svc("x")])).encode(), "m.json", Limits(max_objects=6))
    records, _ = parse_json_list(json.dumps(as_list(cluster(3))).encode(), "m.json", Limits(max_objects=7))
    assert len(records) == 7


def test_a_big_json_list_is_read_in_the_process_and_a_big_yaml_file_in_the_worker(tmp_path, monkeypatch):
    """The first load of a big JSON List needs no worker; a big YAML file (or any other shape)
    still goes to one, and both give the same state."""
    import yaml

    import clusterdns.sources.manifest as manifest
    from clusterdns.synthetic import synthetic_records, to_manifest
    text = to_manifest(synthetic_records(services=1500, endpoints=2))
    as_json, as_yaml = tmp_path / "m.json", tmp_path / "m.yaml"
    write(as_json, text)
    write(as_yaml, yaml.safe_dump(json.loads(text)))
    assert min(as_json.stat().st_size, as_yaml.stat().st_size) >= manifest.WORKER_MIN_BYTES
    workers = []
    real = manifest.parse_in_worker
    monkeypatch.setattr(manifest, "parse_in_worker", lambda *a: workers.append(a[0]) or real(*a))
    states = []
    for f in (as_json, as_yaml):
        store = StateStore()
        assert ManifestSource(store, [str(f)]).load(strict=True)
        states.append(store.current)
    assert workers == [str(as_yaml)]
    assert len(states[0].services) == 1500 and states[0].services == states[1].services
    assert sum(len(s.endpoints) for s in states[0].slices.values()) == 3000
    assert states[0].slices == states[1].slices


async def test_a_reload_in_the_worker_keeps_the_served_objects_of_unchanged_records(tmp_path):
    """The worker's records equal to the served ones are replaced by those as they arrive: after
    a reload that changed one Service, the state and the source hold one copy of the others."""
    from clusterdns.sources.manifest import parse_in_worker_async
    f = tmp_path / "m.json"
    write_json(f, cluster(3))
    store = StateStore()
    src = ManifestSource(store, [str(f)])
    assert src.load(strict=True)
    before = store.current
    items = cluster(3)
    items[1]["spec"]["ports"][0]["port"] = 81          # one Service changes
    write_json(f, items)
    records, _ = await parse_in_worker_async(str(f), served=before)
    kept = [rec for kind, rec in records if rec is before.of_kind(kind).get(record_key(kind, rec))]
    fresh = [rec for kind, rec in records if rec not in kept]
    assert len(fresh) == 1 and fresh[0].ports[0].port == 81
    assert len(kept) == len(records) - 1 >= 6
    # without the served state, every record is a fresh copy
    alone, _ = await parse_in_worker_async(str(f))
    assert not any(rec is before.of_kind(kind).get(record_key(kind, rec)) for kind, rec in alone)


def test_the_worker_streams_a_json_list_and_voids_it_when_it_was_not_one(tmp_path):
    """A JSON List's records leave the worker as they are made; when the file turns out not to
    be a List (here a second "items" after the first, which json.loads lets win) the records
    sent so far are void and the file's whole parse is what counts."""
    from clusterdns.sources.manifest import _CHUNK, parse_file_lean, parse_in_worker
    items = cluster(_CHUNK)               # more than one chunk of records
    f = tmp_path / "m.json"
    write_json(f, items)
    chunks: list = []
    records, _ = parse_file_lean(str(f), flush=chunks.append)
    assert len(chunks) >= 2 and all(len(c) == _CHUNK for c in chunks)
    assert sum(len(c) for c in chunks) + len(records) == len(items)
    assert len(parse_in_worker(str(f))[0]) == len(items)
    text = json.dumps(as_list(items))
    write(f, text[:-1] + ', "items": [' + json.dumps(svc("late", ip="10.96.9.9")) + "]}")
    chunks = []
    records, _ = parse_file_lean(str(f), flush=chunks.append)
    assert chunks[-1] is None and len(chunks) >= 2      # streamed, then voided
    assert [r.name for _, r in records] == ["late"]
    got, _ = parse_in_worker(str(f))
    assert [r.name for _, r in got] == ["late"]
