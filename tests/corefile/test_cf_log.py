"""log (clusterdns/corefile/plugins/log.py), pinned to coredns/coredns plugin/log: README.md,
log_test.go (TestLoggedStatus, TestLoggedClass*, TestLogged), setup_test.go (TestLogParse), the
replacer (plugin/pkg/replacer: placeholders, flags, durations) and response.Typify/Classify."""
from __future__ import annotations

import asyncio
import re

import dns.rcode
import dnslib
import pytest

from clusterdns.corefile.plugin import NXDOMAIN, SERVFAIL, PluginError
from clusterdns.corefile.plugins import log
from clusterdns.corefile.syntax import CorefileError
from tests.corefile.cfplugkit import Canned, Upstream, chain, ctx, directive, query, real_directives
from tests.corefile.cfserve import CorefileServer, answers

STAMP = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z"


def plug(text: str) -> log.Log:
    p = log.setup(directive(text), ctx())
    assert isinstance(p, log.Log)
    return p


def lines(capsys) -> list[str]:
    captured = capsys.readouterr()
    assert captured.err == ""
    return [x for x in captured.out.splitlines() if x]


async def test_default_line_is_the_common_log_format(capsys):
    p = plug("log")
    reply = await p.serve(query("Example.ORG."), Canned(answer="@ 300 IN A 10.0.0.1"))
    assert reply.rr
    (line,) = lines(capsys)
    m = re.fullmatch(STAMP + r' \[INFO\] 10\.240\.0\.1:40212 - 4242 "A IN example\.org\. udp 29 false 512" '
                     r'NOERROR qr,aa,rd,ra 45 (\d+\.\d+)s', line)
    assert m, line
    assert 0 < float(m.group(1)) < 5


async def test_edns_tcp_and_ipv6_values(capsys):
    p = plug("log")
    await p.serve(query("example.org.", "AAAA", edns=1232, do=True, client=("fd00::7", 5353)), Canned())
    await p.serve(query("example.org.", "MX", tcp=True, client=("::1", 1000)), Canned(rcode=NXDOMAIN))
    first, second = lines(capsys)
    assert '[INFO] [fd00::7]:5353 - 4242 "AAAA IN example.org. udp 40 true 1232" NOERROR qr,aa,rd,ra 40 ' in first
    assert '[INFO] [::1]:1000 - 4242 "MX IN example.org. tcp 29 false 65535" NXDOMAIN qr,aa,rd,ra 29 ' in second


async def test_plugin_error_is_logged_with_its_rcode_and_passed_on(capsys):
    # TestLoggedStatus / TestLoggedClassError
    p = plug("log")
    with pytest.raises(PluginError) as info:
        await p.serve(query("example.org."), Canned(error=PluginError(SERVFAIL, "boom")))
    assert info.value.rcode == SERVFAIL
    (line,) = lines(capsys)
    assert '"A IN example.org. udp 29 false 512" SERVFAIL qr,rd 29 ' in line


@pytest.mark.parametrize("classes, canned, logged", [
    ("denial", Canned(error=PluginError(SERVFAIL, "x")), False),   # TestLoggedClassDenial
    ("error", Canned(error=PluginError(SERVFAIL, "x")), True),     # TestLoggedClassError
    ("success", Canned(answer="@ 5 IN A 10.0.0.1"), True),
    ("denial", Canned(answer="@ 5 IN A 10.0.0.1"), False),
    ("denial", Canned(rcode=NXDOMAIN, auth="org. 5 IN SOA a.org. b.org. 1 2 3 4 5"), True),
    ("error", Canned(rcode=NXDOMAIN), True),               # NXDOMAIN without an SOA: OtherError
    ("denial", Canned(auth="org. 5 IN SOA a.org. b.org. 1 2 3 4 5"), True),          # NODATA
    ("denial", Canned(answer="@ 5 IN CNAME x.org."), True),                          # A asked, no A: NODATA
    ("success", Canned(auth="example.org. 5 IN NS ns.example.org."), True),          # delegation
    ("success", Canned(), True),                                                     # NOERROR, empty
    ("error", Canned(rcode=5), True),
    ("denial error", Canned(rcode=5), True),
    ("success denial", Canned(rcode=5), False),
])
async def test_classes(capsys, classes, canned, logged):
    p = plug(f"log . {{\n  class {classes}\n}}")
    try:
        await p.serve(query("example.org."), canned)
    except PluginError:
        pass
    assert len(lines(capsys)) == (1 if logged else 0)


