"""hosts and template over real sockets, in the Corefiles that ship them: k3s's (NodeHosts
served, other names falling through to kubernetes and forward) and AKS's (the NXDOMAIN
templates in front of forward), asked with dnspython."""
from __future__ import annotations

import asyncio
import os
import re
from pathlib import Path

import dns.edns
import dns.flags
import dns.rcode
import pytest

from tests.corefile.cfserve import CorefileServer, answers
from tests.dns.dnskit import FakeUpstream

REAL = Path(__file__).parent / "real"
SVC = "testapp-svc.testapp.svc.cluster.local."


def localized(name: str, upstream: int) -> str:
    """A real Corefile made to run on loopback: its .:53 on {PORT} bound to 127.0.0.1, forward to
    the stub upstream; health, ready and prometheus (fixed ports of their own) left out."""
    text = (REAL / name).read_text()
    text = re.sub(r"\n\s*health \{[^}]*\}", "", text)
    text = re.sub(r"\n\s*(health|ready|prometheus)\b[^\n]*", "", text)
    text = text.replace(".:53 {", ".:{PORT} {\n    bind 127.0.0.1", 1)
    return text.replace("forward . /etc/resolv.conf", f"forward . 127.0.0.1:{upstream}")


@pytest.fixture
async def upstream():
    up = await FakeUpstream({"example.com.": ["example.com. 300 IN A 93.184.216.34"],
                             "a.b.c.internal.cloudapp.net.": ["a.b.c.internal.cloudapp.net. 300 IN A 10.1.0.4"]}).start()
    yield up
    await up.stop()


NODE_HOSTS = "172.18.0.2 k3s-server\n172.18.0.3 k3s-agent-1\n"


async def test_k3s_corefile_serves_node_hosts_and_passes_other_names_on(tmp_path, upstream):
    text = localized("k3s.corefile", upstream.port).replace("/etc/coredns/NodeHosts", "NodeHosts")
    assert "hosts NodeHosts {" in text and "ttl 60" in text
    async with CorefileServer(text, tmp_path, files={"NodeHosts": NODE_HOSTS}) as s:
        for name in ("k3s-server.", "K3S-Server."):
            r = await s.ask(name, "A")
            assert r.rcode() == dns.rcode.NOERROR and r.flags & dns.flags.AA
            # hosts' ttl 60, capped by the block's `cache 30` as CoreDNS's cache caps replies
            assert answers(r) == ["k3s-server. A 172.18.0.2"] and r.answer[0].ttl == 30
        r = await s.ask("2.0.18.172.in-addr.arpa.", "PTR")
        assert answers(r) == ["2.0.18.172.in-addr.arpa. PTR k3s-server."]
        r = await s.ask("k3s-agent-1.", "AAAA", tcp=True)            # listed, no IPv6: NODATA
        assert r.rcode() == dns.rcode.NOERROR and r.answer == []
        asked_before = len(upstream.received)
        # not in NodeHosts: fallthrough to kubernetes (cluster names) and forward (the rest)
        r = await s.ask(SVC, "A")
        assert answers(r) == [f"{SVC} A 172.20.36.232"]
        r = await s.ask("example.com.", "A")
        assert answers(r) == ["example.com. A 93.184.216.34"]
        assert ("udp", "example.com.", 1) in upstream.received[asked_before:]
        assert not any(q[1].startswith("k3s-") for q in upstream.received)


async def test_a_changed_hosts_file_is_served_without_a_restart(tmp_path, upstream):
    text = (".:{PORT} {\n    bind 127.0.0.1\n    hosts nodes {\n        reload 50ms\n        fallthrough\n    }\n"
            f"    forward . 127.0.0.1:{upstream.port}\n}}\n")
    async with CorefileServer(text, tmp_path, files={"nodes": NODE_HOSTS}) as s:
        assert answers(await s.ask("k3s-server.", "A")) == ["k3s-server. A 172.18.0.2"]
        assert (await s.ask("k3s-agent-2.", "A")).rcode() == dns.rcode.NXDOMAIN     # the stub's answer
        path = tmp_path / "nodes"
        path.write_text(NODE_HOSTS + "172.18.0.4 k3s-agent-2\n")
        st = os.stat(path)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
        for _ in range(100):
            r = await s.ask("k3s-agent-2.", "A")
            if answers(r):
                break
            await asyncio.sleep(0.05)
        assert answers(r) == ["k3s-agent-2. A 172.18.0.4"]


