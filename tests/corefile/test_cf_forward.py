"""The Corefile `forward` plugin: setup as CoreDNS's setup_test.go pins it (every error with
FILE:LINE), and serve() against real stub upstreams on loopback (tests/dns/dnskit.py's
FakeUpstream, plus a DNS-over-TLS one with a certificate made by the openssl CLI)."""
from __future__ import annotations

import asyncio
import shutil
import ssl
import subprocess

import dns.flags
import dns.message
import dns.rcode
import dnslib
import pytest

from clusterdns.corefile.parse import parse_text
from clusterdns.corefile.plugin import REFUSED, SERVFAIL, PluginError, Request, SetupContext
from clusterdns.corefile.plugins.forward import ForwardPlugin, setup
from clusterdns.corefile.syntax import CorefileError, Directive
from clusterdns.dns import metrics
from tests.dns.dnskit import RECORDS, FakeUpstream, closed_port

FILE = "Corefile"


def directive(text: str) -> Directive:
    """`forward ... { ... }` read by the real Corefile parser, on line 3 of the file."""
    blocks = parse_text("# forward tests\n.:53 {\n" + text + "\n}\n", FILE)
    (d,) = blocks[0].directives
    return d


def make(text: str, zones=(".",), base_dir: str = ".") -> ForwardPlugin:
    return setup(directive(text), SetupContext(zones=list(zones), base_dir=base_dir))


def error(text: str, **kw) -> str:
    with pytest.raises(CorefileError) as exc:
        make(text, **kw)
    return str(exc.value)


def query(name: str, qtype: str = "A") -> dnslib.DNSRecord:
    return dnslib.DNSRecord.question(name, qtype)


def request(name: str, qtype: str = "A", tcp: bool = False) -> Request:
    return Request(query(name, qtype), client=("127.0.0.1", 40000), tcp=tcp)


class Next:
    """The rest of the chain: records what reached it and answers a marker (or raises)."""

    def __init__(self, fail: bool = False) -> None:
        self.seen: list[str] = []
        self.fail = fail

    async def __call__(self, req: Request) -> dnslib.DNSRecord:
        self.seen.append(req.qname)
        if self.fail:
            raise PluginError(SERVFAIL, "no next plugin found")
        r = req.reply()
        r.add_answer(dnslib.RR(req.qname, rdata=dnslib.TXT("next"), ttl=1))
        return r


async def end_of_chain(req: Request) -> dnslib.DNSRecord:
    raise PluginError(SERVFAIL, "no next plugin found")


def chain(plugins: list[ForwardPlugin], last=end_of_chain):
    """Plugins in Corefile order, each one's next the one after, as the runtime builds them."""
    def link(i: int):
        if i == len(plugins):
            return last

        async def call(req: Request) -> dnslib.DNSRecord:
            return await plugins[i].serve(req, link(i + 1))
        return call
    return link(0)


def requests_to(addr: tuple[str, int]) -> float:
    return metrics.forward_requests.labels(f"{addr[0]}:{addr[1]}")._value.get()


@pytest.fixture
async def upstream():
    up = await FakeUpstream(RECORDS).start()
    yield up
    await up.stop()


# --- setup -----------------------------------------------------------------------------------

def test_defaults():
    p = make("forward . 127.0.0.1")
    f = p.fwd
    assert p.from_zone == "." and p.ignored == []
    assert [(u.host, u.port, u.tls) for u in f.upstreams] == [("127.0.0.1", 53, False)]
    assert (f.max_fails, f.policy, f.expire, f.health_interval, f.health_rd, f.health_domain) == \
        (2, "random", 10.0, 0.5, True, ".")
    assert (f.max_concurrent, f.force_tcp, f.prefer_udp, f.failfast) == (0, False, False, False)
    assert (f.read_timeout, f.overall_timeout) == (2.0, 5.0)     # CoreDNS's read timeout and deadline
    assert not p.transparent("www.example.", 1)
    assert p.describe() == (". 127.0.0.1:53; policy random; max_fails 2; expire 10s; "
                            "health_check 0.5s; max_concurrent unlimited")


