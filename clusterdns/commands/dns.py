"""`clusterdns dns`: the DNS server alone, fed by manifest files or a cluster.

SIGTERM/SIGINT start a lameduck period of --lameduck seconds: DNS keeps
answering and /health stays OK while /ready turns 503, so endpoints are
withdrawn before the process goes; then it exits 0.
"""
from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal

from ..config import Config
from ..errors import UsageError
from ..lifetime import gc_paused
from ..sources import loader
from ..state import StateStore

log = logging.getLogger("clusterdns.dns")


async def serve(cfg: Config) -> int:
    from ..dns.server import DnsService, banner

    corefile = None
    if cfg.dns.corefile:
        from ..corefile.build import prepare
        corefile, cfg = prepare(cfg, os.environ.get("KUBE_DNS_SERVICE_HOST"))   # CorefileError -> exit 2
    store = StateStore()
    with gc_paused():
        source = loader.make_source(cfg, store)    # ManifestError -> exit 2
        service = DnsService(cfg, store, corefile=corefile,
                             reuse_port=corefile is not None and corefile.reload is not None)
        # The state and zone view just built live long: frozen, no collection walks them
        # (once collections resume, the first would scan all that was made while they were
        # paused, ~0.1 s at 10,000 Services for each step of the start, and find nothing).
        gc.freeze()
    # Signals are taken from the moment DNS answers (a SIGTERM before health is up still
    # gets its lameduck and exit 0).
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    try:
        await service.start()
    except OSError as exc:
        raise UsageError(exc.strerror or str(exc)) from None
    # Imported once DNS answers (the receive threads answer first-time questions on their
    # own): aiohttp's import takes ~0.1 s that the first answer need not wait for.
    from ..health import HealthServer
    health = HealthServer(cfg)
    health.add_ready_check("dns", lambda: service.synced)
    try:
        await health.start()
    except OSError as exc:
        await service.stop()
        raise UsageError(exc.strerror or str(exc)) from None
    log.info("%s", banner(service))
    for kind, label in (("health", "health and ready"), ("metrics", "metrics")):
        if health.bound_kinds.get(kind):
            log.info("%s on %s", label, ", ".join(f"{h}:{p}" for h, p in health.bound_kinds[kind]))

    reloader = None
    if corefile is not None and corefile.reload is not None:
        from ..corefile.reloader import Reloader
        holder = {"service": service}

        async def swap(new_corefile) -> None:
            # the new listeners bind beside the old (SO_REUSEPORT) before the old close
            new = DnsService(cfg, store, corefile=new_corefile, reuse_port=True)
            try:
                await new.start()
            except BaseException:
                new.detach()
                raise
            old = holder["service"]
            holder["service"] = new
            health.replace_check("dns", lambda: new.synced)
            await old.stop()
            old.detach()
        reloader = Reloader(cfg, corefile, swap, os.environ.get("KUBE_DNS_SERVICE_HOST"))
        reload_task = asyncio.ensure_future(reloader.run())
    source_task = asyncio.ensure_future(source.run())
    waiter = asyncio.ensure_future(stopping.wait())
    await asyncio.wait([waiter, source_task], return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if source_task.done() and not stopping.is_set():
        error = None if source_task.cancelled() else source_task.exception()
        log.error("state source stopped: %s", error or "ended")
        code = 1
    else:
        if cfg.agent.lameduck > 0:
            log.info("shutting down: lameduck for %gs (still answering, /ready 503)", cfg.agent.lameduck)
            health.lameduck = True
            await asyncio.sleep(cfg.agent.lameduck)
        log.info("shutting down")
    waiter.cancel()
    source_task.cancel()
    await asyncio.gather(source_task, return_exceptions=True)
    if reloader is not None:
        reload_task.cancel()
        await asyncio.gather(reload_task, return_exceptions=True)
        service = holder["service"]
    await service.stop()
    await health.stop()
    return code


def run(cfg: Config) -> int:
    loop_kind = cfg.agent.loop
    if loop_kind in ("auto", "uvloop"):
        try:
            import uvloop
            return uvloop.run(serve(cfg))
        except ImportError:
            if loop_kind == "uvloop":
                raise UsageError("--loop uvloop: uvloop is not installed") from None
    return asyncio.run(serve(cfg))
