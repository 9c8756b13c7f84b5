"""CoreDNS's rewrite plugin: rewrite the question before the rest of the chain, map the reply back.

    rewrite [continue|stop] name [exact|prefix|suffix|substring|regex] FROM TO [answer auto|name F T|value F T]...
    rewrite [continue|stop] type FROM TO | class FROM TO
    rewrite [continue|stop] ttl [exact|prefix|suffix|substring|regex] NAME TTL|MIN-MAX|MIN-|-MAX
    rewrite [continue|stop] rcode [exact|prefix|suffix|substring|regex] NAME FROM TO
    rewrite [continue|stop] cname [exact|prefix|suffix|substring|regex] FROM TO
    rewrite [continue|stop] edns0 local|nsid|subnet set|replace|append [CODE DATA | V4BITS V6BITS]
    rewrite [continue|stop] { LINES }      (the lines are read as one rule, as CoreDNS joins them)

Semantics are coredns/coredns plugin/rewrite's: names are matched lower-cased and fully
qualified (FROM and TO of exact/prefix/suffix/substring get a trailing dot, so they replace text,
not labels: `suffix a.com b.com` also turns `xa.com.` into `xb.com.`); regexes are RE2 (Go's
syntax, linear time), a regex TO takes `{N}` groups; the first matching `stop` rule ends the
list, `continue` rules go on. `exact` rules always map the answer back; `answer auto` does it
for the other kinds. The reply's question is the client's again, whatever was rewritten.
A `cname` rule (it matches every query) swaps a reply's CNAME target for TO and answers with
what the server block itself answers for TO (CoreDNS asks its whole server). `edns0` sets,
replaces or appends a `local` (CODE and DATA, or one of the request variables), `nsid` or
`subnet` option of the query (no metadata labels: clusterdns has no metadata plugin).
"""
from __future__ import annotations

import ipaddress
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

import dnslib

from ..plugin import SERVFAIL, Next, Plugin, PluginError, Request, SetupContext, fqdn
from ..syntax import CorefileError, Directive, Token
from . import _coredns
from ._coredns import CLASS_BY_NAME, RCODE_BY_NAME, class_name, go_regexp, type_by_name, type_name

STOP, CONTINUE = "stop", "continue"
KINDS = ("exact", "prefix", "suffix", "substring", "regex")
_STOPPED = "rewrite.stopped"   # req.data: a stop rule of an earlier rewrite line matched
OPT = 41
_T = TypeVar("_T")


class _RuleError(Exception):
    """A rule's arguments are wrong; `token` says where (None: the directive's line)."""

    def __init__(self, message: str, token: Token | None = None) -> None:
        super().__init__(message)
        self.token = token


# --- string rewriters (the answer side) -------------------------------------------------------

Rewriter = Callable[[str], str]


def _regex_rewriter(pattern: Any, replacement: str) -> Rewriter:
    def rewrite(src: str) -> str:
        m = pattern.search(src)
        return src if m is None else _expand(replacement, m)
    return rewrite


def _remap_rewriter(orig: str, replacement: str) -> Rewriter:
    """The name and its subdomains: `orig` -> `replacement` (answer auto)."""
    def rewrite(src: str) -> str:
        if src == orig:
            return replacement
        if src.endswith("." + orig):
            return src[:len(src) - len(orig)] + replacement
        return src
    return rewrite


def _suffix_rewriter(suffix: str, replacement: str) -> Rewriter:
    def rewrite(src: str) -> str:
        return src[:len(src) - len(suffix)] + replacement if src.endswith(suffix) else src
    return rewrite


def _expand(template: str, m: Any) -> str:
    s = template
    for i in range(len(m.groups()) + 1):
        s = s.replace("{%d}" % i, m.group(i) or "")  # an unmatched group is "" (Go)
    return s


# --- response rules ---------------------------------------------------------------------------

class RespRule:
    def on_rr(self, rr: dnslib.RR) -> None:
        """Rewrite one record of the reply."""

    def on_reply(self, reply: dnslib.DNSRecord) -> None:
        """Rewrite the reply as a whole."""

    async def lookup(self, reply: dnslib.DNSRecord, req: Request) -> None:
        """Rewrite the reply with what another query through the block answers (cname)."""


