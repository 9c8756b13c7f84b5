"""nflink: incremental nftables transactions sent over nfnetlink must leave the kernel exactly as `nft -f` does."""
from __future__ import annotations

import errno
import os
import re
import subprocess
import textwrap
from dataclasses import replace

import pytest

from clusterdns.config import Config
from clusterdns.model import LOAD_BALANCER, NODE_PORT, Endpoint, EndpointPort, EndpointSlice, Service, ServicePort
from clusterdns.proxy import nflink, nftables
from clusterdns.state import state_from_records
from clusterdns.synthetic import synthetic_records
from tests.nslib import requires

CFG = Config(command="rules", node_name="node-0", node_ips=("192.168.0.2",),
             cluster_cidrs=("10.0.0.0/8",), service_cidrs=("10.96.0.0/12",))
T = "ip kube-proxy"


# ---------------------------------------------------------------- which lines are ours

def test_supported_forms():
    lines = [
        f"add chain {T} endpoint-AAAA-ns/svc/tcp/http__10.0.1.3/8080",
        f"flush chain {T} service-X",
        f"delete chain {T} service-X",
        f"add rule {T} svc ip daddr 10.96.0.2 tcp dport 80 ip saddr != 10.0.0.0/8 jump mark-for-masquerade",
        f"add rule {T} svc numgen random mod 2 vmap {{ 0 : goto ep-a , 1 : goto ep-b }}",
        f"add rule {T} ep ip saddr 10.0.1.3 jump mark-for-masquerade",
        f"add rule {T} ep meta l4proto tcp dnat to 10.0.1.3:8080",
        f'add rule {T} ext ip saddr 10.0.0.0/8 goto svc comment "short-circuit pod traffic"',
        f'add rule {T} ext fib saddr type local jump mark-for-masquerade comment "masquerade local traffic"',
        f"add rule {T} ext goto svc",
        f"add rule {T} fw drop",
        f"add rule {T} fw ip saddr != {{ 203.0.113.0/25, 198.51.100.9, 192.0.2.0/24 }} drop",
        f"add element {T} service-ips {{ 10.96.0.2 . tcp . 80 : goto svc }}",
        f'add element {T} no-endpoint-reject {{ 10.96.0.2 . udp . 53 comment "ns/svc:dns" }}',
        f'add element {T} no-endpoint-nodeport-drop {{ tcp . 30001 comment "ns/svc:http" }}',
        f"add element {T} hairpin {{ 10.0.1.3 . 10.0.1.3 }}",
        f"add element {T} endpoints-tcp-007 {{ 65536-98303 : 10.0.1.3 . 8080 }}",
        f"delete element {T} endpoints-tcp-007 {{ 65536-98303 }}",
        f"add map {T} endpoints-udp-007 {{ typeof numgen random mod 65536 : ip daddr . udp dport ; flags interval ; }}",
        f"delete map {T} endpoints-udp-007",
        f"add rule {T} svc meta l4proto tcp dnat to numgen random mod 65536 offset 131072 map @endpoints-tcp-007",
        f"add rule {T} svc meta l4proto udp dnat to numgen random mod 65536 map @endpoints-udp-007",
        f"add element {T} cluster-ips {{ 10.96.0.2 }}",
        f"delete element {T} service-nodeports {{ sctp . 30001 }}",
        f"add set {T} affinity-AAAA-ns/svc/tcp/http__10.0.1.3/8080 {{ type ipv4_addr ; flags dynamic,timeout ; "
        "timeout 10800s ; }",
        f"delete set {T} affinity-AAAA-ns/svc/tcp/http__10.0.1.3/8080",
        f"add rule {T} svc ip saddr @affinity-AAAA-ns/svc/tcp/http__10.0.1.3/8080 goto ep",
        f"add rule {T} ep update @affinity-AAAA-ns/svc/tcp/http__10.0.1.3/8080 {{ ip saddr }}",
    ]
    for line in lines:
        assert nflink.supported(line + "\n"), line
    assert nflink.supported("\n".join(lines))


