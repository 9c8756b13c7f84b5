"""Service ports and their endpoints as kube-proxy sees them, for one IP family.

Shared by every rule generator (iptables, nftables, IPVS) and by `trace`.
Semantics follow kube-proxy: a service port is namespace/name + port name +
protocol; endpoints come only from slices of the family, matched by port
name and protocol, first address only, sorted by their "IP:port" string; and
CategorizeEndpoints decides which endpoints Cluster and Local policies use.
"""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from operator import itemgetter
from typing import NamedTuple

from ..config import Config
from ..lifetime import gc_paused
from ..model import IPV4, IPV6, EndpointSlice, Service, ServicePort
from ..state import ClusterState
from . import names

ZONE_LABEL = "topology.kubernetes.io/zone"


def _family_of(ip: str) -> int:
    return 6 if ":" in ip else 4


def format_endpoint(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def parse_endpoint(text: str) -> tuple[str, int] | None:
    """format_endpoint's inverse, for endpoints as iptables-save, nft and ipvsadm print them:
    "10.0.0.1:8080" / "[fd00::1]:8080" -> (canonical IP, port); None when unreadable."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        return None
    if host[:1] == "[" and host[-1:] == "]":
        host = host[1:-1]
    elif ":" in host:
        return None          # IPv6 without brackets: where the address ends is unknown
    parts = host.split(".")
    if len(parts) == 4 and all(p.isdigit() and (p == "0" or p[0] != "0") and int(p) < 256 for p in parts):
        return host, int(port)   # canonical IPv4 already (the common case): no ipaddress parse
    try:
        return str(ipaddress.ip_address(host)), int(port)
    except ValueError:
        return None


class EndpointInfo(NamedTuple):
    """One endpoint of a service port (a tuple: hundreds of thousands are built per render)."""
    ip: str
    port: int
    endpoint: str                  # "IP:port", or "[IP]:port" for IPv6: kube-proxy's endpoint string
    ready: bool = True
    serving: bool = True
    terminating: bool = False
    local: bool = False
    zone: str = ""
    hint_zones: tuple[str, ...] | None = None
    node_name: str = ""
    pod_namespace: str = ""
    pod_name: str = ""

    @property
    def usable(self) -> bool:
        """Counts towards "has endpoints": ready, or serving while terminating."""
        return self.ready or (self.serving and self.terminating)


@dataclass(frozen=True)
class ServicePortInfo:
    service: tuple[str, str]       # (namespace, name)
    port: ServicePort
    name: str                      # "ns/name:port", or "ns/name" for an unnamed port
    protocol: str                  # lower case: tcp, udp, sctp
    cluster_ip: str                # of this family
    family: int = 4
    external_ips: tuple[str, ...] = ()
    lb_ips: tuple[str, ...] = ()
    lb_source_ranges: tuple[str, ...] = ()   # of this family
    lb_firewall: bool = False      # loadBalancerSourceRanges set (in any family): filter LB traffic
    node_port: int = 0
    affinity_timeout: int = 0      # 0: no ClientIP affinity
    external_local: bool = False   # externalTrafficPolicy Local (only when externally accessible)
    internal_local: bool = False   # internalTrafficPolicy Local
    health_check_node_port: int = 0
    topology_aware: bool = False

    @property
    def namespace(self) -> str:
        return self.service[0]

    @property
    def service_name(self) -> str:
        return self.service[1]

    @property
    def port_number(self) -> int:
        return self.port.port

    @property
    def port_name(self) -> str:
        return self.port.name

    @property
    def externally_accessible(self) -> bool:
        return bool(self.node_port or self.lb_ips or self.external_ips)

    @property
    def uses_cluster_endpoints(self) -> bool:
        # kube-proxy's: external traffic needs the Cluster endpoints even with
        # externalTrafficPolicy Local (pods' and the node's own traffic is short-circuited to them)
        return not self.internal_local or self.externally_accessible

    @property
    def uses_local_endpoints(self) -> bool:
        return self.internal_local or (self.externally_accessible and self.external_local)

    # iptables chain names
    @property
    def svc_chain(self) -> str:
        return names.svc_chain(self.name, self.protocol)

    @property
    def svl_chain(self) -> str:
        return names.svl_chain(self.name, self.protocol)

    @property
    def ext_chain(self) -> str:
        return names.ext_chain(self.name, self.protocol)

    @property
    def fw_chain(self) -> str:
        return names.fw_chain(self.name, self.protocol)

    def sep_chain(self, ep: EndpointInfo) -> str:
        return names.sep_chain(self.name, self.protocol, ep.endpoint)

    # nftables base names
    @property
    def nft_base(self) -> str:
        return names.nft_service_base(self.namespace, self.service_name, self.protocol, self.port_name)

    def nft_endpoint_base(self, ep: EndpointInfo) -> str:
        return names.nft_endpoint_base(self.namespace, self.service_name, self.protocol,
                                       self.port_name, ep.ip, ep.port)


class Categorized(NamedTuple):
    """kube-proxy's CategorizeEndpoints result for one service port."""
    all: tuple[EndpointInfo, ...] = ()        # every endpoint of the port, sorted
    cluster: tuple[EndpointInfo, ...] = ()    # used by Cluster policies
    local: tuple[EndpointInfo, ...] = ()      # used by Local policies
    reachable: tuple[EndpointInfo, ...] = ()  # union of both: the endpoint chains to create
    has_endpoints: bool = False
    uses_topology: bool = False

    @property
    def has_local(self) -> bool:
        return bool(self.local)


@dataclass(frozen=True)
class NodeInfo:
    """What the proxier knows about its own node, for one family."""
    name: str = ""
    zone: str = ""                        # "" when unknown: topology is not used
    ips: tuple[str, ...] = ()             # of this family, primary first
    local_cidr: str = ""                  # the local-traffic detector; "" = none
    local_iface: str = ""                 # or by input interface (iptables -i: "br0", "veth+")
    nodeport_all: bool = True             # NodePorts on every local address
    nodeport_ips: tuple[str, ...] = field(default=())  # else: these addresses

    @property
    def primary_ip(self) -> str:
        return self.ips[0] if self.ips else ""

    @property
    def detects_local(self) -> bool:
        return bool(self.local_cidr or self.local_iface)

    def if_local(self, negate: bool = False) -> str:
        """kube-proxy's LocalTrafficDetector IfLocal / IfNotLocal as iptables arguments."""
        bang = "! " if negate else ""
        return f"{bang}-s {self.local_cidr}" if self.local_cidr else f"{bang}-i {self.local_iface}"


def node_info(state: ClusterState, cfg: Config, family: int) -> NodeInfo:
    """The node's name, zone, addresses and NodePort addresses for one family.

    Addresses come from --node-ip; without it, from this node's Node object.
    --nodeport-addresses takes CIDRs (an address of the node inside one
    accepts NodePorts; a CIDR holding 127.0.0.1 adds loopback), "primary" (the
    first node address of the family) or "all".
    """
    node = state.nodes.get(cfg.proxy.node_name) if cfg.proxy.node_name else None
    ips = tuple(ip for ip in cfg.proxy.node_ips if _family_of(ip) == family)
    if not cfg.proxy.node_ips and node is not None:
        ips = tuple(ip for ip in node.addresses if _is_ip(ip) and _family_of(ip) == family)
    local_cidr, local_iface = "", ""
    mode = cfg.proxy.detect_local_mode
    if mode == "BridgeInterface":
        local_iface = cfg.proxy.pod_bridge_interface
    elif mode == "InterfaceNamePrefix":
        local_iface = cfg.proxy.pod_interface_name_prefix + "+"
    else:
        for cidr in cfg.proxy.cluster_cidrs:
            net = ipaddress.ip_network(cidr, strict=False)
            if net.version == family:
                local_cidr = str(net)
                break
    nodeport_all = True
    np_ips: list[str] = []
    if cfg.proxy.nodeport_addresses and "all" not in cfg.proxy.nodeport_addresses:
        nodeport_all = False
        nets = []
        for item in cfg.proxy.nodeport_addresses:
            if item == "primary":
                if ips and ips[0] not in np_ips:
                    np_ips.append(ips[0])
                continue
            net = ipaddress.ip_network(item, strict=False)
            if net.version == family:
                nets.append(net)
        candidates = list(ips) + (["127.0.0.1"] if family == 4 else ["::1"])
        for ip in candidates:
            addr = ipaddress.ip_address(ip)
            if any(addr in n for n in nets) and ip not in np_ips:
                np_ips.append(ip)
    return NodeInfo(name=cfg.proxy.node_name, zone=node.zone if node is not None else "",
                    ips=ips, local_cidr=local_cidr, local_iface=local_iface, nodeport_all=nodeport_all,
                    nodeport_ips=tuple(np_ips))


def localhost_nodeports(cfg: Config, node: NodeInfo, family: int) -> bool:
    """IPv4 NodePorts on 127.0.0.1 (iptables mode): on unless disabled or excluded."""
    if family != 4 or not cfg.proxy.localhost_nodeports:
        return False
    return node.nodeport_all or "127.0.0.1" in node.nodeport_ips


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return False


def _in_family(ips: tuple[str, ...], family: int) -> tuple[str, ...]:
    return tuple(ip for ip in ips if _family_of(ip) == family)


def _endpoints_for(slices: tuple[EndpointSlice, ...], port: ServicePort, address_type: str,
                   node_name: str, parts: list | None = None,
                   reuse: dict[int, list] | None = None) -> tuple[EndpointInfo, ...]:
    """The port's endpoints of every slice, sorted. parts: receives each slice's own endpoints;
    reuse: such parts of earlier slices by id(), taken for the slices that are those very
    objects (a change of one slice of a Service of 5,000 endpoints costs that slice)."""
    found: list[EndpointInfo] = []
    for sl in slices:
        part = reuse.get(id(sl)) if reuse else None
        if part is None:
            part = _slice_endpoints(sl, port, address_type, node_name)
        if parts is not None:
            parts.append(part)
        found += part
    if len(found) < 2:
        return tuple(found)
    found.sort(key=_ENDPOINT_KEY)
    if len(set(map(_ENDPOINT_KEY, found))) != len(found):
        return _dedup(found)
    return tuple(found)


def _slice_endpoints(sl: EndpointSlice, port: ServicePort, address_type: str, node_name: str) -> list[EndpointInfo]:
    if sl.address_type != address_type:
        return []
    number = None
    for ep_port in sl.ports:
        if ep_port.name == port.name and ep_port.protocol == port.protocol:
            number = ep_port.port
            break
    if not number:
        return []
    new = tuple.__new__   # EndpointInfo without the keyword-handling wrapper: this loop is hot
    v6 = address_type == IPV6
    mine = node_name or "\0"   # no endpoint is local without a node name ("\0" is no node's)
    suffix = f":{number}"   # format_endpoint, by concatenation
    found = [new(EndpointInfo, (
        ip, number, ("[" + ip + "]" if v6 else ip) + suffix, ep.ready, ep.serving, ep.terminating,
        ep.node_name == mine, ep.zone, ep.hint_zones,
        ep.node_name, ep.pod_namespace, ep.pod_name)) for ep in sl.endpoints for ip in ep.addresses[:1]]
    found.sort(key=_ENDPOINT_KEY)   # sorted runs: merging a big Service's slices is then cheap
    return found


_ENDPOINT_KEY = itemgetter(2)


def _dedup(found: list[EndpointInfo]) -> tuple[EndpointInfo, ...]:
    """The same address in two slices (a pod moving between them) counts once; a ready copy wins."""
    out: dict[str, EndpointInfo] = {}
    for info in found:
        old = out.get(info.endpoint)
        if old is None or (info.ready and not old.ready):
            out[info.endpoint] = info
    return tuple(out.values())


def _can_use_topology(svc: ServicePortInfo, eps: tuple[EndpointInfo, ...], zone: str) -> bool:
    if not svc.topology_aware or not zone:
        return False
    has_zone = False
    for ep in eps:
        if not ep.ready:
            continue
        if not ep.hint_zones:
            return False  # one ready endpoint without hints disables topology
        if zone in ep.hint_zones:
            has_zone = True
    return has_zone


def categorize(svc: ServicePortInfo, eps: tuple[EndpointInfo, ...], zone: str = "") -> Categorized:
    """kube-proxy's CategorizeEndpoints."""
    cluster: tuple[EndpointInfo, ...] = ()
    local: tuple[EndpointInfo, ...] = ()
    has_any = False
    use_topology = False
    serving_terminating_local = False
    if svc.uses_cluster_endpoints:
        use_topology = _can_use_topology(svc, eps, zone)
        if use_topology:
            cluster = tuple([e for e in eps if e.ready and e.hint_zones is not None and zone in e.hint_zones])
        else:
            cluster = tuple([e for e in eps if e.ready])
        if not cluster:
            cluster = tuple(e for e in eps if e.serving and e.terminating)
        has_any = bool(cluster)
    if not svc.uses_local_endpoints:
        return Categorized(eps, cluster, (), cluster, has_any, use_topology)
    local_ready = False
    local_st = False
    for e in eps:
        if e.ready:
            has_any = True
            local_ready = local_ready or e.local
        elif e.serving and e.terminating:
            has_any = True
            local_st = local_st or e.local
    if local_ready:
        local = tuple(e for e in eps if e.local and e.ready)
    elif local_st:
        serving_terminating_local = True
        local = tuple(e for e in eps if e.local and e.serving and e.terminating)
    if not svc.uses_cluster_endpoints:
        return Categorized(eps, (), local, local, has_any, use_topology)
    if not use_topology and not serving_terminating_local:
        return Categorized(eps, cluster, local, cluster, has_any, use_topology)
    merged = {e.endpoint: e for e in cluster}
    merged.update({e.endpoint: e for e in local})
    reachable = tuple(merged[k] for k in sorted(merged))
    return Categorized(eps, cluster, local, reachable, has_any, use_topology)


def service_port_infos(svc: Service, family: int) -> list[ServicePortInfo]:
    """The service ports kube-proxy would program for this Service and family."""
    if svc.headless or svc.is_external_name or svc.proxy_name:
        return []
    cluster_ips = _in_family(svc.cluster_ips, family)
    if not cluster_ips:
        return []
    external_ips = _in_family(svc.external_ips, family)
    lb_ips = _in_family(svc.lb_ips, family)
    ranges = tuple(r for r in svc.lb_source_ranges
                   if ipaddress.ip_network(r, strict=False).version == family)
    out = []
    for port in svc.ports:
        sp_name = f"{svc.namespace}/{svc.name}:{port.name}" if port.name else f"{svc.namespace}/{svc.name}"
        # every field set directly: the frozen dataclass __init__ (one object.__setattr__
        # per field) was a tenth of a cold render
        info = _new_info(ServicePortInfo)
        info.__dict__.update(
            service=svc.key, port=port, name=sp_name, protocol=port.protocol.lower(),
            cluster_ip=cluster_ips[0], family=family, external_ips=external_ips, lb_ips=lb_ips,
            lb_source_ranges=ranges, lb_firewall=bool(svc.lb_source_ranges), node_port=port.node_port,
            affinity_timeout=svc.affinity_timeout,
            external_local=svc.external_local and bool(port.node_port or lb_ips or external_ips),
            internal_local=svc.internal_local,
            health_check_node_port=svc.health_check_node_port,
            topology_aware=svc.topology_aware)
        out.append(info)
    return out


_new_info = object.__new__


class PortsCache:
    """service_ports' results across renders, owned by whoever renders repeatedly (a backend).

    For one (family, node name, zone) context: key -> (Service, slices, result).
    Records are immutable and a new state shares the unchanged ones with the
    last, so an entry is valid while the Service and every slice are the very
    same objects (checked with `is`). Renderers' own caches rely on the
    results being the same objects while that holds.
    """

    __slots__ = ("context", "entries")

    def __init__(self) -> None:
        self.context: tuple | None = None
        self.entries: dict[tuple[str, str], tuple] = {}

    def _for(self, family: int, node_name: str, zone: str) -> dict[tuple[str, str], tuple]:
        ctx = (family, node_name, zone)
        if ctx != self.context:
            self.context, self.entries = ctx, {}
        return self.entries


def _same(a: tuple, b: tuple) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x is not y:
            return False
    return True


def _compute_ports(svc: Service, slices: tuple[EndpointSlice, ...], family: int, node_name: str,
                   zone: str, old: tuple | None = None) -> tuple[tuple, tuple | None]:
    """((info, categorized) per port, each port's per-slice endpoints or None). old: an earlier
    result for the same Service object (slices, per-slice endpoints), whose parts for
    unchanged slices are reused. Per-slice parts are kept for Services of several slices only."""
    address_type = IPV6 if family == 6 else IPV4
    out = []
    keep = len(slices) > 1
    all_parts: list[list] = []
    for i, info in enumerate(service_port_infos(svc, family)):
        reuse = None
        if old is not None and old[1] is not None:
            reuse = {id(sl): part for sl, part in zip(old[0], old[1][i])}
        parts: list = []
        eps = _endpoints_for(slices, info.port, address_type, node_name, parts if keep else None, reuse)
        all_parts.append(parts)
        out.append((info, categorize(info, eps, zone)))
    return tuple(out), (tuple(all_parts) if keep else None)


def _cached_ports(cache: dict, state: ClusterState, key: tuple[str, str], family: int, node_name: str,
                  zone: str) -> tuple[tuple[ServicePortInfo, Categorized], ...]:
    svc = state.services.get(key)
    if svc is None:
        return ()
    slices = state.slices_for(*key)
    hit = cache.get(key)
    if hit is not None and hit[0] is svc and _same(hit[1], slices):
        return hit[2]
    # the same Service with other slices: the unchanged slices' endpoints are reused
    # (hit keeps the old slices alive, so their ids name them)
    old = (hit[1], hit[3]) if hit is not None and hit[0] is svc else None
    ports, parts = _compute_ports(svc, slices, family, node_name, zone, old)
    cache[key] = (svc, slices, ports, parts)
    return ports


def service_ports_for(state: ClusterState, key: tuple[str, str], family: int, node_name: str, zone: str,
                      cache: PortsCache | None = None) -> list[tuple[ServicePortInfo, Categorized]]:
    """The service ports of one Service with their categorised endpoints.

    With a cache, the (info, categorized) pairs are shared with later calls
    while the Service and its slices are unchanged: treat them as read-only.
    """
    entries = cache._for(family, node_name, zone) if cache is not None else {}
    if len(entries) > max(4096, 2 * len(state.services)):
        entries.clear()   # Services deleted since the last full render
    return list(_cached_ports(entries, state, key, family, node_name, zone))


def service_ports(state: ClusterState, cfg: Config, family: int = 4,
                  cache: PortsCache | None = None) -> list[tuple[ServicePortInfo, Categorized]]:
    """Every service port the proxier programs, sorted by (namespace, name, port name, protocol).

    cache: the results of earlier calls, kept by the caller (output never depends on it).
    """
    node = state.nodes.get(cfg.proxy.node_name) if cfg.proxy.node_name else None
    zone = node.zone if node is not None else ""
    out: list[tuple[ServicePortInfo, Categorized]] = []
    old = cache._for(family, cfg.proxy.node_name, zone) if cache is not None else {}
    # a new generation holding only this state's Services keeps the cache bounded
    entries: dict[tuple[str, str], tuple] = {}
    with gc_paused():
        for key in sorted(state.services):
            out += _cached_ports(old, state, key, family, cfg.proxy.node_name, zone)
            if key in old:
                entries[key] = old[key]
    if cache is not None:
        cache.entries = entries
    out.sort(key=_PORT_ORDER)
    return out


def _PORT_ORDER(pair: tuple[ServicePortInfo, Categorized]) -> tuple:
    info = pair[0]
    return (info.service, info.port.name, info.protocol)


__all__ = ["Categorized", "EndpointInfo", "NodeInfo", "PortsCache", "ServicePortInfo", "categorize",
           "format_endpoint", "localhost_nodeports", "node_info", "service_port_infos",
           "service_ports", "service_ports_for"]