@dataclass
class NameResp(RespRule):
    rewrite: Rewriter
    text: str = ""

    def on_rr(self, rr: dnslib.RR) -> None:
        old = fqdn(str(rr.rname))
        new = self.rewrite(old)
        if new != old:
            rr.rname = dnslib.DNSLabel(new)


@dataclass
class ValueResp(RespRule):
    """The names in record data CoreDNS rewrites: CNAME, DNAME, NS, MX, SRV, NAPTR, SOA (mname)."""
    rewrite: Rewriter
    text: str = ""

    def on_rr(self, rr: dnslib.RR) -> None:
        rd = rr.rdata
        attr = {5: "label", 2: "label", 15: "label", 33: "target", 35: "replacement", 6: "mname"}.get(rr.rtype)
        if attr is not None and hasattr(rd, attr):
            old = fqdn(str(getattr(rd, attr)))
            new = self.rewrite(old)
            if new != old:
                rr.rdata = rd = _shallow(rd)
                setattr(rd, attr, dnslib.DNSLabel(new))
        elif rr.rtype == 39 and isinstance(rd, dnslib.RD):     # DNAME: dnslib keeps its raw data
            target = _wire_name(rd.data)
            if target is not None:
                new = self.rewrite(target)
                if new != target and _valid_name(new):
                    rr.rdata = dnslib.RD(_name_wire(new))


@dataclass
class TTLResp(RespRule):
    low: int
    high: int

    def on_rr(self, rr: dnslib.RR) -> None:
        if rr.ttl < self.low:
            rr.ttl = self.low
        elif rr.ttl > self.high:
            rr.ttl = self.high


@dataclass
class RcodeResp(RespRule):
    old: int
    new: int

    def on_reply(self, reply: dnslib.DNSRecord) -> None:
        if reply.header.rcode == self.old:
            reply.header.rcode = self.new


# --- rules ------------------------------------------------------------------------------------

@dataclass
class _State:
    name: str       # the question name now, lower-case FQDN
    qtype: int
    qclass: int
    req: Request | None = None
    # the query's EDNS0 options as edns0 rules leave them (None: not read yet / no change)
    edns: list[tuple[int, bytes]] | None = None

    def options(self) -> list[tuple[int, bytes]]:
        """setupEdns0Opt: the options to change (an OPT is added when the query had none)."""
        if self.edns is None:
            opt = _opt(self.req.record) if self.req is not None else None
            self.edns = [(o.code, bytes(o.data)) for o in opt.rdata] if opt is not None else []
        return self.edns


@dataclass
class Matcher:
    kind: str
    text: str
    pattern: Any = None   # an RE2 regexp (Go's syntax, linear time)

    def __call__(self, name: str) -> bool:
        if self.kind == "exact":
            return name == self.text
        if self.kind == "prefix":
            return name.startswith(self.text)
        if self.kind == "suffix":
            return name.endswith(self.text)
        if self.kind == "substring":
            return self.text in name
        assert self.pattern is not None
        return self.pattern.search(name) is not None

    def __str__(self) -> str:
        return f"{self.kind} {self.text}"


@dataclass
class Rule:
    mode: str

    def apply(self, st: _State) -> list[RespRule] | None:
        """None when the rule does not match; else what the reply needs."""
        return None

    def could_match(self, qname: str, qtype: int) -> bool:
        return True


@dataclass
class NameRule(Rule):
    match: Matcher
    to: str
    auto: bool = False
    static: list[RespRule] = field(default_factory=list)

    def apply(self, st: _State) -> list[RespRule] | None:
        name, m, kind = st.name, self.match, self.match.kind
        if kind == "regex":
            assert m.pattern is not None
            found = m.pattern.search(name)
            if found is None:
                return None
            new = _expand(self.to, found)
        elif not m(name):
            return None
        elif kind == "exact":
            new = self.to
        elif kind == "prefix":
            new = self.to + name[len(m.text):]
        elif kind == "suffix":
            new = name[:len(name) - len(m.text)] + self.to
        else:
            new = name.replace(m.text, self.to)
        st.name = new
        if not self.auto:
            return list(self.static)
        back = _remap_rewriter(new, name)
        return [NameResp(back), ValueResp(back), *self.static]

    def could_match(self, qname: str, qtype: int) -> bool:
        return self.match(qname)

    def __str__(self) -> str:
        answers = " ".join(getattr(r, "text", "") for r in self.static)
        auto = " answer auto" if self.auto and self.match.kind != "exact" else ""
        return f"{self.mode} name {self.match} {self.to}{auto}{' ' + answers if answers else ''}"


