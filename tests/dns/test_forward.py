"""The forwarder and its cache against real upstream servers on loopback.

FakeUpstream is a small dnspython server (UDP and TCP) the tests start on an
ephemeral port: it answers from a table, can be slow, can truncate UDP
replies, and counts what it received per transport.
"""
from __future__ import annotations

import asyncio

import dns.flags
import dns.message
import dns.name
import dns.rcode
import dns.rdatatype
import dns.rrset
import dnslib
import pytest

from clusterdns.config import load
from clusterdns.dns.cache import Cache, cache_key
from clusterdns.dns.forward import Forward, upstreams_from
from tests.dns.dnskit import RECORDS, FakeUpstream, closed_port


def q(name: str, qtype: str = "A", **kw) -> dnslib.DNSRecord:
    return dnslib.DNSRecord.question(name, qtype, **kw)


@pytest.fixture
async def upstream():
    up = await FakeUpstream(RECORDS).start()
    yield up
    await up.stop()


async def test_forwards_udp_and_echoes_the_request(upstream):
    fwd = Forward([upstream.address], Cache())
    req = q("WWW.Example", "A")
    reply = await fwd.query(req, tcp=False)
    assert reply.header.id == req.header.id
    assert str(reply.q.qname) == "WWW.Example."          # the asker's spelling
    assert [str(rr.rdata) for rr in reply.rr] == ["192.0.2.1"]
    assert upstream.received == [("udp", "www.example.", 1)]


async def test_tcp_client_goes_to_upstream_over_tcp(upstream):
    fwd = Forward([upstream.address], None)
    reply = await fwd.query(q("www.example", "AAAA"), tcp=True)
    assert [str(rr.rdata) for rr in reply.rr] == ["2001:db8::1"]
    assert upstream.received == [("tcp", "www.example.", 28)]


async def test_cache_answers_second_query_with_ttl_counted_down(upstream):
    now = [1000.0]
    fwd = Forward([upstream.address], Cache(min_ttl=5, max_ttl=30, clock=lambda: now[0]))
    first = await fwd.query(q("www.example"), tcp=False)
    assert first.rr[0].ttl == 300            # passed through as received
    now[0] += 10
    second = await fwd.query(q("www.example"), tcp=False)
    assert len(upstream.received) == 1       # served from the cache
    assert second.rr[0].ttl == 20            # clamped to 30, then 10 s elapsed
    assert str(second.rr[0].rdata) == "192.0.2.1"
    now[0] += 21                             # expired: asks again
    await fwd.query(q("www.example"), tcp=False)
    assert len(upstream.received) == 2


async def test_min_ttl_and_negative_caching(upstream):
    now = [0.0]
    fwd = Forward([upstream.address], Cache(min_ttl=5, max_ttl=30, clock=lambda: now[0]))
    await fwd.query(q("short.example"), tcp=False)     # TTL 1 raised to 5
    now[0] += 4
    hit = await fwd.query(q("short.example"), tcp=False)
    assert len(upstream.received) == 1 and hit.rr[0].ttl == 1
    nx = await fwd.query(q("missing.example"), tcp=False)
    assert nx.header.rcode == dnslib.RCODE.NXDOMAIN
    nx2 = await fwd.query(q("Missing.Example"), tcp=False)   # key is case-insensitive
    assert nx2.header.rcode == dnslib.RCODE.NXDOMAIN and str(nx2.q.qname) == "Missing.Example."
    assert [r[1] for r in upstream.received].count("missing.example.") == 1
    assert nx2.auth[0].rtype == dnslib.QTYPE.SOA
    # NODATA is negative too: cached by the SOA (min(60, 30) -> clamped to 30).
    await fwd.query(q("www.example", "TXT"), tcp=False)
    await fwd.query(q("www.example", "TXT"), tcp=False)
    assert [r[2] for r in upstream.received].count(16) == 1


async def test_servfail_is_not_cached():
    up = await FakeUpstream(rcode=dns.rcode.SERVFAIL).start()
    try:
        fwd = Forward([up.address], Cache())
        for _ in range(2):
            reply = await fwd.query(q("www.example"), tcp=False)
            assert reply.header.rcode == dnslib.RCODE.SERVFAIL   # passed through
        assert len(up.received) == 2
    finally:
        await up.stop()


