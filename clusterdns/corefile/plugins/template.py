"""CoreDNS's *template* plugin: replies synthesized from Go templates for matching names.

    template CLASS TYPE [ZONE...] {
        match REGEX...
        answer RR...           additional RR...           authority RR...
        rcode CODE
        ederror EXTENDED_ERROR_CODE [EXTRA_REASON]
        fallthrough [ZONE...]
    }

As coredns/coredns plugin/template (template.go, template_test.go, setup_test.go, README):
a name outside ZONE (default: the block's zones) goes on; so does a question whose class or
type the template does not take (ANY in the template, or in the question, takes all). The
regexes are tried in order on the lower-cased name (default `.*`); the first that matches
makes the reply: `rcode` (default NOERROR; SERVFAIL fails the query), AA set, the rendered
records in their sections, EDE when `ederror` is given. No regex matched: the next plugin
where `fallthrough` covers the name, otherwise SERVFAIL. A CNAME answer to an A or AAAA
question is followed: its target's records of that type are added (CoreDNS asks itself;
here the rest of the chain is asked, which is where that question would go after the
templates). Several template lines in a block are one plugin each, tried in Corefile order,
which is CoreDNS's one handler with its list of templates.

The regexes are RE2 (google-re2), the engine Go's regexp package is: the same syntax and
errors, and matching in linear time, so no pattern in a Corefile can make a query name
(at most 255 bytes) cost more than a pass over it. Templates are the subset of Go's
text/template in _gotext; anything else is refused at setup.
"""
from __future__ import annotations

import functools
import logging
import struct

import dns.exception
import dns.name
import dns.rdata
import dns.rdataclass
import dns.rdatatype
import dns.tokenizer
import dns.ttl
import dnslib
import re2
from prometheus_client import Counter

from ...metrics import DNS as REGISTRY
from ..plugin import SERVFAIL, Next, Plugin, PluginError, Request, SetupContext, match_zone, normalize_zones
from ..syntax import Directive, plugin_error
from ._gotext import Template as GoTemplate
from ._gotext import TemplateError

log = logging.getLogger(__name__)

ANY = 255
A, AAAA, CNAME, OPT = 1, 28, 5, 41
EDE = 15   # EDNS0 option code of Extended DNS Errors (RFC 8914)
# miekg/dns StringToClass and StringToRcode (4-bit codes only: the others need an
# extended rcode in OPT, which a plugin's reply cannot carry here)
CLASSES = {"IN": 1, "CS": 2, "CH": 3, "HS": 4, "NONE": 254, "ANY": 255}
CLASS_NAMES = {v: k for k, v in CLASSES.items()}
RCODES = {"NOERROR": 0, "FORMERR": 1, "SERVFAIL": 2, "NXDOMAIN": 3, "NOTIMP": 4, "REFUSED": 5,
          "YXDOMAIN": 6, "YXRRSET": 7, "NXRRSET": 8, "NOTAUTH": 9, "NOTZONE": 10}
EXTENDED_RCODES = {"BADSIG", "BADVERS", "BADKEY", "BADTIME", "BADMODE", "BADNAME", "BADALG", "BADTRUNC",
                   "BADCOOKIE"}
DEFAULT_TTL = 3600   # miekg/dns NewRR's, for a record written without one
SECTIONS = ("answer", "additional", "authority")

# CoreDNS's (plugin/template/metrics.go); `template` is the failing template's text
_LABELS = ["server", "zone", "view", "class", "type"]
matches = Counter("coredns_template_matches", "Counter of template regex matches.", _LABELS, registry=REGISTRY)
template_failures = Counter("coredns_template_template_failures", "Counter of go template failures.",
                            [*_LABELS, "section", "template"], registry=REGISTRY)
rr_failures = Counter("coredns_template_rr_failures", "Counter of mis-templated RRs.",
                      [*_LABELS, "section", "template"], registry=REGISTRY)

_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.log_errors = False   # a bad pattern is reported once, as a setup error


def qtype_number(name: str) -> int | None:
    """miekg/dns StringToType: the type's mnemonic, upper case as written (`ANY` included)."""
    if name == "ANY":
        return ANY
    value = dnslib.QTYPE.reverse.get(name)
    return int(value) if value is not None and name.isupper() else None


def qtype_name(qtype: int) -> str:
    return "ANY" if qtype == ANY else str(dnslib.QTYPE.get(qtype, ""))


def parse_rr(text: str) -> dnslib.RR:
    """One RFC 1035 record as miekg/dns NewRR reads it: `OWNER [TTL] [CLASS] TYPE RDATA` (TTL and
    class in either order, TTL 3600 and IN when left out, names relative to the root). A new
    RR each time (later plugins may change it); the text's reading is remembered as wire."""
    return dnslib.RR.parse(dnslib.DNSBuffer(_rr_wire(text)))