@dataclass
class TypeRule(Rule):
    frm: int
    to: int

    def apply(self, st: _State) -> list[RespRule] | None:
        if st.qtype != self.frm:
            return None
        st.qtype = self.to
        return []

    def could_match(self, qname: str, qtype: int) -> bool:
        return qtype == self.frm

    def __str__(self) -> str:
        return f"{self.mode} type {type_name(self.frm)} {type_name(self.to)}"


@dataclass
class ClassRule(Rule):
    frm: int
    to: int

    def apply(self, st: _State) -> list[RespRule] | None:
        if st.qclass != self.frm:
            return None
        st.qclass = self.to
        return []

    def __str__(self) -> str:
        return f"{self.mode} class {class_name(self.frm)} {class_name(self.to)}"


@dataclass
class ReplyRule(Rule):
    """ttl and rcode: match the (current) question name, change the reply."""
    field_: str
    match: Matcher
    resp: RespRule
    text: str

    def apply(self, st: _State) -> list[RespRule] | None:
        return [self.resp] if self.match(st.name) else None

    def could_match(self, qname: str, qtype: int) -> bool:
        return self.match(qname)

    def __str__(self) -> str:
        return f"{self.mode} {self.field_} {self.match} {self.text}"


# --- parsing (newRule and friends) ------------------------------------------------------------

def _compile(pattern: str, template: str, token: Token | None) -> Any:
    try:
        rx = go_regexp(pattern)
    except ValueError as exc:
        raise _RuleError(f"invalid regex matching pattern: {pattern} ({exc})", token) from None
    used = sum(1 for i in range(101) if "{%d}" % i in template)
    if used > rx.groups:
        raise _RuleError(f"the rewrite regex pattern ({template}) uses more subexpressions than its "
                         f"corresponding matching regex pattern ({pattern})", token)
    return rx


def _matcher(kind: str, text: str, token: Token | None, what: str) -> Matcher:
    if kind == "regex":
        try:
            return Matcher(kind, text, go_regexp(text))
        except ValueError as exc:
            raise _RuleError(f"invalid regex pattern in a {what} rule: {text} ({exc})", token) from None
    return Matcher(kind, fqdn(text))


def new_rule(toks: list[Token]) -> Rule:
    args = [t.text for t in toks]
    if not args:
        raise _RuleError("no rule type specified for rewrite")
    mode, start = STOP, 1
    if args[0].lower() in (STOP, CONTINUE):
        mode, start = args[0].lower(), 2
        if len(args) < 2:
            raise _RuleError(f"{mode} rule must begin with a rule type", toks[0])
    kind_tok = toks[start - 1]
    rtype = kind_tok.text.lower()
    rest, rest_toks = args[start:], toks[start:]
    if rtype == "answer":
        raise _RuleError("response rewrites must begin with a name rule", kind_tok)
    if rtype == "name":
        return _name_rule(mode, rest, rest_toks, kind_tok)
    if rtype in ("type", "class"):
        if len(rest) != 2:
            raise _RuleError(f"{rtype} rules must have exactly two arguments", kind_tok)
        if rtype == "type":
            frm, to = type_by_name(rest[0]), type_by_name(rest[1])
            for text, v, t in ((rest[0], frm, rest_toks[0]), (rest[1], to, rest_toks[1])):
                if v is None:
                    raise _RuleError(f"invalid type {text.upper()!r}", t)
            return TypeRule(mode, frm, to)  # type: ignore[arg-type]
        cf, ct = CLASS_BY_NAME.get(rest[0].upper()), CLASS_BY_NAME.get(rest[1].upper())
        for text, v, t in ((rest[0], cf, rest_toks[0]), (rest[1], ct, rest_toks[1])):
            if v is None:
                raise _RuleError(f"invalid class {text.upper()!r}", t)
        return ClassRule(mode, cf, ct)  # type: ignore[arg-type]
    if rtype == "ttl":
        return _ttl_rule(mode, rest, rest_toks, kind_tok)
    if rtype == "rcode":
        return _rcode_rule(mode, rest, rest_toks, kind_tok)
    if rtype == "edns0":
        return _edns0_rule(mode, rest, rest_toks, kind_tok)
    if rtype == "cname":
        return _cname_rule(mode, rest, rest_toks, kind_tok)
    raise _RuleError(f"invalid rule type {args[0]!r}", toks[0])