@pytest.mark.parametrize("text,check", [
    ("forward . 127.0.0.1 {\nexcept miek.nl Example.ORG\n}", lambda p: p.ignored == ["miek.nl.", "example.org."]),
    ("forward . 127.0.0.1 {\nmax_fails 3\n}", lambda p: p.fwd.max_fails == 3),
    ("forward . 127.0.0.1 {\nmax_fails 0\n}", lambda p: p.fwd.max_fails == 0),
    ("forward . 127.0.0.1 {\nforce_tcp\n}", lambda p: p.fwd.force_tcp and not p.fwd.prefer_udp),
    ("forward . 127.0.0.1 {\nprefer_udp\n}", lambda p: p.fwd.prefer_udp and not p.fwd.force_tcp),
    ("forward . 127.0.0.1 {\nforce_tcp\nprefer_udp\n}", lambda p: p.fwd.force_tcp and p.fwd.prefer_udp),
    ("forward . 127.0.0.1:53", lambda p: p.fwd.upstreams[0].address == "127.0.0.1:53"),
    ("forward . 127.0.0.1:8080", lambda p: p.fwd.upstreams[0].address == "127.0.0.1:8080"),
    ("forward . [::1]:53", lambda p: p.fwd.upstreams[0].address == "[::1]:53"),
    ("forward . [2003::1]:53", lambda p: p.fwd.upstreams[0].address == "[2003::1]:53"),
    ("forward . 2003::1 dns://10.0.0.1:5353", lambda p: [u.address for u in p.fwd.upstreams] ==
     ["[2003::1]:53", "10.0.0.1:5353"]),
    ("forward 10.9.3.0/18 127.0.0.1", lambda p: p.from_zone == "0.9.10.in-addr.arpa."),
    ("forward Example.ORG 127.0.0.1", lambda p: p.from_zone == "example.org."),
    ("forward . 127.0.0.1 {\nexpire 30s\n}", lambda p: p.fwd.expire == 30.0),
    ("forward . 127.0.0.1 {\nmax_idle_conns 4\n}", lambda p: p.fwd.max_idle == 4),
    ("forward . 127.0.0.1 {\nmax_connect_attempts 1\n}", lambda p: p.fwd.max_connect_attempts == 1),
    ("forward . 127.0.0.1 {\nmax_concurrent 1000\n}", lambda p: p.fwd.max_concurrent == 1000),
    ("forward . 127.0.0.1 {\npolicy random\n}", lambda p: p.fwd.policy == "random"),
    ("forward . 127.0.0.1 {\npolicy round_robin\n}", lambda p: p.fwd.policy == "round_robin"),
    ("forward . 127.0.0.1 {\npolicy sequential\n}", lambda p: p.fwd.policy == "sequential"),
    ("forward . 127.0.0.1 {\nhealth_check 0.5s\n}", lambda p: (p.fwd.health_rd, p.fwd.health_domain) == (True, ".")),
    ("forward . 127.0.0.1 {\nhealth_check 2s no_rec\n}", lambda p: (p.fwd.health_interval, p.fwd.health_rd) == (2.0, False)),
    ("forward . 127.0.0.1 {\nhealth_check 0.5s no_rec domain example.org\n}",
     lambda p: (p.fwd.health_rd, p.fwd.health_domain) == (False, "example.org.")),
    ("forward . 127.0.0.1 {\nhealth_check 0.5s domain example.org.\n}", lambda p: p.fwd.health_domain == "example.org."),
    ("forward . 127.0.0.1 {\nhealth_check 0.5s domain .\n}", lambda p: p.fwd.health_domain == "."),
    ("forward . 127.0.0.1 {\nnext NXDOMAIN\n}", lambda p: p.next_rcodes == {3}),
    ("forward . 127.0.0.1 {\nnext NXDOMAIN SERVFAIL refused\n}", lambda p: p.next_rcodes == {2, 3, 5}),
    ("forward . 127.0.0.1 {\nnext_on_nodata\n}", lambda p: p.next_on_nodata),
    ("forward . 127.0.0.1 {\nfailover SERVFAIL REFUSED\n}", lambda p: p.fwd.failover == {2, 5}),
    ("forward . 127.0.0.1 {\nfailfast_all_unhealthy_upstreams\n}", lambda p: p.fwd.failfast),
    # CoreDNS accepts TLS options for plain upstreams (they only apply to tls:// ones)
    ("forward . 127.0.0.1 {\ntls_servername dns\n}", lambda p: p.fwd.upstreams[0].server_name is None),
    ("forward . 127.0.0.1 {\ntls\n}", lambda p: isinstance(p.fwd.tls_context, ssl.SSLContext)),
    ("forward . tls://127.0.0.1 {\ntls_servername dns\n}", lambda p: (p.fwd.upstreams[0].port,
                                                                     p.fwd.upstreams[0].server_name) == (853, "dns")),
    ("forward . tls://127.0.0.1", lambda p: p.fwd.upstreams[0].to == "tls://127.0.0.1:853"),
    ("forward . tls://9.9.9.9%dns.quad9.net:10853", lambda p: (p.fwd.upstreams[0].address,
                                                              p.fwd.upstreams[0].server_name) == ("9.9.9.9:10853", "dns.quad9.net")),
])
def test_setup_accepts(text, check):
    assert check(make(text))


def test_fifteen_upstreams_are_the_limit():
    ips = " ".join(f"10.0.0.{i}" for i in range(1, 16))
    assert len(make(f"forward . {ips}").fwd.upstreams) == 15
    assert error(f"forward . {ips} 10.0.0.16") == "Corefile:3: plugin/forward: more than 15 TOs configured: 16"