async def test_truncated_udp_reply_is_retried_over_tcp():
    up = await FakeUpstream(RECORDS, truncate_udp=True).start()
    try:
        fwd = Forward([up.address], Cache())
        reply = await fwd.query(q("big.example"), tcp=False)
        assert not reply.header.tc and len(reply.rr) == 60
        assert [r[0] for r in up.received] == ["udp", "tcp"]
        again = await fwd.query(q("big.example"), tcp=False)       # whole answer cached
        assert len(again.rr) == 60 and len(up.received) == 2
    finally:
        await up.stop()


async def test_failover_from_a_down_upstream(upstream):
    fwd = Forward([("127.0.0.1", closed_port()), upstream.address], None, max_fails=2,
                  health_interval=30)
    # Random order: the down one comes first about every other query (2^-30 odds of never twice).
    for _ in range(30):
        reply = await fwd.query(q("www.example"), tcp=False)
        assert str(reply.rr[0].rdata) == "192.0.2.1"
    down = fwd.upstreams[0]
    assert not fwd.healthy(down)               # marked after max_fails
    assert len(upstream.received) == 30
    await fwd.close()


async def test_all_down_is_none_and_refusals_count_as_failures():
    fwd = Forward([("127.0.0.1", closed_port()), ("127.0.0.1", closed_port())], None, health_interval=30)
    assert await fwd.query(q("www.example"), tcp=False) is None
    assert await fwd.query(q("www.example"), tcp=True) is None
    # each query tried both (refused at once: ICMP / RST), so both are now unhealthy
    assert [u.fails for u in fwd.upstreams] == [2, 2] and not any(fwd.healthy(u) for u in fwd.upstreams)
    await fwd.close()


async def test_slow_upstream_times_out_then_the_other_answers(upstream):
    slow = await FakeUpstream(RECORDS, delay=3.0).start()
    try:
        fwd = Forward([slow.address, upstream.address], None)   # default 2 s read timeout
        # The good one is marked unhealthy, so the slow one is tried first.
        fwd.upstreams[1].fails = fwd.max_fails
        reply = await fwd.query(q("www.example"), tcp=False)
        assert str(reply.rr[0].rdata) == "192.0.2.1"
        # the slow one was asked first and given up on (its answer would come after the
        # read timeout), then the other answered
        assert slow.asked == ["udp"] and not slow.received and len(upstream.received) == 1
        assert fwd.upstreams[0].fails == 1 and fwd.upstreams[1].fails == 0
    finally:
        await slow.stop()


async def test_everything_slow_gives_up_at_the_overall_deadline():
    """Five slow upstreams, a read timeout of 0.4 s and a deadline of 1.2 s: three tries fit (the
    last ends at the deadline), the other two upstreams are never asked."""
    slows = [await FakeUpstream(RECORDS, delay=10).start() for _ in range(5)]
    try:
        fwd = Forward([s.address for s in slows], None, read_timeout=0.4, overall_timeout=1.2, max_fails=100)
        assert await fwd.query(q("www.example"), tcp=False) is None
        assert sum(len(s.asked) for s in slows) == 3
    finally:
        for s in slows:
            await s.stop()
        await fwd.close()


async def test_serve_stale_when_every_upstream_is_down():
    now = [0.0]
    up = await FakeUpstream(RECORDS).start()
    port = up.port
    fwd = Forward([up.address], Cache(clock=lambda: now[0]), health_interval=0.05)
    fresh = await fwd.query(q("www.example"), tcp=False)
    assert fresh.rr[0].ttl == 300
    await up.stop()
    now[0] += 100                              # past the 30 s cap: expired, still stale-servable
    stale = await fwd.query(q("www.example"), tcp=False)
    assert str(stale.rr[0].rdata) == "192.0.2.1" and stale.rr[0].ttl == 0
    # The upstream returns: the health probe notices, fresh answers again.
    up2 = await FakeUpstream(RECORDS).start(port)
    try:
        for _ in range(40):
            if fwd.healthy(fwd.upstreams[0]):
                break
            await asyncio.sleep(0.05)
        assert fwd.healthy(fwd.upstreams[0])
        reply = await fwd.query(q("www.example"), tcp=False)
        assert reply.rr[0].ttl == 300 and len(up2.received) >= 1
    finally:
        await up2.stop()
        await fwd.close()


async def test_mismatched_reply_is_rejected():
    """An upstream answering another question is a failure, not an answer."""
    up = await FakeUpstream(RECORDS).start()
    orig = up.answer

    def wrong(wire, proto):
        m = dns.message.from_wire(wire)
        m.question[0].name = dns.name.from_text("other.example.")
        return orig(m.to_wire(), proto)
    up.answer = wrong
    try:
        fwd = Forward([up.address], None, read_timeout=0.3, overall_timeout=0.6)
        assert await fwd.query(q("www.example"), tcp=True) is None
    finally:
        await up.stop()


