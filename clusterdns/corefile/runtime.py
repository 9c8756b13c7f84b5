"""Serving a Corefile: listeners, the server block a query goes to, and its plugin chain.

Each listener (address:port) holds the server blocks bound to it, by zone. A
query goes to the block whose zone is the longest label-wise match of its name
(the root block last); none matches: REFUSED; a block without plugins: REFUSED
(CoreDNS's server.go). In the block the plugins run in CoreDNS's fixed order
(registry.ORDER), several `forward` lines in Corefile order.

A Listener offers the engine interface the DNS server drives (fast, resolve,
update, synced), so the receive threads keep their fast path: a question the
block's kubernetes plugin can answer from the memo is answered there, without
the chain, when every plugin in front of kubernetes is transparent for it
(errors, cache over the state zones, loadbalance, the setup-only plugins always
are; log, rewrite, hosts and template say per name). Everything else runs the
chain on the event loop with dnslib records, and the reply is fitted to the
client (our OPT, its UDP size, TC) once at the end.
"""
from __future__ import annotations

import contextvars
import logging
from typing import Callable

import dnslib

from ..dns import metrics
from ..dns.wire import MAX_TCP, OPT_TYPE, udp_limit
from .plugin import NOTIMP, REFUSED, SERVFAIL, Next, Plugin, PluginError, Request, fqdn

log = logging.getLogger(__name__)

FORMERR, BADVERS = 1, 16
# Plugins transparent for every name the kubernetes plugin's memo answers (see module doc).
STATE_TRANSPARENT = frozenset({"errors", "cache", "loadbalance", "prometheus", "health", "ready", "reload",
                               "bind", "loop", "autopath"})
# Plugins with no part in answering: a block made of only these answers REFUSED.
SETUP_ONLY = frozenset({"reload", "bind", "health", "ready"})

# The request being answered by the current task (the kubernetes plugin's engine hands
# names it does not answer to the rest of that request's chain).
current: contextvars.ContextVar[Request | None] = contextvars.ContextVar("corefile_request", default=None)


class Block:
    """One server block: its zones and plugin chain, bound to one or more listeners."""

    def __init__(self, zones: list[str], plugins: list[Plugin], *, where: str = "", server: str = "") -> None:
        self.zones = zones
        self.plugins = plugins                 # in the order they run
        self.where = where                     # FILE:LINE of the block (config check, trace)
        self.server = server
        names = [p.name for p in plugins]
        self.answering = [p for p in plugins if p.name not in SETUP_ONLY]
        self.run: Next | None = _chain(self.answering, names) if self.answering else None
        self.kube = next((p for p in plugins if p.name == "kubernetes"), None)
        # CoreDNS counts a block's queries in its prometheus plugin: none, no coredns_dns_* series
        self.counted = "prometheus" in names
        # the rest of the chain after kubernetes: where its engine sends what it does not answer
        if self.kube is not None:
            after = self.answering[self.answering.index(self.kube) + 1:]
            self.tail: Next = _chain(after, names)
            front = self.answering[:self.answering.index(self.kube)]
            # a plugin may opt out of STATE_TRANSPARENT by its options (loadbalance with prefer)
            self.guards = [p for p in front
                           if p.name not in STATE_TRANSPARENT or not getattr(p, "state_transparent", True)]
            self.fast: Callable[[bytes, bool], bytes | None] | None = self.kube.engine.fast  # type: ignore[attr-defined]
        else:
            self.tail = _chain([], names)
            self.guards = []
            self.fast = None
            # a hop into the cluster DNS's Corefile (inprocess.py): its listener's memo, behind
            # the same guards, and the hop's own (the names it takes)
            hop = next((p for p in self.answering if getattr(p, "hop", None) is not None), None)
            if hop is not None:
                front = self.answering[:self.answering.index(hop)]
                self.guards = [p for p in front
                               if p.name not in STATE_TRANSPARENT or not getattr(p, "state_transparent", True)]
                self.guards.append(hop)
                self.fast = hop.hop.fast       # type: ignore[attr-defined]
        # who wrote a memo answer of this block, as CoreDNS would name it: node-local-dns's
        # forward to the cluster DNS (answered in-process) is its forward
        self.memo_writer = "kubernetes" if self.kube is not None and not getattr(self.kube, "implicit", False) \
            else "forward"

    def label(self, zone: str, plugin: str) -> int:
        """The metrics part id of `plugin`'s answers to names under this block's `zone`."""
        if not self.counted:
            return metrics.SILENT
        if plugin == "kubernetes" and getattr(self.kube, "implicit", False):
            plugin = "forward"      # node-local-dns's forward to the cluster DNS, answered in-process
        return metrics.label(zone, plugin)

    def enabled(self) -> list[str]:
        """coredns_plugin_enabled's names: the plugins with a part in answering (CoreDNS's
        handlers; the setup-only ones are not); none when the block is not counted."""
        if not self.counted:
            return []
        names = []
        for p in self.answering:
            name = "forward" if p is self.kube and getattr(p, "implicit", False) else p.name
            if name not in names:
                names.append(name)
        return names

    def describe(self) -> list[str]:
        out = []
        for p in self.plugins:
            text = p.describe()
            out.append(text if text.split(" ", 1)[0] == p.name else f"{p.name} {text}".rstrip())
        return out


