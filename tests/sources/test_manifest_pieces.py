"""A big block-style `kind: List` parsed piece by piece, the later pieces in a forked child
when a CPU is idle, gives exactly what the whole-file parse gives, or is parsed whole."""
import json
import threading

import pytest
import yaml

from clusterdns import forked
from clusterdns.errors import ManifestError
from clusterdns.sources import manifest
from clusterdns.sources.manifest import DEFAULT_LIMITS, Limits, parse_documents, records_from_documents
from clusterdns.synthetic import synthetic_records, to_manifest


@pytest.fixture
def children(monkeypatch):
    """Pieces of ~1.5 KB, the later ones in a child, whatever the file's size and the machine's
    load; the children made are counted in the list it returns. The process must have one
    thread (forking is safe only then): a thread an earlier test left running fails here, named."""
    monkeypatch.setattr(manifest, "PIECES_MIN_BYTES", 0)
    monkeypatch.setattr(manifest, "SPLIT_MIN_BYTES", 0)
    monkeypatch.setattr(manifest, "PIECE_BYTES", 1500)
    monkeypatch.setattr(forked, "idle_cpu", lambda: True)
    assert threading.active_count() == 1, f"threads left running by earlier tests: {threading.enumerate()}"
    children = []
    real = forked.Child
    monkeypatch.setattr(forked, "Child", lambda *a, **kw: children.append(1) or real(*a, **kw))
    return children


def whole(raw: bytes, path: str, limits=DEFAULT_LIMITS):
    return records_from_documents(parse_documents(raw, path, limits), path, limits)


