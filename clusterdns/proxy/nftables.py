"""nftables mode: the `nft -f` transaction kube-proxy's nftables proxier would run.

One private table (`ip kube-proxy` or `ip6 kube-proxy`), base chains at
numeric priorities (nft 1.0.6 rejects named ones on some hooks), verdict
maps from (address, protocol, port) to per-service chains, `numgen random`
endpoint choice. `render` is pure: with `previous` (the NftState the last
applied text left in the kernel) it returns only the changes, as one
transaction, so a sync never needs to list the kernel table.

Deliberate differences from kube-proxy (docs/proxy.md): a full render
recreates the whole table in its transaction (kube-proxy lists the kernel to
find stale chains instead), and chains that are no longer used are deleted in
the same transaction that removes every reference to them (kube-proxy waits
a grace period and deletes them in a later one).
"""
from __future__ import annotations

import ipaddress
import math
from dataclasses import dataclass, field
from typing import Mapping

from ..config import Config
from ..state import ClusterState
from . import names as n
from .servicemap import (
    Categorized,
    NodeInfo,
    ServicePortInfo,
    cache,
    gc_paused,
    node_info,
    service_ports,
    service_ports_for,
)

# (chain, type, hook, priority): kube-proxy's base chains
BASE_CHAINS = (
    ("filter-prerouting-pre-dnat", "filter", "prerouting", -110),
    ("filter-output-pre-dnat", "filter", "output", -110),
    ("filter-input", "filter", "input", 0),
    ("filter-forward", "filter", "forward", 0),
    ("filter-output", "filter", "output", 0),
    ("nat-prerouting", "nat", "prerouting", -100),
    ("nat-output", "nat", "output", -100),
    ("nat-postrouting", "nat", "postrouting", 100),
)
# (from chain, match, to chain)
JUMPS = (
    ("filter-input", "ct state new", "nodeport-endpoints-check"),
    ("filter-input", "ct state new", "service-endpoints-check"),
    ("filter-forward", "ct state new", "service-endpoints-check"),
    ("filter-output", "ct state new", "service-endpoints-check"),
    ("filter-prerouting-pre-dnat", "ct state new", "firewall-check"),
    ("filter-output-pre-dnat", "ct state new", "firewall-check"),
    ("nat-output", "", "services"),
    ("nat-prerouting", "", "services"),
    ("nat-postrouting", "", "masquerading"),
    ("filter-forward", "ct state new", "cluster-ips-check"),
    ("filter-output", "ct state new", "cluster-ips-check"),
)

SERVICES = "services"
MARK_MASQ = "mark-for-masquerade"
MASQUERADING = "masquerading"
REJECT_CHAIN = "reject-chain"
CLUSTER_IPS = "cluster-ips"
NODEPORT_IPS = "nodeport-ips"
SERVICE_IPS = "service-ips"
SERVICE_NODEPORTS = "service-nodeports"
FIREWALL_IPS = "firewall-ips"
NO_ENDPOINT_SERVICES = "no-endpoint-services"
NO_ENDPOINT_NODEPORTS = "no-endpoint-nodeports"


@dataclass(frozen=True)
class Objects:
    """Chains, sets and elements that one owner (the base layout, or one Service) puts in the table."""
    chains: Mapping[str, tuple[str, ...]] = field(default_factory=dict)   # chain -> rules, in order
    chain_decls: Mapping[str, str] = field(default_factory=dict)          # chain -> "{ ... }" or ""
    sets: Mapping[str, tuple[str, str]] = field(default_factory=dict)     # name -> ("set"|"map", "{ ... }")
    elements: tuple[tuple[str, str, str], ...] = ()                       # (set, key, element text)


@dataclass(frozen=True)
class NftState:
    """What the table holds after a text is applied: enough to compute the next transaction.

    The mappings are never mutated once built. `owned` records which objects
    each Service contributed, so a sync that knows which Services changed
    rebuilds only those; `context` is what every Service's objects depend on
    besides the Service itself (base layout, node zone): when it changes, a
    sync rebuilds everything.
    """
    family: int = 4
    chains: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    chain_decls: Mapping[str, str] = field(default_factory=dict)
    sets: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    elements: Mapping[str, Mapping[str, str]] = field(default_factory=dict)  # name -> key -> element text
    owned: Mapping[tuple[str, str], Objects] = field(default_factory=dict)
    context: tuple = ()

    def summary(self) -> dict[str, int]:
        return {"chains": len(self.chains), "rules": sum(len(r) for r in self.chains.values()),
                "sets": len(self.sets), "elements": sum(len(e) for e in self.elements.values())}


