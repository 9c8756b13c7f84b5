"""CoreDNS's `forward`: queries under FROM go to up to 15 upstreams.

    forward FROM TO... {
        except IGNORED_NAMES...
        force_tcp | prefer_udp
        expire DURATION            max_idle_conns INTEGER
        max_fails INTEGER          max_connect_attempts INTEGER
        tls [CERT KEY] [CA]        tls_servername NAME
        policy random|round_robin|sequential
        health_check DURATION [no_rec] [domain FQDN]
        max_concurrent MAX
        next RCODE...              next_on_nodata
        failover RCODE...          failfast_all_unhealthy_upstreams
    }

TO is IP[:port], [IPv6]:port, dns://..., tls://IP[%SERVERNAME][:port] (DNS over
TLS, port 853, the certificate checked against the system CAs or `tls`'s CA
and the server name: tls_servername, else the per-upstream %NAME, else the
IP), or a resolv.conf-style file (its nameservers). Built on
clusterdns.dns.forward.Forward, which exchanges, fails over, health-checks.

Where this differs from CoreDNS, and why:
- An upstream is down after `max_fails` consecutive failed queries (CoreDNS
  counts failed health checks, which it starts at the first error); the
  probe (`. IN NS` or `health_check ... domain`) then runs every interval
  until it answers. The effect is the same: a dead upstream is skipped
  until it answers again.
- Each query tries each upstream at most once within the 5 s deadline;
  CoreDNS cycles through the list again until the deadline.
- A truncated UDP answer is retried over TCP within the same try whatever
  the options (the server block then fits the reply to the client), so a
  UDP client gets the whole answer where it fits instead of TC.
- `expire`: idle TCP and TLS connections are kept per upstream and reused
  until they have been idle that long (default 10 s; `max_idle_conns` caps
  how many); UDP uses a fresh socket per query (nothing to expire).
- `next RCODE` / `next_on_nodata` hand the query to the next plugin only
  when a later `forward` of this block takes it (the next plugin is called;
  when no forward was reached the upstream's reply stands, as CoreDNS
  ignores the setting when the next plugin is not a forward).
- Hostname TOs and `resolver` (CoreDNS resolves them at start), `https://`
  and `doh_method` (DNS over HTTPS), and grpc/quic TOs are setup errors.
"""
from __future__ import annotations

import ipaddress
import logging
import os
import ssl
from typing import Any

import dnslib

from ...dns import resolvconf
from ...dns.forward import MAX_UPSTREAMS, Forward, ForwardFailed, ForwardRefused, Upstream
from ..plugin import (
    REFUSED,
    SERVFAIL,
    Next,
    Plugin,
    PluginError,
    Request,
    SetupContext,
    fqdn,
    is_subdomain,
    zone_argument,
)
from ..syntax import Directive, Token, duration, plugin_error

log = logging.getLogger(__name__)

EXPIRE = 10.0
HEALTH_INTERVAL = 0.5
MIN_HEALTH_INTERVAL = 0.01    # `health_check 0` would be a busy loop; CoreDNS's loop sleeps 0
SEEN = "forward.seen"         # req.data: how many forward plugins this query has reached

RCODES = {"NOERROR": 0, "FORMERR": 1, "SERVFAIL": 2, "NXDOMAIN": 3, "NOTIMP": 4, "NOTIMPL": 4,
          "REFUSED": 5, "YXDOMAIN": 6, "YXRRSET": 7, "NXRRSET": 8, "NOTAUTH": 9, "NOTZONE": 10}
RCODE_NAMES = {0: "NOERROR", 1: "FORMERR", 2: "SERVFAIL", 3: "NXDOMAIN", 4: "NOTIMP", 5: "REFUSED",
               6: "YXDOMAIN", 7: "YXRRSET", 8: "NXRRSET", 9: "NOTAUTH", 10: "NOTZONE"}

UNSUPPORTED = {
    "doh_method": "DNS over HTTPS is not supported",
    "resolver": "hostname upstreams are not supported (give IP addresses)",
}


