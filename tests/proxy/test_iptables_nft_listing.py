"""iptables mode on the nf_tables backend at scale, where the tool loads a full sync (netlink
off, or a text iptnl does not encode): full syncs go in with a `-S` line that makes
iptables-nft-restore fetch the whole table instead of building its quadratic chain list
(apply.whole_table_cache). What the kernel holds afterwards must be exactly what plain
`iptables-nft-restore --noflush` of the same text leaves, other components' chains and rules
included, and traffic must still reach the backends."""
from __future__ import annotations

import asyncio

import pytest

from clusterdns.config import Config
from clusterdns.model import Endpoint, EndpointPort, EndpointSlice, Namespace, Service, ServicePort
from clusterdns.proxy import iptables, iptsave
from clusterdns.proxy.apply import (
    WHOLE_TABLE_FROM,
    IptablesExecutor,
    RecordingRunner,
    SubprocessRunner,
    whole_table_cache,
)
from clusterdns.proxy.proxier import IptablesBackend
from clusterdns.state import state_from_records
from tests.nslib import connect, requires, sh

CFG = Config.from_options(node_name="node-a", node_ips=("192.168.49.2",), cluster_cidrs=("10.161.0.0/16",))

# What other components keep in the same tables: a CNI's hostport chain and jump, kubelet's
# KUBE-FIREWALL, a host firewall's chain, jumps and policy. All of it must survive our syncs.
FOREIGN = """*nat
:CNI-HOSTPORT-DNAT - [0:0]
:CNI-HOSTPORT-SETMARK - [0:0]
-A PREROUTING -m addrtype --dst-type LOCAL -j CNI-HOSTPORT-DNAT
-A OUTPUT -m addrtype --dst-type LOCAL -j CNI-HOSTPORT-DNAT
-A POSTROUTING -s 10.88.0.0/16 ! -d 10.88.0.0/16 -j MASQUERADE
-A CNI-HOSTPORT-DNAT -p tcp -m tcp --dport 8443 -j DNAT --to-destination 10.88.0.5:443
-A CNI-HOSTPORT-SETMARK -j MARK --set-xmark 0x2000/0x2000
COMMIT
*filter
:HOST-FW - [0:0]
:KUBE-FIREWALL - [0:0]
-A INPUT -j HOST-FW
-A INPUT -j KUBE-FIREWALL
-A OUTPUT -j KUBE-FIREWALL
-A HOST-FW -p tcp -m tcp --dport 22 -j ACCEPT
-A HOST-FW -s 198.51.100.0/24 -j DROP
-A KUBE-FIREWALL ! -s 127.0.0.0/8 -d 127.0.0.0/8 -m comment --comment "block incoming localnet connections" -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP
COMMIT
"""


def state_of(n: int, endpoints: int = 10, shift: int = 0, skip: int = -1, moved: int = -1):
    """n Services of `endpoints` endpoints each: enough chains for the listing (n=40: 440);
    Service `skip` left out, Service `moved`'s endpoints shifted by two more."""
    recs = [("Namespace", Namespace("ns"))]
    for i in range(n):
        if i == skip:
            continue
        recs.append(("Service", Service("ns", f"s{i}", "ClusterIP", (f"10.96.{i // 250}.{i % 250 + 1}",),
                                        ports=(ServicePort("http", "TCP", 80, target_port=8080),))))
        extra = 2 if i == moved else 0
        eps = tuple(Endpoint((f"10.161.{i}.{j + 1 + shift + extra}",), node_name="node-b") for j in range(endpoints))
        recs.append(("EndpointSlice", EndpointSlice("ns", f"s{i}-1", f"s{i}", "IPv4", eps,
                                                    (EndpointPort("http", "TCP", 8080),))))
    return state_from_records(recs)


def save(ns: str) -> dict[str, tuple[dict[str, str], list[str]]]:
    """iptables-nft-save by table: its chains with policies and its rules in order."""
    return {name: (dict(t.chains), [r.line for r in t.rules])
            for name, t in iptsave.read(sh("iptables-nft-save", ns=ns)).items()}


# ------------------------------------------------------------------ the text

