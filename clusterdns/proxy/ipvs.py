"""IPVS mode: what kube-proxy's IPVS proxier sets up, as the inputs of its tools.

One IPVS virtual server per (address, protocol, port) of every ClusterIP,
externalIP, LoadBalancer IP and node address with a NodePort, with a real
server (masquerading, weight 1) per endpoint; the kube-ipvs0 dummy device
holds the service addresses; ipsets classify packets; a few iptables rules
keyed on those ipsets masquerade and filter. `render` is pure and returns the
ipvsadm-restore, `ipset restore` and iptables-restore inputs. This kernel
has no IPVS module, so the configuration is unit-tested, not run.

Differences from kube-proxy (docs/proxy.md): KUBE-IPVS-OUT-FILTER is
created and jumped to but left empty.
"""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from ..config import Config
from ..lifetime import gc_paused
from ..state import ClusterState
from .iptables import mark_hex
from .servicemap import Categorized, PortsCache, ServicePortInfo, node_info, parse_endpoint, service_ports

SCHEDULERS = ("rr", "wrr", "lc", "wlc", "lblc", "lblcr", "sh", "dh", "sed", "nq")
DEVICE = "kube-ipvs0"

# ipset name, type, comment (kube-proxy's ipsetInfo)
LOOP_BACK = "KUBE-LOOP-BACK"
CLUSTER_IP = "KUBE-CLUSTER-IP"
EXTERNAL_IP = "KUBE-EXTERNAL-IP"
EXTERNAL_IP_LOCAL = "KUBE-EXTERNAL-IP-LOCAL"
LOAD_BALANCER = "KUBE-LOAD-BALANCER"
LOAD_BALANCER_FW = "KUBE-LOAD-BALANCER-FW"
LOAD_BALANCER_LOCAL = "KUBE-LOAD-BALANCER-LOCAL"
LOAD_BALANCER_SOURCE_IP = "KUBE-LOAD-BALANCER-SOURCE-IP"
LOAD_BALANCER_SOURCE_CIDR = "KUBE-LOAD-BALANCER-SOURCE-CIDR"
NODE_PORT_TCP = "KUBE-NODE-PORT-TCP"
NODE_PORT_LOCAL_TCP = "KUBE-NODE-PORT-LOCAL-TCP"
NODE_PORT_UDP = "KUBE-NODE-PORT-UDP"
NODE_PORT_LOCAL_UDP = "KUBE-NODE-PORT-LOCAL-UDP"
NODE_PORT_SCTP = "KUBE-NODE-PORT-SCTP-HASH"
NODE_PORT_LOCAL_SCTP = "KUBE-NODE-PORT-LOCAL-SCTP-HASH"
HEALTH_CHECK_NODE_PORT = "KUBE-HEALTH-CHECK-NODE-PORT"
IPVS_IPS = "KUBE-IPVS-IPS"