def test_cache_key_and_policy():
    plain = cache_key(q("A.Example"))
    assert plain == ("a.example.", 1, 1, False, False)
    with_do = q("a.example")
    with_do.add_ar(dnslib.EDNS0(udp_len=1232, flags="do"))
    assert cache_key(with_do)[3] is True
    cd = q("a.example")
    cd.header.cd = 1
    assert cache_key(cd)[4] is True

    cache = Cache(size=2)
    for i in range(3):
        r = q(f"n{i}.example").reply()
        r.add_answer(dnslib.RR(f"n{i}.example", rdata=dnslib.A("192.0.2.1"), ttl=60))
        assert cache.put(cache_key(r), r, r.pack())
    assert len(cache) == 2                        # bounded; the oldest evicted
    tc = q("tc.example").reply()
    tc.header.tc = 1
    assert not cache.put(cache_key(tc), tc, tc.pack())
    refused = q("r.example").reply()
    refused.header.rcode = dnslib.RCODE.REFUSED
    assert not cache.put(cache_key(refused), refused, refused.pack())
    nx_no_soa = q("nx.example").reply()
    nx_no_soa.header.rcode = dnslib.RCODE.NXDOMAIN
    assert not cache.put(cache_key(nx_no_soa), nx_no_soa, nx_no_soa.pack())


def test_upstreams_from_flags_and_resolv_conf(tmp_path):
    conf = tmp_path / "resolv.conf"
    conf.write_text("nameserver 10.0.0.1\nnameserver fe80::1%eth0\nnameserver bogus\n")
    cfg = load(["dns", "--manifest", "x", "--resolv-conf", str(conf)])
    assert upstreams_from(cfg) == [("10.0.0.1", 53), ("fe80::1", 53)]
    cfg = load(["dns", "--manifest", "x", "--upstream", "127.0.0.1:5300", "--upstream", "[::1]:53"])
    assert upstreams_from(cfg) == [("127.0.0.1", 5300), ("::1", 53)]
    cfg = load(["dns", "--manifest", "x", "--resolv-conf", str(tmp_path / "missing")])
    assert upstreams_from(cfg) == []
    assert Forward.from_config(load(["dns", "--manifest", "x", "--no-upstream"])) is None


# --- the engine's fast path for answers the cache holds ---------------------------------------

def engine_with(fwd: Forward):

    from clusterdns.config import Config
    from clusterdns.dns.engine import Engine
    from clusterdns.state import ClusterState
    engine = Engine(Config(), fwd)
    engine.update(ClusterState())
    return engine


def hits() -> float:
    from clusterdns.metrics import REGISTRY
    return sum(s.value for f in REGISTRY.collect() for s in f.samples if s.name == "coredns_cache_hits_total")


@pytest.mark.parametrize("name,qtype,kw", [
    ("www.example.", "A", {}),
    ("www.example.", "AAAA", {"use_edns": 0, "want_dnssec": True}),
    ("missing.example.", "A", {"use_edns": 0, "payload": 1232}),       # negative: SOA in authority
    ("www.example.", "TXT", {}),                                          # NODATA
])
async def test_cached_forwarded_answer_on_the_fast_path_with_ttl_counted_down(upstream, name, qtype, kw):
    now = [1000.0]
    engine = engine_with(Forward([upstream.address], Cache(min_ttl=5, max_ttl=30, clock=lambda: now[0])))
    wire = dns.message.make_query(name, qtype, **kw).to_wire()
    assert engine.fast(wire, False) is None                 # never asked: resolve() forwards it
    first = await engine.resolve(wire, "10.0.0.1", False)
    assert len(upstream.received) == 1
    for elapsed in (0, 10, 19.5):
        now[0] = 1000.0 + elapsed
        before = hits()
        fast = engine.fast(wire, False)
        assert fast is not None and hits() == before + 1     # a cache hit, counted
        slow = await engine.resolve(wire, "10.0.0.1", False)   # the dnslib-level cache answers the same
        assert fast == slow
        m = dns.message.from_wire(fast)
        ttls = {rr.ttl for rrset in m.answer + m.authority for rr in [rrset]}
        assert ttls == {int(30 - elapsed)}
    assert dns.message.from_wire(first).rcode() == m.rcode()
    assert len(upstream.received) == 1
    now[0] = 1031.0                                           # expired: back to resolve(), which asks again
    assert engine.fast(wire, False) is None
    await engine.resolve(wire, "10.0.0.1", False)
    assert len(upstream.received) == 2 and engine.fast(wire, False) is not None


