"""rewrite (clusterdns/corefile/plugins/rewrite.py), pinned to coredns/coredns plugin/rewrite:
README.md, rewrite_test.go (TestNewRule, TestRewrite), name.go (newNameRule, parseAnswerRules,
the auto/suffix/remap rewriters), ttl.go and ttl_test.go (TestNewTTLRule, doTTLTests, TTL ranges),
rcode.go, reverter.go (answer values) and setup_test.go (the block form)."""
from __future__ import annotations

import re
import time

import dns.message
import dns.rcode
import dns.rrset
import dnslib
import pytest

from clusterdns.corefile.plugin import SERVFAIL, PluginError
from clusterdns.corefile.plugins import rewrite
from clusterdns.corefile.syntax import CorefileError
from tests.corefile.cfplugkit import Canned, Upstream, chain, ctx, directive, names, query, real_directives
from tests.corefile.cfserve import CorefileServer, answers

A, ANY, HINFO, SRV = 1, 255, 13, 33


def plug(text: str) -> rewrite.Rewrite:
    p = rewrite.setup(directive(text), ctx())
    assert isinstance(p, rewrite.Rewrite)
    return p


def refused(text: str) -> str:
    with pytest.raises(CorefileError) as info:
        rewrite.setup(directive(text), ctx())
    return str(info.value)


# --- setup: CoreDNS's TestNewRule, its successes and its failures ---------------------------------

@pytest.mark.parametrize("text", [
    "rewrite name a.com b.com",
    "rewrite name exact a.com b.com",
    "rewrite name prefix a.com b.com",
    "rewrite name suffix a.com b.com",
    r"rewrite name suffix foo3.bar google.com answer name g(o+)gle(.*) f{1}{2}",
    "rewrite name substring a.com b.com",
    r"rewrite name regex ([a])\.com new-{1}.com",
    r"rewrite name regex (dns)\.(core)\.(rocks) {2}.{1}.{3} answer name (core)\.(dns)\.(rocks) {2}.{1}.{3}",
    r"rewrite name substring fcore.dns.rocks dns.fcore.rocks answer name (fcore)\.(dns)\.(rocks) {2}.{1}.{3}",
    "rewrite name suffix .coredns.rocks .service.consul answer auto",
    r"rewrite name regex (.*)\.a\.com {1}.b.com answer auto answer value (.*)\.b\.com {1}.a.com",
    r"rewrite name regex (.*)\.a\.com {1}.b.com answer name (.*)\.b\.com {1}.a.com value (.*)\.b\.com {1}.a.com",
    "rewrite type any a",
    "rewrite type ANY HINFO",
    "rewrite class ch in",
    "rewrite stop name a.com b.com",
    "rewrite continue name a.com b.com",
    "rewrite STOP type any a",
    "rewrite Continue class ch in",
    "rewrite ttl srv1.coredns.rocks 10",
    "rewrite ttl exact srv1.coredns.rocks 15",
    "rewrite ttl prefix coredns.rocks 20",
    "rewrite ttl suffix srv1 25",
    "rewrite ttl substring coredns 30",
    r"rewrite continue ttl regex (srv1)\.(coredns)\.(rocks) 35",
    "rewrite ttl a.b 30-300",
    "rewrite ttl a.b 30-",
    "rewrite ttl a.b -300",
    "rewrite rcode a.b NXDOMAIN NOERROR",
    "rewrite rcode suffix .a.b 3 0",
    "rewrite stop {\n  name regex foo bar\n  answer name bar foo\n}",
    "rewrite edns0 local set 65518 abcdefg",
    "rewrite cname a.com. b.com.",
    "rewrite continue cname exact a.com. b.com.",
    "rewrite cname suffix .cdn.example. .svc.cluster.local.",
    r"rewrite cname regex (.*)\.cdn\.example\. {1}.svc.cluster.local.",
    "rewrite edns0 local set 0xffee abcdefg",
    "rewrite edns0 local append 0xffee abcdefg",
    "rewrite edns0 local replace 0xffee abcdefg",
    "rewrite edns0 nsid set",
    "rewrite edns0 nsid append",
    "rewrite edns0 nsid replace",
    "rewrite stop edns0 local set 0xffee {qname}",
    "rewrite continue edns0 local append 0xffee {qtype}",
    "rewrite edns0 local replace 0xffee {client_ip}",
    "rewrite edns0 local set 0xffee {client_port}",
    "rewrite edns0 local set 0xffee {protocol}",
    "rewrite edns0 local set 0xffee {server_ip}",
    "rewrite edns0 local set 0xffee {server_port}",
    "rewrite edns0 subnet set 24 56",
    "rewrite continue edns0 subnet append 24 56",
    "rewrite stop edns0 subnet replace 24 56",
    "rewrite {\n  name exact a.com b.com\n}",
])
def test_setup_accepts(text):
    assert plug(text).rules


