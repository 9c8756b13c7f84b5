"""Choosing the state source a command reads: manifest files, a cluster, or the demo."""
from __future__ import annotations

from ..config import Config
from ..state import ClusterState, StateStore
from .manifest import DEMO_MANIFEST, ManifestSource, load_files, publish, report_skipped


def manifest_paths(cfg: Config) -> list[str]:
    return list(cfg.manifest) if cfg.manifest else [DEMO_MANIFEST]


def load_once(cfg: Config) -> ClusterState:
    """The state as it is now, for one-shot commands (rules, trace)."""
    store = StateStore()
    if cfg.kubeconfig:
        from .kube import list_once  # imported lazily: the client is slow to import
        list_once(cfg, store)
        return store.current
    records, skipped = load_files(manifest_paths(cfg))
    report_skipped(skipped)
    publish(store, records)
    return store.current


def make_source(cfg: Config, store: StateStore):
    """A long-running source with `run()` (a coroutine) feeding the store.

    Manifest files are checked once up front so that an unreadable file is a
    usage error (exit 2), not a silent empty cluster.
    """
    if cfg.kubeconfig:
        from .kube import KubeSource
        return KubeSource(cfg, store)
    paths = manifest_paths(cfg)
    source = ManifestSource(store, paths)
    source.load(strict=True)  # raises ManifestError; read and converted once (10,000 services: ~3 s each time)
    return source
