"""`loop`: at start a query for a random name under the block's zone is sent to the
block's own listener; when it arrives more than twice, queries to this block go
round through an upstream back to us. CoreDNS then exits; clusterdns, which also
programs the node's Service rules, keeps running and answers SERVFAIL for every
name that would be forwarded (the loop is logged at ERROR and counted in
coredns_forward_loops... as a deliberate difference), while the cluster's own
names keep answering."""
from __future__ import annotations

import asyncio
import logging
import random

import dnslib

from ..plugin import SERVFAIL, Next, Plugin, PluginError, Request, SetupContext
from ..syntax import Directive, plugin_error

log = logging.getLogger("clusterdns.corefile.loop")
THRESHOLD = 2


class Loop(Plugin):
    name = "loop"

    def __init__(self, zone: str, where: str) -> None:
        self.zone, self.where = zone, where
        base = "" if zone == "." else zone
        self.probe = f"{random.getrandbits(63)}.{random.getrandbits(63)}.{base}".rstrip(".") + "."
        self.seen = 0
        self.looped = False
        self.done = False     # the probe is answered once (not a loop): stop counting

    async def serve(self, req: Request, next: Next) -> dnslib.DNSRecord:
        if req.qtype == dnslib.QTYPE.HINFO and req.qname == self.probe and not self.done:
            self.seen += 1
            if self.seen > THRESHOLD and not self.looped:
                self.looped = True
                log.error("plugin/loop: Loop (%s -> %s) detected for zone %r, see "
                          "https://coredns.io/plugins/loop#troubleshooting. Query: \"HINFO %s\"; "
                          "forwarding from this block is disabled", req.client[0], req.server, self.zone,
                          self.probe)
        if self.looped:
            raise PluginError(SERVFAIL, "plugin/loop: forwarding loop detected")
        return await next(req)

    def transparent(self, qname: str, qtype: int) -> bool:
        return True

    async def send_probe(self, host: str, port: int, timeout: float = 2.0) -> None:
        """Ask ourselves the probe name (over UDP) a few times, as CoreDNS does at start."""
        from ...dns.forward import Upstream, UpstreamError, exchange
        target = Upstream({"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host), port)
        for _ in range(THRESHOLD + 2):
            if self.looped or self.done:
                return
            q = dnslib.DNSRecord.question(self.probe, "HINFO")
            try:
                await exchange(target, bytes(q.pack()), False, timeout)
                self.done = True       # an answer came back: the query did not go round
            except UpstreamError:
                await asyncio.sleep(0.2)

    def describe(self) -> str:
        return f"probe {self.probe} HINFO"


def setup(d: Directive, ctx: SetupContext) -> Plugin:
    if d.args or d.body:
        raise plugin_error(d, "takes no arguments")
    return Loop(ctx.zones[0] if ctx.zones else ".", d.where)
