"""iptables mode on the nf_tables backend, full syncs sent as one nfnetlink batch (proxy/iptnl.py).

The kernel must hold exactly what `iptables-nft-restore --noflush` of the same text makes: the
kernel's own dump of every table, chain and rule (each expression's attributes) is compared
between a namespace loaded by iptnl and one loaded by the tool, and so is iptables-nft-save.
Other components' chains and rules are there first and must survive; a refused text must leave
the previous rules working; a foreign rule referencing a chain we delete must not stop the sync."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import random

import pytest

from clusterdns.config import Config
from clusterdns.model import (
    LOAD_BALANCER,
    NODE_PORT,
    Endpoint,
    EndpointPort,
    EndpointSlice,
    Namespace,
    Service,
    ServicePort,
)
from clusterdns.proxy import iptables, iptnl, iptsave, nflink
from clusterdns.proxy.apply import ApplyError, SubprocessRunner
from clusterdns.proxy.proxier import IptablesBackend
from clusterdns.state import state_from_records
from tests.nslib import connect, requires, sh

CFG4 = Config.from_options(node_name="node-a", node_ips=("192.168.49.2",), cluster_cidrs=("10.161.0.0/16",))
CFG6 = Config.from_options(node_name="node-a", node_ips=("fd00:49::2",), cluster_cidrs=("fd00:161::/64",))
# an interface-based local-traffic detector writes `-i veth+` / `! -i veth+`
CFG_IFACE = Config.from_options(node_name="node-a", node_ips=("192.168.49.2",), cluster_cidrs=("10.161.0.0/16",),
                                detect_local_mode="InterfaceNamePrefix", pod_interface_name_prefix="veth")

FOREIGN = {4: """*nat
:CNI-HOSTPORT-DNAT - [0:0]
:KUBE-MARK-MASQ - [0:0]
-A PREROUTING -m addrtype --dst-type LOCAL -j CNI-HOSTPORT-DNAT
-A POSTROUTING -s 10.88.0.0/16 ! -d 10.88.0.0/16 -j MASQUERADE
-A CNI-HOSTPORT-DNAT -p tcp -m tcp --dport 8443 -j DNAT --to-destination 10.88.0.5:443
-A CNI-HOSTPORT-DNAT -j KUBE-MARK-MASQ
COMMIT
*filter
:HOST-FW - [0:0]
:KUBE-FIREWALL - [0:0]
-A INPUT -j HOST-FW
-A INPUT -j KUBE-FIREWALL
-A HOST-FW -p tcp -m tcp --dport 22 -j ACCEPT
-A HOST-FW -s 198.51.100.0/24 -j DROP
-A KUBE-FIREWALL ! -s 127.0.0.0/8 -d 127.0.0.0/8 -m comment --comment "block incoming localnet connections" -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP
COMMIT
""", 6: """*nat
:CNI-HOSTPORT-DNAT - [0:0]
-A PREROUTING -m addrtype --dst-type LOCAL -j CNI-HOSTPORT-DNAT
-A CNI-HOSTPORT-DNAT -p tcp -m tcp --dport 8443 -j DNAT --to-destination [fd00:88::5]:443
COMMIT
*filter
:HOST-FW - [0:0]
-A INPUT -j HOST-FW
-A HOST-FW -p tcp -m tcp --dport 22 -j ACCEPT
COMMIT
"""}


def tool(family: int, name: str) -> str:
    base = f"{'iptables' if family == 4 else 'ip6tables'}-nft"
    return f"{base}-{name}" if name else base


def kernel(ns: str, family: int) -> dict:
    """Every table's chains (hook, policy, type) and rules (each expression's attributes, in order),
    as the kernel dumps them; handles aside, counters zeroed (traffic may have counted)."""
    out: dict = {}
    for m in nflink.dump(iptnl.GETCHAIN, family, b"", netns=ns):
        table, chain = m[1][0].rstrip(b"\0").decode(), m[3][0].rstrip(b"\0").decode()
        out.setdefault(table, {})[chain] = [m.get(4), m.get(5), m.get(7)]
    rules: dict = {}
    for table in out:
        for m in nflink.dump(nflink.GETRULE, family, nflink._str(1, table), netns=ns):
            exprs = []
            for e in nflink.attrs(m[4][0])[1]:
                a = nflink.attrs(e)
                name = a[1][0]
                exprs.append((name, b"" if name.startswith(b"counter") else a.get(2, [b""])[0]))
            rules.setdefault((table, m[2][0].rstrip(b"\0").decode()), []).append((exprs, m.get(7)))
    return {"chains": out, "rules": rules}


def saved(ns: str, family: int) -> list[str]:
    return [line for line in sh(tool(family, "save"), ns=ns).splitlines() if not line.startswith("#")]


def same_kernel(a: str, b: str, family: int) -> None:
    ka, kb = kernel(a, family), kernel(b, family)
    assert ka["chains"] == kb["chains"]
    for key in sorted(set(ka["rules"]) | set(kb["rules"])):
        assert ka["rules"].get(key) == kb["rules"].get(key), key
    assert saved(a, family) == saved(b, family)


# ------------------------------------------------------------------ states

def service(i: int, rng: random.Random, family: int) -> Service:
    kind = rng.choice(["ClusterIP", "ClusterIP", NODE_PORT, LOAD_BALANCER])
    ports = [ServicePort("http", "TCP", 80 + rng.randrange(3), node_port=30000 + i if kind != "ClusterIP" else 0)]
    if rng.random() < 0.3:
        ports.append(ServicePort("dns", "UDP", 53, node_port=31000 + i if kind != "ClusterIP" else 0))
    if rng.random() < 0.15:
        ports.append(ServicePort("assoc", "SCTP", 9000, node_port=32000 + i if kind != "ClusterIP" else 0))
    v4 = family == 4
    local = kind != "ClusterIP" and rng.random() < 0.4
    return Service("ns", f"s{i}", kind, (f"10.96.{rng.randrange(2)}.{i + 1}" if v4 else f"fd00:96::{i + 1:x}",),
                   ports=tuple(ports),
                   external_ips=(("192.0.2.9" if v4 else "2001:db8::9"),) if rng.random() < 0.2 else (),
                   lb_ips=((f"203.0.113.{i + 1}" if v4 else f"2001:db8:113::{i + 1:x}"),)
                   if kind == LOAD_BALANCER else (),
                   lb_source_ranges=(("198.51.100.0/24", "0.0.0.0/0", "10.160.0.0/12") if v4
                                     else ("2001:db8:100::/56", "2001:db8:200::/61"))
                   if kind == LOAD_BALANCER and rng.random() < 0.5 else (),
                   external_local=local, health_check_node_port=33000 + i if local and kind == LOAD_BALANCER else 0,
                   internal_local=rng.random() < 0.15,
                   affinity_timeout=600 if rng.random() < 0.2 else 0)


def endpoints(i: int, rng: random.Random, family: int) -> EndpointSlice:
    eps = tuple(Endpoint((f"10.161.{i}.{j}" if family == 4 else f"fd00:161::{i:x}:{j:x}",),
                         ready=rng.random() < 0.85, serving=True, terminating=rng.random() < 0.1,
                         node_name=rng.choice(["node-a", "node-b"]))
                for j in rng.sample(range(1, 9), rng.randrange(0, 5)))
    return EndpointSlice("ns", f"s{i}-1", f"s{i}", "IPv4" if family == 4 else "IPv6", eps,
                         (EndpointPort("http", "TCP", 8080), EndpointPort("dns", "UDP", 5353),
                          EndpointPort("assoc", "SCTP", 9000)))


def records_of(services: dict, slices: dict) -> list:
    recs = [("Namespace", Namespace("ns"))]
    recs += [("Service", s) for s in services.values()]
    recs += [("EndpointSlice", s) for s in slices.values()]
    return recs


def state_of(services: dict, slices: dict):
    return state_from_records(records_of(services, slices))


def backends(ours: str, ref: str, cfg: Config, family: int) -> tuple[IptablesBackend, IptablesBackend]:
    a = IptablesBackend(SubprocessRunner(prefix=("ip", "netns", "exec", ours)), cfg, family)
    a.exe.backend = "nft"
    b = IptablesBackend(SubprocessRunner(prefix=("ip", "netns", "exec", ref)), cfg, family)
    b.exe.backend, b.exe.list_tables, b.exe.netlink = "nft", False, False   # plain --noflush: kube-proxy's call
    return a, b


# ------------------------------------------------------------------ the encoding

CORPUS = {4: """*nat
:X - [0:0]
:Y - [0:0]
-I PREROUTING -m comment --comment "kubernetes service portals" -j X
-I OUTPUT -j X
-A X -i veth+ -j Y
-A X ! -i br0 -j Y
-A X -o eth0 -j Y
-A X -m sctp -p sctp -d 1.2.3.4 --dport 80 -j Y
-A X -m udp -p udp -d 1.2.3.4 --dport 53 -j Y
-A X -m udp -p udp -j DNAT --to-destination 1.2.3.4:53
-A X -m sctp -p sctp -j DNAT --to-destination 1.2.3.4:53
-A X -m recent --name KUBE-SEP-A --rcheck --seconds 600 --reap -j Y
-A X -m recent --name KUBE-SEP-A --set -m tcp -p tcp -j DNAT --to-destination 1.2.3.4:80
-A X -m addrtype --src-type LOCAL -j Y
-A X -m addrtype ! --dst-type LOCAL -j Y
-A X -m addrtype --src-type LOCAL --dst-type LOCAL,UNICAST -j Y
-A X -m mark --mark 0x4000/0x4000 -j Y
-A X ! -o eth+ -j Y
-A X -s 10.160.0.0/12 -j Y
-A X -s 0.0.0.0/0 -j Y
-A X ! -s 10.0.0.0/8 -d 10.96.0.0/16 -j Y
-A X -m comment --comment "x y"
-A X -m comment --comment x
-A X -m statistic --mode random --probability 0.3333333333 -j Y
-A X -m mark ! --mark 0x4000/0x4000 -j RETURN
-A X -j MARK --xor-mark 0x4000
-A X -j MARK --or-mark 0x4000
-A X -j MARK --set-xmark 0x2000/0x2000
-A Y -j ACCEPT
:W - [0:0]
-I POSTROUTING -j W
-A W -j MASQUERADE --random-fully
-A W -j MASQUERADE
COMMIT
*filter
:Z - [0:0]
-I FORWARD -m conntrack --ctstate NEW -j Z
-A Z -j REJECT
-A Z -m tcp -p tcp -d 1.2.3.4 --dport 80 -j REJECT
-A Z -m addrtype --dst-type LOCAL -m tcp -p tcp --dport 30001 -j DROP
-A Z -m conntrack --ctstate INVALID -j DROP
-A Z -m conntrack --ctstate NEW,SNAT,UNTRACKED -j DROP
-A Z -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT
-A Z -d 127.0.0.0/8 ! -s 127.0.0.0/8 -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP
-A Z -m comment --comment "h" -m tcp -p tcp --dport 30002 -j ACCEPT
COMMIT
*mangle
:KUBE-PROXY-CANARY - [0:0]
COMMIT
""", 6: """*nat
:X - [0:0]
:Y - [0:0]
-I POSTROUTING -j Y
-A X -m tcp -p tcp -d fd00::1 --dport 80 -j Y
-A X ! -s fd00:10::/64 -j Y
-A X -s fd00:10::/61 -j Y
-A X -s fd00::5 -j Y
-A X -m udp -p udp -j DNAT --to-destination [fd00::5]:53
-A X -m recent --name KUBE-SEP-A --rcheck --seconds 600 --reap -j Y
-A X -m recent --name KUBE-SEP-A --set -m tcp -p tcp -j DNAT --to-destination [fd00::5]:80
-A Y -j MASQUERADE --random-fully
-A Y -m addrtype --dst-type LOCAL ! -d ::1/128 -j RETURN
COMMIT
*filter
:Z - [0:0]
-A Z -j REJECT
-A Z -m conntrack --ctstate NEW -j ACCEPT
COMMIT
"""}


@pytest.mark.root
@requires(tool(4, "restore"), tool(6, "restore"))
@pytest.mark.parametrize("family", [4, 6])
def test_every_form_the_renderers_write_becomes_the_tools_objects(namespaces, family):
    ours, ref = namespaces.add("ours"), namespaces.add("ref")
    assert iptnl.apply(CORPUS[family], family, netns=ours) == []
    sh(tool(family, "restore"), "--noflush", "--counters", ns=ref, input=CORPUS[family])
    same_kernel(ours, ref, family)
    # and again on top: declared chains flushed, -I jumps inserted before the first
    iptnl.apply(CORPUS[family], family, netns=ours)
    sh(tool(family, "restore"), "--noflush", "--counters", ns=ref, input=CORPUS[family])
    same_kernel(ours, ref, family)


@pytest.mark.parametrize("spec", [
    "-p tcp --dport 80 -j X",                  # an implicit match (the renderers always write -m)
    "-m tcp -p tcp ! --dport 80 -j X",
    "-m tcp -p tcp --dport 80:90 -j X",
    "-m multiport -p tcp --dports 80,81 -j X",
    "-j LOG --log-prefix x",
    "-j REJECT --reject-with tcp-reset",
    "-m comment --comment 'single quoted'",
    "-m statistic --mode nth --every 2 -j X",
    "-g X",
    "-m recent --name A --update -j X",
    "-j DROP",                                 # iptables refuses DROP in nat
])
def test_forms_it_does_not_know_are_refused_before_sending(spec):
    if spec != "-j DROP":
        with pytest.raises(iptnl.Unsupported):
            iptnl.rule(spec, 4)
    text = f"*nat\n:X - [0:0]\n-A X {spec}\nCOMMIT\n"
    with pytest.raises(iptnl.Unsupported):
        iptnl.encode(text, 4, {})
    for bad in ("*nat\n-D X -j RETURN\nCOMMIT\n", "*nat\n:PREROUTING ACCEPT [0:0]\nCOMMIT\n",
                "*security\n:X - [0:0]\nCOMMIT\n", "*nat\n-A UNDECLARED -j RETURN\nCOMMIT\n", "*nat\n:X - [0:0]\n"):
        with pytest.raises(iptnl.Unsupported):
            iptnl.encode(bad, 4, {})


def test_rules_sharing_a_head_keep_their_own_targets():
    """The encoder reuses what rules share (everything before a jump's chain or a DNAT's
    destination; everything after `-s ADDR`): each rule must still get its own expressions."""
    text = ("*filter\n:A - [0:0]\n:B - [0:0]\n-A A -j B\n-A A -j RETURN\n-A A -j DROP\n-A A -j B\n"
            "-A A -s 10.0.0.1 -j B\n-A A -s 10.0.0.2 -j B\n-A A -s 10.0.0.3 -j DROP\n-A A -s 0.0.0.0/0 -p tcp -j B\n"
            "-A A -s 10.0.0.4 -p tcp -j B\nCOMMIT\n"
            "*nat\n:C - [0:0]\n-A C -m tcp -p tcp -j DNAT --to-destination 10.1.0.1:80\n"
            "-A C -m tcp -p tcp -j DNAT --to-destination 10.1.0.2:81\n-A C -j MASQUERADE\nCOMMIT\n")
    batch = iptnl.encode(text, 4, {"filter": {}, "nat": {}})
    rules = 0
    for place, offset in zip(batch.offsets, batch.lines):
        piece, at = batch.pieces[place >> 32], place & 0xFFFFFFFF
        length = int.from_bytes(piece[at:at + 4], "little")
        line = iptnl.line_at(text, offset)
        if line.startswith("-A "):
            body = nflink.attrs(bytes(piece[at + 20:at + length]))
            assert body[4][0] == iptnl.rule(line.split(" ", 2)[2], 4)[0], line
            rules += 1
    assert rules == text.count("-A ")


# ------------------------------------------------------------------ the proxier

@pytest.mark.root
@requires(tool(4, "restore"), tool(6, "restore"))
@pytest.mark.parametrize("family,cfg", [(4, CFG4), (6, CFG6), (4, CFG_IFACE)], ids=["ipv4", "ipv6", "iface"])
def test_full_and_partial_syncs_equal_plain_noflush_beside_other_components(namespaces, family, cfg):
    ours, ref = namespaces.add("ours"), namespaces.add("ref")
    for ns in (ours, ref):
        sh(tool(family, "restore"), "--noflush", ns=ns, input=FOREIGN[family])
        sh(tool(family, ""), "-P", "FORWARD", "DROP", ns=ns)
    foreign = saved(ours, family)
    ipt, plain = backends(ours, ref, cfg, family)
    rng = random.Random(11 + family)
    services = {i: service(i, rng, family) for i in range(40)}
    slices = {i: endpoints(i, rng, family) for i in range(40)}

    async def go():
        await ipt.sync(state_of(services, slices), None, 0.0)
        await plain.sync(state_of(services, slices), None, 0.0)
        assert ipt.exe.last_path == "netlink" and plain.exe.last_path == tool(family, "restore")
        same_kernel(ours, ref, family)
        # a changed state in full: Services gone (their chains deleted), endpoints moved
        for i in range(0, 40, 3):
            services.pop(i)
            slices.pop(i)
        for i in range(1, 40, 4):
            slices[i] = endpoints(i, rng, family)
        services[45] = service(45, rng, family)
        slices[45] = endpoints(45, rng, family)
        await ipt.sync(state_of(services, slices), None, 1.0)
        await plain.sync(state_of(services, slices), None, 1.0)
        assert ipt.exe.last_path == "netlink"
        same_kernel(ours, ref, family)
        # partial syncs on top of the netlink full sync, netlink too: endpoints replaced, a
        # Service's last endpoints gone and back (its KUBE-SERVICES rules deleted by their spec,
        # inserted first), a Service created and one deleted
        emptied = None
        restores = []
        real_restore = ipt.exe.restore

        async def counted(text, **kw):
            restores.append(text)
            await real_restore(text, **kw)
        ipt.exe.restore = counted
        for step in range(10):
            i = rng.choice(sorted(services))
            if step == 3:
                i = next(k for k in sorted(services) if any(e.ready for e in slices[k].endpoints))
                emptied = slices[i]
                slices[i] = dataclasses.replace(slices[i], endpoints=())
            elif step == 4:
                i = int(emptied.service[1:])
                slices[i] = emptied
            elif step == 7:
                services[50 + step] = service(50 + step, rng, family)
                slices[50 + step] = endpoints(50 + step, rng, family)
                i = 50 + step
            elif step == 8:
                services.pop(i)
                slices.pop(i)
            else:
                slices[i] = endpoints(i, rng, family)
            ipt.exe.last_path = ""
            before = len(restores)
            await ipt.sync(state_of(services, slices), {("ns", f"s{i}")}, 2.0 + step)
            await plain.sync(state_of(services, slices), {("ns", f"s{i}")}, 2.0 + step)
            assert ipt.exe.last_path == ("netlink" if len(restores) > before else ""), step
            same_kernel(ours, ref, family)
        deletes = sum(t.count("\n-D ") for t in restores)
        assert len(restores) >= 8 and deletes and sum(t.count("\n-I ") for t in restores), (len(restores), deletes)

    asyncio.run(go())
    after = saved(ours, family)
    # every foreign rule is still there, in its order, and the policy too
    assert [line for line in after if line in foreign and line.startswith("-A")] == \
        [line for line in foreign if line.startswith("-A")]
    assert ":FORWARD DROP [0:0]" in after


@pytest.mark.root
@requires(tool(4, "restore"))
def test_traffic_reaches_a_backend_over_tcp_and_udp(namespaces):
    node, pod = namespaces.add("node"), namespaces.add("pod")
    namespaces.veth(node, "vp0", pod, "eth0")
    namespaces.routed_pod(node, "vp0", pod, "10.161.200.10", gw="10.161.0.1")
    namespaces.backend(pod, "pod0", tcp_port=8080, udp_port=5353)
    sh("ip", "route", "add", "10.96.0.0/12", "dev", "vp0", ns=node)     # ClusterIPs are routed off-node
    sh(tool(4, "restore"), "--noflush", ns=node, input=FOREIGN[4])
    rng = random.Random(5)
    services = {i: service(i, rng, 4) for i in range(30)}
    slices = {i: endpoints(i, rng, 4) for i in range(30)}
    services[99] = Service("ns", "web", "ClusterIP", ("10.96.9.9",),
                           ports=(ServicePort("http", "TCP", 80), ServicePort("dns", "UDP", 53)))
    slices[99] = EndpointSlice("ns", "web-1", "web", "IPv4", (Endpoint(("10.161.200.10",), node_name="node-a"),),
                               (EndpointPort("http", "TCP", 8080), EndpointPort("dns", "UDP", 5353)))
    ipt = IptablesBackend(SubprocessRunner(prefix=("ip", "netns", "exec", node)), CFG4, 4)
    ipt.exe.backend = "nft"
    asyncio.run(ipt.sync(state_of(services, slices), None, 0.0))
    assert ipt.exe.last_path == "netlink"
    for proto, port in (("tcp", 80), ("udp", 53)):
        got = connect(node, proto, "10.96.9.9", port, 3)
        assert [a[0] for a in got["answers"]] == ["pod0"] * 3, (proto, got)


@pytest.mark.root
@requires(tool(4, "restore"))
def test_a_text_refused_half_way_leaves_the_previous_rules_and_is_retried(namespaces, monkeypatch):
    node, pod = namespaces.add("node"), namespaces.add("pod")
    namespaces.veth(node, "vp0", pod, "eth0")
    namespaces.routed_pod(node, "vp0", pod, "10.161.200.10", gw="10.161.0.1")
    namespaces.backend(pod, "pod0", tcp_port=8080)
    sh("ip", "route", "add", "10.96.0.0/12", "dev", "vp0", ns=node)
    web = Service("ns", "web", "ClusterIP", ("10.96.9.9",), ports=(ServicePort("http", "TCP", 80),))
    web_eps = EndpointSlice("ns", "web-1", "web", "IPv4", (Endpoint(("10.161.200.10",), node_name="node-a"),),
                            (EndpointPort("http", "TCP", 8080),))
    rng = random.Random(9)
    services = {i: service(i, rng, 4) for i in range(30)}
    slices = {i: endpoints(i, rng, 4) for i in range(30)}
    services[99], slices[99] = web, web_eps
    from clusterdns.proxy.proxier import Proxier
    from clusterdns.sources.manifest import publish
    from clusterdns.state import StateStore
    store = StateStore()
    publish(store, records_of(services, slices))
    cfg = Config.from_options(node_name="node-a", node_ips=("192.168.49.2",), cluster_cidrs=("10.161.0.0/16",),
                              proxy_mode="iptables", apply=True)
    prox = Proxier(cfg, store, executor=SubprocessRunner(prefix=("ip", "netns", "exec", node)), family=4)
    backend = prox.backends[4]
    backend.exe.backend = "nft"

    async def go():
        await prox._sync()
        assert prox.failures == 0 and backend.exe.last_path == "netlink"
        before = saved(node, 4)
        # the next full text is refused by the kernel at a rule half-way through its nat table
        # (a jump back to KUBE-SERVICES makes a loop); everything before it was already encoded
        real = iptables.render

        def faulty(*a, **kw):
            rs = real(*a, **kw)
            nat = rs.text.index("\n-A KUBE-SEP-")
            half = rs.text.index("\n-A KUBE-SEP-", nat + (len(rs.text) - nat) // 2)
            text = rs.text[:half] + rs.text[half:].replace(" -j KUBE-MARK-MASQ\n", " -j KUBE-SERVICES\n", 1)
            import dataclasses
            return dataclasses.replace(rs, text=text)

        monkeypatch.setattr(iptables, "render", faulty)
        slices[99] = EndpointSlice("ns", "web-1", "web", "IPv4", (), (EndpointPort("http", "TCP", 8080),))
        publish(store, records_of(services, slices))
        prox._need_full = True
        await prox._sync()
        assert prox.failures == 1 and "nfnetlink" in prox.last_error, prox.last_error
        assert saved(node, 4) == before                      # nothing of it went in
        got = connect(node, "tcp", "10.96.9.9", 80, 2)        # the old rules still work
        assert [a[0] for a in got["answers"]] == ["pod0"] * 2, got
        # retried in full once the fault is gone: web now has no endpoints and is rejected
        monkeypatch.setattr(iptables, "render", real)
        assert prox._need_full
        await prox._sync()
        assert prox.failures == 1 and backend.exe.last_path == "netlink"
        assert any("web:http has no endpoints" in line for line in saved(node, 4))

    asyncio.run(go())


@pytest.mark.root
@requires(tool(4, "restore"))
def test_a_foreign_rule_referencing_a_stale_chain_does_not_stop_the_sync(namespaces, caplog):
    ours, ref = namespaces.add("ours"), namespaces.add("ref")
    ipt, plain = backends(ours, ref, CFG4, 4)
    rng = random.Random(3)
    services = {i: service(i, rng, 4) for i in range(10)}
    slices = {i: endpoints(i, rng, 4) for i in range(10)}
    for i in range(10):   # every Service with endpoints
        if not slices[i].endpoints:
            slices[i] = EndpointSlice("ns", f"s{i}-1", f"s{i}", "IPv4", (Endpoint((f"10.161.{i}.1",)),),
                                      slices[i].ports)
    asyncio.run(ipt.sync(state_of(services, slices), None, 0.0))
    asyncio.run(plain.sync(state_of(services, slices), None, 0.0))
    nat = iptsave.read(sh("iptables-nft-save", "-t", "nat", ns=ours))["nat"]
    victim = next(c for c in sorted(nat.chains) if c.startswith("KUBE-SEP-") and "10.161.4." in
                  " ".join(r.spec for r in nat.rules_of(c)))
    for ns in (ours, ref):   # another component jumps to one of Service s4's endpoint chains
        sh("iptables-nft-restore", "--noflush", ns=ns, input=f"*nat\n:OTHER - [0:0]\n-A OTHER -j {victim}\nCOMMIT\n")
    services.pop(4)
    slices.pop(4)
    with caplog.at_level(logging.WARNING):
        asyncio.run(ipt.sync(state_of(services, slices), None, 1.0))
    with pytest.raises(ApplyError, match="CHAIN_DEL failed|busy"):
        asyncio.run(plain.sync(state_of(services, slices), None, 1.0))    # kube-proxy's call fails whole
    assert ipt.exe.kept == [("nat", victim)] and victim in caplog.text
    after = iptsave.read(sh("iptables-nft-save", "-t", "nat", ns=ours))["nat"]
    assert not any("s4" in r.spec for r in after.rules)     # the rest of the sync went in
    assert victim in after.chains and after.rules_of(victim) == []      # kept, flushed
    assert [r.spec for r in after.rules_of("OTHER")] == [f"-j {victim}"]
    # once the other rule is gone, the next full sync deletes the chain
    sh("iptables-nft", "-t", "nat", "-F", "OTHER", ns=ours)
    asyncio.run(ipt.sync(state_of(services, slices), None, 2.0))
    assert ipt.exe.kept == []
    assert victim not in iptsave.read(sh("iptables-nft-save", "-t", "nat", ns=ours))["nat"].chains


@pytest.mark.root
@requires(tool(4, "restore"))
def test_a_change_between_reading_the_chains_and_sending_is_caught(namespaces, monkeypatch):
    """The batch carries the generation its chain list was read at: a change in between makes the
    kernel refuse it (ERESTART) and it is encoded again against the new chains."""
    ns = namespaces.add("gen")
    text = "*nat\n:KUBE-A - [0:0]\n-A KUBE-A -j RETURN\nCOMMIT\n"
    iptnl.apply(text, 4, netns=ns)
    real, calls = iptnl.chains_of, []

    def racing(family, wanted, netns=None):
        got = real(family, wanted, netns)
        calls.append(1)
        if len(calls) == 1:     # someone deletes the chain right after we listed it
            sh("iptables-nft", "-t", "nat", "-F", "KUBE-A", ns=ns)
            sh("iptables-nft", "-t", "nat", "-X", "KUBE-A", ns=ns)
        return got

    monkeypatch.setattr(iptnl, "chains_of", racing)
    iptnl.apply(text, 4, netns=ns)
    assert len(calls) == 2
    nat = iptsave.read(sh("iptables-nft-save", "-t", "nat", ns=ns))["nat"]
    assert [r.spec for r in nat.rules_of("KUBE-A")] == ["-j RETURN"]


@pytest.mark.root
@requires(tool(4, "restore"))
def test_a_rule_deleted_by_its_spec_is_the_first_that_matches_whatever_it_counted(namespaces):
    """`-D CHAIN spec` over netlink deletes what iptables-nft-restore would: the first rule with
    those expressions (packet counters aside), one per line; `-I CHAIN 1` puts a rule first.
    Written by the tool first, as a kube-proxy that ran before would have."""
    ns = namespaces.add("delete")
    spec = "-m comment --comment \"ns/a:http cluster IP\" -m tcp -p tcp -d 10.96.0.1 --dport 80 -j KUBE-SVC-A"
    sh("iptables-nft-restore", "--noflush", "--counters", ns=ns, input=(
        "*nat\n:KUBE-SERVICES - [0:0]\n:KUBE-SVC-A - [0:0]\n"
        f"[1:60] -A KUBE-SERVICES {spec.replace('80', '81')}\n"
        f"[7:420] -A KUBE-SERVICES {spec}\n"
        f"[0:0] -A KUBE-SERVICES -s 10.0.0.9 {spec}\n"
        f"[3:180] -A KUBE-SERVICES {spec}\n"
        "COMMIT\n"))
    kept = iptnl.apply(f"*nat\n-D KUBE-SERVICES {spec}\n-I KUBE-SERVICES 1 -j RETURN\nCOMMIT\n", 4, netns=ns)
    assert kept == []
    out = [line for line in sh("iptables-nft-save", "-c", "-t", "nat", ns=ns).splitlines()
           if "-A KUBE-SERVICES" in line]
    assert [line.split(" ", 1)[0] for line in out] == ["[0:0]", "[1:60]", "[0:0]", "[3:180]"]
    assert out[0].endswith("-A KUBE-SERVICES -j RETURN") and "10.0.0.9" in out[2]
    # two lines: the two remaining identical ones... one of them is gone already, so the second
    # line matches nothing: the text goes to the tool, which refuses it whole
    ipt = IptablesBackend(SubprocessRunner(prefix=("ip", "netns", "exec", ns)), CFG4, 4)
    ipt.exe.backend = "nft"
    with pytest.raises(ApplyError):
        asyncio.run(ipt.exe.restore(f"*nat\n-D KUBE-SERVICES {spec}\n-D KUBE-SERVICES {spec}\n"
                                    "-A KUBE-SERVICES -j ACCEPT\nCOMMIT\n"))
    assert ipt.exe.last_path == "iptables-nft-restore"
    assert [line.split(" ", 1)[0] for line in sh("iptables-nft-save", "-c", "-t", "nat", ns=ns).splitlines()
            if "-A KUBE-SERVICES" in line] == ["[0:0]", "[1:60]", "[0:0]", "[3:180]"]
    with pytest.raises(iptnl.Unsupported):
        iptnl.apply("*nat\n-I KUBE-SERVICES 2 -j RETURN\nCOMMIT\n", 4, netns=ns)


@pytest.mark.root
@requires(tool(4, "restore"))
def test_texts_it_does_not_encode_go_to_the_tool(namespaces):
    ns = namespaces.add("fallback")
    ipt = IptablesBackend(SubprocessRunner(prefix=("ip", "netns", "exec", ns)), CFG4, 4)
    ipt.exe.backend = "nft"
    text = "*nat\n:KUBE-A - [0:0]\n-A KUBE-A -p tcp -m multiport --dports 80,81 -j RETURN\nCOMMIT\n"
    asyncio.run(ipt.exe.restore(text, full=True))
    assert ipt.exe.last_path == "iptables-nft-restore"
    assert "--dports 80,81" in sh("iptables-nft-save", "-t", "nat", ns=ns)


# ------------------------------------------------------------------ new chains first, then the rest

@pytest.fixture
def small_pieces(monkeypatch):
    """Batch pieces of 4 KiB, so that a small text's new chains go in several early batches."""
    monkeypatch.setattr(nflink, "_PIECE", 4096)
    monkeypatch.setattr(nflink, "_FIRST_PIECE", 4096)


