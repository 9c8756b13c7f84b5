"""The small HTTP listeners: health (/health, /ready) and metrics (/metrics), each on its own port.

- --health-listen: /health, /ready and the routes components add (the proxier's
  /healthz and /livez). No /metrics.
- --healthz-bind-address (proxy role; kube-proxy's healthzBindAddress): /healthz
  and /livez only, retried like the proxy metrics listener when its own.
- --metrics-listen (DNS role): /metrics with the coredns_* registry (CoreDNS's :9153).
- --proxy-metrics-listen (proxy role): /metrics with the kubeproxy_* registry
  (kube-proxy's :10249), and /proxyMode (the mode, as kube-proxy answers it). The shared series (rest_client_*, clusterdns_*) go
  with it, or with the DNS registry when the process has no proxy listener.
  As kube-proxy does with its metrics server, a port that cannot be bound is
  logged and retried every 5 s instead of stopping the process.
'none' disables a listener. Two of them on one address share one server
(its routes and registries combined).

    health = HealthServer(cfg, roles=("dns", "proxy"))
    health.add_ready_check("dns", lambda: engine.synced)
    health.add_route("/livez", handler)      # aiohttp handler: async (request) -> Response
    await health.start()

/health answers 200 "OK" while the process runs, also during lameduck.
/ready answers 200 "OK" when every check passes, else 503 with the names of
the checks that do not (and "lameduck" while shutting down).
"""
from __future__ import annotations

import asyncio
import errno
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Awaitable, Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from . import metrics
from .config import Config, parse_hostport
from .lazy import module

if TYPE_CHECKING:
    from aiohttp import web
    Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
else:
    # aiohttp's import (~0.5 s) only once a listener starts: a restarted agent answers DNS first
    web = module("aiohttp.web")
    Handler = Callable

log = logging.getLogger(__name__)

RETRY_INTERVAL = 5.0   # kube-proxy retries its metrics server this often


