"""loadbalance (clusterdns/corefile/plugins/loadbalance.py), pinned to coredns/coredns
plugin/loadbalance: README.md, loadbalance_test.go (TestLoadBalance's sorted-sections table,
TestLoadBalanceXFR), setup.go (policies, `prefer`, `reload`), prefer.go, weighted.go (the weight file,
the weighted pick of the top address, reloads)."""
from __future__ import annotations

import asyncio
import ipaddress
import random
from collections import Counter

import pytest

from clusterdns.corefile.plugins import loadbalance
from clusterdns.corefile.syntax import CorefileError
from tests.corefile.cfplugkit import Canned, Upstream, ctx, directive, query, real_directives
from tests.corefile.cfserve import CorefileServer

CNAME, A, AAAA, MX, NS, SOA = 5, 1, 28, 15, 2, 6
ORDER = {CNAME: 0, A: 1, AAAA: 1, MX: 2, NS: 3}


def plug(text: str) -> loadbalance.LoadBalance:
    p = loadbalance.setup(directive(text), ctx())
    assert isinstance(p, loadbalance.LoadBalance)
    return p


def counts(rrs) -> tuple[dict[int, int], bool]:
    """CoreDNS's countRecords: per kind, and whether CNAMEs < addresses < MX < NS in order (others: anywhere)."""
    seen, state, ok = Counter(), -1, True
    for rr in rrs:
        k = ORDER.get(rr.rtype)
        if k is None:
            continue
        ok = ok and state <= k
        state = k
        seen[rr.rtype if rr.rtype != AAAA else A] += 1
    return dict(seen), ok


CASES = [
    ("cname1.region2.skydns.test. 300 IN CNAME cname2.region2.skydns.test.\n"
     "cname2.region2.skydns.test. 300 IN CNAME cname3.region2.skydns.test.\n"
     "cname5.region2.skydns.test. 300 IN CNAME cname6.region2.skydns.test.\n"
     "cname6.region2.skydns.test. 300 IN CNAME endpoint.region2.skydns.test.\n"
     "endpoint.region2.skydns.test. 300 IN A 10.240.0.1\n"
     "mx.region2.skydns.test. 300 IN MX 1 mx1.region2.skydns.test.\n"
     "mx.region2.skydns.test. 300 IN MX 2 mx2.region2.skydns.test.\n"
     "mx.region2.skydns.test. 300 IN MX 3 mx3.region2.skydns.test.", "",
     {CNAME: 4, A: 1, MX: 3}, {}),
    ("region2.skydns.test. 300 IN NS ns1.region2.skydns.test.\n"
     "region2.skydns.test. 300 IN NS ns2.region2.skydns.test.\n"
     "region2.skydns.test. 300 IN NS ns3.region2.skydns.test.\n"
     "region2.skydns.test. 300 IN NS ns4.region2.skydns.test.", "",
     {NS: 4}, {}),
    ("endpoint.region2.skydns.test. 300 IN A 10.240.0.1\n"
     "mx.region2.skydns.test. 300 IN MX 1 mx1.region2.skydns.test.\n"
     "cname.region2.skydns.test. 300 IN CNAME endpoint.region2.skydns.test.", "",
     {CNAME: 1, A: 1, MX: 1}, {}),
    ("mx.region2.skydns.test. 300 IN MX 1 mx1.region2.skydns.test.\n"
     "endpoint.region2.skydns.test. 300 IN A 10.240.0.1\n"
     "endpoint.region2.skydns.test. 300 IN A 10.240.0.2\n"
     "mx.region2.skydns.test. 300 IN MX 1 mx2.region2.skydns.test.\n"
     "cname2.region2.skydns.test. 300 IN CNAME cname3.region2.skydns.test.\n"
     "endpoint.region2.skydns.test. 300 IN A 10.240.0.3\n"
     "mx.region2.skydns.test. 300 IN MX 1 mx3.region2.skydns.test.",
     "endpoint.region2.skydns.test. 300 IN A 10.240.0.1\n"
     "endpoint.region2.skydns.test. 300 IN AAAA ::1\n"
     "mx.region2.skydns.test. 300 IN MX 1 mx1.region2.skydns.test.\n"
     "cname2.region2.skydns.test. 300 IN CNAME cname3.region2.skydns.test.\n"
     "mx.region2.skydns.test. 300 IN MX 1 mx2.region2.skydns.test.\n"
     "endpoint.region2.skydns.test. 300 IN A 10.240.0.3\n"
     "endpoint.region2.skydns.test. 300 IN AAAA ::2\n"
     "mx.region2.skydns.test. 300 IN MX 1 mx3.region2.skydns.test.\n"
     "region2.skydns.test. 300 IN NS ns1.region2.skydns.test.\n"
     "region2.skydns.test. 300 IN NS ns2.region2.skydns.test.\n"
     "region2.skydns.test. 300 IN NS ns3.region2.skydns.test.\n"
     "region2.skydns.test. 300 IN NS ns4.region2.skydns.test.",
     {CNAME: 1, A: 3, MX: 3}, {CNAME: 1, A: 4, MX: 3, NS: 4}),
]


