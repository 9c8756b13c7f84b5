"""The manifest source: cluster state read from YAML or JSON files.

A file holds a `kind: List` with `items`, a single object, or a multi-document
YAML stream, as `kubectl get ... -o yaml` prints them. A changed file is
reloaded once it has settled; a broken one is reported (file, line, reason)
and its last good content kept. Invalid objects are skipped with a warning and
a metric.

Reading is bounded (Limits): file size, object count, nesting (the parsers'
own bounds) and YAML alias expansion. The long-running source parses in a
child process and streams the converted records back in small chunks, so a
big file never holds the event loop (DNS keeps answering the last good state)
and the parse's peak memory goes away with the child.
"""
from __future__ import annotations

import codecs
import json
import logging
import os
import pickle
import re
import struct
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, NamedTuple

from .. import forked
from ..errors import ManifestError
from ..lifetime import gc_paused, retain
from ..model import KINDS
from ..state import ClusterState, StateStore, group_by_kind, record_key
from .objects import API_VERSIONS, InvalidObject, convert, object_name

if TYPE_CHECKING:
    import asyncio
    import subprocess

    from .. import metrics
else:   # imported when first used: one-shot commands (rules, trace) need none of them (~60 ms)
    from ..lazy import module
    asyncio = module("asyncio")
    subprocess = module("subprocess")
    metrics = module("clusterdns.metrics")

log = logging.getLogger(__name__)

# yaml_rs: a Rust YAML 1.2 parser, ~20x faster than PyYAML's C loader, bounded nesting and
# aliases. Imported when the first YAML file is read (5.5 MiB of RSS and ~30 ms that a
# process reading only JSON never needs); None where no wheel exists for the platform.
yaml_rs: Any = False


def _yaml_rs() -> Any:
    global yaml_rs
    if yaml_rs is False:
        try:
            import yaml_rs as mod
            yaml_rs = mod
        except ImportError:  # pragma: no cover
            yaml_rs = None
    return yaml_rs

DEMO_MANIFEST = os.path.join(os.path.dirname(os.path.dirname(__file__)), "demo", "cluster.yaml")


@dataclass(frozen=True)
class Limits:
    """What one manifest file may hold; beyond it the file is refused as broken."""
    max_bytes: int = 256 * 1024 * 1024      # --manifest-max-bytes
    max_objects: int = 1_000_000            # --manifest-max-objects (items across the file)
    max_alias_nodes: int = 100_000          # YAML nodes produced by aliases (alias bombs)
    allow_shrink: bool = False              # --manifest-allow-shrink: accept a file that lost most objects


DEFAULT_LIMITS = Limits()
# A reload that keeps fewer than this share of the last good objects is refused
# (a file truncated or emptied in place), unless allow_shrink; small files are exempt.
SHRINK_KEEP = 0.5
SHRINK_MIN_OBJECTS = 20
# Files smaller than this are parsed in the process (a few milliseconds): a worker's
# start would cost more than it saves.
WORKER_MIN_BYTES = 256 * 1024


def limits_from(source: Any) -> Limits:
    """The limits of a config.SourceConfig (--manifest-max-bytes, ...)."""
    return Limits(max_bytes=source.manifest_max_bytes, max_objects=source.manifest_max_objects,
                  allow_shrink=source.manifest_allow_shrink)


@dataclass(frozen=True)
class Skipped:
    path: str
    kind: str
    name: str
    reason: str

    def __str__(self) -> str:
        return f"{self.path}: skipped {self.kind} {self.name}: {self.reason}"


def read_bytes(path: str, limits: Limits = DEFAULT_LIMITS) -> bytes:
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size > limits.max_bytes:
                raise ManifestError(path, None, f"{size} bytes is over the limit of {limits.max_bytes} "
                                                "(--manifest-max-bytes)")
            # the size read for: read(n) allocates n bytes first (the limit: 268 MB per read)
            raw = fh.read(size + 1)
            if len(raw) > size:   # growing while being read
                raw += fh.read(limits.max_bytes + 1 - len(raw))
    except OSError as exc:
        raise ManifestError(path, None, exc.strerror or str(exc), transient=True) from None
    if len(raw) > limits.max_bytes:   # grew while being read
        raise ManifestError(path, None, f"over the limit of {limits.max_bytes} bytes (--manifest-max-bytes)",
                            transient=True)
    return raw


_YAML_LINE = re.compile(r"line (\d+)")
_LEADING_SPACE = re.compile(r"\s*")   # what str.lstrip() skips, without copying the text


class Decoded(NamedTuple):
    """A manifest file's bytes, decoded and classified once for every reader below.
    raw: the bytes (for the nesting check), None once a reader let them go."""
    raw: bytes | None
    text: str       # the UTF-8 text, a byte order mark dropped
    first: str      # its first character past leading whitespace ("" when blank)

    @property
    def json(self) -> bool:
        return self.first in ("{", "[")


