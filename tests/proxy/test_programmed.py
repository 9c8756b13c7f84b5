"""Reading back what is programmed in the kernel: iptables-save (real, in a namespace) and ipvsadm -Ln."""
from __future__ import annotations

import asyncio
import subprocess

import pytest

from clusterdns.config import Config
from clusterdns.model import (
    LOAD_BALANCER,
    NODE_PORT,
    Endpoint,
    EndpointPort,
    EndpointSlice,
    Service,
    ServicePort,
)
from clusterdns.proxy import iptables, iptsave, ipvs, readback
from clusterdns.proxy.apply import RecordingRunner, Result, SubprocessRunner
from clusterdns.proxy.proxier import IptablesBackend, IpvsBackend
from clusterdns.state import state_from_records
from tests.nslib import requires

CFG = Config.from_options(node_name="node-a", node_ips=("192.168.49.2", "fd00:49::2"),
             cluster_cidrs=("10.161.0.0/16", "fd00:161::/32"))


def _slice(name, svc, *ips, ports=(("http", "TCP", 8080),), family="IPv4", node="node-b", **kw):
    eps = tuple(Endpoint((ip,), node_name=node, **kw) for ip in ips)
    return ("EndpointSlice", EndpointSlice("ns", name, svc, family, eps,
                                           tuple(EndpointPort(*p) for p in ports)))


def _state():
    recs = [
        ("Service", Service("ns", "web", cluster_ips=("10.96.0.5",),
                            ports=(ServicePort("http", "TCP", 80), ServicePort("dns", "UDP", 53)))),
        _slice("web-1", "web", "10.161.1.10", "10.161.1.11", ports=(("http", "TCP", 8080), ("dns", "UDP", 5353))),
        # no endpoints: only a filter REJECT
        ("Service", Service("ns", "empty", cluster_ips=("10.96.0.6",), ports=(ServicePort("", "TCP", 81),))),
        # internalTrafficPolicy Local with one local endpoint of two, plus a NodePort (so KUBE-SVC exists too)
        ("Service", Service("ns", "loc", NODE_PORT, cluster_ips=("10.96.0.7",), internal_local=True,
                            ports=(ServicePort("http", "TCP", 80, node_port=30007),))),
        _slice("loc-1", "loc", "10.161.1.12"),
        ("EndpointSlice", EndpointSlice("ns", "loc-2", "loc", "IPv4", (Endpoint(("10.161.1.13",), node_name="node-a"),),
                                        (EndpointPort("http", "TCP", 8080),))),
        # a LoadBalancer with source ranges and affinity
        ("Service", Service("ns", "lb", LOAD_BALANCER, cluster_ips=("10.96.0.8",), lb_ips=("203.0.113.8",),
                            lb_source_ranges=("198.51.100.0/24",), affinity_timeout=600,
                            ports=(ServicePort("http", "TCP", 80, node_port=30008),))),
        _slice("lb-1", "lb", "10.161.1.14"),
        # IPv6
        ("Service", Service("ns", "six", cluster_ips=("fd00:96::9",), ports=(ServicePort("http", "TCP", 80),))),
        _slice("six-1", "six", "fd00:161:1::10", family="IPv6"),
    ]
    return state_from_records(recs)


EXPECTED4 = {
    ("10.96.0.5", "TCP", 80): frozenset({"10.161.1.10:8080", "10.161.1.11:8080"}),
    ("10.96.0.5", "UDP", 53): frozenset({"10.161.1.10:5353", "10.161.1.11:5353"}),
    ("10.96.0.6", "TCP", 81): frozenset(),
    ("10.96.0.7", "TCP", 80): frozenset({"10.161.1.12:8080", "10.161.1.13:8080"}),
    ("10.96.0.8", "TCP", 80): frozenset({"10.161.1.14:8080"}),
}
EXPECTED6 = {("fd00:96::9", "TCP", 80): frozenset({"[fd00:161:1::10]:8080"})}


def test_programmed_from_rendered_text():
    """The renderer's own text read back (restore text is a superset of a dump)."""
    state = _state()
    for family, want in ((4, EXPECTED4), (6, EXPECTED6)):
        text = iptables.render(state, CFG, family).text
        assert iptsave.programmed(text, text) == want