@dataclass(frozen=True)
class NftRuleSet:
    text: str
    state: NftState
    full: bool = True
    changes: int = 0      # statements in the text (a measure of the transaction's size)


def _fam(family: int) -> tuple[str, str, str]:
    """(table family, address match keyword, address type)."""
    return ("ip6", "ip6", "ipv6_addr") if family == 6 else ("ip", "ip", "ipv4_addr")


class _Builder:
    """Collects one owner's objects in write order."""

    def __init__(self) -> None:
        self.chains: dict[str, list[str]] = {}
        self.chain_decls: dict[str, str] = {}
        self.sets: dict[str, tuple[str, str]] = {}
        self.elements: list[tuple[str, str, str]] = []

    def chain(self, name: str, decl: str = "") -> list[str]:
        rules = self.chains.get(name)
        if rules is None:
            rules = self.chains[name] = []
            self.chain_decls[name] = decl
        return rules

    def set(self, name: str, kind: str, decl: str) -> None:
        self.sets[name] = (kind, decl)

    def element(self, name: str, key: str, value: str = "", comment: str = "") -> None:
        text = key
        if comment:
            text += f' comment "{comment}"'
        if value:
            text += f" : {value}"
        self.elements.append((name, key, text))

    def objects(self) -> Objects:
        return Objects({k: tuple(v) for k, v in self.chains.items()}, self.chain_decls, self.sets,
                       tuple(self.elements))


def _merge(family: int, base: Objects, owned: Mapping[tuple[str, str], Objects], context: tuple) -> NftState:
    chains: dict[str, tuple[str, ...]] = dict(base.chains)
    decls: dict[str, str] = dict(base.chain_decls)
    sets: dict[str, tuple[str, str]] = dict(base.sets)
    elements: dict[str, dict[str, str]] = {name: {} for name in sets}
    for name, key, text in base.elements:
        elements[name][key] = text
    for key in sorted(owned):
        objs = owned[key]
        chains.update(objs.chains)
        decls.update(objs.chain_decls)
        for name, spec in objs.sets.items():
            sets[name] = spec
            elements.setdefault(name, {})
        for name, ekey, text in objs.elements:
            elements.setdefault(name, {})[ekey] = text
    return NftState(family, chains, decls, sets, elements, owned, context)


class _Layered(Mapping):
    """A read-only mapping: a base dict with some keys removed, replaced or added.

    It iterates exactly as a dict copy of the base would after the same pops
    and assignments (a re-added key goes to the end, a replaced one keeps its
    place), but deriving one costs O(changes), not O(size): a one-Service
    sync at 10,000 Services would otherwise copy 120,000 chains. After many
    changes it is flattened back into a dict (amortised O(1) per change).
    """
    __slots__ = ("_base", "_gone", "_vals", "_tail")

    def __init__(self, base: Mapping, gone: set, vals: dict, tail: dict) -> None:
        self._base = base      # never mutated
        self._gone = gone      # base keys no longer at their place (removed, or re-added at the end)
        self._vals = vals      # values that differ from the base, and those of the tail
        self._tail = tail      # keys after the base's, in order (values unused)

    @classmethod
    def derive(cls, m: Mapping) -> "_Layered":
        """A writable layer over m (m itself is left as it is)."""
        if isinstance(m, _Layered):
            return cls(m._base, set(m._gone), dict(m._vals), dict(m._tail))  # O(changes so far)
        return cls(m if isinstance(m, dict) else dict(m), set(), {}, {})

    def __getitem__(self, key):
        vals = self._vals
        if key in vals:
            return vals[key]
        if key in self._gone:
            raise KeyError(key)
        return self._base[key]

    def __contains__(self, key) -> bool:
        return key in self._vals or (key not in self._gone and key in self._base)

    def __iter__(self):
        gone = self._gone
        if gone:
            for key in self._base:
                if key not in gone:
                    yield key
        else:
            yield from self._base
        yield from self._tail

    def __len__(self) -> int:
        return len(self._base) - len(self._gone) + len(self._tail)

    def get(self, key, default=None):
        vals = self._vals
        if key in vals:
            return vals[key]
        if key in self._gone:
            return default
        return self._base.get(key, default)

    def __repr__(self) -> str:
        return repr(dict(self))

    # building (only while _apply makes the next state)
    def pop(self, key, default=None):
        if key in self._tail:
            del self._tail[key]
            return self._vals.pop(key)
        if key in self._base and key not in self._gone:
            self._gone.add(key)
            return self._vals.pop(key, self._base[key])
        return default

    def __setitem__(self, key, value) -> None:
        if key not in self:
            self._tail[key] = None
        self._vals[key] = value

    def update(self, other: Mapping) -> None:
        for key, value in other.items():
            self[key] = value

    def settled(self) -> Mapping:
        """Flattened into a dict once the changes outgrow ~sqrt(size).

        Each derive copies the changes so far and a flatten copies everything:
        a limit near sqrt(size) keeps both small per sync (about 1,500 entries
        for 120,000 chains, against 120,000 for a plain copy).
        """
        if len(self._gone) + len(self._vals) > 64 + 4 * math.isqrt(len(self._base)):
            return {k: self[k] for k in self}
        return self