@pytest.mark.parametrize("answer, extra, in_answer, in_extra", CASES)
async def test_sections_are_sorted_and_keep_every_record(answer, extra, in_answer, in_extra):
    p = plug("loadbalance")
    for _ in range(20):
        reply = await p.serve(query("region2.skydns.test.", "SRV"), Canned(answer=answer, extra=extra))
        got, ordered = counts(reply.rr)
        assert ordered and got == in_answer
        got, ordered = counts(reply.ar)
        assert ordered and got == in_extra
        assert reply.rr[:in_answer.get(CNAME, 0)] == [rr for rr in reply.rr if rr.rtype == CNAME]


async def test_addresses_are_shuffled_uniformly():
    p = plug("LOADBALANCE round_robin".lower())
    answer = "\n".join(f"@ 5 IN A 10.0.0.{i}" for i in range(1, 5))
    req = query("svc.example.")
    fixed = await Canned(answer=answer)(req)

    async def same(_req):
        return fixed
    first = Counter()
    for _ in range(1200):
        reply = await p.serve(req, same)
        assert sorted(str(rr.rdata) for rr in reply.rr) == [f"10.0.0.{i}" for i in range(1, 5)]
        first[str(reply.rr[0].rdata)] += 1
    # 300 expected each; 200..400 is over 6 standard deviations
    assert len(first) == 4 and all(200 < n < 400 for n in first.values()), first


async def test_next_reply_is_left_as_it_was():
    p = loadbalance.LoadBalance(rand=random.Random(7))
    answer = "\n".join(f"@ 5 IN A 10.0.0.{i}" for i in range(1, 9))
    canned = Canned(answer=answer)
    for _ in range(5):
        await p.serve(query("svc.example."), canned)
    for reply in canned.replies:
        assert [str(rr.rdata) for rr in reply.rr] == [f"10.0.0.{i}" for i in range(1, 9)]


@pytest.mark.parametrize("qtype", ["AXFR", "IXFR"])
async def test_transfers_are_left_alone(qtype):
    answer = ("skydns.test. 30 IN SOA ns.dns.skydns.test. hostmaster.skydns.test. 1542756695 7200 1800 86400 30\n"
              "mx.region2.skydns.test. 300 IN MX 1 mx1.region2.skydns.test.\n"
              "endpoint.region2.skydns.test. 300 IN A 10.240.0.1\n"
              "endpoint.region2.skydns.test. 300 IN A 10.240.0.2\n"
              "cname2.region2.skydns.test. 300 IN CNAME cname3.region2.skydns.test.\n"
              "skydns.test. 30 IN SOA ns.dns.skydns.test. hostmaster.skydns.test. 1542756695 7200 1800 86400 30")
    p = plug("loadbalance")
    for _ in range(10):
        reply = await p.serve(query("skydns.test.", qtype), Canned(answer=answer))
        assert reply.rr[0].rtype == SOA and reply.rr[-1].rtype == SOA
        assert [rr.rtype for rr in reply.rr] == [SOA, MX, A, A, CNAME, SOA]


async def test_only_noerror_replies_are_shuffled():
    answer = "cname.example. 5 IN CNAME x.example.\n" + "\n".join(f"x.example. 5 IN A 10.0.0.{i}" for i in range(9))
    p = plug("loadbalance")
    for rcode in (2, 3):
        reply = await p.serve(query("cname.example."), Canned(answer="x.example. 5 IN A 10.0.0.1\n" + answer,
                                                              rcode=rcode))
        assert reply.rr[0].rtype == A         # untouched: the A before the CNAME stays first


