"""The Kubernetes source: list+watch of the cluster into the StateStore.

Built on the official client's asyncio half (`kubernetes.aio`): its
configuration loaders (kubeconfig, in-cluster service account with token
rotation, exec plugins) and its aiohttp-based ApiClient, with our own
reflector per resource (see reflector.py) reading raw JSON.

Resources: Services, EndpointSlices and Namespaces always; Pods only for
`--pods verified` or autopath; the own Node (by field selector) when a node
name is known. Kinds not watched are marked synced (empty), as the manifest
source does, so "synced" means the same thing whatever the source.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
from typing import Any, Coroutine

import aiohttp

from ..config import Config
from ..errors import UsageError
from ..model import KINDS
from ..state import StateStore
from .reflector import (
    ENDPOINTSLICES,
    NAMESPACES,
    NODES,
    PODS,
    SERVICES,
    ApiError,
    ApiHealth,
    EventBatcher,
    Forbidden,
    Options,
    Reflector,
    Resource,
    Transport,
    forbidden_hint,
    list_records,
)

log = logging.getLogger(__name__)

IN_CLUSTER = "in-cluster"


def resources_for(cfg: Config) -> list[Resource]:
    """What this configuration needs watched."""
    out = [SERVICES, ENDPOINTSLICES, NAMESPACES]
    if cfg.dns.pods == "verified" or cfg.dns.autopath:
        out.append(PODS)
    if cfg.proxy.node_name:
        out.append(Resource(NODES.name, NODES.kind, NODES.path,
                            field_selector=f"metadata.name={cfg.proxy.node_name}"))
    return out


def _usage_error(message: str) -> Exception:
    return UsageError(message)


def _run_sync(coro: Coroutine) -> Any:
    """Run a coroutine to completion from sync code, even when a loop runs in this thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


async def _load_configuration(kubeconfig: str) -> tuple[Any, Any]:
    """(client Configuration, kubeconfig loader or None); raises UsageError."""
    from kubernetes.aio import client, config
    conf = client.Configuration()
    if kubeconfig == IN_CLUSTER:
        try:
            config.load_incluster_config(client_configuration=conf)
        except Exception as exc:   # ConfigException, OSError: all mean the same to the user
            raise _usage_error(f"in-cluster config: {_one_line(exc)} (set --kubeconfig, or run in a "
                               "pod with a service account and KUBERNETES_SERVICE_HOST/PORT)") from None
        loader = None
    else:
        # A KUBECONFIG list skips missing files, as kubectl does; one must exist.
        paths = [os.path.expanduser(p) for p in kubeconfig.split(os.pathsep) if p]
        present = [p for p in paths if os.path.exists(p)]
        if not present:
            raise _usage_error(f"kubeconfig {kubeconfig}: no such file")
        for path in present:
            if not os.path.isfile(path) or not os.access(path, os.R_OK):
                raise _usage_error(f"kubeconfig {path}: not a readable file")
        try:
            loader = await config.load_kube_config(config_file=os.pathsep.join(present),
                                                   client_configuration=conf, persist_config=False)
        except (AttributeError, TypeError, KeyError):
            raise _usage_error(f"kubeconfig {kubeconfig}: not a kubeconfig "
                               "(expected a mapping with clusters, users and contexts)") from None
        except Exception as exc:   # yaml errors, ConfigException, exec plugin failures
            raise _usage_error(f"kubeconfig {kubeconfig}: {_one_line(exc)}") from None
    # No hidden retries: the reflector owns retrying, with backoff and metrics.
    conf.retries = None
    conf.client_go_retries = False
    return conf, loader


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[:300]


def _transport(conf: Any) -> Transport:
    from kubernetes.aio import client
    return Transport(client.ApiClient(configuration=conf))


TOKEN_REFRESH_INTERVAL = 60.0   # seconds between checks of an exec-plugin or GCP token
FIRST_WAIT = 10.0               # at most this long for the `first` kinds' lists (KubeSource)


async def _token_refresher(loader: Any, conf: Any) -> None:
    """Keep exec-plugin and GCP tokens fresh (in-cluster tokens refresh by themselves).

    The client's refresh_token decides from the kubeconfig user: it loops for those two
    and returns at once for any other credentials (a static token, certificates)."""
    if loader is None or not loader.current_context["context"].get("user"):
        return   # in-cluster, or a context without a user: nothing to refresh
    from kubernetes.aio import config
    while True:
        try:
            await config.refresh_token(loader, conf, interval=TOKEN_REFRESH_INTERVAL)
            return
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("refreshing the API token failed: %s; retrying in %gs", _one_line(exc),
                        TOKEN_REFRESH_INTERVAL)
            await asyncio.sleep(TOKEN_REFRESH_INTERVAL)


