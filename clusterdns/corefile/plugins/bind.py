"""`bind ADDRESS|INTERFACE... { except ADDRESS|INTERFACE... }`: the block listens only
on these addresses (an interface name stands for its addresses at start)."""
from __future__ import annotations

import ipaddress

from ...dns.server import interface_addresses
from ..plugin import Plugin, SetupContext
from ..syntax import Directive, plugin_error


class Bind(Plugin):
    name = "bind"

    def __init__(self, addresses: list[str], excluded: list[str], where: str) -> None:
        self.addresses, self.excluded, self.where = addresses, excluded, where

    def describe(self) -> str:
        text = " ".join(self.addresses)
        return text + (" except " + " ".join(self.excluded) if self.excluded else "")


def resolve(d: Directive, items: list[str]) -> list[str]:
    out: list[str] = []
    for item in items:
        try:
            out.append(str(ipaddress.ip_address(item.split("%", 1)[0])))
            continue
        except ValueError:
            pass
        found = [a for a in interface_addresses(item) if not a.startswith("fe80:")]
        if not found:
            raise plugin_error(d, f"not a valid IP address or interface name: {item}", "bind")
        out += found
    return out


def setup(d: Directive, ctx: SetupContext) -> Plugin:
    if not d.args:
        raise plugin_error(d, "at least one address or interface name")
    excluded: list[str] = []
    for line in d.lines():
        if line.name != "except" or not line.args:
            raise plugin_error(line, f"unknown property '{line.name}'", "bind")
        excluded += resolve(line, line.values)
    addresses = [a for a in resolve(d, d.values) if a not in excluded]
    if not addresses:
        raise plugin_error(d, "every address is excluded")
    return Bind(list(dict.fromkeys(addresses)), excluded, d.where)