async def test_a_hosts_only_block_answers_servfail_for_names_it_does_not_list(tmp_path):
    # coredns#2482: no fallthrough, no SOA to make an NXDOMAIN: SERVFAIL
    text = "example.org:{PORT} {\n    bind 127.0.0.1\n    hosts {\n        10.0.0.1 example.org\n    }\n}\n"
    async with CorefileServer(text, tmp_path) as s:
        assert answers(await s.ask("example.org.", "A")) == ["example.org. A 10.0.0.1"]
        assert (await s.ask("www.example.org.", "A")).rcode() == dns.rcode.SERVFAIL


async def test_aks_corefile_templates_answer_nxdomain_before_forward(tmp_path, upstream):
    text = localized("aks.corefile", upstream.port)
    assert "template ANY ANY reddog.microsoft.com" in text
    async with CorefileServer(text, tmp_path) as s:
        for name, qtype in (("reddog.microsoft.com.", "A"), ("foo.Reddog.Microsoft.com.", "AAAA"),
                            ("a.b.c.d.internal.cloudapp.net.", "A"), ("x.a.b.c.d.internal.cloudapp.net.", "SRV")):
            r = await s.ask(name, qtype)
            assert r.rcode() == dns.rcode.NXDOMAIN and r.flags & dns.flags.AA, name
            assert r.answer == []
        assert not any("reddog" in q[1] or q[1].endswith(".d.internal.cloudapp.net.") for q in upstream.received)
        # fewer labels under internal.cloudapp.net: fallthrough to forward
        r = await s.ask("a.b.c.internal.cloudapp.net.", "A")
        assert answers(r) == ["a.b.c.internal.cloudapp.net. A 10.1.0.4"]
        assert answers(await s.ask(SVC, "A")) == [f"{SVC} A 172.20.36.232"]


async def test_hosts_and_templates_in_front_of_kubernetes_take_the_names_they_answer(tmp_path):
    # the receive threads answer cluster names from the memo only where every plugin in front of
    # kubernetes is transparent: a name hosts lists, or a template takes, must get their answer
    text = (".:{PORT} {\n    bind 127.0.0.1\n    hosts nodes {\n        fallthrough\n    }\n"
            "    template IN TXT cluster.local {\n        match ^testapp-svc[.]\n"
            '        answer "{{ .Name }} 60 IN TXT \\"templated\\""\n        fallthrough\n    }\n'
            "    template IN A testapp.svc.cluster.local {\n        match ^other[.]\n"
            '        answer "{{ .Name }} 60 IN A 192.0.2.9"\n        fallthrough\n    }\n'
            "    template IN A testapp.svc.cluster.local {\n        match ^other[.] ^second[.]\n"
            '        answer "{{ .Name }} 60 IN A 192.0.2.10"\n        fallthrough\n    }\n'
            "    kubernetes cluster.local in-addr.arpa ip6.arpa\n}\n")
    override = f"10.99.0.1 {SVC}\n"
    async with CorefileServer(text, tmp_path, files={"nodes": override}) as s:
        for _ in range(2):                           # the second time is the memo's chance
            assert answers(await s.ask(SVC, "A")) == [f"{SVC} A 10.99.0.1"]
            assert answers(await s.ask(SVC, "TXT")) == [f'{SVC} TXT "templated"']
            r = await s.ask(SVC, "AAAA")               # hosts lists it, IPv4 only: NODATA
            assert r.rcode() == dns.rcode.NOERROR and r.answer == []
            # the templates in Corefile order: the first that matches answers
            assert answers(await s.ask("other.testapp.svc.cluster.local.", "A")) == [
                "other.testapp.svc.cluster.local. A 192.0.2.9"]
            assert answers(await s.ask("second.testapp.svc.cluster.local.", "A")) == [
                "second.testapp.svc.cluster.local. A 192.0.2.10"]
            other = "testapp2-svc.testapp.svc.cluster.local."
            r = await s.ask(other, "A")
            assert r.rcode() == dns.rcode.NOERROR and r.answer and r.answer[0].ttl == 5   # kubernetes'


async def test_a_template_with_ederror_over_the_wire(tmp_path):
    text = (".:{PORT} {\n    bind 127.0.0.1\n    template ANY ANY invalid {\n        rcode NXDOMAIN\n"
            '        authority "invalid. 60 {{ .Class }} SOA ns.invalid. hostmaster.invalid. (1 60 60 60 60)"\n'
            '        ederror 21 "Blocked according to RFC2606"\n    }\n}\n')
    async with CorefileServer(text, tmp_path) as s:
        r = await s.ask("x.invalid.", "A", use_edns=0)
        assert r.rcode() == dns.rcode.NXDOMAIN
        assert [rr.to_text() for rr in r.authority] == [
            "invalid. 60 IN SOA ns.invalid. hostmaster.invalid. 1 60 60 60 60"]
        assert [(o.code, o.text) for o in r.options if o.otype == dns.edns.EDE] == [
            (21, "Blocked according to RFC2606")]
        r = await s.ask("x.invalid.", "A")                     # no EDNS in the query: no OPT back
        assert r.rcode() == dns.rcode.NXDOMAIN and r.edns < 0