@pytest.mark.parametrize("text,where,message", [
    ("forward . a27.0.0.1", 3, "not an IP address or file: 'a27.0.0.1'"),
    ("forward .", 3, "Wrong argument count"),
    ("forward", 3, "Wrong argument count"),
    ("forward . 127.0.0.1:99999", 3, "invalid port in '127.0.0.1:99999'"),
    ("forward . dns.example.com", 3, "hostname upstreams are not supported"),
    ("forward . https://127.0.0.1", 3,
     "'https' is not supported as a destination protocol in forward: https://127.0.0.1"),
    ("forward . grpc://127.0.0.1", 3, "'grpc' is not supported as a destination protocol"),
    ("forward . /dev/null", 3, "no valid upstream addresses found"),
    ("forward " + "x" * 64 + " 127.0.0.1", 3, "unable to normalize '" + "x" * 64 + "'"),
    ("forward . 127.0.0.1 {\nblaatl\n}", 4, "unknown property 'blaatl'"),
    ("forward . 127.0.0.1 {\nexcept\n}", 4, "Wrong argument count or unexpected line ending after 'except'"),
    ("forward . 127.0.0.1 {\nforce_tcp yes\n}", 4, "Wrong argument count"),
    ("forward . 127.0.0.1 {\nmax_fails\n}", 4, "Wrong argument count"),
    ("forward . 127.0.0.1 {\nmax_fails -1\n}", 4, "max_fails can't be negative: -1"),
    ("forward . 127.0.0.1 {\nmax_concurrent many\n}", 4, "max_concurrent: invalid number 'many'"),
    ("forward . 127.0.0.1 {\nmax_concurrent -4\n}", 4, "max_concurrent can't be negative: -4"),
    ("forward . 127.0.0.1 {\nexpire -1s\n}", 4, "expire can't be negative"),
    ("forward . 127.0.0.1 {\nexpire soon\n}", 4, "time: invalid duration"),
    ("forward . 127.0.0.1 {\npolicy fastest\n}", 4, "unknown policy 'fastest'"),
    ("forward . 127.0.0.1 {\nhealth_check no_rec\n}", 4, "time: invalid duration"),
    ("forward . 127.0.0.1 {\nhealth_check domain example.org\n}", 4, "time: invalid duration"),
    ("forward . 127.0.0.1 {\nhealth_check 0.5s rec\n}", 4, "health_check: unknown option rec"),
    ("forward . 127.0.0.1 {\nhealth_check 0.5s domain\n}", 4,
     "Wrong argument count or unexpected line ending after 'domain'"),
    ("forward . 127.0.0.1 {\nhealth_check 0.5s domain example..org\n}", 4, "health_check: invalid domain name"),
    ("forward . 127.0.0.1 {\nhealth_check -1s\n}", 4, "health_check can't be negative"),
    ("forward . 127.0.0.1 {\nnext\n}", 4, "Wrong argument count"),
    ("forward . 127.0.0.1 {\nnext INVALID\n}", 4, "INVALID is not a valid rcode"),
    ("forward . 127.0.0.1 {\nnext NXDOMAIN INVALID\n}", 4, "INVALID is not a valid rcode"),
    ("forward . 127.0.0.1 {\nfailfast_all_unhealthy_upstreams false\n}", 4, "Wrong argument count"),
    ("forward . 127.0.0.1 {\nfailover NOERROR\n}", 4, "NoError cannot be used in failover"),
    ("forward . 127.0.0.1 {\nfailover\n}", 4, "Wrong argument count"),
    ("forward . 127.0.0.1 {\ntls a b c d\n}", 4, "Wrong argument count"),
    ("forward . 127.0.0.1 {\ntls /nonexistent/ca.pem\n}", 4, "tls:"),
    ("forward . 127.0.0.1 {\ntls_servername\n}", 4, "Wrong argument count"),
    ("forward . tls://127.0.0.1%a.example {\ntls_servername b.example\n}", 3,
     "both forward ('b.example') and proxy level ('a.example') TLS servernames are set"),
    # CoreDNS options clusterdns does not implement are refused, by name
    ("forward . 127.0.0.1 {\ndoh_method GET\n}", 4, "doh_method: DNS over HTTPS is not supported"),
    ("forward . 127.0.0.1 {\nresolver 10.0.0.1\n}", 4, "resolver: hostname upstreams are not supported"),
])
def test_setup_errors_say_file_line(text, where, message):
    msg = error(text)
    assert msg.startswith(f"Corefile:{where}: plugin/forward: "), msg
    assert message in msg, msg


def test_resolv_conf_files(tmp_path):
    (tmp_path / "resolv.conf").write_text("nameserver 10.10.255.252\nnameserver 10.10.255.253\n")
    (tmp_path / "resolv-ipv6.conf").write_text("nameserver 0388:d254:7aec:6892:9f7f:e93b:5806:1b0f%en0\n")
    (tmp_path / "empty.conf").write_text("search example.org\n")
    p = make(f"forward . {tmp_path / 'resolv.conf'}")
    assert [u.address for u in p.fwd.upstreams] == ["10.10.255.252:53", "10.10.255.253:53"]
    p = make("forward . resolv-ipv6.conf 10.0.0.1", base_dir=str(tmp_path))      # relative: base_dir
    assert [u.address for u in p.fwd.upstreams] == ["[388:d254:7aec:6892:9f7f:e93b:5806:1b0f]:53", "10.0.0.1:53"]
    assert error("forward . empty.conf", base_dir=str(tmp_path)) == (
        "Corefile:3: plugin/forward: no valid upstream addresses found (no nameservers in empty.conf)")
    many = tmp_path / "many.conf"
    many.write_text("".join(f"nameserver 10.1.0.{i}\n" for i in range(16)))
    assert "more than 15 TOs configured: 16" in error(f"forward . {many}")


def test_from_outside_the_block_zones_never_matches(caplog):
    p = make("forward foo.com 127.0.0.1", zones=["example.org."])
    assert "outside the block's zones" in caplog.text
    assert not p.matches("www.example.org.")


# --- serve -----------------------------------------------------------------------------------

async def test_forwards_with_the_clients_id_and_question(upstream):
    p = make(f"forward . 127.0.0.1:{upstream.port}")
    req = Request(query("WWW.Example"), client=("127.0.0.1", 4000))
    before = requests_to(upstream.address)
    reply = await p.serve(req, Next())
    assert reply.header.id == req.record.header.id and str(reply.q.qname) == "WWW.Example."
    assert [str(rr.rdata) for rr in reply.rr] == ["192.0.2.1"]
    assert upstream.received == [("udp", "www.example.", 1)]
    assert requests_to(upstream.address) == before + 1        # coredns_forward_requests_total{to}
    await p.stop()