def test_listing_keeps_every_line_and_puts_base_chain_commands_first():
    text = iptables.render(state_of(40), CFG, 4).text
    listed = whole_table_cache(text)
    assert sorted(listed.splitlines()) == sorted(text.splitlines() + ["-S"])   # only the nat table is big
    nat = listed[listed.index("*nat\n"):].splitlines()
    at = nat.index("-S")
    # before it: the jumps from base chains and the declarations of the chains they jump to, nothing else
    assert nat[1:at] == [":KUBE-SERVICES - [0:0]", ":KUBE-POSTROUTING - [0:0]",
                         *[line for line in text[text.index("*nat\n"):].splitlines() if line.startswith("-I ")]]
    # after it, every other line in its own order
    rest = [line for line in text[text.index("*nat\n"):].splitlines()[1:] if line not in nat[1:at]]
    assert nat[at + 1:] == rest
    # the render writes the same text itself when asked
    rs = iptables.render(state_of(40), CFG, 4, listing=True)
    assert rs.listed and rs.text == listed


def test_small_tables_and_late_declarations_are_left_alone():
    small = iptables.render(state_of(3), CFG, 4).text
    assert whole_table_cache(small) == small
    assert not iptables.render(state_of(3), CFG, 4, listing=True).listed
    decls = "".join(f":KUBE-SEP-{i:016d} - [0:0]\n" for i in range(WHOLE_TABLE_FROM))
    late = f"*nat\n{decls}-A KUBE-SEP-{0:016d} -j RETURN\n:KUBE-LATE - [0:0]\nCOMMIT\n"
    assert whole_table_cache(late) == late      # moving a declaration would flush after the rule
    ok = f"*nat\n{decls}-A KUBE-SEP-{0:016d} -j RETURN\nCOMMIT\n"
    assert whole_table_cache(ok) == f"*nat\n-S\n{decls}-A KUBE-SEP-{0:016d} -j RETURN\nCOMMIT\n"


def test_executor_lists_only_full_texts_on_the_nft_backend():
    text = iptables.render(state_of(40), CFG, 4).text
    for backend, full, lists in (("nft", True, True), ("nft", False, False), ("legacy", True, False)):
        runner = RecordingRunner()
        exe = IptablesExecutor(runner, 4, backend)
        asyncio.run(exe.restore(text, full=full))
        (argv, stdin), = runner.calls
        assert argv == (f"iptables-{backend}-restore", "-w", "5", "--noflush", "--counters")
        assert (stdin == whole_table_cache(text)) is lists and (stdin == text) is not lists


# ------------------------------------------------------------------ the kernel

async def _full(backend: IptablesBackend, state) -> None:
    await backend.sync(state, None, 0.0)


@pytest.mark.root
@requires("iptables-nft-restore", "iptables-nft-save")
def test_full_syncs_leave_what_plain_noflush_leaves_and_keep_others_rules(namespaces):
    ours, plain = namespaces.add("ours"), namespaces.add("plain")
    for ns in (ours, plain):
        sh("iptables-nft-restore", "--noflush", ns=ns, input=FOREIGN)
        sh("iptables-nft", "-P", "FORWARD", "DROP", ns=ns)
    foreign = save(ours)
    ipt = IptablesBackend(SubprocessRunner(prefix=("ip", "netns", "exec", ours)), CFG, 4)
    ipt.exe.backend, ipt.exe.netlink = "nft", False   # the tool, listed (netlink: test_iptnl.py)
    # the same proxier on plain `iptables-nft-restore --noflush` of the texts kube-proxy would write
    ref = IptablesBackend(SubprocessRunner(prefix=("ip", "netns", "exec", plain)), CFG, 4)
    ref.exe.backend, ref.exe.list_tables, ref.exe.netlink = "nft", False, False
    restores: list[str] = []
    real = SubprocessRunner.run

    async def spy(self, argv, stdin=None):
        if any(a.endswith("-restore") for a in argv) and stdin:
            restores.append(stdin)
        return await real(self, argv, stdin)

    # a first full sync (the jumps inserted), then one of a changed state (stale chains removed,
    # endpoint chains renamed), then a partial sync reading the kernel back
    first, second = state_of(40), state_of(40, shift=3, skip=7)
    SubprocessRunner.run = spy
    try:
        asyncio.run(_full(ipt, first))
        asyncio.run(_full(ref, first))
        assert save(ours) == save(plain)
        asyncio.run(_full(ipt, second))
        asyncio.run(_full(ref, second))
    finally:
        SubprocessRunner.run = real
    # the listed texts went to ours, the plain ones to the reference
    assert sum("\n-S\n" in t for t in restores) == 2 and sum("\n-S\n" not in t for t in restores) >= 2
    after = save(ours)
    assert after == save(plain)
    assert not any("s7" in line for line in after["nat"][1])   # the removed Service is gone
    # everything the other components had is still there, in its order, with the policy
    for table, (chains, rules) in foreign.items():
        for chain in ("CNI-HOSTPORT-DNAT", "CNI-HOSTPORT-SETMARK", "HOST-FW", "KUBE-FIREWALL"):
            if chain in chains:
                assert after[table][0][chain] == "-"
        mine = [r for r in after[table][1] if r in rules]
        assert mine == rules, table
    assert after["filter"][0]["FORWARD"] == "DROP"

    third = state_of(40, shift=3, skip=7, moved=3)
    asyncio.run(ipt.sync(third, {("ns", "s3")}, 1.0))
    asyncio.run(ref.sync(third, {("ns", "s3")}, 1.0))
    got = save(ours)
    assert got == save(plain)
    dnat = [line for line in got["nat"][1] if "--to-destination 10.161.3." in line]
    assert sorted(line.rsplit(".", 1)[1] for line in dnat) == sorted(f"{j + 6}:8080" for j in range(10))


