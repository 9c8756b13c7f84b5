"""`ready [ADDRESS]`: /ready on ADDRESS (default :8181): 200 once every block's
kubernetes plugin has its first state (and the agent its first rule sync)."""
from __future__ import annotations

from ..plugin import Plugin, SetupContext
from ..syntax import Directive, plugin_error
from ._simple import address, no_block


class Ready(Plugin):
    name = "ready"

    def __init__(self, listen: str, where: str) -> None:
        self.listen, self.where = listen, where

    def describe(self) -> str:
        return self.listen


def setup(d: Directive, ctx: SetupContext) -> Plugin:
    no_block(d)
    if len(d.args) > 1:
        raise plugin_error(d, "at most one address")
    return Ready(address(d, d.values[0] if d.args else ":8181"), d.where)