@pytest.mark.parametrize("text, message", [
    ("rewrite", "no rule type specified"),
    ("rewrite foo", "invalid rule type 'foo'"),
    ("rewrite name", "too few arguments for a name rule"),
    ("rewrite name a.com", "too few arguments for a name rule"),
    ("rewrite name a.com b.com c.com", "supports only exact, prefix, suffix, substring, and regex"),
    (r"rewrite name regex ([a]\.com new-{1}.com", "invalid regex matching pattern"),
    (r"rewrite name regex (a)\.com {1}{2}.com", "uses more subexpressions"),
    # Go's regexp (RE2): no look-around or backreferences, as CoreDNS
    (r"rewrite name regex (?<=a)b x", "invalid regex matching pattern: (?<=a)b (error parsing regexp: invalid perl"),
    (r"rewrite name regex (a)\1 x", "invalid regex matching pattern"),
    (r"rewrite name regex (adns)\.(core)\.(rocks) {2}.{1}.{3} answer name (core)\.(adns)\.(rocks) {2}.{1}.{3} "
     "too.long way.too.long", "invalid type 'too.long' for answer rule"),
    (r"rewrite name regex (bdns)\.(core)\.(rocks) {2}.{1}.{3} NoAnswer name (core)\.(bdns)\.(rocks) {2}.{1}.{3}",
     "exceeded the number of arguments"),
    (r"rewrite name regex (cdns)\.(core)\.(rocks) {2}.{1}.{3} answer ttl (core)\.(cdns)\.(rocks) {2}.{1}.{3}",
     "invalid type 'ttl' for answer rule"),
    (r"rewrite name regex (d)\.x {1}.y answer name (\.x {1}.y", "invalid regex matching pattern"),
    ("rewrite name substring a.com b.com c.com", "invalid arguments for substring rule"),
    ("rewrite name substring a.com b.com c.com d.com", "exceeded the number of arguments"),
    ("rewrite name regex a b answer", "invalid arguments for regex rule"),
    ("rewrite name regex a b answer name x", "2 arguments required"),
    (r"rewrite name regex (.*)\.a {1}.b answer auto answer name (.*)\.b {1}.a", "cannot be combined"),
    ("rewrite answer name a b", "response rewrites must begin with a name rule"),
    ("rewrite stop", "stop rule must begin with a rule type"),
    ("rewrite type", "type rules must have exactly two arguments"),
    ("rewrite type a", "type rules must have exactly two arguments"),
    ("rewrite type any a a", "type rules must have exactly two arguments"),
    ("rewrite type XY WV", "invalid type 'XY'"),
    ("rewrite type ANY WV", "invalid type 'WV'"),
    ("rewrite class", "class rules must have exactly two arguments"),
    ("rewrite class IN", "class rules must have exactly two arguments"),
    ("rewrite class ch in in", "class rules must have exactly two arguments"),
    ("rewrite class XY WV", "invalid class 'XY'"),
    ("rewrite class IN WV", "invalid class 'WV'"),
    ("rewrite unknown-action name a.com b.com", "invalid rule type 'unknown-action'"),
    ("rewrite edns0", "too few arguments for an EDNS0 rule"),
    ("rewrite edns0 local", "too few arguments for an EDNS0 rule"),
    ("rewrite edns0 local set", "EDNS0 local rules require exactly three args"),
    ("rewrite edns0 local set 0xffee", "EDNS0 local rules require exactly three args"),
    ("rewrite edns0 local foo 0xffee abcdefg", "invalid action: 'foo'"),
    ("rewrite edns0 local set 0xffee 0xabcdefg", "invalid hex data '0xabcdefg'"),
    ("rewrite edns0 local set 0x1ffff abc", "invalid EDNS0 local option code '0x1ffff'"),
    ("rewrite edns0 nsid set junk", "EDNS0 NSID rules do not accept args"),
    ("rewrite edns0 nsid foo", "invalid action: 'foo'"),
    ("rewrite edns0 cookie set", "invalid rule type 'cookie'"),
    ("rewrite edns0 local set 0xffee {dummy}", "unsupported variable name '{dummy}'"),
    ("rewrite edns0 local set 0xffee {some-plugin/some-label}", "metadata labels need the metadata plugin"),
    ("rewrite edns0 subnet set -1 56", "invalid IPv4 bit mask length -1"),
    ("rewrite edns0 subnet set 24 -56", "invalid IPv6 bit mask length -56"),
    ("rewrite edns0 subnet set 33 56", "invalid IPv4 bit mask length 33"),
    ("rewrite edns0 subnet set 24 129", "invalid IPv6 bit mask length 129"),
    ("rewrite unknown-action edns0 local set 0xffee abcedef", "invalid rule type 'unknown-action'"),
    ("rewrite cname a.com.", "too few (1) arguments for a cname rule"),
    ("rewrite cname exact a.com. b.com. c.com.", "too few (4) arguments for a cname rule"),
    ("rewrite cname fuzzy a.com. b.com.", "unknown cname rewrite type: fuzzy"),
    ("rewrite cname regex (a b.", "invalid regex matching pattern"),
    ("rewrite ttl srv1.coredns.rocks 12345678901234567890", "invalid TTL '12345678901234567890'"),
    ("rewrite ttl srv1.coredns.rocks coredns.rocks", "invalid TTL 'coredns.rocks'"),
    ("rewrite ttl srv1.coredns.rocks -", "invalid TTL '-'"),
    ("rewrite ttl a.b 300-30", "invalid TTL '300-30'"),
    ("rewrite ttl a.b 1-2-3", "invalid TTL '1-2-3'"),
    ("rewrite ttl a", "too few (1) arguments for a ttl rule"),
    ("rewrite ttl exact a b 10", "too many arguments for a ttl rule"),
    ("rewrite ttl fuzzy a.b 10", "ttl rule supports only exact"),
    (r"rewrite ttl regex (a\.b 10", "invalid regex pattern in a ttl rule"),
    ("rewrite rcode a.b NXDOMAIN", "too few (2) arguments for a rcode rule"),
    ("rewrite rcode a.b NOPE NOERROR", "invalid matching RCODE 'NOPE'"),
    ("rewrite rcode a.b NXDOMAIN 99", "invalid replacement RCODE '99'"),
    ("rewrite rcode a.b NXDOMAIN BADCOOKIE", "extended RCODEs"),
    ("rewrite stop name a b {\n  answer auto\n}", "a block follows only 'rewrite [continue|stop]'"),
    ("rewrite stop {\n}", "stop rule must begin with a rule type"),
])
def test_setup_refuses_with_file_line(text, message):
    err = refused(text)
    assert re.match(r"Corefile:[12]: plugin/rewrite: ", err), err
    assert message in err, err