def decode(raw: bytes, path: str = "<input>") -> Decoded:
    """The one front end of the manifest readers; raises ManifestError when not UTF-8."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ManifestError(path, None, f"not UTF-8 text ({exc.reason})") from None
    if text.startswith("\ufeff"):
        text = text[1:]
    i = _LEADING_SPACE.match(text).end()   # type: ignore[union-attr]  # always matches
    return Decoded(raw, text, text[i:i + 1])


def parse_documents(raw: bytes | Decoded, path: str = "<input>", limits: Limits = DEFAULT_LIMITS) -> list[Any]:
    """Every top-level document of a file's bytes (or of their decode()); raises ManifestError."""
    src = raw if isinstance(raw, Decoded) else decode(raw, path)
    text = src.text
    if src.json:   # JSON (as kubectl -o json prints it): the fast parser
        try:
            return [json.loads(text)]
        except json.JSONDecodeError as exc:
            if exc.msg != "Extra data":   # "Extra data": a YAML stream of flow-style documents
                raise ManifestError(path, exc.lineno, exc.msg) from None
        except RecursionError:
            raise ManifestError(path, None, "nested too deeply") from None
        except ValueError as exc:   # e.g. an integer of more than 4300 digits
            raise ManifestError(path, None, str(exc)[:200]) from None
    try:
        _check_nesting(src.raw if src.raw is not None else text.encode("utf-8"))
        docs = _load_yaml(text, limits)
    except ManifestError as exc:
        raise ManifestError(path, exc.line, exc.reason) from None
    return [d for d in docs if d is not None]


# Block-style YAML nests by indentation and "- " / "? " / ": " indicators; the Rust
# parser recurses per level and overflows its stack somewhere past 10,000 levels. A run
# of this many of those characters is refused first, bounding block nesting well below
# that (flow nesting has the parser's own bound of about 256).
MAX_INDENT_RUN = 2048
_STRUCTURAL = bytes(0x78 if chr(c) in " \t-?:" else 0x0A for c in range(256))


def _check_nesting(raw: bytes) -> None:
    at = raw.translate(_STRUCTURAL).find(b"x" * MAX_INDENT_RUN)
    if at >= 0:
        raise ManifestError("", raw.count(b"\n", 0, at) + 1,
                            f"nested too deeply (a run of {MAX_INDENT_RUN} indentation or indicator characters)")


def _load_yaml(text: str, limits: Limits) -> list[Any]:
    yaml_rs = _yaml_rs()
    if yaml_rs is not None:
        try:
            data = yaml_rs.loads(text, parse_datetime=False,
                                 alias_limits=yaml_rs.AliasLimits(max_total_replayed_events=limits.max_alias_nodes))
        except (ValueError, RecursionError, OverflowError) as exc:
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            m = _YAML_LINE.search(first)
            reason = _YAML_LINE.sub("", first).replace("at , column", "at column").strip(" ,") or first
            raise ManifestError("", int(m.group(1)) if m else None, reason[:200]) from None
        # several documents come back as a list of them; one list document is flattened alike
        docs = data if isinstance(data, list) else [data]
        _check_keys(docs)
        return docs
    return _load_pyyaml(text, limits)   # pragma: no cover


def _check_keys(docs: list[Any]) -> None:
    """YAML 1.2 reads text such as `: : x` as mappings with null keys, which YAML 1.1
    (kubectl, PyYAML) refuses as broken; no Kubernetes document has a key that is not a
    string, so a document or object with one is a broken file, not an empty one."""
    for doc in docs:
        items = doc.get("items") if isinstance(doc, dict) else None
        for obj in [doc, *(items if isinstance(items, list) else ())]:
            if isinstance(obj, dict) and not all(isinstance(k, str) for k in obj):
                bad = next(k for k in obj if not isinstance(k, str))
                raise ManifestError("", None, f"a mapping key that is not a string ({_printable(bad)}): "
                                              "not a Kubernetes document")


def _load_pyyaml(text: str, limits: Limits) -> list[Any]:  # pragma: no cover - fallback
    import yaml
    loader_cls = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    try:
        loader = loader_cls(text)
        docs = []
        try:
            while loader.check_node():
                node = loader.get_node()
                _check_aliases(node, limits)
                docs.append(loader.construct_document(node))
        finally:
            loader.dispose()
        return docs
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        reason = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ManifestError("", mark.line + 1 if mark else None, reason) from None
    except RecursionError:
        raise ManifestError("", None, "nested too deeply") from None


def _check_aliases(root: Any, limits: Limits) -> None:  # pragma: no cover - fallback
    """Refuse a node graph whose expansion (aliases counted each time) is too big."""
    sizes: dict[int, int] = {}
    stack = [(root, False)]
    while stack:
        node, done = stack.pop()
        if id(node) in sizes:
            continue
        kids = node.value if isinstance(node.value, list) else []
        kids = [k for kid in kids for k in (kid if isinstance(kid, tuple) else (kid,))]
        if not done:
            stack.append((node, True))
            stack.extend((k, False) for k in kids if id(k) not in sizes)
            continue
        total = 1 + sum(sizes.get(id(k), 1) for k in kids)
        if total > limits.max_objects * 64 + limits.max_alias_nodes:
            raise ManifestError("", None, "YAML aliases expand beyond the limit")
        sizes[id(node)] = total


def read_documents(path: str, limits: Limits = DEFAULT_LIMITS) -> list[Any]:
    """Every top-level document of a file; raises ManifestError."""
    raw = read_bytes(path, limits)
    try:
        return parse_documents(raw, path, limits)
    except ManifestError as exc:
        if not exc.path:
            raise ManifestError(path, exc.line, exc.reason) from None
        raise


def _flatten(docs: Iterable[Any], limits: Limits) -> Iterator[Any]:
    """Objects of documents, Lists and lists, depth first; bounded in count and nesting."""
    count = 0
    stack: list[Iterator[Any]] = [iter(docs)]
    while stack:
        for item in stack[-1]:
            if isinstance(item, dict) and isinstance(item.get("kind"), str) and item["kind"].endswith("List") \
                    and isinstance(item.get("items"), list):
                item = item["items"]
            if isinstance(item, list):
                if len(stack) >= 32:
                    raise ManifestError("", None, "lists nested more than 32 deep")
                stack.append(iter(item))
                break
            count += 1
            if count > limits.max_objects:
                raise ManifestError("", None, f"more than {limits.max_objects} objects (--manifest-max-objects)")
            yield item
        else:
            stack.pop()