def _text_of(n: int, seed: int, cfg: Config = CFG4) -> str:
    rng = random.Random(seed)
    services = {i: service(i, rng, 4) for i in range(n)}
    slices = {i: endpoints(i, rng, 4) for i in range(n)}
    return iptables.render(state_of(services, slices), cfg, 4).text


@pytest.mark.root
@requires(tool(4, "restore"))
def test_new_chains_in_several_early_batches_then_the_rest(namespaces, small_pieces):
    ours, ref = namespaces.add("ours"), namespaces.add("ref")
    for ns in (ours, ref):
        sh(tool(4, "restore"), "--noflush", ns=ns, input=FOREIGN[4])
    for seed in (1, 2):       # a first load (every chain new), then another state on top
        text = _text_of(30, seed)
        stats: dict = {}
        iptnl.apply(text, 4, netns=ours, stats=stats, early_bytes=8192)
        sh(tool(4, "restore"), "--noflush", "--counters", ns=ref, input=text)
        same_kernel(ours, ref, 4)
        assert stats["early_batches"] > 3 and stats["final_messages"] > 0, stats
    # one batch only (early_bytes=0) leaves the same
    text = _text_of(30, 3)
    iptnl.apply(text, 4, netns=ours, early_bytes=0)
    sh(tool(4, "restore"), "--noflush", "--counters", ns=ref, input=text)
    same_kernel(ours, ref, 4)