class ForwardPlugin(Plugin):
    name = "forward"

    def __init__(self, from_zone: str, ignored: list[str], fwd: Forward, *, next_rcodes: frozenset[int],
                 next_on_nodata: bool, summary: str) -> None:
        self.from_zone, self.ignored, self.fwd = from_zone, ignored, fwd
        self.next_rcodes, self.next_on_nodata = next_rcodes, next_on_nodata
        self.summary = summary

    def matches(self, qname: str) -> bool:
        """Under FROM and not under an `except` name (FROM itself always is, as in CoreDNS)."""
        if not is_subdomain(qname, self.from_zone):
            return False
        return qname == self.from_zone or not any(is_subdomain(qname, z) for z in self.ignored)

    async def serve(self, req: Request, next: Next) -> dnslib.DNSRecord:
        req.data[SEEN] = req.data.get(SEEN, 0) + 1
        if not self.matches(req.qname):
            return await next(req)
        tried: list[tuple[str, str, str, bool]] = []
        try:
            reply = await self.fwd.ask(req.record, req.tcp, tried)
        except ForwardRefused as exc:
            raise PluginError(REFUSED, f"plugin/forward: {exc}") from None
        except ForwardFailed as exc:
            req.note(f"forward {self.from_zone}: no answer" + _tries(tried))
            raise PluginError(SERVFAIL, f"plugin/forward: {self.from_zone}: {exc}") from None
        used = _used(tried)
        if used is not None:
            req.data["upstream"] = used[0]
        req.note(f"forward {self.from_zone}: {RCODE_NAMES.get(reply.header.rcode, reply.header.rcode)}"
                 + (f" from {used[0]} over {used[1]}" if used else "")
                 + _tries([t for t in tried if t is not used]))
        if not self._hand_on(reply):
            return reply
        seen = req.data[SEEN]
        try:
            out = await next(req)
        except PluginError:
            if req.data.get(SEEN) == seen:     # no forward after this one: the setting is ignored
                return reply
            raise
        return reply if req.data.get(SEEN) == seen else out

    def _hand_on(self, reply: dnslib.DNSRecord) -> bool:
        rcode = reply.header.rcode
        if rcode in self.next_rcodes:
            return True
        return self.next_on_nodata and rcode == 0 and not reply.rr

    def transparent(self, qname: str, qtype: int) -> bool:
        return False

    async def stop(self) -> None:
        await self.fwd.close()

    def describe(self) -> str:
        return self.summary


def _used(tried: list[tuple[str, str, str, bool]]) -> tuple[str, str, str, bool] | None:
    for t in tried:
        if t[3]:
            return t
    return None


def _tries(tried: list[tuple[str, str, str, bool]]) -> str:
    """The other tries of a query, as trace shows them."""
    if not tried:
        return ""
    return " (tried " + ", ".join(f"{up} over {proto}: {result.removeprefix(up + ': ')}"
                                  for up, proto, result, _used in tried) + ")"


def _arg_error(d: Directive, after: str) -> Exception:
    return plugin_error(d, f"Wrong argument count or unexpected line ending after '{after}'", "forward")


def _name_ok(name: str) -> bool:
    n = name.rstrip(".")
    if not n:
        return name in (".", "")
    labels = n.split(".")
    return all(0 < len(label) <= 63 for label in labels) and len(n) <= 253


def _zones(d: Directive, text: str) -> list[str]:
    """A FROM or except name as CoreDNS's NormalizeExact makes it: FQDN, a CIDR its reverse zones."""
    try:
        return zone_argument(text)
    except ValueError as exc:
        raise plugin_error(d, f"unable to normalize '{text}': {exc}", "forward") from None


def _ip(host: str) -> str | None:
    try:
        return str(ipaddress.ip_address(host.split("%", 1)[0]))
    except ValueError:
        return None