@pytest.mark.parametrize("options,client_tcp,expect", [
    ("", False, ["udp"]),
    ("", True, ["tcp"]),
    ("force_tcp", False, ["tcp"]),
    ("prefer_udp", True, ["udp"]),
    ("force_tcp\nprefer_udp", True, ["tcp"]),      # force_tcp wins
    ("force_tcp\nprefer_udp", False, ["tcp"]),
])
async def test_transport(upstream, options, client_tcp, expect):
    p = make(f"forward . 127.0.0.1:{upstream.port} {{\n{options}\n}}")
    reply = await p.serve(request("www.example", tcp=client_tcp), Next())
    assert str(reply.rr[0].rdata) == "192.0.2.1"
    assert [r[0] for r in upstream.received] == expect
    await p.stop()


async def test_prefer_udp_retries_a_truncated_answer_over_tcp():
    up = await FakeUpstream(RECORDS, truncate_udp=True).start()
    try:
        p = make(f"forward . 127.0.0.1:{up.port} {{\nprefer_udp\n}}")
        reply = await p.serve(request("big.example", tcp=True), Next())
        assert not reply.header.tc and len(reply.rr) == 60
        assert [r[0] for r in up.received] == ["udp", "tcp"]
        await p.stop()
    finally:
        await up.stop()


async def test_names_outside_from_and_except_names_go_to_next(upstream):
    p = make(f"forward example 127.0.0.1:{upstream.port} {{\nexcept skip.example\n}}", zones=["."])
    nxt = Next()
    other = await p.serve(request("www.other"), nxt)
    assert str(other.rr[0].rdata) == '"next"'
    skipped = await p.serve(request("a.Skip.example"), nxt)
    assert str(skipped.rr[0].rdata) == '"next"'
    assert nxt.seen == ["www.other.", "a.skip.example."] and upstream.received == []
    forwarded = await p.serve(request("www.example"), nxt)       # under FROM, not excepted
    assert str(forwarded.rr[0].rdata) == "192.0.2.1"
    # FROM itself is never excepted (CoreDNS's isAllowedDomain)
    p2 = make(f"forward example 127.0.0.1:{upstream.port} {{\nexcept example\n}}")
    await p2.serve(request("example", "SOA"), nxt)
    assert nxt.seen == ["www.other.", "a.skip.example."]
    assert upstream.received[-1][1] == "example."
    await p.stop()
    await p2.stop()


async def test_several_forwards_chain_in_corefile_order():
    lab = await FakeUpstream({"a.lab.example.": ["a.lab.example. 60 IN A 10.20.0.1"]}).start()
    rest = await FakeUpstream(RECORDS).start()
    try:
        plugins = [make(f"forward lab.example 127.0.0.1:{lab.port}"),
                   make(f"forward . 127.0.0.1:{rest.port}")]
        serve = chain(plugins)
        a = await serve(request("a.lab.example"))
        www = await serve(request("www.example"))
        assert str(a.rr[0].rdata) == "10.20.0.1" and str(www.rr[0].rdata) == "192.0.2.1"
        assert [r[1] for r in lab.received] == ["a.lab.example."]
        assert [r[1] for r in rest.received] == ["www.example."]
        for pl in plugins:
            await pl.stop()
    finally:
        await lab.stop()
        await rest.stop()


class Recording(FakeUpstream):
    """A FakeUpstream that notes its name in a shared log for every query it gets."""

    def __init__(self, label: str, log: list[str], **kw) -> None:
        super().__init__(RECORDS, **kw)
        self.label, self.log = label, log

    def answer(self, wire, proto):
        self.log.append(self.label)
        return super().answer(wire, proto)


async def recorders(n: int, **kw):
    log: list[str] = []
    ups = [await Recording("ABC"[i], log, **kw).start() for i in range(n)]
    return log, ups


async def test_policy_sequential_asks_the_first_first():
    log, ups = await recorders(3)
    try:
        p = make("forward . " + " ".join(f"127.0.0.1:{u.port}" for u in ups) + " {\npolicy sequential\n}")
        for _ in range(4):
            await p.serve(request("www.example"), Next())
        assert log == ["A", "A", "A", "A"]
        await p.stop()
    finally:
        for u in ups:
            await u.stop()


async def test_policy_round_robin_order_is_coredns():
    """CoreDNS's roundRobin moves its counter before choosing: query 1 starts at the second
    upstream, the rest in configured order ([1,0,2]), then [2,0,1], then [0,1,2]. Every upstream
    answers SERVFAIL and `failover SERVFAIL` makes each query walk its whole list."""
    log, ups = await recorders(3, rcode=dns.rcode.SERVFAIL)
    try:
        p = make("forward . " + " ".join(f"127.0.0.1:{u.port}" for u in ups)
                 + " {\npolicy round_robin\nfailover SERVFAIL\n}")
        walks = []
        for _ in range(4):
            reply = await p.serve(request("www.example"), Next())
            assert reply.header.rcode == SERVFAIL      # the last one's answer, all having failed over
            walks.append("".join(log))
            log.clear()
        assert walks == ["BAC", "CAB", "ABC", "BAC"]
        await p.stop()
    finally:
        for u in ups:
            await u.stop()


async def test_policy_random_spreads():
    log, ups = await recorders(3)
    try:
        p = make("forward . " + " ".join(f"127.0.0.1:{u.port}" for u in ups))
        for _ in range(60):
            await p.serve(request("www.example"), Next())
        assert set(log) == {"A", "B", "C"} and len(log) == 60     # (2/3)^60 odds of missing one
        await p.stop()
    finally:
        for u in ups:
            await u.stop()


