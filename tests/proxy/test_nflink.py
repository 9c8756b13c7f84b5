"""nflink: incremental nftables transactions sent over nfnetlink must leave the kernel exactly as `nft -f` does."""
from __future__ import annotations

import errno
import functools
import os
import re
import subprocess
import textwrap
from dataclasses import replace

import pytest

from clusterdns.config import Config
from clusterdns.model import LOAD_BALANCER, NODE_PORT, Endpoint, EndpointPort, EndpointSlice, Service, ServicePort
from clusterdns.proxy import nflink, nftables
from clusterdns.proxy.nftobj import (
    Addr,
    AddrIn,
    BaseChain,
    CtState,
    DnatMap,
    DnatTo,
    Dport,
    Element,
    FibLocal,
    L4proto,
    Lookup,
    Masquerade,
    NumgenVmap,
    Op,
    SetDecl,
    Update,
    Verdict,
    Vmap,
    rule,
)
from clusterdns.proxy.nftobj import Endpoint as NftEndpoint
from clusterdns.proxy.nftobj import text as ops_text
from clusterdns.state import state_from_records
from clusterdns.synthetic import synthetic_records
from tests import nslib
from tests.nslib import requires

CFG = Config.from_options(command="rules", node_name="node-0", node_ips=("192.168.0.2",),
             cluster_cidrs=("10.0.0.0/8",), service_cidrs=("10.96.0.0/12",))
T = "ip kube-proxy"


# ---------------------------------------------------------------- which operations are ours

AFF = "affinity-AAAA-ns/svc/tcp/http__10.0.1.3/8080"
AFF_DECL = SetDecl("set", type="ipv4_addr", flags="dynamic,timeout", timeout=10800)
EP_MAP = SetDecl("map", typeof="numgen random mod 65536 : ip daddr . udp dport", flags="interval")
MASQ = Verdict("jump", "mark-for-masquerade")


def el(*key, value=None, comment=""):
    return (Element(tuple(key), value, comment),)


def rng(lo, hi, ip=None, port=0):
    return (Element((lo, hi), NftEndpoint(ip, port) if ip else None, interval=True),)


SUPPORTED = [
    Op("add", "chain", "endpoint-AAAA-ns/svc/tcp/http__10.0.1.3/8080"),
    Op("flush", "chain", "service-X"),
    Op("delete", "chain", "service-X"),
    Op("add", "rule", "svc", rule(Addr("ip", "daddr", "10.96.0.2"), Dport("tcp", 80),
                                  Addr("ip", "saddr", "10.0.0.0/8", neg=True), MASQ)),
    Op("add", "rule", "svc", rule(NumgenVmap(("ep-a", "ep-b")))),
    Op("add", "rule", "ep", rule(DnatTo("tcp", "10.0.1.3", 8080))),
    Op("add", "rule", "ext", rule(Addr("ip", "saddr", "10.0.0.0/8"), Verdict("goto", "svc"),
                                  comment="short-circuit pod traffic")),
    Op("add", "rule", "ext", rule(FibLocal("saddr"), MASQ, comment="masquerade local traffic")),
    Op("add", "rule", "ext", rule(Verdict("goto", "svc"))),
    Op("add", "rule", "fw", rule(Verdict("drop"))),
    Op("add", "rule", "fw", rule(AddrIn("ip", "saddr", ("203.0.113.0/25", "198.51.100.9", "192.0.2.0/24"), neg=True),
                                 Verdict("drop"))),
    Op("add", "element", "service-ips", el("10.96.0.2", "tcp", "80", value=Verdict("goto", "svc"))),
    Op("add", "element", "no-endpoint-reject", el("10.96.0.2", "udp", "53", comment="ns/svc:dns")),
    Op("add", "element", "no-endpoint-nodeport-drop", el("tcp", "30001", comment="ns/svc:http")),
    Op("add", "element", "hairpin", el("10.0.1.3", "10.0.1.3")),
    Op("add", "element", "endpoints-tcp-007", rng(65536, 98303, "10.0.1.3", 8080)),
    Op("delete", "element", "endpoints-tcp-007", rng(65536, 98303)),
    Op("add", "map", "endpoints-udp-007", EP_MAP),
    Op("delete", "map", "endpoints-udp-007"),
    Op("add", "rule", "svc", rule(DnatMap("tcp", 65536, 131072, "endpoints-tcp-007"))),
    Op("add", "rule", "svc", rule(DnatMap("udp", 65536, 0, "endpoints-udp-007"))),
    Op("add", "element", "cluster-ips", el("10.96.0.2") + el("10.96.0.3")),
    Op("delete", "element", "service-nodeports", el("sctp", "30001")),
    Op("add", "set", AFF, AFF_DECL),
    Op("delete", "set", AFF),
    Op("add", "rule", "svc", rule(Lookup(("ip saddr",), AFF), Verdict("goto", "ep"))),
    Op("add", "rule", "ep", rule(Update(AFF, "ip"))),
]