def _split_hostport(text: str) -> tuple[str, str | None] | None:
    """'1.2.3.4:53' / '[::1]:53' / '[::1]' / '::1' / '1.2.3.4' -> (host, port or None); None if malformed."""
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            return None
        rest = text[end + 1:]
        if rest and not rest.startswith(":"):
            return None
        return text[1:end], (rest[1:] if rest else None)
    if text.count(":") == 1:
        host, port = text.split(":")
        return host, port
    return text, None


def _port(d: Directive, text: str, port: str | None, default: int) -> int:
    if port is None:
        return default
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise plugin_error(d, f"invalid port in '{text}'", "forward")
    return int(port)


def _upstreams(d: Directive, tok: Token, base_dir: str) -> list[tuple[str, int, bool, str | None]]:
    """One TO: (ip, port, tls, per-upstream server name) for each address it stands for."""
    text = tok.text
    scheme, rest = "dns", text
    if "://" in text:
        scheme, rest = text.split("://", 1)
        scheme = scheme.lower()
        if scheme not in ("dns", "tls"):
            raise plugin_error(d, f"'{scheme}' is not supported as a destination protocol in forward: {text}",
                               "forward")
    if not rest:
        raise plugin_error(d, f"invalid address: '{text}'", "forward")
    tls = scheme == "tls"
    server_name = None
    if "%" in rest:
        # tls://IP%NAME[:port] names the server; dns://fe80::1%eth0 is an IPv6 zone (dropped)
        head, zone = rest.rsplit("%", 1)
        if head.startswith("[") and "]" in zone:        # [fe80::1%eth0]:53
            zone, after = zone.split("]", 1)
            head += "]" + after
        elif ":" in zone:                                # tls://IP%NAME:PORT
            zone, port_part = zone.rsplit(":", 1)
            head += ":" + port_part
        rest = head
        if tls:
            server_name = zone or None
    hp = _split_hostport(rest)
    if hp is not None and _ip(hp[0]) is not None:
        return [(_ip(hp[0]) or "", _port(d, text, hp[1], 853 if tls else 53), tls, server_name)]
    path = rest if os.path.isabs(rest) else os.path.join(base_dir, rest)
    if not tls and os.path.exists(path) and not os.path.isdir(path):
        try:
            conf = resolvconf.read(path)
        except OSError as exc:
            raise plugin_error(d, f"cannot read {rest}: {exc.strerror or exc}", "forward") from None
        found: list[tuple[str, int, bool, str | None]] = []
        for ns in conf.nameservers:
            ip = _ip(ns)
            if ip is None:
                log.warning("%s: %s: ignoring nameserver %r (not an IP address)", d.where, rest, ns)
                continue
            found.append((ip, 53, False, None))
        if not found:
            raise plugin_error(d, f"no valid upstream addresses found (no nameservers in {rest})", "forward")
        return found
    host = hp[0] if hp else rest
    if host and not host[0].isdigit() and "/" not in host and "." in host:
        raise plugin_error(d, f"not an IP address or file: '{rest}' (hostname upstreams are not supported)",
                           "forward")
    raise plugin_error(d, f"not an IP address or file: '{rest}'", "forward")


def _count(line: Directive, what: str, low: int = 0) -> int:
    if len(line.args) != 1:
        raise _arg_error(line, what)
    text = line.args[0].text
    try:
        n = int(text)
    except ValueError:
        raise plugin_error(line, f"{what}: invalid number '{text}'", "forward") from None
    if n < low:
        raise plugin_error(line, f"{what} can't be negative: {n}", "forward")
    return n


def _duration(line: Directive, text: str, what: str) -> float:
    try:
        dur = duration(text)
    except ValueError:
        raise plugin_error(line, f"{what}: time: invalid duration '{text}'", "forward") from None
    if dur < 0:
        raise plugin_error(line, f"{what} can't be negative: {text}", "forward")
    return dur