def _chain(plugins: list[Plugin], names: list[str]) -> Next:
    last = names[-1] if names else "server"

    async def end(req: Request) -> dnslib.DNSRecord:
        raise PluginError(SERVFAIL, f"plugin/{last}: no next plugin found")

    handler: Next = end
    for p in reversed(plugins):
        handler = _link(p, handler)
    return handler


def _link(plugin: Plugin, nxt: Next) -> Next:
    serve = plugin.serve

    name = plugin.name

    async def handle(req: Request) -> dnslib.DNSRecord:
        reply = await serve(req, nxt)
        if "by" not in req.data:       # the innermost plugin that returned wrote the reply
            req.data["by"] = name
        return reply
    return handle


def _wire_zone(zone: str) -> bytes:
    if zone == ".":
        return b"\x00"
    return b"".join(bytes((len(label),)) + label.encode("ascii") for label in zone.rstrip(".").split(".")) + b"\x00"


def _dotted(wire: bytes) -> str:
    """A lower-cased wire name (labels, zero byte) as `a.b.`."""
    out, i = [], 0
    while i < len(wire) and wire[i]:
        n = wire[i]
        out.append(wire[i + 1:i + 1 + n].decode("latin-1"))
        i += n + 1
    return ".".join(out) + "." if out else "."