def test_supported_forms():
    for op in SUPPORTED:
        assert nflink.supported([op]), op.text(T)
    assert nflink.supported(SUPPORTED)


@pytest.mark.parametrize("op", [
    Op("add", "table", "kube-proxy", "rules for kube-proxy"),
    Op("delete", "table", "kube-proxy"),
    Op("add", "chain", "nat-output", BaseChain("nat", "output", -100)),
    Op("add", "map", "service-ips", SetDecl("map", type="ipv4_addr . inet_proto . inet_service : verdict")),
    Op("flush", "map", "service-ips"),
    Op("add", "set", "other", SetDecl("set", type="ipv4_addr", flags="dynamic,timeout", timeout=10)),
    Op("add", "set", "affinity-A", SetDecl("set", type="ipv6_addr", flags="dynamic,timeout", timeout=10)),
    Op("add", "set", "affinity-A", SetDecl("set", type="ipv4_addr", flags="timeout", timeout=10)),
    Op("flush", "set", "affinity-A"),
    Op("add", "rule", "c", rule(Lookup(("ip saddr",), "cluster-ips"), Verdict("goto", "x"))),
    Op("add", "rule", "c", rule(Update("affinity-A", "ip6"))),
    Op("add", "rule", "fw", rule(AddrIn("ip", "saddr", ("203.0.113.0/25", "203.0.113.128/25"), neg=True),
                                 Verdict("drop"))),     # adjacent: nft merges them
    Op("add", "rule", "fw", rule(AddrIn("ip", "saddr", ("203.0.113.0/24", "203.0.113.128/25"), neg=True),
                                 Verdict("drop"))),     # overlapping
    Op("add", "rule", "fw", rule(AddrIn("ip", "saddr", ("0.0.0.0/2", "192.0.2.0/24"), neg=True), Verdict("drop"))),
    Op("add", "rule", "fw", rule(AddrIn("ip", "saddr", ("192.0.2.0/24", "255.0.0.0/8"), neg=True), Verdict("drop"))),
    Op("add", "rule", "fw", rule(AddrIn("ip", "saddr", ("203.0.113.0/25",)), Verdict("drop"))),
    Op("add", "rule", "fw", rule(AddrIn("ip", "daddr", ("203.0.113.0/25",), neg=True), Verdict("drop"))),
    Op("add", "rule", "fw", rule(AddrIn("ip", "saddr", ("fd00::/64", "192.0.2.0/24"), neg=True), Verdict("drop"))),
    Op("add", "rule", "c", rule(Vmap(("ip daddr", "meta l4proto", "th dport"), "service-ips"))),
    Op("add", "rule", "c", rule(CtState("new"), Verdict("jump", "x"))),
    Op("add", "rule", "c", rule(Masquerade())),
    Op("add", "rule", "c", rule(Verdict("return"))),
    Op("add", "rule", "c", rule(Addr("ip", "saddr", "10.0.0.1/8"), Verdict("jump", "x"))),     # host bits set
    Op("add", "rule", "c", rule(Addr("ip", "saddr", "10.0.0.1"), Addr("ip", "daddr", "10.0.0.2"),
                                Verdict("jump", "x"))),  # nft would merge the two loads
    Op("add", "rule", "c", rule(Addr("ip6", "saddr", "fd00::1"), Verdict("jump", "x"))),      # v6 in an ip table
    Op("add", "rule", "c", rule(DnatTo("tcp", "fd00::1", 80))),                               # v6 target
    Op("add", "rule", "c", rule(NumgenVmap(()))),
    Op("add", "rule", "c", rule()),
    Op("add", "element", "service-ips", el("10.96.0.2", "tcp", "80")),                        # no data
    Op("add", "element", "cluster-ips", el("10.96.0.2", value=Verdict("goto", "x"))),
    Op("add", "element", "service-ips", el("10.96.0.2", "icmp", "80", value=Verdict("goto", "x"))),
    Op("add", "element", "other-set", el("10.96.0.2")),
    Op("add", "element", "endpoints-tcp-1", el("5", value=NftEndpoint("10.0.0.1", 80))),          # not a range
    Op("add", "element", "endpoints-tcp-1", rng(0, 5)),                                       # no endpoint
    Op("add", "element", "hairpin", el("10.0.0.1")),
    Op("add", "map", "endpoints-tcp-1", EP_MAP),                                              # udp typeof
    Op("add", "map", "other", EP_MAP._replace(typeof="numgen random mod 65536 : ip daddr . tcp dport")),
    Op("add", "rule", "c", rule(DnatMap("udp", 65536, 0, "endpoints-tcp-1"))),                 # protocol mismatch
    Op("add", "rule", "c", rule(DnatMap("tcp", 65536, 7, "endpoints-tcp-1"))),
    Op("add", "rule", "c", rule(DnatMap("tcp", 100, 0, "endpoints-tcp-1"))),
], ids=lambda op: op.text(T)[:70])
def test_unsupported_forms(op):
    assert not nflink.supported([op])
    with pytest.raises(nflink.Unsupported):
        nflink.apply([op], 4)


