"""Agent restarts against a real kernel in a network namespace.

The agents run in this process; every tool they start (iptables-save/-restore,
conntrack) runs inside a scratch namespace (`ip netns exec`). Endpoints are
addresses on the namespace's lo, ClusterIPs are routed into a portless bridge,
so only the proxier's DNAT makes a connection to a ClusterIP reach an endpoint
(the namespace's own OUTPUT path: no pods needed).

- rules in place from a first agent, a second one answers the Services whose
  rules are still in the kernel from its first query, before its own first sync
  (held back here), and a Service changed while no agent ran waits for that sync;
- a UDP flow DNATed to an endpoint that went away while no agent ran is deleted
  after the restart; flows to endpoints that stay are kept;
- a crash (the first agent a real process, SIGKILLed), in nftables and iptables
  mode: the next agent answers from the kernel's ports alone (read over netlink;
  endpoint names wait for its first sync), and a Service whose rules were removed
  from the kernel meanwhile is not answered before that sync puts them back.
"""
from __future__ import annotations

import asyncio
import gc
import logging
import subprocess
import sys
import time

import pytest

from clusterdns.agent import Agent
from clusterdns.config import load
from clusterdns.model import Endpoint, EndpointPort, EndpointSlice, Namespace, Service, ServicePort
from clusterdns.proxy.apply import SubprocessRunner
from clusterdns.proxy.proxier import IptablesBackend, NftablesBackend
from clusterdns.synthetic import to_manifest
from tests.common import dns_ask, shown_eps
from tests.nslib import requires, sh

pytestmark = [pytest.mark.root, requires("iptables-nft-restore", "conntrack")]

ENDPOINTS = ("10.0.0.1", "10.0.0.2", "10.0.0.3")


@pytest.fixture
def node(namespaces):
    name = namespaces.add("node")
    for ip in ENDPOINTS:
        sh("ip", "addr", "add", f"{ip}/32", "dev", "lo", ns=name)
    sh("ip", "link", "add", "void0", "type", "bridge", ns=name)
    sh("ip", "link", "set", "void0", "up", ns=name)
    sh("ip", "addr", "add", "192.168.77.2/24", "dev", "void0", ns=name)
    sh("ip", "route", "add", "10.96.0.0/12", "dev", "void0", ns=name)
    return name


class Gate(SubprocessRunner):
    """The namespace's tools, with rule restores held until `open` is set (a slow first sync).
    Netlink reads go to the namespace too (the runner is the kernel's)."""

    def __init__(self, ns: str) -> None:
        super().__init__(prefix=("ip", "netns", "exec", ns))
        self.open = asyncio.Event()
        self.open.set()

    async def run(self, argv, stdin=None):
        argv = tuple(argv)
        if "restore" in argv[0]:
            await self.open.wait()
        return await super().run(argv, stdin)


def write(path, services):
    """services: {name: (cluster_ip, [endpoint ips], protocol)}: port 80 -> 8080 (UDP: 53 -> 5353)."""
    recs = [("Namespace", Namespace("ns"))]
    for name, (ip, ips, proto) in services.items():
        port, target = (80, 8080) if proto == "TCP" else (53, 5353)
        recs.append(("Service", Service("ns", name, cluster_ips=(ip,),
                                        ports=(ServicePort("p", proto, port, target_port=target),))))
        recs.append(("EndpointSlice", EndpointSlice("ns", f"{name}-1", name, "IPv4",
                                                    tuple(Endpoint((a,)) for a in ips),
                                                    (EndpointPort("p", proto, target),))))
    tmp = path.with_suffix(".tmp")
    tmp.write_text(to_manifest(recs))
    tmp.replace(path)


def agent_args(path, mode="iptables", listen="127.0.0.1:0"):
    return ["agent", "--manifest", str(path), "--proxy-mode", mode, "--apply",
            "--listen", listen, "--no-upstream", "--health-listen", "none",
            "--metrics-listen", "none", "--proxy-metrics-listen", "none", "--lameduck", "0",
            "--min-sync-period", "0",
            "--node-ip", "192.168.77.2", "--cluster-cidr", "10.0.0.0/8"]


def config(path, mode="iptables"):
    return load(agent_args(path, mode), env={})


async def ask(port, name):
    rcode, answers, _ = await dns_ask(port, f"{name}.ns.svc.cluster.local.")
    return rcode, sorted(answers)


async def start(path, runner, mode="iptables"):
    agent = Agent(config(path, mode), executor=runner)
    await agent.start()
    return agent, agent.dns.bound[0][1]


async def synced(agent, timeout=20.0):
    assert await agent.proxier.wait_synced(timeout=timeout), "no rule sync"