@pytest.mark.root
@requires(tool(4, "restore"))
@pytest.mark.parametrize("where", ["early", "final", "unsupported"])
def test_a_load_refused_after_early_batches_leaves_the_kernel_as_it_was(namespaces, small_pieces, where,
                                                                        monkeypatch):
    """Whatever is refused, and wherever: the kernel holds what it held before, the chains the
    early batches made deleted again (nothing ever referred to them)."""
    ns = namespaces.add("undo")
    undone = []
    real_undo = iptnl._undo
    monkeypatch.setattr(iptnl, "_undo", lambda link, fam, created, genid: (
        undone.append(sum(len(c) for c in created.chains.values())), real_undo(link, fam, created, genid)))
    sh(tool(4, "restore"), "--noflush", ns=ns, input=FOREIGN[4])
    iptnl.apply(_text_of(20, 1), 4, netns=ns, early_bytes=8192)
    before = kernel(ns, 4)
    text = _text_of(30, 2)          # new Services: new chains, in early batches
    lines = text.split("\n")
    seps = [i for i, line in enumerate(lines) if line.startswith("-A KUBE-SEP-")]
    if where == "early":
        # a new endpoint chain's rule near the end jumps back into KUBE-SERVICES: a loop, refused
        # in an early batch after others went in (the chain is new, so is its batch)
        new_sep = [i for i in seps if lines[i].split()[1] not in before["chains"]["nat"]]
        i = new_sep[-1]
        lines[i] = f"-A {lines[i].split()[1]} -j KUBE-SERVICES"
    elif where == "final":
        # a rule of a chain the kernel already holds refers to a chain nobody declared
        old_sep = [i for i in seps if lines[i].split()[1] in before["chains"]["nat"]]
        lines[old_sep[0]] = f"-A {lines[old_sep[0]].split()[1]} -j KUBE-SVC-NOWHERE"
    else:
        lines.insert(len(lines) - 3, "-A KUBE-MARK-MASQ -m multiport -p tcp --dports 1,2 -j RETURN")
    bad = "\n".join(lines)
    stats: dict = {}
    if where == "unsupported":
        with pytest.raises(iptnl.Unsupported):
            iptnl.apply(bad, 4, netns=ns, early_bytes=8192, stats=stats)
    else:
        with pytest.raises(iptnl.NflinkError, match="refused line"):
            iptnl.apply(bad, 4, netns=ns, early_bytes=8192, stats=stats)
    assert len(undone) == 1 and undone[0] > 10, undone      # early batches had gone in
    assert kernel(ns, 4) == before