def test_full_render_falls_back_but_incremental_does_not():
    st = state_from_records(synthetic_records(5, 3, nodeport_every=2))
    full = nftables.render(st, CFG)
    assert not nflink.supported(full.ops)
    # every Service-owned operation of the full transaction is one nflink encodes
    owned = tuple(c for objs in full.state.owned.values() for c in objs.chains)
    service_ops = [op for op in full.ops if op.kind == "element" or op.kind in ("rule", "chain") and op.name in owned]
    assert len(service_ops) > 30
    assert nflink.supported(service_ops)


# ---------------------------------------------------------------- in the kernel

needs_netns = requires("nft")


@pytest.fixture
def pair(namespaces):
    try:
        yield [namespaces.add("a"), namespaces.add("b")]
    finally:
        nflink.close_all()


nft = functools.partial(nslib.nft, strict=True)
listing = nslib.nft_table


def _blocks(text: str) -> dict[str, list[str]]:
    """`nft list table` as {chain/set header: its lines}, for comparisons indifferent to creation order."""
    out: dict[str, list[str]] = {}
    current: list[str] = []
    for line in text.splitlines():
        if line.startswith("\t") and not line.startswith("\t\t") and line.strip() != "}":
            current = out.setdefault(line.strip(), [])
        elif line.startswith("\t\t"):
            current.append(line.strip())
    assert out
    return out


def bytecode(ns: str, fam: str = "ip"):
    """The kernel's objects as netlink expressions: (sets with their elements, rules in order).

    Normalised only where the two sides may differ without a behavioural
    difference: handles, anonymous map numbers, the order of hash set elements.
    """
    out = subprocess.run(["ip", "netns", "exec", ns, "nft", "--debug=netlink", "list", "table", fam, "kube-proxy"],
                         capture_output=True, text=True, check=True).stdout
    out = re.sub(r"__map\d+", "__map", out)
    # nft 1.0.6 starts an interval set it believes empty with an end element at 0 (matches nothing);
    # whether it does depends on its cache's history, netlink never writes one
    out = re.sub(r"\n\s*element 00000000  : 1 \[end\]", "", out)
    blocks: list[list[str]] = []
    for line in out.splitlines():
        if not line.strip():
            continue
        if line.startswith((" ", "\t")):
            blocks[-1].append(line)
        else:
            blocks.append([re.sub(r"( \d+)+$", "", line)])
    sets = sorted((b[0], *sorted(b[1:])) for b in blocks if "@" in b[0])
    rules = [tuple(b) for b in blocks if "@" not in b[0]]
    assert rules
    return sets, rules


def _slice(ns, name, *ips, node="node-0", port=8080, ready=True):
    return ("EndpointSlice", EndpointSlice(ns, f"{name}-xyz", name, "IPv4",
                                           tuple(Endpoint((ip,), ready=ready, node_name=node) for ip in ips),
                                           (EndpointPort("http", "TCP", port),)))