def connects(ns, ip, port=80) -> bool:
    code = ("import socket,sys\ns=socket.socket();s.settimeout(1)\n"
            f"sys.exit(0 if s.connect_ex(('{ip}',{port}))==0 else 1)")
    return subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", code]).returncode == 0


def listen_tcp(ns):
    """A listener on every endpoint address, port 8080 (a connect proves the DNAT)."""
    code = ("import socket,time\nss=[]\n"
            f"for ip in {list(ENDPOINTS)!r}:\n"
            "    s=socket.socket();s.setsockopt(1,2,1);s.bind((ip,8080));s.listen(64);ss.append(s)\n"
            "print('up',flush=True)\ntime.sleep(120)\n")
    p = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "up"
    return p


async def test_restart_answers_from_the_first_query_and_waits_for_changed_services(node, tmp_path):
    path = tmp_path / "cluster.json"
    write(path, {"a": ("10.96.0.5", ["10.0.0.1"], "TCP"),
                 "b": ("10.96.0.6", ["10.0.0.2"], "TCP"),
                 "c": ("10.96.0.7", ["10.0.0.1", "10.0.0.3"], "TCP")})
    backends = listen_tcp(node)
    try:
        first, port = await start(path, Gate(node))
        try:
            await synced(first)
            assert (await ask(port, "a")) == ("NOERROR", ["10.96.0.5"])
        finally:
            await first.stop()
        assert connects(node, "10.96.0.5")            # the rules stay in the kernel

        # While no agent runs: b moves, c loses an endpoint, d is created.
        write(path, {"a": ("10.96.0.5", ["10.0.0.1"], "TCP"),
                     "b": ("10.96.0.16", ["10.0.0.2"], "TCP"),
                     "c": ("10.96.0.7", ["10.0.0.1"], "TCP"),
                     "d": ("10.96.0.8", ["10.0.0.3"], "TCP")})
        gate = Gate(node)
        gate.open.clear()                              # the new agent's first sync cannot finish yet
        second, port = await start(path, gate)
        try:
            # The very first query is answered from the kernel's rules...
            assert (await ask(port, "a")) == ("NOERROR", ["10.96.0.5"])
            assert second.proxier.syncs == 0 and second.view.adopting
            assert not gc.isenabled()        # no collections while DNS answers before the first sync
            assert (await ask(port, "c")) == ("NOERROR", ["10.96.0.7"])
            # only the ports were read from the kernel: c's endpoints wait for the sync (the
            # one removed while down is never shown)
            assert shown_eps(second.view, "c") == []
            # ...a Service changed while down is not shown at its old address, a new one waits.
            assert (await ask(port, "b"))[0] == "SERVFAIL"
            assert (await ask(port, "d"))[0] == "SERVFAIL"
            assert second.view.adopted == 2
            gate.open.set()
            await synced(second)
            assert gc.isenabled()            # the first sync froze what it built; collections resume
            assert (await ask(port, "b")) == ("NOERROR", ["10.96.0.16"])
            assert (await ask(port, "d")) == ("NOERROR", ["10.96.0.8"])
            assert not second.view.adopting
            assert shown_eps(second.view, "c") == ["10.0.0.1"]
            assert connects(node, "10.96.0.16") and connects(node, "10.96.0.8")
            assert not connects(node, "10.96.0.6")      # the old address's rules are gone
        finally:
            await second.stop()
    finally:
        backends.kill()
        backends.wait()


async def test_cold_node_answers_servfail_until_the_first_sync(node, tmp_path):
    path = tmp_path / "cluster.json"
    write(path, {"a": ("10.96.0.5", ["10.0.0.1"], "TCP")})
    gate = Gate(node)
    gate.open.clear()
    agent, port = await start(path, gate)
    try:
        assert not agent.view.adopting                  # nothing in the kernel to adopt
        assert (await ask(port, "a"))[0] == "SERVFAIL"
        gate.open.set()
        await synced(agent)
        assert (await ask(port, "a")) == ("NOERROR", ["10.96.0.5"])
    finally:
        await agent.stop()


def udp_flows(ns, ip, port, sports):
    """One datagram from each source port to ip:port (the node's own OUTPUT path: DNATed there)."""
    code = ("import socket\n"
            f"for sp in {list(sports)!r}:\n"
            "    s=socket.socket(socket.AF_INET,socket.SOCK_DGRAM);s.bind(('192.168.77.2',sp))\n"
            f"    s.sendto(b'x',('{ip}',{port}));s.close()\n")
    subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", code], check=True)


def flows_by_target(ns, ip):
    """DNAT target -> number of UDP conntrack entries whose original destination is ip."""
    out: dict[str, int] = {}
    for line in sh("conntrack", "-L", "-p", "udp", "-d", ip, ns=ns).splitlines():
        srcs = [w[4:] for w in line.split() if w.startswith("src=")]
        if len(srcs) >= 2:
            out[srcs[1]] = out.get(srcs[1], 0) + 1
    return out