IPSETS = (
    (LOOP_BACK, "hash:ip,port,ip", "Kubernetes endpoints dst ip:port, source ip for solving hairpin purpose"),
    (CLUSTER_IP, "hash:ip,port", "Kubernetes service cluster ip + port for masquerade purpose"),
    (EXTERNAL_IP, "hash:ip,port", "Kubernetes service external ip + port for masquerade and filter purpose"),
    (EXTERNAL_IP_LOCAL, "hash:ip,port", "Kubernetes service external ip + port with externalTrafficPolicy=local"),
    (LOAD_BALANCER, "hash:ip,port", "Kubernetes service lb portal"),
    (LOAD_BALANCER_FW, "hash:ip,port", "Kubernetes service load balancer ip + port for load balancer with sourceRange"),
    (LOAD_BALANCER_LOCAL, "hash:ip,port",
     "Kubernetes service load balancer ip + port with externalTrafficPolicy=local"),
    (LOAD_BALANCER_SOURCE_IP, "hash:ip,port,ip",
     "Kubernetes service load balancer ip + port + source IP for packet filter purpose"),
    (LOAD_BALANCER_SOURCE_CIDR, "hash:ip,port,net",
     "Kubernetes service load balancer ip + port + source cidr for packet filter purpose"),
    (NODE_PORT_TCP, "bitmap:port", "Kubernetes nodeport TCP port for masquerade purpose"),
    (NODE_PORT_LOCAL_TCP, "bitmap:port", "Kubernetes nodeport TCP port with externalTrafficPolicy=local"),
    (NODE_PORT_UDP, "bitmap:port", "Kubernetes nodeport UDP port for masquerade purpose"),
    (NODE_PORT_LOCAL_UDP, "bitmap:port", "Kubernetes nodeport UDP port with externalTrafficPolicy=local"),
    (NODE_PORT_SCTP, "hash:ip,port", "Kubernetes nodeport SCTP port for masquerade purpose with type 'hash ip:port'"),
    (NODE_PORT_LOCAL_SCTP, "hash:ip,port",
     "Kubernetes nodeport SCTP port with externalTrafficPolicy=local with type 'hash ip:port'"),
    (HEALTH_CHECK_NODE_PORT, "bitmap:port", "Kubernetes health check node port"),
    (IPVS_IPS, "hash:ip", "Addresses on ipvs interface"),
)
_TYPES = {name: kind for name, kind, _ in IPSETS}
_COMMENTS = {name: comment for name, _, comment in IPSETS}

# (ipset, table, from chain, to, match type, protocol): kube-proxy's ipsetWithIptablesChain, in order
_SET_RULES = (
    (LOOP_BACK, "nat", "KUBE-POSTROUTING", "MASQUERADE", "dst,dst,src", ""),
    (LOAD_BALANCER, "nat", "KUBE-SERVICES", "KUBE-LOAD-BALANCER", "dst,dst", ""),
    (LOAD_BALANCER_LOCAL, "nat", "KUBE-LOAD-BALANCER", "RETURN", "dst,dst", ""),
    (LOAD_BALANCER_FW, "filter", "KUBE-PROXY-FIREWALL", "KUBE-SOURCE-RANGES-FIREWALL", "dst,dst", ""),
    (LOAD_BALANCER_SOURCE_CIDR, "filter", "KUBE-SOURCE-RANGES-FIREWALL", "RETURN", "dst,dst,src", ""),
    (LOAD_BALANCER_SOURCE_IP, "filter", "KUBE-SOURCE-RANGES-FIREWALL", "RETURN", "dst,dst,src", ""),
    (NODE_PORT_LOCAL_TCP, "nat", "KUBE-NODE-PORT", "RETURN", "dst", "tcp"),
    (NODE_PORT_TCP, "nat", "KUBE-NODE-PORT", "KUBE-MARK-MASQ", "dst", "tcp"),
    (NODE_PORT_LOCAL_UDP, "nat", "KUBE-NODE-PORT", "RETURN", "dst", "udp"),
    (NODE_PORT_UDP, "nat", "KUBE-NODE-PORT", "KUBE-MARK-MASQ", "dst", "udp"),
    (NODE_PORT_LOCAL_SCTP, "nat", "KUBE-NODE-PORT", "RETURN", "dst,dst", "sctp"),
    (NODE_PORT_SCTP, "nat", "KUBE-NODE-PORT", "KUBE-MARK-MASQ", "dst,dst", "sctp"),
)

NAT_CHAINS = ("KUBE-SERVICES", "KUBE-POSTROUTING", "KUBE-NODE-PORT", "KUBE-LOAD-BALANCER", "KUBE-MARK-MASQ")
FILTER_CHAINS = ("KUBE-FORWARD", "KUBE-NODE-PORT", "KUBE-PROXY-FIREWALL", "KUBE-SOURCE-RANGES-FIREWALL",
                 "KUBE-IPVS-FILTER", "KUBE-IPVS-OUT-FILTER")
