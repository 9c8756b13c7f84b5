"""CoreDNS's log plugin: one query log line per answered query, on standard output.

    log [NAMES...] [FORMAT] [{ class success|denial|error|all...; minDuration [DURATION] }]

As coredns/coredns plugin/log: the first rule whose NAME the question is at or under logs it
(other log lines of the block then stay quiet, as CoreDNS's one rule list); the reply's class
(response.Typify + Classify: success = NOERROR with data or a delegation, denial = NXDOMAIN
with an SOA or NODATA, error = the rest) must be one of the rule's classes, or the query took
longer than minDuration. Lines are `[INFO] ` + FORMAT, CoreDNS's placeholders filled in;
the default is the Common Log Format. A plugin error on the way back is logged with the
rcode the client gets, and passed on.

Differences: {rsize} is the reply as this plugin sees it plus the OPT record the server adds
(a reply truncated for UDP later is logged at its full size); {local} is the listener's
address; metadata placeholders ({/label}) are always `-` (there is no metadata plugin); a
single argument with a placeholder (CoreDNS would take it for a NAME and log nothing) is refused.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from decimal import Decimal

import dnslib

from ..plugin import Next, Plugin, PluginError, Request, SetupContext, fqdn, is_subdomain
from ..syntax import Directive, plugin_error
from . import _coredns
from ._coredns import class_name, go_duration, go_duration_string, rcode_name, type_name

COMMON = '{remote}:{port} - {>id} "{type} {class} {name} {proto} {size} {>do} {>bufsize}" {rcode} {>rflags} {rsize} {duration}'
COMBINED = COMMON + ' "{>opcode}"'
CLASSES = ("all", "success", "denial", "error")
_SEEN = "log.seen"   # req.data: an earlier log line's rule took this query
OPT = 41

LABELS = frozenset({"{type}", "{name}", "{class}", "{proto}", "{size}", "{remote}", "{port}", "{local}",
                    "{>id}", "{>opcode}", "{>do}", "{>bufsize}", "{rcode}", "{rsize}", "{duration}",
                    "{>rflags}"})


def parse_format(s: str) -> list[tuple[str, str]]:
    """CoreDNS's replacer: ('label'|'meta'|'text', value) nodes, `{...}` found from the right brace."""
    out: list[tuple[str, str]] = []
    while True:
        j = s.find("}")
        if j < 0:
            break
        i = s.rfind("{", 0, j)
        if i < 0:
            out.append(("text", s[:j + 1]))
            s = s[j + 1:]
            continue
        val = s[i:j + 1]
        if val in LABELS:
            kind = "label"
        elif val.startswith("{/"):
            kind, val = "meta", val[2:-1]
        else:
            kind, val = "text", s[:j + 1]
        if i and kind != "text":
            out.append(("text", s[:i]))
        out.append((kind, val))
        s = s[j + 1:]
    if s:
        out.append(("text", s))
    return out


def typify(m: dnslib.DNSRecord) -> str:
    """response.Typify without the DNSSEC expiry check."""
    h = m.header
    if h.opcode == 5:
        return "UPDATE"
    if h.opcode == 4:
        return "META"
    qtype = m.q.qtype if m.questions else 0
    if qtype in (251, 252):
        return "META"
    answer = [rr for rr in m.rr if rr.rtype != OPT]
    matched = any(rr.rtype == qtype for rr in answer)
    addr = qtype in (1, 28)
    if answer and h.rcode == 0:
        return "NODATA" if addr and not matched else "NOERROR"
    soa = any(rr.rtype == 6 for rr in m.auth)
    ns = sum(1 for rr in m.auth if rr.rtype == 2)
    if soa and h.rcode == 0:
        return "NODATA"
    if soa and h.rcode == 3:
        return "NXDOMAIN"
    if h.rcode in (2, 4):
        return "SERVERERROR"
    if ns and h.rcode == 0:
        return "DELEGATION"
    return "NOERROR" if h.rcode == 0 else "OTHERERROR"


def classify(kind: str) -> str:
    if kind in ("NOERROR", "DELEGATION"):
        return "success"
    if kind in ("NXDOMAIN", "NODATA"):
        return "denial"
    return "error"


def _flags(h: dnslib.DNSHeader) -> str:
    names = [("qr", 1), ("aa", h.aa), ("tc", h.tc), ("rd", h.rd), ("ra", h.ra), ("z", h.z), ("ad", h.ad),
             ("cd", h.cd)]
    return ",".join(n for n, on in names if on)