async def test_flow_to_an_endpoint_removed_while_down_is_gone_after_restart(node, tmp_path):
    path = tmp_path / "cluster.json"
    write(path, {"u": ("10.96.0.9", ["10.0.0.1", "10.0.0.2"], "UDP")})
    first, _ = await start(path, Gate(node))
    try:
        await synced(first)
    finally:
        await first.stop()
    udp_flows(node, "10.96.0.9", 53, range(40001, 40041))
    before = flows_by_target(node, "10.96.0.9")
    assert set(before) == {"10.0.0.1", "10.0.0.2"}, before    # both endpoints got flows

    write(path, {"u": ("10.96.0.9", ["10.0.0.1"], "UDP")})      # 10.0.0.2 went away while down
    second, _ = await start(path, Gate(node))
    try:
        await synced(second)
        after = flows_by_target(node, "10.96.0.9")
        assert after == {"10.0.0.1": before["10.0.0.1"]}, after  # only the dead endpoint's flows went
    finally:
        await second.stop()


def remove_rules(ns, mode, ip):
    """Delete the ClusterIP's entry point from the kernel behind the agents' backs."""
    if mode == "nftables":
        sh("nft", "delete", "element", "ip", "kube-proxy", "service-ips", f"{{ {ip} . tcp . 80 }}", ns=ns)
        return
    for line in sh("iptables-nft", "-t", "nat", "-S", "KUBE-SERVICES", ns=ns).splitlines():
        if f"-d {ip}/32" in line:
            sh("sh", "-c", f"iptables-nft -t nat {line.replace('-A ', '-D ', 1)}", ns=ns)


@pytest.mark.parametrize("mode", ["nftables", "iptables"])
async def test_crash_restart_answers_what_the_kernel_holds_before_its_first_sync(node, tmp_path, monkeypatch,
                                                                                caplog, mode):
    path = tmp_path / "cluster.json"
    services = {"a": ("10.96.0.5", ["10.0.0.1"], "TCP"), "b": ("10.96.0.6", ["10.0.0.2"], "TCP"),
                "c": ("10.96.0.7", ["10.0.0.3"], "TCP")}
    write(path, services)
    backends = listen_tcp(node)
    first = subprocess.Popen(["ip", "netns", "exec", node, sys.executable, "-m", "clusterdns",
                              *agent_args(path, mode, "127.0.0.1:5399")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not all(connects(node, ip) for ip, _, _ in services.values()):
            assert first.poll() is None and time.monotonic() < deadline, "the first agent never programmed"
            time.sleep(0.2)
        first.kill()                           # a crash: nothing drains, the rules stay
        first.wait(10)
        remove_rules(node, mode, "10.96.0.7")  # c's rules are gone from the kernel
        assert not connects(node, "10.96.0.7")
        write(path, {**services, "d": ("10.96.0.8", ["10.0.0.3"], "TCP")})   # d: never programmed

        hold = asyncio.Event()                 # the second agent's first sync waits for this
        cls = NftablesBackend if mode == "nftables" else IptablesBackend
        sync = cls.sync

        async def held(self, *args, **kwargs):
            await hold.wait()
            return await sync(self, *args, **kwargs)
        monkeypatch.setattr(cls, "sync", held)
        caplog.set_level(logging.INFO, logger="clusterdns")
        second, port = await start(path, SubprocessRunner(prefix=("ip", "netns", "exec", node)), mode)
        try:
            assert (await ask(port, "a")) == ("NOERROR", ["10.96.0.5"])     # the first query
            assert (await ask(port, "b")) == ("NOERROR", ["10.96.0.6"])
            assert connects(node, "10.96.0.5") and connects(node, "10.96.0.6")   # the answers work
            assert (await ask(port, "c"))[0] == "SERVFAIL"     # its rules are not in the kernel
            assert (await ask(port, "d"))[0] == "SERVFAIL"
            assert second.proxier.syncs == 0 and second.view.adopted == 2
            assert any("endpoints not read yet" in r.getMessage() for r in caplog.records)  # the ports alone
            assert shown_eps(second.view, "a") == []        # endpoint names wait for the sync
            hold.set()
            await synced(second)
            assert shown_eps(second.view, "a") == ["10.0.0.1"]
            assert (await ask(port, "c")) == ("NOERROR", ["10.96.0.7"])
            assert (await ask(port, "d")) == ("NOERROR", ["10.96.0.8"])
            assert connects(node, "10.96.0.7") and connects(node, "10.96.0.8")
        finally:
            await second.stop()
    finally:
        if first.poll() is None:
            first.kill()
            first.wait(10)
        backends.kill()
        backends.wait()
