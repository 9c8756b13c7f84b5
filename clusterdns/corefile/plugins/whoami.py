"""`whoami`: answers every query with the client's address (A or AAAA) and its port and
transport (SRV at `_udp.` / `_tcp.` + the name, target `.`) in the additional section, TTL 0,
AA set; the answer section stays empty (CoreDNS's whoami)."""
from __future__ import annotations

import ipaddress

import dnslib

from ..plugin import Next, Plugin, Request, SetupContext
from ..syntax import Directive, plugin_error


class Whoami(Plugin):
    name = "whoami"

    async def serve(self, req: Request, next: Next) -> dnslib.DNSRecord:
        reply = req.reply()
        qname = req.name
        ip = req.client[0]
        try:
            v6 = ipaddress.ip_address(ip).version == 6
        except ValueError:
            v6 = False
        addr = dnslib.RR(qname, dnslib.QTYPE.AAAA if v6 else dnslib.QTYPE.A, req.qclass, 0,
                         dnslib.AAAA(ip) if v6 else dnslib.A(ip or "0.0.0.0"))
        owner = f"_{'tcp' if req.tcp else 'udp'}" + ("." if qname == "." else "." + qname)
        srv = dnslib.RR(owner, dnslib.QTYPE.SRV, req.qclass, 0, dnslib.SRV(0, 0, req.client[1], "."))
        reply.ar = [addr, srv]
        return reply

    def transparent(self, qname: str, qtype: int) -> bool:
        return False


def setup(d: Directive, ctx: SetupContext) -> Plugin:
    if d.args or d.body:
        raise plugin_error(d, "takes no arguments")
    return Whoami()
