"""loadbalance (clusterdns/corefile/plugins/loadbalance.py), pinned to coredns/coredns
plugin/loadbalance: README.md, loadbalance_test.go (TestLoadBalance's sorted-sections table,
TestLoadBalanceXFR), setup.go (policies, `prefer`), prefer.go."""
from __future__ import annotations

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
    ("loadbalance weighted /etc/coredns/weights", "weighted policy is not supported"),
    ("loadbalance weighted w {\n  reload 10s\n}", "weighted policy is not supported"),
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
    line = "2" if "\n" in text and "weighted" not in text and "extra" not in text else "1"
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