def _bracket(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip


def _seconds(s: float) -> str:
    """time.Since(start).Seconds() as strconv.FormatFloat(s, 'f', -1, 64) + 's': whole nanoseconds,
    the shortest digits, no exponent."""
    return format(Decimal(repr(round(s, 9))).normalize(), "f") + "s"


@dataclass
class Rule:
    scope: str
    fmt: str
    nodes: list[tuple[str, str]]
    classes: frozenset[str]
    min_duration: float = 0.0


class Log(Plugin):
    name = "log"

    def __init__(self, rules: list[Rule]) -> None:
        self.rules = rules

    def _rule(self, qname: str) -> Rule | None:
        return next((r for r in self.rules if is_subdomain(qname, r.scope)), None)

    async def serve(self, req: Request, next: Next) -> dnslib.DNSRecord:
        if req.data.get(_SEEN):
            return await next(req)
        rule = self._rule(req.qname)
        if rule is None:
            return await next(req)
        req.data[_SEEN] = True
        start = time.monotonic()
        size = len(req.wire) if req.wire else len(req.record.pack())
        try:
            reply = await next(req)
        except PluginError as exc:
            self._log(rule, req, _error_reply(req, exc.rcode), start, size)
            raise
        self._log(rule, req, reply, start, size)
        return reply

    def _log(self, rule: Rule, req: Request, reply: dnslib.DNSRecord, start: float, size: int) -> None:
        took = time.monotonic() - start
        if "all" not in rule.classes and classify(typify(reply)) not in rule.classes:
            if not (rule.min_duration > 0 and took > rule.min_duration):
                return
        _coredns.log(logging.INFO, self.line(rule.nodes, req, reply, took, size))

    @staticmethod
    def line(nodes: list[tuple[str, str]], req: Request, reply: dnslib.DNSRecord, took: float, size: int) -> str:
        out = []
        for kind, val in nodes:
            if kind == "text":
                out.append(val)
            elif kind == "meta":
                out.append("-")
            else:
                out.append(_value(val, req, reply, took, size))
        return "".join(out)

    def transparent(self, qname: str, qtype: int) -> bool:
        return self._rule(qname) is None

    def describe(self) -> str:
        parts = []
        for r in self.rules:
            fmt = {COMMON: "{common}", COMBINED: "{combined}"}.get(r.fmt, repr(r.fmt))
            extra = f" minDuration {go_duration_string(r.min_duration)}" if r.min_duration else ""
            parts.append(f"{r.scope} {fmt} class {' '.join(sorted(r.classes))}{extra}")
        return "; ".join(parts) + " (to stdout)"


def _value(label: str, req: Request, reply: dnslib.DNSRecord, took: float, size: int) -> str:
    q = req.record
    if label == "{type}":
        return type_name(req.qtype)
    if label == "{name}":
        return req.qname
    if label == "{class}":
        return class_name(req.qclass)
    if label == "{proto}":
        return "tcp" if req.tcp else "udp"
    if label == "{size}":
        return str(size)
    if label == "{remote}":
        return _bracket(req.client[0])
    if label == "{port}":
        return str(req.client[1])
    if label == "{local}":
        return _bracket(_local(req))
    if label == "{>id}":
        return str(q.header.id)
    if label == "{>opcode}":
        return str(q.header.opcode)
    if label == "{>do}":
        return "true" if req.do else "false"
    if label == "{>bufsize}":
        return str(_bufsize(req))
    if label == "{rcode}":
        return rcode_name(reply.header.rcode)
    if label == "{rsize}":
        return str(_rsize(req, reply))
    if label == "{duration}":
        return _seconds(took)
    if label == "{>rflags}":
        return _flags(reply.header)
    return "-"


def _error_reply(req: Request, rcode: int) -> dnslib.DNSRecord:
    """What the client gets for a plugin error (SetRcode): ID, question, opcode, RD, CD; no AA, no RA."""
    h = req.record.header
    return dnslib.DNSRecord(dnslib.DNSHeader(id=h.id, qr=1, opcode=h.opcode, rd=h.rd, cd=h.cd, rcode=rcode),
                            questions=list(req.record.questions))


def _opt(record: dnslib.DNSRecord) -> dnslib.RR | None:
    return next((rr for rr in record.ar if rr.rtype == OPT), None)


def _bufsize(req: Request) -> int:
    """request.Size(): TCP 65535, else the EDNS0 size, at least 512."""
    if req.tcp:
        return 65535
    opt = _opt(req.record)
    return max(512, opt.rclass if opt is not None else 0)


def _rsize(req: Request, reply: dnslib.DNSRecord) -> int:
    """The reply as sent: the server replaces any OPT by its own (11 bytes) when the query had one."""
    r = reply
    if _opt(reply) is not None:
        r = dnslib.DNSRecord(reply.header, reply.questions, reply.rr, reply.auth,
                             [rr for rr in reply.ar if rr.rtype != OPT])
    return len(r.pack()) + (11 if _opt(req.record) is not None else 0)


def _local(req: Request) -> str:
    local = req.data.get("local")
    if isinstance(local, str) and local:
        return local
    hostport = req.server.removeprefix("dns://")
    host = hostport.rsplit(":", 1)[0] if ":" in hostport else hostport
    return host.strip("[]")


def setup(directive: Directive, ctx: SetupContext) -> Plugin:
    d, args = directive, directive.values
    fmt = COMMON
    if not args:
        names = ["."]
    elif len(args) == 1:
        if "{" in args[0]:
            raise plugin_error(d, f"one argument is a NAME, not a FORMAT ({args[0]!r}): write 'log . {args[0]}'")
        names = [args[0]]
    else:
        names = args
        if "{" in args[-1]:
            fmt = {"{common}": COMMON, "{combined}": COMBINED}.get(args[-1], args[-1])
            names = args[:-1]
    classes: set[str] = set()
    min_duration = 0.0
    for line in d.lines():
        if line.name == "class":
            if not line.values:
                raise plugin_error(line, "class needs one or more of all, success, denial, error", "log")
            for c in line.values:
                if c not in CLASSES:
                    raise plugin_error(line, f"invalid Class: {c}", "log")
                classes.add(c)
        elif line.name == "minDuration":
            if len(line.values) > 1:
                raise plugin_error(line, "minDuration takes at most one DURATION", "log")
            text = line.values[0] if line.values else "100ms"
            try:
                min_duration = go_duration(text)
            except ValueError:
                raise plugin_error(line, f"Illegal duration found: '{text}'", "log") from None
        else:
            raise plugin_error(line, f"unknown property '{line.name}'", "log")
    nodes = parse_format(fmt)
    chosen = frozenset(classes or {"all"})
    return Log([Rule(fqdn(n), fmt, nodes, chosen, min_duration) for n in names])