def _steps():
    """(label, records) in order: each step is one state change a proxier would see."""
    base = synthetic_records(6, 3, nodeport_every=3)
    lb = ("Service", Service("web", "lb", LOAD_BALANCER, ("10.96.1.1",),
                             ports=(ServicePort("http", "TCP", 80, 31080, 8080),),
                             external_ips=("192.0.2.7",), lb_ips=("198.51.100.7",), external_local=True))
    lb_eps = _slice("web", "lb", "10.1.0.1", "10.1.0.2", node="node-0")
    recs = base + [lb, lb_eps]
    yield "start", recs

    def edit(records, key, fn):
        out = []
        for kind, r in records:
            if kind == "EndpointSlice" and (r.namespace, r.service) == key:
                r = fn(r)
                if r is None:
                    continue
            out.append((kind, r))
        return out

    recs = edit(recs, ("ns-1", "svc-1"), lambda s: replace(s, endpoints=s.endpoints[1:]))
    yield "endpoint removed", recs
    recs = edit(recs, ("ns-1", "svc-1"), lambda s: replace(s, endpoints=s.endpoints + (
        Endpoint(("10.9.0.1",), node_name="node-1"), Endpoint(("10.9.0.2",), node_name="node-0"))))
    yield "endpoints added", recs
    recs = recs + [("Service", Service("new", "api", ports=(ServicePort("http", "TCP", 443, 0, 8080),),
                                       cluster_ips=("10.96.2.2",))),
                   _slice("new", "api", "10.2.0.1", "10.2.0.2", "10.2.0.3")]
    yield "service added", recs
    recs = [(k, r) for k, r in recs if not (getattr(r, "namespace", "") == "ns-2"
                                            and (getattr(r, "name", "") == "svc-2" or getattr(r, "service", "") == "svc-2"))]
    yield "service deleted", recs
    recs = edit(recs, ("new", "api"), lambda s: replace(s, endpoints=tuple(replace(e, ready=False, serving=False)
                                                                           for e in s.endpoints)))
    yield "no endpoints left", recs
    recs = [(k, replace(r, ports=(replace(r.ports[0], node_port=32000),))
             if k == "Service" and r.name == "svc-3" else r) for k, r in recs]
    yield "nodeport changed", recs
    recs = edit(recs, ("web", "lb"), lambda s: replace(s, endpoints=(replace(s.endpoints[0], node_name="node-1"),)
                                                       + s.endpoints[1:]))
    yield "eTP Local endpoint moved", recs
    recs = edit(recs, ("web", "lb"), lambda s: replace(s, endpoints=tuple(replace(e, node_name="node-1")
                                                                         for e in s.endpoints)))
    yield "eTP Local without local endpoints", recs
    recs = [(k, replace(r, type=NODE_PORT, ports=(replace(r.ports[0], node_port=31500),))
             if k == "Service" and r.name == "svc-4" else r) for k, r in recs]
    yield "ClusterIP becomes NodePort", recs
    recs = edit(recs, ("new", "api"), lambda s: replace(s, endpoints=tuple(replace(e, ready=True, serving=True)
                                                                           for e in s.endpoints)))
    yield "endpoints back", recs
    recs = recs + [("Service", Service("aff", "sticky", ports=(ServicePort("http", "TCP", 80, 0, 8080),),
                                       cluster_ips=("10.96.3.3",), affinity_timeout=600)),
                   _slice("aff", "sticky", "10.3.0.1", "10.3.0.2")]
    yield "affinity service added", recs
    recs = edit(recs, ("aff", "sticky"), lambda s: replace(s, endpoints=s.endpoints[:1]))
    yield "affinity endpoint removed", recs
    recs = recs + [("Service", Service("fw", "guarded", LOAD_BALANCER, ("10.96.4.4",),
                                       ports=(ServicePort("http", "TCP", 80, 31600, 8080),),
                                       lb_ips=("198.51.100.9",), lb_source_ranges=("203.0.113.0/25",))),
                   _slice("fw", "guarded", "10.4.0.1")]
    yield "firewalled service added", recs
    recs = edit(recs, ("fw", "guarded"), lambda s: replace(s, endpoints=s.endpoints + (Endpoint(("10.4.0.2",)),)))
    yield "firewalled endpoint added", recs
    recs = [(k, replace(r, lb_source_ranges=("203.0.113.0/25", "192.0.2.0/24", "198.51.100.77/32"))
             if k == "Service" and r.name == "guarded" else r) for k, r in recs]
    yield "source ranges changed", recs


def _keys(records):
    by_key: dict = {}
    for kind, r in records:
        if kind == "Service":
            by_key.setdefault((r.namespace, r.name), []).append(r)
        elif kind == "EndpointSlice":
            by_key.setdefault((r.namespace, r.service), []).append(r)
    return by_key


@needs_netns
def test_incremental_batches_match_nft(pair):
    a, b = pair
    steps = list(_steps())
    label, recs = steps[0]
    full = nftables.render(state_from_records(recs), CFG)
    nft(a, full.text)
    nft(b, full.text)
    assert listing(a) == listing(b)
    prev, prev_keys = full.state, _keys(recs)
    sent = []
    for label, recs in steps[1:]:
        keys = _keys(recs)
        changed = {k for k in set(keys) | set(prev_keys) if keys.get(k) != prev_keys.get(k)}
        rs = nftables.render(state_from_records(recs), CFG, previous=prev, changed=changed)
        assert rs.text, label
        if nflink.supported(rs.ops):
            nflink.apply(rs.ops, 4, netns=a)
            sent.append(label)
        else:
            nft(a, rs.text)   # what the proxier does with a form nflink does not encode
        nft(b, rs.text)
        assert listing(a) == listing(b), label
        assert bytecode(a) == bytecode(b), label
        prev, prev_keys = rs.state, keys
    # the forms the one-endpoint and service changes need all went over netlink
    for label in ("endpoint removed", "endpoints added", "service added", "service deleted", "no endpoints left",
                  "nodeport changed", "eTP Local endpoint moved", "eTP Local without local endpoints",
                  "ClusterIP becomes NodePort", "endpoints back", "affinity service added",
                  "affinity endpoint removed"):
        assert label in sent
    assert {"firewalled service added", "firewalled endpoint added", "source ranges changed"} <= set(sent)
    # and the result is what a full render gives (which creates objects in another order)
    nft(b, nftables.render(state_from_records(steps[-1][1]), CFG).text)
    assert _blocks(listing(a)) == _blocks(listing(b))


@needs_netns
def test_diff_of_whole_states_over_netlink(pair):
    """render(previous=...) without `changed` compares every Service: also encodable."""
    a, b = pair
    recs = synthetic_records(8, 4, nodeport_every=2)
    old = nftables.render(state_from_records(recs), CFG)
    nft(a, old.text)
    nft(b, old.text)
    recs2 = [(k, replace(r, endpoints=r.endpoints[::2]) if k == "EndpointSlice" else r) for k, r in recs[:-4]]
    rs = nftables.render(state_from_records(recs2), CFG, previous=old.state)
    assert nflink.supported(rs.ops)
    nflink.apply(rs.ops, netns=a)
    nft(b, rs.text)
    assert listing(a) == listing(b)
    assert bytecode(a) == bytecode(b)