def _name_rule(mode: str, args: list[str], toks: list[Token], at: Token) -> Rule:
    if len(args) < 2:
        raise _RuleError("too few arguments for a name rule", at)
    if len(args) == 2:
        kind, frm, to, frm_tok = "exact", args[0], args[1], toks[0]
    else:
        kind, frm, to, frm_tok = args[0].lower(), args[1], args[2], toks[1]
    if kind not in KINDS:
        raise _RuleError("name rule supports only exact, prefix, suffix, substring, and regex name "
                         f"matching, received: {args[0]}", toks[0])
    auto, answers = False, list[RespRule]()
    if len(args) > 3:
        auto, answers = _answer_rules(kind, args[3:], toks[3:])
    if kind == "regex":
        rx = _compile(frm, to, frm_tok)
        return NameRule(mode, Matcher(kind, frm, rx), fqdn(to), auto, answers)
    m, to_n = Matcher(kind, fqdn(frm)), fqdn(to)
    if kind == "exact":
        return NameRule(mode, m, to_n, True, answers)
    if kind == "suffix" and auto:
        # a suffix maps back by swapping FROM and TO (CoreDNS's suffix 'answer auto')
        back = _suffix_rewriter(to_n, m.text)
        return NameRule(mode, m, to_n, False, [NameResp(back, "answer auto"), ValueResp(back), *answers])
    return NameRule(mode, m, to_n, auto, answers)


def _answer_rules(kind: str, args: list[str], toks: list[Token]) -> tuple[bool, list[RespRule]]:
    if len(args) < 2:
        raise _RuleError(f"invalid arguments for {kind} rule", toks[0])
    auto, names, i, last = False, 0, 0, ""
    rules: list[RespRule] = []
    while i < len(args):
        if last == "" and args[i] != "answer":
            raise _RuleError(f"exceeded the number of arguments for a non-answer rule argument for {kind} rule",
                             toks[i])
        if args[i] == "answer":
            i += 1
        if i >= len(args):
            raise _RuleError(f"type missing for answer rule for {kind} rule", toks[i - 1])
        last, at = args[i], toks[i]
        i += 1
        if last == "auto":
            auto = True
            continue
        if last not in ("name", "value"):
            raise _RuleError(f"invalid type {last!r} for answer rule for {kind} rule", at)
        if len(args) - i < 2:
            raise _RuleError(f"{last} answer rule for {kind} rule: 2 arguments required", at)
        frm, to = args[i], args[i + 1]
        rx = _compile(frm, to, toks[i])
        rewriter = _regex_rewriter(rx, fqdn(to))
        text = f"answer {last} {frm} {fqdn(to)}"
        rules.append(NameResp(rewriter, text) if last == "name" else ValueResp(rewriter, text))
        names += last == "name"
        i += 2
    if auto and names:
        raise _RuleError("auto name answer rule cannot be combined with explicit name answer rules", toks[0])
    return auto, rules


def _ttl_value(text: str) -> tuple[int, int] | None:
    def num(s: str) -> int | None:
        return int(s) if s.isdigit() and int(s) <= 0xFFFFFFFF else None
    parts = text.split("-")
    if len(parts) == 1:
        v = num(parts[0])
        return None if v is None else (v, v)
    if len(parts) != 2 or parts == ["", ""]:   # a bare '-' would be 0-2147483647: refused, as CoreDNS
        return None
    low = 0 if parts[0] == "" else num(parts[0])
    high = 2147483647 if parts[1] == "" else num(parts[1])
    if low is None or high is None or low > high:
        return None
    return low, high