async def test_failover_tries_the_next_upstream_on_those_rcodes(upstream):
    bad = await FakeUpstream(rcode=dns.rcode.SERVFAIL).start()
    try:
        to = f"127.0.0.1:{bad.port} 127.0.0.1:{upstream.port}"
        p = make(f"forward . {to} {{\npolicy sequential\nfailover SERVFAIL REFUSED\n}}")
        reply = await p.serve(request("www.example"), Next())
        assert str(reply.rr[0].rdata) == "192.0.2.1" and len(bad.received) == 1
        plain = make(f"forward . {to} {{\npolicy sequential\n}}")
        reply = await plain.serve(request("www.example"), Next())
        assert reply.header.rcode == SERVFAIL and len(bad.received) == 2    # passed through
        await p.stop()
        await plain.stop()
    finally:
        await bad.stop()


async def test_max_fails_marks_down_and_the_next_query_skips_it(upstream):
    down = ("127.0.0.1", closed_port())
    p = make(f"forward . 127.0.0.1:{down[1]} 127.0.0.1:{upstream.port} {{\npolicy sequential\n"
             "health_check 30s\n}")
    before = requests_to(down)
    for _ in range(5):
        reply = await p.serve(request("www.example"), Next())
        assert str(reply.rr[0].rdata) == "192.0.2.1"
    assert requests_to(down) == before + 2          # two failures (max_fails 2), then skipped
    assert not p.fwd.healthy(p.fwd.upstreams[0]) and len(upstream.received) == 5
    await p.stop()


async def test_max_fails_0_never_marks_down(upstream):
    down = ("127.0.0.1", closed_port())
    p = make(f"forward . 127.0.0.1:{down[1]} 127.0.0.1:{upstream.port} {{\npolicy sequential\nmax_fails 0\n}}")
    before = requests_to(down)
    for _ in range(5):
        await p.serve(request("www.example"), Next())
    assert requests_to(down) == before + 5          # still asked first every time
    assert p.fwd.healthy(p.fwd.upstreams[0]) and p.fwd.upstreams[0]._probe is None   # never probed
    await p.stop()


class Dropping(FakeUpstream):
    """Drops the first `drop` queries; notes (name, RD, proto) of each query it gets."""

    def __init__(self, drop: int = 1, **kw) -> None:
        super().__init__(RECORDS, **kw)
        self.drop, self.seen = drop, []

    def answer(self, wire, proto):
        m = dns.message.from_wire(wire)
        self.seen.append((m.question[0].name.to_text(), bool(m.flags & dns.flags.RD), proto))
        if self.drop:
            self.drop -= 1
            return None
        return super().answer(wire, proto)


async def probes(up: Dropping, want: int = 1) -> list:
    for _ in range(100):
        found = [s for s in up.seen if s[0] != "www.example."]
        if len(found) >= want:
            return found
        await asyncio.sleep(0.02)
    return [s for s in up.seen if s[0] != "www.example."]


@pytest.mark.parametrize("options,name,rd,proto", [
    ("health_check 0.05s", ".", True, "udp"),
    ("health_check 0.05s no_rec", ".", False, "udp"),
    ("health_check 0.05s domain example.org", "example.org.", True, "udp"),
    ("health_check 0.05s no_rec domain example.org\nforce_tcp", "example.org.", False, "tcp"),
])
async def test_health_check_probe_name_rd_and_transport(options, name, rd, proto):
    up = await Dropping().start()
    try:
        p = make(f"forward . 127.0.0.1:{up.port} {{\nmax_fails 1\n{options}\n}}")
        p.fwd.read_timeout = 0.2
        with pytest.raises(PluginError) as exc:
            await p.serve(request("www.example"), Next())      # dropped: the upstream is down
        assert exc.value.rcode == SERVFAIL and f"127.0.0.1:{up.port}" in exc.value.reason
        found = await probes(up)
        assert found[0] == (name, rd, proto)
        for _ in range(50):                                    # the probe answered: healthy again
            if p.fwd.healthy(p.fwd.upstreams[0]):
                break
            await asyncio.sleep(0.02)
        assert p.fwd.healthy(p.fwd.upstreams[0])
        reply = await p.serve(request("www.example"), Next())
        assert str(reply.rr[0].rdata) == "192.0.2.1"
        await p.stop()
    finally:
        await up.stop()


async def test_every_upstream_failing_is_servfail_with_the_reason():
    ports = [closed_port(), closed_port()]
    p = make(f"forward . 127.0.0.1:{ports[0]} 127.0.0.1:{ports[1]} {{\nhealth_check 30s\n}}")
    with pytest.raises(PluginError) as exc:
        await p.serve(request("www.example"), Next())
    assert exc.value.rcode == SERVFAIL
    assert exc.value.reason.startswith("plugin/forward: .: 127.0.0.1:")
    assert "ConnectionRefusedError" in exc.value.reason
    await p.stop()


