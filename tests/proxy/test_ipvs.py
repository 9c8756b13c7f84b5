"""IPVS mode: the generated ipvsadm-restore, ipset and iptables inputs; real ipset/iptables in a namespace."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from clusterdns.config import Config
from clusterdns.model import LOAD_BALANCER, Endpoint, EndpointPort, EndpointSlice, Service, ServicePort
from clusterdns.proxy import ipvs
from clusterdns.sources.manifest import DEMO_MANIFEST
from clusterdns.state import state_from_records
from tests.demo import demo_state
from tests.nslib import requires

CFG = Config.from_options(command="rules", node_name="node-a", node_ips=("192.168.49.2",), cluster_cidrs=("10.161.0.0/16",))


def vs_by_key(conf):
    return {s.key: s for s in conf.virtual_servers}


def test_demo_virtual_servers():
    conf = ipvs.render(demo_state(), CFG, 4)
    servers = vs_by_key(conf)
    dns = servers["-u 172.20.0.10:53"]
    assert [(r.ip, r.port, r.weight) for r in dns.reals] == [("10.161.0.2", 53, 1), ("10.161.0.3", 53, 1)]
    assert len(servers["-t 172.20.36.232:8080"].reals) == 74
    # NodePort on the node address, externalIP, both with every ready endpoint (eTP Cluster)
    assert [r.ip for r in servers["-t 192.168.49.2:31218"].reals] == ["10.161.34.10", "10.161.34.11"]
    assert [r.ip for r in servers["-t 192.0.2.50:8080"].reals] == ["10.161.34.10", "10.161.34.11"]
    # the LB service: eTP Local -> only node-a's endpoint outside; ClientIP -> persistence
    lb = servers["-t 203.0.113.10:80"]
    assert lb.persistence == 10800 and [r.ip for r in lb.reals] == ["10.161.34.10"]
    assert [r.ip for r in servers["-t 172.20.60.6:80"].reals] == ["10.161.34.10", "10.161.34.11"]
    assert "-A -t 203.0.113.10:80 -s rr -p 10800" in conf.ipvsadm.splitlines()
    assert "-a -t 172.20.0.1:443 -r 192.168.49.2:6443 -m -w 1" in conf.ipvsadm.splitlines()
    # headless and ExternalName services get nothing
    assert not any("35." in k for k in servers)
    assert conf.addresses == ("172.20.0.1", "172.20.0.10", "172.20.36.232", "172.20.41.17", "172.20.50.5",
                              "172.20.60.6", "192.0.2.50", "203.0.113.10")


def test_demo_ipsets():
    conf = ipvs.render(demo_state(), CFG, 4)
    e = conf.set_entries
    assert "172.20.0.10,udp:53" in e["KUBE-CLUSTER-IP"]
    assert e["KUBE-EXTERNAL-IP"] == {"192.0.2.50,tcp:8080"}
    assert e["KUBE-LOAD-BALANCER"] == e["KUBE-LOAD-BALANCER-LOCAL"] == e["KUBE-LOAD-BALANCER-FW"] == \
        {"203.0.113.10,tcp:80"}
    assert e["KUBE-LOAD-BALANCER-SOURCE-CIDR"] == {"203.0.113.10,tcp:80,198.51.100.0/24"}
    assert e["KUBE-NODE-PORT-TCP"] == {"30080", "31218"} and e["KUBE-NODE-PORT-LOCAL-TCP"] == {"30080"}
    assert e["KUBE-HEALTH-CHECK-NODE-PORT"] == {"32000"}
    assert e["KUBE-IPVS-IPS"] == set(conf.addresses)
    # hairpin entries only for endpoints on this node
    assert "10.161.0.2,udp:53,10.161.0.2" in e["KUBE-LOOP-BACK"]
    assert not any(x.startswith("10.161.0.3,") for x in e["KUBE-LOOP-BACK"])
    assert "create KUBE-NODE-PORT-TCP bitmap:port range 0-65535 -exist" in conf.ipsets
    assert "add KUBE-CLUSTER-IP 172.20.0.10,udp:53 -exist" in conf.ipsets


def test_iptables_rules():
    conf = ipvs.render(demo_state(), CFG, 4)
    lines = conf.iptables.splitlines()
    assert ('-A KUBE-SERVICES -m comment --comment "Kubernetes service cluster ip + port for masquerade purpose" '
            "-m set --match-set KUBE-CLUSTER-IP dst,dst ! -s 10.161.0.0/16 -j KUBE-MARK-MASQ") in lines
    assert "-A KUBE-SERVICES -m addrtype --dst-type LOCAL -j KUBE-NODE-PORT" in lines
    # the eTP Local NodePort RETURNs before the masquerade rule
    np = [x for x in lines if x.startswith("-A KUBE-NODE-PORT -p tcp")]
    assert "LOCAL-TCP" in np[0] and np[1].endswith("-j KUBE-MARK-MASQ")
    assert lines.index("-A KUBE-SERVICES -m set --match-set KUBE-CLUSTER-IP dst,dst -j ACCEPT") > \
        lines.index("-A KUBE-SERVICES -m addrtype --dst-type LOCAL -j KUBE-NODE-PORT")
    no_detector = ipvs.render(demo_state(), CFG.with_options(cluster_cidrs=()), 4).iptables
    assert "-m set --match-set KUBE-CLUSTER-IP src,dst -j KUBE-MARK-MASQ" in no_detector
    masq_all = ipvs.render(demo_state(), CFG.with_options(masquerade_all=True), 4).iptables
    assert "-m set --match-set KUBE-CLUSTER-IP dst,dst -j KUBE-MARK-MASQ" in masq_all


def test_ipv6_names_and_addresses():
    conf = ipvs.render(demo_state(), CFG, 6)
    assert conf.addresses == ("fd00:20::5",)
    assert "-A -t [fd00:20::5]:80 -s rr" in conf.ipvsadm
    assert "-a -t [fd00:20::5]:80 -r [fd00:161::2]:8080 -m -w 1" in conf.ipvsadm
    assert "create KUBE-6-CLUSTER-IP hash:ip,port family inet6" in conf.ipsets
    assert "KUBE-CLUSTER-IP " not in conf.ipsets
    assert "--match-set KUBE-6-CLUSTER-IP" in conf.iptables and "-s ::1/128 -j RETURN" in conf.iptables
    assert ipvs.set_name("KUBE-NODE-PORT-LOCAL-SCTP-HASH", 6) == "KUBE-6-NODE-PORT-LOCAL-SCTP-HAS"


def test_local_policies_and_scheduler():
    svc = Service("ns1", "svc1", LOAD_BALANCER, ("172.30.0.41",), ports=(ServicePort("p80", "UDP", 80, 3001),),
                  lb_ips=("5.6.7.8",), internal_local=True, external_local=True, lb_source_ranges=("192.168.0.0/16",))
    sl = EndpointSlice("ns1", "s", "svc1", "IPv4", (Endpoint(("10.0.0.1",), node_name="node-a"),
                                                    Endpoint(("10.0.0.2",), node_name="node-b")),
                       (EndpointPort("p80", "UDP", 8080),))
    st = state_from_records([("Service", svc), ("EndpointSlice", sl)])
    conf = ipvs.render(st, CFG.with_options(node_ips=("192.168.0.2",)), 4, scheduler="lc")
    servers = vs_by_key(conf)
    assert {k: [r.ip for r in v.reals] for k, v in servers.items()} == {
        "-u 172.30.0.41:80": ["10.0.0.1"], "-u 5.6.7.8:80": ["10.0.0.1"], "-u 192.168.0.2:3001": ["10.0.0.1"]}
    assert all(s.scheduler == "lc" for s in servers.values())
    # the node is inside the source range: the LB IP itself is allowed as a source
    assert conf.set_entries["KUBE-LOAD-BALANCER-SOURCE-IP"] == {"5.6.7.8,udp:80,5.6.7.8"}
    assert conf.set_entries["KUBE-NODE-PORT-LOCAL-UDP"] == {"3001"}
    with pytest.raises(ValueError):
        ipvs.render(st, CFG, 4, scheduler="random")


def test_rules_command_prints_three_sections(capsys):
    from clusterdns.cli import main
    assert main(["rules", "--mode", "ipvs", "--manifest", DEMO_MANIFEST, "--node-name", "node-a"]) == 0
    out = capsys.readouterr().out
    for header in ("# ipvsadm-restore input", "# ipset restore input", "# iptables-restore --noflush input",
                   "# addresses on kube-ipvs0"):
        assert header in out


# ---------------------------------------------------------------- real tools

needs_netns = requires()


def run(ns, argv, text):
    return subprocess.run(["ip", "netns", "exec", ns] + argv, input=text, capture_output=True, text=True)


@needs_netns
@pytest.mark.skipif(shutil.which("ipset") is None, reason="ipset is not installed")
def test_ipsets_and_iptables_accepted(netns):
    for family in (4, 6):
        conf = ipvs.render(demo_state(), CFG, family)
        for _ in range(2):   # a second sync over the first must also apply
            r = run(netns, ["ipset", "restore"], conf.ipsets)
            assert r.returncode == 0, r.stderr
        tool = "ip6tables-restore" if family == 6 else "iptables-restore"
        r = run(netns, [tool, "--noflush"], conf.iptables)
        assert r.returncode == 0, r.stderr
    listed = run(netns, ["ipset", "list", "KUBE-CLUSTER-IP"], "").stdout
    assert "172.20.0.10,udp:53" in listed
    # cleanup: iptables first (the rules hold references to the sets), then the sets
    from clusterdns.proxy import iptables
    for family, tool in ((4, "iptables"), (6, "ip6tables")):
        saved = run(netns, [f"{tool}-save"], "").stdout
        r = run(netns, [f"{tool}-restore", "--noflush"], iptables.cleanup_saved(saved))
        assert r.returncode == 0, r.stderr
        assert "KUBE-" not in run(netns, [f"{tool}-save"], "").stdout
        r = run(netns, ["ipset", "restore"], ipvs.cleanup(family).ipsets)
        assert r.returncode == 0, r.stderr
    assert run(netns, ["ipset", "list", "-n"], "").stdout.strip() == ""
    assert run(netns, ["ipset", "restore"], ipvs.cleanup(4).ipsets).returncode == 0   # nothing left: still fine


@requires("ipvsadm-restore", ipvs=True)
def test_ipvsadm_restore_in_kernel(netns):
    conf = ipvs.render(demo_state(), CFG, 4)
    r = run(netns, ["ipvsadm-restore"], conf.ipvsadm)
    assert r.returncode == 0, r.stderr
    listed = run(netns, ["ipvsadm", "-Ln"], "").stdout
    assert "172.20.0.10:53" in listed and "10.161.0.2:53" in listed
