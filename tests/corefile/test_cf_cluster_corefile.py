"""--cluster-corefile: a node-local-dns Corefile's forwards to the cluster DNS run the cluster
DNS's own Corefile in this process (its kubernetes options, hosts, rewrite), over real sockets."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import dns.rcode
import dnslib
import pytest

from clusterdns.config import Config, ConfigError, load
from clusterdns.corefile.build import load_corefile, prepare
from clusterdns.corefile.syntax import CorefileError
from tests import demo
from tests.corefile.cfserve import CorefileServer, answers
from tests.dns.dnskit import FakeUpstream

ROOT = Path(__file__).resolve().parents[2]
REAL = Path(__file__).parent / "real"
SVC = "testapp-svc.testapp.svc.cluster.local."

# node-local-dns's cluster block, as upstream ships it, on loopback (the forward to the cluster
# DNS as node-cache fills it), and its root block forwarding to the node's upstream
NODE_LOCAL = """cluster.local:{PORT} {
    errors
    cache {
            success 9984 30
            denial 9984 5
    }
    reload
    loop
    bind 127.0.0.1
    forward . clusterdns:state {
            force_tcp
    }
    }
.:{PORT} {
    errors
    cache 30
    bind 127.0.0.1
    forward . 127.0.0.1:UPSTREAM
    }