def test_typify_and_classify():
    def reply(rcode=0, answer="", auth="", qtype="A"):
        r = dnslib.DNSRecord.question("example.org.", qtype).reply()
        r.header.rcode = rcode
        r.rr = dnslib.RR.fromZone(answer) if answer else []
        r.auth = dnslib.RR.fromZone(auth) if auth else []
        return r
    soa = "org. 5 IN SOA a.org. b.org. 1 2 3 4 5"
    assert log.typify(reply(answer="example.org. 5 IN A 1.2.3.4")) == "NOERROR"
    assert log.typify(reply(answer="example.org. 5 IN CNAME x.org.")) == "NODATA"
    assert log.typify(reply(answer="example.org. 5 IN CNAME x.org.", qtype="MX")) == "NOERROR"
    assert log.typify(reply(auth=soa)) == "NODATA"
    assert log.typify(reply(rcode=3, auth=soa)) == "NXDOMAIN"
    assert log.typify(reply(rcode=3)) == "OTHERERROR"
    assert log.typify(reply(rcode=2)) == "SERVERERROR"
    assert log.typify(reply(rcode=4)) == "SERVERERROR"
    assert log.typify(reply(auth="org. 5 IN NS ns.org.")) == "DELEGATION"
    assert log.typify(reply(qtype="AXFR")) == "META"
    assert [log.classify(t) for t in ("NOERROR", "DELEGATION", "NXDOMAIN", "NODATA", "SERVERERROR", "META",
                                      "OTHERERROR")] == ["success", "success", "denial", "denial", "error",
                                                         "error", "error"]


@pytest.mark.parametrize("text, domain, expect, absent", [
    # TestLogged: name scopes and formats
    ("log example.org", "example.org.", "A IN example.org.", None),
    ("log example.org", "example.net.", None, None),
    ("log example.org example.net", "example.net.", "A IN example.net.", None),
    ("log EXAMPLE.org", "www.Example.Org.", "A IN www.example.org.", None),
    ('log . "{type} {class}"', "example.org.", "A IN", "example.org"),
    ("log . {remote}:{port}", "example.org.", "10.240.0.1:40212", "A IN example.org"),
    ("log . {combined}", "example.org.", '"0"', None),
    ("log . {common}", "example.org.", '"A IN example.org. udp 29 false 512" NOERROR', None),
    ('log . "{proto} Request: {name} {type} {>id}"', "example.org.", "[INFO] udp Request: example.org. A 4242",
     None),
    ('log . "{host} {/some/label} {>opcode} {local} A } {size} {{name}}"', "example.org.",
     "[INFO] {host} - 0 127.0.0.1 A } 29 {example.org.}", None),
])
async def test_names_and_formats(capsys, text, domain, expect, absent):
    p = plug(text)
    await p.serve(query(domain), Canned(answer="@ 5 IN A 10.0.0.1"))
    got = lines(capsys)
    if expect is None:
        assert got == []
        return
    (line,) = got
    assert expect in line, line
    if absent:
        assert absent not in line


async def test_min_duration_logs_slow_queries_outside_the_classes(capsys):
    # TestLogged's latency cases: a class that does not match, but slower than minDuration
    p = plug("log {\n  class denial\n  minDuration 20ms\n}")

    async def slow(req):
        await asyncio.sleep(0.05)
        return await Canned(answer="@ 5 IN A 10.0.0.1")(req)
    await p.serve(query("example.org."), slow)
    await p.serve(query("example.org."), Canned(answer="@ 5 IN A 10.0.0.1"))
    (line,) = lines(capsys)
    assert float(re.search(r" (\d+\.\d+)s$", line).group(1)) >= 0.05


async def test_first_log_line_whose_name_matches_takes_the_query(capsys):
    # CoreDNS's one rule list over all log lines of a block: the first matching NAME logs, once
    outer, inner = plug('log example.org "outer {name}"'), plug('log . "inner {name}"')
    serve = chain([outer, inner], Canned(answer="@ 5 IN A 10.0.0.1"))
    await serve(query("a.example.org."))
    await serve(query("a.example.net."))
    assert [x.split("] ", 1)[1] for x in lines(capsys)] == ["outer a.example.org.", "inner a.example.net."]


def test_transparent_unless_a_name_matches():
    p = plug("log example.org")
    assert p.transparent("web.default.svc.cluster.local.", 1)
    assert not p.transparent("www.example.org.", 1)
    assert not plug("log").transparent("web.default.svc.cluster.local.", 1)


