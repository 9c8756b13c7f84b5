"""The contract between a server block and its plugins.

A plugin is set up once from its directive (`setup(directive, ctx) -> Plugin`,
raising CorefileError with FILE:LINE) and then serves queries:

    async def serve(self, req: Request, next: Next) -> dnslib.DNSRecord

It either answers (returns the reply), hands the query on (`return await
next(req)`, possibly changing `req.record` before and the reply after), or fails
(`raise PluginError(rcode, reason)`: the client gets that rcode, the `errors`
plugin logs the reason). Calling `next` after the last plugin fails with
SERVFAIL ("no next plugin found"), as CoreDNS does.

Names are CoreDNS's: lower-cased, fully qualified, with the trailing dot
(`example.org.`); zones the same (`.` is the root).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Awaitable, Callable, ClassVar, Mapping

import dnslib

from .syntax import Directive, plugin_error

if TYPE_CHECKING:
    from ..config import Config
    from ..state import ClusterState

NOERROR, FORMERR, SERVFAIL, NXDOMAIN, NOTIMP, REFUSED = 0, 1, 2, 3, 4, 5


class PluginError(Exception):
    """The query fails with `rcode` (SERVFAIL unless said); `reason` is what errors logs."""

    def __init__(self, rcode: int = SERVFAIL, reason: str = "") -> None:
        super().__init__(reason)
        self.rcode, self.reason = rcode, reason


@dataclass
class Request:
    record: dnslib.DNSRecord          # the query as plugins see it (rewrite may replace its question)
    client: tuple[str, int] = ("", 0)
    tcp: bool = False
    server: str = ""                  # the listener, as CoreDNS's `server` label: dns://host:port
    zone: str = "."                   # the server block's zone this query matched
    wire: bytes = b""                 # the query as received
    size: int = 512                   # what the client can take over UDP (its EDNS size, at least 512)
    trail: list[str] = field(default_factory=list)   # what each plugin did (trace, log)
    data: dict[str, Any] = field(default_factory=dict)  # per-query notes between plugins

    @property
    def qname(self) -> str:
        """The question name, lower-cased, with the trailing dot."""
        return fqdn(str(self.record.q.qname))

    @property
    def name(self) -> str:
        """The question name as the client spelled it (trailing dot)."""
        n = str(self.record.q.qname)
        return n if n.endswith(".") else n + "."

    @property
    def qtype(self) -> int:
        return self.record.q.qtype

    @property
    def qclass(self) -> int:
        return self.record.q.qclass

    @property
    def do(self) -> bool:
        return any(rr.rtype == dnslib.QTYPE.OPT and rr.edns_do for rr in self.record.ar)

    def reply(self, rcode: int = NOERROR, aa: bool = True) -> dnslib.DNSRecord:
        """An empty reply to the query: its ID, question, RD; QR and (by default) AA set."""
        q = self.record
        r = dnslib.DNSRecord(dnslib.DNSHeader(id=q.header.id, qr=1, aa=1 if aa else 0, ra=1,
                                              rd=q.header.rd, opcode=q.header.opcode, rcode=rcode),
                             questions=list(q.questions))
        return r

    def note(self, text: str) -> None:
        self.trail.append(text)


Next = Callable[[Request], Awaitable[dnslib.DNSRecord]]


class Plugin:
    """One plugin of one server block."""

    name: ClassVar[str] = ""

    async def serve(self, req: Request, next: Next) -> dnslib.DNSRecord:
        return await next(req)

    def transparent(self, qname: str, qtype: int) -> bool:
        """True when this plugin would pass this query on unchanged and leave the reply as it
        is, so the receive threads may answer it from the memo without running the chain.
        `qname` is lower-cased with the trailing dot. The safe answer is False."""
        return False

    def on_state(self, state: "ClusterState") -> None:
        """A new cluster state version is being served (cache drops what it made stale)."""

    async def start(self) -> None:
        """Start background work (file reloads, health checks); the event loop runs."""

    async def stop(self) -> None:
        """Stop what start() began."""

    def describe(self) -> str:
        """The effective options, one line, for `clusterdns config check`."""
        return ""


@dataclass
class SetupContext:
    """What a plugin's setup may read besides its directive."""
    zones: list[str]                       # the server block's zones (lower-case FQDN, '.' root)
    corefile: str = ""                     # path of the Corefile (imports, relative files)
    base_dir: str = "."                    # directory relative file names are read from
    cfg: "Config | None" = None            # the process's flags (defaults the Corefile can override)
    env: Mapping[str, str] = field(default_factory=dict)
    server: str = ""                       # dns://host:port of the first listener of the block
    # zones this block answers from the cluster state (its kubernetes plugin's, or the cluster
    # zones a node-local-dns block forwards to the cluster DNS, answered in-process)
    state_zones: list[str] = field(default_factory=list)


Setup = Callable[[Directive, SetupContext], Plugin]


def fqdn(name: str) -> str:
    """`Example.ORG` -> `example.org.`; `` and `.` -> `.`."""
    n = name.strip().lower()
    if not n or n == ".":
        return "."
    return n if n.endswith(".") else n + "."


def is_subdomain(name: str, zone: str) -> bool:
    """Is `name` at or under `zone` (label-wise)? Both lower-case FQDN."""
    if zone == ".":
        return True
    return name == zone or name.endswith("." + zone)


def match_zone(zones: list[str] | tuple[str, ...], name: str) -> str | None:
    """The longest of `zones` that `name` is at or under (CoreDNS's plugin.Zones.Matches)."""
    best: str | None = None
    for z in zones:
        if is_subdomain(name, z) and (best is None or len(z) > len(best)):
            best = z
    return best


def normalize_zones(tokens: list[str], block_zones: list[str], d: Directive | None = None,
                    plugin: str | None = None) -> list[str]:
    """A plugin's ZONES arguments as CoreDNS takes them: none means the block's zones; each
    is made an FQDN; a CIDR becomes its reverse zone(s). One that is neither (a bad CIDR, an
    empty or too long label) is a setup error at `d` (plugin/PLUGIN), ValueError without `d`."""
    if not tokens:
        return list(block_zones)
    out: list[str] = []
    for t in tokens:
        try:
            out += zone_argument(t)
        except ValueError as exc:
            if d is None:
                raise
            raise plugin_error(d, f"unable to normalize '{t}': {exc}", plugin) from None
    return out


def zone_argument(text: str) -> list[str]:
    """One ZONES argument as normalize_zones takes it; ValueError saying why it is none."""
    if "/" in text:
        from .keys import reverse_zones  # CIDR -> in-addr.arpa / ip6.arpa zones
        return reverse_zones(text)
    name = fqdn(text)
    if name != ".":
        labels = name[:-1].split(".")
        if not all(labels[1:]):      # (a leading dot, `.*`, CoreDNS's tests take as a zone)
            raise ValueError("empty label")
        if any(len(label) > 63 for label in labels):
            raise ValueError("label longer than 63 bytes")
        if len(name) > 254:
            raise ValueError("name longer than 253 bytes")
    return [name]