async def test_failfast_all_unhealthy_upstreams():
    ports = [closed_port(), closed_port()]
    for failfast in (True, False):
        p = make(f"forward . 127.0.0.1:{ports[0]} 127.0.0.1:{ports[1]} {{\nmax_fails 1\nhealth_check 30s\n"
                 + ("failfast_all_unhealthy_upstreams\n" if failfast else "") + "}")
        with pytest.raises(PluginError):
            await p.serve(request("www.example"), Next())      # both fail once: both down
        assert not any(p.fwd.healthy(u) for u in p.fwd.upstreams)
        before = [requests_to(("127.0.0.1", port)) for port in ports]
        broken = metrics.healthcheck_broken._value.get()
        with pytest.raises(PluginError) as exc:
            await p.serve(request("www.example"), Next())
        after = [requests_to(("127.0.0.1", port)) for port in ports]
        if failfast:       # SERVFAIL at once, nobody asked
            assert after == before and "no healthy upstreams" in exc.value.reason
            assert metrics.healthcheck_broken._value.get() == broken + 1
        else:              # CoreDNS's default: health checking assumed broken, try them anyway
            assert sum(after) == sum(before) + 2
        await p.stop()


async def test_max_concurrent_refuses_beyond():
    slow = await FakeUpstream(RECORDS, delay=0.3).start()
    try:
        p = make(f"forward . 127.0.0.1:{slow.port} {{\nmax_concurrent 1\n}}")
        rejects = metrics.forward_rejects._value.get()
        results = await asyncio.gather(p.serve(request("www.example"), Next()),
                                       p.serve(request("www.example"), Next()), return_exceptions=True)
        answered = [r for r in results if isinstance(r, dnslib.DNSRecord)]
        refused = [r for r in results if isinstance(r, PluginError)]
        assert len(answered) == 1 and str(answered[0].rr[0].rdata) == "192.0.2.1"
        assert len(refused) == 1 and refused[0].rcode == REFUSED
        assert "concurrent queries exceeded maximum 1" in refused[0].reason
        assert metrics.forward_rejects._value.get() == rejects + 1
        assert p.fwd.healthy(p.fwd.upstreams[0]) and p.fwd.upstreams[0].fails == 0   # not a failure
        await p.serve(request("www.example"), Next())       # the slot is free again
        await p.stop()
    finally:
        await slow.stop()


async def test_next_rcode_hands_the_query_to_the_next_forward():
    first = await FakeUpstream({}).start()                   # NXDOMAIN for everything
    second = await FakeUpstream(RECORDS).start()
    try:
        a = make(f"forward . 127.0.0.1:{first.port} {{\nnext NXDOMAIN\n}}")
        b = make(f"forward . 127.0.0.1:{second.port}")
        reply = await chain([a, b])(request("www.example"))
        assert str(reply.rr[0].rdata) == "192.0.2.1"
        assert len(first.received) == 1 and len(second.received) == 1
        # no forward after it: the setting is ignored, the upstream's NXDOMAIN stands
        reply = await chain([a])(request("www.example"))
        assert reply.header.rcode == dnslib.RCODE.NXDOMAIN
        # without `next`, NXDOMAIN is the answer and the next forward is not asked
        c = make(f"forward . 127.0.0.1:{first.port}")
        reply = await chain([c, b])(request("www.example"))
        assert reply.header.rcode == dnslib.RCODE.NXDOMAIN and len(second.received) == 1
        # next_on_nodata: NOERROR without answers goes on
        d = make(f"forward . 127.0.0.1:{second.port} {{\nnext_on_nodata\n}}")
        e = make(f"forward . 127.0.0.1:{first.port}")
        reply = await chain([d, e])(request("www.example", "TXT"))
        assert reply.header.rcode == dnslib.RCODE.NXDOMAIN and len(first.received) == 4
        for pl in (a, b, c, d, e):
            await pl.stop()
    finally:
        await first.stop()
        await second.stop()


class Connections(FakeUpstream):
    """Counts TCP connections; with `once`, closes each after its first answer."""

    def __init__(self, once: bool = False) -> None:
        super().__init__(RECORDS)
        self.connections, self.once = 0, once

    async def _handle(self, reader, writer):
        self.connections += 1
        if not self.once:
            return await super()._handle(reader, writer)
        import struct
        size = struct.unpack("!H", await reader.readexactly(2))[0]
        out = self.answer(await reader.readexactly(size), "tcp")
        writer.write(struct.pack("!H", len(out)) + out)
        await writer.drain()
        writer.close()


async def test_tcp_connections_are_reused_until_expire():
    up = await Connections().start()
    try:
        p = make(f"forward . 127.0.0.1:{up.port} {{\nforce_tcp\nexpire 0.3s\n}}")
        for _ in range(3):
            await p.serve(request("www.example"), Next())
        assert up.connections == 1 and len(up.received) == 3
        await asyncio.sleep(0.4)                               # idle past expire: a new one
        await p.serve(request("www.example"), Next())
        assert up.connections == 2
        await p.stop()
        fresh = make(f"forward . 127.0.0.1:{up.port} {{\nforce_tcp\nexpire 0s\n}}")
        for _ in range(2):
            await fresh.serve(request("www.example"), Next())
        assert up.connections == 4                              # expire 0: one per query
        await fresh.stop()
    finally:
        await up.stop()


async def test_an_idle_connection_the_upstream_closed_is_replaced():
    up = await Connections(once=True).start()
    try:
        p = make(f"forward . 127.0.0.1:{up.port} {{\nforce_tcp\n}}")
        for _ in range(3):
            reply = await p.serve(request("www.example"), Next())
            assert str(reply.rr[0].rdata) == "192.0.2.1"
        assert up.connections == 3 and p.fwd.upstreams[0].fails == 0     # never counted as failure
        await p.stop()
    finally:
        await up.stop()