def _target(args: list[str], toks: list[Token], n: int, at: Token, what: str) -> tuple[Matcher, list[str]]:
    """The `[TYPE] NAME` of a ttl/rcode rule and its `n` trailing values."""
    if len(args) < n + 1:
        raise _RuleError(f"too few ({len(args)}) arguments for a {what} rule", at)
    if len(args) > n + 2:
        raise _RuleError(f"too many arguments for a {what} rule", toks[n + 2])
    if len(args) == n + 1:
        return _matcher("exact", args[0], toks[0], what), args[1:]
    kind = args[0].lower()
    if kind not in KINDS:
        raise _RuleError(f"{what} rule supports only exact, prefix, suffix, substring, and regex name matching",
                         toks[0])
    return _matcher(kind, args[1], toks[1], what), args[2:]


def _ttl_rule(mode: str, args: list[str], toks: list[Token], at: Token) -> Rule:
    match, (value,) = _target(args, toks, 1, at, "ttl")
    span = _ttl_value(value)
    if span is None:
        raise _RuleError(f"invalid TTL '{value}' for a ttl rule", toks[-1])
    return ReplyRule(mode, "ttl", match, TTLResp(*span), value)


def _rcode(text: str) -> int | None:
    if text.isdigit() and int(text) <= 23:
        return int(text)
    return RCODE_BY_NAME.get(text.upper())


def _rcode_rule(mode: str, args: list[str], toks: list[Token], at: Token) -> Rule:
    match, (old_s, new_s) = _target(args, toks, 2, at, "rcode")
    old, new = _rcode(old_s), _rcode(new_s)
    if old is None:
        raise _RuleError(f"invalid matching RCODE '{old_s}' for a rcode rule", toks[-2])
    if new is None:
        raise _RuleError(f"invalid replacement RCODE '{new_s}' for a rcode rule", toks[-1])
    if new > 15 or old > 15:
        raise _RuleError("extended RCODEs (above 15) are not supported by clusterdns", toks[-1])
    return ReplyRule(mode, "rcode", match, RcodeResp(old, new), f"{old_s} {new_s}")


# --- cname (cname_target.go) -----------------------------------------------------------------

_LOOKUP = "rewrite.cname_lookup"   # req.data: a cname rule's own lookup (no cname rules for it)
CNAME = 5


@dataclass
class CnameRule(Rule):
    """Every reply's CNAME whose target matches: the answer becomes the CNAMEs (target TO) and what
    the block answers for TO (CoreDNS asks its server through the upstream package)."""
    kind: str
    frm: str
    to: str
    pattern: Any = None

    def apply(self, st: _State) -> list[RespRule] | None:
        if st.req is not None and st.req.data.get(_LOOKUP):
            return None
        return [CnameResp(self, st.qtype)]

    def target(self, cname: str) -> tuple[str, str]:
        """getFromAndToTarget."""
        if self.kind == "exact":
            return self.frm, self.to
        if self.kind == "prefix" and cname.startswith(self.frm):
            return cname, self.to + cname[len(self.frm):]
        if self.kind == "suffix" and cname.endswith(self.frm):
            return cname, cname[:len(cname) - len(self.frm)] + self.to
        if self.kind == "substring" and self.frm in cname:
            return cname, cname.replace(self.frm, self.to)
        if self.kind == "regex":
            m = self.pattern.search(cname)
            if m is not None:
                return cname, _expand(self.to, m)
        return "", ""

    def __str__(self) -> str:
        return f"{self.mode} cname {self.kind} {self.frm} {self.to}"


@dataclass
class CnameResp(RespRule):
    rule: CnameRule
    qtype: int

    async def lookup(self, reply: dnslib.DNSRecord, req: Request) -> None:
        for rr in reply.rr:
            if rr.rtype != CNAME:
                continue
            target = str(rr.rdata.label)
            frm, to = self.rule.target(target)
            if target != frm or not to or not _valid_name(fqdn(to)):
                continue
            answers = await _ask_block(req, to, self.qtype)
            kept = []
            for c in reply.rr:
                if c.rtype == CNAME:
                    c = _shallow(c)
                    c.rdata = dnslib.CNAME(to)
                    kept.append(c)
            reply.rr = kept + [a for a in answers if str(a.rname) == to]
            return


