"""`clusterdns agent`: the node agent (watch + DNS + proxier), see clusterdns/agent.py.

SIGTERM/SIGINT: lameduck for --lameduck seconds (DNS keeps answering, /health
OK, /ready 503), then exit 0; a second signal exits at once. SIGHUP, or a
change of the --config file, reloads the configuration; a bad one is
reported and the running one kept.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import sys

from ..agent import Agent
from ..config import Config
from ..errors import UsageError
from ..localdns import LocalDNSError

log = logging.getLogger("clusterdns.agent")


async def serve(cfg: Config, argv: list[str] | None) -> int:
    agent = Agent(cfg, argv=argv)
    loop = asyncio.get_running_loop()
    signals = {"n": 0}
    started = False
    reload_asked = False

    def on_stop() -> None:
        signals["n"] += 1
        if signals["n"] > 1:
            log.warning("second signal: exiting now")
            for task in asyncio.all_tasks(loop):
                task.cancel()
            return
        agent.begin_shutdown()

    def on_hup() -> None:
        nonlocal reload_asked
        if started:
            asyncio.ensure_future(agent.reload())
        else:
            reload_asked = True     # once the start is done

    # Signals are taken from the start: DNS may answer before it is over (health listens
    # after DNS), and a SIGTERM then still gets its lameduck and exit 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_stop)
    loop.add_signal_handler(signal.SIGHUP, on_hup)
    try:
        await agent.start()
    except OSError as exc:            # an address in use or not local
        await agent.stop()
        raise UsageError(str(exc)) from None
    except LocalDNSError as exc:      # e.g. not allowed to create the device
        await agent.stop()
        log.error("local DNS addresses: %s", exc)
        return 1
    except BaseException:
        await agent.stop()
        raise
    started = True
    print(agent.banner(), file=sys.stderr, flush=True)
    if reload_asked:
        asyncio.ensure_future(agent.reload())
    try:
        return await agent.wait()
    except asyncio.CancelledError:
        return 0


def run(cfg: Config) -> int:
    argv = sys.argv[1:] if sys.argv and sys.argv[1:2] == ["agent"] else None
    if cfg.agent.loop in ("auto", "uvloop"):
        try:
            import uvloop
        except ImportError:
            if cfg.agent.loop == "uvloop":
                raise UsageError("--loop uvloop: uvloop is not installed") from None
        else:
            return uvloop.run(serve(cfg, argv))
    return asyncio.run(serve(cfg, argv))
