"""Local DNS addresses: the device, NOTRACK/ACCEPT rules, repair and cleanup.

The namespace tests build a node namespace and a pod namespace joined by a
veth pair, hold 172.20.0.10 on the node, and send real DNS-port traffic from
the pod while kube-proxy-style DNAT and REJECT rules for that address exist.
"""
import asyncio
import shutil
import subprocess
import textwrap

import pytest

from clusterdns import localdns
from clusterdns.proxy.apply import SubprocessRunner
from tests.nslib import PY, requires, run, sh

LOCAL_IP = "172.20.0.10"

needs_root = requires("iptables")


def test_render_rules_ipv4():
    text = localdns.render_rules([LOCAL_IP, "169.254.20.10"], 4)
    lines = text.splitlines()
    assert lines[0] == "*raw" and ":CLUSTERDNS-NOTRACK - [0:0]" in lines
    assert "*filter" in lines and ":CLUSTERDNS-LOCAL - [0:0]" in lines
    notrack = [x for x in lines if x.endswith("-j NOTRACK")]
    accept = [x for x in lines if x.endswith("-j ACCEPT")]
    # 2 addresses x udp/tcp x (to port 53, from port 53)
    assert len(notrack) == 8 and len(accept) == 8
    assert any(f"-d {LOCAL_IP}/32 -p udp -m udp --dport 53" in x for x in notrack)
    assert any(f"-s {LOCAL_IP}/32 -p tcp -m tcp --sport 53" in x for x in notrack)
    assert text.count("COMMIT") == 2


def test_render_rules_ipv6_and_split():
    fam = localdns.split_families(["fd00::a", LOCAL_IP])
    assert fam == {4: [LOCAL_IP], 6: ["fd00::a"]}
    assert "-d fd00::a/128 -p udp" in localdns.render_rules(fam[6], 6)


@pytest.fixture
def topology(namespaces):
    """node <-> pod over a veth; the pod routes everything through the node."""
    node, pod = namespaces.add("node"), namespaces.add("pod")
    namespaces.veth(node, "veth-pod", pod, "eth0")
    sh("ip", "addr", "add", "10.161.0.1/24", "dev", "veth-pod", ns=node)
    sh("ip", "addr", "add", "10.161.0.5/24", "dev", "eth0", ns=pod)
    sh("ip", "route", "add", "default", "via", "10.161.0.1", ns=pod)
    return node, pod


RESPONDER = textwrap.dedent("""
    import socket, sys
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((sys.argv[1], 53))
    print("ready", flush=True)
    while True:
        data, peer = s.recvfrom(512)
        s.sendto(b"answer:" + data, peer)
""")

CLIENT = textwrap.dedent("""
    import socket, sys
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(2)
    try:
        s.sendto(b"q", (sys.argv[1], 53))
        print(s.recvfrom(512)[0].decode())
    except OSError as exc:
        print("error:", exc.__class__.__name__)
""")


def _kube_proxy_like_rules(node):
    """What a proxier writes for a kube-dns ClusterIP with no endpoints: REJECT for NEW
    connections (filter) and a DNAT elsewhere (nat), both jumped before ours would be."""
    rules = textwrap.dedent(f"""
        *filter
        :KUBE-SERVICES - [0:0]
        -I INPUT 1 -m conntrack --ctstate NEW -j KUBE-SERVICES
        -I OUTPUT 1 -m conntrack --ctstate NEW -j KUBE-SERVICES
        -A KUBE-SERVICES -d {LOCAL_IP}/32 -p udp -m udp --dport 53 -j REJECT --reject-with icmp-port-unreachable
        COMMIT
        *nat
        :KUBE-SERVICES - [0:0]
        -I PREROUTING 1 -j KUBE-SERVICES
        -I OUTPUT 1 -j KUBE-SERVICES
        -A KUBE-SERVICES -d {LOCAL_IP}/32 -p udp -m udp --dport 53 -j DNAT --to-destination 10.99.99.99:53
        COMMIT
        """)
    sh("iptables-restore", "--noflush", ns=node, input=rules)


def _query(pod, ip=LOCAL_IP):
    return sh(PY, "-c", CLIENT, ip, ns=pod).strip()


@needs_root
@requires("conntrack")
def test_local_ip_answered_on_node_despite_reject_and_dnat(topology, namespaces):
    node, pod = topology
    runner = SubprocessRunner(prefix=("ip", "netns", "exec", node))
    ldns = localdns.LocalDNS([LOCAL_IP], runner)
    _kube_proxy_like_rules(node)
    # Without our rules the proxier's REJECT wins: the pod gets port-unreachable.
    sh("ip", "link", "add", "nodelocaldns", "type", "bridge", ns=node)
    sh("ip", "link", "set", "nodelocaldns", "up", ns=node)
    sh("ip", "addr", "add", f"{LOCAL_IP}/32", "dev", "nodelocaldns", ns=node)
    responder = namespaces.spawn(node, PY, "-c", RESPONDER, LOCAL_IP, stdout=subprocess.PIPE, text=True)
    assert responder.stdout.readline().strip() == "ready"
    assert _query(pod).startswith("error")
    asyncio.run(ldns.setup())
    assert ldns.link_type in ("dummy", "bridge")
    assert _query(pod) == "answer:q"
    # From the node itself (OUTPUT path) too.
    assert sh(PY, "-c", CLIENT, LOCAL_IP, ns=node).strip() == "answer:q"
    # Untracked: no conntrack entry for the DNS flow, so no DNAT either.
    ct = run("conntrack", "-L", "-d", LOCAL_IP, ns=node)
    assert ct.returncode == 0 and "dport=53" not in ct.stdout, ct.stderr
    # Our jumps are first in every chain they hook.
    for table, chain in (("raw", "PREROUTING"), ("raw", "OUTPUT"), ("filter", "INPUT"), ("filter", "OUTPUT")):
        first = [x for x in sh("iptables", "-t", table, "-S", chain, ns=node).splitlines()
                 if x.startswith("-A")][0]
        assert first.endswith("-j CLUSTERDNS-NOTRACK") or first.endswith("-j CLUSTERDNS-LOCAL"), first


