"""The Corefile `cache` plugin, served directly: `await plugin.serve(Request(...), next)` with a
`next` that counts its calls and returns canned dnslib replies, and a clock the test moves.

Expectations follow CoreDNS's plugin/cache tests (setup_test.go, cache_test.go,
prefetch_test.go, spoof_test.go) and README; the state-zone drop is clusterdns's own rule.
"""
from __future__ import annotations

import asyncio
from pathlib import Path

import dns.flags
import dns.rcode
import dnslib
import pytest
from prometheus_client import generate_latest

from clusterdns.corefile.parse import load, parse_text, walk
from clusterdns.corefile.plugin import PluginError, Request, SetupContext
from clusterdns.corefile.plugins.cache import Cache, setup
from clusterdns.corefile.syntax import CorefileError, Directive
from clusterdns.metrics import DNS as REGISTRY
from tests import demo
from tests.corefile.cfserve import CorefileServer, answers
from tests.dns.dnskit import FakeUpstream

A, AAAA, MX, SOA_T = dnslib.QTYPE.A, dnslib.QTYPE.AAAA, dnslib.QTYPE.MX, dnslib.QTYPE.SOA
SERVER = "dns://192.0.2.53:53"   # a label no other test's listener has


# -- helpers ----------------------------------------------------------------------------------

def directive(text: str, file: str = "Corefile", first: int = 2) -> Directive:
    """The `cache` directive of `text` as the Corefile reader hands it over, its first line at
    line `first` of `file` (inside a `. {` block on the line before)."""
    blocks = parse_text("\n" * (first - 2) + ". {\n" + text + "\n}\n", filename=file)
    return blocks[0].directives[0]


def make(text: str, zones: tuple[str, ...] = (".",), state_zones: tuple[str, ...] = ()) -> tuple[Cache, "Clock"]:
    ctx = SetupContext(zones=list(zones), server=SERVER, state_zones=list(state_zones))
    plugin = setup(directive(text), ctx)
    clock = Clock()
    plugin.clock = clock
    return plugin, clock


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def query(name: str, qtype: int = A, do: bool = False, cd: bool = False, ad: bool = False,
          server: str = SERVER) -> Request:
    q = dnslib.DNSRecord.question(name, dnslib.QTYPE[qtype])
    q.header.rd = 1
    if cd:
        q.header.cd = 1
    if ad:
        q.header.ad = 1
    if do:
        q.add_ar(dnslib.EDNS0(udp_len=1232, flags="do"))
    return Request(record=q, server=server)


def soa(zone: str, ttl: int, minimum: int) -> dnslib.RR:
    return dnslib.RR(zone, SOA_T, ttl=ttl, rdata=dnslib.SOA("ns.dns." + zone, "hostmaster." + zone,
                                                           (1, 7200, 1800, 86400, minimum)))


class Next:
    """A canned backend: `kind` says what it answers; counts calls; IPs count up per call."""

    def __init__(self, kind: str = "positive", ttl: int = 300, *, ad: bool = False) -> None:
        self.kind, self.ttl, self.ad = kind, ttl, ad
        self.calls = 0
        self.gate: asyncio.Event | None = None

    async def __call__(self, req: Request) -> dnslib.DNSRecord:
        self.calls += 1
        if self.gate is not None:
            await self.gate.wait()
        q = req.record
        r = q.reply(ra=1, aa=0)
        r.header.ad = 1 if self.ad else 0
        name = str(q.q.qname)
        kind = self.kind
        if kind == "error":
            raise PluginError(reason="upstream down")
        if kind in ("positive", "truncated", "mismatch", "noqr"):
            r.add_answer(dnslib.RR(name, q.q.qtype, ttl=self.ttl,
                                   rdata=dnslib.A(f"192.0.{2 + self.calls // 256}.{self.calls % 256}") if q.q.qtype == A
                                   else dnslib.MX(f"mx{self.calls}.example.")))
            if kind == "truncated":
                r.header.tc = 1
            if kind == "mismatch":
                r.questions = [dnslib.DNSQuestion("example.net.", q.q.qtype)]
            if kind == "noqr":
                r.header.qr = 0
        elif kind == "nxdomain":
            r.header.rcode = dnslib.RCODE.NXDOMAIN
            r.add_auth(soa("example.org.", self.ttl, 60))
        elif kind == "nxdomain-nosoa":
            r.header.rcode = dnslib.RCODE.NXDOMAIN
        elif kind == "nodata":
            r.add_auth(soa("example.org.", self.ttl, 60))
        elif kind in ("servfail", "refused", "formerr"):
            r.header.rcode = {"servfail": 2, "refused": 5, "formerr": 1}[kind]
        return r


def ttls(reply: dnslib.DNSRecord) -> list[int]:
    return [rr.ttl for rr in reply.rr + reply.auth + reply.ar if rr.rtype != dnslib.QTYPE.OPT]


def address(reply: dnslib.DNSRecord) -> str:
    return str(reply.rr[0].rdata)


async def settle(plugin: Cache) -> None:
    if plugin.pending:
        await asyncio.gather(*list(plugin.pending))


# -- positive answers, TTLs, AA, letter case ---------------------------------------------------

async def test_positive_answer_cached_and_ttl_counts_down():
    plugin, clock = make("cache")
    nxt = Next(ttl=300)
    first = await plugin.serve(query("example.org"), nxt)
    assert nxt.calls == 1 and ttls(first) == [300] and address(first) == "192.0.2.1"
    assert first.header.aa == 0          # the backend's reply as it was (a miss is not from the cache)
    clock.t += 10.5
    hit = await plugin.serve(query("example.org"), nxt)
    assert nxt.calls == 1
    assert address(hit) == "192.0.2.1" and ttls(hit) == [290]     # whole seconds elapsed
    assert hit.header.aa == 1 and hit.header.ra == 1 and hit.header.qr == 1 and hit.header.rd == 1
    assert hit.header.rcode == 0
    clock.t += 289
    assert ttls(await plugin.serve(query("example.org"), nxt)) == [1] and nxt.calls == 1
    clock.t += 1
    again = await plugin.serve(query("example.org"), nxt)          # expired: fetched again
    assert nxt.calls == 2 and address(again) == "192.0.2.2"