def _apply(previous: NftState, changes: Mapping[tuple[str, str], Objects | None]) -> NftState:
    """previous with the objects of the changed Services replaced (None: the Service is gone).

    O(changed Services): every mapping is a _Layered view over the previous one.
    """
    chains = _Layered.derive(previous.chains)
    decls = _Layered.derive(previous.chain_decls)
    sets = _Layered.derive(previous.sets)
    elements = _Layered.derive(previous.elements)
    owned = _Layered.derive(previous.owned)
    copied: set[str] = set()

    def writable(name: str) -> _Layered:
        if name not in copied:
            elements[name] = _Layered.derive(elements.get(name, {}))
            copied.add(name)
        return elements[name]  # type: ignore[return-value]

    for key, objs in changes.items():
        old = owned.pop(key, None)
        if old is not None:
            for name in old.chains:
                chains.pop(name, None)
                decls.pop(name, None)
            for name in old.sets:
                sets.pop(name, None)
                elements.pop(name, None)
                copied.discard(name)
            for name, ekey, _ in old.elements:
                if name in elements:
                    writable(name).pop(ekey, None)
    for key, objs in changes.items():
        if objs is None:
            continue
        owned[key] = objs
        chains.update(objs.chains)
        decls.update(objs.chain_decls)
        for name, spec in objs.sets.items():
            sets[name] = spec
            writable(name)
        for name, ekey, text in objs.elements:
            writable(name)[ekey] = text
    for name in copied:
        if name in elements:
            elements[name] = elements[name].settled()
    return NftState(previous.family, chains.settled(), decls.settled(), sets.settled(), elements.settled(),
                    owned.settled(), previous.context)


def _partial(family: int, objs: list[Objects]) -> NftState:
    """A state holding only these objects: the two sides of a diff restricted to changed Services."""
    return _merge(family, Objects(), {(str(i), ""): o for i, o in enumerate(objs)}, ())


def render(state: ClusterState, cfg: Config, family: int = 4, *,
           previous: NftState | None = None,
           changed: set[tuple[str, str]] | frozenset[tuple[str, str]] | None = None,
           resync: bool = False) -> NftRuleSet:
    """The nft -f transaction for `state`.

    previous None: a full transaction (recreates the table). previous given:
    only the changes from it. changed (with previous): the Service keys whose
    Service or EndpointSlices changed since `previous` was rendered
    (StateStore deltas); only those are rebuilt, so a small change costs
    little however large the cluster. Without it every Service is rebuilt and
    compared. resync (with previous): a full sync that keeps the table, as
    kube-proxy's periodic full syncs: every chain is flushed and refilled,
    every map re-filled, objects `previous` had and the state no longer needs
    deleted; session-affinity sets keep their entries.
    """
    with gc_paused():
        base, context, node, zone = _base(state, cfg, family)
        if previous is None or previous.family != family:
            new = _merge(family, base, _all_services(state, cfg, family, node, zone), context)
            return NftRuleSet(text=full_text(new), state=new, full=True, changes=sum(new.summary().values()))
        if resync:
            new = _merge(family, base, _all_services(state, cfg, family, node, zone), context)
            text = resync_text(previous, new)
            return NftRuleSet(text=text, state=new, full=True, changes=text.count("\n"))
        if changed is None or previous.context != context:
            new = _merge(family, base, _all_services(state, cfg, family, node, zone), context)
            text, count = diff_text(previous, new)
            return NftRuleSet(text=text, state=new, full=False, changes=count)
        updates = {key: _service_objects(state, key, cfg, family, node, zone) for key in changed}
        new = _apply(previous, updates)
        old_side = _partial(family, [o for k in changed if (o := previous.owned.get(k)) is not None])
        new_side = _partial(family, [o for o in updates.values() if o is not None])
        text, count = diff_text(old_side, new_side)
        return NftRuleSet(text=text, state=new, full=False, changes=count)