async def _ask_block(req: Request, name: str, qtype: int) -> list[dnslib.RR]:
    """upstream.Lookup: the name asked through this server block's chain; [] when it fails."""
    block = req.data.get("block")
    run = getattr(block, "run", None)
    if run is None:
        return []
    q = dnslib.DNSRecord(dnslib.DNSHeader(id=req.record.header.id, rd=1), q=dnslib.DNSQuestion(name, qtype))
    sub = Request(record=q, client=req.client, tcp=req.tcp, server=req.server, zone=req.zone, size=req.size,
                  data={"block": block, _LOOKUP: True})
    try:
        reply = await run(sub)
    except PluginError as exc:
        _coredns.log(logging.ERROR, f"Error upstream request {exc.reason or exc}", "rewrite")
        return []
    return list(reply.rr)


def _cname_rule(mode: str, args: list[str], toks: list[Token], at: Token) -> Rule:
    if len(args) == 2:
        kind, frm, to = "exact", args[0].lower(), args[1].lower()
    elif len(args) == 3:
        kind, frm, to = args[0].lower(), args[1].lower(), args[2].lower()
        if kind not in KINDS:
            raise _RuleError(f"unknown cname rewrite type: {kind}", toks[0])
    else:
        raise _RuleError(f"too few ({len(args)}) arguments for a cname rule", at)
    pattern = _compile(frm, to, toks[1]) if kind == "regex" else None
    return CnameRule(mode, kind, frm, to, pattern)


# --- EDNS0 (edns0.go) ------------------------------------------------------------------------

EDNS_ACTIONS = ("replace", "set", "append")
NSID, SUBNET = 3, 8
VARIABLES = ("{qname}", "{qtype}", "{client_ip}", "{client_port}", "{protocol}", "{server_ip}", "{server_port}")


@dataclass
class Edns0Rule(Rule):
    """local CODE DATA|{variable}, nsid, subnet V4BITS V6BITS: set/replace/append one option."""
    kind: str           # local, nsid, subnet
    action: str
    code: int
    data: bytes = b""
    variable: str = ""
    bits: tuple[int, int] = (0, 0)
    text: str = ""

    def apply(self, st: _State) -> list[RespRule] | None:
        if self.kind == "subnet":
            data = _subnet(st, *self.bits)
        elif self.variable:
            data = _variable(st, self.variable)
        else:
            data = self.data
        if data is None:
            return None
        opts = st.options()
        for i, (code, _) in enumerate(opts):
            if code == self.code:
                if self.action in ("replace", "set"):
                    opts[i] = (code, data)
                    return []
                if self.variable or self.kind == "subnet":
                    return None   # an append over an existing option: ignored (edns0.go)
        if self.action in ("append", "set"):
            opts.append((self.code, data))
            return []
        return None

    def __str__(self) -> str:
        return f"{self.mode} edns0 {self.text}"


def _edns0_rule(mode: str, args: list[str], toks: list[Token], at: Token) -> Rule:
    if len(args) < 2:
        raise _RuleError("too few arguments for an EDNS0 rule", at)
    kind, action = args[0].lower(), args[1].lower()
    if action not in EDNS_ACTIONS:
        raise _RuleError(f"invalid action: {action!r}", toks[1])
    text = " ".join(args)
    if kind == "nsid":
        if len(args) != 2:
            raise _RuleError("EDNS0 NSID rules do not accept args", toks[2])
        return Edns0Rule(mode, kind, action, NSID, text=text)
    if kind not in ("local", "subnet"):
        raise _RuleError(f"invalid rule type {kind!r}", toks[0])
    if len(args) != 4:
        raise _RuleError(f"EDNS0 {kind} rules require exactly three args", toks[0])
    if kind == "subnet":
        v4, v6 = _uint(args[2], 0xFFFF), _uint(args[3], 0xFFFF)
        if v4 is None or v4 > 32:
            raise _RuleError(f"invalid IPv4 bit mask length {args[2]}", toks[2])
        if v6 is None or v6 > 128:
            raise _RuleError(f"invalid IPv6 bit mask length {args[3]}", toks[3])
        return Edns0Rule(mode, kind, action, SUBNET, bits=(v4, v6), text=text)
    code = _uint(args[2], 0xFFFF)
    if code is None:
        raise _RuleError(f"invalid EDNS0 local option code {args[2]!r}", toks[2])
    data = args[3]
    if data.startswith("{") and data.endswith("}"):
        if data not in VARIABLES:
            raise _RuleError(f"unsupported variable name {data!r} (metadata labels need the metadata "
                             "plugin, which clusterdns does not have)", toks[3])
        return Edns0Rule(mode, kind, action, code, variable=data, text=text)
    if data.startswith("0x"):
        try:
            raw = bytes.fromhex(data[2:])
        except ValueError:
            raise _RuleError(f"invalid hex data {data!r}", toks[3]) from None
    else:
        raw = data.encode()
    return Edns0Rule(mode, kind, action, code, data=raw, text=text)


