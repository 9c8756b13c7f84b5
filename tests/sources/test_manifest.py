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
from clusterdns.state import StateStore

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


async def test_source_reloads_within_a_second(tmp_path):
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
            assert time.monotonic() - start < 1.0
            await asyncio.sleep(0.02)
    finally:
        task.cancel()
