"""`health [ADDRESS] { lameduck DURATION }`: /health on ADDRESS (default :8080), process-wide.

Served by the agent's health listener: the address and lameduck become its
--health-listen and --lameduck (several blocks must agree, as CoreDNS's one
process-wide listener requires)."""
from __future__ import annotations

from ..plugin import Plugin, SetupContext
from ..syntax import Directive, plugin_error
from ._simple import address, seconds


class Health(Plugin):
    name = "health"

    def __init__(self, listen: str, lameduck: float, where: str) -> None:
        self.listen, self.lameduck, self.where = listen, lameduck, where

    def describe(self) -> str:
        return f"{self.listen} lameduck {self.lameduck:g}s"


def setup(d: Directive, ctx: SetupContext) -> Plugin:
    if len(d.args) > 1:
        raise plugin_error(d, "at most one address")
    listen = address(d, d.values[0] if d.args else ":8080")
    lameduck = 0.0
    for line in d.lines():
        if line.name == "lameduck" and len(line.args) == 1:
            lameduck = seconds(line, line.values[0], "lameduck")
            if lameduck < 0:
                raise plugin_error(line, "lameduck must not be negative", "health")
        else:
            raise plugin_error(line, f"unknown property '{line.name}'", "health")
    return Health(listen, lameduck, d.where)