@dataclass
class Listener:
    host: str
    port: int
    health: bool = False
    registries: list[CollectorRegistry] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)   # "health", "metrics", "proxy-metrics"
    optional: bool = False    # a bind failure is retried, not raised
    proxy_mode: str = ""      # served at /proxyMode, as kube-proxy's metrics server does
    ready: bool = False       # /ready alone (a Corefile's `ready` on its own address)
    paths: tuple[str, ...] = ()   # without `health`: only these added routes (kube-proxy's healthz server)

    @property
    def shown(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def plan(cfg: Config | None, roles: tuple[str, ...] = ("dns",)) -> list[Listener]:
    """The listeners a process with these roles serves for `cfg`."""
    out: dict[tuple[str, int], Listener] = {}

    def at(value: str) -> Listener | None:
        if not value or value == "none":
            return None
        host, port = parse_hostport(value, 0)
        return out.setdefault((host, port), Listener(host, port))

    if cfg is None:
        return []
    h = at(cfg.agent.health_listen)
    if h is not None:
        h.health = True
        h.kinds.append("health")
    for addr in filter(None, cfg.agent.ready_listen.split(",")):
        r = at(addr)
        if r is not None and not r.health and not r.ready:
            r.ready = True
            r.kinds.append("ready")
    proxy = at(cfg.agent.proxy_metrics_listen) if "proxy" in roles else None
    healthz = at(cfg.agent.proxy_health_listen) if "proxy" in roles else None
    if healthz is not None:
        healthz.paths = ("/healthz", "/livez")
        healthz.kinds.append("proxy-health")
    dns = at(cfg.agent.metrics_listen) if "dns" in roles else None
    if dns is not None:
        dns.registries.append(metrics.DNS)
        dns.kinds.append("metrics")
    if proxy is not None:
        proxy.registries += [metrics.PROXY, metrics.SHARED]
        proxy.kinds.append("proxy-metrics")
        proxy.proxy_mode = cfg.proxy.proxy_mode
        # Only a listener of its own may fail to bind without stopping the process.
        proxy.optional = proxy.kinds == ["proxy-metrics"] and not cfg.agent.bind_address_hard_fail
    elif dns is not None:
        dns.registries.append(metrics.SHARED)
    if healthz is not None:
        healthz.optional = healthz.kinds == ["proxy-health"] and not cfg.agent.bind_address_hard_fail
    return list(out.values())


class HealthServer:
    def __init__(self, cfg: Config | None = None, *, addresses: list[tuple[str, int]] | None = None,
                 roles: tuple[str, ...] = ("dns",), reuse_port: bool = False) -> None:
        if addresses is not None:
            # Everything on each address (tests, embedding).
            self.listeners = [Listener(h, p, True, [metrics.REGISTRY], ["health", "metrics"]) for h, p in addresses]
        else:
            self.listeners = plan(cfg, roles)
        self.lameduck = False
        # SO_REUSEPORT (the agent): a successor can bind the same ports while this process
        # runs (a DaemonSet rollout with maxSurge), as the DNS sockets do
        self.reuse_port = reuse_port
        self._checks: dict[str, Callable[[], bool]] = {}
        self._routes: dict[str, Handler] = {"/health": self._health, "/ready": self._ready}
        self._runners: list[web.AppRunner] = []
        self._retries: list[asyncio.Task] = []
        self._started = False
        self.bound: list[tuple[str, int]] = []
        self.bound_kinds: dict[str, list[tuple[str, int]]] = {}

    @property
    def addresses(self) -> list[tuple[str, int]]:
        return [(l.host, l.port) for l in self.listeners]

    def add_ready_check(self, name: str, check: Callable[[], bool]) -> None:
        self._checks[name] = check

    def replace_check(self, name: str, check: Callable[[], bool]) -> None:
        self._checks[name] = check

    def add_route(self, path: str, handler: Handler) -> None:
        """Serve one more GET path on the health listener (before start())."""
        if self._started:
            raise RuntimeError("routes must be added before start()")
        self._routes[path] = handler

    def not_ready(self) -> list[str]:
        """Names of the failing readiness checks (a check that raises fails)."""
        failing = ["lameduck"] if self.lameduck else []
        for name, check in self._checks.items():
            try:
                ok = bool(check())
            except Exception:
                log.exception("readiness check %s failed", name)
                ok = False
            if not ok:
                failing.append(name)
        return failing

    async def _health(self, _request: web.Request) -> web.Response:
        return web.Response(text="OK")

    async def _ready(self, _request: web.Request) -> web.Response:
        failing = self.not_ready()
        if failing:
            return web.Response(status=503, text="not ready: " + ", ".join(failing) + "\n")
        return web.Response(text="OK")

    @staticmethod
    def _metrics_handler(registries: list[CollectorRegistry]) -> Handler:
        view = registries[0] if len(registries) == 1 else metrics.UnionRegistry(registries)

        async def handle(_request: web.Request) -> web.Response:
            return web.Response(body=generate_latest(view), headers={"Content-Type": CONTENT_TYPE_LATEST})
        return handle

    def _app(self, listener: Listener) -> web.Application:
        app = web.Application()
        if listener.health or listener.paths:
            for path, handler in self._routes.items():
                if listener.health or path in listener.paths:
                    app.router.add_get(path, handler)
        if listener.ready and not listener.health:
            app.router.add_get("/ready", self._ready)
        if listener.registries:
            app.router.add_get("/metrics", self._metrics_handler(listener.registries))
        if listener.proxy_mode:
            mode = listener.proxy_mode

            async def proxy_mode(_request: web.Request) -> web.Response:
                return web.Response(text=mode)
            app.router.add_get("/proxyMode", proxy_mode)
        return app

    async def _bind(self, listener: Listener) -> None:
        runner = web.AppRunner(self._app(listener), access_log=None, handle_signals=False)
        await runner.setup()
        site = web.TCPSite(runner, listener.host, listener.port, reuse_address=True,
                           reuse_port=(self.reuse_port and listener.port != 0) or None)
        try:
            await site.start()
        except OSError as exc:
            await runner.cleanup()
            raise OSError(exc.errno, f"cannot listen on {listener.shown} (HTTP): {exc.strerror or exc}") from None
        self._runners.append(runner)
        for sock in site._server.sockets if site._server else []:   # the real port when 0 was asked
            addr = sock.getsockname()[:2]
            self.bound.append(addr)
            for kind in listener.kinds:
                self.bound_kinds.setdefault(kind, []).append(addr)

    async def _retry(self, listener: Listener) -> None:
        while True:
            await asyncio.sleep(RETRY_INTERVAL)
            try:
                await self._bind(listener)
            except OSError as exc:
                log.debug("%s; retrying in %gs", exc, RETRY_INTERVAL)
                continue
            log.info("now serving HTTP on %s", listener.shown)
            return

    async def start(self) -> None:
        """Bind every address; raises OSError with the address when one cannot be bound
        (an optional listener is retried in the background instead)."""
        self._started = True
        try:
            for listener in self.listeners:
                try:
                    await self._bind(listener)
                except OSError as exc:
                    # With SO_REUSEPORT (the agent), a port in use is held by a process that
                    # does not share it, such as a previous agent without SO_REUSEPORT during
                    # a maxSurge rollout: wait for it to go instead of ending this start.
                    if not listener.optional and not (self.reuse_port and exc.errno == errno.EADDRINUSE):
                        raise
                    log.error("%s; retrying every %gs", exc, RETRY_INTERVAL)
                    self._retries.append(asyncio.ensure_future(self._retry(listener)))
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        for task in self._retries:
            task.cancel()
        for task in self._retries:
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        self._retries.clear()
        for runner in self._runners:
            await runner.cleanup()
        self._runners.clear()