def test_block_errors_name_the_line_at_fault():
    # setup_test.go: an answer before the name rule; the error points at the block's line
    err = refused("rewrite stop {\n    answer name bar foo\n    name regex foo bar\n}")
    assert err.startswith("Corefile:2: plugin/rewrite: response rewrites must begin with a name rule"), err
    err = refused("rewrite stop {\n    name regex (.*)\\.x {1}.y\n    answer name (x {1}\n}")
    assert err.startswith("Corefile:3: plugin/rewrite: invalid regex matching pattern: (x"), err
    err = refused("rewrite continue {\n  ttl exact a.b soon\n}")
    assert err.startswith("Corefile:2: plugin/rewrite: invalid TTL 'soon'"), err


def test_block_joins_lines_into_one_rule_and_a_second_name_line_is_another_answer_rule():
    # name.go parseAnswerRules: after the first `answer` the keyword may be left out
    p = plug("rewrite stop {\n    name regex foo bar\n    answer name bar foo\n    name baz qux\n}")
    assert len(p.rules) == 1
    rule = p.rules[0]
    assert isinstance(rule, rewrite.NameRule) and len(rule.static) == 2


# --- serving: CoreDNS's TestRewrite table through a chain of rewrite lines -------------------------

TABLE = [
    "rewrite stop name from.nl. to.nl.",
    r"rewrite stop name regex (core)\.(dns)\.(rocks)\.(nl) {2}.{1}.{3}.{4} answer name (dns)\.(core)\.(rocks)\.(nl) "
    r"{2}.{1}.{3}.{4}",
    "rewrite stop name exact from.exact.nl. to.nl.",
    "rewrite stop name prefix prefix to",
    "rewrite stop name suffix .suffix. .nl.",
    "rewrite stop name substring from.substring to",
    r"rewrite stop name regex (f.*m)\.regex\.(nl) to.{2}",
    r"rewrite continue name regex consul\.(rocks) core.dns.{1}",
    "rewrite stop name core.dns.rocks to.nl.",
    "rewrite continue class HS CH",
    "rewrite stop class CH IN",
    "rewrite stop type ANY HINFO",
]


@pytest.mark.parametrize("asked, qtype, qclass, sent, stype, sclass, owner", [
    ("from.nl.", A, 1, "to.nl.", A, 1, "from.nl."),              # exact rules map the answer back
    ("a.nl.", A, 1, "a.nl.", A, 1, "a.nl."),
    ("a.nl.", A, 3, "a.nl.", A, 1, "a.nl."),
    ("a.nl.", ANY, 1, "a.nl.", HINFO, 1, None),
    ("from.nl.", ANY, 1, "to.nl.", ANY, 1, None),                # name is rewritten, type is not (stop)
    ("from.exact.nl.", A, 1, "to.nl.", A, 1, "from.exact.nl."),
    ("prefix.nl.", A, 1, "to.nl.", A, 1, "to.nl."),              # prefix without answer auto: no revert
    ("to.suffix.", A, 1, "to.nl.", A, 1, "to.nl."),
    ("from.substring.nl.", A, 1, "to.nl.", A, 1, "to.nl."),
    ("from.regex.nl.", A, 1, "to.nl.", A, 1, "to.nl."),
    ("consul.rocks.", A, 1, "to.nl.", A, 1, "core.dns.rocks."),  # continue, then the exact rule (its revert)
    ("a.nl.", ANY, 3, "a.nl.", ANY, 1, None),                    # class rewritten and stops: type is not
    ("a.nl.", ANY, 4, "a.nl.", ANY, 1, None),                    # HS -> CH (continue), CH -> IN (stop)
    ("core.dns.rocks.nl.", A, 1, "dns.core.rocks.nl.", A, 1, "core.dns.rocks.nl."),
    ("FROM.nl.", A, 1, "to.nl.", A, 1, "from.nl."),              # names are matched lower-cased
    ("Core.DNS.Rocks.NL.", A, 1, "dns.core.rocks.nl.", A, 1, "core.dns.rocks.nl."),
])
async def test_rewrite_table(asked, qtype, qclass, sent, stype, sclass, owner):
    plugins = [plug(t) for t in TABLE]
    last = Canned(answer="@ 300 IN A 127.0.0.1")
    req = query(asked, dnslib.QTYPE[qtype])
    req.record.q.qclass = qclass
    original_q = req.record.q
    reply = await chain(plugins, last)(req)
    seen = last.asked[0].q
    assert (str(seen.qname), seen.qtype, seen.qclass) == (sent, stype, sclass)
    # the received bytes are not passed on as the rewritten query's
    assert last.wires[0] == (req.wire if sent == asked.lower() and (stype, sclass) == (qtype, qclass) else b"")
    # the reply carries the client's question (spelled as asked); the request is as it came
    assert reply.q == original_q and str(reply.q.qname) == asked
    assert req.record.q is original_q
    if owner is not None:
        assert names(reply.rr) == [owner]


async def test_stop_in_one_line_ends_the_later_lines_too():
    plugins = [plug("rewrite name a.nl. b.nl."), plug("rewrite name b.nl. c.nl.")]
    last = Canned(answer="@ 300 IN A 127.0.0.1")
    await chain(plugins, last)(query("a.nl."))
    assert str(last.asked[0].q.qname) == "b.nl."
    plugins = [plug("rewrite continue name a.nl. b.nl."), plug("rewrite name b.nl. c.nl.")]
    last = Canned(answer="@ 300 IN A 127.0.0.1")
    reply = await chain(plugins, last)(query("a.nl."))
    assert str(last.asked[0].q.qname) == "c.nl."
    assert names(reply.rr) == ["a.nl."]        # each exact rule maps its own step back


