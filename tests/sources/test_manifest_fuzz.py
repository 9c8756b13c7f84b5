"""Fuzzing the manifest loader: random structures, mutated objects, odd names and types,
huge and deep documents. The loader never raises, and after every file it serves either
what the file validly holds or the last good state; no invalid name ever reaches the state
or the rules."""
from __future__ import annotations

import copy
import json
import os
import re
import tempfile

import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from clusterdns.config import load
from clusterdns.proxy import iptables, nftables
from clusterdns.sources.manifest import Limits, ManifestSource
from clusterdns.state import StateStore

DNS1035 = re.compile(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?\Z")
DNS1123 = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?\Z")

SERVICE = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web", "namespace": "shop"},
           "spec": {"type": "NodePort", "clusterIP": "10.96.0.5", "externalIPs": ["192.0.2.1"],
                    "ports": [{"name": "http", "port": 80, "targetPort": "web", "nodePort": 30080,
                               "protocol": "TCP"}]}}
SLICE = {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
         "metadata": {"name": "web-abc", "namespace": "shop", "labels": {"kubernetes.io/service-name": "web"}},
         "addressType": "IPv4",
         "endpoints": [{"addresses": ["10.1.0.1"], "conditions": {"ready": True}, "nodeName": "n1",
                        "zone": "z1", "hostname": "web-0", "targetRef": {"kind": "Pod", "name": "web-0"}}],
         "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}]}
NAMESPACE = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "shop"}}
GOOD = [NAMESPACE, SERVICE, SLICE,
        {**copy.deepcopy(SERVICE), "metadata": {"name": "db", "namespace": "shop"},
         "spec": {"clusterIP": "10.96.0.6", "ports": [{"port": 5432}]}}]

odd_text = st.one_of(
    st.text(max_size=80),
    st.sampled_from(["", " ", "sp ace", 'qu"ote', "semi;colon", "caf\u00e9", "MySvc", "my_svc", "x" * 300,
                     "a\nb", "-", "0", "None", "10.96.0.300", "fe80::1%eth0", "::", "1e400", "\u202e", "\x00",
                     "${x}", "web", "http", "TCP", "udp", "10.96.0.5", "Local", "ClientIP"]))
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(min_value=-2, max_value=70000),
                    st.floats(allow_nan=True), odd_text)
values = st.recursive(scalars, lambda kids: st.one_of(st.lists(kids, max_size=4),
                                                        st.dictionaries(odd_text, kids, max_size=4)),
                      max_leaves=20)


def paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from paths(v, prefix + (i,))


def mutate(obj, path, value):
    obj = copy.deepcopy(obj)
    if not path:
        return value
    cur = obj
    for p in path[:-1]:
        cur = cur[p]
    cur[path[-1]] = value
    return obj


@st.composite
def mutated_objects(draw):
    base = draw(st.sampled_from([SERVICE, SLICE, NAMESPACE]))
    obj = base
    for _ in range(draw(st.integers(1, 3))):
        all_paths = list(paths(obj))
        obj = mutate(obj, draw(st.sampled_from(all_paths)), draw(values))
    return obj


@st.composite
def documents(draw):
    shape = draw(st.sampled_from(["list", "list", "stream", "random", "deep", "huge", "bytes", "alias"]))
    if shape == "bytes":
        return "bytes", draw(st.binary(max_size=300))
    if shape == "deep":
        n = draw(st.integers(1000, 150_000))
        unit = draw(st.sampled_from(["[", "{\"a\":", "- ", " ", "a:\n "]))
        return "text", unit * n
    if shape == "huge":   # many objects, some broken
        n = draw(st.integers(500, 3000))
        items = [mutate(SERVICE, ("metadata", "name"), f"s{i}") for i in range(n)]
        items += [draw(mutated_objects()) for _ in range(3)]
        return "json", {"apiVersion": "v1", "kind": "List", "items": items}
    if shape == "alias":
        k = draw(st.integers(2, 12))
        text = "a: &a [x, x, x, x, x, x, x, x]\n" + "".join(
            f"b{i}: &b{i} [{', '.join(['*a' if i == 0 else f'*b{i - 1}'] * 8)}]\n" for i in range(k))
        return "text", text
    items = [draw(st.one_of(mutated_objects(), values)) for _ in range(draw(st.integers(0, 6)))]
    items += [copy.deepcopy(o) for o in draw(st.lists(st.sampled_from(GOOD), max_size=4))]
    if shape == "random":
        return draw(st.sampled_from(["json", "yaml"])), draw(values)
    if shape == "stream":
        return "stream", items
    return draw(st.sampled_from(["json", "yaml"])), {"apiVersion": "v1", "kind": "List", "items": items}


def render(fmt, doc) -> bytes:
    if fmt == "bytes":
        return doc
    if fmt == "text":
        return doc.encode()
    if fmt == "json":
        return json.dumps(doc, allow_nan=True).encode()
    if fmt == "stream":
        return "\n---\n".join(yaml.safe_dump(d, allow_unicode=True) for d in doc).encode()
    return yaml.safe_dump(doc, allow_unicode=True).encode()