async def test_hit_keeps_id_and_question_of_the_asker_both_letter_cases():
    plugin, clock = make("cache")
    nxt = Next()
    await plugin.serve(query("Example.ORG"), nxt)
    q = query("example.org")
    q.record.header.id = 4242
    hit = await plugin.serve(q, nxt)
    assert nxt.calls == 1
    assert hit.header.id == 4242 and str(hit.q.qname) == "example.org."
    q2 = query("EXAMPLE.org")
    hit2 = await plugin.serve(q2, nxt)
    assert nxt.calls == 1 and str(hit2.q.qname) == "EXAMPLE.org."
    # the qtype is part of the key
    await plugin.serve(query("example.org", MX), nxt)
    assert nxt.calls == 2


async def test_ttl_argument_caps_and_reply_on_miss_carries_the_capped_ttl():
    plugin, clock = make("cache 30")
    nxt = Next(ttl=300)
    miss = await plugin.serve(query("example.org"), nxt)
    assert ttls(miss) == [30]             # no 300 -> 29 jump between first and cached answer
    clock.t += 29
    assert ttls(await plugin.serve(query("example.org"), nxt)) == [1] and nxt.calls == 1
    clock.t += 1
    await plugin.serve(query("example.org"), nxt)
    assert nxt.calls == 2


async def test_default_caps_3600_success_1800_denial():
    plugin, clock = make("cache")
    assert ttls(await plugin.serve(query("big.example.org"), Next(ttl=3601))) == [3600]
    neg = Next("nxdomain", ttl=86400)
    neg_reply = await plugin.serve(query("nx.example.org"), neg)
    # SOA counts as min(TTL, MINIMUM) = 60 (RFC 2308)
    assert ttls(neg_reply) == [60]
    plugin2, _ = make("cache")
    neg2 = Next("nodata", ttl=100000)
    r = await plugin2.serve(query("example.org", AAAA), neg2)
    assert ttls(r) == [60]


async def test_minimum_ttl_and_zero_ttl():
    plugin, clock = make("cache")
    nxt = Next(ttl=1)
    assert ttls(await plugin.serve(query("example.org"), nxt)) == [5]    # raised to the 5 s minimum
    clock.t += 4
    assert ttls(await plugin.serve(query("example.org"), nxt)) == [1] and nxt.calls == 1
    # MINTTL 0 and a 0-TTL answer: not cached (CoreDNS's TestCacheZeroTTL)
    plugin, clock = make("cache {\nsuccess 9984 3600 0\ndenial 9984 1800 0\n}")
    zero = Next(ttl=0)
    await plugin.serve(query("example.org"), zero)
    await plugin.serve(query("example.org"), zero)
    assert zero.calls == 2


async def test_success_and_denial_options_nodelocal():
    plugin, clock = make("cache {\nsuccess 9984 30\ndenial 9984 5\n}")
    pos, neg = Next(ttl=300), Next("nxdomain", ttl=300)
    assert ttls(await plugin.serve(query("a.example.org"), pos)) == [30]
    assert ttls(await plugin.serve(query("nx.example.org"), neg)) == [5]
    clock.t += 4
    assert ttls(await plugin.serve(query("nx.example.org"), neg)) == [1] and neg.calls == 1
    clock.t += 1
    await plugin.serve(query("nx.example.org"), neg)
    assert neg.calls == 2
    clock.t += 20
    assert ttls(await plugin.serve(query("a.example.org"), pos)) == [5] and pos.calls == 1


# -- what is cached, what is not ----------------------------------------------------------------

@pytest.mark.parametrize("kind, cached, rcode", [
    ("nxdomain", True, 3),          # NXDOMAIN with SOA: denial
    ("nodata", True, 0),            # NOERROR, SOA, no answer: denial
    ("servfail", True, 2),          # SERVFAIL: for `servfail` (5 s)
    ("nxdomain-nosoa", False, 3),   # no SOA: OtherError
    ("refused", False, 5),
    ("formerr", False, 1),
    ("truncated", False, 0),        # CoreDNS never stores TC replies
])
async def test_which_replies_are_cached(kind, cached, rcode):
    plugin, clock = make("cache")
    nxt = Next(kind)
    first = await plugin.serve(query("x.example.org"), nxt)
    assert first.header.rcode == rcode
    clock.t += 1
    second = await plugin.serve(query("x.example.org"), nxt)
    assert nxt.calls == (1 if cached else 2)
    assert second.header.rcode == rcode
    if cached:
        assert second.header.aa == 1
        if kind in ("nxdomain", "nodata"):
            assert second.auth[0].rtype == SOA_T and second.auth[0].ttl == 59


async def test_servfail_duration_default_zero_and_set():
    plugin, clock = make("cache")
    nxt = Next("servfail")
    await plugin.serve(query("sf.example.org"), nxt)
    clock.t += 4.9
    await plugin.serve(query("sf.example.org"), nxt)
    assert nxt.calls == 1
    clock.t += 0.1
    await plugin.serve(query("sf.example.org"), nxt)
    assert nxt.calls == 2
    # servfail 0 (aks-localdns): never
    plugin, clock = make("cache 3600 {\nsuccess 9984\ndenial 9984\nservfail 0\n}")
    nxt = Next("servfail")
    await plugin.serve(query("sf.example.org"), nxt)
    await plugin.serve(query("sf.example.org"), nxt)
    assert nxt.calls == 2
    plugin, clock = make("cache {\nservfail 2m\n}")
    nxt = Next("servfail")
    await plugin.serve(query("sf.example.org"), nxt)
    clock.t += 119
    await plugin.serve(query("sf.example.org"), nxt)
    assert nxt.calls == 1


async def test_key_has_do_and_cd_and_ad_kept_only_when_asked():
    plugin, clock = make("cache")
    nxt = Next(ad=True)
    plain = await plugin.serve(query("example.org"), nxt)
    assert plain.header.ad == 0                 # neither DO nor AD asked: AD cleared
    await plugin.serve(query("example.org", do=True), nxt)
    await plugin.serve(query("example.org", cd=True), nxt)
    assert nxt.calls == 3                       # three keys
    assert (await plugin.serve(query("example.org", do=True), nxt)).header.ad == 1
    assert (await plugin.serve(query("example.org"), nxt)).header.ad == 0
    # the same (non-DO) entry for a query that sets AD: the stored AD is kept (RFC 6840 5.7)
    assert (await plugin.serve(query("example.org", ad=True), nxt)).header.ad == 1
    cd_hit = await plugin.serve(query("example.org", cd=True), nxt)
    assert cd_hit.header.cd == 1 and nxt.calls == 3


