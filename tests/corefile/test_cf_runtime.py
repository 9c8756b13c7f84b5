"""Server blocks at run time, over real sockets: which block a query goes to, REFUSED when
none (or an empty one) matches, the kubernetes plugin's answers and the fast path, setup
errors with FILE:LINE, the reload of a changed and of a broken Corefile."""
from __future__ import annotations

import dns.flags
import dns.message
import dns.rcode
import pytest

from clusterdns.config import Config
from clusterdns.corefile.build import load_corefile, prepare
from clusterdns.corefile.reloader import Reloader
from clusterdns.corefile.syntax import CorefileError
from tests import demo
from tests.common import sample
from tests.corefile.cfserve import CorefileServer, answers

SVC = "testapp-svc.testapp.svc.cluster.local."

KUBE = """.:{PORT} {
    loop
    bind 127.0.0.1
    kubernetes cluster.local in-addr.arpa ip6.arpa {
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
        ttl 30
    }
}
"""


async def test_kubernetes_block_answers_from_state(tmp_path):
    async with CorefileServer(KUBE, tmp_path) as s:
        for name in (SVC, SVC.upper()):
            r = await s.ask(name, "A")
            assert r.rcode() == dns.rcode.NOERROR
            assert r.flags & dns.flags.AA
            assert [rd.to_text() for rrset in r.answer for rd in rrset] == ["172.20.36.232"]
            assert r.answer[0].ttl == 30                       # the plugin's ttl, not the flag's 5
        r = await s.ask("nosuch.testapp.svc.cluster.local", "A")
        assert r.rcode() == dns.rcode.NXDOMAIN
        r = await s.ask(SVC, "A", tcp=True)
        assert answers(r) == [f"{SVC} A 172.20.36.232"]


async def test_a_name_the_block_passes_on_with_no_next_plugin_is_servfail(tmp_path):
    async with CorefileServer(KUBE, tmp_path) as s:
        r = await s.ask("example.com", "A")
        assert r.rcode() == dns.rcode.SERVFAIL
        # fallthrough in-addr.arpa: a reverse name the cluster does not have goes on, to nothing
        r = await s.ask("4.3.2.1.in-addr.arpa", "PTR")
        assert r.rcode() == dns.rcode.SERVFAIL
        r = await s.ask("232.36.20.172.in-addr.arpa", "PTR")
        assert r.rcode() == dns.rcode.NOERROR and "testapp-svc.testapp.svc.cluster.local." in answers(r)[0]


async def test_longest_zone_wins_and_no_match_is_refused(tmp_path):
    text = """cluster.local:{PORT} {
    bind 127.0.0.1
    kubernetes
}
svc.cluster.local:{PORT} {
    bind 127.0.0.1
    loop
}
example.org:{PORT} {
    bind 127.0.0.1
}
"""
    async with CorefileServer(text, tmp_path) as s:
        # svc.cluster.local's block has no answering plugin but loop: SERVFAIL (no next plugin)
        r = await s.ask(SVC, "A")
        assert r.rcode() == dns.rcode.SERVFAIL
        # the cluster.local block answers what is not under svc.cluster.local
        r = await s.ask("10-161-33-1.testapp.pod.cluster.local", "A")
        assert r.rcode() == dns.rcode.NOERROR and answers(r)[0].endswith("10.161.33.1")
        # a block with no plugins at all (only bind): REFUSED
        r = await s.ask("www.example.org", "A")
        assert r.rcode() == dns.rcode.REFUSED
        # no zone matches (label-wise: foocluster.local is not under cluster.local): REFUSED
        for name in ("example.com", "foocluster.local", "."):
            r = await s.ask(name, "A")
            assert r.rcode() == dns.rcode.REFUSED, name
            assert not r.flags & dns.flags.AA


async def test_empty_block_is_refused(tmp_path):
    async with CorefileServer("example.org:{PORT} {\n}\n", tmp_path) as s:
        r = await s.ask("example.org", "A")
        assert r.rcode() == dns.rcode.REFUSED
        r = await s.ask("a.example.org", "AAAA", tcp=True)
        assert r.rcode() == dns.rcode.REFUSED