# (table, built-in chain, our chain, comment): kube-proxy's IPVS iptablesJumpChain
JUMPS = (
    ("nat", "OUTPUT", "KUBE-SERVICES", "kubernetes service portals"),
    ("nat", "PREROUTING", "KUBE-SERVICES", "kubernetes service portals"),
    ("nat", "POSTROUTING", "KUBE-POSTROUTING", "kubernetes postrouting rules"),
    ("filter", "FORWARD", "KUBE-FORWARD", "kubernetes forwarding rules"),
    ("filter", "INPUT", "KUBE-NODE-PORT", "kubernetes health check rules"),
    ("filter", "INPUT", "KUBE-PROXY-FIREWALL", "kube-proxy firewall rules"),
    ("filter", "FORWARD", "KUBE-PROXY-FIREWALL", "kube-proxy firewall rules"),
    ("filter", "INPUT", "KUBE-IPVS-FILTER", "kubernetes ipvs access filter"),
    ("filter", "OUTPUT", "KUBE-IPVS-OUT-FILTER", "kubernetes ipvs access filter"),
)
# What the iptables text declares (table -> chains) and inserts ((table, chain, spec) as
# iptables-save prints them): the proxier keeps these, and removes what other modes left.
CHAINS = {"filter": FILTER_CHAINS, "nat": NAT_CHAINS}
JUMP_RULES = tuple((t, builtin, f'-m comment --comment "{c}" -j {ours}') for t, builtin, ours, c in JUMPS)


@dataclass(frozen=True)
class RealServer:
    ip: str
    port: int
    weight: int = 1


@dataclass(frozen=True)
class VirtualServer:
    address: str
    protocol: str          # tcp, udp, sctp
    port: int
    scheduler: str = "rr"
    persistence: int = 0   # ClientIP affinity timeout; 0: none
    reals: tuple[RealServer, ...] = ()
    service: str = ""      # "ns/name:port" it serves

    @property
    def key(self) -> str:
        """ipvsadm's service address: "-t 10.0.0.1:80", "-u [fd00::1]:53", "--sctp-service ..."."""
        flag = {"tcp": "-t", "udp": "-u", "sctp": "--sctp-service"}[self.protocol]
        return f"{flag} {_hostport(self.address, self.port)}"


@dataclass(frozen=True)
class IpvsConfig:
    ipvsadm: str                     # ipvsadm-restore input
    ipsets: str                      # ipset restore input
    iptables: str                    # iptables-restore --noflush input (ip6tables for family 6)
    addresses: tuple[str, ...]       # for kube-ipvs0
    virtual_servers: tuple[VirtualServer, ...] = ()
    set_entries: dict[str, frozenset[str]] | None = None   # ipset name -> entries