async def test_expired_rrsig_with_do_not_cached():
    plugin, clock = make("cache")

    async def signed(req: Request) -> dnslib.DNSRecord:
        signed.calls += 1   # type: ignore[attr-defined]
        r = req.record.reply(ra=1, aa=0)
        r.add_answer(dnslib.RR("example.org.", A, ttl=300, rdata=dnslib.A("192.0.2.9")))
        r.add_answer(dnslib.RR("example.org.", dnslib.QTYPE.RRSIG, ttl=300, rdata=dnslib.RRSIG(
            A, 8, 2, 300, 1463800381, 1461208381, 12051, "example.org.", b"sig")))   # expired in 2016
        r.add_ar(dnslib.EDNS0(udp_len=1232, flags="do"))
        return r
    signed.calls = 0   # type: ignore[attr-defined]
    await plugin.serve(query("example.org", do=True), signed)
    await plugin.serve(query("example.org", do=True), signed)
    assert signed.calls == 2   # type: ignore[attr-defined]


async def test_spoofed_or_not_a_response_is_not_cached_and_counted_as_drop():
    plugin, clock = make("cache")
    for kind in ("mismatch", "noqr"):
        nxt = Next(kind)
        await plugin.serve(query("example.org"), nxt)
        await plugin.serve(query("example.org"), nxt)
        assert nxt.calls == 2, kind
    assert plugin._counts[("drops", SERVER, "")] == 4


async def test_plugin_error_of_next_propagates_and_is_not_cached():
    plugin, clock = make("cache")
    nxt = Next("error")
    for _ in range(2):
        with pytest.raises(PluginError):
            await plugin.serve(query("example.org"), nxt)
    assert nxt.calls == 2


async def test_cached_reply_is_not_the_backends_objects():
    plugin, clock = make("cache")
    nxt = Next()
    first = await plugin.serve(query("example.org"), nxt)
    first.rr[0].ttl = 1          # a later plugin changing what it got
    first.rr.append(first.rr[0])
    hit = await plugin.serve(query("example.org"), nxt)
    assert ttls(hit) == [300] and len(hit.rr) == 1


# -- zones, disable, keepttl ---------------------------------------------------------------------

async def test_names_outside_the_zones_go_to_next_uncached():
    plugin, clock = make("cache example.org")
    nxt = Next(ttl=300)
    assert plugin.zones == ["example.org."]
    for _ in range(2):
        r = await plugin.serve(query("www.example.com"), nxt)
        assert ttls(r) == [300]           # untouched
    assert nxt.calls == 2
    await plugin.serve(query("WWW.Example.ORG"), nxt)
    await plugin.serve(query("www.example.org"), nxt)
    assert nxt.calls == 3
    assert plugin.transparent("www.example.com.", A) and not plugin.transparent("www.example.org.", A)
    assert plugin.transparent("wwwexample.org.", A) and not plugin.transparent("example.org.", A)
    await plugin.serve(query("wwwexample.org"), nxt)
    await plugin.serve(query("wwwexample.org"), nxt)
    assert nxt.calls == 5


async def test_zones_default_to_the_server_block():
    plugin, _ = make("cache 30", zones=("example.org.", "example.net."))
    assert plugin.zones == ["example.org.", "example.net."]
    plugin, _ = make("cache aaa example.nl")      # not a number: a zone (CoreDNS setup_test)
    assert plugin.zones == ["aaa.", "example.nl."] and plugin.opts.pttl == 3600


async def test_disable_kubeadm_cluster_local():
    plugin, clock = make("cache 30 {\ndisable success cluster.local\ndisable denial cluster.local\n}")
    pos, neg = Next(), Next("nxdomain")
    for _ in range(2):
        await plugin.serve(query("kube-dns.kube-system.svc.Cluster.Local"), pos)
        await plugin.serve(query("missing.svc.cluster.local"), neg)
    assert pos.calls == 2 and neg.calls == 2
    for _ in range(2):
        await plugin.serve(query("example.org"), pos)
        await plugin.serve(query("nx.example.org"), neg)
    assert pos.calls == 3 and neg.calls == 3


async def test_disable_one_kind_everywhere():
    plugin, clock = make("cache {\ndisable denial\n}")
    pos, neg, fail = Next(), Next("nxdomain"), Next("servfail")
    for _ in range(2):
        await plugin.serve(query("a.example.org"), pos)
        await plugin.serve(query("nx.example.org"), neg)
        await plugin.serve(query("sf.example.org"), fail)
    assert (pos.calls, neg.calls, fail.calls) == (1, 2, 2)
    plugin, clock = make("cache {\ndisable success\n}")
    pos, neg = Next(), Next("nxdomain")
    for _ in range(2):
        await plugin.serve(query("a.example.org"), pos)
        await plugin.serve(query("nx.example.org"), neg)
    assert (pos.calls, neg.calls) == (2, 1)


async def test_keepttl_serves_the_original_ttl():
    plugin, clock = make("cache {\nkeepttl\n}")
    nxt = Next(ttl=300)
    await plugin.serve(query("example.org"), nxt)
    clock.t += 200
    assert ttls(await plugin.serve(query("example.org"), nxt)) == [300] and nxt.calls == 1
    clock.t += 100
    await plugin.serve(query("example.org"), nxt)
    assert nxt.calls == 2


# -- prefetch ------------------------------------------------------------------------------------