@needs_netns
def test_failing_batch_applies_nothing(pair):
    a, _ = pair
    st = state_from_records(synthetic_records(3, 2))
    nft(a, nftables.render(st, CFG).text)
    before = listing(a)
    ops = [Op("add", "chain", "endpoint-NEW"),
           Op("add", "rule", "endpoint-NEW", rule(DnatTo("tcp", "10.0.9.9", 8080))),
           Op("add", "element", "cluster-ips", el("10.96.9.9")),
           Op("delete", "chain", "endpoint-MISSING"),
           Op("add", "element", "cluster-ips", el("10.96.9.10"))]
    assert nflink.supported(ops)
    with pytest.raises(nflink.NflinkError) as info:
        nflink.apply(ops, netns=a)
    assert info.value.errno == errno.ENOENT
    assert info.value.line == f"delete chain {T} endpoint-MISSING"
    assert "statement 4" in str(info.value)
    assert listing(a) == before
    # a chain still referenced by a map element cannot go: EBUSY, and again nothing changes
    svc_chain = next(c for c in nftables.render(st, CFG).state.chains if c.startswith("service-"))
    with pytest.raises(nflink.NflinkError) as info:
        nflink.apply([Op("add", "element", "cluster-ips", el("10.96.9.9")), Op("flush", "chain", svc_chain),
                      Op("delete", "chain", svc_chain)], netns=a)
    assert info.value.errno == errno.EBUSY
    assert listing(a) == before
    # the socket stays usable after failures
    nflink.apply([Op("add", "element", "cluster-ips", el("10.96.9.9"))], netns=a)
    assert "10.96.9.9" in listing(a)


@needs_netns
def test_missing_namespace_is_a_clear_error():
    with pytest.raises(nflink.NflinkError, match="no network namespace"):
        nflink.apply([Op("add", "chain", "x")], netns=f"cdns-nfl-absent-{os.getpid()}")


SERVER_AND_CLIENT = textwrap.dedent("""\
    import socket, sys, threading
    srv = socket.socket(); srv.bind(("127.0.0.1", 8080)); srv.listen()
    def serve():
        conn, _ = srv.accept(); conn.sendall(b"hello from the endpoint"); conn.close()
    threading.Thread(target=serve, daemon=True).start()
    c = socket.create_connection((sys.argv[1], 80), timeout=3)
    print(c.recv(100).decode())
    """)


@needs_netns
def test_dnat_added_over_netlink_rewrites_packets(pair):
    a, _ = pair
    run = lambda *argv: subprocess.run(["ip", "netns", "exec", a, *argv], check=True, capture_output=True)  # noqa: E731
    run("ip", "link", "set", "lo", "up")
    # a port-less bridge holds the route to the service range (the kernel here has no dummy links)
    run("ip", "link", "add", "svcbr", "type", "bridge")
    run("ip", "addr", "add", "10.96.255.254/12", "dev", "svcbr")
    run("ip", "link", "set", "svcbr", "up")
    nft(a, nftables.render(state_from_records([]), CFG).text)
    # the Service, its chains and its endpoint all arrive through netlink
    recs = [("Service", Service("t", "echo", ports=(ServicePort("http", "TCP", 80, 0, 8080),),
                                cluster_ips=("10.96.7.7",))), _slice("t", "echo", "127.0.0.1")]
    rs = nftables.render(state_from_records(recs), CFG, previous=nftables.render(state_from_records([]), CFG).state,
                         changed={("t", "echo")})
    assert nflink.supported(rs.ops)
    nflink.apply(rs.ops, netns=a)
    out = subprocess.run(["ip", "netns", "exec", a, "python3", "-c", SERVER_AND_CLIENT, "10.96.7.7"],
                         capture_output=True, text=True, timeout=20)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "hello from the endpoint"


CFG6 = Config.from_options(command="rules", node_name="node-a", node_ips=("192.168.49.2", "fd00:49::2"),
              cluster_cidrs=("10.161.0.0/16", "fd00:161::/64"), service_cidrs=("172.20.0.0/16", "fd00:20::/108"))


