"""`autopath [ZONE...] @kubernetes`: server-side search-path completion from the asking
pod's namespace (the kubernetes plugin's engine does it; needs `pods verified`)."""
from __future__ import annotations

from ..plugin import Plugin, SetupContext, normalize_zones
from ..syntax import Directive, plugin_error
from ._simple import no_block


class Autopath(Plugin):
    name = "autopath"

    def __init__(self, zones: list[str], where: str) -> None:
        self.zones, self.where = zones, where

    def describe(self) -> str:
        return " ".join(self.zones) + " @kubernetes"


def setup(d: Directive, ctx: SetupContext) -> Plugin:
    no_block(d)
    if not d.args:
        raise plugin_error(d, "expected a resolv.conf file or @kubernetes")
    source = d.values[-1]
    if source != "@kubernetes":
        raise plugin_error(d, f"{source}: only @kubernetes is supported (search paths from the pod's namespace)")
    return Autopath(normalize_zones(d.values[:-1], ctx.zones, d, "autopath"), d.where)