@pytest.mark.parametrize("line", [
    f'add table {T} {{ comment "rules for kube-proxy" ; }}',
    f"delete table {T}",
    f"add chain {T} nat-output {{ type nat hook output priority -100 ; }}",
    f'add map {T} service-ips {{ type ipv4_addr . inet_proto . inet_service : verdict ; }}',
    f"flush map {T} service-ips",
    f"add set {T} other {{ type ipv4_addr ; flags dynamic,timeout ; timeout 10s ; }}",
    f"add set {T} affinity-A {{ type ipv6_addr ; flags dynamic,timeout ; timeout 10s ; }}",
    f"add set {T} affinity-A {{ type ipv4_addr ; flags timeout ; timeout 10s ; }}",
    f"flush set {T} affinity-A",
    f"add rule {T} c ip saddr @cluster-ips goto x",
    f"add rule {T} c ip saddr != @affinity-A goto x",
    f"add rule {T} c update @affinity-A {{ ip daddr }}",
    f"add rule {T} c update",
    f"add rule {T} fw ip saddr != {{ 203.0.113.0/25, 203.0.113.128/25 }} drop",   # adjacent: nft merges
    f"add rule {T} fw ip saddr != {{ 203.0.113.0/24, 203.0.113.128/25 }} drop",   # overlapping
    f"add rule {T} fw ip saddr != {{ 0.0.0.0/2, 192.0.2.0/24 }} drop",      # starts at the lowest address
    f"add rule {T} fw ip saddr != {{ 192.0.2.0/24, 255.0.0.0/8 }} drop",    # ends at the highest
    f"add rule {T} fw ip saddr {{ 203.0.113.0/25 }} drop",
    f"add rule {T} fw ip daddr != {{ 203.0.113.0/25 }} drop",
    f"add rule {T} fw ip saddr != {{ fd00::/64, 192.0.2.0/24 }} drop",
    f"add rule {T} c ip daddr . meta l4proto . th dport vmap @service-ips",
    f"add rule {T} c ct state new jump x",
    f"add rule {T} c masquerade fully-random",
    f"add rule {T} c ip saddr 10.0.0.1/8 jump x",                      # host bits set
    f"add rule {T} c ip saddr 10.0.0.1 ip daddr 10.0.0.2 jump x",      # nft would merge the two loads
    f"add rule {T} c meta l4proto tcp dnat to [fd00::1]:80",            # v6 target in an ip table
    f"add rule {T} c dnat to 10.0.0.1:80",                              # no protocol before it
    f"add rule {T} c numgen random mod 3 vmap {{ 0 : goto a , 1 : goto b }}",
    f"add rule {T} c numgen random mod 2 vmap {{ 0 : goto a , 0 : goto b }}",
    f"add element {T} service-ips {{ 10.96.0.2 . tcp . 80 }}",           # a map element without data
    f"add element {T} cluster-ips {{ 10.96.0.2 : goto x }}",
    f"add element {T} service-ips {{ 10.96.0.2 . icmp . 80 : goto x }}",
    f"add element {T} other-set {{ 10.96.0.2 }}",
    f"add element {T} endpoints-tcp-1 {{ 5 : 10.0.0.1 . 80 }}",                  # not a range
    f"add element {T} endpoints-tcp-1 {{ 0-5 : 10.0.0.1 }}",                     # no port
    f"add element {T} hairpin {{ 10.0.0.1 }}",
    f"add map {T} endpoints-tcp-1 {{ typeof numgen random mod 65536 : ip daddr . udp dport ; flags interval ; }}",
    f"add map {T} other {{ typeof numgen random mod 65536 : ip daddr . tcp dport ; flags interval ; }}",
    f"add rule {T} c meta l4proto udp dnat to numgen random mod 65536 map @endpoints-tcp-1",   # protocol mismatch
    f"add rule {T} c meta l4proto tcp dnat to numgen random mod 65536 offset 7 map @endpoints-tcp-1",
    f"add rule {T} c meta l4proto tcp dnat to numgen random mod 100 map @endpoints-tcp-1",
    f"add chain ip6 kube-proxy a\nadd chain {T} b",                    # mixed families
    "list ruleset",
])
def test_unsupported_forms(line):
    assert not nflink.supported(line)
    with pytest.raises(nflink.Unsupported):
        nflink.apply(line, 6 if line.startswith("add chain ip6") else 4)


def test_full_render_falls_back_but_incremental_does_not():
    st = state_from_records(synthetic_records(5, 3, nodeport_every=2))
    full = nftables.render(st, CFG)
    assert not nflink.supported(full.text)
    # every Service-owned line of the full text is one nflink encodes
    service_lines = [ln for ln in full.text.splitlines()
                     if re.match(r"add (rule|chain) ip kube-proxy (service|external|endpoint)-[A-Z0-9]{8}-", ln)
                     or ln.startswith("add element")]
    assert len(service_lines) > 30
    assert nflink.supported("\n".join(service_lines))


# ---------------------------------------------------------------- in the kernel

needs_netns = requires("nft")


@pytest.fixture
def pair(namespaces):
    try:
        yield [namespaces.add("a"), namespaces.add("b")]
    finally:
        nflink.close_all()