@pytest.mark.root
@requires(tool(4, "restore"))
def test_the_proxier_loads_in_a_child_process(namespaces, monkeypatch):
    """The batch (115 MB at 10,000 Services) is the child's memory, not the agent's; the child
    is run like the tool, through the runner and its namespace prefix."""
    ns = namespaces.add("child")
    ipt = IptablesBackend(SubprocessRunner(prefix=("ip", "netns", "exec", ns)), CFG4, 4)
    ipt.exe.backend = "nft"
    calls = []
    real = SubprocessRunner.run

    async def spy(self, argv, stdin=None):
        calls.append(tuple(argv))
        return await real(self, argv, stdin)

    monkeypatch.setattr(SubprocessRunner, "run", spy)
    monkeypatch.setattr(iptnl, "apply", lambda *a, **kw: pytest.fail("applied in the agent's process"))
    rng = random.Random(1)
    asyncio.run(ipt.sync(state_of({i: service(i, rng, 4) for i in range(5)},
                                  {i: endpoints(i, rng, 4) for i in range(5)}), None, 0.0))
    assert ipt.exe.last_path == "netlink"
    assert [c[-4:] for c in calls if "clusterdns.proxy.iptnl" in c] == [("-m", "clusterdns.proxy.iptnl",
                                                                        "--family", "4")]
    assert "KUBE-SERVICES" in sh("iptables-nft-save", "-t", "nat", ns=ns)