def test_setup_rules_as_coredns_parses_them():
    # TestLogParse
    def rules(text):
        return [(r.scope, r.fmt, set(r.classes), r.min_duration) for r in plug(text).rules]
    assert rules("log") == [(".", log.COMMON, {"all"}, 0.0)]
    assert rules("log example.org") == [("example.org.", log.COMMON, {"all"}, 0.0)]
    assert rules("log example.org. {common}") == [("example.org.", log.COMMON, {"all"}, 0.0)]
    assert rules("log example.org {combined}") == [("example.org.", log.COMBINED, {"all"}, 0.0)]
    assert rules("log example.org example.net {host}") == [("example.org.", "{host}", {"all"}, 0.0),
                                                            ("example.net.", "{host}", {"all"}, 0.0)]
    assert rules("log example.org example.net {when} {\n class denial\n}") == [
        ("example.org.", "{when}", {"denial"}, 0.0), ("example.net.", "{when}", {"denial"}, 0.0)]
    assert rules("log {\n class denial error\n}") == [(".", log.COMMON, {"denial", "error"}, 0.0)]
    assert rules("log {\n class denial\n class error\n}") == [(".", log.COMMON, {"denial", "error"}, 0.0)]
    assert rules("log {\n minDuration\n}") == [(".", log.COMMON, {"all"}, 0.1)]
    assert rules("log {\n class error\n minDuration 1s\n}") == [(".", log.COMMON, {"error"}, 1.0)]
    assert plug("log example.org {\n class denial\n minDuration 1m30s\n}").describe() == \
        "example.org. {common} class denial minDuration 1m30s (to stdout)"


@pytest.mark.parametrize("text, line, message", [
    ("log {\n  class abracadabra\n}", 2, "invalid Class: abracadabra"),
    ("log {\n  class Success\n}", 2, "invalid Class: Success"),
    ("log {\n  class\n}", 2, "class needs one or more"),
    ("log {\n  minDuration 123abc\n}", 2, "Illegal duration found: '123abc'"),
    ("log {\n  minDuration 5\n}", 2, "Illegal duration found: '5'"),
    ("log {\n  minDuration 1s 2s\n}", 2, "minDuration takes at most one"),
    ("log {\n  unknown\n}", 2, "unknown property 'unknown'"),
    ("log {combined}", 1, "one argument is a NAME, not a FORMAT"),
])
def test_setup_refuses_with_file_line(text, line, message):
    with pytest.raises(CorefileError) as info:
        log.setup(directive(text), ctx())
    err = str(info.value)
    assert err.startswith(f"Corefile:{line}: plugin/log: "), err
    assert message in err, err


def test_duration_is_go_seconds():
    # replacer: strconv.FormatFloat(time.Since(start).Seconds(), 'f', -1, 64) + "s"
    assert [log._seconds(s) for s in (0.0006355220000386907, 3.7990251e-05, 1.5, 2.0, 0.0, 100.0)] == \
        ["0.000635522s", "0.00003799s", "1.5s", "2s", "0s", "100s"]


@pytest.mark.parametrize("where, d", real_directives("log"), ids=lambda v: v if isinstance(v, str) else "")
def test_real_corefiles_lines_are_accepted(where, d):
    assert log.setup(d, ctx()).describe()


async def test_socket_log_lines_and_the_memo(tmp_path, capsys):
    # `log example.org` is transparent for cluster names: the memo answers them, unlogged
    async with Upstream({"www.example.org.": ["www.example.org. 30 IN A 10.0.0.1"]}) as up:
        text = (".:{PORT} {\n  bind 127.0.0.1\n  log example.org {combined}\n"
                f"  kubernetes cluster.local\n  forward . 127.0.0.1:{up.port}\n}}\n")
        async with CorefileServer(text, tmp_path) as s:
            r = await s.ask("www.example.org", "A", use_edns=0, payload=1232)
            assert answers(r) == ["www.example.org. A 10.0.0.1"]
            r = await s.ask("testapp-svc.testapp.svc.cluster.local", "A")
            assert answers(r) == ["testapp-svc.testapp.svc.cluster.local. A 172.20.36.232"]
            r = await s.ask("nosuch.example.org", "AAAA", tcp=True)
            assert r.rcode() == dns.rcode.NXDOMAIN
    out = lines(capsys)
    assert len(out) == 2, out
    # 44 bytes asked (33 + an OPT), 60 answered (one A more); the stub sets no RA
    assert re.search(r'\[INFO\] 127\.0\.0\.1:\d+ - \d+ "A IN www\.example\.org\. udp 44 false 1232" '
                     r'NOERROR qr,rd 60 [\d.]+s "0"$', out[0]), out[0]
    assert '"AAAA IN nosuch.example.org. tcp 36 false 65535" NXDOMAIN ' in out[1], out[1]