@needs_root
def test_check_repairs_and_cleanup_removes(topology):
    node, _ = topology
    runner = SubprocessRunner(prefix=("ip", "netns", "exec", node))
    ldns = localdns.LocalDNS([LOCAL_IP, "169.254.20.10"], runner)
    asyncio.run(ldns.setup())
    addrs = sh("ip", "-o", "addr", "show", "dev", "nodelocaldns", ns=node)
    assert LOCAL_IP in addrs and "169.254.20.10" in addrs
    assert asyncio.run(ldns.check()) is False          # all in place: nothing to do
    assert asyncio.run(ldns.setup()) is None          # idempotent
    assert sh("iptables", "-t", "raw", "-S", "PREROUTING", ns=node).count("CLUSTERDNS-NOTRACK") == 1

    # Someone inserts a jump above ours (a proxier's full sync does) and flushes our chain.
    sh("iptables", "-N", "OTHER", ns=node)
    sh("iptables", "-I", "INPUT", "1", "-j", "OTHER", ns=node)
    sh("iptables", "-t", "raw", "-F", "CLUSTERDNS-NOTRACK", ns=node)
    sh("ip", "addr", "del", "169.254.20.10/32", "dev", "nodelocaldns", ns=node)
    assert asyncio.run(ldns.check()) is True
    first = [x for x in sh("iptables", "-S", "INPUT", ns=node).splitlines() if x.startswith("-A")][0]
    assert first.endswith("-j CLUSTERDNS-LOCAL")
    assert sh("iptables", "-t", "raw", "-S", "CLUSTERDNS-NOTRACK", ns=node).count("NOTRACK") >= 8
    assert "169.254.20.10" in sh("ip", "-o", "addr", "show", "dev", "nodelocaldns", ns=node)
    assert asyncio.run(ldns.check()) is False

    removed = asyncio.run(localdns.cleanup(runner))
    assert "device nodelocaldns" in removed
    assert run("ip", "link", "show", "nodelocaldns", ns=node).returncode != 0
    for table, chain in (("raw", "CLUSTERDNS-NOTRACK"), ("filter", "CLUSTERDNS-LOCAL")):
        assert run("iptables", "-t", table, "-S", chain, ns=node).returncode != 0
    saved = sh("iptables-save", ns=node)
    assert "CLUSTERDNS" not in saved and "-j OTHER" in saved   # others' rules untouched
    assert asyncio.run(localdns.cleanup(runner)) == []          # nothing left: a no-op


@needs_root
def test_bad_address_is_a_clear_error(topology):
    node, _ = topology
    runner = SubprocessRunner(prefix=("ip", "netns", "exec", node))
    with pytest.raises(ValueError):
        localdns.LocalDNS(["not-an-ip"], runner)


@needs_root
@pytest.mark.skipif(shutil.which("ip6tables") is None, reason="needs ip6tables")
def test_ipv6_local_address(topology):
    node, _ = topology
    runner = SubprocessRunner(prefix=("ip", "netns", "exec", node))
    ldns = localdns.LocalDNS(["fd00:20::a", LOCAL_IP], runner)
    asyncio.run(ldns.setup())
    assert "fd00:20::a" in sh("ip", "-6", "-o", "addr", "show", "dev", "nodelocaldns", ns=node)
    rules = sh("ip6tables", "-t", "raw", "-S", "CLUSTERDNS-NOTRACK", ns=node)
    assert "-d fd00:20::a/128 -p udp -m udp --dport 53" in rules
    assert asyncio.run(ldns.check()) is False
    # A UDP socket can bind the address at once (nodad): what the DNS server does.
    probe = "import socket; s=socket.socket(socket.AF_INET6, socket.SOCK_DGRAM); s.bind(('fd00:20::a', 53)); print('ok')"
    assert sh(PY, "-c", probe, ns=node).strip() == "ok"
    removed = asyncio.run(localdns.cleanup(runner))
    assert any(r.startswith("IPv6 raw") for r in removed)


@needs_root
def test_proxy_cleanup_removes_local_dns_too(topology):
    """`clusterdns proxy --cleanup` removes everything clusterdns installed, the agent's local DNS included."""
    from clusterdns.config import load
    from clusterdns.proxy.proxier import cleanup
    node, _ = topology
    runner = SubprocessRunner(prefix=("ip", "netns", "exec", node))
    asyncio.run(localdns.LocalDNS([LOCAL_IP], runner).setup())
    removed = asyncio.run(cleanup(load(["proxy", "--cleanup", "--manifest", "unused.yaml"], env={}), runner))
    assert "device nodelocaldns" in removed
    assert run("ip", "link", "show", "nodelocaldns", ns=node).returncode != 0
    assert "CLUSTERDNS" not in sh("iptables-save", ns=node)