async def test_fast_path_answers_repeated_cluster_questions_byte_for_byte(tmp_path):
    async with CorefileServer(KUBE, tmp_path) as s:
        listener = next(iter(s.corefile.listeners.values()))
        wire = dns.message.make_query(SVC, "A", use_edns=0).to_wire()
        first = listener.fast(wire, False)     # built here the first time, or left to resolve()
        slow = await listener.resolve(wire, "127.0.0.1", False)
        fast = listener.fast(wire, False)
        assert fast is not None, "the memo must answer a repeated cluster question"
        assert fast == slow
        assert first is None or first == slow
        # a name outside the kubernetes zones never takes the fast path
        other = dns.message.make_query("example.com", "A").to_wire()
        assert listener.fast(other, False) is None


async def test_class_chaos_and_bad_packets(tmp_path):
    async with CorefileServer(KUBE, tmp_path) as s:
        listener = next(iter(s.corefile.listeners.values()))
        q = dns.message.make_query(SVC, "A", rdclass="CH")
        reply = dns.message.from_wire(await listener.resolve(q.to_wire(), "127.0.0.1", False))
        assert reply.rcode() == dns.rcode.REFUSED
        assert await listener.resolve(b"\x00\x01", "127.0.0.1", False) is None        # no header: dropped
        bad = await listener.resolve(b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\x03abc", "127.0.0.1", False)
        assert bad is not None and bad[3] & 0xF == dns.rcode.FORMERR and bad[:2] == b"\x12\x34"


def _with_headless(n: int):
    from clusterdns.model import Endpoint, EndpointPort, EndpointSlice, Service
    eps = tuple(Endpoint((f"10.8.{i // 250}.{i % 250 + 1}",)) for i in range(n))
    return demo.demo_records() + [
        ("Service", Service("big", "hl", headless=True)),
        ("EndpointSlice", EndpointSlice("big", "hl-1", "hl", "IPv4", eps, (EndpointPort("http", "TCP", 8080),)))]


async def test_edns_size_and_truncation(tmp_path):
    async with CorefileServer(KUBE, tmp_path, records=_with_headless(100)) as s:
        # a headless Service's SRV set: more than 512 bytes, so TC over plain UDP, whole over TCP
        name = "_http._tcp.hl.big.svc.cluster.local"
        r = await s.ask(name, "SRV", use_edns=False)
        t = await s.ask(name, "SRV", tcp=True)
        assert t.rcode() == dns.rcode.NOERROR and len(t.to_wire()) > 512
        assert r.flags & dns.flags.TC and len(r.to_wire()) <= 512
        assert len(answers(t)) > len(answers(r))
        r = await s.ask(SVC, "A", use_edns=0, payload=4096)
        assert r.edns == 0 and r.payload == 1232          # never more than 1232 advertised


@pytest.mark.parametrize("text, where, words", [
    (".:53 {\n    loop\n    nosuchplugin\n}\n", 3, "Unknown directive 'nosuchplugin'"),
    (".:53 {\n    kubernetes cluster.local\n    kubernetes cluster.local\n}\n", 3, "only be used once"),
    (".:53 {\n    kubernetes cluster.local {\n        pods sometimes\n    }\n}\n", 3, "pods"),
    (".:53 {\n    kubernetes cluster.local {\n        ttl 3601\n    }\n}\n", 3, "ttl"),
    (".:53 {\n    kubernetes cluster.local {\n        upstream\n    }\n}\n", 3, "removed in CoreDNS 1.7"),
    (".:53 {\n    kubernetes cluster.local {\n        colour blue\n    }\n}\n", 3, "unknown property 'colour'"),
    (".:53 {\n    dnssec\n}\n", 2, "not supported by clusterdns"),
    (".:53 {\n    loop\n}\n.:53 {\n    loop\n}\n", 4, "cannot serve dns://.:53 - it is already defined"),
    (".:53 {\n    health :8080\n}\ncluster.local:53 {\n    health :8081\n}\n", 5, "health"),
    (".:53 {\n    reload 1s\n}\n", 2, "greater or equal to 2s"),
    (".:53 {\n    bind 127.0.0.1\n}\nexample.org:53 {\n    loop\n}\n", 4, "must all use bind or none"),
])
def test_setup_errors_name_file_and_line(tmp_path, text, where, words):
    path = tmp_path / "Corefile"
    path.write_text(text)
    with pytest.raises(CorefileError) as exc:
        load_corefile(str(path), Config.from_options("dns", corefile=str(path)))
    msg = str(exc.value)
    assert msg.startswith(f"{path}:{where}: "), msg
    assert words in msg


def test_flags_the_corefile_says_are_refused(tmp_path):
    from clusterdns.config import load
    from clusterdns.errors import ConfigError
    path = tmp_path / "Corefile"
    path.write_text(KUBE.replace("{PORT}", "5300"))
    for flag in (["--listen", "127.0.0.1:53"], ["--upstream", "1.1.1.1"], ["--cache-size", "10"],
                 ["--metrics-listen", ":9153"], ["--health-listen", ":8080"]):
        with pytest.raises(ConfigError, match="with --corefile the Corefile says this"):
            load(["dns", "--corefile", str(path), *flag])
    cfg = load(["dns", "--corefile", str(path), "--ttl", "7"])
    with pytest.raises(CorefileError, match="--ttl: with --corefile the Corefile's kubernetes plugin says this"):
        prepare(cfg)
    cfg, = [load(["dns", "--corefile", str(path)])]
    cf, effective = prepare(cfg)
    assert effective.listen_addresses() == [("127.0.0.1", 5300)]
    assert effective.agent.health_listen == "none" and effective.agent.metrics_listen == "none"


async def test_reload_serves_a_changed_corefile_and_keeps_the_running_one_when_broken(tmp_path):
    text = KUBE.replace("    loop\n", "    loop\n    reload 2s\n")
    async with CorefileServer(text, tmp_path) as s:
        served = {"corefile": s.corefile}

        async def apply(new) -> None:
            from clusterdns.dns.server import DnsService
            await s.service.stop()
            s.service.detach()
            s.service = DnsService(s.cfg, s.store, corefile=new)
            await s.service.start()
            served["corefile"] = new

        reloader = Reloader(s.cfg, s.corefile, apply)
        assert not await reloader.check()                 # unchanged: nothing done
        r = await s.ask(SVC, "A")
        assert r.answer[0].ttl == 30
        s.path.write_text(s.path.read_text().replace("ttl 30", "ttl 12"))
        assert await reloader.check()
        r = await s.ask(SVC, "A")
        assert r.answer[0].ttl == 12
        failed = sample("coredns_reload_failed_total")
        s.path.write_text(s.path.read_text().replace("pods insecure", "pods sometimes"))
        assert not await reloader.check()
        assert sample("coredns_reload_failed_total") == failed + 1
        r = await s.ask(SVC, "A")                         # the running configuration keeps serving
        assert r.answer[0].ttl == 12 and served["corefile"] is reloader.current


def test_bind_takes_an_interface_name_and_a_duplicate_through_it_is_refused(tmp_path):
    path = tmp_path / "Corefile"
    path.write_text(".:5300 {\n    bind lo\n    loop\n}\n")
    cf = load_corefile(str(path), Config.from_options("dns", corefile=str(path)))
    assert ("127.0.0.1", 5300) in cf.listeners
    # lo and 127.0.0.1 are one address: the second block serves a zone already defined there
    path.write_text(".:5300 {\n    bind lo\n    loop\n}\n.:5300 {\n    bind 127.0.0.1\n    loop\n}\n")
    with pytest.raises(CorefileError, match=r"Corefile:5: cannot serve dns://\.:5300 on 127\.0\.0\.1 - it is already defined"):
        load_corefile(str(path), Config.from_options("dns", corefile=str(path)))