async def test_prefer_moves_addresses_in_the_subnets_first_in_their_order():
    p = plug("loadbalance round_robin {\n  prefer 10.9.0.0/16 10.1.0.0/16 fd00::/8\n}")
    answer = "\n".join(["@ 5 IN A 192.0.2.1", "@ 5 IN A 10.1.0.1", "@ 5 IN A 10.9.3.3", "@ 5 IN AAAA fd00::1",
                        "@ 5 IN A 10.1.0.2"])
    for _ in range(20):
        reply = await p.serve(query("svc.example."), Canned(answer=answer))
        got = [str(rr.rdata) for rr in reply.rr]
        assert got[0] == "10.9.3.3" and set(got[1:3]) == {"10.1.0.1", "10.1.0.2"}
        assert got[3] == "fd00::1" and got[4] == "192.0.2.1"
    assert not p.transparent("svc.example.", A)


async def test_limit_answers():
    p = plug("loadbalance {\n  limit_answers 2\n}")
    answer = "\n".join(f"@ 5 IN A 10.0.0.{i}" for i in range(1, 6))
    reply = await p.serve(query("svc.example."), Canned(answer=answer))
    assert len(reply.rr) == 2
    assert not p.transparent("svc.example.", A)
    assert p.describe() == "round_robin limit_answers 2"


def test_transparent_and_describe():
    p = plug("loadbalance")
    assert p.transparent("web.default.svc.cluster.local.", A)
    assert p.describe().startswith("round_robin (cluster answers from the memo: the engine rotates")
    assert "prefer 10.0.0.0/8" in plug("loadbalance {\n prefer 10.0.0.0/8\n}").describe()


@pytest.mark.parametrize("text, message", [
    ("loadbalance weighted", "missing weight file argument"),
    ("loadbalance weighted a b", "unexpected argument(s)"),
    ("loadbalance weighted /nonexistent/weights {\n  reload 0s\n}", "weight file open error: /nonexistent/weights"),
    ("loadbalance weighted /nonexistent/weights {\n  reload\n}", "reload duration value is missing"),
    ("loadbalance weighted /nonexistent/weights {\n  reload 1s 2s\n}", "unexpected argument"),
    ("loadbalance weighted /nonexistent/weights {\n  reload soon\n}", "invalid reload duration 'soon'"),
    ("loadbalance weighted /nonexistent/weights {\n  prefer 10.0.0.0/8\n}", "unknown property 'prefer'"),
    ("loadbalance random", "unknown policy: random"),
    ("loadbalance ROUND_ROBIN", "unknown policy: ROUND_ROBIN"),
    ("loadbalance round_robin extra", "unknown property for round_robin"),
    ("loadbalance {\n  prefer 10.0.0.0/33\n}", "invalid CIDR '10.0.0.0/33'"),
    ("loadbalance {\n  reload 10s\n}", "unknown property 'reload'"),
    ("loadbalance {\n  limit_answers 0\n}", "limit_answers takes one number"),
    ("loadbalance {\n  limit_answers\n}", "limit_answers takes one number"),
    ("loadbalance {\n  shuffle\n}", "unknown property 'shuffle'"),
])
def test_setup_refuses_with_file_line(text, message):
    with pytest.raises(CorefileError) as info:
        loadbalance.setup(directive(text), ctx())
    err = str(info.value)
    line = "2" if "\n" in text and "extra" not in text and "open error" not in message else "1"
    assert err.startswith(f"Corefile:{line}: plugin/loadbalance: "), err
    assert message in err, err


@pytest.mark.parametrize("where, d", real_directives("loadbalance"), ids=lambda v: v if isinstance(v, str) else "")
def test_real_corefiles_lines_are_accepted(where, d):
    assert loadbalance.setup(d, ctx()).describe()