def build(state: ClusterState, cfg: Config, family: int = 4) -> NftState:
    """The complete table contents for `state`."""
    with gc_paused():
        base, context, node, zone = _base(state, cfg, family)
        return _merge(family, base, _all_services(state, cfg, family, node, zone), context)


def nodeport_addresses(cfg: Config, node: NodeInfo, family: int) -> tuple[bool, tuple[str, ...]]:
    """(all local addresses?, else these): kube-proxy's nftables default is the primary node IP."""
    if cfg.nodeport_addresses:
        if not node.nodeport_all:
            # loopback never accepts NodePorts in nftables mode
            return False, tuple(ip for ip in node.nodeport_ips if ip not in ("127.0.0.1", "::1"))
        return True, ()
    if node.primary_ip:
        return False, (node.primary_ip,)
    return True, ()


# Each Service's Objects across renders: context -> key -> ((info, cat) pairs, Objects).
# servicemap hands out the same pairs while a Service and its slices are
# unchanged, so a hit is an identity check; the rest is in the context.
_OBJECTS: dict[tuple, dict[tuple[str, str], tuple]] = cache({})
_OBJECT_CONTEXTS = 2


def _all_services(state: ClusterState, cfg: Config, family: int, node: NodeInfo,
                  zone: str) -> dict[tuple[str, str], Objects]:
    groups: dict[tuple[str, str], list] = {}
    for pair in service_ports(state, cfg, family):
        group = groups.get(pair[0].service)
        if group is None:
            groups[pair[0].service] = [pair]
        else:
            group.append(pair)
    _, ipx, addr_type = _fam(family)
    ctx = (family, node, cfg.masquerade_all)
    old = _OBJECTS.get(ctx, {})
    cache: dict[tuple[str, str], tuple] = {}
    owned: dict[tuple[str, str], Objects] = {}
    for key, pairs in groups.items():
        hit = old.get(key)
        if hit is not None and len(hit[0]) == len(pairs) and all(a is b for a, b in zip(hit[0], pairs)):
            objs = hit[1]
        else:
            b = _Builder()
            for info, cat in pairs:
                _service(b, info, cat, node, cfg, ipx, addr_type)
            objs = b.objects()
        owned[key] = objs
        cache[key] = (pairs, objs)
    # only this render's Services are kept: bounded by the state
    _OBJECTS.pop(ctx, None)
    while len(_OBJECTS) >= _OBJECT_CONTEXTS:
        _OBJECTS.pop(next(iter(_OBJECTS)))
    _OBJECTS[ctx] = cache
    return owned


def _service_objects(state: ClusterState, key: tuple[str, str], cfg: Config, family: int,
                     node: NodeInfo, zone: str) -> Objects | None:
    ports = service_ports_for(state, key, family, cfg.node_name, zone)
    if not ports:
        return None
    _, ipx, addr_type = _fam(family)
    b = _Builder()
    for info, cat in ports:
        _service(b, info, cat, node, cfg, ipx, addr_type)
    return b.objects()