async def test_prefetch_coredns_cases():
    # prefetch_test.go "hits.reset": TTL 80, prefetch 1: at 73 s (7 left <= 8 = 10%) a refresh
    plugin, clock = make("cache {\nprefetch 1\n}")
    nxt = Next(ttl=80)
    t0 = clock.t
    assert ttls(await plugin.serve(query("hits.reset.example.org"), nxt)) == [80]
    clock.t = t0 + 73
    r = await plugin.serve(query("hits.reset.example.org"), nxt)
    assert ttls(r) == [7] and address(r) == "192.0.2.1"      # the client gets the cached answer
    await settle(plugin)
    assert nxt.calls == 2
    clock.t = t0 + 80
    r = await plugin.serve(query("hits.reset.example.org"), nxt)
    assert ttls(r) == [73] and address(r) == "192.0.2.2" and nxt.calls == 2
    assert plugin._counts[("prefetch", SERVER, "")] == 1

    # "short.ttl": TTL 5: threshold ceil(0.5) = 1
    plugin, clock = make("cache {\nprefetch 1\n}")
    nxt = Next(ttl=5)
    t0 = clock.t
    await plugin.serve(query("short.ttl.example.org"), nxt)
    clock.t = t0 + 1
    assert ttls(await plugin.serve(query("short.ttl.example.org"), nxt)) == [4]
    await settle(plugin)
    assert nxt.calls == 1
    clock.t = t0 + 4
    assert ttls(await plugin.serve(query("short.ttl.example.org"), nxt)) == [1]
    await settle(plugin)
    assert nxt.calls == 2
    clock.t = t0 + 5
    r = await plugin.serve(query("short.ttl.example.org"), nxt)
    assert ttls(r) == [4] and address(r) == "192.0.2.2"

    # "no.prefetch"
    plugin, clock = make("cache")
    nxt = Next(ttl=30)
    t0 = clock.t
    await plugin.serve(query("no.prefetch.example.org"), nxt)
    for after, left in ((15, 15), (29, 1)):
        clock.t = t0 + after
        assert ttls(await plugin.serve(query("no.prefetch.example.org"), nxt)) == [left]
    assert nxt.calls == 1 and not plugin.pending
    clock.t = t0 + 30
    r = await plugin.serve(query("no.prefetch.example.org"), nxt)
    assert ttls(r) == [30] and address(r) == "192.0.2.2"


async def test_prefetch_amount_duration_percentage():
    # 3 hits with no gap of 10 s; refresh once the TTL is at or below 50% of 100
    plugin, clock = make("cache {\nprefetch 3 10s 50%\n}")
    nxt = Next(ttl=100)
    t0 = clock.t
    await plugin.serve(query("p.example.org"), nxt)
    for after in (51, 62, 73):           # gaps of 11 s: the count starts again each time
        clock.t = t0 + after
        await plugin.serve(query("p.example.org"), nxt)
        await settle(plugin)
    assert nxt.calls == 1
    for after in (74, 75):               # with 73: three hits within 10 s of each other
        clock.t = t0 + after
        await plugin.serve(query("p.example.org"), nxt)
        await settle(plugin)
    assert nxt.calls == 2


async def test_prefetched_entry_keeps_the_hit_count():
    plugin, clock = make("cache {\nprefetch 2 1m 50%\n}")
    nxt = Next(ttl=100)
    t0 = clock.t
    await plugin.serve(query("p.example.org"), nxt)
    for after in (45, 50):               # two hits; at 50 s half the TTL is left: refresh
        clock.t = t0 + after
        await plugin.serve(query("p.example.org"), nxt)
        await settle(plugin)
    assert nxt.calls == 2
    # the new entry (stored at 50 s) starts with those hits: its first hit at half TTL refreshes
    clock.t = t0 + 100
    await plugin.serve(query("p.example.org"), nxt)
    await settle(plugin)
    assert nxt.calls == 3


async def test_one_refresh_in_flight_per_entry():
    plugin, clock = make("cache {\nprefetch 1\n}")
    nxt = Next(ttl=10)
    await plugin.serve(query("example.org"), nxt)
    nxt.gate = asyncio.Event()
    clock.t += 9
    for _ in range(5):
        assert address(await plugin.serve(query("example.org"), nxt)) == "192.0.2.1"
    await asyncio.sleep(0)
    assert nxt.calls == 2 and len(plugin.pending) == 1
    nxt.gate.set()
    await settle(plugin)
    r = await plugin.serve(query("example.org"), nxt)
    assert address(r) == "192.0.2.2"


# -- serve_stale ---------------------------------------------------------------------------------

async def test_serve_stale_immediate():
    plugin, clock = make("cache {\nserve_stale 3600s immediate\n}")
    nxt = Next(ttl=60)
    t0 = clock.t
    await plugin.serve(query("cached.org"), nxt)
    nxt.kind = "error"
    clock.t = t0 + 30 * 60                     # 30 minutes later: stale, within the hour
    r = await plugin.serve(query("cached.org"), nxt)
    assert address(r) == "192.0.2.1" and ttls(r) == [0] and r.header.rcode == 0
    await settle(plugin)
    assert nxt.calls == 2                      # refreshed in the background (and failed)
    assert plugin._counts[("served_stale", SERVER, "")] == 1
    clock.t = t0 + 70 * 60                     # past the stale window: a miss
    with pytest.raises(PluginError):
        await plugin.serve(query("cached.org"), nxt)
    with pytest.raises(PluginError):
        await plugin.serve(query("notcached.org"), nxt)
    # a successful background refresh replaces the stale entry
    plugin, clock = make("cache {\nserve_stale\n}")
    nxt = Next(ttl=60)
    await plugin.serve(query("cached.org"), nxt)
    clock.t += 120
    assert ttls(await plugin.serve(query("cached.org"), nxt)) == [0]
    await settle(plugin)
    r = await plugin.serve(query("cached.org"), nxt)
    assert address(r) == "192.0.2.2" and ttls(r) == [60]


async def test_serve_stale_verify():
    plugin, clock = make("cache {\nserve_stale 72000s verify\n}")
    nxt = Next(ttl=60)
    await plugin.serve(query("cached.org"), nxt)
    clock.t += 600
    # upstream answers: the fresh answer, asked before replying, nothing in the background
    r = await plugin.serve(query("cached.org"), nxt)
    assert nxt.calls == 2 and address(r) == "192.0.2.2" and ttls(r) == [60] and not plugin.pending
    clock.t += 600
    nxt.kind = "error"                                   # upstream down: stale
    r = await plugin.serve(query("cached.org"), nxt)
    assert nxt.calls == 3 and address(r) == "192.0.2.2" and ttls(r) == [0]
    nxt.kind = "servfail"                                # neither NOERROR nor NXDOMAIN: stale
    r = await plugin.serve(query("cached.org"), nxt)
    assert nxt.calls == 4 and address(r) == "192.0.2.2" and r.header.rcode == 0
    nxt.kind = "nxdomain"                                # NXDOMAIN is an answer: served and stored
    r = await plugin.serve(query("cached.org"), nxt)
    assert r.header.rcode == 3
    assert plugin._counts[("served_stale", SERVER, "")] == 2