def kubectl_yaml(services=40) -> bytes:
    """A List as kubectl prints it, with invalid objects and other kinds in both halves."""
    doc = json.loads(to_manifest(synthetic_records(services=services, endpoints=3)))
    items = doc["items"]
    n = len(items)
    bad_ip = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "bad-ip", "namespace": "ns-0"},
              "spec": {"clusterIP": 1234, "ports": [{"port": 80}]}}
    bad_name = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "Bad_Name", "namespace": "ns-0"},
                "spec": {"clusterIP": "10.96.99.1", "ports": [{"port": 80}]}}
    deploy = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web", "namespace": "ns-0"}}
    old_api = {"apiVersion": "discovery.k8s.io/v1beta1", "kind": "EndpointSlice", "metadata": {"name": "x"}}
    items[n // 4:n // 4] = [bad_ip, deploy]
    items[3 * n // 4:3 * n // 4] = [bad_name, old_api, "just a string"]
    text = yaml.dump(doc, Dumper=yaml.SafeDumper, default_flow_style=False)
    assert text.startswith("apiVersion: v1\nitems:\n- ")
    return text.encode()


def test_pieces_give_the_whole_files_records_and_skips(children, tmp_path):
    raw = kubectl_yaml()
    path = str(tmp_path / "c.yaml")
    got = manifest._parse_in_pieces(raw, path, DEFAULT_LIMITS)
    assert got is not None, "the file was not cut"
    assert children, "no child took the later pieces"
    assert len(manifest._pieces(raw.decode(), *manifest._items_region(raw.decode()))) > 10
    want = whole(raw, path)
    assert got == want
    assert [s.name for s in got[1]] == ["ns-0/bad-ip", "ns-0/Bad_Name", "x", "?"]   # in file order across the processes
    (tmp_path / "c.yaml").write_bytes(raw)
    assert manifest.parse_file(path) == want


def test_pieces_without_a_child_give_the_same(children, monkeypatch):
    monkeypatch.setattr(forked, "idle_cpu", lambda: False)
    raw = kubectl_yaml()
    assert manifest._parse_in_pieces(raw, "c.yaml", DEFAULT_LIMITS) == whole(raw, "c.yaml")
    assert not children


def test_a_block_list_with_keys_after_the_items_splits(children):
    raw = kubectl_yaml(10) + (b"metadata:\n  resourceVersion: ''\n"
                              b"extra:\n- apiVersion: v1\n  kind: Namespace\n  metadata:\n    name: extra\n")
    # "extra" holds a Namespace at column 0 after the items: not an item, so not a record
    got = manifest._parse_in_pieces(raw, "c.yaml", DEFAULT_LIMITS)
    assert got is not None and got == whole(raw, "c.yaml")


@pytest.mark.parametrize("change", ["alias", "quoted", "stream", "tab", "indented"])
def test_doubtful_layouts_are_parsed_whole(children, tmp_path, change):
    text = kubectl_yaml(20).decode()
    lines = text.split("\n")
    mid = next(i for i in range(len(lines) // 2, len(lines)) if lines[i].startswith("- "))
    if change == "alias":      # an anchor in an early piece used in a later one
        first = next(i for i, line in enumerate(lines) if line.startswith("  kind: Namespace"))
        lines[first] = "  kind: &k Namespace"
        lines[mid + 1:mid + 1] = ["  note: *k"]
    elif change == "quoted":   # a quoted scalar whose continuation line reads like an item
        lines[mid:mid] = ['  note: "starts here', '- and goes on"']
    elif change == "stream":   # a second document after the List
        lines += ["---", "apiVersion: v1", "kind: Namespace", "metadata:", "  name: later"]
    elif change == "tab":
        lines[mid:mid] = ["\tfoo: bar"]
    elif change == "indented":   # items indented under "items:": not the layout split
        lines = [lines[0], lines[1]] + ["  " + line if line else line for line in lines[2:]]
    raw = "\n".join(lines).encode()
    try:
        want = whole(raw, str(tmp_path / "c.yaml"))
    except ManifestError as exc:
        want = exc
    assert manifest._parse_in_pieces(raw, "c.yaml", DEFAULT_LIMITS) is None
    path = tmp_path / "c.yaml"
    path.write_bytes(raw)
    try:
        got = manifest.parse_file(str(path))
    except ManifestError as exc:
        got = exc
    assert (str(got) == str(want)) if isinstance(want, ManifestError) else (got == want)


def test_a_broken_later_piece_reports_the_whole_files_line(children, tmp_path):
    text = kubectl_yaml(20).decode()
    lines = text.split("\n")
    at = len(lines) * 3 // 4
    lines[at] = "  broken: [1, 2"
    path = tmp_path / "c.yaml"
    path.write_text("\n".join(lines))
    assert manifest._parse_in_pieces(path.read_bytes(), str(path), DEFAULT_LIMITS) is None
    with pytest.raises(ManifestError) as split_err:
        manifest.parse_file(str(path))
    with pytest.raises(ManifestError) as whole_err:
        whole(path.read_bytes(), str(path))
    assert str(split_err.value) == str(whole_err.value)
    assert split_err.value.line is not None and split_err.value.line > len(lines) // 2


def test_object_limit_counts_every_piece(children, tmp_path):
    raw = kubectl_yaml(20)
    n = len(yaml.safe_load(raw)["items"])
    path = tmp_path / "c.yaml"
    path.write_bytes(raw)
    tight = Limits(max_objects=n - 1)
    with pytest.raises(ManifestError, match="more than"):
        manifest.parse_file(str(path), tight)
    assert manifest.parse_file(str(path), Limits(max_objects=n)) == whole(raw, str(path))


def test_json_and_small_files_stay_whole_and_busy_ones_in_one_process(children, monkeypatch):
    text = to_manifest(synthetic_records(services=10, endpoints=2))
    assert manifest._parse_in_pieces(text.encode(), "c.json", DEFAULT_LIMITS) is None
    raw = kubectl_yaml(10)
    want = whole(raw, "c.yaml")
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:   # a fork copies only the calling thread: never a child in a process with others
        assert manifest._parse_in_pieces(raw, "c.yaml", DEFAULT_LIMITS) == want
    finally:
        stop.set()
        other.join()
    monkeypatch.setattr(forked, "idle_cpu", lambda: False)
    assert manifest._parse_in_pieces(raw, "c.yaml", DEFAULT_LIMITS) == want
    assert not children
    monkeypatch.setattr(manifest, "PIECES_MIN_BYTES", len(raw) + 1)
    assert manifest._parse_in_pieces(raw, "c.yaml", DEFAULT_LIMITS) is None


def test_nested_lists_are_parsed_whole(children):
    text = kubectl_yaml(20).decode()
    nested = "- apiVersion: v1\n  kind: List\n  items:\n  - apiVersion: v1\n    kind: Namespace\n    metadata:\n      name: inner\n"
    at = text.index("\n- ", len(text) // 2) + 1
    raw = (text[:at] + nested + text[at:]).encode()
    assert manifest._parse_in_pieces(raw, "c.yaml", DEFAULT_LIMITS) is None
    records, _ = whole(raw, "c.yaml")
    assert any(kind == "Namespace" and rec.name == "inner" for kind, rec in records)


PSI_CALM = "some avg10=0.40 avg60=0.20 avg300=0.10 total=123\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
PSI_BUSY = "some avg10=12.31 avg60=15.28 avg300=12.36 total=3214268291\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"


@pytest.mark.parametrize("loadavg,cpus,psi,idle", [
    ("0.10 0.20 0.30 1/120 4242\n", {0, 1}, PSI_CALM, True),    # only this process runnable, no waiting
    ("0.10 0.20 0.30 1/120 4242\n", {0, 1}, None, True),        # a kernel without PSI: the run queue alone
    ("1.90 2.10 2.20 1/120 4242\n", {0, 1}, PSI_BUSY, False),   # idle this instant, contended lately
    ("2.10 1.90 1.50 2/120 4242\n", {0, 1}, PSI_CALM, False),   # another task wants the other CPU
    ("0.10 0.20 0.30 1/120 4242\n", {0}, PSI_CALM, False),      # one CPU
    ("garbage\n", {0, 1}, PSI_CALM, False),
    ("0.10 0.20 0.30 1/120 4242\n", {0, 1}, "garbage\n", False),
])
def test_idle_cpu_reads_the_run_queue_and_the_pressure(tmp_path, monkeypatch, loadavg, cpus, psi, idle):
    path = tmp_path / "loadavg"
    path.write_text(loadavg)
    pressure = tmp_path / "pressure"
    if psi is not None:
        pressure.write_text(psi)
    monkeypatch.setattr(forked.os, "sched_getaffinity", lambda pid: cpus)
    assert forked.idle_cpu(str(path), str(pressure)) is idle