class KubeSource:
    """List+watch every needed resource into the store until cancelled.

    `run()` never raises for API trouble: it logs, counts and retries with
    backoff while the store keeps serving the last state. An unusable
    kubeconfig is a UsageError from the constructor (exit code 2).
    """

    def __init__(self, cfg: Config, store: StateStore, first: tuple[str, ...] = (), **options: Any) -> None:
        self.cfg = cfg
        self.store = store
        self.first = first    # kinds listed before the others start (see run)
        self.options = Options(**options)
        self.resources = resources_for(cfg)
        self.synced = asyncio.Event()
        self.reflectors: dict[str, Reflector] = {}
        self.health: ApiHealth | None = None
        self._conf, self._loader = _run_sync(_load_configuration(cfg.source.kubeconfig))
        self._started = False

    @property
    def host(self) -> str:
        return str(self._conf.host)

    @property
    def api_ok(self) -> bool:
        """False while the liveness probe declares the API server unreachable (for /ready)."""
        return self.health is None or not self.health.down

    def not_synced(self) -> list[str]:
        """Resources whose first list has not completed yet."""
        return [r.name for r in self.resources
                if r.name not in self.reflectors or not self.reflectors[r.name].synced.is_set()]

    async def run(self) -> None:
        transport = _transport(self._conf)
        # The probe has its own client, so its connection is never one a watch holds.
        probe_transport = _transport(self._conf)
        self.health = ApiHealth(probe_transport, self.options)
        batcher = EventBatcher(self.store, self.options.batch_window, spacing=self.options.batch_spacing)
        self.reflectors = {r.name: Reflector(transport, r, batcher, self.options, self.health)
                           for r in self.resources}
        watched = {r.kind for r in self.resources}
        unwatched = [k for k in KINDS if k not in watched]
        if unwatched:
            self.store.mark_synced(*unwatched)
        log.info("watching %s at %s", ", ".join(r.name for r in self.resources), self.host)
        first = [ref for ref in self.reflectors.values() if ref.res.kind in self.first]
        tasks = [asyncio.create_task(ref.run() if not first or ref in first else self._after(first, ref),
                                     name=f"reflector-{name}")
                 for name, ref in self.reflectors.items()]
        tasks.append(asyncio.create_task(self.health.run(), name="kube-probe"))
        tasks.append(asyncio.create_task(self._wait_synced(), name="kube-synced"))
        tasks.append(asyncio.create_task(_token_refresher(self._loader, self._conf), name="kube-token"))
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            batcher.flush()
            await transport.close()
            await probe_transport.close()

    @staticmethod
    async def _after(first: list[Reflector], ref: Reflector) -> None:
        """ref's list+watch once `first` are listed (at most FIRST_WAIT seconds): a restarted
        agent answers a Service whose rules are in the kernel as soon as the Services are
        listed, sooner when the EndpointSlices' pages do not share the loop with theirs."""
        try:
            await asyncio.wait_for(asyncio.gather(*(f.synced.wait() for f in first)), FIRST_WAIT)
        except asyncio.TimeoutError:
            pass
        await ref.run()

    async def _wait_synced(self) -> None:
        await asyncio.gather(*(ref.synced.wait() for ref in self.reflectors.values()))
        log.info("all resources synced (state version %d)", self.store.current.version)
        self.synced.set()


def list_once(cfg: Config, store: StateStore, **options: Any) -> None:
    """One LIST of each resource, published as one version (for `rules`, `trace`).

    An unreachable or refusing API server is a UsageError: a one-shot command
    has no last state to fall back on.
    """
    opts = Options(**options)

    async def main() -> None:
        conf, _ = await _load_configuration(cfg.source.kubeconfig)
        transport = _transport(conf)
        results = {}
        try:
            for res in resources_for(cfg):
                try:
                    records, _rv = await list_records(transport, res, opts)
                except Forbidden as exc:
                    raise _usage_error(f"{forbidden_hint(res, 'list')} ({exc})") from None
                except ApiError as exc:
                    raise _usage_error(f"cannot list {res.name} from {conf.host}: {exc}") from None
                except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError) as exc:
                    raise _usage_error(f"cannot list {res.name} from {conf.host}: "
                                       f"{_one_line(exc) or type(exc).__name__}") from None
                results[res.kind] = records
        finally:
            await transport.close()
        with store.batch():
            for kind in KINDS:
                store.replace(kind, results.get(kind, []))

    _run_sync(main())


__all__ = ["IN_CLUSTER", "KubeSource", "list_once", "resources_for"]