async def test_aks_block_rewrites_question_and_answer_names():
    # aks-coredns-custom.corefile, "Configure DNS name rewrites"
    p = plug("rewrite stop {\n  name regex (.*)\\.example\\.com {1}.default.svc.cluster.local\n"
             "  answer name (.*)\\.default\\.svc\\.cluster\\.local {1}.example.com\n}")
    last = Canned(answer="@ 5 IN A 10.96.0.10\n@ 5 IN A 10.96.0.11")
    req = query("Web.Example.com.")
    reply = await p.serve(req, last)
    assert str(last.asked[0].q.qname) == "web.default.svc.cluster.local."
    assert names(reply.rr) == ["web.example.com.", "web.example.com."]
    assert str(reply.q.qname) == "Web.Example.com."
    # the reply next gave back is left as it was (a cache may hold it)
    assert names(last.replies[0].rr) == ["web.default.svc.cluster.local."] * 2


async def test_answer_value_rewrites_record_data():
    p = plug(r"rewrite name regex (.*)\.coredns\.rocks {1}.svc.cluster.local "
             r"answer name (.*)\.svc\.cluster\.local {1}.coredns.rocks "
             r"answer value (.*)\.svc\.cluster\.local {1}.coredns.rocks")
    last = Canned(answer="@ 5 IN SRV 0 100 443 web.svc.cluster.local.\n"
                         "@ 5 IN MX 10 mail.svc.cluster.local.\n"
                         "@ 5 IN CNAME api.svc.cluster.local.\n"
                         "@ 5 IN NS ns.svc.cluster.local.\n"
                         "other.example. 5 IN CNAME keep.example.",
                  auth="svc.cluster.local. 5 IN SOA ns.svc.cluster.local. host.example. 1 2 3 4 5",
                  extra="web.svc.cluster.local. 5 IN A 10.0.0.1")
    reply = await p.serve(query("xmpp.coredns.rocks.", "SRV"), last)
    values = [str(rr.rdata).split()[-1] for rr in reply.rr]
    assert names(reply.rr)[:4] == ["xmpp.coredns.rocks."] * 4
    assert values == ["web.coredns.rocks.", "mail.coredns.rocks.", "api.coredns.rocks.", "ns.coredns.rocks.",
                      "keep.example."]
    assert names(reply.rr)[4] == "other.example."
    assert str(reply.auth[0].rdata.mname) == "ns.coredns.rocks."
    assert names(reply.auth) == ["svc.cluster.local."]     # `svc.cluster.local.` has no `.` before it
    assert names(reply.ar) == ["web.coredns.rocks."]
    # next's reply (a cache's, say) is left as it was
    kept = last.replies[0]
    assert str(kept.rr[0].rdata).split()[-1] == "web.svc.cluster.local."
    assert names(kept.rr)[0] == "xmpp.svc.cluster.local." and str(kept.auth[0].rdata.mname) == "ns.svc.cluster.local."


async def test_without_answer_value_record_data_stays():
    p = plug(r"rewrite name regex (.*)\.coredns\.rocks {1}.svc.cluster.local "
             r"answer name (.*)\.svc\.cluster\.local {1}.coredns.rocks")
    last = Canned(answer="@ 5 IN CNAME api.svc.cluster.local.")
    reply = await p.serve(query("xmpp.coredns.rocks."), last)
    assert names(reply.rr) == ["xmpp.coredns.rocks."]
    assert str(reply.rr[0].rdata) == "api.svc.cluster.local."


async def test_suffix_answer_auto_swaps_suffixes_back():
    # README "Auto Response Name Rewrite"; kubespray's old_dns_domains line
    p = plug("rewrite name suffix .coredns.rocks .service.consul answer auto")
    last = Canned(answer="@ 5 IN CNAME web.service.consul.\nweb.service.consul. 5 IN A 10.0.0.1")
    reply = await p.serve(query("www.CoreDNS.rocks."), last)
    assert str(last.asked[0].q.qname) == "www.service.consul."
    assert names(reply.rr) == ["www.coredns.rocks.", "web.coredns.rocks."]
    assert str(reply.rr[0].rdata) == "web.coredns.rocks."
    # text, not labels: a suffix without its leading dot also matches inside a label
    p = plug("rewrite name suffix coredns.rocks service.consul answer auto")
    last = Canned(answer="@ 5 IN A 10.0.0.2")
    reply = await p.serve(query("x.notcoredns.rocks."), last)
    assert names(reply.rr) == ["x.notcoredns.rocks."]
    assert str(last.asked[0].q.qname) == "x.notservice.consul."


async def test_kubespray_old_domain_suffix_line():
    p = plug("rewrite name suffix cluster.old cluster.local answer auto")
    last = Canned(answer="@ 5 IN A 10.96.0.1")
    reply = await p.serve(query("kubernetes.default.svc.cluster.old."), last)
    assert str(last.asked[0].q.qname) == "kubernetes.default.svc.cluster.local."
    assert names(reply.rr) == ["kubernetes.default.svc.cluster.old."]


async def test_exact_rule_maps_subdomains_in_values_back():
    # remapStringRewriter: the name and names under it
    p = plug("rewrite name exact RED.example BLUE.example")
    last = Canned(answer="@ 5 IN CNAME a.blue.example.\na.blue.example. 5 IN A 10.0.0.1")
    reply = await p.serve(query("red.example."), last)
    assert str(last.asked[0].q.qname) == "blue.example."
    assert names(reply.rr) == ["red.example.", "a.red.example."]
    assert str(reply.rr[0].rdata) == "a.red.example."


async def test_prefix_and_substring_answer_auto():
    p = plug("rewrite name prefix www web answer auto")
    last = Canned(answer="@ 5 IN A 10.0.0.1")
    reply = await p.serve(query("www.a.b."), last)
    assert str(last.asked[0].q.qname) == "web.a.b."
    assert names(reply.rr) == ["www.a.b."]
    p = plug("rewrite name substring .old. .new. answer auto")
    last = Canned(answer="@ 5 IN A 10.0.0.1")
    reply = await p.serve(query("x.old.y."), last)
    assert str(last.asked[0].q.qname) == "x.new.y."
    assert names(reply.rr) == ["x.old.y."]