async def test_cached_forwarded_answer_keeps_id_case_and_keys_on_do_and_cd(upstream):
    now = [0.0]
    engine = engine_with(Forward([upstream.address], Cache(clock=lambda: now[0])))
    await engine.resolve(dns.message.make_query("www.example.", "A").to_wire(), "10.0.0.1", False)
    q = dns.message.make_query("WWW.Example.", "A")
    q.id = 4321
    fast = engine.fast(q.to_wire(), False)
    m = dns.message.from_wire(fast)
    assert m.id == 4321 and m.question[0].name.to_text() == "WWW.Example."
    assert m.flags & dns.flags.QR and m.flags & dns.flags.RD and m.answer[0][0].address == "192.0.2.1"
    assert m.answer[0].name.to_text() == "WWW.Example."      # owner compressed onto the question
    # DO and CD are part of the cache key: their first query goes upstream
    for kw, flags in (({"use_edns": 0, "want_dnssec": True}, 0), ({}, dns.flags.CD)):
        q = dns.message.make_query("www.example.", "A", **kw)
        q.flags |= flags
        assert engine.fast(q.to_wire(), False) is None
        await engine.resolve(q.to_wire(), "10.0.0.1", False)
        reply = dns.message.from_wire(engine.fast(q.to_wire(), False))
        assert reply.flags & flags == flags and (reply.ednsflags & dns.flags.DO) == (q.ednsflags & dns.flags.DO)
    assert len(upstream.received) == 3


async def test_the_fast_path_serves_what_the_cache_holds_not_an_uncached_reply(upstream):
    """Two queries for one name forwarded at once: the other one's answer is cached while this
    one's upstream said SERVFAIL (never cached). This client gets its SERVFAIL; the fast path
    then serves the cached answer."""
    class Racing(Forward):
        async def query(self, request, tcp):
            await super().query(request, tcp)          # "the other query": forwarded and cached
            bad = request.reply()
            bad.header.ra, bad.header.rcode = 1, dnslib.RCODE.SERVFAIL
            return bad

    engine = engine_with(Racing([upstream.address], Cache(clock=lambda: 0.0)))
    wire = dns.message.make_query("www.example.", "A").to_wire()
    assert dns.message.from_wire(await engine.resolve(wire, "10.0.0.1", False)).rcode() == dns.rcode.SERVFAIL
    m = dns.message.from_wire(engine.fast(wire, False))
    assert m.rcode() == dns.rcode.NOERROR and m.answer[0][0].address == "192.0.2.1"


@pytest.mark.parametrize("kw,tcp,limit,full", [({}, False, 512, False), ({"use_edns": 0, "payload": 512}, False, 512, False),
                                               ({"use_edns": 0, "payload": 1232}, False, 1232, True),
                                               ({}, True, 65535, True)])
async def test_cached_big_forwarded_answer_fits_the_client(upstream, kw, tcp, limit, full):
    engine = engine_with(Forward([upstream.address], Cache(clock=lambda: 0.0)))
    wire = dns.message.make_query("big.example.", "A", **kw).to_wire()
    prime = dns.message.make_query("big.example.", "A").to_wire()
    await engine.resolve(prime, "10.0.0.1", True)            # cached whole (60 records) over TCP
    fast = engine.fast(wire, tcp)
    assert fast == await engine.resolve(wire, "10.0.0.1", tcp) and len(fast) <= limit
    m = dns.message.from_wire(fast)
    n = sum(len(r) for r in m.answer)
    assert (n == 60) == full and bool(m.flags & dns.flags.TC) == (not full) and n > 0


async def test_uncached_answers_and_cluster_names_are_not_on_the_forwarded_fast_path():
    up = await FakeUpstream(rcode=dns.rcode.SERVFAIL).start()
    try:
        engine = engine_with(Forward([up.address], Cache()))
        wire = dns.message.make_query("www.example.", "A").to_wire()
        for _ in range(2):
            await engine.resolve(wire, "10.0.0.1", False)
            assert engine.fast(wire, False) is None           # SERVFAIL is never cached
        assert len(up.received) == 2
    finally:
        await up.stop()