def _hostport(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def set_name(name: str, family: int) -> str:
    """kube-proxy names IPv6 sets KUBE-6-... (ipset names are at most 31 characters)."""
    if family == 6 and name.startswith("KUBE-"):
        return ("KUBE-6-" + name[5:])[:31]
    return name


def render(state: ClusterState, cfg: Config, family: int = 4, *, scheduler: str = "",
           cache: PortsCache | None = None) -> IpvsConfig:
    """The IPVS configuration for `state`. cache: servicemap's work kept across renders by the caller."""
    scheduler = scheduler or cfg.proxy.ipvs_scheduler   # kube-proxy's ipvs.scheduler, "" -> rr
    if scheduler not in SCHEDULERS:
        raise ValueError(f"unknown IPVS scheduler {scheduler!r}: one of {', '.join(SCHEDULERS)}")
    with gc_paused():
        return _render(state, cfg, family, scheduler, cache)


def _render(state: ClusterState, cfg: Config, family: int, scheduler: str, cache: PortsCache | None) -> IpvsConfig:
    node = node_info(state, cfg, family)
    nodeport_ips = node.ips if node.nodeport_all else tuple(
        ip for ip in node.nodeport_ips if not ipaddress.ip_address(ip).is_loopback)
    entries: dict[str, set[str]] = {name: set() for name, _, _ in IPSETS}
    servers: list[VirtualServer] = []
    addresses: set[str] = set()

    for info, cat in service_ports(state, cfg, family, cache):
        _service(info, cat, node.primary_ip, nodeport_ips, scheduler, entries, servers, addresses)
    entries[IPVS_IPS] = set(addresses)

    return IpvsConfig(
        ipvsadm=_ipvsadm_text(servers),
        ipsets=_ipset_text(entries, family),
        iptables=_iptables_text(entries, cfg, node.if_local(negate=True) if node.detects_local else "", family),
        addresses=tuple(sorted(addresses, key=lambda a: ipaddress.ip_address(a))),
        virtual_servers=tuple(servers),
        set_entries={set_name(k, family): frozenset(v) for k, v in entries.items()})


def _service(info: ServicePortInfo, cat: Categorized, node_ip: str, nodeport_ips: tuple[str, ...],
             scheduler: str, entries: dict[str, set[str]], servers: list[VirtualServer],
             addresses: set[str]) -> None:
    proto = info.protocol
    port = info.port_number
    internal = cat.local if info.internal_local else cat.cluster
    external = cat.local if info.external_local else cat.cluster

    def vs(address: str, p: int, eps) -> None:
        servers.append(VirtualServer(address, proto, p, scheduler, info.affinity_timeout,
                                     tuple(RealServer(e.ip, e.port) for e in eps), info.name))

    entry = f"{info.cluster_ip},{proto}:{port}"
    entries[CLUSTER_IP].add(entry)
    addresses.add(info.cluster_ip)
    vs(info.cluster_ip, port, internal)
    for ep in cat.all:
        if ep.local:
            entries[LOOP_BACK].add(f"{ep.ip},{proto}:{ep.port},{ep.ip}")

    for eip in info.external_ips:
        entries[EXTERNAL_IP_LOCAL if info.external_local else EXTERNAL_IP].add(f"{eip},{proto}:{port}")
        addresses.add(eip)
        vs(eip, port, external)

    for lbip in info.lb_ips:
        lb_entry = f"{lbip},{proto}:{port}"
        entries[LOAD_BALANCER].add(lb_entry)
        if info.external_local:
            entries[LOAD_BALANCER_LOCAL].add(lb_entry)
        if info.lb_firewall:
            entries[LOAD_BALANCER_FW].add(lb_entry)
            allow_node = False
            for cidr in info.lb_source_ranges:
                entries[LOAD_BALANCER_SOURCE_CIDR].add(f"{lb_entry},{cidr}")
                if node_ip and ipaddress.ip_address(node_ip) in ipaddress.ip_network(cidr, strict=False):
                    allow_node = True
            if allow_node:
                entries[LOAD_BALANCER_SOURCE_IP].add(f"{lb_entry},{lbip}")
        addresses.add(lbip)
        vs(lbip, port, external)

    if info.node_port:
        np = info.node_port
        if proto == "sctp":
            for ip in nodeport_ips:
                entries[NODE_PORT_SCTP].add(f"{ip},sctp:{np}")
                if info.external_local:
                    entries[NODE_PORT_LOCAL_SCTP].add(f"{ip},sctp:{np}")
        else:
            entries[NODE_PORT_TCP if proto == "tcp" else NODE_PORT_UDP].add(str(np))
            if info.external_local:
                entries[NODE_PORT_LOCAL_TCP if proto == "tcp" else NODE_PORT_LOCAL_UDP].add(str(np))
        for ip in nodeport_ips:
            vs(ip, np, external)

    if info.health_check_node_port:
        entries[HEALTH_CHECK_NODE_PORT].add(str(info.health_check_node_port))


def _ipvsadm_text(servers: list[VirtualServer]) -> str:
    out = []
    for s in servers:
        line = f"-A {s.key} -s {s.scheduler}"
        if s.persistence:
            line += f" -p {s.persistence}"
        out.append(line)
        for r in s.reals:
            out.append(f"-a {s.key} -r {_hostport(r.ip, r.port)} -m -w {r.weight}")
    return "\n".join(out) + "\n" if out else ""


def _ipset_text(entries: dict[str, set[str]], family: int) -> str:
    fam = "inet6" if family == 6 else "inet"
    out = []
    for name, kind, _ in IPSETS:
        real = set_name(name, family)
        if kind == "bitmap:port":
            out.append(f"create {real} {kind} range 0-65535 -exist")
        else:
            out.append(f"create {real} {kind} family {fam} hashsize 1024 maxelem 65536 -exist")
        out.append(f"flush {real}")
        for entry in sorted(entries[name]):
            out.append(f"add {real} {entry} -exist")
    return "\n".join(out) + "\n"


def _iptables_text(entries: dict[str, set[str]], cfg: Config, not_local: str, family: int) -> str:
    mark = mark_hex(cfg)
    nat: list[str] = []
    flt: list[str] = []

    def name(s: str) -> str:
        return set_name(s, family)

    def comment(s: str) -> str:
        return f'"{_COMMENTS[s]}"'

    lo = "::1/128" if family == 6 else "127.0.0.0/8"
    nat.append(f"-A KUBE-SERVICES -s {lo} -j RETURN")
    for s, table, src, dst, match, proto in _SET_RULES:
        if not entries[s]:
            continue
        rule = f"-A {src}" + (f" -p {proto}" if proto else "") + \
            f" -m comment --comment {comment(s)} -m set --match-set {name(s)} {match} -j {dst}"
        (flt if table == "filter" else nat).append(rule)
    if entries[CLUSTER_IP]:
        args = f"-A KUBE-SERVICES -m comment --comment {comment(CLUSTER_IP)} -m set --match-set {name(CLUSTER_IP)}"
        if cfg.proxy.masquerade_all:
            nat.append(f"{args} dst,dst -j KUBE-MARK-MASQ")
        elif not_local:
            nat.append(f"{args} dst,dst {not_local} -j KUBE-MARK-MASQ")
        else:
            # node-originated traffic picks a VIP on kube-ipvs0 as its source
            nat.append(f"{args} src,dst -j KUBE-MARK-MASQ")
    for s, masq in ((EXTERNAL_IP, True), (EXTERNAL_IP_LOCAL, False)):
        if not entries[s]:
            continue
        args = f"-A KUBE-SERVICES -m comment --comment {comment(s)} -m set --match-set {name(s)} dst,dst"
        if masq:
            nat.append(f"{args} -j KUBE-MARK-MASQ")
        # only traffic from off the machine, or to an external IP that is local
        nat.append(f"{args} -m physdev ! --physdev-is-in -m addrtype ! --src-type LOCAL -j ACCEPT")
        nat.append(f"{args} -m addrtype --dst-type LOCAL -j ACCEPT")
    nat.append("-A KUBE-SERVICES -m addrtype --dst-type LOCAL -j KUBE-NODE-PORT")
    nat.append("-A KUBE-LOAD-BALANCER -j KUBE-MARK-MASQ")
    flt.append("-A KUBE-SOURCE-RANGES-FIREWALL -j DROP")
    for s in (CLUSTER_IP, LOAD_BALANCER):
        if entries[s]:
            nat.append(f"-A KUBE-SERVICES -m set --match-set {name(s)} dst,dst -j ACCEPT")
    flt.append(f'-A KUBE-FORWARD -m comment --comment "kubernetes forwarding rules" '
               f"-m mark --mark {mark}/{mark} -j ACCEPT")
    flt.append('-A KUBE-FORWARD -m comment --comment "kubernetes forwarding conntrack rule" '
               "-m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT")
    flt.append(f"-A KUBE-NODE-PORT -m comment --comment {comment(HEALTH_CHECK_NODE_PORT)} "
               f"-m set --match-set {name(HEALTH_CHECK_NODE_PORT)} dst -j ACCEPT")
    for s, match in ((LOAD_BALANCER, "dst,dst"), (CLUSTER_IP, "dst,dst"), (EXTERNAL_IP, "dst,dst"),
                     (EXTERNAL_IP_LOCAL, "dst,dst"), (HEALTH_CHECK_NODE_PORT, "dst")):
        flt.append(f"-A KUBE-IPVS-FILTER -m set --match-set {name(s)} {match} -j RETURN")
    flt.append(f"-A KUBE-IPVS-FILTER -m conntrack --ctstate NEW -m set --match-set {name(IPVS_IPS)} dst -j REJECT")
    nat += [f"-A KUBE-POSTROUTING -m mark ! --mark {mark}/{mark} -j RETURN",
            f"-A KUBE-POSTROUTING -j MARK --xor-mark {mark}",
            '-A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring SNAT" '
            "-j MASQUERADE --random-fully",
            f"-A KUBE-MARK-MASQ -j MARK --or-mark {mark}"]

    out = ["*filter"] + [f":{c} - [0:0]" for c in CHAINS["filter"]]
    out += [f"-I {b} {spec}" for t, b, spec in JUMP_RULES if t == "filter"]
    out += flt + ["COMMIT", "*nat"] + [f":{c} - [0:0]" for c in CHAINS["nat"]]
    out += [f"-I {b} {spec}" for t, b, spec in JUMP_RULES if t == "nat"]
    out += nat + ["COMMIT"]
    return "\n".join(out) + "\n"


def cleanup(family: int = 4) -> IpvsConfig:
    """The ipset input destroying IPVS mode's sets (each created first with -exist, so a
    missing set is no error). Remove the iptables rules first (iptables.cleanup_saved):
    a set still referenced by a rule cannot be destroyed. Virtual servers are the
    applier's to delete (ipvsadm -D for each it created).
    """
    fam = "inet6" if family == 6 else "inet"
    lines = []
    for name, kind, _ in IPSETS:
        real = set_name(name, family)
        spec = "range 0-65535" if kind == "bitmap:port" else f"family {fam}"
        lines += [f"create {real} {kind} {spec} -exist", f"destroy {real}"]
    return IpvsConfig(ipvsadm="", ipsets="\n".join(lines) + "\n", iptables="", addresses=())


def parse_list(text: str, family: int | None = None) -> dict[tuple[str, str, int], frozenset[str]]:
    """`ipvsadm -L -n` output -> (virtual address, protocol, port) -> "ip:port" of its real
    servers with a weight above 0 (weight 0: terminating, no new connections).

    Every virtual server is listed (ClusterIPs, externalIPs, LB IPs, node addresses
    with NodePorts): IPVS does not say which is which. Firewall-mark services are skipped."""
    out: dict[tuple[str, str, int], set[str]] = {}
    current: set[str] | None = None
    for line in text.splitlines():
        words = line.split()
        if not words:
            continue
        if words[0] in ("TCP", "UDP", "SCTP") and len(words) >= 2:
            hp = parse_endpoint(words[1])
            current = None
            if hp is None or (family and ipaddress.ip_address(hp[0]).version != family):
                continue
            current = out.setdefault((hp[0], words[0], hp[1]), set())
        elif words[0] == "->" and current is not None and len(words) >= 4:
            hp = parse_endpoint(words[1])
            if hp is None or not words[3].isdigit() or int(words[3]) == 0:
                continue
            current.add(_hostport(*hp))
        elif line[:1] not in (" ", "\t"):
            current = None   # a header or a firewall-mark service
    return {k: frozenset(v) for k, v in out.items()}


__all__ = ["DEVICE", "IpvsConfig", "RealServer", "SCHEDULERS", "VirtualServer", "cleanup", "parse_list", "render", "set_name"]
