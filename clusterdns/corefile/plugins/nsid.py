"""`nsid [DATA]`: a query carrying the NSID EDNS option (RFC 5001) gets DATA (default: the
host name) back in the reply's OPT; other queries are left alone (CoreDNS's nsid)."""
from __future__ import annotations

import socket

import dnslib

from ..plugin import Next, Plugin, Request, SetupContext
from ..syntax import Directive, plugin_error

NSID = 3


class Nsid(Plugin):
    name = "nsid"

    def __init__(self, data: str) -> None:
        self.data = data

    async def serve(self, req: Request, next: Next) -> dnslib.DNSRecord:
        if NSID in option_codes(req.wire):
            req.data.setdefault("edns_options", []).append((NSID, self.data.encode()))
        return await next(req)

    def transparent(self, qname: str, qtype: int) -> bool:
        return False     # whether a query asks for NSID is in its OPT, which the memo does not look at

    def describe(self) -> str:
        return self.data


def option_codes(wire: bytes) -> set[int]:
    """The EDNS option codes of a query's OPT, read from its bytes (dnslib drops an empty
    option, and an NSID request is one)."""
    from ...dns.wire import question_end
    pos = question_end(wire)
    if pos < 0 or len(wire) < 12:
        return set()
    records = (wire[6] << 8 | wire[7]) + (wire[8] << 8 | wire[9]) + (wire[10] << 8 | wire[11])
    codes: set[int] = set()
    for _ in range(min(records, 16)):
        while pos < len(wire) and wire[pos] and not wire[pos] & 0xC0:    # the owner name
            pos += wire[pos] + 1
        pos += 2 if pos < len(wire) and wire[pos] & 0xC0 else 1
        if pos + 10 > len(wire):
            return codes
        rtype, rdlen = wire[pos] << 8 | wire[pos + 1], wire[pos + 8] << 8 | wire[pos + 9]
        start, end = pos + 10, pos + 10 + rdlen
        if rtype == dnslib.QTYPE.OPT:
            at = start
            while at + 4 <= min(end, len(wire)):
                codes.add(wire[at] << 8 | wire[at + 1])
                at += 4 + (wire[at + 2] << 8 | wire[at + 3])
        pos = end
    return codes


def setup(d: Directive, ctx: SetupContext) -> Plugin:
    if d.body:
        raise plugin_error(d, f"unknown property '{d.body[0].name}'")
    data = " ".join(d.values) if d.args else socket.gethostname()
    return Nsid(data)