def _base(state: ClusterState, cfg: Config, family: int) -> tuple[Objects, tuple, NodeInfo, str]:
    """The table's fixed layout, and the context every Service's objects depend on."""
    _, ipx, addr_type = _fam(family)
    node = node_info(state, cfg, family)
    mark = hex(1 << cfg.masquerade_bit)
    np_all, np_ips = nodeport_addresses(cfg, node, family)
    no_localhost = f"{ipx} daddr != 127.0.0.0/8" if family == 4 else f"{ipx} daddr != ::1"
    b = _Builder()

    for name, ctype, hook, prio in BASE_CHAINS:
        b.chain(name, f"{{ type {ctype} hook {hook} priority {prio} ; }}")
    for src, match, dst in JUMPS:
        b.chain(dst)
        b.chain(src).append(f"{match} jump {dst}" if match else f"jump {dst}")
    for name in (SERVICES, "cluster-ips-check", MASQUERADING, MARK_MASQ):
        b.chain(name)
    b.chain(MARK_MASQ).append(f"mark set mark or {mark}")
    b.chain(MASQUERADING).extend([f"mark and {mark} == 0 return", f"mark set mark xor {mark}",
                                  "masquerade fully-random"])

    b.set(CLUSTER_IPS, "set", f'{{ type {addr_type} ; comment "Active ClusterIPs" ; }}')
    check = b.chain("cluster-ips-check")
    check.append(f'{ipx} daddr @{CLUSTER_IPS} reject comment "Reject traffic to invalid ports of ClusterIPs"')
    cidrs = [c for c in cfg.service_cidrs if (":" in c) == (family == 6)]
    if cidrs:
        check.append(f'{ipx} daddr {{ {", ".join(cidrs)} }} drop comment "Drop traffic to unallocated ClusterIPs"')

    if not np_all:
        b.set(NODEPORT_IPS, "set", f'{{ type {addr_type} ; comment "IPs that accept NodePort traffic" ; }}')
        for ip in np_ips:
            b.element(NODEPORT_IPS, ip)
        np_match = f"{ipx} daddr @{NODEPORT_IPS}"
    else:
        np_match = f"fib daddr type local {no_localhost}"

    b.set(NO_ENDPOINT_SERVICES, "map", f"{{ type {addr_type} . inet_proto . inet_service : verdict ; "
                                       f'comment "vmap to drop or reject packets to services with no endpoints" ; }}')
    b.set(NO_ENDPOINT_NODEPORTS, "map", "{ type inet_proto . inet_service : verdict ; "
                                        'comment "vmap to drop or reject packets to service nodeports with no endpoints" ; }')
    b.chain(REJECT_CHAIN, '{ comment "helper for @no-endpoint-services / @no-endpoint-nodeports" ; }').append("reject")
    b.chain("service-endpoints-check").append(
        f"{ipx} daddr . meta l4proto . th dport vmap @{NO_ENDPOINT_SERVICES}")
    b.chain("nodeport-endpoints-check").append(
        f"{np_match} meta l4proto . th dport vmap @{NO_ENDPOINT_NODEPORTS}")

    b.set(FIREWALL_IPS, "map", f"{{ type {addr_type} . inet_proto . inet_service : verdict ; "
                               f'comment "destinations that are subject to LoadBalancerSourceRanges" ; }}')
    b.chain("firewall-check").append(f"{ipx} daddr . meta l4proto . th dport vmap @{FIREWALL_IPS}")

    b.set(SERVICE_IPS, "map", f"{{ type {addr_type} . inet_proto . inet_service : verdict ; "
                              f'comment "ClusterIP, ExternalIP and LoadBalancer IP traffic" ; }}')
    b.set(SERVICE_NODEPORTS, "map", '{ type inet_proto . inet_service : verdict ; comment "NodePort traffic" ; }')
    b.chain(SERVICES).append(f"{ipx} daddr . meta l4proto . th dport vmap @{SERVICE_IPS}")
    b.chain(SERVICES).append(f"{np_match} meta l4proto . th dport vmap @{SERVICE_NODEPORTS}")

    zone = ""
    if cfg.node_name and cfg.node_name in state.nodes:
        zone = state.nodes[cfg.node_name].zone
    base = b.objects()
    # everything a Service's objects depend on besides the Service itself
    context = (base, node, zone, cfg.masquerade_all)
    return base, context, node, zone