async def test_aks_localdns_corefile_hosts_and_templates_on_both_listeners(tmp_path, upstream):
    # its two .:53 blocks bind the node (169.254.10.10) and cluster (169.254.10.11) listeners:
    # here 127.0.0.10 and 127.0.0.11 (loopback), every upstream the stub
    text = (REAL / "aks-localdns.corefile").read_text()
    text = re.sub(r"\n\s*(ready|prometheus)\b[^\n]*", "", text)
    text = text.replace("169.254.10.10", "127.0.0.10").replace("169.254.10.11", "127.0.0.11")
    text = text.replace(":53 {", ":{PORT} {").replace("/etc/localdns/hosts", "localdns-hosts")
    for target in ("168.63.129.16", "10.0.0.10"):
        text = text.replace(f"forward . {target}", f"forward . 127.0.0.1:{upstream.port}")
    hosts = "20.61.99.192 mcr.microsoft.com\n2603:1061:f:101::10 mcr.microsoft.com\n"
    async with CorefileServer(text, tmp_path, files={"localdns-hosts": hosts}) as s:
        for host in ("127.0.0.10", "127.0.0.11"):
            r = await s.ask("MCR.microsoft.com.", "A", host=host)
            assert answers(r) == ["mcr.microsoft.com. A 20.61.99.192"] and r.answer[0].ttl == 5
            r = await s.ask("mcr.microsoft.com.", "AAAA", host=host)
            assert answers(r) == ["mcr.microsoft.com. AAAA 2603:1061:f:101::10"]
            r = await s.ask("reddog.microsoft.com.", "A", host=host)
            assert r.rcode() == dns.rcode.NXDOMAIN and r.flags & dns.flags.AA
            r = await s.ask("example.com.", "A", host=host)
            assert answers(r) == ["example.com. A 93.184.216.34"]
        assert not any(q[1] in ("mcr.microsoft.com.", "reddog.microsoft.com.") for q in upstream.received)


async def test_a_big_hosts_file_loading_at_start_holds_its_block_only(tmp_path, monkeypatch):
    """A big file is read in the background at setup: another block answers at once; the hosts
    block's questions (cluster names behind it included) wait for the file, then get its answer."""
    import threading

    from clusterdns.corefile.plugins import hosts as hostsmod
    release = threading.Event()
    real = hostsmod._read_apart

    def slow(*a, **k):
        release.wait(30)
        return real(*a, **k)
    monkeypatch.setattr(hostsmod, "_read_apart", slow)
    body = "10.7.7.7 big.hosts.example\n" + "".join(f"10.1.{i >> 8 & 255}.{i & 255} h{i}.hosts.example\n"
                                                    for i in range(20_000))
    assert len(body) > hostsmod.BIG
    text = """.:{PORT} {
    bind 127.0.0.1
    hosts big {
        fallthrough
    }
    kubernetes cluster.local in-addr.arpa ip6.arpa
}
other.example:{PORT} {
    bind 127.0.0.1
    template IN A other.example {
        answer "{{ .Name }} 60 IN A 192.0.2.99"
    }
}
"""
    async with CorefileServer(text, tmp_path, files={"big": body}) as s:
        r = await s.ask("www.other.example", "A")
        assert answers(r) == ["www.other.example. A 192.0.2.99"]
        held = [asyncio.ensure_future(s.ask(n, "A", timeout=10)) for n in ("big.hosts.example", SVC)]
        await asyncio.sleep(0.5)
        assert not any(t.done() for t in held)                   # waiting, not answered wrongly
        assert answers(await s.ask("x.other.example", "A")) == ["x.other.example. A 192.0.2.99"]
        release.set()
        big, svc = await asyncio.gather(*held)
        assert answers(big) == ["big.hosts.example. A 10.7.7.7"]
        assert svc.rcode() == dns.rcode.NOERROR and answers(svc) == [f"{SVC} A 172.20.36.232"]
        # loaded: the memo's path again for the cluster name
        hosts = next(p for b in s.corefile.blocks for p in b.plugins if p.name == "hosts")
        assert hosts.loaded.is_set() and hosts.transparent(SVC, 1)