def nft(ns: str, text: str) -> None:
    r = subprocess.run(["ip", "netns", "exec", ns, "nft", "-f", "-"], input=text, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr + text


def listing(ns: str, fam: str = "ip") -> str:
    return subprocess.run(["ip", "netns", "exec", ns, "nft", "list", "table", fam, "kube-proxy"],
                          capture_output=True, text=True, check=True).stdout


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
        if nflink.supported(rs.text):
            nflink.apply(rs.text, 4, netns=a)
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
    assert nflink.supported(rs.text)
    nflink.apply(rs.text, netns=a)
    nft(b, rs.text)
    assert listing(a) == listing(b)
    assert bytecode(a) == bytecode(b)


@needs_netns
def test_failing_batch_applies_nothing(pair):
    a, _ = pair
    st = state_from_records(synthetic_records(3, 2))
    nft(a, nftables.render(st, CFG).text)
    before = listing(a)
    text = textwrap.dedent(f"""\
        add chain {T} endpoint-NEW
        add rule {T} endpoint-NEW meta l4proto tcp dnat to 10.0.9.9:8080
        add element {T} cluster-ips {{ 10.96.9.9 }}
        delete chain {T} endpoint-MISSING
        add element {T} cluster-ips {{ 10.96.9.10 }}
        """)
    assert nflink.supported(text)
    with pytest.raises(nflink.NflinkError) as info:
        nflink.apply(text, netns=a)
    assert info.value.errno == errno.ENOENT
    assert info.value.line == f"delete chain {T} endpoint-MISSING"
    assert "line 4" in str(info.value)
    assert listing(a) == before
    # a chain still referenced by a map element cannot go: EBUSY, and again nothing changes
    svc_chain = next(c for c in nftables.render(st, CFG).state.chains if c.startswith("service-"))
    with pytest.raises(nflink.NflinkError) as info:
        nflink.apply(f"add element {T} cluster-ips {{ 10.96.9.9 }}\nflush chain {T} {svc_chain}\n"
                     f"delete chain {T} {svc_chain}\n", netns=a)
    assert info.value.errno == errno.EBUSY
    assert listing(a) == before
    # the socket stays usable after failures
    nflink.apply(f"add element {T} cluster-ips {{ 10.96.9.9 }}\n", netns=a)
    assert "10.96.9.9" in listing(a)


@needs_netns
def test_missing_namespace_is_a_clear_error():
    with pytest.raises(nflink.NflinkError, match="no network namespace"):
        nflink.apply(f"add chain {T} x\n", netns=f"cdns-nfl-absent-{os.getpid()}")


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
    assert nflink.supported(rs.text)
    nflink.apply(rs.text, netns=a)
    out = subprocess.run(["ip", "netns", "exec", a, "python3", "-c", SERVER_AND_CLIENT, "10.96.7.7"],
                         capture_output=True, text=True, timeout=20)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "hello from the endpoint"


CFG6 = Config(command="rules", node_name="node-a", node_ips=("192.168.49.2", "fd00:49::2"),
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
    for text in (rs.text, rs2.text):
        assert nflink.supported(text)
        with pytest.raises(nflink.Unsupported):
            nflink.apply(text, 4, netns=a)          # the family must match the text
        nflink.apply(text, 6, netns=a)
        nft(b, text)
        assert _blocks(listing(a, "ip6")) == _blocks(listing(b, "ip6"))
        assert listing(a, "ip6") == listing(b, "ip6")
        assert bytecode(a, "ip6") == bytecode(b, "ip6")


@needs_netns
@pytest.mark.parametrize("family", [4, 6])
def test_each_form_matches_nft(pair, family):
    """Every rule and element form, including ones the step sequence does not reach, in both families."""
    a, b = pair
    fam, ipx = ("ip6", "ip6") if family == 6 else ("ip", "ip")
    t = f"{fam} kube-proxy"
    empty = nftables.render(state_from_records([]), CFG6, family)
    nft(a, empty.text)
    nft(b, empty.text)
    if family == 4:
        host, net, odd, addr2, ranges = "10.0.1.3", "10.0.0.0/8", "10.96.0.0/12", "10.96.0.2", \
            "203.0.113.0/25, 198.51.100.9, 192.0.2.0/24"
        target = "10.0.1.3:8080"
    else:
        host, net, odd, addr2, ranges = "fd00:161::3", "fd00:161::/64", "fd00:20::/108", "fd00:20::2", \
            "2001:db8::/64, 2001:db8:1::7, 2001:db8:2::/48"
        target = "[fd00:161::3]:8080"
    aff = "affinity-ABCDEFGH-ns/svc/udp/dns__x/53"
    text = textwrap.dedent(f"""\
        add chain {t} svc
        add chain {t} ep
        add chain {t} ep2
        add chain {t} fw
        add set {t} {aff} {{ type {"ipv6_addr" if family == 6 else "ipv4_addr"} ; flags dynamic,timeout ; timeout 60s ; }}
        add rule {t} svc {ipx} daddr {addr2} udp dport 53 {ipx} saddr != {net} jump mark-for-masquerade
        add rule {t} svc {ipx} daddr {addr2} sctp dport 9 {ipx} saddr {odd} jump mark-for-masquerade
        add rule {t} svc {ipx} saddr @{aff} goto ep
        add rule {t} svc numgen random mod 3 vmap {{ 0 : goto ep , 1 : goto ep2 , 2 : goto ep }}
        add rule {t} ep {ipx} saddr {host} jump mark-for-masquerade
        add rule {t} ep update @{aff} {{ {ipx} saddr }}
        add rule {t} ep meta l4proto udp dnat to {target}
        add rule {t} ep2 {ipx} saddr {net} goto ep comment "short-circuit pod traffic"
        add rule {t} ep2 fib saddr type local jump mark-for-masquerade comment "masquerade local traffic"
        add rule {t} ep2 meta l4proto sctp
        add rule {t} ep2 accept
        add rule {t} fw {ipx} saddr != {{ {ranges} }} drop
        add rule {t} fw {ipx} saddr != {{ {net} }} drop
        add element {t} service-ips {{ {addr2} . udp . 53 : goto svc }}
        add element {t} firewall-ips {{ {addr2} . sctp . 9 comment "ns/svc:x" : goto fw }}
        add element {t} no-endpoint-reject {{ {addr2} . tcp . 1 comment "ns/svc:y" }}
        add element {t} no-endpoint-drop {{ {addr2} . udp . 2 }}
        add element {t} service-nodeports {{ udp . 30053 : jump ep }}
        add element {t} no-endpoint-nodeport-reject {{ tcp . 30054 comment "ns/svc:y" }}
        add element {t} no-endpoint-nodeport-drop {{ sctp . 30055 }}
        add element {t} hairpin {{ {host} . {host} }}
        add element {t} cluster-ips {{ {addr2} }}
        add map {t} endpoints-udp-003 {{ typeof numgen random mod 65536 : {ipx} daddr . udp dport ; flags interval ; }}
        add map {t} endpoints-sctp-003 {{ typeof numgen random mod 65536 : {ipx} daddr . sctp dport ; flags interval ; }}
        add chain {t} svc2
        add rule {t} svc2 meta l4proto udp dnat to numgen random mod 65536 offset 65536 map @endpoints-udp-003
        add rule {t} svc2 meta l4proto sctp dnat to numgen random mod 65536 map @endpoints-sctp-003
        add element {t} endpoints-udp-003 {{ 65536-87381 : {host} . 53 }}
        add element {t} endpoints-udp-003 {{ 87382-131071 : {addr2} . 5353 }}
        add element {t} endpoints-sctp-003 {{ 0-65535 : {host} . 9 }}
        """)
    assert nflink.supported(text)
    nflink.apply(text, family, netns=a)
    nft(b, text)
    assert listing(a, fam) == listing(b, fam)
    assert bytecode(a, fam) == bytecode(b, fam)
    undo = textwrap.dedent(f"""\
        delete element {t} service-ips {{ {addr2} . udp . 53 }}
        delete element {t} firewall-ips {{ {addr2} . sctp . 9 }}
        delete element {t} service-nodeports {{ udp . 30053 }}
        delete element {t} cluster-ips {{ {addr2} }}
        delete element {t} hairpin {{ {host} . {host} }}
        delete element {t} no-endpoint-reject {{ {addr2} . tcp . 1 }}
        delete element {t} endpoints-udp-003 {{ 65536-87381 }}
        add element {t} endpoints-udp-003 {{ 65536-76458 : {host} . 53 }}
        flush chain {t} svc2
        delete chain {t} svc2
        delete map {t} endpoints-sctp-003
        flush chain {t} svc
        flush chain {t} ep
        flush chain {t} ep2
        delete chain {t} ep
        delete set {t} {aff}
        """)
    nflink.apply(undo, family, netns=a)
    nft(b, undo)
    assert listing(a, fam) == listing(b, fam)
    assert bytecode(a, fam) == bytecode(b, fam)