def records_from_documents(docs: Iterable[Any], path: str = "<input>", limits: Limits = DEFAULT_LIMITS,
                           flush: Callable[[list], None] | None = None,
                           ) -> tuple[list[tuple[str, Any]], list[Skipped]]:
    """Convert raw documents into (kind, record) pairs and the objects skipped.

    flush: given every _CHUNK records as they are made, which are then not returned (a
    caller that streams them never holds them all). Raises ManifestError when the documents
    break a limit."""
    records: list[tuple[str, Any]] = []
    skipped: list[Skipped] = []
    try:
        for obj in _flatten(docs, limits):
            if not isinstance(obj, dict):
                skipped.append(Skipped(path, "?", "?", f"not an object: {type(obj).__name__}"))
                continue
            kind = obj.get("kind")
            if kind not in KINDS:
                # Other kinds (Deployments, Endpoints...) are legitimately present in dumps.
                continue
            if obj.get("apiVersion") not in API_VERSIONS[kind]:
                skipped.append(Skipped(path, kind, _printable(object_name(obj)),
                                       f"unsupported apiVersion {_printable(obj.get('apiVersion'))}"))
                continue
            try:
                records.append((kind, convert(kind, obj)))
                if flush is not None and len(records) >= _CHUNK:
                    flush(records)
                    records = []
            except InvalidObject as exc:
                skipped.append(Skipped(path, kind, _printable(object_name(obj)), str(exc)))
            except RecursionError:
                skipped.append(Skipped(path, kind, _printable(object_name(obj)), "nested too deeply"))
    except ManifestError as exc:
        raise ManifestError(path, exc.line, exc.reason) from None
    return records, skipped


def _printable(value: Any) -> str:
    """Names from a hostile object end up in log lines: bounded and escaped."""
    text = value if isinstance(value, str) else repr(value)
    return text[:100] if text.isprintable() and text.isascii() else ascii(text[:100])


def parse_file(path: str, limits: Limits = DEFAULT_LIMITS, raw: bytes | Decoded | None = None,
               ) -> tuple[list[tuple[str, Any]], list[Skipped]]:
    """Read (unless its bytes, or their decode(), are given), parse and convert one file;
    raises ManifestError."""
    with gc_paused():
        if raw is None:
            raw = read_bytes(path, limits)
        src = raw if isinstance(raw, Decoded) else decode(raw, path)
        del raw
        pieces = _parse_in_pieces(src, path, limits)
        if pieces is not None:
            return pieces
        try:
            docs = parse_documents(src, path, limits)
        except ManifestError as exc:
            if not exc.path:
                raise ManifestError(path, exc.line, exc.reason) from None
            raise
        records = records_from_documents(docs, path, limits)
        retain(docs)
        del docs
    return records


# -- a big block-style `kind: List` parsed and converted piece by piece ----------------------
#
# YAML parsing is most of a large file's load. A `kind: List` as kubectl and PyYAML print it
# ("items:" at column 0, each item a line starting "- " at column 0) is cut at item lines
# into pieces of ~32 KB, each parsed and converted at once and its dicts freed, as a JSON
# List is read item by item: ~0.25 s less at 23 MB (the dicts are converted while in the
# CPU's caches) and the parse's peak memory one piece. When a CPU is idle and the process
# has one thread, a forked child does the later half of the pieces and sends its records
# back pickled. Any doubt (another layout, a parse error or a limit in any piece, an alias
# across pieces, nested lists) and the file is parsed whole as usual, so results and error
# messages are the whole-file parse's own.
PIECES_MIN_BYTES = 1024 * 1024
PIECE_BYTES = 32 * 1024
SPLIT_MIN_BYTES = 4 * 1024 * 1024   # and from this size on, in two processes when a CPU is idle
# A line that can neither continue an item nor start one: where the items end.
_ITEMS_END = re.compile(r"\n(?:[^ \n#-]|-[^ \n])")


def _items_region(text: str) -> tuple[int, int] | None:
    """(start of the first item, end of the last) of a top-level block `items:` sequence."""
    if text.startswith("items:\n"):
        start = len("items:\n")
    else:
        start = text.find("\nitems:\n")
        if start < 0:
            return None
        start += len("\nitems:\n")
    if not text.startswith("- ", start):
        return None
    m = _ITEMS_END.search(text, start - 1)
    return start, (m.start() + 1 if m else len(text))


def _pieces(text: str, start: int, end: int) -> list[tuple[int, int]]:
    """The items region cut at item lines about every PIECE_BYTES."""
    out = []
    while start < end:
        cut = text.find("\n- ", start + PIECE_BYTES, end)
        cut = end if cut < 0 else cut + 1
        out.append((start, cut))
        start = cut
    return out


def _convert_pieces(text: str, pieces: list[tuple[int, int]], path: str, limits: Limits,
                    ) -> tuple[list, list[Skipped]] | None:
    """Records and skips of the items in these pieces, or None where a piece is in doubt."""
    records: list = []
    skipped: list[Skipped] = []
    for start, end in pieces:
        items = _load_yaml(text[start:end], limits)
        # every "- " line at column 0 an item (the cuts were at items' starts), and no nested
        # lists, so that the items are the objects the whole file's limits count
        if type(items) is not list or len(items) != text.count("\n- ", start - 1, end):
            return None
        for item in items:
            if type(item) is list or (type(item) is dict and isinstance(item.get("kind"), str)
                                      and item["kind"].endswith("List")):
                return None
        r, k = records_from_documents([{"kind": "List", "items": items}], path, limits)
        del items
        records += r
        skipped += k
    return records, skipped


