"""The manifest source: cluster state read from YAML or JSON files.

A file holds a `kind: List` with `items`, a single object, or a multi-document
YAML stream, as `kubectl get ... -o yaml` prints them. A changed file is
reloaded; a broken one is reported (file, line, reason) and its last good
content kept. Invalid objects are skipped with a warning and a metric.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Iterable

import yaml

from .. import metrics
from ..errors import ManifestError
from ..model import KINDS
from ..state import StateStore
from .objects import API_VERSIONS, InvalidObject, convert, object_name

log = logging.getLogger(__name__)

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

DEMO_MANIFEST = os.path.join(os.path.dirname(os.path.dirname(__file__)), "demo", "cluster.yaml")


@dataclass(frozen=True)
class Skipped:
    path: str
    kind: str
    name: str
    reason: str

    def __str__(self) -> str:
        return f"{self.path}: skipped {self.kind} {self.name}: {self.reason}"


def read_documents(path: str) -> list[Any]:
    """Every top-level document of a file; raises ManifestError."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except OSError as exc:
        raise ManifestError(path, None, exc.strerror or str(exc)) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ManifestError(path, None, f"not UTF-8 text ({exc.reason})") from None
    if text.lstrip().startswith(("{", "[")):
        try:
            return [json.loads(text)]
        except json.JSONDecodeError as exc:
            raise ManifestError(path, exc.lineno, exc.msg) from None
    try:
        return [d for d in yaml.load_all(text, Loader=_Loader) if d is not None]
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        reason = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ManifestError(path, mark.line + 1 if mark else None, reason) from None


def _flatten(doc: Any) -> Iterable[Any]:
    if isinstance(doc, list):
        for item in doc:
            yield from _flatten(item)
    elif isinstance(doc, dict) and isinstance(doc.get("kind"), str) and doc["kind"].endswith("List") \
            and isinstance(doc.get("items"), list):
        for item in doc["items"]:
            yield from _flatten(item)
    else:
        yield doc


def records_from_documents(docs: Iterable[Any], path: str = "<input>") -> tuple[list[tuple[str, Any]], list[Skipped]]:
    """Convert raw documents into (kind, record) pairs and the objects skipped."""
    records: list[tuple[str, Any]] = []
    skipped: list[Skipped] = []
    for obj in (o for d in docs for o in _flatten(d)):
        if not isinstance(obj, dict):
            skipped.append(Skipped(path, "?", "?", f"not an object: {type(obj).__name__}"))
            continue
        kind = obj.get("kind")
        if kind not in KINDS:
            # Other kinds (Deployments, Endpoints...) are legitimately present in dumps.
            log.debug("%s: ignoring kind %r", path, kind)
            continue
        if obj.get("apiVersion") not in API_VERSIONS[kind]:
            skipped.append(Skipped(path, kind, object_name(obj),
                                   f"unsupported apiVersion {obj.get('apiVersion')!r}"))
            continue
        try:
            records.append((kind, convert(kind, obj)))
        except InvalidObject as exc:
            skipped.append(Skipped(path, kind, object_name(obj), str(exc)))
    return records, skipped


def load_files(paths: Iterable[str]) -> tuple[list[tuple[str, Any]], list[Skipped]]:
    """Load files at once (one-shot commands); raises ManifestError on the first broken file."""
    records: list[tuple[str, Any]] = []
    skipped: list[Skipped] = []
    for path in paths:
        r, s = records_from_documents(read_documents(path), path)
        records += r
        skipped += s
    return records, skipped


def report_skipped(skipped: Iterable[Skipped]) -> None:
    for s in skipped:
        log.warning("%s", s)
        metrics.invalid_objects.labels(s.kind).inc()


def publish(store: StateStore, records: Iterable[tuple[str, Any]]) -> None:
    """Replace every kind in the store with these records, as one version."""
    by_kind: dict[str, list] = {k: [] for k in KINDS}
    for kind, rec in records:
        by_kind[kind].append(rec)
    with store.batch():
        for kind in KINDS:
            store.replace(kind, by_kind[kind])


class ManifestSource:
    """Feeds a StateStore from files and reloads them when they change."""

    def __init__(self, store: StateStore, paths: list[str], interval: float = 0.2) -> None:
        self.store = store
        self.paths = list(paths)
        self.interval = interval
        self._good: dict[str, list[tuple[str, Any]]] = {}
        self._stamp: dict[str, tuple] = {}
        self.errors: dict[str, ManifestError] = {}

    def _stat(self, path: str) -> tuple:
        try:
            st = os.stat(path)
            return (st.st_mtime_ns, st.st_size, st.st_ino)
        except OSError:
            return ()

    def load(self, strict: bool = False) -> bool:
        """(Re)load changed files and publish; True if anything was published.

        strict: a file that cannot be read raises ManifestError (the first load of a command)."""
        changed = False
        for path in self.paths:
            stamp = self._stat(path)
            if path in self._stamp and self._stamp[path] == stamp:
                continue
            self._stamp[path] = stamp
            try:
                records, skipped = records_from_documents(read_documents(path), path)
            except ManifestError as exc:
                if strict:
                    raise
                if str(self.errors.get(path)) != str(exc):
                    log.error("manifest %s; keeping the last good state", exc)
                self.errors[path] = exc
                metrics.source_errors.labels("manifest").inc()
                continue
            self.errors.pop(path, None)
            report_skipped(skipped)
            self._good[path] = records
            changed = True
            log.info("loaded %s: %d objects, %d skipped", path, len(records), len(skipped))
        # Publish only once every file has loaded at least once: until then the
        # state is not complete, and DNS must not answer NXDOMAIN from it.
        if changed and all(p in self._good for p in self.paths):
            publish(self.store, (r for p in self.paths for r in self._good[p]))
            return True
        return False

    async def run(self) -> None:
        self.load()
        while True:
            await asyncio.sleep(self.interval)
            self.load()