def _rcodes(line: Directive, what: str) -> list[int]:
    if not line.args:
        raise _arg_error(line, what)
    out = []
    for t in line.args:
        rc = RCODES.get(t.text.upper())
        if rc is None:
            raise plugin_error(line, f"{t.text} is not a valid rcode", "forward")
        out.append(rc)
    return out


def _tls_context(line: Directive, base_dir: str) -> ssl.SSLContext:
    args = [a.text if os.path.isabs(a.text) else os.path.join(base_dir, a.text) for a in line.args]
    if len(args) > 3:
        raise _arg_error(line, "tls")
    try:
        if len(args) in (1, 3):
            ctx = ssl.create_default_context(cafile=args[-1])
        else:
            ctx = ssl.create_default_context()
        if len(args) >= 2:
            ctx.load_cert_chain(args[0], args[1])
    except (OSError, ssl.SSLError, ValueError) as exc:
        raise plugin_error(line, f"tls: {exc}", "forward") from None
    return ctx


def setup(directive: Directive, ctx: SetupContext) -> ForwardPlugin:
    d = directive
    if len(d.args) < 2:
        raise _arg_error(d, d.args[0].text if d.args else "forward")
    from_tok = d.args[0]
    zones = _zones(d, from_tok.text)
    from_zone = zones[0]
    if len(zones) > 1:
        log.warning("%s: plugin/forward: '%s' expands to %d zones; only %s is used, as CoreDNS does",
                    d.where, from_tok.text, len(zones), from_zone)
    if not any(is_subdomain(from_zone, z) or is_subdomain(z, from_zone) for z in ctx.zones):
        log.warning("%s: plugin/forward: %s is outside the block's zones (%s): it never matches",
                    d.where, from_zone, " ".join(ctx.zones))

    ignored: list[str] = []
    opts: dict[str, Any] = {"max_fails": 2, "expire": EXPIRE, "max_idle": 0, "health_interval": HEALTH_INTERVAL,
                  "health_rd": True, "health_domain": ".", "policy": "random", "force_tcp": False,
                  "prefer_udp": False, "max_concurrent": 0, "failfast": False, "failover": [],
                  "max_connect_attempts": 0}
    tls_ctx: ssl.SSLContext | None = None
    tls_servername: str | None = None
    next_rcodes: list[int] = []
    next_on_nodata = False
    shown: list[str] = []
    for line in d.lines():
        name, args = line.name, line.values
        if line.body is not None:
            raise plugin_error(line, f"'{name}' takes no block", "forward")
        if name in UNSUPPORTED:
            raise plugin_error(line, f"{name}: {UNSUPPORTED[name]}", "forward")
        if name == "except":
            if not args:
                raise _arg_error(line, name)
            for a in line.args:
                ignored += _zones(line, a.text)
        elif name in ("force_tcp", "prefer_udp", "failfast_all_unhealthy_upstreams", "next_on_nodata"):
            if args:
                raise _arg_error(line, name)
            if name == "failfast_all_unhealthy_upstreams":
                opts["failfast"] = True
            elif name == "next_on_nodata":
                next_on_nodata = True
            else:
                opts[name] = True
        elif name == "max_fails":
            opts["max_fails"] = _count(line, name)
        elif name == "max_concurrent":
            opts["max_concurrent"] = _count(line, name)
        elif name == "max_idle_conns":
            opts["max_idle"] = _count(line, name)
        elif name == "max_connect_attempts":
            opts["max_connect_attempts"] = _count(line, name)
        elif name == "expire":
            if len(args) != 1:
                raise _arg_error(line, name)
            opts["expire"] = _duration(line, args[0], name)
        elif name == "policy":
            if len(args) != 1:
                raise _arg_error(line, name)
            if args[0] not in ("random", "round_robin", "sequential"):
                raise plugin_error(line, f"unknown policy '{args[0]}'", "forward")
            opts["policy"] = args[0]
        elif name == "health_check":
            if not args:
                raise _arg_error(line, name)
            opts["health_interval"] = max(MIN_HEALTH_INTERVAL, _duration(line, args[0], name))
            opts["health_domain"] = "."
            i = 1
            while i < len(args):
                if args[i] == "no_rec":
                    opts["health_rd"] = False
                elif args[i] == "domain":
                    if i + 1 >= len(args):
                        raise _arg_error(line, "domain")
                    i += 1
                    if not _name_ok(args[i]):
                        raise plugin_error(line, f"health_check: invalid domain name {args[i]}", "forward")
                    opts["health_domain"] = fqdn(args[i])
                else:
                    raise plugin_error(line, f"health_check: unknown option {args[i]}", "forward")
                i += 1
        elif name == "tls":
            tls_ctx = _tls_context(line, ctx.base_dir)
            shown.append(f"tls {' '.join(args)}".strip())
        elif name == "tls_servername":
            if len(args) != 1:
                raise _arg_error(line, name)
            tls_servername = args[0]
        elif name == "next":
            next_rcodes += _rcodes(line, name)
        elif name == "failover":
            codes = _rcodes(line, name)
            if 0 in codes:
                raise plugin_error(line, "NoError cannot be used in failover", "forward")
            opts["failover"] += codes
        else:
            raise plugin_error(line, f"unknown property '{name}'", "forward")

    ups: list[Upstream] = []
    for tok in d.args[1:]:
        for host, port, tls, sni in _upstreams(d, tok, ctx.base_dir):
            if tls and sni and tls_servername:
                raise plugin_error(d, f"both forward ('{tls_servername}') and proxy level ('{sni}') TLS "
                                   f"servernames are set for upstream proxy '{tok.text}'", "forward")
            ups.append(Upstream(host, port, tls=tls, server_name=(sni or tls_servername) if tls else None))
    if len(ups) > MAX_UPSTREAMS:
        raise plugin_error(d, f"more than {MAX_UPSTREAMS} TOs configured: {len(ups)}", "forward")

    fwd = Forward(ups, None, tls_context=tls_ctx, **opts)
    plugin = ForwardPlugin(from_zone, ignored, fwd, next_rcodes=frozenset(next_rcodes),
                           next_on_nodata=next_on_nodata, summary="")
    plugin.summary = _summary(plugin, opts, shown, next_rcodes, next_on_nodata)
    return plugin


