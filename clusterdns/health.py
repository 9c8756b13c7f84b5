"""The small HTTP server for /health, /ready and /metrics (CoreDNS's health, ready, prometheus).

One aiohttp application, bound on every distinct address of --health-listen
and --metrics-listen ('none' disables one; both may be the same address).
Components register readiness checks and extra paths (the proxier adds
/healthz and /livez):

    health = HealthServer(cfg)
    health.add_ready_check("dns", lambda: engine.synced)
    health.add_route("/livez", handler)      # aiohttp handler: async (request) -> Response
    await health.start()

/health answers 200 "OK" while the process runs, also during lameduck.
/ready answers 200 "OK" when every check passes, else 503 with the names of
the checks that do not (and "lameduck" while shutting down).
"""
from __future__ import annotations

import logging
from typing import Awaitable, Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .config import Config, parse_hostport
from .metrics import REGISTRY

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class HealthServer:
    def __init__(self, cfg: Config | None = None, *, addresses: list[tuple[str, int]] | None = None) -> None:
        if addresses is None:
            addresses = []
            for value in ((cfg.health_listen, cfg.metrics_listen) if cfg else ()):
                if value and value != "none":
                    hp = parse_hostport(value, 0)
                    if hp not in addresses:
                        addresses.append(hp)
        self.addresses = addresses
        self.lameduck = False
        self._checks: dict[str, Callable[[], bool]] = {}
        self._routes: dict[str, Handler] = {
            "/health": self._health, "/ready": self._ready, "/metrics": self._metrics}
        self._runner: web.AppRunner | None = None
        self.bound: list[tuple[str, int]] = []

    def add_ready_check(self, name: str, check: Callable[[], bool]) -> None:
        self._checks[name] = check

    def add_route(self, path: str, handler: Handler) -> None:
        """Serve one more GET path (before start())."""
        if self._runner is not None:
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

    async def _metrics(self, _request: web.Request) -> web.Response:
        body = generate_latest(REGISTRY)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def start(self) -> None:
        """Bind every address; raises OSError with the address when one cannot be bound."""
        if not self.addresses:
            return
        app = web.Application()
        for path, handler in self._routes.items():
            app.router.add_get(path, handler)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        try:
            for host, port in self.addresses:
                site = web.TCPSite(self._runner, host, port, reuse_address=True)
                try:
                    await site.start()
                except OSError as exc:
                    shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
                    raise OSError(exc.errno, f"cannot listen on {shown} (HTTP): {exc.strerror or exc}") from None
                for sock in site._server.sockets if site._server else []:   # the real port when 0 was asked
                    self.bound.append(sock.getsockname()[:2])
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