CFG = load(["rules", "--node-name", "n1", "--node-ip", "192.168.0.2"])


def check_state(state):
    for (ns, name), svc in state.services.items():
        assert DNS1123.match(ns) and DNS1035.match(name), (ns, name)
        for p in svc.ports:
            assert p.name == "" or DNS1123.match(p.name)
    for sl in state.slices.values():
        assert DNS1035.match(sl.service)
    for text in (iptables.render(state, CFG, 4).text, nftables.render(state, CFG, 4).text):
        assert text.isascii()


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(documents(), min_size=1, max_size=3))
@example([("bytes", b""), ("text", "kind: [unclosed\n")])     # emptied, then broken: both refused
def test_loader_never_raises_and_keeps_the_last_good_state(docs):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "m.yaml")
        with open(path, "w") as fh:
            json.dump({"apiVersion": "v1", "kind": "List", "items": GOOD}, fh)
        store = StateStore()
        src = ManifestSource(store, [path], worker=False, limits=Limits(max_objects=5000))
        assert src.load(strict=True)
        check_state(store.current)
        for fmt, doc in docs:
            before = store.current
            with open(path, "wb") as fh:
                fh.write(render(fmt, doc))
            st_ = os.stat(path)
            os.utime(path, ns=(st_.st_atime_ns, st_.st_mtime_ns + 1_000_000))
            published = src.load()          # never raises
            if published:
                check_state(store.current)
            else:
                assert store.current is before   # nothing served from a refused or broken file
            if not os.path.getsize(path):
                assert store.current is before   # an emptied file is refused


# -- the server stays up and answering while a fuzzer rewrites its manifest -------------

import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import dns.message  # noqa: E402
import dns.query  # noqa: E402
import dns.rcode  # noqa: E402
import pytest  # noqa: E402

from tests.netutil import free_port  # noqa: E402


@pytest.fixture(scope="module")
def fuzzed_server():
    tmp = tempfile.mkdtemp(prefix="clusterdns-fuzz-")
    path = os.path.join(tmp, "m.yaml")
    with open(path, "w") as fh:
        json.dump({"apiVersion": "v1", "kind": "List", "items": GOOD}, fh)
    port = free_port()
    log = open(os.path.join(tmp, "server.log"), "w+")
    proc = subprocess.Popen([sys.executable, "-m", "clusterdns", "dns", "--manifest", path,
                             "--listen", f"127.0.0.1:{port}", "--no-upstream", "--health-listen", "none",
                             "--metrics-listen", "none"], stdout=log, stderr=subprocess.STDOUT)
    query = dns.message.make_query("db.shop.svc.cluster.local", "A")
    for _ in range(100):
        try:
            if dns.query.udp(query, "127.0.0.1", port=port, timeout=0.5).answer:
                break
        except Exception:
            time.sleep(0.1)
    stats = {"asked": 0, "failed": []}
    stop = threading.Event()

    def probe():
        while not stop.is_set():
            try:
                r = dns.query.udp(query, "127.0.0.1", port=port, timeout=2.0)
                if r.rcode() not in (dns.rcode.NOERROR, dns.rcode.NXDOMAIN):
                    stats["failed"].append(dns.rcode.to_text(r.rcode()))
            except Exception as exc:   # a timeout: the server stalled or died
                stats["failed"].append(type(exc).__name__)
            stats["asked"] += 1
            time.sleep(0.02)

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    yield path, port, proc, stats
    stop.set()
    prober.join(5)
    proc.terminate()
    proc.wait(10)
    log.seek(0)
    assert "Traceback" not in log.read()


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(documents())
def test_server_keeps_answering_while_its_manifest_is_fuzzed(fuzzed_server, doc):
    path, port, proc, stats = fuzzed_server
    fmt, body = doc
    tmp = path + ".new"
    with open(tmp, "wb") as fh:
        fh.write(render(fmt, body))
    os.rename(tmp, path)
    time.sleep(0.6)                      # settle (two polls) and the parse
    assert proc.poll() is None, "the server exited"
    assert not stats["failed"], stats["failed"][:5]


def test_server_serves_the_good_file_again_after_the_fuzz(fuzzed_server):
    path, port, proc, stats = fuzzed_server
    # big enough not to be refused as a shrink of whatever the fuzzer left (up to ~3,000 objects)
    filler = [mutate(SERVICE, ("metadata", "name"), f"f{i}") for i in range(3100)]
    with open(path + ".new", "w") as fh:
        json.dump({"apiVersion": "v1", "kind": "List", "items": GOOD + filler}, fh)
    os.rename(path + ".new", path)
    query = dns.message.make_query("web.shop.svc.cluster.local", "A")
    for _ in range(100):
        r = dns.query.udp(query, "127.0.0.1", port=port, timeout=2.0)
        if r.answer and r.answer[0][0].address == "10.96.0.5":
            break
        time.sleep(0.1)
    assert r.answer and r.answer[0][0].address == "10.96.0.5"
    assert proc.poll() is None and stats["asked"] > 25 and not stats["failed"]