async def test_serve_stale_in_the_second_after_expiry_is_ttl_0_not_stale():
    # CoreDNS counts whole seconds: TTL 60 after 60.5 s is 0, usable under serve_stale, not "< 0"
    plugin, clock = make("cache {\nserve_stale\n}")
    nxt = Next(ttl=60)
    await plugin.serve(query("cached.org"), nxt)
    clock.t += 60.5
    r = await plugin.serve(query("cached.org"), nxt)
    assert ttls(r) == [0] and nxt.calls == 1 and not plugin.pending
    assert ("served_stale", SERVER, "") not in plugin._counts


async def test_serve_stale_zero_means_off():
    plugin, clock = make("cache {\nserve_stale 0\n}")
    nxt = Next(ttl=60)
    await plugin.serve(query("cached.org"), nxt)
    clock.t += 61
    nxt.kind = "error"
    with pytest.raises(PluginError):
        await plugin.serve(query("cached.org"), nxt)


async def test_cached_servfail_does_not_shadow_a_stale_positive():
    plugin, clock = make("cache {\nserve_stale 1h immediate\n}")
    nxt = Next(ttl=60)
    await plugin.serve(query("cached.org"), nxt)
    clock.t += 120
    nxt.kind = "servfail"
    await plugin.serve(query("cached.org"), nxt)     # stale; its refresh stores a SERVFAIL
    await settle(plugin)
    assert nxt.calls == 2
    r = await plugin.serve(query("cached.org"), nxt)
    assert r.header.rcode == 0 and address(r) == "192.0.2.1"
    await settle(plugin)


# -- state zones ----------------------------------------------------------------------------------

async def test_state_zone_entries_dropped_on_every_state_change():
    plugin, clock = make("cache 30", state_zones=("cluster.local.",))
    svc, ext = Next(ttl=30), Next(ttl=300)
    assert plugin.transparent("testapp-svc.testapp.svc.cluster.local.", A)
    assert plugin.transparent("cluster.local.", SOA_T)
    assert not plugin.transparent("example.org.", A)
    assert not plugin.transparent("xcluster.local.", A)       # label-wise, not a string suffix
    for _ in range(2):
        await plugin.serve(query("testapp-svc.testapp.svc.Cluster.Local"), svc)
        await plugin.serve(query("example.org"), ext)
    assert svc.calls == 1 and ext.calls == 1       # cached like CoreDNS while the state stands
    main, state, entries = plugin._main, plugin._state, len(plugin._state.p)
    assert gauge(plugin) == {"success": 2, "denial": 0}
    plugin.on_state(object())
    assert gauge(plugin) == {"success": 1, "denial": 0}       # the retired pair is not counted
    # O(1): nothing walked, nothing cleared; the old pair is simply not looked at again
    assert plugin._main is main and plugin._state is state and len(state.p) == entries == 1
    await plugin.serve(query("testapp-svc.testapp.svc.cluster.local"), svc)
    await plugin.serve(query("example.org"), ext)
    assert svc.calls == 2 and ext.calls == 1       # only the state zone's entries went
    assert plugin._state is not state
    await plugin.serve(query("testapp-svc.testapp.svc.cluster.local"), svc)
    assert svc.calls == 2                          # cached again until the next change
    # negative answers under the state zone too
    nx = Next("nxdomain")
    await plugin.serve(query("missing.svc.cluster.local"), nx)
    await plugin.serve(query("missing.svc.cluster.local"), nx)
    assert nx.calls == 1
    plugin.on_state(object())
    await plugin.serve(query("missing.svc.cluster.local"), nx)
    assert nx.calls == 2


def gauge(plugin: Cache) -> dict[str, float]:
    return {labels["type"]: v for name, labels, v in plugin.metric_samples() if name == "coredns_cache_entries"}


async def test_answer_fetched_across_a_state_change_is_not_stored():
    plugin, clock = make("cache 30", state_zones=("cluster.local.",))
    svc = Next(ttl=30)
    svc.gate = asyncio.Event()
    task = asyncio.create_task(plugin.serve(query("a.svc.cluster.local"), svc))
    await asyncio.sleep(0)
    assert svc.calls == 1           # next is answering
    plugin.on_state(object())
    svc.gate.set()
    await task
    svc.gate = None
    await plugin.serve(query("a.svc.cluster.local"), svc)
    assert svc.calls == 2


async def test_state_zones_outside_the_cache_zones_do_not_matter():
    plugin, _ = make("cache example.org", state_zones=("cluster.local.",))
    assert plugin.state_zones == []
    plugin, _ = make("cache", zones=("svc.cluster.local.",), state_zones=("cluster.local.",))
    assert plugin.state_zones == ["cluster.local."]


# -- metrics -----------------------------------------------------------------------------------------

def samples(name: str) -> dict[tuple, float]:
    out = {}
    for family in REGISTRY.collect():
        for s in family.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def value(name: str, **labels: str) -> float | None:
    return samples(name).get(tuple(sorted(labels.items())))


