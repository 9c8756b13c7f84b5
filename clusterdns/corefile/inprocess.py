"""A node-local-dns Corefile's forward to the cluster DNS, answered by the cluster DNS's
own Corefile (--cluster-corefile) in this process: the query runs that Corefile's block
for its name on the port forwarded to, as the CoreDNS pods behind the kube-dns Service
would have answered it, without a second hop.

The hop asks over "TCP" (no truncation: node-local-dns forwards with force_tcp) and the
reply is fitted to the client by the node-local block. The receive threads answer from
the cluster Corefile's memo when every plugin in front of the hop is transparent.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import dnslib

from .plugin import REFUSED, SERVFAIL, Next, Plugin, PluginError, Request, fqdn, is_subdomain
from .syntax import CorefileError, Directive

if TYPE_CHECKING:
    from .build import Corefile
    from .runtime import Listener


class ClusterHop(Plugin):
    name = "forward"

    def __init__(self, from_zone: str, hop: Listener, where: str, target: str, cluster_path: str) -> None:
        self.from_zone, self.hop, self.where = from_zone, hop, where
        self.target, self.cluster_path = target, cluster_path

    def transparent(self, qname: str, qtype: int) -> bool:
        # The memo stands in for the hop only for the names the hop takes.
        return is_subdomain(qname, self.from_zone)

    async def serve(self, req: Request, next: Next) -> dnslib.DNSRecord:
        if not is_subdomain(req.qname, self.from_zone):
            return await next(req)
        info: dict = {}
        reply = await self.hop.resolve(bytes(req.record.pack()), req.client[0], True, req.client[1], info=info)
        req.data["upstream"] = (f"{self.target} in process: {self.cluster_path} block {info.get('block', '?')}"
                                + (f" ({info['plugin']})" if info.get("plugin") else ""))
        if reply is None:
            raise PluginError(SERVFAIL, "plugin/forward: the cluster DNS gave no answer")
        if isinstance(reply, list):       # a zone transfer is not forwarded
            raise PluginError(REFUSED, "plugin/forward: zone transfers are not forwarded")
        try:
            return dnslib.DNSRecord.parse(reply)
        except Exception:
            raise PluginError(SERVFAIL, "plugin/forward: the cluster DNS's reply did not parse") from None

    def describe(self) -> str:
        return (f"forward {self.from_zone} -> {self.target}: answered in this process by {self.cluster_path} "
                f"(its listener {self.hop.host}:{self.hop.port})")


def setup_hop(d: Directive, cluster: Corefile) -> ClusterHop:
    """The forward to the cluster DNS as a hop into `cluster`'s listener on the port forwarded to."""
    to = d.args[1].text
    port = 53
    if to.rsplit(":", 1)[-1].isdigit() and to.count(":") == 1:
        port = int(to.rsplit(":", 1)[1])
    found = [li for (host, p), li in cluster.listeners.items() if p == port]
    if not found:
        raise CorefileError(d, f"plugin/forward: the cluster DNS's Corefile {cluster.path} serves nothing on "
                               f"port {port}, where this forward goes")
    hop = next((li for li in found if li.host in ("0.0.0.0", "::")), found[0])
    return ClusterHop(fqdn(d.args[0].text), hop, d.where, to, cluster.path)