async def test_regex_matching_is_linear_time():
    # RE2, as Go: a pattern that backtracks exponentially in Python's re costs one pass here
    p = plug(r"rewrite name regex (a+)+\.x\. ok")
    name = "a" * 60 + ".y."
    assert p.transparent(name, A)
    reply = await p.serve(query(name), Canned(answer="@ 5 IN A 10.0.0.1"))
    assert names(reply.rr) == [name]
    # the classic catastrophic patterns over the longest names there are (63-byte labels,
    # 253 bytes): each costs about what a plain pattern does (Python's re: years for some)
    longest = ".".join(["a" * 63] * 3) + "." + "a" * 61 + "."
    plain = plug(r"rewrite name regex ^b\.x\.$ ok")
    bad = [plug(f"rewrite name regex {rx} ok") for rx in
           (r"^(a+)+$", r"^(a|aa)+$", r"^(a|a?)+$", r"^(.*a){12}$", r"^(a*)*b$", r"^((a+)\.?)+x$")]

    def cost(plugin) -> float:
        rule = plugin.rules[0]          # its matcher itself (transparent() remembers names)
        began = time.perf_counter()
        for _ in range(200):
            assert not rule.could_match(longest, A)
        return time.perf_counter() - began
    base = min(cost(plain) for _ in range(3))
    for rule in bad:
        took = min(cost(rule) for _ in range(3))
        assert took < max(0.05, 50 * base), (rule.describe(), took, base)


async def test_invalid_name_after_rewrite_is_servfail():
    p = plug("rewrite name suffix .a. ..b.")
    last = Canned(answer="@ 5 IN A 10.0.0.1")
    with pytest.raises(PluginError) as info:
        await p.serve(query("x.a."), last)
    assert info.value.rcode == SERVFAIL
    assert info.value.reason == "invalid name after rewrite: x..b."
    assert last.asked == []
    p = plug(r"rewrite name regex (.*)\.long\. {1}{1}{1}{1}{1}{1}{1}{1}{1}.x")
    with pytest.raises(PluginError, match="invalid name after rewrite"):
        await p.serve(query("abcdefghij.long."), last)


async def test_errors_from_next_pass_through_and_the_request_is_restored():
    p = plug("rewrite name a.nl. b.nl.")
    req = query("a.nl.")
    before = req.record
    with pytest.raises(PluginError) as info:
        await p.serve(req, Canned(error=PluginError(SERVFAIL, "upstream timeout")))
    assert info.value.reason == "upstream timeout"
    assert req.record is before and str(req.record.q.qname) == "a.nl."


# --- edns0 (rewrite_test.go TestRewriteEDNS0Local, TestEdns0LocalMultiRule, *Variable, *Subnet) ---

def options(record: dnslib.DNSRecord) -> list[tuple[int, bytes]] | None:
    opt = [rr for rr in record.ar if rr.rtype == 41]
    return [(o.code, bytes(o.data)) for o in opt[0].rdata] if opt else None


@pytest.mark.parametrize("rule, before, after", [
    ("local set 0xffee 0xabcdef", None, [(0xFFEE, b"\xab\xcd\xef")]),
    ("local append 0xffee abcdefghijklmnop", None, [(0xFFEE, b"abcdefghijklmnop")]),
    ("local replace 0xffee abcdefghijklmnop", None, None),        # nothing to replace: the query is as it was
    ("local replace 0xffee abc", [(0xFFEE, b"old"), (10, b"x")], [(0xFFEE, b"abc"), (10, b"x")]),
    ("local set 65518 abc", [(0xFFEE, b"old")], [(0xFFEE, b"abc")]),
    ("nsid set", None, [(3, b"")]),
    ("nsid append", None, [(3, b"")]),
    ("nsid replace", None, None),
    ("nsid set", [(3, b"node-1")], [(3, b"")]),
    ("local set 0xffee {qname}", None, [(0xFFEE, b"Example.com.")]),
    ("local set 0xffee {qtype}", None, [(0xFFEE, b"\x00\x01")]),
    ("local set 0xffee {client_ip}", None, [(0xFFEE, bytes([10, 240, 0, 1]))]),
    ("local set 0xffee {client_port}", None, [(0xFFEE, bytes([0x9D, 0x14]))]),
    ("local set 0xffee {protocol}", None, [(0xFFEE, b"udp")]),
    ("local set 0xffee {server_port}", None, [(0xFFEE, bytes([0x00, 0x35]))]),
    ("local set 0xffee {server_ip}", None, [(0xFFEE, bytes([127, 0, 0, 1]))]),
    ("local append 0xffee {qtype}", [(0xFFEE, b"old")], None),        # a variable append over one: ignored
    ("subnet set 24 56", None, [(8, bytes([0, 1, 24, 0, 10, 240, 0]))]),
    ("subnet set 32 56", None, [(8, bytes([0, 1, 32, 0, 10, 240, 0, 1]))]),
    ("subnet set 0 56", None, [(8, bytes([0, 1, 0, 0]))]),
    ("subnet append 24 56", [(8, bytes([0, 1, 16, 0, 1, 2]))], None),
    ("subnet replace 24 56", [(8, bytes([0, 1, 16, 0, 1, 2]))], [(8, bytes([0, 1, 24, 0, 10, 240, 0]))]),
])
async def test_edns0_rules(rule, before, after):
    p = plug(f"rewrite edns0 {rule}")
    req = query("Example.com.", edns=1232 if before is not None else None)
    if before is not None:
        req.record.ar[0].rdata = [dnslib.EDNSOption(c, d) for c, d in before]
    original = options(req.record)
    last = Canned(answer="@ 5 IN A 10.0.0.1")
    await p.serve(req, last)
    assert options(last.asked[0]) == (after if after is not None else before)
    assert options(req.record) == original        # the request object is left as it came
    if after is not None and before is None:
        opt = [rr for rr in last.asked[0].ar if rr.rtype == 41][0]
        assert (opt.rclass, opt.ttl) == (4096, 0)     # setupEdns0Opt: SetEdns0(4096, false)