class Listener:
    """The blocks bound to one address:port, with the engine interface the DNS server drives."""

    def __init__(self, host: str, port: int, blocks: dict[str, Block], udp_size: int = 1232) -> None:
        self.host, self.port = host, port
        self.blocks = blocks                  # zone -> block
        self.server = f"dns://{'[' + host + ']' if ':' in host else host}:{port}"
        self.udp_size = udp_size
        self._by_wire = {_wire_zone(z): b for z, b in blocks.items()}
        # the metrics part of a memo answer, by the zone key that took the query
        self._part_by_wire = {_wire_zone(z): b.label(z, b.memo_writer) for z, b in blocks.items()}
        self._only = blocks["."] if list(blocks) == ["."] else None
        # the part of the last answer fast() gave (read by the caller holding the engine lock)
        self.part = self._part_by_wire[b"\x00"] if self._only is not None else metrics.SILENT

    def enabled(self) -> list[tuple[str, str]]:
        """(zone, plugin) of coredns_plugin_enabled on this listener."""
        return [(zone, name) for zone, b in self.blocks.items() for name in b.enabled()]

    # --- what the DNS server drives (the Corefile object follows the state) -------------

    def block_for(self, qname: str) -> tuple[str, Block] | None:
        """The block answering `qname` (lower-case FQDN) here: the longest zone match."""
        name = qname
        while True:
            b = self.blocks.get(name)
            if b is not None:
                return name, b
            if name == ".":
                return None
            name = name.split(".", 1)[1] or "."

    def fast(self, data: bytes, tcp: bool) -> bytes | None:
        block, end = self._only, -1
        if block is None:
            if len(data) < 17:
                return None
            end = data.find(b"\x00", 12)
            if end < 0:
                return None
            name = data[12:end + 1].lower()
            by_wire, i, n = self._by_wire, 0, len(name)
            while True:
                block = by_wire.get(name[i:])
                if block is not None or i >= n - 1:
                    break
                i += name[i] + 1
            if block is None:
                return None
            self.part = self._part_by_wire[name[i:]]
        fast = block.fast
        if fast is None:
            return None
        if block.guards:
            if end < 0:
                end = data.find(b"\x00", 12)
            if end < 0 or end + 3 > len(data):
                return None
            qname = _dotted(data[12:end + 1].lower())
            qtype = data[end + 1] << 8 | data[end + 2]
            for g in block.guards:
                if not g.transparent(qname, qtype):
                    return None
        return fast(data, tcp)

    async def resolve(self, data: bytes, client_ip: str, tcp: bool, client_port: int = 0,
                      info: dict | None = None) -> bytes | list[bytes] | None:
        """Answer any query; `info` (trace) gets the block, the plugin that answered and the trail."""
        if len(data) < 12 or data[2] & 0x80:
            return None
        if (data[2] >> 3) & 0xF:
            return _raw_error(data, NOTIMP)
        try:
            record = dnslib.DNSRecord.parse(data)
        except Exception:
            return _raw_error(data, FORMERR, question=False)
        opts = [rr for rr in record.ar if rr.rtype == OPT_TYPE]
        edns = opts[0].rclass if opts else None
        do = bool(opts and opts[0].ttl & 0x8000)
        limit = MAX_TCP if tcp else udp_limit(edns, self.udp_size)
        if len(opts) > 1:
            return self._finish(_error(record, FORMERR), edns, do, limit)
        if opts and (opts[0].ttl >> 16) & 0xFF:
            reply = _error(record, 0)
            return self._finish(reply, edns, do, limit, ext_rcode=BADVERS >> 4)
        if len(record.questions) != 1:
            return self._finish(_error(record, SERVFAIL if not record.questions else FORMERR), edns, do, limit)
        if record.q.qclass != 1:
            return self._finish(_error(record, REFUSED), edns, do, limit)
        qname = fqdn(str(record.q.qname))
        found = self.block_for(qname)
        if found is None or found[1].run is None:
            return self._finish(_error(record, REFUSED), edns, do, limit)
        zone, block = found
        if info is not None:
            info.update(block=block.where, zone=zone)
        req = Request(record=record, client=(client_ip, client_port), tcp=tcp, server=self.server, zone=zone,
                      wire=data, size=limit)
        req.data["block"] = block
        question = record.questions[0]
        # as received: the kubernetes plugin hands the wire on unchanged when no rewrite changed it
        req.data["question"] = (str(question.qname), question.qtype, question.qclass)
        token = current.set(req)
        try:
            reply = await block.run(req)   # type: ignore[misc]
            metrics.answered_as(block.label(zone, req.data.get("by", "")))
        except PluginError as exc:
            reply = _error(record, exc.rcode)
            req.data.setdefault("error", exc.reason)
            metrics.answered_as(block.label(zone, ""))     # no plugin wrote it: the server did
        finally:
            current.reset(token)
        if info is not None:
            info.update(plugin=req.data.get("by", ""), trail=list(req.trail), error=req.data.get("error", ""),
                        upstream=req.data.get("upstream", ""), cache=req.data.get("cache", ""))
        xfr = req.data.get("xfr")
        if xfr is not None:
            return xfr
        reply.header.id = record.header.id
        reply.questions = [question]
        return self._finish(reply, edns, do, limit, options=req.data.get("edns_options", ()))

    def _finish(self, reply: dnslib.DNSRecord, edns: int | None, do: bool, limit: int, ext_rcode: int = 0,
                options=()) -> bytes:
        """The reply as sent: our OPT (with the options plugins asked for, NSID) when the client
        sent one, fitted to `limit` (TC)."""
        reply.header.qr = 1
        reply.ar = [rr for rr in reply.ar if rr.rtype != OPT_TYPE]
        if edns is not None:
            reply.ar.append(dnslib.RR(".", OPT_TYPE, self.udp_size, (ext_rcode << 24) | (0x8000 if do else 0),
                                      [dnslib.EDNSOption(code, data) for code, data in options]))
        data = reply.pack()
        if len(data) <= limit:
            return bytes(data)
        return _truncate(reply, limit, edns is not None)


def _error(record: dnslib.DNSRecord, rcode: int) -> dnslib.DNSRecord:
    """CoreDNS's error reply (SetRcode): ID, question, opcode, RD and CD kept; no AA, no RA."""
    h = record.header
    return dnslib.DNSRecord(dnslib.DNSHeader(id=h.id, qr=1, opcode=h.opcode, rd=h.rd, cd=h.cd, rcode=rcode),
                            questions=list(record.questions))


def _raw_error(data: bytes, rcode: int, question: bool = True) -> bytes | None:
    from ..dns.server import error_reply
    reply = error_reply(data, rcode)
    if reply is None or question:
        return reply
    return reply[:4] + b"\x00\x00" + reply[6:12]


def _truncate(reply: dnslib.DNSRecord, limit: int, keep_opt: bool) -> bytes:
    """The longest prefix of the answer records that fits, TC set (authority and additional
    records go first; the OPT stays)."""
    opt = [rr for rr in reply.ar if rr.rtype == OPT_TYPE] if keep_opt else []
    answers = list(reply.rr)
    reply.header.tc = 1
    reply.auth, reply.ar = [], opt
    lo, hi = 0, len(answers)
    best = b""
    while lo <= hi:
        mid = (lo + hi) // 2
        reply.rr = answers[:mid]
        data = bytes(reply.pack())
        if len(data) <= limit:
            best, lo = data, mid + 1
        else:
            hi = mid - 1
    if not best:
        reply.rr = []
        best = bytes(reply.pack())[:limit]
    return best


__all__ = ["Block", "Listener", "current", "metrics"]