def _service(b: _Builder, info: ServicePortInfo, cat: Categorized, node: NodeInfo, cfg: Config,
             ipx: str, addr_type: str) -> None:
    proto = info.protocol
    name = info.name
    port = info.port_number
    cip = info.cluster_ip
    base = info.nft_base
    cluster_chain = n.nft_service_chain(base)
    local_chain = n.nft_local_chain(base)
    ext_chain = n.nft_external_chain(base)
    fw_chain = n.nft_firewall_chain(base)
    has_endpoints = cat.has_endpoints

    uses_cluster_chain = bool(cat.cluster) and info.uses_cluster_endpoints
    uses_local_chain = bool(cat.local) and info.uses_local_endpoints
    internal_chain, has_internal = cluster_chain, has_endpoints
    if info.internal_local:
        internal_chain, has_internal = local_chain, has_endpoints and bool(cat.local)
    external_policy_chain, has_external = cluster_chain, has_endpoints
    if info.external_local:
        external_policy_chain, has_external = local_chain, has_endpoints and bool(cat.local)
    uses_ext_chain = has_endpoints and info.externally_accessible
    uses_fw_chain = has_endpoints and bool(info.lb_ips) and info.lb_firewall

    int_verdict = ext_verdict = ""
    if not has_endpoints:
        int_verdict = ext_verdict = f"goto {REJECT_CHAIN}"
    else:
        if not has_internal:
            int_verdict = "drop"
        if not has_external:
            ext_verdict = "drop"

    b.element(CLUSTER_IPS, cip)
    key = f"{cip} . {proto} . {port}"
    if has_internal:
        b.element(SERVICE_IPS, key, f"goto {internal_chain}")
    else:
        b.element(NO_ENDPOINT_SERVICES, key, int_verdict, name)
    for eip in info.external_ips:
        ekey = f"{eip} . {proto} . {port}"
        if has_endpoints:
            b.element(SERVICE_IPS, ekey, f"goto {ext_chain}")
        if not has_external:
            b.element(NO_ENDPOINT_SERVICES, ekey, ext_verdict, name)
    for lbip in info.lb_ips:
        lkey = f"{lbip} . {proto} . {port}"
        if has_endpoints:
            b.element(SERVICE_IPS, lkey, f"goto {ext_chain}")
        if uses_fw_chain:
            b.element(FIREWALL_IPS, lkey, f"goto {fw_chain}", name)
        if not has_external:
            b.element(NO_ENDPOINT_SERVICES, lkey, ext_verdict, name)
    if info.node_port:
        nkey = f"{proto} . {info.node_port}"
        if has_endpoints:
            b.element(SERVICE_NODEPORTS, nkey, f"goto {ext_chain}")
        if not has_external:
            b.element(NO_ENDPOINT_NODEPORTS, nkey, ext_verdict, name)

    if has_internal:
        rules = b.chain(internal_chain)
        if cfg.masquerade_all:
            rules.append(f"{ipx} daddr {cip} {proto} dport {port} jump {MARK_MASQ}")
        elif node.local_cidr:
            rules.append(f"{ipx} daddr {cip} {proto} dport {port} {ipx} saddr != {node.local_cidr} jump {MARK_MASQ}")

    if uses_ext_chain:
        rules = b.chain(ext_chain)
        if not info.external_local:
            rules += [f"jump {MARK_MASQ}"]
        else:
            if node.local_cidr:
                rules.append(f'{ipx} saddr {node.local_cidr} goto {cluster_chain} comment "short-circuit pod traffic"')
            rules.append(f'fib saddr type local jump {MARK_MASQ} comment "masquerade local traffic"')
            rules.append(f'fib saddr type local goto {cluster_chain} comment "short-circuit local traffic"')
        if has_external:
            rules.append(f"goto {external_policy_chain}")

    if uses_fw_chain:
        sources = list(info.lb_source_ranges)
        if node.primary_ip and any(_contains(c, node.primary_ip) for c in info.lb_source_ranges):
            sources += list(info.lb_ips)
        # ranges only in the other family allow nothing of this one
        b.chain(fw_chain).append(f"{ipx} saddr != {{ {', '.join(sources)} }} drop" if sources else "drop")

    # nft_endpoint_base and hash_and_truncate inlined: this loop runs for every endpoint
    prefix = f"{info.namespace}/{info.service_name}/{proto}/{info.port_name}__"
    b32 = n._b32_16
    ep_chains = {}
    for ep in cat.reachable:
        text = f"{prefix}{ep.ip.replace(':', '.')}/{ep.port}"
        ep_chains[ep.endpoint] = b32(text)[:8] + "-" + (text if len(text) <= 240 else text[:237] + "...")
    if uses_cluster_chain:
        _dispatch(b.chain(cluster_chain), cat.cluster, ep_chains, info, ipx)
    if uses_local_chain:
        _dispatch(b.chain(local_chain), cat.local, ep_chains, info, ipx)
    chains, decls = b.chains, b.chain_decls
    masq = f"{ipx} saddr "
    masq_tail = f" jump {MARK_MASQ}"
    dnat = f"meta l4proto {proto} dnat to "
    for ep in cat.reachable:
        ep_base = ep_chains[ep.endpoint]
        chain = "endpoint-" + ep_base
        if info.affinity_timeout:
            rules = b.chain(chain)
            rules.append(masq + ep.ip + masq_tail)
            aff = n.nft_affinity_set(ep_base)
            b.set(aff, "set", f"{{ type {addr_type} ; flags dynamic,timeout ; timeout {info.affinity_timeout}s ; }}")
            rules.append(f"update @{aff} {{ {ipx} saddr }}")
            rules.append(dnat + ep.endpoint)
        elif chain in chains:
            chains[chain] += [masq + ep.ip + masq_tail, dnat + ep.endpoint]
        else:
            chains[chain] = [masq + ep.ip + masq_tail, dnat + ep.endpoint]
            decls[chain] = ""