def _parse_in_pieces(src: bytes | Decoded, path: str, limits: Limits) -> tuple[list, list[Skipped]] | None:
    """parse_documents + records_from_documents piece by piece (see above), or None: then the
    caller parses the file whole. src: decode() of the file (bytes: decoded here)."""
    if isinstance(src, bytes):
        if len(src) < PIECES_MIN_BYTES:
            return None
        try:
            src = decode(src, path)
        except ManifestError:
            return None
    raw, text = src.raw, src.text
    if raw is None:
        raw = text.encode("utf-8")
    if len(raw) < PIECES_MIN_BYTES:
        return None
    if src.json:
        return None   # JSON: read item by item (parse_json_list)
    if _yaml_rs() is None:
        return None   # pragma: no cover - PyYAML's loader reads a piece's list as one document
    region = _items_region(text)
    if region is None:
        return None
    start, end = region
    if text.count("\n- ", start - 1, end) > limits.max_objects:
        return None   # the whole parse words the error
    try:
        _check_nesting(raw)
    except ManifestError:
        return None
    pieces = _pieces(text, start, end)
    # Each piece within its share of the alias budget: all of them stay within the file's.
    each = Limits(max_bytes=limits.max_bytes, max_objects=limits.max_objects,
                  max_alias_nodes=limits.max_alias_nodes // len(pieces), allow_shrink=limits.allow_shrink)
    try:
        # the rest of the file, "items:" empty: one List document and nothing else
        docs = _load_yaml(text[:start] + text[end:], each)
    except ManifestError:
        return None
    doc = docs[0] if len(docs) == 1 else None
    if not (isinstance(doc, dict) and isinstance(doc.get("kind"), str) and doc["kind"].endswith("List")
            and "items" in doc and doc["items"] is None):
        return None
    child = None
    if len(raw) >= SPLIT_MIN_BYTES and len(pieces) >= 2 and forked.worth_forking():
        # the child's share a little under half: it also pickles what this process unpickles
        cut = max(1, len(pieces) * 11 // 20)
        later = pieces[cut:]
        pieces = pieces[:cut]
        child = forked.Child(lambda: _convert_pieces(text, later, path, each))
    mine = theirs = None
    try:
        mine = _convert_pieces(text, pieces, path, each)
    except ManifestError:
        pass
    finally:
        if child is not None:
            try:
                theirs = child.result()
            except forked.ChildFailed:
                pass
    if mine is None or (child is not None and theirs is None):
        return None
    if theirs is not None:
        return mine[0] + theirs[0], mine[1] + theirs[1]
    return mine


class NotAJsonList(Exception):
    """The bytes are not one JSON `kind: ...List` object with `items` (or not valid JSON):
    the caller reads them the usual way, which also words any error."""


_JSON_WS = re.compile(r"[ \t\n\r]*")   # JSON's whitespace, as the json module skips it
_JSON_DECODE = json.JSONDecoder().raw_decode


# A JSON List is read this much at a time: the parse holds one window of the file's text
# (and one item's dicts), not the file's bytes and text (~45 MB at 10,000 x 10).
STREAM_BYTES = 1 << 20


class _ReadFailed(Exception):
    """A read error met while streaming a file (not a ManifestError, which
    records_from_documents would reword without its transient flag)."""

    def __init__(self, error: ManifestError) -> None:
        super().__init__(error)
        self.error = error


class _Window:
    """A file's text read STREAM_BYTES at a time (buf: what the parse has not consumed yet),
    under read_bytes's limits; or a whole text given at once (eof from the start)."""

    def __init__(self, fh: Any = None, path: str = "<input>", limits: Limits = DEFAULT_LIMITS,
                 text: str | None = None) -> None:
        self.fh, self.path, self.limits = fh, path, limits
        self.buf = text if text is not None else ""
        self.eof = text is not None
        self.total = 0
        self.raw: list[bytes] | None = []   # the bytes read, until start() found the format
        self._utf8 = codecs.getincrementaldecoder("utf-8")()
        if fh is not None:
            size = os.fstat(fh.fileno()).st_size
            if size > limits.max_bytes:
                raise ManifestError(path, None, f"{size} bytes is over the limit of {limits.max_bytes} "
                                                "(--manifest-max-bytes)")

    def _read(self, n: int) -> bytes:
        try:
            data = self.fh.read(n)
        except OSError as exc:
            raise _ReadFailed(ManifestError(self.path, None, exc.strerror or str(exc), transient=True)) from None
        self.total += len(data)
        if self.total > self.limits.max_bytes:   # grew while being read
            raise _ReadFailed(ManifestError(self.path, None, f"over the limit of {self.limits.max_bytes} bytes "
                                                             "(--manifest-max-bytes)", transient=True))
        return data

    def more(self, keep: int, grow: bool = False) -> int:
        """Drop buf[:keep] and read on; returns keep's index in the new buf (0). grow: the read
        doubles the window (a value longer than it is read in linear time). Raises
        UnicodeDecodeError (a ValueError) when the bytes are not UTF-8."""
        want = max(STREAM_BYTES, len(self.buf) - keep) if grow else STREAM_BYTES
        text = ""
        while not text and not self.eof:
            data = self._read(want)
            if self.raw is not None:
                self.raw.append(data)
            self.eof = not data
            text = self._utf8.decode(data, final=self.eof)
        self.buf = self.buf[keep:] + text
        return 0

    def start(self) -> str | None:
        """Reads up to the first character past leading whitespace (decode()'s `first`, "" when
        blank) and drops a byte order mark; None when the bytes read are not UTF-8."""
        try:
            self.more(0)
            if self.buf.startswith("\ufeff"):
                self.buf = self.buf[1:]
            i = 0
            while True:
                i = _LEADING_SPACE.match(self.buf, i).end()  # type: ignore[union-attr]  # always matches
                if i < len(self.buf) or self.eof:
                    return self.buf[i:i + 1]
                self.more(0)   # all kept: what JSON counts as whitespace is less
        except UnicodeDecodeError:
            return None

    def whole(self) -> bytes:
        """Every byte of the file (those start() read and the rest), as read_bytes gives them."""
        assert self.raw is not None
        raw = self.raw
        self.raw = None
        try:
            if not self.eof:
                raw.append(self._read(self.limits.max_bytes + 1 - self.total))
        except _ReadFailed as exc:
            raise exc.error from None
        return b"".join(raw)


def _json_list_items(src: str | _Window) -> Iterator[Any]:
    """The items of a JSON List object, each decoded when asked for, so that no more than one
    item's dicts exist at a time (json.loads of the whole builds every one first), from a text
    or a window on a file's text. The other top-level members are decoded as json.loads would;
    once the object is read, raises NotAJsonList unless it was a List with one `items` array
    and nothing after it."""
    w = src if isinstance(src, _Window) else _Window(text=src)
    match: Any = _JSON_WS.match   # always matches (possibly nothing)
    raw_decode = _JSON_DECODE

    def ws(i: int) -> int:
        """i past JSON whitespace (read on while it runs to the window's end)."""
        while True:
            i = match(w.buf, i).end()
            if i < len(w.buf) or w.eof:
                return i
            i = w.more(i)

    def char(i: int) -> tuple[str, int]:
        """The character at i ("" at the end of the text) and i (moved when read on)."""
        if i >= len(w.buf) and not w.eof:
            i = w.more(i)
        return w.buf[i:i + 1], i

    def decode(i: int) -> tuple[Any, int]:
        """The value at i and the index past it; one cut short by the window's end (or ending
        just there: a number might go on) is decoded again with more text."""
        while True:
            try:
                value, end = raw_decode(w.buf, i)
            except ValueError:
                if w.eof:
                    raise
            else:
                if end < len(w.buf) or w.eof:
                    return value, end
            i = w.more(i, grow=True)

    top: dict[str, Any] = {}
    items_seen = False
    try:
        i = ws(0)
        c, i = char(i)
        if c != "{":
            raise NotAJsonList
        i = ws(i + 1)
        while True:
            c, i = char(i)
            if c != '"':
                raise NotAJsonList
            key, i = decode(i)
            i = ws(i)
            c, i = char(i)
            if c != ":":
                raise NotAJsonList
            i = ws(i + 1)
            if key != "items":
                top[key], i = decode(i)
            else:
                c, i = char(i)
                if items_seen or c != "[":
                    raise NotAJsonList    # a second "items" (the last would win) or not an array
                items_seen = True
                i = ws(i + 1)
                c, i = char(i)
                if c == "]":
                    i += 1
                else:
                    while True:
                        item, i = decode(i)
                        yield item
                        del item
                        i = ws(i)
                        c, i = char(i)
                        i = ws(i + 1)
                        if c == "]":
                            break
                        if c != ",":
                            raise NotAJsonList
            i = ws(i)
            c, i = char(i)
            i = ws(i + 1)
            if c == "}":
                break
            if c != ",":
                raise NotAJsonList
    except (ValueError, RecursionError):   # json.JSONDecodeError (and UnicodeDecodeError) is a ValueError
        raise NotAJsonList from None
    kind = top.get("kind")
    if i < len(w.buf) or not items_seen or not isinstance(kind, str) or not kind.endswith("List"):
        raise NotAJsonList


def parse_json_list(raw: bytes | str, path: str = "<input>", limits: Limits = DEFAULT_LIMITS,
                    flush: Callable[[list], None] | None = None,
                    ) -> tuple[list[tuple[str, Any]], list[Skipped]]:
    """parse_file's result for a JSON List (as `kubectl get -o json` prints), each item converted
    as soon as it is decoded: the parse's peak memory is one item, not the whole document, so a
    long-running process can read a big file itself. Raises NotAJsonList for anything else
    (YAML, another JSON shape, broken JSON) and ManifestError past a limit. raw: the file's
    bytes, or its text (parse_file_lean reads a file's text a window at a time instead)."""
    if isinstance(raw, str):
        text = raw
    else:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise NotAJsonList from None
    if text.startswith("\ufeff"):
        text = text[1:]
    return _parse_json_window(_Window(text=text), path, limits, flush)


def _parse_json_window(w: _Window, path: str, limits: Limits, flush: Callable[[list], None] | None,
                       ) -> tuple[list[tuple[str, Any]], list[Skipped]]:
    with gc_paused():
        return records_from_documents(_json_list_items(w), path, limits, flush)


def parse_file_lean(path: str, limits: Limits = DEFAULT_LIMITS, flush: Callable[[list | None], None] | None = None,
                    whole: Callable[..., tuple[list[tuple[str, Any]], list[Skipped]]] | None = None,
                    ) -> tuple[list[tuple[str, Any]], list[Skipped]]:
    """parse_file, a JSON List read item by item (parse_json_list) from a window on the file's
    text; raises ManifestError. flush: as records_from_documents's, for a JSON List; flush(None)
    when what it was given is void (the file was not a List after all, and is parsed whole: all
    returned). whole(path, limits, raw): what parses any other file (parse_file; raw None when
    the file was read as JSON, else the decode() of its bytes)."""
    whole = whole or parse_file
    try:
        fh = open(path, "rb")
    except OSError as exc:
        raise ManifestError(path, None, exc.strerror or str(exc), transient=True) from None
    with fh:
        w = _Window(fh, path, limits)
        try:
            first = w.start()
        except _ReadFailed as exc:
            raise exc.error from None
        if first != "{":   # not a JSON object (or not UTF-8), so not a JSON List: parsed whole, decoded once
            return whole(path, limits, decode(w.whole(), path))
        w.raw = None   # the JSON read keeps no bytes
        try:
            return _parse_json_window(w, path, limits, flush)
        except NotAJsonList:
            if flush is not None:
                flush(None)
        except _ReadFailed as exc:
            raise exc.error from None
        del w
    return whole(path, limits, None)


def load_files(paths: Iterable[str], limits: Limits = DEFAULT_LIMITS) -> tuple[list[tuple[str, Any]], list[Skipped]]:
    """Load files at once (one-shot commands); raises ManifestError on the first broken file."""
    records: list[tuple[str, Any]] = []
    skipped: list[Skipped] = []
    files = []
    for path in paths:
        r, s = parse_file_lean(path, limits)   # a JSON List item by item: less memory, less time
        files.append((path, r))
        records += r
        skipped += s
    with gc_paused():
        for line in duplicates(files):
            log.warning("%s", line)
    return records, skipped


def report_skipped(skipped: Iterable[Skipped]) -> None:
    for s in skipped:
        log.warning("%s", s)
        metrics.invalid_objects.labels(s.kind).inc()


def duplicates(files: Iterable[tuple[str, list[tuple[str, Any]]]]) -> list[str]:
    """Messages for objects given more than once (the later one wins, as before)."""
    seen: dict[tuple[str, Any], str] = {}
    out = []
    for path, records in files:
        for kind, rec in records:
            key = (kind, record_key(kind, rec))
            first = seen.get(key)
            if first is not None:
                name = "/".join(key[1]) if isinstance(key[1], tuple) else key[1]
                out.append(f"{path}: {kind} {name} is also given in {first}; the later one is used")
            seen[key] = path
    return out


def publish(store: StateStore, records: Iterable[tuple[str, Any]]) -> bool:
    """Replace every kind in the store with these records, as one version; False when some
    object was given twice (the store holds fewer than it was given: see duplicates())."""
    by_kind = group_by_kind(records)
    with gc_paused(), store.batch():
        for kind in KINDS:
            store.replace(kind, by_kind[kind])
    return all(len(store.current.of_kind(kind)) == len(by_kind[kind]) for kind in KINDS)


# -- the parse worker: a child process, records streamed back in frames ------------------

_FRAME = struct.Struct("!Q")
_CHUNK = 200   # records per frame: unpickling one costs a few milliseconds of the event loop


def _worker_main(argv: list[str]) -> int:
    """`python -m clusterdns.sources.manifest PATH MAX_BYTES MAX_OBJECTS`: frames on stdout."""
    path, max_bytes, max_objects = argv[0], int(argv[1]), int(argv[2])
    out = sys.stdout.buffer

    def send(msg: Any) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        out.write(_FRAME.pack(len(data)))
        out.write(data)

    def stream(chunk: list | None) -> None:
        # a JSON List's records go as they are made: the worker never holds them all
        send(("records", chunk) if chunk is not None else ("reset",))

    try:
        records, skipped = parse_file_lean(path, Limits(max_bytes=max_bytes, max_objects=max_objects), stream)
    except ManifestError as exc:
        send(("error", exc.line, exc.reason, exc.transient))
        out.flush()
        return 0
    for i in range(0, len(records), _CHUNK):
        send(("records", records[i:i + _CHUNK]))
    send(("done", skipped))
    out.flush()
    return 0


def _worker_cmd(path: str, limits: Limits) -> list[str]:
    return [sys.executable, "-m", "clusterdns.sources.manifest", path, str(limits.max_bytes), str(limits.max_objects)]


def _worker_env() -> dict[str, str]:
    env = dict(os.environ)
    # the child must import this very package, wherever it was imported from
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


class _Collector:
    def __init__(self, path: str, served: ClusterState | None = None) -> None:
        self.path = path
        self.records: list[tuple[str, Any]] = []
        self.skipped: list[Skipped] = []
        self.done = False
        self.served = served

    def take(self, msg: tuple) -> None:
        if msg[0] == "records":
            self.records += msg[1] if self.served is None else _served_copies(self.served, msg[1])
        elif msg[0] == "reset":
            self.records = []        # the records so far are void: the worker parses the file again
        elif msg[0] == "done":
            self.skipped = msg[1]
            self.done = True
        elif msg[0] == "error":
            raise ManifestError(self.path, msg[1], msg[2], transient=msg[3])

    def result(self, rc: int | None, stderr: bytes) -> tuple[list[tuple[str, Any]], list[Skipped]]:
        if not self.done:
            tail = stderr.decode("utf-8", "replace").strip().splitlines()[-1:] or [f"exit code {rc}"]
            raise ManifestError(self.path, None, f"the parse worker failed: {tail[0][:200]}", transient=True)
        return self.records, self.skipped


def worker_timeout(path: str) -> float:
    """How long a parse worker may take: 60 s, and 2 s more per MB (~20x the usual)."""
    try:
        size = os.stat(path).st_size
    except OSError:
        size = 0
    return 60.0 + 2.0 * size / 1e6


def parse_in_worker(path: str, limits: Limits = DEFAULT_LIMITS) -> tuple[list[tuple[str, Any]], list[Skipped]]:
    """parse_file in a child process, blocking (a command's first load)."""
    try:
        proc = subprocess.run(_worker_cmd(path, limits), capture_output=True, env=_worker_env(), check=False,
                              timeout=worker_timeout(path))
    except subprocess.TimeoutExpired:
        raise ManifestError(path, None, f"parsing took longer than {worker_timeout(path):.0f} s") from None
    except OSError as exc:
        raise ManifestError(path, None, f"cannot start the parse worker: {exc}", transient=True) from None
    got = _Collector(path)
    data, pos = proc.stdout, 0
    with gc_paused():
        while pos + _FRAME.size <= len(data):
            (n,) = _FRAME.unpack_from(data, pos)
            pos += _FRAME.size
            got.take(pickle.loads(data[pos:pos + n]))
            pos += n
    return got.result(proc.returncode, proc.stderr)


def _served_copies(served: ClusterState, pairs: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """(kind, record) pairs with each record equal to the one `served` holds under its key replaced
    by that object. A reload's unchanged records are dropped frame by frame as they arrive: the
    fresh copies of a 10,000-Service file (~45 MB) never all live at once beside the served ones."""
    out = []
    tables = {kind: served.of_kind(kind) for kind in KINDS}
    for pair in pairs:
        kind, rec = pair
        table = tables.get(kind)
        was = table.get(record_key(kind, rec)) if table is not None else None
        out.append((kind, was) if was is not None and was == rec else pair)
    return out


async def parse_in_worker_async(path: str, limits: Limits = DEFAULT_LIMITS, served: ClusterState | None = None,
                                ) -> tuple[list[tuple[str, Any]], list[Skipped]]:
    """parse_file in a child process; the event loop runs between frames. served: the state now
    served, whose objects replace equal records as they arrive (see _served_copies)."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *_worker_cmd(path, limits), stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=_worker_env())
    except OSError as exc:
        raise ManifestError(path, None, f"cannot start the parse worker: {exc}", transient=True) from None
    got = _Collector(path, served)
    assert proc.stdout is not None and proc.stderr is not None
    stdout = proc.stdout
    errs = asyncio.ensure_future(proc.stderr.read())

    async def frames() -> int:
        while True:
            try:
                head = await stdout.readexactly(_FRAME.size)
            except asyncio.IncompleteReadError:
                break
            (n,) = _FRAME.unpack(head)
            body = await stdout.readexactly(n)
            with gc_paused():
                got.take(pickle.loads(body))
            await asyncio.sleep(0)   # let queries in between frames
        return await proc.wait()

    try:
        try:
            rc = await asyncio.wait_for(frames(), worker_timeout(path))
        except asyncio.TimeoutError:
            # content no parser should take this long on: not retried until the file changes
            raise ManifestError(path, None, f"parsing took longer than {worker_timeout(path):.0f} s") from None
        return got.result(rc, await errs)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        if not errs.done():
            errs.cancel()


# -- the long-running source ---------------------------------------------------------

class ManifestSource:
    """Feeds a StateStore from files and reloads them when they change.

    A change is read once the file has settled (the same size, mtime and inode
    at two polls in a row), so a writer rewriting in place is never read half
    way. A file that became empty or lost most of its objects is refused
    (ERROR, metric, `problems`) unless limits.allow_shrink; a failed read is
    retried at the next poll; broken content is reported once and kept out
    until the file changes again.
    """

    def __init__(self, store: StateStore, paths: list[str], interval: float = 0.2,
                 limits: Limits = DEFAULT_LIMITS, worker: bool = True) -> None:
        self.store = store
        self.paths = list(paths)
        self.interval = interval
        self.limits = limits
        self.worker = worker                          # parse in a child process
        self._good: dict[str, list[tuple[str, Any]]] = {}
        self._stamp: dict[str, tuple] = {}            # stamp of the content last dealt with
        self._seen: dict[str, tuple] = {}             # stamp at the previous poll (settling)
        self.errors: dict[str, ManifestError] = {}    # files whose last read or parse failed
        self.refused: dict[str, str] = {}             # files whose new content was refused, and why
        self.on_problem: Callable[[], None] | None = None
        self._retry: dict[str, tuple[int, float]] = {}  # failed reads: (failures, monotonic time of next try)

    def problems(self) -> list[str]:
        """One line per file not serving its current content (for /ready)."""
        out = [f"{p}: {r}" for p, r in self.refused.items()]
        out += [str(e) for p, e in self.errors.items() if p not in self.refused]
        return out

    @property
    def ready(self) -> bool:
        return all(p in self._good for p in self.paths)

    @staticmethod
    def _stat(path: str) -> tuple:
        try:
            st = os.stat(path)
            return (st.st_mtime_ns, st.st_size, st.st_ino, st.st_ctime_ns)
        except OSError:
            return ()

    def _due(self, settle: bool) -> list[tuple[str, tuple]]:
        """Files whose content changed since it was last dealt with (and has settled)."""
        due = []
        for path in self.paths:
            stamp = self._stat(path)
            previous, self._seen[path] = self._seen.get(path), stamp
            if self._stamp.get(path) == stamp and path in self._stamp:
                continue
            if settle and previous != stamp:
                continue   # changed since the last poll: wait until it holds still
            retry = self._retry.get(path)
            if settle and retry is not None and time.monotonic() < retry[1] and previous == stamp:
                continue   # a failed read is retried with backoff (up to 5 s) unless the file changes
            due.append((path, stamp))
        return due

    def _fail(self, path: str, stamp: tuple, exc: ManifestError, strict: bool) -> None:
        if exc.transient:   # the read failed, not the content: try again (stamp not recorded)
            n = self._retry.get(path, (0, 0.0))[0] + 1
            self._retry[path] = (n, time.monotonic() + min(5.0, self.interval * 2 ** n))
        else:               # broken content: not parsed again until the file changes
            self._stamp[path] = stamp
            self._retry.pop(path, None)
        if strict:
            raise exc
        if str(self.errors.get(path)) != str(exc):
            log.error("manifest %s; keeping the last good state", exc)
        self.errors[path] = exc
        metrics.source_errors.labels("manifest").inc()

    def _accept(self, path: str, stamp: tuple, records: list, skipped: list[Skipped]) -> bool:
        """Take a parsed file, or refuse it; True when it was taken."""
        self.errors.pop(path, None)
        self._retry.pop(path, None)
        self._stamp[path] = stamp   # the content is known: not parsed again until it changes
        old = self._good.get(path)
        if old is not None and not self.limits.allow_shrink and old:
            reason = None
            if not records:
                reason = f"now holds no objects (had {len(old)})"
            elif len(old) >= SHRINK_MIN_OBJECTS and len(records) < SHRINK_KEEP * len(old):
                reason = f"now holds {len(records)} objects, fewer than half of the {len(old)} it had"
            if reason is not None:
                reason += "; refused, serving the last good content (--manifest-allow-shrink accepts it)"
                if self.refused.get(path) != reason:
                    log.error("manifest %s: %s", path, reason)
                    metrics.source_errors.labels("manifest").inc()
                self.refused[path] = reason
                self._notify()
                return False
        self.refused.pop(path, None)
        report_skipped(skipped)
        self._good[path] = records
        log.info("loaded %s: %d objects, %d skipped", path, len(records), len(skipped))
        return True

    def _notify(self) -> None:
        if self.on_problem is not None:
            try:
                self.on_problem()
            except Exception:   # a watcher's bug must not stop the source
                log.exception("manifest problem callback failed")

    def _publish(self) -> bool:
        # Publish only once every file has loaded at least once: until then the
        # state is not complete, and DNS must not answer NXDOMAIN from it.
        if not self.ready:
            return False
        files = [(p, self._good[p]) for p in self.paths]
        if not publish(self.store, (r for _, recs in files for r in recs)):
            for line in duplicates(files):   # only then: naming them costs a pass over every record
                log.warning("%s", line)
        return True

    async def _publish_off_loop(self) -> bool:
        """_publish with the diff against the served state worked out in a thread (1-1.5 s of
        Python at 100,000 Services, which the GIL hands back to the loop every few ms)."""
        if not self.ready:
            return False
        files = [(p, self._good[p]) for p in self.paths]

        def prepare():
            with gc_paused():
                by_kind = group_by_kind(rec for _, recs in files for rec in recs)
                return duplicates(files), self.store.prepare_replace_all(by_kind)

        dups, prepared = await asyncio.to_thread(prepare)
        for line in dups:
            log.warning("%s", line)
        if not self.store.commit(prepared):   # another write came in between: the usual way
            publish(self.store, (r for _, recs in files for r in recs))
        return True

    def _parse_now(self, path: str, stamp: tuple) -> tuple[list[tuple[str, Any]], list[Skipped]]:
        """A blocking read. A big JSON List is read here item by item: its peak memory is one
        item, and the records need no trip through pickle (at 10,000 Services the worker's
        start, pickling and unpickling cost as much as the parse). Other big files go to a
        worker, whose peak memory (the whole document) goes away with it."""
        if not (self.worker and stamp and stamp[1] >= WORKER_MIN_BYTES):
            return parse_file(path, self.limits)
        return parse_file_lean(path, self.limits, whole=lambda p, limits, _raw: parse_in_worker(p, limits))

    def load(self, strict: bool = False) -> bool:
        """(Re)load changed files at once, in this process or a blocking worker; True if published.

        strict: a file that cannot be read raises ManifestError (the first load of a command)."""
        changed = False
        for path, stamp in self._due(settle=False):
            try:
                records, skipped = self._parse_now(path, stamp)
            except ManifestError as exc:
                self._fail(path, stamp, exc, strict)
                continue
            changed |= self._accept(path, stamp, records, skipped)
        if self.errors or self.refused:
            self._notify()
        return changed and self._publish()

    async def poll(self) -> bool:
        """One poll: read settled changed files off the event loop; True if published."""
        changed = False
        for path, stamp in self._due(settle=True):
            try:
                if not stamp:
                    read_bytes(path, Limits(max_bytes=0))   # raises the reason (no such file...)
                if self.worker and stamp[1] >= WORKER_MIN_BYTES:
                    records, skipped = await parse_in_worker_async(path, self.limits, self.store.current)
                else:
                    records, skipped = parse_file(path, self.limits)
            except ManifestError as exc:
                self._fail(path, stamp, exc, False)
                self._notify()
                continue
            if self._stat(path) != stamp:
                continue   # changed while it was read: read it again once it settles
            changed |= self._accept(path, stamp, records, skipped)
        return changed and await self._publish_off_loop()

    async def run(self) -> None:
        while True:
            try:
                await self.poll()
            except asyncio.CancelledError:
                raise
            except Exception:   # never end the source task: the last good state stays served
                log.exception("manifest poll failed; retrying")
                metrics.source_errors.labels("manifest").inc()
            await asyncio.sleep(self.interval)


if __name__ == "__main__":
    # Through the package's own module, so that pickled classes name it, not __main__.
    from clusterdns.sources.manifest import _worker_main as _main
    sys.exit(_main(sys.argv[1:]))