# --- DNS over TLS ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("the openssl CLI is needed to make the test certificate")
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                    "-keyout", str(d / "key.pem"), "-out", str(d / "cert.pem"),
                    "-subj", "/CN=dns.test.local", "-addext", "subjectAltName=DNS:dns.test.local"],
                   check=True, capture_output=True)
    return d


async def start_dot(certs, up: FakeUpstream, client_auth: bool = False):
    """A DNS-over-TLS server on loopback: FakeUpstream's TCP handler behind Python's ssl; the
    handshakes it completed are counted in up.connections. With client_auth it requires a
    client certificate signed by the test's CA (the same self-signed certificate)."""
    sctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    sctx.load_cert_chain(certs / "cert.pem", certs / "key.pem")
    if client_auth:
        sctx.verify_mode = ssl.CERT_REQUIRED
        sctx.load_verify_locations(certs / "cert.pem")
    up.connections = 0  # type: ignore[attr-defined]

    async def handle(reader, writer):
        up.connections += 1  # type: ignore[attr-defined]
        await up._handle(reader, writer)
    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=sctx)
    up.port = server.sockets[0].getsockname()[1]
    return server


@pytest.fixture
async def dot_upstream(certs):
    up = FakeUpstream(RECORDS)
    server = await start_dot(certs, up)
    yield up
    server.close()
    await server.wait_closed()


async def test_dot_verifies_the_server_name_against_the_ca(certs, dot_upstream):
    ca = certs / "cert.pem"
    p = make(f"forward . tls://127.0.0.1:{dot_upstream.port} {{\ntls {ca}\ntls_servername dns.test.local\n}}")
    assert p.fwd.upstreams[0].tls and f"tls {ca}" in p.describe()
    for _ in range(2):
        reply = await p.serve(request("www.example"), Next())
        assert str(reply.rr[0].rdata) == "192.0.2.1"
    assert [r[0] for r in dot_upstream.received] == ["tcp", "tcp"]    # DNS over the TLS stream
    assert dot_upstream.connections == 1                               # one session, reused
    await p.stop()
    # the per-upstream form: tls://IP%NAME:PORT
    p = make(f"forward . tls://127.0.0.1%dns.test.local:{dot_upstream.port} {{\ntls {ca}\n}}")
    assert str((await p.serve(request("www.example"), Next())).rr[0].rdata) == "192.0.2.1"
    await p.stop()


@pytest.mark.parametrize("options,why", [
    ("tls {ca}\ntls_servername other.test.local", "Hostname mismatch"),       # wrong name
    ("tls {ca}", "IP address mismatch"),                                       # no name: the IP is checked
    ("tls_servername dns.test.local", "certificate verify failed"),            # system CAs: self-signed
])
async def test_dot_fails_when_the_certificate_does_not_match(certs, dot_upstream, options, why):
    opts = options.format(ca=certs / "cert.pem")
    p = make(f"forward . tls://127.0.0.1:{dot_upstream.port} {{\n{opts}\nhealth_check 30s\n}}")
    with pytest.raises(PluginError) as exc:
        await p.serve(request("www.example"), Next())
    assert exc.value.rcode == SERVFAIL and why in exc.value.reason, exc.value.reason
    assert dot_upstream.received == []
    await p.stop()


# --- the real Corefiles ----------------------------------------------------------------------

REAL = __import__("pathlib").Path(__file__).parent / "real"


def real_forwards(name: str, tmp_path) -> list[ForwardPlugin]:
    """Every top-level `forward` of a real Corefile set up (pillars filled with an IP, the node's
    /etc/resolv.conf replaced by one of the test's own so the test runs anywhere)."""
    import re

    from clusterdns.corefile.parse import parse_text
    conf = tmp_path / "resolv.conf"
    conf.write_text("nameserver 10.255.255.53\n")
    text = (REAL / name).read_text()
    text = re.sub(r"__PILLAR__[A-Z_]+__", "10.0.0.10", text).replace("/etc/resolv.conf", str(conf))
    out = []
    for block in parse_text(text, name):
        for d in block.directives:
            if d.name == "forward":
                out.append(setup(d, SetupContext(zones=["."])))
    return out


@pytest.mark.parametrize("name", sorted(p.name for p in REAL.glob("*.corefile")))
def test_every_real_corefile_forward_sets_up(name, tmp_path):
    found = real_forwards(name, tmp_path)
    assert found                       # each of them forwards somewhere
    for p in found:
        assert p.fwd.upstreams and p.describe().startswith(f"{p.from_zone} ")


def test_real_corefile_options_are_read(tmp_path):
    (kubeadm,) = real_forwards("kubeadm.corefile", tmp_path)
    assert kubeadm.fwd.max_concurrent == 1000 and [u.address for u in kubeadm.fwd.upstreams] == ["10.255.255.53:53"]
    assert all(p.fwd.force_tcp for p in real_forwards("nodelocaldns.corefile", tmp_path)[:3])
    aks = real_forwards("aks-localdns.corefile", tmp_path)
    assert len(aks) == 4 and all(p.fwd.policy == "sequential" for p in aks)
    assert [p.fwd.prefer_udp for p in aks] == [True, False, True, True]
    assert [p.fwd.max_concurrent for p in aks] == [1000, 1000, 1000, 2000]


