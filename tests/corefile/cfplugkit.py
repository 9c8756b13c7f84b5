"""Helpers of the plugin unit tests (imported as a module: `from tests.corefile.cfplugkit import ...`).

directive(text): one Corefile directive (with its `{ ... }` block) read into syntax.Directive
with FILE:LINE, by a small reader of the Corefile's words, quotes and braces, so each test
writes the plugin line as a Corefile would; query(): a Request; canned(): a `next` that
answers from dnslib zone text and records what it was asked.
"""
from __future__ import annotations

import dnslib

from clusterdns.corefile.plugin import PluginError, Request, SetupContext
from clusterdns.corefile.syntax import Directive, Token

FILE = "Corefile"


def _words(text: str) -> list[Token]:
    out: list[Token] = []
    line, i = 1, 0
    while i < len(text):
        c = text[i]
        if c == "\n":
            line += 1
            i += 1
        elif c.isspace():
            i += 1
        elif c == "#":
            while i < len(text) and text[i] != "\n":
                i += 1
        elif c == '"':
            j, buf = i + 1, []
            while text[j] != '"':
                if text[j] == "\\" and text[j + 1] == '"':
                    j += 1
                buf.append(text[j])
                j += 1
            out.append(Token("".join(buf), FILE, line, quoted=True))
            line += "".join(buf).count("\n")
            i = j + 1
        else:
            j = i
            while j < len(text) and not text[j].isspace() and text[j] != "#":
                j += 1
            out.append(Token(text[i:j], FILE, line))
            i = j
    return out


def _read(toks: list[Token], i: int) -> tuple[Directive, int]:
    head = toks[i]
    d = Directive(head.text, file=FILE, line=head.line)
    i += 1
    while i < len(toks) and toks[i].line == head.line and toks[i].text not in ("{", "}"):
        d.args.append(toks[i])
        i += 1
    if i < len(toks) and toks[i].text == "{" and not toks[i].quoted:
        d.body = []
        i += 1
        while toks[i].text != "}" or toks[i].quoted:
            sub, i = _read(toks, i)
            d.body.append(sub)
        i += 1
    return d, i


def directive(text: str) -> Directive:
    toks = _words(text)
    d, i = _read(toks, 0)
    assert i == len(toks), f"one directive expected, left: {toks[i:]}"
    return d


def ctx(zones: list[str] | None = None) -> SetupContext:
    return SetupContext(zones=zones or ["."], corefile=FILE, server="dns://127.0.0.1:53")


def query(name: str, qtype: str = "A", *, edns: int | None = None, do: bool = False, tcp: bool = False,
          client: tuple[str, int] = ("10.240.0.1", 40212), qid: int = 4242) -> Request:
    q = dnslib.DNSRecord.question(name, qtype)
    q.header.id = qid
    if edns is not None:
        q.add_ar(dnslib.EDNS0(udp_len=edns, flags="do" if do else ""))
    return Request(record=q, client=client, tcp=tcp, server="dns://127.0.0.1:53", wire=bytes(q.pack()))


class Canned:
    """A `next` plugin: replies with zone text per section (`@` = the name it was asked), or raises."""

    def __init__(self, answer: str = "", auth: str = "", extra: str = "", rcode: int = 0,
                 error: PluginError | None = None, aa: bool = True) -> None:
        self.sections = {"rr": answer, "auth": auth, "ar": extra}
        self.rcode, self.error, self.aa = rcode, error, aa
        self.asked: list[dnslib.DNSRecord] = []
        self.wires: list[bytes] = []
        self.replies: list[dnslib.DNSRecord] = []

    async def __call__(self, req: Request) -> dnslib.DNSRecord:
        self.asked.append(req.record)
        self.wires.append(req.wire)
        if self.error is not None:
            raise self.error
        reply = req.reply(self.rcode, aa=self.aa)
        qname = str(req.record.q.qname)
        for section, text in self.sections.items():
            if text:
                getattr(reply, section).extend(dnslib.RR.fromZone(text.replace("@", qname)))
        self.replies.append(reply)
        return reply


def names(rrs: list[dnslib.RR]) -> list[str]:
    return [str(rr.rname) for rr in rrs]


def chain(plugins: list, last):
    """plugins[0] -> plugins[1] -> ... -> last, as a server block links them."""
    handler = last
    for p in reversed(plugins):
        handler = (lambda plug, nxt: (lambda req: plug.serve(req, nxt)))(p, handler)
    return handler


def real_directives(plugin: str) -> list[tuple[str, Directive]]:
    """Every `plugin` line of the real Corefiles in tests/corefile/real/, read by the Corefile parser."""
    from pathlib import Path

    from clusterdns.corefile.parse import parse_text
    found = []
    for path in sorted((Path(__file__).resolve().parent / "real").glob("*.corefile")):
        text = path.read_text()
        if "__PILLAR__" in text:      # node-local-dns's template: read once filled (test_cf_pillars)
            continue
        for block in parse_text(text, path.name, env={}, base_dir=str(path.parent)):
            found += [(f"{d.where}", d) for d in block.directives if d.name == plugin]
    return found


class Upstream:
    """`async with Upstream({name: [rrset texts]}) as up`: tests/dns/dnskit.FakeUpstream on loopback."""

    def __init__(self, records: dict[str, list[str]] | None = None) -> None:
        from tests.dns.dnskit import FakeUpstream
        self.fake = FakeUpstream(records or {})

    async def __aenter__(self):
        return await self.fake.start()

    async def __aexit__(self, *exc) -> None:
        await self.fake.stop()