async def test_edns0_subnet_ipv6_and_kept_flags():
    p = plug("rewrite edns0 subnet set 24 56")
    req = query("example.com.", edns=1232, do=True, client=("fe80::42:ff:feca:4c65", 53000))
    last = Canned()
    await p.serve(req, last)
    assert options(last.asked[0]) == [(8, bytes([0, 2, 56, 0, 0xFE, 0x80, 0, 0, 0, 0, 0]))]
    opt = [rr for rr in last.asked[0].ar if rr.rtype == 41][0]
    assert (opt.rclass, opt.ttl) == (1232, 0x8000)       # the client's size and DO bit kept
    p = plug("rewrite edns0 subnet set 24 128")
    await p.serve(query("example.com.", client=("fe80::42:ff:feca:4c65", 1)), last)
    assert options(last.asked[1]) == [(8, bytes([0, 2, 128, 0]) + bytes.fromhex("fe80000000000000004200fffeca4c65"))]


async def test_edns0_multi_rule():
    # TestEdns0LocalMultiRule: replace (ignored without the option), then set
    plugins = [plug("rewrite edns0 local replace 0xffee abcdef"), plug("rewrite edns0 local set 0xffee fedcba")]
    last = Canned()
    await chain(plugins, last)(query("example.com."))
    assert options(last.asked[0]) == [(0xFFEE, b"fedcba")]
    req = query("example.com.", edns=4096, do=True)
    req.record.ar[0].rdata = [dnslib.EDNSOption(0xFFEE, b"foobar")]
    await chain(plugins, last)(req)
    assert options(last.asked[1]) == [(0xFFEE, b"abcdef")]


def test_edns0_is_never_transparent():
    assert not plug("rewrite edns0 nsid set").transparent("web.default.svc.cluster.local.", 1)


# --- cname (cname_target_test.go) ------------------------------------------------------------------

class FakeBlock:
    """req.data['block'].run: what the server block answers for a cname rule's new target."""

    def __init__(self, answers: dict[str, str]) -> None:
        self.answers, self.asked = answers, []

    async def run(self, req):
        self.asked.append((str(req.record.q.qname), req.record.q.qtype))
        return await Canned(answer=self.answers.get(str(req.record.q.qname), ""))(req)


@pytest.mark.parametrize("rule, target, new", [
    ("exact cname.test.com. target.test.com.", "cname.test.com.", "target.test.com."),
    ("prefix cname target", "cname.test.com.", "target.test.com."),
    ("suffix .example.org. .test.com.", "target.example.org.", "target.test.com."),
    ("substring -ext. -int.", "svc-ext.test.com.", "svc-int.test.com."),
    (r"regex (.*)\.cdn\.(.*)\. {1}.{2}.", "img.cdn.test.com.", "img.test.com."),
])
async def test_cname_target_rewrite(rule, target, new):
    p = plug(f"rewrite cname {rule}")
    block = FakeBlock({new: f"{new} 30 IN A 10.0.0.9\nother.test. 30 IN A 10.0.0.8"})
    req = query("www.example.com.")
    req.data["block"] = block
    reply = await p.serve(req, Canned(answer=f"@ 30 IN CNAME {target}\n{target} 30 IN A 192.0.2.1"))
    assert block.asked == [(new, 1)]
    assert [(str(rr.rname), rr.rtype, str(rr.rdata)) for rr in reply.rr] == [
        ("www.example.com.", 5, new), (new, 1, "10.0.0.9")]


async def test_cname_rule_leaves_other_targets_and_its_own_lookup_alone():
    p = plug("rewrite cname exact cname.test.com. target.test.com.")
    block = FakeBlock({})
    req = query("www.example.com.")
    req.data["block"] = block
    reply = await p.serve(req, Canned(answer="@ 30 IN CNAME other.test.com.\nother.test.com. 30 IN A 192.0.2.1"))
    assert block.asked == [] and [str(rr.rdata) for rr in reply.rr] == ["other.test.com.", "192.0.2.1"]
    assert not p.transparent("www.example.com.", 1)       # it takes every query
    req = query("target.test.com.")
    req.data["rewrite.cname_lookup"] = True
    last = Canned(answer="@ 30 IN CNAME cname.test.com.")
    reply = await p.serve(req, last)
    assert str(reply.rr[0].rdata) == "cname.test.com."


# --- ttl and rcode ----------------------------------------------------------------------------------

TTL_RULES = [
    "rewrite stop ttl srv1.coredns.rocks 1",
    "rewrite stop ttl exact srv15.coredns.rocks 15",
    "rewrite stop ttl prefix srv30 30",
    "rewrite stop ttl suffix 45.coredns.rocks 45",
    "rewrite stop ttl substring rv50 50",
    r"rewrite stop ttl regex (srv10)\.(coredns)\.(rocks) 10",
    r"rewrite stop ttl regex (srv20)\.(coredns)\.(rocks) 20",
    "rewrite stop ttl range.coredns.rocks 30-300",
    "rewrite stop ttl floor.coredns.rocks 60-",
    "rewrite stop ttl ceiling.coredns.rocks -10",
]