@needs_netns
def test_ipv6_batches_match_nft(pair):
    """The demo cluster's IPv6 Services arrive over netlink, then lose an endpoint: as nft -f leaves it."""
    from clusterdns.sources.manifest import DEMO_MANIFEST, load_files
    a, b = pair
    records, _ = load_files([DEMO_MANIFEST])
    empty = nftables.render(state_from_records([]), CFG6, 6)
    nft(a, empty.text)
    nft(b, empty.text)
    demo = state_from_records(records)
    keys = set(_keys(records))
    rs = nftables.render(demo, CFG6, 6, previous=empty.state, changed=keys)
    assert " : fd00:161::" in rs.text and "dnat to numgen random mod 65536" in rs.text
    assert "ip6 saddr != fd00:161::/64" in rs.text
    fewer = [(k, replace(r, endpoints=r.endpoints[1:]) if k == "EndpointSlice" and r.address_type == "IPv6" else r)
             for k, r in records]
    rs2 = nftables.render(state_from_records(fewer), CFG6, 6, previous=rs.state, changed=keys)
    for r in (rs, rs2):
        assert nflink.supported(r.ops, 6)
        with pytest.raises(nflink.Unsupported):
            nflink.apply(r.ops, 4, netns=a)          # the family must match the objects
        nflink.apply(r.ops, 6, netns=a)
        nft(b, r.text)
        assert _blocks(listing(a, "ip6")) == _blocks(listing(b, "ip6"))
        assert listing(a, "ip6") == listing(b, "ip6")
        assert bytecode(a, "ip6") == bytecode(b, "ip6")


@needs_netns
@pytest.mark.parametrize("family", [4, 6])
def test_each_form_matches_nft(pair, family):
    """Every rule and element form, including ones the step sequence does not reach, in both families."""
    a, b = pair
    fam, ipx = ("ip6", "ip6") if family == 6 else ("ip", "ip")
    empty = nftables.render(state_from_records([]), CFG6, family)
    nft(a, empty.text)
    nft(b, empty.text)
    if family == 4:
        host, net, odd, addr2, ranges = "10.0.1.3", "10.0.0.0/8", "10.96.0.0/12", "10.96.0.2", \
            ("203.0.113.0/25", "198.51.100.9", "192.0.2.0/24")
        target = ("10.0.1.3", 8080)
    else:
        host, net, odd, addr2, ranges = "fd00:161::3", "fd00:161::/64", "fd00:20::/108", "fd00:20::2", \
            ("2001:db8::/64", "2001:db8:1::7", "2001:db8:2::/48")
        target = ("fd00:161::3", 8080)
    aff = "affinity-ABCDEFGH-ns/svc/udp/dns__x/53"
    addr_type = "ipv6_addr" if family == 6 else "ipv4_addr"
    masq = Verdict("jump", "mark-for-masquerade")
    ip, port = target
    ops = [
        Op("add", "chain", "svc"), Op("add", "chain", "ep"), Op("add", "chain", "ep2"), Op("add", "chain", "fw"),
        Op("add", "set", aff, SetDecl("set", type=addr_type, flags="dynamic,timeout", timeout=60)),
        Op("add", "rule", "svc", rule(Addr(ipx, "daddr", addr2), Dport("udp", 53), Addr(ipx, "saddr", net, neg=True),
                                      masq)),
        Op("add", "rule", "svc", rule(Addr(ipx, "daddr", addr2), Dport("sctp", 9), Addr(ipx, "saddr", odd), masq)),
        Op("add", "rule", "svc", rule(Lookup((f"{ipx} saddr",), aff), Verdict("goto", "ep"))),
        Op("add", "rule", "svc", rule(NumgenVmap(("ep", "ep2", "ep")))),
        Op("add", "rule", "ep", rule(Addr(ipx, "saddr", host), masq)),
        Op("add", "rule", "ep", rule(Update(aff, ipx))),
        Op("add", "rule", "ep", rule(DnatTo("udp", ip, port))),
        Op("add", "rule", "ep2", rule(Addr(ipx, "saddr", net), Verdict("goto", "ep"), comment="short-circuit pod traffic")),
        Op("add", "rule", "ep2", rule(FibLocal("saddr"), masq, comment="masquerade local traffic")),
        Op("add", "rule", "ep2", rule(L4proto("sctp"))),
        Op("add", "rule", "ep2", rule(Verdict("accept"))),
        Op("add", "rule", "fw", rule(AddrIn(ipx, "saddr", ranges, neg=True), Verdict("drop"))),
        Op("add", "rule", "fw", rule(AddrIn(ipx, "saddr", (net,), neg=True), Verdict("drop"))),
        Op("add", "element", "service-ips", el(addr2, "udp", "53", value=Verdict("goto", "svc"))),
        Op("add", "element", "firewall-ips", el(addr2, "sctp", "9", value=Verdict("goto", "fw"), comment="ns/svc:x")),
        Op("add", "element", "no-endpoint-reject", el(addr2, "tcp", "1", comment="ns/svc:y")),
        Op("add", "element", "no-endpoint-drop", el(addr2, "udp", "2")),
        Op("add", "element", "service-nodeports", el("udp", "30053", value=Verdict("jump", "ep"))),
        Op("add", "element", "no-endpoint-nodeport-reject", el("tcp", "30054", comment="ns/svc:y")),
        Op("add", "element", "no-endpoint-nodeport-drop", el("sctp", "30055")),
        Op("add", "element", "hairpin", el(host, host)),
        Op("add", "element", "cluster-ips", el(addr2)),
        Op("add", "map", "endpoints-udp-003",
           SetDecl("map", typeof=f"numgen random mod 65536 : {ipx} daddr . udp dport", flags="interval")),
        Op("add", "map", "endpoints-sctp-003",
           SetDecl("map", typeof=f"numgen random mod 65536 : {ipx} daddr . sctp dport", flags="interval")),
        Op("add", "chain", "svc2"),
        Op("add", "rule", "svc2", rule(DnatMap("udp", 65536, 65536, "endpoints-udp-003"))),
        Op("add", "rule", "svc2", rule(DnatMap("sctp", 65536, 0, "endpoints-sctp-003"))),
        Op("add", "element", "endpoints-udp-003", rng(65536, 87381, host, 53) + rng(87382, 131071, addr2, 5353)),
        Op("add", "element", "endpoints-sctp-003", rng(0, 65535, host, 9)),
    ]
    assert nflink.supported(ops, family)
    nflink.apply(ops, family, netns=a)
    nft(b, ops_text(ops, family))
    assert listing(a, fam) == listing(b, fam)
    assert bytecode(a, fam) == bytecode(b, fam)
    undo = [
        Op("delete", "element", "service-ips", el(addr2, "udp", "53")),
        Op("delete", "element", "firewall-ips", el(addr2, "sctp", "9")),
        Op("delete", "element", "service-nodeports", el("udp", "30053")),
        Op("delete", "element", "cluster-ips", el(addr2)),
        Op("delete", "element", "hairpin", el(host, host)),
        Op("delete", "element", "no-endpoint-reject", el(addr2, "tcp", "1")),
        Op("delete", "element", "endpoints-udp-003", rng(65536, 87381)),
        Op("add", "element", "endpoints-udp-003", rng(65536, 76458, host, 53)),
        Op("flush", "chain", "svc2"), Op("delete", "chain", "svc2"),
        Op("delete", "map", "endpoints-sctp-003"),
        Op("flush", "chain", "svc"), Op("flush", "chain", "ep"), Op("flush", "chain", "ep2"),
        Op("delete", "chain", "ep"),
        Op("delete", "set", aff),
    ]
    nflink.apply(undo, family, netns=a)
    nft(b, ops_text(undo, family))
    assert listing(a, fam) == listing(b, fam)
    assert bytecode(a, fam) == bytecode(b, fam)