def _summary(p: ForwardPlugin, opts: dict, shown: list[str], next_rcodes: list[int], nodata: bool) -> str:
    def secs(v: float) -> str:
        return f"{v:g}s"
    ups = " ".join(u.to + (f"%{u.server_name}" if u.server_name else "") for u in p.fwd.upstreams)
    parts = [f"{p.from_zone} {ups}", f"policy {opts['policy']}", f"max_fails {opts['max_fails']}",
             f"expire {secs(opts['expire'])}",
             f"health_check {secs(opts['health_interval'])}" + ("" if opts["health_rd"] else " no_rec")
             + ("" if opts["health_domain"] == "." else f" domain {opts['health_domain']}"),
             f"max_concurrent {opts['max_concurrent'] or 'unlimited'}"]
    if opts["force_tcp"]:
        parts.append("force_tcp")
    elif opts["prefer_udp"]:
        parts.append("prefer_udp")
    if opts["max_idle"]:
        parts.append(f"max_idle_conns {opts['max_idle']}")
    if opts["max_connect_attempts"]:
        parts.append(f"max_connect_attempts {opts['max_connect_attempts']}")
    if opts["failfast"]:
        parts.append("failfast_all_unhealthy_upstreams")
    if opts["failover"]:
        parts.append("failover " + " ".join(RCODE_NAMES[c] for c in opts["failover"]))
    if next_rcodes:
        parts.append("next " + " ".join(RCODE_NAMES[c] for c in next_rcodes))
    if nodata:
        parts.append("next_on_nodata")
    if p.ignored:
        parts.append("except " + " ".join(p.ignored))
    parts += shown
    return "; ".join(parts)
