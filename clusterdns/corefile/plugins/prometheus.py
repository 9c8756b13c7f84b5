"""`prometheus [ADDRESS]`: the coredns_* series on ADDRESS (default localhost:9153).

Served by the agent's metrics listener (--metrics-listen); blocks naming one
address share it, as in CoreDNS. Two different addresses are refused: the
series of all blocks are one registry here."""
from __future__ import annotations

from ..plugin import Plugin, SetupContext
from ..syntax import Directive, plugin_error
from ._simple import address, no_block


class Prometheus(Plugin):
    name = "prometheus"

    def __init__(self, listen: str, where: str) -> None:
        self.listen, self.where = listen, where

    def transparent(self, qname: str, qtype: int) -> bool:
        return True

    def describe(self) -> str:
        return self.listen


def setup(d: Directive, ctx: SetupContext) -> Plugin:
    no_block(d)
    if len(d.args) > 1:
        raise plugin_error(d, "at most one address")
    text = d.values[0] if d.args else "localhost:9153"
    return Prometheus(address(d, text), d.where)
