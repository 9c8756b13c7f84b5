"""The reload plugin at run time: re-read the Corefile (imports included) every
interval +- jitter; a changed one is set up and served, a broken one is logged at
ERROR and counted in coredns_reload_failed_total while the running one keeps serving."""
from __future__ import annotations

import asyncio
import logging
import random
from typing import Awaitable, Callable

from ..config import Config
from ..dns import metrics
from .build import Corefile, load_corefile
from .syntax import CorefileError

log = logging.getLogger("clusterdns.corefile.reload")


class Reloader:
    def __init__(self, cfg: Config, current: Corefile, apply: Callable[[Corefile], Awaitable[None]],
                 dns_server: str | None = None) -> None:
        self.cfg, self.current, self.apply, self.dns_server = cfg, current, apply, dns_server
        self.reloads = 0
        self.failures = 0

    def _wait(self) -> float:
        interval, jitter = self.current.reload or (30.0, 15.0)
        return max(0.5, interval + random.uniform(-jitter, jitter))

    async def check(self) -> bool:
        """One look at the file; True when a new Corefile is now served."""
        try:
            new = await asyncio.to_thread(load_corefile, self.current.path, self.cfg, None, self.dns_server)
        except CorefileError as exc:
            return self._failed("Corefile changed but reload failed", exc)
        if new.digest == self.current.digest:
            return False
        try:
            await asyncio.to_thread(new.wait_loaded)
            await self.apply(new)
        except Exception as exc:
            return self._failed("could not serve the changed Corefile", exc)
        log.info("plugin/reload: Running configuration SHA512 = %s", new.digest)
        self.current = new
        self.reloads += 1
        return True

    def _failed(self, what: str, exc: Exception) -> bool:
        self.failures += 1
        metrics.reload_failed.inc()
        log.error("plugin/reload: %s: %s; the running configuration keeps serving", what, exc)
        return False

    async def run(self) -> None:
        while self.current.reload is not None:
            await asyncio.sleep(self._wait())
            await self.check()