async def test_socket_forwarded_addresses_rotate(tmp_path):
    records = {"many.example.org.": [f"many.example.org. 30 IN A 10.0.0.{i}" for i in range(1, 5)]}
    async with Upstream(records) as up:
        text = f".:{{PORT}} {{\n  bind 127.0.0.1\n  loadbalance\n  forward . 127.0.0.1:{up.port}\n}}\n"
        async with CorefileServer(text, tmp_path) as s:
            first = Counter()
            for _ in range(60):
                r = await s.ask("many.example.org", "A")
                got = [rd.to_text() for rrset in r.answer for rd in rrset]
                assert sorted(got) == [f"10.0.0.{i}" for i in range(1, 5)]
                first[got[0]] += 1
            # each of 4 first in 60 tries: missing one has odds (3/4)^60 ~ 3e-8
            assert len(first) == 4, first


async def test_socket_prefer_with_the_kubernetes_plugin(tmp_path):
    # the headless Service's endpoints: prefer puts the chosen subnet's address first every time
    text = (".:{PORT} {\n  bind 127.0.0.1\n  loadbalance {\n    prefer 10.161.35.3/32\n  }\n"
            "  kubernetes cluster.local\n}\n")
    async with CorefileServer(text, tmp_path) as s:
        for _ in range(10):
            r = await s.ask("testapp-headless.testapp.svc.cluster.local", "A")
            got = [rd.to_text() for rrset in r.answer for rd in rrset]
            assert got[0] == "10.161.35.3" and sorted(got) == ["10.161.35.2", "10.161.35.3", "10.161.35.4"]


# --- weighted (weighted.go, weighted_test.go) -------------------------------------------------------

WEIGHTS = """# Comment lines are ignored

www.example.com
100.64.1.1 3
100.64.1.2 1
100.64.1.3 2

Other.Example.COM.
fd00::1 255
"""


def weighted(tmp_path, text: str = WEIGHTS, block: str = "", zones=None) -> loadbalance.Weighted:
    (tmp_path / "weights").write_text(text)
    c = ctx()
    c.base_dir = str(tmp_path)
    c.state_zones = zones or []
    p = loadbalance.setup(directive(f"loadbalance weighted weights{block}"), c)
    assert isinstance(p, loadbalance.Weighted)
    return p


async def test_weighted_top_address_follows_the_weights(tmp_path):
    p = weighted(tmp_path)
    p.rand = random.Random(11)
    answer = "\n".join(f"@ 5 IN A 100.64.1.{i}" for i in (1, 2, 3)) + "\n@ 5 IN A 100.64.1.9"
    req = query("www.example.com.")
    fixed = await Canned(answer=answer)(req)

    async def same(_req):
        return fixed
    top = Counter()
    for _ in range(1400):
        reply = await p.serve(req, same)
        got = [str(rr.rdata) for rr in reply.rr]
        assert sorted(got) == sorted(str(rr.rdata) for rr in fixed.rr)
        top[got[0]] += 1
    # weights 3 : 1 : 2 and 1 for the unlisted address, of 7: 600, 200, 400, 200 expected
    for ip, expect in (("100.64.1.1", 600), ("100.64.1.2", 200), ("100.64.1.3", 400), ("100.64.1.9", 200)):
        assert abs(top[ip] - expect) < expect * 0.25, top
    assert [str(rr.rdata) for rr in fixed.rr] == ["100.64.1.1", "100.64.1.2", "100.64.1.3", "100.64.1.9"]


async def test_weighted_sections_types_and_names(tmp_path):
    p = weighted(tmp_path)
    p.rand = random.Random(5)
    # AAAA by a name written in capitals, without its dot
    answer = "@ 5 IN CNAME other.example.com.\nother.example.com. 5 IN AAAA fd00::2\nother.example.com. 5 IN AAAA fd00::1"
    firsts = Counter()
    for _ in range(50):
        reply = await p.serve(query("alias.example.com.", "AAAA"), Canned(answer=answer))
        assert reply.rr[0].rtype == CNAME
        firsts[str(reply.rr[1].rdata)] += 1
    assert firsts["fd00::1"] > 40          # 255 : 1
    # SRV: the additional section's addresses; MX: left alone
    reply = await p.serve(query("_x._tcp.example.com.", "SRV"),
                          Canned(answer="@ 5 IN SRV 0 0 1 www.example.com.",
                                 extra="www.example.com. 5 IN A 100.64.1.2\nwww.example.com. 5 IN A 100.64.1.1"))
    assert len(reply.ar) == 2
    mx = "@ 5 IN MX 1 a.example.com.\n@ 5 IN MX 2 b.example.com."
    for _ in range(10):
        reply = await p.serve(query("www.example.com.", "MX"), Canned(answer=mx))
        assert [str(rr.rdata) for rr in reply.rr] == ["1 a.example.com.", "2 b.example.com."]