"""

# the cluster DNS's Corefile (kubeadm's, plus the custom entries operators add)
CLUSTER = """.:53 {
    errors
    health {
       lameduck 5s
    }
    ready
    hosts {
       10.9.9.9 db.cluster.local
       fallthrough
    }
    rewrite name exact alias.cluster.local testapp-svc.testapp.svc.cluster.local
    kubernetes cluster.local in-addr.arpa ip6.arpa {
       pods insecure
       fallthrough in-addr.arpa ip6.arpa
       ttl 30
    }
    prometheus :9153
    forward . 127.0.0.1:UPSTREAM
    cache 30 {
       disable success cluster.local
       disable denial cluster.local
    }
    loop
    reload
    loadbalance
}
"""


def _with_service(name: str, ip: str) -> list:
    from clusterdns.model import Service, ServicePort
    return demo.demo_records() + [("Service", Service("testapp", name, cluster_ips=(ip,),
                                                      ports=(ServicePort("http", "TCP", 8080),)))]


@pytest.fixture
async def upstream():
    up = await FakeUpstream({"example.com.": ["example.com. 300 IN A 93.184.216.34"]}).start()
    yield up
    await up.stop()


async def test_node_local_forwards_run_the_cluster_corefile(tmp_path, upstream):
    cluster = tmp_path / "coredns.Corefile"
    cluster.write_text(CLUSTER.replace("UPSTREAM", str(upstream.port)))
    text = NODE_LOCAL.replace("UPSTREAM", str(upstream.port))
    async with CorefileServer(text, tmp_path, cluster_corefile=str(cluster)) as s:
        cf = s.corefile
        assert cf.cluster is not None and cf.cluster.path == str(cluster)
        # the cluster Corefile's listeners are not bound: only node-local's
        assert list(cf.listeners) == [("127.0.0.1", s.port)]
        assert "answered in this process by" in cf.describe() and "cluster DNS (answered" in cf.describe()
        # the cluster Corefile's kubernetes options: ttl 30 (the flags' default is 5)
        for tcp in (False, True):
            r = await s.ask(SVC, "A", tcp=tcp)
            assert answers(r) == [f"{SVC} A 172.20.36.232"] and r.answer[0].ttl == 30
            assert r.flags & dns.flags.AA
        # its hosts and rewrite, which node-local alone does not have
        assert answers(await s.ask("db.cluster.local.", "A")) == ["db.cluster.local. A 10.9.9.9"]
        r = await s.ask("Alias.cluster.local.", "A")
        # (answer auto: the names of the rule, as the cluster Corefile alone answers them)
        assert answers(r) == ["alias.cluster.local. A 172.20.36.232"]
        assert (await s.ask("nope.testapp.svc.cluster.local.", "A")).rcode() == dns.rcode.NXDOMAIN
        # names outside the cluster zone take node-local's root block, to the node's upstream
        assert answers(await s.ask("example.com.", "A")) == ["example.com. A 93.184.216.34"]
        # a new Service resolves at once through node-local's cache 30 and the hop
        name = "fresh-svc.testapp.svc.cluster.local."
        assert (await s.ask(name, "A")).rcode() == dns.rcode.NXDOMAIN
        s.publish(_with_service("fresh-svc", "172.20.99.9"))
        await s.settle()
        assert answers(await s.ask(name, "A")) == [f"{name} A 172.20.99.9"]
        # the receive threads' memo answers the hop's names as the chain does
        listener = cf.listeners[("127.0.0.1", s.port)]
        q = bytes(dnslib.DNSRecord.question(SVC, "A").pack())
        fast = None
        for _ in range(5):
            fast = listener.fast(q, False)
            if fast is not None:
                break
            await s.ask(SVC, "A")
        assert fast is not None
        rr = dnslib.DNSRecord.parse(fast).rr
        assert [(str(r.rname), str(r.rdata), r.ttl) for r in rr] == [(SVC, "172.20.36.232", 30)]
        # ... but never for a name only the cluster chain's hosts knows
        q = bytes(dnslib.DNSRecord.question("db.cluster.local.", "A").pack())
        assert listener.fast(q, False) is None


def _cfg(tmp_path: Path, node_local: str, cluster: str, **options) -> Config:
    (tmp_path / "nl").write_text(node_local)
    (tmp_path / "cl").write_text(cluster)
    return Config.from_options("dns", corefile=str(tmp_path / "nl"), cluster_corefile=str(tmp_path / "cl"),
                               **options)


def test_setup_errors(tmp_path):
    nl = NODE_LOCAL.replace("{PORT}", "5300").replace("UPSTREAM", "5301")
    cl = CLUSTER.replace("UPSTREAM", "5301")
    # the cluster Corefile without a kubernetes plugin
    with pytest.raises(CorefileError, match=r"--cluster-corefile .*: no kubernetes plugin"):
        load_corefile(str(tmp_path / "nl"), _cfg(tmp_path, nl, ".:53 {\n    whoami\n}\n"))
    # a node-local Corefile that forwards nothing to the cluster DNS
    with pytest.raises(CorefileError, match=r"forwards nothing to the cluster DNS"):
        load_corefile(str(tmp_path / "nl"), _cfg(tmp_path, ".:5300 {\n    forward . 127.0.0.1:5301\n}\n", cl))
    # the cluster DNS serves nothing on the port forwarded to
    with pytest.raises(CorefileError, match=r"nl:1\d: plugin/forward: .* serves nothing on port 53"):
        load_corefile(str(tmp_path / "nl"), _cfg(tmp_path, nl, cl.replace(".:53", ".:5353")))
    # a broken cluster Corefile names its own FILE:LINE
    with pytest.raises(CorefileError, match=r"cl:\d+: .*bogus"):
        load_corefile(str(tmp_path / "nl"), _cfg(tmp_path, nl, cl.replace("    loop\n", "    bogus\n")))
    # the kubernetes flags are the cluster Corefile's to say
    with pytest.raises(CorefileError, match=r"--ttl: with --corefile the Corefile's kubernetes plugin says this"):
        prepare(_cfg(tmp_path, nl, cl, ttl=7, corefile_flags=("ttl",)))
    with pytest.raises(ConfigError, match=r"--cluster-corefile: .* give that Corefile with --corefile"):
        load(["dns", "--cluster-corefile", str(tmp_path / "cl")])


def test_config_check_prints_both_and_a_changed_cluster_corefile_changes_the_digest(tmp_path):
    nl = NODE_LOCAL.replace("{PORT}", "5300").replace("UPSTREAM", "5301")
    cl = CLUSTER.replace("UPSTREAM", "5301")
    cfg = _cfg(tmp_path, nl, cl)
    before = load_corefile(cfg.dns.corefile, cfg).digest
    (tmp_path / "cl").write_text(cl.replace("10.9.9.9", "10.9.9.8"))
    assert load_corefile(cfg.dns.corefile, cfg).digest != before     # the reload plugin sees it
    r = subprocess.run([sys.executable, "-m", "clusterdns", "config", "check", "--corefile", str(tmp_path / "nl"),
                        "--cluster-corefile", str(tmp_path / "cl")], capture_output=True, text=True, timeout=60,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert f"Corefile {tmp_path / 'nl'}" in r.stdout and f"Corefile {tmp_path / 'cl'}" in r.stdout
    assert "hosts" in r.stdout and "kubernetes" in r.stdout
    r = subprocess.run([sys.executable, "-m", "clusterdns", "config", "check", "--corefile", str(tmp_path / "nl"),
                        "--cluster-corefile", str(tmp_path / "cl"), "--ttl", "9"], capture_output=True, text=True,
                       timeout=60, cwd=ROOT)
    assert r.returncode == 2 and "--ttl" in r.stderr, r.stderr


async def test_the_real_node_local_corefile_over_kubeadms(tmp_path, upstream):
    """The upstream NodeLocal Corefile, placeholders and all, over kubeadm's, both unchanged but
    for the loopback address and ports."""
    text = (REAL / "nodelocaldns.corefile").read_text().replace(":53 {", ":{PORT} {")
    text = text.replace("prometheus :9253", "").replace("health __PILLAR__LOCAL__DNS__:8080", "")
    cluster = tmp_path / "kubeadm"
    cluster.write_text((REAL / "kubeadm.corefile").read_text()
                       .replace("forward . /etc/resolv.conf", f"forward . 127.0.0.1:{upstream.port}")
                       .replace("prometheus :9153", "").replace("    ready\n", ""))
    resolv = tmp_path / "resolv.conf"
    resolv.write_text(f"nameserver 127.0.0.1:{upstream.port}\n")
    async with CorefileServer(text, tmp_path, cluster_corefile=str(cluster), local_ips=("127.0.0.1",),
                              upstream=(f"127.0.0.1:{upstream.port}",)) as s:
        r = await s.ask(SVC, "A")
        assert answers(r) == [f"{SVC} A 172.20.36.232"] and r.answer[0].ttl == 30
        assert answers(await s.ask("example.com.", "A")) == ["example.com. A 93.184.216.34"]
        r = await s.ask("232.36.20.172.in-addr.arpa.", "PTR")
        assert answers(r) == ["232.36.20.172.in-addr.arpa. PTR testapp-svc.testapp.svc.cluster.local."]