def _uint(text: str, top: int) -> int | None:
    """strconv.ParseUint(text, 0, ...): decimal, 0x, 0o, 0b."""
    try:
        v = int(text, 0)
    except ValueError:
        return None
    return v if 0 <= v <= top else None


def _ip_wire(ip: str) -> bytes | None:
    try:
        return ipaddress.ip_address(ip.split("%")[0]).packed
    except ValueError:
        return None


def _local(req: Request) -> tuple[str, int]:
    hostport = req.server.removeprefix("dns://")
    host, _, port = hostport.rpartition(":")
    return host.strip("[]"), int(port) if port.isdigit() else 0


def _variable(st: _State, name: str) -> bytes | None:
    req = st.req
    if req is None:
        return None
    if name == "{qname}":
        return (st.name if st.name != req.qname else req.name).encode()
    if name == "{qtype}":
        return st.qtype.to_bytes(2, "big")
    if name == "{client_ip}":
        return _ip_wire(req.client[0])
    if name == "{client_port}":
        return req.client[1].to_bytes(2, "big")
    if name == "{protocol}":
        return b"tcp" if req.tcp else b"udp"
    host, port = _local(req)
    if name == "{server_ip}":
        return _ip_wire(host)
    return port.to_bytes(2, "big")


def _subnet(st: _State, v4: int, v6: int) -> bytes | None:
    """An ECS option of the client's address masked to V4/V6 bits (miekg packs only the prefix's bytes)."""
    if st.req is None:
        return None
    try:
        ip = ipaddress.ip_address(st.req.client[0].split("%")[0])
    except ValueError:
        return None
    bits, family = (v4, 1) if ip.version == 4 else (v6, 2)
    net = ipaddress.ip_network(f"{ip}/{bits}", strict=False)
    addr = net.network_address.packed[:(bits + 7) // 8]
    return family.to_bytes(2, "big") + bytes((bits, 0)) + addr


def _opt(record: dnslib.DNSRecord) -> dnslib.RR | None:
    return next((rr for rr in record.ar if rr.rtype == OPT), None)


def _with_options(record: dnslib.DNSRecord, options: list[tuple[int, bytes]]) -> list[dnslib.RR]:
    """The additional section with our OPT: the query's size and flags (4096, none when it had no OPT)."""
    old = _opt(record)
    opt = dnslib.RR(".", OPT, rclass=old.rclass if old is not None else 4096, ttl=old.ttl if old is not None else 0,
                    rdata=[dnslib.EDNSOption(code, data) for code, data in options])
    return [rr for rr in record.ar if rr.rtype != OPT] + [opt]


# --- names on the wire ------------------------------------------------------------------------

def _valid_name(name: str) -> bool:
    """dns.IsDomainName for what a rewrite can produce: labels of 1..63 bytes, 255 in all."""
    if name == ".":
        return True
    if not name.endswith(".") or ".." in name or name.startswith("."):
        return False
    labels = name[:-1].split(".")
    return all(0 < len(x.encode()) <= 63 for x in labels) and sum(len(x.encode()) + 1 for x in labels) + 1 <= 255


def _wire_name(data: bytes) -> str | None:
    out, i = [], 0
    while i < len(data) and data[i]:
        n = data[i]
        if n > 63 or i + 1 + n > len(data):
            return None
        out.append(data[i + 1:i + 1 + n].decode("latin-1").lower())
        i += n + 1
    return ".".join(out) + "." if out else "."


def _name_wire(name: str) -> bytes:
    if name == ".":
        return b"\x00"
    return b"".join(bytes((len(x),)) + x.encode("latin-1") for x in name[:-1].split(".")) + b"\x00"


def _shallow(obj: _T) -> _T:
    """A shallow copy of a dnslib object (copy.copy costs ~10 times as much)."""
    out = object.__new__(type(obj))
    out.__dict__.update(obj.__dict__)
    return out


def _rewritten(rr: dnslib.RR, resp: list[RespRule]) -> dnslib.RR:
    if rr.rtype == OPT:
        return rr
    rr = _shallow(rr)
    for r in resp:
        r.on_rr(rr)
    return rr


# --- the plugin -------------------------------------------------------------------------------

class Rewrite(Plugin):
    name = "rewrite"

    MEMO = 4096     # names remembered by transparent(): a regex search costs microseconds, a lookup not

    def __init__(self, rules: list[Rule]) -> None:
        self.rules = rules
        self._memo: dict[tuple[str, int], bool] = {}

    async def serve(self, req: Request, next: Next) -> dnslib.DNSRecord:
        if req.data.get(_STOPPED):      # CoreDNS's one rule list: a stop rule ended it
            return await next(req)
        q = req.record.q
        st = _State(req.qname, q.qtype, q.qclass, req)
        matched, stopped, resp = False, False, []
        for rule in self.rules:
            got = rule.apply(st)
            if got is None:
                continue
            if not _valid_name(st.name):
                raise PluginError(SERVFAIL, f"invalid name after rewrite: {st.name}")
            matched = True
            resp += got
            if rule.mode == STOP:
                stopped = True
                break
        if not matched:
            return await next(req)
        if stopped:
            req.data[_STOPPED] = True
        original, wire = req.record, req.wire
        asked = _shallow(original)
        asked.header = _shallow(original.header)
        asked.questions = [dnslib.DNSQuestion(st.name, st.qtype, st.qclass), *original.questions[1:]]
        if st.edns is not None:
            asked.ar = _with_options(original, st.edns)
        req.record = asked
        req.wire = b""      # the bytes received are not this question any more (Request's default: none)
        try:
            reply = await next(req)
        finally:
            req.record, req.wire = original, wire
        # our own copy: the reply may be what a cache holds (records copied as they are
        # changed: a reply's pack()+parse() would cost ~20 times more)
        out = _shallow(reply)
        out.header = _shallow(reply.header)
        out.questions = list(original.questions)
        if resp:
            out.auth, out.rr, out.ar = ([_rewritten(rr, resp) for rr in section]
                                        for section in (reply.auth, reply.rr, reply.ar))
            for r in resp:
                r.on_reply(out)
            for r in resp:
                await r.lookup(out, req)
        return out

    def transparent(self, qname: str, qtype: int) -> bool:
        # a rule only ever matches the name as asked or as an earlier matching rule left it:
        # when none matches the question as asked, nothing is rewritten
        key = (qname, qtype)
        got = self._memo.get(key)
        if got is None:
            if len(self._memo) >= self.MEMO:
                self._memo.clear()
            got = self._memo[key] = not any(r.could_match(qname, qtype) for r in self.rules)
        return got

    def describe(self) -> str:
        return "; ".join(str(r) for r in self.rules)


def _tokens(d: Directive) -> list[Token]:
    """The rule's words: the line's, or (CoreDNS's `len(args) < 2`) those plus its block's lines."""
    toks = list(d.args)
    if d.body is None:
        return toks
    if len(toks) >= 2:
        raise CorefileError(d, "plugin/rewrite: a block follows only 'rewrite [continue|stop]': "
                               "put the whole rule on the line or in the block")
    for line in d.body:
        if line.body is not None:
            raise CorefileError(line, "plugin/rewrite: a rewrite block's lines take no block")
        toks.append(Token(line.name, line.file, line.line))
        toks += line.args
    return toks


def setup(directive: Directive, ctx: SetupContext) -> Plugin:
    try:
        rule = new_rule(_tokens(directive))
    except _RuleError as exc:
        where: Token | Directive = exc.token if exc.token is not None and exc.token.file else directive
        raise CorefileError(where, f"plugin/rewrite: {exc}") from None
    return Rewrite([rule])