async def test_metrics_with_server_and_zones_labels():
    plugin, clock = make("cache 30 example.org example.net {\nprefetch 1\nserve_stale\n}")
    server2 = "dns://10.0.0.10:53"
    await plugin.start()
    try:
        nxt = Next(ttl=10)
        await plugin.serve(query("a.example.org"), nxt)                       # miss
        await plugin.serve(query("a.example.org"), nxt)                       # hit success
        await plugin.serve(query("a.example.org", server=server2), nxt)       # hit on another listener
        await plugin.serve(query("nx.example.org"), Next("nxdomain"))         # miss
        await plugin.serve(query("nx.example.org"), Next("nxdomain"))         # hit denial
        await plugin.serve(query("m.example.org"), Next("mismatch"))          # miss, drop
        clock.t += 9
        await plugin.serve(query("a.example.org"), nxt)                       # hit, prefetch
        await settle(plugin)
        clock.t += 25
        await plugin.serve(query("nx.example.org"), Next("error"))            # stale
        await settle(plugin)
        z = "example.org.,example.net."
        base = {"server": SERVER, "zones": z, "view": ""}
        assert value("coredns_cache_requests_total", **base) == 7
        assert value("coredns_cache_requests_total", **{**base, "server": server2}) == 1
        assert value("coredns_cache_hits_total", type="success", **base) == 2
        assert value("coredns_cache_hits_total", type="success", **{**base, "server": server2}) == 1
        assert value("coredns_cache_hits_total", type="denial", **base) == 2
        assert value("coredns_cache_misses_total", **base) == 3
        assert value("coredns_cache_drops_total", **base) == 1
        assert value("coredns_cache_prefetch_total", **base) == 2      # the prefetch and the stale refresh
        assert value("coredns_cache_served_stale_total", **base) == 1
        assert value("coredns_cache_entries", type="success", **base) == 1
        assert value("coredns_cache_entries", type="denial", **base) == 1
        # one family per name, one line per label set, next to the flag-driven cache's series
        text = generate_latest(REGISTRY).decode()
        for name in ("coredns_cache_requests_total", "coredns_cache_hits_total", "coredns_cache_entries"):
            lines = [line for line in text.splitlines() if line.startswith(name + "{")]
            assert len(lines) == len(set(line.rsplit(" ", 1)[0] for line in lines)) > 1
            assert text.count(f"# TYPE {name} ") == 1
    finally:
        await plugin.stop()
    assert value("coredns_cache_requests_total", **base) is None


async def test_evictions_counted_at_capacity():
    plugin, clock = make("cache {\nsuccess 10\n}")
    assert plugin.opts.pcap == 1024                # CoreDNS: 256 shards of at least 4
    await plugin.start()
    try:
        nxt = Next()
        for i in range(1030):
            await plugin.serve(query(f"n{i}.example.org"), nxt)
        assert len(plugin._main.p) == 1024
        assert value("coredns_cache_evictions_total", server=SERVER, type="success", zones=".", view="") == 6
        # least recently used went first
        await plugin.serve(query("n1029.example.org"), nxt)
        assert nxt.calls == 1030
    finally:
        await plugin.stop()


# -- setup ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, pcap, ncap, pttl, minp, nttl, minn, prefetch", [
    ("cache", 9984, 9984, 3600, 5, 1800, 5, 0),
    ("cache {\n}", 9984, 9984, 3600, 5, 1800, 5, 0),
    ("cache example.nl {\nsuccess 10\n}", 1024, 9984, 3600, 5, 1800, 5, 0),
    ("cache example.nl {\nsuccess 10 1800 30\n}", 1024, 9984, 1800, 30, 1800, 5, 0),
    ("cache example.nl {\nsuccess 10\ndenial 10 15\n}", 1024, 1024, 3600, 5, 15, 5, 0),
    ("cache example.nl {\nsuccess 10\ndenial 10 15 2\n}", 1024, 1024, 3600, 5, 15, 2, 0),
    ("cache 25 example.nl {\nsuccess 10\ndenial 10 15\n}", 1024, 1024, 25, 5, 15, 5, 0),
    ("cache 25 example.nl {\nsuccess 10\ndenial 10 15 5\n}", 1024, 1024, 25, 5, 15, 5, 0),
    ("cache {\nprefetch 10\n}", 9984, 9984, 3600, 5, 1800, 5, 10),
    ("cache 30", 9984, 9984, 30, 5, 30, 5, 0),
    ("cache {\nsuccess 5000\ndenial 2500\n}", 4864, 2304, 3600, 5, 1800, 5, 0),
    ("cache {\nsuccess 9984 30\ndenial 9984 5\n}", 9984, 9984, 30, 5, 5, 5, 0),
    ("cache {\nsuccess -5\ndenial 100000\n}", 1024, 99840, 3600, 5, 1800, 5, 0),   # Go: -5/256 = 0 -> 4
])
def test_setup_values(text, pcap, ncap, pttl, minp, nttl, minn, prefetch):
    plugin, _ = make(text)
    o = plugin.opts
    assert (o.pcap, o.ncap, o.pttl, o.minpttl, o.nttl, o.minnttl, o.prefetch) == \
        (pcap, ncap, pttl, minp, nttl, minn, prefetch)


@pytest.mark.parametrize("line, stale, verify", [
    ("serve_stale", 3600, False), ("serve_stale 20m", 1200, False), ("serve_stale 1h20m", 4800, False),
    ("serve_stale 0m", 0, False), ("serve_stale 0", 0, False), ("serve_stale 0 verify", 0, True),
    ("serve_stale 0 immediate", 0, False), ("serve_stale 0 VERIFY", 0, True),
    ("serve_stale 3600s immediate", 3600, False),
])
def test_setup_serve_stale(line, stale, verify):
    plugin, _ = make(f"cache {{\n{line}\n}}")
    assert (plugin.opts.stale, plugin.opts.verify) == (stale, verify)


@pytest.mark.parametrize("line, fail", [("servfail 1s", 1), ("servfail 5m", 300), ("servfail 0s", 0),
                                        ("servfail 0", 0)])
def test_setup_servfail(line, fail):
    plugin, _ = make(f"cache {{\n{line}\n}}")
    assert plugin.opts.failttl == fail


@pytest.mark.parametrize("lines, nexcept, pexcept", [
    ("disable denial example.com example.org", ["example.com.", "example.org."], []),
    ("disable success example.com Example.ORG", [], ["example.com.", "example.org."]),
    ("disable denial", ["."], []),
    ("disable success", [], ["."]),
    ("disable denial example.com example.org\ndisable success example.com example.org",
     ["example.com.", "example.org."], ["example.com.", "example.org."]),
])
def test_setup_disable(lines, nexcept, pexcept):
    plugin, _ = make(f"cache {{\n{lines}\n}}")
    assert (plugin.opts.nexcept, plugin.opts.pexcept) == (nexcept, pexcept)


def test_setup_prefetch_options():
    o = make("cache {\nprefetch 5 30s 20%\n}")[0].opts
    assert (o.prefetch, o.window, o.percentage) == (5, 30, 20)
    o = make("cache {\nprefetch 2 1m\n}")[0].opts
    assert (o.prefetch, o.window, o.percentage) == (2, 60, 10)
    assert make("cache {\nkeepttl\n}")[0].opts.keepttl


