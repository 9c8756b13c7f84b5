"""`clusterdns proxy`: the proxier alone (state source + Proxier + health + metrics).

`clusterdns proxy --cleanup` removes everything clusterdns installed and exits.
SIGTERM and SIGINT stop it cleanly; the rules stay in place, as kube-proxy's do,
so traffic keeps flowing while the proxier restarts.
"""
from __future__ import annotations

import asyncio
import logging
import signal

from ..config import Config, parse_hostport
from ..proxy.apply import ApplyError
from ..proxy.healthcheck import start_http
from ..proxy.proxier import Proxier, cleanup
from ..sources.loader import make_source
from ..state import StateStore

log = logging.getLogger(__name__)


async def _serve(cfg: Config) -> int:
    store = StateStore()
    source = make_source(cfg, store)   # a broken manifest raises here: exit 2
    proxier = Proxier(cfg, store)
    servers = []
    if cfg.health_listen and cfg.health_listen != "none":
        host, port = parse_hostport(cfg.health_listen, 10256)
        servers.append(await start_http(host, port, proxier.health.respond))
    if cfg.metrics_listen and cfg.metrics_listen != "none":
        servers.append(await _start_metrics(cfg.metrics_listen))

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    tasks = [asyncio.create_task(source.run(), name="source"),
             asyncio.create_task(proxier.run(), name="proxier")]
    waiter = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait(tasks + [waiter], return_when=asyncio.FIRST_COMPLETED)
    rc = 0
    for t in done:
        if t is not waiter and t.exception() is not None:
            log.error("%s stopped: %s", t.get_name(), t.exception())
            rc = 1
    await proxier.stop()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    waiter.cancel()
    for s in servers:
        s.close()
    log.info("proxy stopped (state version %d in the kernel)", proxier.applied_version)
    return rc


async def _start_metrics(listen: str):
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    from ..metrics import REGISTRY

    def respond(path: str):
        if path != "/metrics":
            return 404, {"Content-Type": "text/plain"}, b"404 page not found\n"
        return 200, {"Content-Type": CONTENT_TYPE_LATEST}, generate_latest(REGISTRY)

    host, port = parse_hostport(listen, 9153)
    return await start_http(host, port, respond)


def run(cfg: Config) -> int:
    if cfg.cleanup:
        try:
            removed = asyncio.run(cleanup(cfg))
        except ApplyError as exc:
            log.error("cleanup failed: %s", exc)
            return 1
        log.info("cleanup: removed %s", ", ".join(removed) or "nothing (no clusterdns rules found)")
        return 0
    return asyncio.run(_serve(cfg))