@pytest.mark.parametrize("text, message", [
    ("100.64.1.1\n", 'Wrong domain name:"100.64.1.1"'),
    ("www.example.com\nnot-an-ip 3\n", 'Wrong IP address:"not-an-ip"'),
    ("www.example.com\n100.64.1.1 0\n", 'Wrong weight value:"0"'),
    ("www.example.com\n100.64.1.1 256\n", 'Wrong weight value:"256"'),
    ("100.64.1.1 3\n", "Missing domain name in weight file"),
    ("www.example.com\n100.64.1.1 3 4\n", 'Could not parse weight line:"100.64.1.1 3 4"'),
])
def test_weight_file_errors_at_setup(tmp_path, text, message):
    with pytest.raises(CorefileError) as info:
        weighted(tmp_path, text)
    assert str(info.value).startswith("Corefile:1: plugin/loadbalance: ") and message in str(info.value)


async def test_weight_file_reload(tmp_path, capsys):
    p = weighted(tmp_path, block=" {\n  reload 50ms\n}")
    assert p.reload == 0.05 and p.weights["www.example.com."][ipaddress.ip_address("100.64.1.1")] == 3
    await p.start()
    try:
        (tmp_path / "weights").write_text("www.example.com\n100.64.1.1 9\n")
        await asyncio.sleep(0.3)
        assert p.weights == {"www.example.com.": {ipaddress.ip_address("100.64.1.1"): 9}}
        (tmp_path / "weights").write_text("www.example.com\nbroken 1\n")
        await asyncio.sleep(0.3)
        assert p.weights == {"www.example.com.": {ipaddress.ip_address("100.64.1.1"): 9}}   # the last good kept
    finally:
        await p.stop()
    out = capsys.readouterr().out
    assert "[INFO] plugin/loadbalance: Successfully reloaded weight file " in out
    assert '[ERROR] plugin/loadbalance: Wrong IP address:"broken"' in out
    assert out.count("[ERROR]") == 1          # the same broken content is not reported again and again


def test_weight_file_missing_with_reload_warns_and_waits(tmp_path, capsys):
    c = ctx()
    c.base_dir = str(tmp_path)
    p = loadbalance.setup(directive("loadbalance weighted later"), c)
    assert isinstance(p, loadbalance.Weighted) and p.weights == {}
    assert "[WARNING] plugin/loadbalance: Failed to open weight file:" in capsys.readouterr().out
    (tmp_path / "later").write_text(WEIGHTS)
    assert p.load() and "www.example.com." in p.weights


def test_weighted_transparent_for_the_memo_unless_it_weighs_a_state_name(tmp_path):
    p = weighted(tmp_path, zones=["cluster.local."])
    assert p.transparent("web.default.svc.cluster.local.", A)
    q = weighted(tmp_path, "web.default.svc.cluster.local\n10.0.0.1 5\n", zones=["cluster.local."])
    assert not q.transparent("web.default.svc.cluster.local.", A)
    assert q.transparent("web.default.svc.cluster.local.", 16)
    assert p.describe().endswith("reload 30s (2 names weighted)")


async def test_socket_weighted_forwarded_answers(tmp_path):
    records = {"www.example.org.": ["www.example.org. 30 IN A 10.0.0.1", "www.example.org. 30 IN A 10.0.0.2"]}
    async with Upstream(records) as up:
        text = (".:{PORT} {\n  bind 127.0.0.1\n  loadbalance weighted weights {\n    reload 0s\n  }\n"
                f"  forward . 127.0.0.1:{up.port}\n}}\n")
        async with CorefileServer(text, tmp_path, files={"weights": "www.example.org\n10.0.0.2 255\n"}) as s:
            tops = Counter()
            for _ in range(40):
                r = await s.ask("www.example.org", "A")
                tops[[rd.to_text() for rrset in r.answer for rd in rrset][0]] += 1
            assert tops["10.0.0.2"] >= 36, tops      # 255 : 1