@pytest.mark.parametrize("text, line, message", [
    ("cache 0 example.nl", 1, "cache TTL can not be zero or negative: 0"),
    ("cache -1 example.nl", 1, "cache TTL can not be zero or negative: -1"),
    ("cache example.nl {\nsuccess\ndenial 10 15\n}", 2, "success takes CAPACITY [TTL] [MINTTL]"),
    ("cache example.nl {\nsuccess 15\ndenial aaa\n}", 3, "denial capacity 'aaa' is not an integer"),
    ("cache {\nsuccess 10 0\n}", 2, "cache TTL can not be zero or negative: 0"),
    ("cache {\ndenial 10 20 -1\n}", 2, "cache min TTL can not be negative: -1"),
    ("cache {\nsuccess 10 20 5 9\n}", 2, "success takes CAPACITY [TTL] [MINTTL], got 4"),
    ("cache {\nsuccess 10 30s\n}", 2, "success TTL '30s' is not an integer"),
    ("cache example.nl {\npositive 15\nnegative aaa\n}", 2, "unknown option 'positive'"),
    ("cache 1 example.nl {\nprefetch -1\n}", 2, "prefetch amount should be positive: -1"),
    ("cache 1 example.nl {\nprefetch 0 blurp\n}", 2, "prefetch: invalid duration 'blurp'"),
    ("cache {\nprefetch\n}", 2, "prefetch takes AMOUNT"),
    ("cache {\nprefetch 1 1m 10% x\n}", 2, "prefetch takes AMOUNT"),
    ("cache {\nprefetch 1 20\n}", 2, "missing unit"),
    ("cache {\nprefetch 1 1m 20\n}", 2, "last character of percentage should be `%`"),
    ("cache {\nprefetch 1 1m 5%\n}", 2, "percentage should fall in range [10, 90]: 5"),
    ("cache {\nprefetch 1 1m 95%\n}", 2, "percentage should fall in range [10, 90]: 95"),
    ("cache {\nprefetch 1 1m x%\n}", 2, "prefetch percentage 'x' is not an integer"),
    ("cache {\nserve_stale 20\n}", 2, "missing unit"),
    ("cache {\nserve_stale -20m\n}", 2, "invalid negative duration for serve_stale"),
    ("cache {\nserve_stale aa\n}", 2, "serve_stale: invalid duration 'aa'"),
    ("cache {\nserve_stale 1m nono\n}", 2, "invalid value for serve_stale refresh mode: nono"),
    ("cache {\nserve_stale 0 after nono\n}", 2, "a third argument"),
    ("cache {\nservfail\n}", 2, "servfail takes one DURATION"),
    ("cache {\nservfail 6m\n}", 2, "caching SERVFAIL responses over 5 minutes is not permitted"),
    ("cache {\nservfail 20\n}", 2, "missing unit"),
    ("cache {\nservfail -1s\n}", 2, "invalid negative ttl for servfail"),
    ("cache {\nservfail aa\n}", 2, "servfail: invalid duration 'aa'"),
    ("cache {\nservfail 1m invalid\n}", 2, "servfail takes one DURATION"),
    ("cache {\ndisable invalid example.com example.org\n}", 2, 'cache type for disable must be "success" or "denial"'),
    ("cache {\ndisable\n}", 2, "disable takes success|denial"),
    ("cache {\ndisable Success\n}", 2, 'must be "success" or "denial"'),
    ("cache {\nkeepttl arg1\n}", 2, "keepttl takes no arguments"),
    ("cache {\nserve_stale_policy prefer_positive\n}", 2, "serve_stale_policy (CoreDNS after 1.14.7) is not supported"),
])
def test_setup_errors_say_file_and_line(text, line, message):
    with pytest.raises(CorefileError) as err:
        setup(directive(text, file="/etc/coredns/Corefile", first=7),
              SetupContext(zones=["."], server=SERVER))
    text_ = str(err.value)
    assert text_.startswith(f"/etc/coredns/Corefile:{6 + line}: plugin/cache: "), text_
    assert message in text_


def test_setup_error_for_a_nested_block():
    with pytest.raises(CorefileError, match=r"^Corefile:3: plugin/cache: success takes no block"):
        setup(directive("cache {\nsuccess 10 {\n}\n}"), SetupContext(zones=["."]))


REAL = Path(__file__).parent / "real"


def real_caches(name: str) -> list[Cache]:
    out = []
    for block in load(str(REAL / name), env={}):
        for d in walk(block.directives):
            if d.name == "cache":
                out.append(setup(d, SetupContext(zones=["."], server=SERVER)))
    return out


def test_every_real_corefile_cache_sets_up():
    found = 0
    for path in sorted(REAL.glob("*.corefile")):
        for plugin in real_caches(path.name):
            assert plugin.describe()
            found += 1
    assert found >= 20
    kubeadm, = real_caches("kubeadm.corefile")
    o = kubeadm.opts
    assert (o.pttl, o.nttl, o.pexcept, o.nexcept) == (30, 30, ["cluster.local."], ["cluster.local."])
    cluster, *others = real_caches("nodelocaldns.corefile")     # the cluster domain's block first
    o = cluster.opts
    assert (o.pcap, o.pttl, o.ncap, o.nttl) == (9984, 30, 9984, 5)
    assert others and all((c.opts.pttl, c.opts.nttl) == (30, 30) for c in others)
    modes = {(c.opts.stale, c.opts.verify, c.opts.failttl) for c in real_caches("aks-localdns.corefile")}
    assert modes == {(3600, False, 0), (0, False, 0), (3600, True, 0), (72000, True, 0)}


def test_describe_one_line():
    plugin, _ = make("cache 30 {\ndisable success cluster.local\ndisable denial cluster.local\nprefetch 2 30s 20%\n"
                     "serve_stale 1h verify\nservfail 0\nkeepttl\n}", state_zones=("cluster.local.",))
    text = plugin.describe()
    assert "\n" not in text
    for part in ("zones=.", "success=9984 ttl 30s min 5s", "denial=9984 ttl 30s min 5s", "servfail=off",
                 "prefetch=2 30s 20%", "serve_stale=3600s verify", "disable success=cluster.local.",
                 "disable denial=cluster.local.", "keepttl", "dropped on state change=cluster.local."):
        assert part in text, (part, text)
    assert make("cache")[0].describe() == ("zones=.; success=9984 ttl 3600s min 5s; denial=9984 ttl 1800s min 5s; "
                                           "servfail=5s; prefetch=off; serve_stale=off")