# ---------------------------------------------------------------- full transactions over netlink

def _every_feature():
    """A generated cluster with every Service kind the layout has a form for."""
    from clusterdns.model import Node
    recs = synthetic_records(12, 3, nodeport_every=4, node_name="node-0")
    recs = [(k, r) for k, r in recs if k != "Node" or r.name != "node-0"] + [
        ("Node", Node("node-0", ("192.168.0.2",), (("topology.kubernetes.io/zone", "zone-0"),)))]
    recs += [
        ("Service", Service("f", "lb", LOAD_BALANCER, ("10.96.5.1",), ports=(ServicePort("http", "TCP", 80, 31001),),
                            external_ips=("192.0.2.9",), lb_ips=("198.51.100.5",),
                            lb_source_ranges=("203.0.113.0/25", "192.168.0.0/24"), external_local=True)),
        _slice("f", "lb", "10.5.0.1", "10.5.0.2", node="node-1"),
        ("Service", Service("f", "local", ports=(ServicePort("dns", "UDP", 53),), cluster_ips=("10.96.5.2",),
                            internal_local=True)),
        _slice("f", "local", "10.5.1.1", node="node-0", port=53),
        ("Service", Service("f", "sticky", ports=(ServicePort("http", "TCP", 80),), cluster_ips=("10.96.5.3",),
                            affinity_timeout=300)),
        _slice("f", "sticky", "10.5.2.1", "10.5.2.2"),
        ("Service", Service("f", "empty", ports=(ServicePort("x", "SCTP", 9, 31002),), cluster_ips=("10.96.5.4",),
                            type=NODE_PORT)),
        ("Service", Service("f", "draining", ports=(ServicePort("http", "TCP", 80),), cluster_ips=("10.96.5.5",))),
        ("EndpointSlice", EndpointSlice("f", "draining-x", "draining", "IPv4", (
            Endpoint(("10.5.3.1",), ready=False, serving=True, terminating=True, node_name="node-0"),),
            (EndpointPort("http", "TCP", 8080),))),
        ("Service", Service("f", "zoned", ports=(ServicePort("http", "TCP", 80),), cluster_ips=("10.96.5.6",),
                            topology_aware=True)),
        ("EndpointSlice", EndpointSlice("f", "zoned-x", "zoned", "IPv4", (
            Endpoint(("10.5.4.1",), node_name="node-0", zone="zone-0", hint_zones=("zone-0",)),
            Endpoint(("10.5.4.2",), node_name="node-1", zone="zone-1", hint_zones=("zone-1",))),
            (EndpointPort("http", "TCP", 8080),))),
    ]
    return state_from_records(recs)