def test_read_and_target():
    tables = iptsave.read("*nat\n:PREROUTING ACCEPT [0:0]\n:KUBE-X - [0:0]\n"
                          '-A PREROUTING -m comment --comment "a -j b" -j KUBE-X\nCOMMIT\n*filter\nCOMMIT\n')
    assert tables["nat"].chains == {"PREROUTING": "ACCEPT", "KUBE-X": "-"}
    (rule,) = tables["nat"].rules
    assert (rule.chain, iptsave.target(rule.spec)) == ("PREROUTING", "KUBE-X")
    assert tables["filter"].rules == []
    assert iptsave.tokens(rule.spec) == ["-j", "KUBE-X"]
    assert iptsave.programmed("") == {}


def test_not_programmed_when_wider_prefix_or_negated():
    text = ("*nat\n:KUBE-SERVICES - [0:0]\n"
            "-A KUBE-SERVICES -d 10.96.0.0/16 -p tcp -m tcp --dport 80 -j KUBE-SVC-AAAA\n"
            "-A KUBE-SERVICES ! -d 10.96.0.1/32 -p tcp -m tcp --dport 80 -j KUBE-SVC-BBBB\n"
            "-A KUBE-SVC-AAAA -j KUBE-SEP-CCCC\n"
            "-A KUBE-SEP-CCCC -p tcp -m tcp -j DNAT --to-destination 10.0.0.1:80\nCOMMIT\n")
    assert iptsave.programmed(text) == {}


IPVSADM = """IP Virtual Server version 1.2.1 (size=4096)
Prot LocalAddress:Port Scheduler Flags
  -> RemoteAddress:Port           Forward Weight ActiveConn InActConn
TCP  10.96.0.1:443 rr
  -> 172.18.0.2:6443              Masq    1      0          0
UDP  10.96.0.10:53 rr
  -> 10.244.0.2:53                Masq    1      3          0
  -> 10.244.0.3:53                Masq    0      0          2
TCP  10.96.0.20:80 rr persistent 10800
SCTP 10.96.0.30:3868 rr
  -> 10.244.1.9:3868              Masq    1      0          0
FWM  12 rr
  -> 10.244.7.7:80                Masq    1      0          0
TCP  [fd00:96::1]:443 rr
  -> [fd00:244::2]:6443           Masq    1      0          0
"""


def test_ipvsadm_list_parsed():
    assert ipvs.parse_list(IPVSADM, 4) == {
        ("10.96.0.1", "TCP", 443): frozenset({"172.18.0.2:6443"}),
        ("10.96.0.10", "UDP", 53): frozenset({"10.244.0.2:53"}),    # weight 0: terminating, left out
        ("10.96.0.20", "TCP", 80): frozenset(),
        ("10.96.0.30", "SCTP", 3868): frozenset({"10.244.1.9:3868"}),
    }
    assert ipvs.parse_list(IPVSADM, 6) == {("fd00:96::1", "TCP", 443): frozenset({"[fd00:244::2]:6443"})}


def test_ipvs_backend_reads_ipvsadm():
    runner = RecordingRunner(lambda argv, stdin: Result(argv, 0, IPVSADM) if argv[0] == "ipvsadm" else None)
    got = asyncio.run(IpvsBackend(runner, CFG, 4).programmed())
    assert got[("10.96.0.1", "TCP", 443)] == frozenset({"172.18.0.2:6443"})
    assert runner.commands() == ["ipvsadm -L -n"]
    failing = RecordingRunner(lambda argv, stdin: Result(argv, 2, "", "Can't initialize ipvs"))
    assert asyncio.run(IpvsBackend(failing, CFG, 4).programmed()) == {}


@requires("iptables-restore", "ip6tables-restore")
@pytest.mark.parametrize("large", [False, True], ids=["comments", "large-cluster"])
def test_backend_reads_back_what_a_sync_applied(netns, large, monkeypatch):
    """Rules applied through the real tools; iptables-save then read back by the backend."""
    if large:   # the large-cluster layout drops the endpoint comments
        monkeypatch.setattr(iptables, "LARGE_CLUSTER_ENDPOINTS", 1)
    state = _state()
    runner = SubprocessRunner(prefix=("ip", "netns", "exec", netns))

    async def go():
        out = {}
        for family in (4, 6):
            backend = IptablesBackend(runner, CFG, family)
            assert await backend.programmed() == {}       # nothing there yet
            await backend.sync(state, None, 0.0)
            fresh = IptablesBackend(runner, CFG, family)  # a new process: reads the kernel
            out[family] = await fresh.programmed()
        return out

    got = asyncio.run(go())
    assert got[4] == EXPECTED4
    assert got[6] == EXPECTED6