def test_record_copies_are_whole_and_independent():
    from clusterdns.corefile.plugins import cache as mod
    assert mod._PLAIN_RR          # this dnslib's layout: the fast copy is the one tested here
    rrs = [dnslib.RR("Example.ORG.", A, ttl=300, rdata=dnslib.A("192.0.2.1")),
           dnslib.RR("example.org.", MX, ttl=20, rdata=dnslib.MX("mx.example.org.", 10)),
           dnslib.RR("example.org.", dnslib.QTYPE.OPT, rclass=1232, ttl=0, rdata=[])]
    for ttl in (None, 7):
        copies = mod._copy(rrs, ttl)
        assert len(copies) == 2 and all(c is not r for c, r in zip(copies, rrs))
        want = [dnslib.RR(r.rname, r.rtype, r.rclass, r.ttl if ttl is None else ttl, r.rdata) for r in rrs[:2]]
        assert [(c.rname, c.rtype, c.rclass, c.ttl, c.rdata) for c in copies] == \
            [(w.rname, w.rtype, w.rclass, w.ttl, w.rdata) for w in want]
        packed = dnslib.DNSRecord(dnslib.DNSHeader(id=1), rr=copies).pack()
        assert packed == dnslib.DNSRecord(dnslib.DNSHeader(id=1), rr=want).pack()
        copies[0].ttl = 1
        assert rrs[0].ttl == 300


# -- over real sockets, in a served Corefile ----------------------------------------------------------

def _with_service(name: str, ip: str) -> list:
    from clusterdns.model import Service, ServicePort
    return demo.demo_records() + [("Service", Service("testapp", name, cluster_ips=(ip,),
                                                      ports=(ServicePort("http", "TCP", 8080),)))]


def _denial_hits(cache: Cache) -> int:
    return sum(n for (metric, _server, kind), n in cache._counts.items() if (metric, kind) == ("hits", "denial"))


@pytest.mark.parametrize("chain", ["fast path", "chain (log in front)", "chain (log in front) over TCP"])
async def test_new_service_resolves_at_once_under_cache_30(tmp_path, chain):
    # `log` is not transparent: every query runs the chain, through the cache's serve()
    log_line = "    log\n" if chain != "fast path" else ""
    up = await FakeUpstream({"www.example.org.": ["www.example.org. 300 IN A 192.0.2.80"]}).start()
    text = (".:{PORT} {\n    bind 127.0.0.1\n" + log_line + "    cache 30\n"
            "    kubernetes cluster.local in-addr.arpa ip6.arpa\n"
            f"    forward . 127.0.0.1:{up.port}\n}}\n")
    tcp = chain.endswith("TCP")
    name = "fresh-svc.testapp.svc.cluster.local"
    try:
        async with CorefileServer(text, tmp_path) as s:
            cache = next(p for p in s.corefile.plugins if p.name == "cache")
            assert cache.state_zones == ["cluster.local.", "in-addr.arpa.", "ip6.arpa."]
            for _ in range(2):
                r = await s.ask(name, "A", tcp=tcp)
                assert r.rcode() == dns.rcode.NXDOMAIN
            if chain == "fast path":
                assert cache._counts == {}           # transparent: answered from the memo
            else:
                assert _denial_hits(cache) == 1      # the second NXDOMAIN came from the state store
                # exported (the runtime started the plugin) with the listener's server label
                assert value("coredns_cache_hits_total", server=f"dns://127.0.0.1:{s.port}", type="denial",
                             zones=".", view="") == 1
            s.publish(_with_service("fresh-svc", "172.20.99.9"))
            await s.settle()
            r = await s.ask(name, "A", tcp=tcp)
            assert r.rcode() == dns.rcode.NOERROR and answers(r) == [f"{name}. A 172.20.99.9"]
            # forwarded names are cached as CoreDNS caches them: once upstream, TTL capped at 30
            first = await s.ask("www.example.org", "A", tcp=tcp)
            second = await s.ask("WWW.example.org", "A", tcp=tcp)
            assert answers(first) == ["www.example.org. A 192.0.2.80"] and first.answer[0].ttl == 30
            assert second.answer[0].ttl <= 30 and second.flags & dns.flags.AA
            assert [q[1:] for q in up.received if q[1] == "www.example.org."] == [("www.example.org.", 1)]
    finally:
        await up.stop()


@pytest.mark.parametrize("mode", ["immediate", "verify"])
async def test_serve_stale_over_sockets_when_the_upstream_is_gone(tmp_path, mode):
    up = await FakeUpstream({"www.example.org.": ["www.example.org. 1 IN A 192.0.2.80"]}).start()
    text = (".:{PORT} {\n    bind 127.0.0.1\n    cache {\n        success 9984 1 0\n"
            f"        serve_stale 1h {mode}\n    }}\n    forward . 127.0.0.1:{up.port}\n}}\n")
    async with CorefileServer(text, tmp_path) as s:
        first = await s.ask("www.example.org", "A")
        assert answers(first) == ["www.example.org. A 192.0.2.80"] and first.answer[0].ttl == 1
        await up.stop()                      # the upstream goes away
        # and the entry expires: TTL 1 - 2 whole seconds < 0 (in the second after expiry CoreDNS
        # still counts it TTL 0, not stale)
        await asyncio.sleep(2.05)
        r = await s.ask("www.example.org", "A")
        assert r.rcode() == dns.rcode.NOERROR and answers(r) == ["www.example.org. A 192.0.2.80"]
        assert r.answer[0].ttl == 0
        cache = next(p for p in s.corefile.plugins if p.name == "cache")
        await settle(cache)
        assert sum(n for (m, _s, _k), n in cache._counts.items() if m == "served_stale") == 1
        # a name never cached has nothing stale: the forward's failure is the answer
        r = await s.ask("other.example.org", "A")
        assert r.rcode() == dns.rcode.SERVFAIL