@pytest.mark.parametrize("name, qtype, answer, ttls", [
    ("srv1.coredns.rocks.", "A", "@ 5 IN A 10.0.0.1", [1]),
    ("srv15.coredns.rocks.", "A", "@ 5 IN A 10.0.0.15", [15]),
    ("srv30.coredns.rocks.", "A", "@ 5 IN A 10.0.0.30", [30]),
    ("srv45.coredns.rocks.", "A", "@ 5 IN A 10.0.0.45", [45]),
    ("srv50.coredns.rocks.", "A", "@ 5 IN A 10.0.0.50", [50]),
    ("srv10.coredns.rocks.", "A", "@ 5 IN A 10.0.0.10", [10]),
    ("xmpp.coredns.rocks.", "SRV", "@ 5 IN SRV 0 100 100 srvxmpp.coredns.rocks.", [5]),
    ("srv15.coredns.rocks.", "HINFO", '@ 5 IN TXT "INTEL-64 RHEL 7.5"', [15]),
    ("srv20.coredns.rocks.", "A", "@ 5 IN A 10.0.0.22\n@ 5 IN A 10.0.0.23", [20, 20]),
    ("SRV1.CoreDNS.Rocks.", "A", "@ 5 IN A 10.0.0.1", [1]),
    ("range.coredns.rocks.", "A", "@ 5 IN A 10.0.0.1\n@ 100 IN A 10.0.0.2\n@ 900 IN A 10.0.0.3", [30, 100, 300]),
    ("floor.coredns.rocks.", "A", "@ 5 IN A 10.0.0.1\n@ 3600 IN A 10.0.0.2", [60, 3600]),
    ("ceiling.coredns.rocks.", "A", "@ 5 IN A 10.0.0.1\n@ 3600 IN A 10.0.0.2", [5, 10]),
])
async def test_ttl_rules(name, qtype, answer, ttls):
    plugins = [plug(t) for t in TTL_RULES]
    canned = Canned(answer=answer)
    reply = await chain(plugins, canned)(query(name, qtype))
    assert [rr.ttl for rr in reply.rr] == ttls
    assert [rr.ttl for rr in canned.replies[0].rr] == [int(x.split()[1]) for x in answer.splitlines()]


async def test_ttl_applies_to_every_section_but_not_the_opt_record():
    p = plug("rewrite ttl suffix .rocks 30")
    last = Canned(answer="@ 5 IN A 10.0.0.1", auth="rocks. 5 IN SOA a.rocks. b.rocks. 1 2 3 4 5",
                  extra="x.rocks. 900 IN A 10.0.0.2")
    req = query("a.rocks.", edns=1232, do=True)
    orig_next = last

    async def with_opt(r):
        reply = await orig_next(r)
        reply.add_ar(dnslib.EDNS0(udp_len=1232, flags="do"))
        return reply
    reply = await p.serve(req, with_opt)
    assert [rr.ttl for rr in reply.rr + reply.auth] == [30, 30]
    assert reply.ar[0].ttl == 30
    assert reply.ar[1].rtype == 41 and reply.ar[1].ttl == 0x8000    # the DO flag kept


async def test_rcode_rule():
    p = plug("rewrite rcode suffix .blocked.example NXDOMAIN REFUSED")
    canned = Canned(rcode=3)
    reply = await p.serve(query("ads.blocked.example."), canned)
    assert reply.header.rcode == 5 and canned.replies[0].header.rcode == 3
    reply = await p.serve(query("ads.blocked.example."), Canned(rcode=0))
    assert reply.header.rcode == 0
    reply = await p.serve(query("ads.fine.example."), Canned(rcode=3))
    assert reply.header.rcode == 3


# --- transparent and describe -----------------------------------------------------------------------

def test_transparent_only_when_no_rule_can_match():
    exact = plug("rewrite name exact from.nl to.nl")
    assert exact.transparent("other.nl.", A) and not exact.transparent("from.nl.", A)
    suffix = plug("rewrite name suffix .cluster.old .cluster.local answer auto")
    assert suffix.transparent("web.default.svc.cluster.local.", A)
    assert not suffix.transparent("web.default.svc.cluster.old.", A)
    regex = plug(r"rewrite name regex (.*)\.example\.com {1}.default.svc.cluster.local")
    assert regex.transparent("kubernetes.default.svc.cluster.local.", A)
    assert not regex.transparent("web.example.com.", A)
    typ = plug("rewrite type ANY HINFO")
    assert typ.transparent("a.nl.", A) and not typ.transparent("a.nl.", ANY)
    assert not plug("rewrite class CH IN").transparent("a.nl.", A)    # unsure: the class is not given
    ttl = plug("rewrite ttl prefix srv 30")
    assert ttl.transparent("web.nl.", A) and not ttl.transparent("srv.nl.", A)


def test_describe_is_one_line_of_the_rule():
    text = plug("rewrite stop {\n  name regex (.*)\\.example\\.com {1}.default.svc.cluster.local\n"
                "  answer name (.*)\\.default\\.svc\\.cluster\\.local {1}.example.com\n}").describe()
    assert "\n" not in text
    assert text == (r"stop name regex (.*)\.example\.com {1}.default.svc.cluster.local. "
                    r"answer name (.*)\.default\.svc\.cluster\.local {1}.example.com.")
    assert plug("rewrite continue ttl a.b 30-300").describe() == "continue ttl exact a.b. 30-300"
    assert plug("rewrite type any a").describe() == "stop type ANY A"


@pytest.mark.parametrize("where, d", real_directives("rewrite"), ids=lambda v: v if isinstance(v, str) else "")
def test_real_corefiles_lines_are_accepted(where, d):
    assert rewrite.setup(d, ctx()).describe()


async def test_kubespray_documented_lines_through_the_parser():
    # kubespray-coredns.corefile's template: old_dns_domains lines and the coredns_rewrite_block example
    from clusterdns.corefile.parse import parse_text
    text = (".:53 {\n"
            "    rewrite name suffix cluster.old cluster.local answer auto\n"
            "    rewrite stop {\n"
            "        name regex (.*)\\.my\\.domain {1}.svc.cluster.local\n"
            "        answer name (.*)\\.svc\\.cluster\\.local {1}.my.domain\n"
            "    }\n"
            "    rewrite name stop website.tld website.namespace.svc.cluster.local\n"
            "}\n")
    d1, d2, d3 = parse_text(text, "Corefile", env={})[0].directives
    plugins = [rewrite.setup(d, ctx()) for d in (d1, d2)]
    last = Canned(answer="@ 5 IN A 10.0.0.9")
    reply = await chain(plugins, last)(query("web.ns.my.domain."))
    assert str(last.asked[0].q.qname) == "web.ns.svc.cluster.local."
    assert names(reply.rr) == ["web.ns.my.domain."]
    # kubespray's external-zone example puts `stop` after `name`: CoreDNS refuses it, so do we
    with pytest.raises(CorefileError, match=r"^Corefile:7: plugin/rewrite: name rule supports only exact"):
        rewrite.setup(d3, ctx())