async def test_dot_health_probe_goes_over_tls(certs):
    up = Dropping()
    server = await start_dot(certs, up)
    try:
        p = make(f"forward . tls://127.0.0.1:{up.port} {{\ntls {certs / 'cert.pem'}\n"
                 "tls_servername dns.test.local\nmax_fails 1\nhealth_check 0.05s domain example.org\n}")
        p.fwd.read_timeout = 0.3
        with pytest.raises(PluginError):
            await p.serve(request("www.example"), Next())       # dropped: down
        assert (await probes(up))[0] == ("example.org.", True, "tcp")
        for _ in range(50):
            if p.fwd.healthy(p.fwd.upstreams[0]):
                break
            await asyncio.sleep(0.02)
        assert p.fwd.healthy(p.fwd.upstreams[0])
        assert str((await p.serve(request("www.example"), Next())).rr[0].rdata) == "192.0.2.1"
        await p.stop()
    finally:
        server.close()
        await server.wait_closed()


# --- over real sockets, in a served Corefile (tests/corefile/cfserve.py) -----------------------

async def test_stub_domain_block_beside_the_default_block(tmp_path):
    from tests.corefile.cfserve import CorefileServer, answers
    consul = await FakeUpstream({"web.service.consul.local.": ["web.service.consul.local. 30 IN A 10.9.9.9"]}).start()
    default = await FakeUpstream(RECORDS).start()
    text = ("consul.local:{PORT} {\n    bind 127.0.0.1\n    forward . 127.0.0.1:%d\n}\n"
            ".:{PORT} {\n    bind 127.0.0.1\n    kubernetes cluster.local in-addr.arpa ip6.arpa\n"
            "    forward . 127.0.0.1:%d\n}\n") % (consul.port, default.port)
    try:
        async with CorefileServer(text, tmp_path) as s:
            for tcp in (False, True):
                r = await s.ask("WEB.Service.consul.local", "A", tcp=tcp)
                assert answers(r) == ["WEB.Service.consul.local. A 10.9.9.9"]       # the client's spelling
                r = await s.ask("www.example", "A", tcp=tcp)
                assert answers(r) == ["www.example. A 192.0.2.1"]
                r = await s.ask("testapp-svc.testapp.svc.cluster.local", "A", tcp=tcp)
                assert answers(r) == ["testapp-svc.testapp.svc.cluster.local. A 172.20.36.232"]
            # each upstream got only its own names, over the client's transport
            assert consul.received == [("udp", "web.service.consul.local.", 1), ("tcp", "web.service.consul.local.", 1)]
            assert default.received == [("udp", "www.example.", 1), ("tcp", "www.example.", 1)]
            r = await s.ask("missing.consul.local", "A")
            assert r.rcode() == dns.rcode.NXDOMAIN and len(default.received) == 2    # the stub's NXDOMAIN
            await consul.stop()                                   # the stub domain's upstream is gone
            r = await s.ask("web.service.consul.local", "A")
            assert r.rcode() == dns.rcode.SERVFAIL
            assert answers(await s.ask("www.example", "A")) == ["www.example. A 192.0.2.1"]
    finally:
        await consul.stop()
        await default.stop()


async def test_forwards_chained_in_one_served_block(tmp_path):
    from tests.corefile.cfserve import CorefileServer, answers
    lab = await FakeUpstream({"a.lab.example.": ["a.lab.example. 60 IN A 10.20.0.1"]}).start()
    rest = await FakeUpstream(RECORDS).start()
    text = (".:{PORT} {\n    bind 127.0.0.1\n    forward lab.example 127.0.0.1:%d\n"
            "    forward . 127.0.0.1:%d {\n        force_tcp\n    }\n}\n") % (lab.port, rest.port)
    try:
        async with CorefileServer(text, tmp_path) as s:
            assert answers(await s.ask("a.lab.example", "A")) == ["a.lab.example. A 10.20.0.1"]
            assert answers(await s.ask("www.example", "A")) == ["www.example. A 192.0.2.1"]
            assert lab.received == [("udp", "a.lab.example.", 1)]
            assert rest.received == [("tcp", "www.example.", 1)]               # force_tcp
    finally:
        await lab.stop()
        await rest.stop()


def test_a_bad_forward_in_a_corefile_is_refused_with_file_line(tmp_path):
    from clusterdns.config import Config
    from clusterdns.corefile.build import load_corefile
    path = tmp_path / "Corefile"
    path.write_text(".:53 {\n    forward . 127.0.0.1 {\n        max_fails many\n    }\n}\n")
    with pytest.raises(CorefileError) as exc:
        load_corefile(str(path), Config.from_options("dns", corefile=str(path)))
    assert str(exc.value).startswith(f"{path}:3: plugin/forward: max_fails: invalid number 'many'")


async def test_dot_client_certificate_with_tls_cert_key_ca(certs):
    up = FakeUpstream(RECORDS)
    server = await start_dot(certs, up, client_auth=True)
    c, k = certs / "cert.pem", certs / "key.pem"
    try:
        p = make(f"forward . tls://127.0.0.1:{up.port} {{\ntls {c} {k} {c}\ntls_servername dns.test.local\n}}")
        assert str((await p.serve(request("www.example"), Next())).rr[0].rdata) == "192.0.2.1"
        await p.stop()
        # without a client certificate the server ends the handshake: SERVFAIL, never an answer
        p = make(f"forward . tls://127.0.0.1:{up.port} {{\ntls {c}\ntls_servername dns.test.local\n"
                 "health_check 30s\n}")
        with pytest.raises(PluginError) as exc:
            await p.serve(request("www.example"), Next())
        assert exc.value.rcode == SERVFAIL and len(up.received) == 1
        await p.stop()
    finally:
        server.close()
        await server.wait_closed()
