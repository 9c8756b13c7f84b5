"""The manifest readers' one front end: a file's bytes are decoded and their format detected once
(manifest.decode), whichever reader (one-shot load_files, the source's parse_file_lean, the
piece-by-piece YAML reader, the whole-file parse) ends up with them."""
import json

import pytest
import yaml

from clusterdns.errors import ManifestError
from clusterdns.sources import manifest
from clusterdns.synthetic import synthetic_records, to_manifest


@pytest.fixture
def decodes(monkeypatch):
    """Counts manifest.decode's calls."""
    calls = []
    real = manifest.decode

    def counting(raw, path="<input>"):
        calls.append(path)
        return real(raw, path)
    monkeypatch.setattr(manifest, "decode", counting)
    return calls


def _files(tmp_path):
    doc = json.loads(to_manifest(synthetic_records(services=30, endpoints=3)))
    j = tmp_path / "c.json"
    j.write_text(json.dumps(doc))
    y = tmp_path / "c.yaml"
    y.write_text(yaml.safe_dump(doc, sort_keys=False))
    stream = tmp_path / "s.yaml"
    stream.write_text(yaml.safe_dump_all(doc["items"], sort_keys=False))
    flow = tmp_path / "flow.yaml"   # a YAML stream of JSON-looking documents
    flow.write_text("\n---\n".join(json.dumps(i) for i in doc["items"]))
    return doc, {"json": j, "yaml": y, "stream": stream, "flow": flow}


@pytest.mark.parametrize("pieces", [False, True], ids=["whole", "in-pieces"])
def test_each_file_is_decoded_once_whatever_reads_it(tmp_path, decodes, monkeypatch, pieces):
    if pieces:
        monkeypatch.setattr(manifest, "PIECES_MIN_BYTES", 0)
        monkeypatch.setattr(manifest, "SPLIT_MIN_BYTES", 1 << 40)   # no child: counted here
        monkeypatch.setattr(manifest, "PIECE_BYTES", 2000)
    doc, files = _files(tmp_path)
    want = manifest.records_from_documents([doc], "x")[0]
    for name, path in files.items():
        decodes.clear()
        records, skipped = manifest.parse_file_lean(str(path))
        assert sorted(map(repr, records)) == sorted(map(repr, want)), name
        # a JSON List is decoded a window at a time, never whole; a JSON-looking stream is tried
        # as one first, then read again and decoded once
        assert decodes == ([] if name == "json" else [str(path)]), name
        decodes.clear()
        assert manifest.parse_file(str(path)) == (records, skipped), name
        assert decodes == [str(path)], name


def test_a_json_object_that_is_no_list_is_read_again_after_its_bytes_were_let_go(tmp_path, decodes):
    """The JSON List reader keeps no bytes (peak memory); a JSON object that turns out to be no
    List is then read and decoded by the whole-file parse."""
    path = tmp_path / "one.json"
    path.write_text(json.dumps({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "a"}}))
    records, _ = manifest.parse_file_lean(str(path))
    assert [k for k, _ in records] == ["Namespace"]
    assert decodes == [str(path)]


@pytest.mark.parametrize(("raw", "first", "is_json"), [
    (b"", "", False),
    (b" \n\t ", "", False),
    (b"\xef\xbb\xbf  {\"kind\": \"List\"}", "{", True),
    (b"\n\n[1]", "[", True),
    (b"\xc2\xa0{}", "{", True),            # lstrip()'s whitespace, as the whole-file parse used
    (b"# c\n{}", "#", False),
    (b"kind: List\n", "k", False),
])
def test_decode_detects_the_format(raw, first, is_json):
    src = manifest.decode(raw)
    assert (src.first, src.json) == (first, is_json)
    assert not src.text.startswith("\ufeff") and src.raw is raw


def test_not_utf8_is_the_same_error_through_every_reader(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_bytes(b"kind: List\nitems: [\xff]\n")
    messages = set()
    for read in (manifest.parse_file, manifest.parse_file_lean, lambda p: manifest.load_files([p])):
        with pytest.raises(ManifestError) as info:
            read(str(path))
        messages.add(str(info.value))
    assert len(messages) == 1 and "not UTF-8" in messages.pop()