def _dispatch(rules: list[str], endpoints, ep_chains: dict[str, str], info: ServicePortInfo, ipx: str) -> None:
    if info.affinity_timeout:
        for ep in endpoints:
            base = ep_chains[ep.endpoint]
            rules.append(f"{ipx} saddr @{n.nft_affinity_set(base)} goto {n.nft_endpoint_chain(base)}")
    vmap = " , ".join([f"{i} : goto endpoint-{ep_chains[ep.endpoint]}" for i, ep in enumerate(endpoints)])
    rules.append(f"numgen random mod {len(endpoints)} vmap {{ {vmap} }}")


def _contains(cidr: str, ip: str) -> bool:
    try:
        return ipaddress.ip_address(ip) in ipaddress.ip_network(cidr, strict=False)
    except ValueError:
        return False


def full_text(new: NftState) -> str:
    """A transaction that replaces the whole table with `new` (atomic: one nft -f)."""
    fam, _, _ = _fam(new.family)
    t = f"{fam} {n.NFT_TABLE}"
    out = [f'add table {t} {{ comment "rules for kube-proxy" ; }}',
           f"delete table {t}",
           f'add table {t} {{ comment "rules for kube-proxy" ; }}']
    chain = f"add chain {t} "
    out += [(chain + name + " " + decl).rstrip() if decl else chain + name
            for name, decl in new.chain_decls.items()]
    for name, (kind, decl) in new.sets.items():
        out.append(f"add {kind} {t} {name} {decl}")
    _rules_and_elements(out, t, new)
    return "\n".join(out) + "\n"


def _rules_and_elements(out: list[str], t: str, new: NftState) -> None:
    """Every rule, then every element, of `new` (hot: hundreds of thousands of lines)."""
    rule = f"add rule {t} "
    for name, rules in new.chains.items():
        if rules:
            p = rule + name + " "
            out.append(p + ("\n" + p).join(rules))
    element = f"add element {t} "
    for name, elems in new.elements.items():
        if elems:
            p = element + name + " { "
            out.append(p + (" }\n" + p).join(elems.values()) + " }")