class _Recording(SubprocessRunner):
    """The namespace's tools, each command line kept."""

    def __init__(self, ns):
        super().__init__(prefix=("ip", "netns", "exec", ns))
        self.argvs = []

    async def run(self, argv, stdin=None):
        self.argvs.append(tuple(argv))
        return await super().run(argv, stdin)


@requires("iptables-nft-restore", "ip6tables-nft-restore", "iptables-legacy-save")
def test_ports_read_over_netlink_match_iptables_save(netns):
    """readback.iptables_nft_ports: KUBE-SERVICES of nat and filter over netlink give the ports
    iptables-save's reading finds (every family, both layouts); rules that are not one
    ClusterIP port (a CIDR, a negation, a port range or list) are not taken for one."""
    state = _state()
    runner = _Recording(netns)

    async def go():
        for family in (4, 6):
            backend = IptablesBackend(runner, CFG, family)
            assert await backend.programmed_ports() == set()         # nothing there yet
            await backend.sync(state, None, 0.0)
            fresh = IptablesBackend(runner, CFG, family)
            ports = await fresh.programmed_ports()
            assert ports == set(EXPECTED4 if family == 4 else EXPECTED6)
            assert ports == set(await fresh.programmed())
        # the backend was chosen without a dump of nf_tables' rules: legacy holds none
        assert not [a for a in runner.argvs if a[0] in ("iptables-nft-save", "ip6tables-nft-save") and len(a) == 1]

    asyncio.run(go())
    ipt = ("ip", "netns", "exec", netns, "iptables-nft", "-t", "nat", "-I", "KUBE-SERVICES")
    for rule in (["-d", "10.96.0.0/16", "-p", "tcp", "--dport", "80", "-j", "KUBE-SVC-AAAAAAAAAAAAAAAA"],
                 ["!", "-d", "10.96.0.1/32", "-p", "tcp", "--dport", "80", "-j", "KUBE-SVC-AAAAAAAAAAAAAAAA"],
                 ["-d", "10.96.0.2/32", "-p", "tcp", "--dport", "80:90", "-j", "KUBE-SVC-AAAAAAAAAAAAAAAA"],
                 ["-d", "10.96.0.3/32", "-p", "tcp", "-m", "multiport", "--dports", "80,81",
                  "-j", "KUBE-SVC-AAAAAAAAAAAAAAAA"],
                 ["-d", "10.96.0.4/32", "-p", "udp", "!", "--dport", "53", "-j", "KUBE-SVC-AAAAAAAAAAAAAAAA"]):
        subprocess.run(["ip", "netns", "exec", netns, "iptables-nft", "-t", "nat", "-N", "KUBE-SVC-AAAAAAAAAAAAAAAA"],
                       capture_output=True)
        subprocess.run([*ipt, *rule], check=True)
    assert readback.iptables_nft_ports(4, netns) == set(EXPECTED4)
    # the fixed-offset reading of the expressions that differ per rule agrees with the
    # attribute-by-attribute one wherever it reads one
    fast = 0
    for family in (4, 6):
        for table in ("nat", "filter"):
            for exprs in readback._chain_rules(family, table, "KUBE-SERVICES", netns):
                for _, ex in readback._walk(exprs):
                    op = readback._fast_op(ex)
                    if op is not None:
                        fast += 1
                        assert op == readback._expr_op(ex, family)
    assert fast >= 20
    # a host firewall's rule in the filter table's KUBE-SERVICES that only accepts
    subprocess.run(["ip", "netns", "exec", netns, "iptables-nft", "-t", "filter", "-I", "KUBE-SERVICES",
                    "-d", "10.96.0.9/32", "-p", "tcp", "--dport", "80", "-j", "ACCEPT"], check=True)
    assert readback.iptables_nft_ports(4, netns) == set(EXPECTED4)


def test_no_netlink_reader_for_a_runner_that_is_not_the_kernels():
    assert asyncio.run(IptablesBackend(RecordingRunner(), CFG, 4).programmed_ports()) is None
