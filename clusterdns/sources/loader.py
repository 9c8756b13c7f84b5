"""Choosing the state source a command reads: manifest files, a cluster, or the demo."""
from __future__ import annotations

from ..config import Config
from ..state import ClusterState, StateStore
from .manifest import DEMO_MANIFEST, ManifestSource, limits_from, load_files, publish, report_skipped


def manifest_paths(cfg: Config) -> list[str]:
    return list(cfg.source.manifest) if cfg.source.manifest else [DEMO_MANIFEST]


def load_once(cfg: Config) -> ClusterState:
    """The state as it is now, for one-shot commands (rules, trace)."""
    store = StateStore()
    if cfg.source.kubeconfig:
        from .kube import list_once  # imported lazily: the client is slow to import
        list_once(cfg, store)
        return store.current
    records, skipped = load_files(manifest_paths(cfg), limits_from(cfg.source))   # in this process: fastest
    report_skipped(skipped)
    publish(store, records)
    return store.current


def make_source(cfg: Config, store: StateStore, strict: bool = True, first: tuple[str, ...] = ()):
    """A long-running source with `run()` (a coroutine) feeding the store.

    strict (a command's start): manifest files are read once up front, so that
    an unreadable file is a usage error (exit 2), not a silent empty cluster.
    Not strict (a reload): nothing is read here; the source keeps polling, and
    the store keeps the last good state until every file has loaded.
    first: kinds a cluster source lists before the others (a manifest is read whole).
    """
    if cfg.source.kubeconfig:
        from .kube import KubeSource
        return KubeSource(cfg, store, first=first)
    source = ManifestSource(store, manifest_paths(cfg), limits=limits_from(cfg.source))
    if strict:
        source.load(strict=True)  # raises ManifestError
    return source