def resync_text(old: NftState, new: NftState) -> str:
    """Rewrite everything in place: repairs any drift in our objects, keeps affinity entries.

    Affinity sets are the only objects the kernel fills by itself (`update @set`);
    they are re-declared (idempotent) but not flushed, unless their declaration changed.
    """
    fam, _, _ = _fam(new.family)
    t = f"{fam} {n.NFT_TABLE}"
    out = [f'add table {t} {{ comment "rules for kube-proxy" ; }}']
    redeclared = [c for c in new.chains if c in old.chain_decls and old.chain_decls[c] != new.chain_decls[c]]
    for name, decl in new.chain_decls.items():
        if name not in redeclared:
            out.append(f"add chain {t} {name} {decl}".rstrip())
    for name in old.chains:
        out.append(f"flush chain {t} {name}")
    for name in new.chains:
        if name not in old.chains:
            out.append(f"flush chain {t} {name}")   # it may exist without our knowing (drift)
    dynamic = {s for s, (kind, decl) in new.sets.items() if "dynamic" in decl}
    recreated = [s for s in new.sets if s in old.sets and old.sets[s] != new.sets[s]]
    for name, (kind, decl) in new.sets.items():
        if name not in recreated:
            out.append(f"add {kind} {t} {name} {decl}")
            if name not in dynamic:
                out.append(f"flush {kind} {t} {name}")
    for name in old.chains:
        if name not in new.chains:
            out.append(f"delete chain {t} {name}")
    for name in redeclared:
        out.append(f"delete chain {t} {name}")
        out.append(f"add chain {t} {name} {new.chain_decls[name]}".rstrip())
    for name in old.sets:
        if name not in new.sets or name in recreated:
            out.append(f"delete {old.sets[name][0]} {t} {name}")
    for name in recreated:
        kind, decl = new.sets[name]
        out.append(f"add {kind} {t} {name} {decl}")
    _rules_and_elements(out, t, new)
    return "\n".join(out) + "\n"


def diff_text(old: NftState, new: NftState) -> tuple[str, int]:
    """The transaction turning `old` into `new`: only changed elements and chains."""
    fam, _, _ = _fam(new.family)
    t = f"{fam} {n.NFT_TABLE}"
    out: list[str] = []
    # sets whose declaration changed are recreated; chains using them are refilled
    recreated = {s for s in new.sets if s in old.sets and old.sets[s] != new.sets[s]}
    removed_sets = [s for s in old.sets if s not in new.sets]
    added_sets = [s for s in new.sets if s not in old.sets]
    removed_chains = [c for c in old.chains if c not in new.chains]
    added_chains = [c for c in new.chains if c not in old.chains]
    redeclared = [c for c in new.chains if c in old.chains and old.chain_decls.get(c) != new.chain_decls.get(c)]
    changed = [c for c in new.chains if c in old.chains and (
        old.chains[c] != new.chains[c] or c in redeclared
        or (recreated and any(f"@{s} " in r or r.endswith(f"@{s}") for r in new.chains[c] for s in recreated)))]

    for c in added_chains:
        out.append(f"add chain {t} {c} {new.chain_decls.get(c, '')}".rstrip())
    for s in added_sets:
        kind, decl = new.sets[s]
        out.append(f"add {kind} {t} {s} {decl}")
    # elements that go away or change value
    for s, elems in old.elements.items():
        if s in removed_sets or s in recreated:
            continue
        now = new.elements.get(s, {})
        for key, text in elems.items():
            if now.get(key) != text:
                out.append(f"delete element {t} {s} {{ {key} }}")
    for c in changed + removed_chains:
        out.append(f"flush chain {t} {c}")
    for c in removed_chains:
        out.append(f"delete chain {t} {c}")
    for c in redeclared:
        # a base chain's hook or priority changed: recreate it (flushed above)
        out.append(f"delete chain {t} {c}")
        out.append(f"add chain {t} {c} {new.chain_decls[c]}".rstrip())
    for s in removed_sets + sorted(recreated):
        out.append(f"delete {old.sets[s][0]} {t} {s}")
    for s in sorted(recreated):
        kind, decl = new.sets[s]
        out.append(f"add {kind} {t} {s} {decl}")
    for c in added_chains + changed:
        for rule in new.chains[c]:
            out.append(f"add rule {t} {c} {rule}")
    for s, elems in new.elements.items():
        before = {} if (s in recreated or s in added_sets) else old.elements.get(s, {})
        for key, text in elems.items():
            if before.get(key) != text:
                out.append(f"add element {t} {s} {{ {text} }}")
    return ("\n".join(out) + "\n" if out else ""), len(out)


def cleanup_text(family: int = 4) -> str:
    """An nft -f script removing clusterdns's table (and nothing else); safe when it is absent."""
    fam, _, _ = _fam(family)
    return f"add table {fam} {n.NFT_TABLE}\ndelete table {fam} {n.NFT_TABLE}\n"


__all__ = ["NftRuleSet", "NftState", "build", "cleanup_text", "diff_text", "full_text", "render"]
