"""`clusterdns proxy`: the proxier alone (state source + Proxier + /healthz, /livez, /metrics).

`clusterdns proxy --cleanup` removes everything clusterdns installed and exits.
SIGTERM and SIGINT stop it cleanly; the rules stay in place, as kube-proxy's do,
so traffic keeps flowing while the proxier restarts.
"""
from __future__ import annotations

import asyncio
import logging
import signal

from ..config import Config
from ..health import HealthServer
from ..proxy.apply import ApplyError
from ..proxy.healthcheck import aiohttp_handler
from ..proxy.proxier import Proxier, cleanup
from ..sources.loader import make_source
from ..state import StateStore

log = logging.getLogger(__name__)


async def _serve(cfg: Config) -> int:
    store = StateStore()
    source = make_source(cfg, store)   # a broken manifest raises here: exit 2
    proxier = Proxier(cfg, store)
    health = HealthServer(cfg, roles=("proxy",))
    health.add_route("/healthz", aiohttp_handler(proxier.health.respond))
    health.add_route("/livez", aiohttp_handler(proxier.health.respond))
    health.add_ready_check("proxy", lambda: proxier.syncs > 0)
    await health.start()   # an address in use raises OSError: exit 1 with the reason

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
    await health.stop()
    log.info("proxy stopped (state version %d in the kernel)", proxier.applied_version)
    return rc


def run(cfg: Config) -> int:
    if cfg.run.cleanup:
        try:
            removed = asyncio.run(cleanup(cfg))
        except ApplyError as exc:
            log.error("cleanup failed: %s", exc)
            return 1
        log.info("cleanup: removed %s", ", ".join(removed) or "nothing (no clusterdns rules found)")
        return 0
    try:
        return asyncio.run(_serve(cfg))
    except OSError as exc:
        log.error("%s", exc)
        return 1