@pytest.mark.root
@requires("iptables-nft-restore", "iptables-nft-save")
def test_traffic_reaches_the_backend_after_a_listed_full_sync(namespaces):
    """A node routing to a pod: the node's connection to a ClusterIP is DNATed to the pod's
    backend by rules that went in listed, beside the other components' rules."""
    node, pod = namespaces.add("node"), namespaces.add("pod")
    namespaces.veth(node, "vp0", pod, "eth0")
    namespaces.routed_pod(node, "vp0", pod, "10.161.200.10", gw="10.161.0.1")
    namespaces.backend(pod, "pod0", tcp_port=8080)
    sh("ip", "route", "add", "10.96.0.0/12", "dev", "vp0", ns=node)     # ClusterIPs are routed off-node
    sh("iptables-nft-restore", "--noflush", ns=node, input=FOREIGN)
    base = state_of(40)
    recs = [("Namespace", Namespace("ns"))]
    recs += [("Service", s) for s in base.services.values()]
    recs += [("EndpointSlice", s) for s in base.slices.values()]
    recs.append(("Service", Service("ns", "web", "ClusterIP", ("10.96.9.9",),
                                    ports=(ServicePort("http", "TCP", 80, target_port=8080),))))
    recs.append(("EndpointSlice", EndpointSlice("ns", "web-1", "web", "IPv4",
                                                (Endpoint(("10.161.200.10",), node_name="node-a"),),
                                                (EndpointPort("http", "TCP", 8080),))))
    ipt = IptablesBackend(SubprocessRunner(prefix=("ip", "netns", "exec", node)), CFG, 4)
    ipt.exe.backend, ipt.exe.netlink = "nft", False
    asyncio.run(_full(ipt, state_from_records(recs)))
    assert ipt.previous is not None and ipt.previous.listed   # the text went in listed
    got = connect(node, "tcp", "10.96.9.9", 80, 3)
    assert [a[0] for a in got["answers"]] == ["pod0"] * 3, got
    # the foreign jump is still first-class: the CNI's DNAT chain is still jumped to
    nat = iptsave.read(sh("iptables-nft-save", "-t", "nat", ns=node))["nat"]
    assert "-m addrtype --dst-type LOCAL -j CNI-HOSTPORT-DNAT" in [r.spec for r in nat.rules_of("PREROUTING")]


@pytest.mark.root
@requires("iptables-nft-restore", "nft")
def test_table_listed_reads_tables_over_netlink_without_nft(namespaces):
    """The leftovers check after the first full sync asks whether an nftables-mode table is there:
    `nft list tables` would load every iptables-nft rule first (minutes at 10,000 Services),
    so it must not run when netlink can answer."""
    from clusterdns.proxy.apply import NftExecutor

    ns = namespaces.add("tables")
    sh("iptables-nft-restore", "--noflush", ns=ns, input=FOREIGN)

    class Counting(SubprocessRunner):
        calls: list = []

        async def run(self, argv, stdin=None):
            self.calls.append(tuple(argv))
            return await super().run(argv, stdin)

    runner = Counting(prefix=("ip", "netns", "exec", ns))
    v4, v6 = NftExecutor(runner, 4), NftExecutor(runner, 6)
    assert asyncio.run(v4.table_listed()) is False
    assert asyncio.run(v4.table_listed("nat")) is True        # iptables-nft's own table
    sh("nft", "add", "table", "ip", "kube-proxy", ns=ns)
    assert asyncio.run(v4.table_listed()) is True
    assert asyncio.run(v6.table_listed()) is False
    assert runner.calls == []
    # a runner that is not ours to bypass still asks nft
    rec = RecordingRunner()
    asyncio.run(NftExecutor(rec, 4).table_listed())
    assert rec.commands() == ["nft list tables ip"]