@functools.lru_cache(maxsize=4096)   # rendered texts repeat (one per name asked); failures are not kept
def _rr_wire(text: str) -> bytes:
    tok = dns.tokenizer.Tokenizer(text)
    try:
        owner = tok.get_name(dns.name.root)
        ttl, rdclass, rdtype = None, None, None
        while rdtype is None:
            word = tok.get_string()
            if ttl is None and word[:1].isdigit():
                ttl = dns.ttl.from_text(word)
                continue
            if rdclass is None and word.upper() in CLASSES and word.upper() != "ANY":
                rdclass = dns.rdataclass.from_text(word)
                continue
            rdtype = dns.rdatatype.from_text(word)
        rdclass = dns.rdataclass.IN if rdclass is None else rdclass
        rd = dns.rdata.from_text(rdclass, rdtype, tok, dns.name.root, relativize=False)
    except dns.exception.DNSException as exc:
        raise ValueError(f"dns: {exc or type(exc).__name__}: {text!r}") from None
    data = rd.to_wire() or b""
    return (owner.to_wire() or b"") + struct.pack("!HHIH", rdtype, rdclass, DEFAULT_TTL if ttl is None else ttl,
                                                   len(data)) + data


def _regex(d: Directive, pattern: str):
    try:
        return re2.compile(pattern, _RE2_OPTIONS)
    except re2.error as exc:
        reason = exc.args[0].decode() if exc.args and isinstance(exc.args[0], bytes) else str(exc)
        raise plugin_error(d, f"could not parse regex: {pattern}, error parsing regexp: {reason}",
                           "template") from None


class Template(Plugin):
    """One `template` directive."""
    name = "template"

    def __init__(self, *, qclass: int, qtype: int, zones: list[str], regexes: list, sections: dict,
                 rcode: int, ederror: tuple[int, str] | None, fall: list[str] | None, where: str = "") -> None:
        self.qclass, self.qtype, self.zones = qclass, qtype, zones
        self.regexes = regexes
        self.sections: dict[str, list[GoTemplate]] = sections
        self.rendered = any(sections.values())     # AKS's NXDOMAIN templates render nothing
        self.rcode, self.ederror, self.fall = rcode, ederror, fall or []
        self.where = where

    def _takes(self, qclass: int, qtype: int) -> bool:
        return (self.qclass == ANY or qclass == ANY or qclass == self.qclass) and \
            (self.qtype == ANY or qtype == ANY or qtype == self.qtype)

    def transparent(self, qname: str, qtype: int) -> bool:
        # the fast path only sees class IN
        return match_zone(self.zones, qname) is None or not self._takes(1, qtype)

    def _falls(self, qname: str) -> bool:
        return bool(self.fall) and match_zone(self.fall, qname) is not None

    async def serve(self, req: Request, next: Next) -> dnslib.DNSRecord:
        qname = req.qname
        zone = match_zone(self.zones, qname)
        q = req.record.q
        if zone is None or not self._takes(q.qclass, q.qtype):
            return await next(req)
        for regex in self.regexes:
            m = regex.search(qname)
            if m is not None:
                break
        else:
            if self._falls(qname):
                return await next(req)
            raise PluginError(SERVFAIL, "")
        req.note(f"template {self.where}: matched {regex.pattern}")
        qclass = CLASS_NAMES.get(q.qclass if q.qclass != ANY else self.qclass, "")
        qtype = qtype_name(q.qtype if q.qtype != ANY else self.qtype)
        labels = (req.server, zone, "", qclass, qtype)
        matches.labels(*labels).inc()
        if self.rcode == SERVFAIL:
            raise PluginError(SERVFAIL, "")
        reply = req.reply(self.rcode)
        data = self._data(req, zone, regex, m, qclass, qtype) if self.rendered else {}
        for section, attr in (("answer", "rr"), ("additional", "ar"), ("authority", "auth")):
            for tmpl in self.sections[section]:
                try:
                    text = tmpl.render(data)
                except TemplateError as exc:
                    template_failures.labels(*labels, section, tmpl.source).inc()
                    raise PluginError(SERVFAIL, str(exc)) from None
                try:
                    rr = parse_rr(text)
                except ValueError as exc:
                    rr_failures.labels(*labels, section, tmpl.source).inc()
                    raise PluginError(SERVFAIL, str(exc)) from None
                getattr(reply, attr).append(rr)
                if section == "answer" and rr.rtype == CNAME and q.qtype in (A, AAAA):
                    await self._follow(req, next, reply, str(rr.rdata.label), q.qtype)
        if self.ederror is not None:
            # the server puts it in its OPT (when the client sent one: RFC 6891)
            code, reason = self.ederror
            req.data.setdefault("edns_options", []).append((EDE, struct.pack("!H", code) + reason.encode()))
        return reply

    @staticmethod
    async def _follow(req: Request, next: Next, reply: dnslib.DNSRecord, target: str, qtype: int) -> None:
        """Add the target's records (CoreDNS's upstream lookup; its failure only means none)."""
        ask = dnslib.DNSRecord.question(target, qtype_name(qtype))
        ask.header.rd = req.record.header.rd
        sub = Request(record=ask, client=req.client, tcp=req.tcp, server=req.server, zone=req.zone,
                      size=req.size, trail=req.trail)
        try:
            got = await next(sub)
        except PluginError:
            return
        reply.rr.extend(got.rr)
        if got.header.tc:
            reply.header.tc = 1

    def _data(self, req: Request, zone: str, regex, m, qclass: str, qtype: str) -> dict:
        q = req.record.q
        match = [m.group(i) or "" for i in range(regex.groups + 1)]
        group = {str(i): g for i, g in enumerate(match)}
        for name, i in regex.groupindex.items():
            group[name] = match[i]
        return {
            "Zone": zone, "Name": req.qname, "Regex": regex.pattern, "Match": match, "Group": group,
            "Class": qclass, "Type": qtype,
            "Question": {"Name": str(q.qname), "Qtype": q.qtype, "Qclass": q.qclass},
            "Remote": req.client[0],
        }

    def describe(self) -> str:
        parts = [CLASS_NAMES.get(self.qclass, str(self.qclass)), qtype_name(self.qtype), *self.zones]
        parts += [f"match={r.pattern}" for r in self.regexes]
        for section in SECTIONS:
            parts += [f'{section}="{t.source}"' for t in self.sections[section]]
        parts.append("rcode=" + next(k for k, v in RCODES.items() if v == self.rcode))
        if self.ederror is not None:
            parts.append(f"ederror={self.ederror[0]}" + (f' "{self.ederror[1]}"' if self.ederror[1] else ""))
        if self.fall:
            parts.append("fallthrough=" + ",".join(self.fall))
        return " ".join(parts)