FULL_CASES = {
    "demo-v4": (lambda: _demo(), CFG6, 4),
    "demo-v6": (lambda: _demo(), CFG6, 6),
    "every-feature": (_every_feature, CFG, 4),
    "two-service-cidrs-nodeports-everywhere": (
        _every_feature, CFG.with_options(service_cidrs=("10.96.0.0/12", "10.200.0.0/16"), nodeport_addresses=("all",)), 4),
    "masquerade-all-no-detector": (_every_feature, CFG.with_options(masquerade_all=True, cluster_cidrs=()), 4),
    "v6-two-cidrs": (lambda: _demo(), CFG6.with_options(service_cidrs=("fd00:20::/108", "fd00:30::/108")), 6),
}


def _demo():
    from clusterdns.sources.manifest import DEMO_MANIFEST, load_files
    records, _ = load_files([DEMO_MANIFEST])
    return state_from_records(records)


@needs_netns
@pytest.mark.parametrize("case", sorted(FULL_CASES))
def test_full_load_over_netlink_equals_nft(pair, case):
    """The whole table as one netlink batch leaves the kernel as `nft -f` of the printed text does."""
    make, cfg, family = FULL_CASES[case]
    a, b = pair
    fam = "ip6" if family == 6 else "ip"
    st = make()
    rs = nftables.render(st, cfg, family)
    if case == "every-feature":   # the forms are really there
        for form in ("update @affinity-", "goto local-", "firewall-", "no-endpoint-reject { ", "short-circuit",
                     "offset ", " : 10.5.4.1 . 8080", "sctp . 31002"):
            assert form in rs.text, form
        assert " : 10.5.4.2 . 8080" not in rs.text      # topology: the other zone's endpoint is not used
    if case.startswith(("two-service-cidrs", "v6-two")):
        assert any("daddr {" in op.body.text() for op in rs.ops if op.kind == "rule")
    assert nflink.supported(rs.ops, family, full=True)
    assert not nflink.supported(rs.ops, family)          # the base forms are for full transactions only
    nflink.apply(rs.ops, family, netns=a, full=True)
    nft(b, rs.text)
    assert listing(a, fam) == listing(b, fam)
    assert bytecode(a, fam) == bytecode(b, fam)
    # again over the existing table (it deletes and recreates it), and an in-place resync after drift
    nflink.apply(rs.ops, family, netns=a, full=True)
    assert listing(a, fam) == listing(b, fam)
    drift = [Op("flush", "chain", next(c for c in rs.state.chains if c.startswith("service-")))]
    nflink.apply(drift, family, netns=a)
    nft(b, ops_text(drift, family))
    resync = nftables.render(st, cfg, family, previous=rs.state, resync=True)
    nflink.apply(resync.ops, family, netns=a, full=True)
    nft(b, resync.text)
    assert listing(a, fam) == listing(b, fam)
    assert bytecode(a, fam) == bytecode(b, fam)


@needs_netns
def test_a_dump_comes_as_it_is_read_and_one_left_unread_closes_its_socket(pair):
    """dump() yields each reply as it arrives (a big table is never held whole); a dump the
    caller stops reading leaves its socket closed, so the next request gets its own replies."""
    a, _ = pair
    rs = nftables.render(state_from_records(synthetic_records(300, 4)), CFG)
    nflink.apply(rs.ops, 4, netns=a, full=True)
    table = nflink._str(1, nftables.n.NFT_TABLE)
    rules = nflink.dump(nflink.GETRULE, 4, table, netns=a)
    assert not isinstance(rules, list)
    first = next(rules)
    assert 2 in first and 4 in first                  # a rule: its chain and expressions
    link = nflink._link(a)
    rules.close()                                     # stopped early: replies left unread
    assert nflink._link(a) is not link
    everything = list(nflink.dump(nflink.GETRULE, 4, table, netns=a))
    assert len(everything) == sum(len(r) for r in rs.state.chains.values())
    found = nftables.programmed(4, netns=a)
    assert len(found) == 300 and all(len(eps) == 4 for eps in found.values())


def test_bulk_elements_are_encoded_as_elements_are():
    """The endpoint-map ranges and hairpin pairs of a full load are written from their flat
    tuples directly; the bytes are those of the general element encoder, both families, both verbs."""
    from clusterdns.proxy.nftobj import element_of
    from clusterdns.proxy.servicemap import EndpointInfo
    for family, ip in ((4, "10.1.2.3"), (6, "fd00:161::2")):
        rng = nftables._slot_element("endpoints-tcp-007", 7 * 65536, 3, 1, EndpointInfo(ip, 8080, ""))
        pair = nftables._hairpin_element(ip)[2]
        for name, flat in (("endpoints-tcp-007", rng), ("hairpin", pair)):
            for verb in ("add", "delete"):
                fast = nflink._element(name, flat, verb, family)
                assert fast == nflink._element(name, element_of(flat), verb, family), (name, verb, family)
    # not an endpoint map's name, a comment, an address of the other family: the general path decides
    assert nflink._bulk_element("endpoints-x", rng, "add", 4) is None
    with pytest.raises(nflink.Unsupported):
        nflink._element("hairpin", nftables._hairpin_element("fd00::1")[2], "add", 4)
