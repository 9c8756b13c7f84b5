"""`reload [INTERVAL] [JITTER]`: re-read the Corefile (and what it imports) every
INTERVAL +- JITTER (default 30s, 15s; at least 2s and 1s) and serve the new one
when its content changed; a broken one is logged and the running one kept."""
from __future__ import annotations

from ..plugin import Plugin, SetupContext
from ..syntax import Directive, plugin_error
from ._simple import no_block, seconds


class Reload(Plugin):
    name = "reload"

    def __init__(self, interval: float, jitter: float, where: str) -> None:
        self.interval, self.jitter, self.where = interval, jitter, where

    def describe(self) -> str:
        return f"{self.interval:g}s jitter {self.jitter:g}s"


def setup(d: Directive, ctx: SetupContext) -> Plugin:
    no_block(d)
    if len(d.args) > 2:
        raise plugin_error(d, "at most an interval and a jitter")
    interval = seconds(d, d.values[0], "interval") if d.args else 30.0
    jitter = seconds(d, d.values[1], "jitter") if len(d.args) > 1 else interval / 2
    if interval < 2:
        raise plugin_error(d, f"interval value must be greater or equal to 2s: {d.values[0]}")
    if jitter < 1:
        raise plugin_error(d, f"jitter value must be greater or equal to 1s: {d.values[1]}")
    if jitter > interval / 2:
        raise plugin_error(d, "jitter value must be smaller than interval / 2")
    return Reload(interval, jitter, d.where)