def setup(d: Directive, ctx: SetupContext) -> Template:
    args = d.values
    if not args:
        raise plugin_error(d, "Wrong argument count or unexpected line ending after 'template'")
    qclass = CLASSES.get(args[0])
    if qclass is None:
        raise plugin_error(d, f"invalid query class {args[0]}")
    if len(args) < 2:
        raise plugin_error(d, f"Wrong argument count or unexpected line ending after '{args[0]}'")
    qtype = qtype_number(args[1])
    if qtype is None:
        raise plugin_error(d, f"invalid RR type {args[1]}")
    zones = normalize_zones(args[2:], ctx.zones, d, "template")
    regexes: list = []
    sections: dict[str, list[GoTemplate]] = {s: [] for s in SECTIONS}
    rcode, ederror, fall = 0, None, None
    for line in d.lines():
        name, vals = line.name, line.values
        if line.body is not None:
            raise plugin_error(line, f"{name} takes no block", "template")
        if name == "match":
            if not vals:
                raise plugin_error(line, "Wrong argument count or unexpected line ending after 'match'", "template")
            regexes += [_regex(line, v) for v in vals]
        elif name in SECTIONS:
            if not vals:
                raise plugin_error(line, f"Wrong argument count or unexpected line ending after '{name}'",
                                   "template")
            for v in vals:
                try:
                    sections[name].append(GoTemplate(name, v))
                except TemplateError as exc:
                    raise plugin_error(line, f"could not compile template: {name}, {exc}", "template") from None
        elif name == "rcode":
            if len(vals) != 1:
                raise plugin_error(line, "Wrong argument count or unexpected line ending after 'rcode'", "template")
            if vals[0] in EXTENDED_RCODES:
                raise plugin_error(line, f"rcode {vals[0]} is not supported (an extended rcode)", "template")
            if vals[0] not in RCODES:
                raise plugin_error(line, f"unknown rcode {vals[0]}", "template")
            rcode = RCODES[vals[0]]
        elif name == "ederror":
            if len(vals) not in (1, 2):
                raise plugin_error(line, "Wrong argument count or unexpected line ending after 'ederror'",
                                   "template")
            if not vals[0].isdigit() or not vals[0].isascii() or int(vals[0]) > 65535:
                raise plugin_error(line, f"error parsing extended DNS error code {vals[0]}", "template")
            ederror = (int(vals[0]), vals[1] if len(vals) == 2 else "")
        elif name == "fallthrough":
            fall = normalize_zones(vals, ["."], line, "template")
        else:
            raise plugin_error(line, f"unknown property '{name}'", "template")
    if not regexes:
        regexes = [re2.compile(".*", _RE2_OPTIONS)]
    if not sections["answer"] and not sections["authority"] and rcode == 0:
        raise plugin_error(d, "no answer section for template found")
    return Template(qclass=qclass, qtype=qtype, zones=zones, regexes=regexes, sections=sections, rcode=rcode,
                    ederror=ederror, fall=fall, where=d.where)