# --- over real sockets (tests/corefile/cfserve.py, a dnspython client, a stub upstream) -------------

AKS = r"""example.com:{PORT} {
    bind 127.0.0.1
    log
    errors
    rewrite stop {
        name regex (.*)\.example\.com {1}.default.svc.cluster.local
        answer name (.*)\.default\.svc\.cluster\.local {1}.example.com
    }
    forward . 127.0.0.1:UPSTREAM
}
"""


async def test_socket_aks_rewrite_block_against_a_stub_upstream(tmp_path, capsys):
    records = {"web.default.svc.cluster.local.": ["web.default.svc.cluster.local. 30 IN A 10.96.7.7"]}
    async with Upstream(records) as up, CorefileServer(AKS.replace("UPSTREAM", str(up.port)), tmp_path) as s:
        r = await s.ask("Web.Example.com", "A")
        assert r.rcode() == dns.rcode.NOERROR
        assert str(r.question[0].name) == "Web.Example.com."
        assert answers(r) == ["web.example.com. A 10.96.7.7"]
        assert ("udp", "web.default.svc.cluster.local.", 1) in up.received
        r = await s.ask("nosuch.example.com", "A", tcp=True)
        assert r.rcode() == dns.rcode.NXDOMAIN and str(r.question[0].name) == "nosuch.example.com."
    out = capsys.readouterr().out.splitlines()
    assert any('"A IN web.example.com. udp ' in x and " NOERROR qr," in x for x in out), out
    assert any('"A IN nosuch.example.com. tcp ' in x and " NXDOMAIN " in x for x in out), out


async def test_socket_rewrite_into_the_cluster_zone(tmp_path):
    # coredns#4834's form: the block's kubernetes plugin answers the rewritten name
    text = ("example.com:{PORT} {\n  bind 127.0.0.1\n"
            "  rewrite name regex (.*)\\.example\\.com {1}.testapp.svc.cluster.local answer auto\n"
            "  kubernetes cluster.local\n}\n")
    async with CorefileServer(text, tmp_path) as s:
        r = await s.ask("testapp-svc.example.com", "A")
        assert answers(r) == ["testapp-svc.example.com. A 172.20.36.232"]


async def test_socket_kubespray_old_domain_suffix_with_the_kubernetes_plugin(tmp_path, capsys):
    text = (".:{PORT} {\n  bind 127.0.0.1\n  log cluster.old\n"
            "  rewrite name suffix cluster.old cluster.local answer auto\n"
            "  kubernetes cluster.local in-addr.arpa ip6.arpa\n}\n")
    async with CorefileServer(text, tmp_path) as s:
        r = await s.ask("testapp-svc.testapp.svc.cluster.old", "A")
        assert answers(r) == ["testapp-svc.testapp.svc.cluster.old. A 172.20.36.232"]
        # the new name itself: no rule matches (the memo may answer it), log (cluster.old only) is quiet
        r = await s.ask("testapp-svc.testapp.svc.cluster.local", "A")
        assert answers(r) == ["testapp-svc.testapp.svc.cluster.local. A 172.20.36.232"]
    out = [x for x in capsys.readouterr().out.splitlines() if "[INFO]" in x]
    assert len(out) == 1 and '"A IN testapp-svc.testapp.svc.cluster.old. udp ' in out[0], out


async def test_socket_edns0_local_option_reaches_the_upstream(tmp_path):
    seen = []
    async with Upstream({"a.example.org.": ["a.example.org. 30 IN A 10.0.0.1"]}) as up:
        answer = up.answer

        def spy(wire, proto):
            seen.append(dnslib.DNSRecord.parse(wire))
            return answer(wire, proto)
        up.answer = spy
        text = (".:{PORT} {\n  bind 127.0.0.1\n  rewrite edns0 local set 0xffee {client_ip}\n"
                f"  forward . 127.0.0.1:{up.port}\n}}\n")
        async with CorefileServer(text, tmp_path) as s:
            r = await s.ask("a.example.org", "A")
            assert answers(r) == ["a.example.org. A 10.0.0.1"]
    assert options(seen[0]) == [(0xFFEE, bytes([127, 0, 0, 1]))]


async def test_socket_cname_target_into_the_cluster_zone(tmp_path):
    # the stub's CNAME points at a CDN name; the rule sends it to the Service, which the block answers
    async with Upstream() as up:
        def cname(wire, proto):
            q = dns.message.from_wire(wire)
            r = dns.message.make_response(q)
            r.answer.append(dns.rrset.from_text(q.question[0].name, 30, "IN", "CNAME", "testapp-svc.cdn.example."))
            return r.to_wire()
        up.answer = cname
        text = (".:{PORT} {\n  bind 127.0.0.1\n"
                "  rewrite cname suffix .cdn.example. .testapp.svc.cluster.local.\n"
                f"  kubernetes cluster.local\n  forward . 127.0.0.1:{up.port}\n}}\n")
        async with CorefileServer(text, tmp_path) as s:
            r = await s.ask("www.example.org", "A")
            assert answers(r) == ["www.example.org. CNAME testapp-svc.testapp.svc.cluster.local.",
                                  "testapp-svc.testapp.svc.cluster.local. A 172.20.36.232"]
