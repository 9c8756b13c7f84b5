"""iptables mode: the iptables-restore input kube-proxy's iptables proxier would write.

`render` is pure. Its text is complete on its own: loaded with
`iptables-restore --noflush` (ip6tables-restore for family 6) into empty
tables it gives the whole behaviour, including the jumps from the built-in
chains, which full syncs insert with `-I` as kube-proxy does. Loading a full
text twice inserts those jumps twice: an applier that already installed them
checks with `iptables -C` (see `jump_rules`) and renders with `jumps=False`.

Deliberate differences from kube-proxy are listed in docs/proxy.md (no nfacct
counters; addresses in --service-cidr that no Service holds are not dropped in
this mode, as in kube-proxy's iptables mode).
"""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from ..config import Config
from ..lifetime import gc_paused
from ..state import ClusterState
from . import iptsave
from . import names as n
from .apply import WHOLE_TABLE_FROM
from .servicemap import (
    Categorized,
    EndpointInfo,
    NodeInfo,
    PortsCache,
    ServicePortInfo,
    localhost_nodeports,
    node_info,
    service_ports,
)

# kube-proxy drops per-endpoint comments beyond this many endpoint chains
LARGE_CLUSTER_ENDPOINTS = 1000

FILTER_CHAINS = (n.KUBE_SERVICES, n.KUBE_EXTERNAL_SERVICES, n.KUBE_FORWARD, n.KUBE_NODEPORTS,
                 n.KUBE_PROXY_FIREWALL)
NAT_CHAINS = (n.KUBE_SERVICES, n.KUBE_NODEPORTS, n.KUBE_POSTROUTING, n.KUBE_MARK_MASQ)

_NEW = "-m conntrack --ctstate NEW"
# (table, built-in chain, extra match, comment, target), in kube-proxy's order;
# each is inserted at the top, so the last one ends up first.
_JUMPS = (
    ("filter", "INPUT", _NEW, "kubernetes externally-visible service portals", n.KUBE_EXTERNAL_SERVICES),
    ("filter", "FORWARD", _NEW, "kubernetes externally-visible service portals", n.KUBE_EXTERNAL_SERVICES),
    ("filter", "INPUT", "", "kubernetes health check service ports", n.KUBE_NODEPORTS),
    ("filter", "FORWARD", _NEW, "kubernetes service portals", n.KUBE_SERVICES),
    ("filter", "OUTPUT", _NEW, "kubernetes service portals", n.KUBE_SERVICES),
    ("filter", "FORWARD", "", "kubernetes forwarding rules", n.KUBE_FORWARD),
    ("filter", "INPUT", _NEW, "kubernetes load balancer firewall", n.KUBE_PROXY_FIREWALL),
    ("filter", "OUTPUT", _NEW, "kubernetes load balancer firewall", n.KUBE_PROXY_FIREWALL),
    ("filter", "FORWARD", _NEW, "kubernetes load balancer firewall", n.KUBE_PROXY_FIREWALL),
    ("nat", "OUTPUT", "", "kubernetes service portals", n.KUBE_SERVICES),
    ("nat", "PREROUTING", "", "kubernetes service portals", n.KUBE_SERVICES),
    ("nat", "POSTROUTING", "", "kubernetes postrouting rules", n.KUBE_POSTROUTING),
)
_KUBELET_JUMPS = (
    ("filter", "INPUT", "", "", n.KUBE_FIREWALL),
    ("filter", "OUTPUT", "", "", n.KUBE_FIREWALL),
)


@dataclass(frozen=True)
class RuleSet:
    text: str
    chains: dict[str, frozenset[str]]   # table -> every KUBE-* chain declared or kept
    counts: dict[str, int]              # table -> rules written in this text
    deleted: dict[str, frozenset[str]] = field(default_factory=dict)  # table -> chains removed (-X)
    large_cluster: bool = False
    listed: bool = False                # the nat table lists itself first (render's `listing`)
    # Service key -> (its filter rules, its nat KUBE-SERVICES/KUBE-NODEPORTS rules, its nat
    # chains, their rules' text) as this text leaves them: a later partial render writes
    # only the difference.
    tops: dict[tuple[str, str], tuple[list[str], list[str], list[str], list[str]]] = field(default_factory=dict)


def _q(comment: str) -> str:
    """Quote a comment the way kube-proxy writes it: only when it has a space."""
    return f'"{comment}"' if " " in comment else comment


def mark_hex(cfg: Config) -> str:
    return hex(1 << cfg.proxy.masquerade_bit)


def jump_rules(cfg: Config, family: int = 4) -> list[tuple[str, str, str]]:
    """(table, built-in chain, rule spec) of every jump a full sync inserts.

    The rule spec is what `iptables -t TABLE -C CHAIN <spec>` takes.
    """
    jumps = list(_JUMPS)
    # only the configuration decides whether localhost NodePorts (and KUBE-FIREWALL) exist
    if localhost_nodeports(cfg, node_info(ClusterState(), cfg, family), family):
        jumps += list(_KUBELET_JUMPS)
    out = []
    for table, chain, extra, comment, target in jumps:
        parts = [extra] if extra else []
        if comment:
            parts.append(f"-m comment --comment {_q(comment)}")
        parts.append(f"-j {target}")
        out.append((table, chain, " ".join(parts)))
    return out


class _Tables:
    """Chain declarations and rules of one restore, per table, in write order."""

    def __init__(self) -> None:
        self.chains: dict[str, list[str]] = {"filter": [], "nat": []}
        self.rules: dict[str, list[str]] = {"filter": [], "nat": []}


def render(state: ClusterState, cfg: Config, family: int = 4, *,
           only: set[tuple[str, str]] | None = None,
           existing: dict[str, set[str]] | None = None,
           jumps: bool = True,
           previous: RuleSet | None = None,
           listing: bool = False,
           cache: RenderCache | None = None) -> RuleSet:
    """The iptables-restore text for `state`.

    only: None for a full sync; else the Service keys whose per-service chains
    are rewritten (a partial sync). Without `previous` a partial text still
    rewrites the filter table and the top-level nat chains whole, as kube-proxy
    does; with `previous` (the RuleSet last applied, whose rules are in the
    kernel) it writes only what changed: the changed Services' lines in the
    top-level chains are deleted (-D) and added (-A; -I 1 in nat KUBE-SERVICES,
    whose last rule must stay last), their chains rewritten, the chains they no
    longer use deleted, and nothing else. existing: chains now in the kernel
    (table -> names); per-service chains among them that are no longer used
    are flushed and deleted in the same text. jumps: whether a full sync
    inserts the jumps from the built-in chains. listing: a full text for iptables-nft
    (see apply.whole_table_cache) whose nat table, when it declares many chains, lists
    the table (`-S`) before the chains are declared, after its jumps and their targets:
    the same rules, loaded in linear time. cache: per-Service work kept across
    renders by the caller (output never depends on it).
    """
    with gc_paused():
        return _render(state, cfg, family, only, existing, jumps, previous, listing, cache)


class RenderCache:
    """Per-service-port blocks across renders, owned by whoever renders repeatedly (the backend).

    entries: port name -> ((info, cat), block) for one context. servicemap
    hands out the same (info, cat) pair while a Service and its slices are
    unchanged (through `ports`), so a hit is an identity check; everything
    else a block depends on is in the context.
    """

    __slots__ = ("context", "entries", "ports")

    def __init__(self) -> None:
        self.context: tuple | None = None
        self.entries: dict[str, tuple] = {}
        self.ports = PortsCache()


def _render(state: ClusterState, cfg: Config, family: int, only: set[tuple[str, str]] | None,
            existing: dict[str, set[str]] | None, jumps: bool,
            previous: RuleSet | None, listing: bool, cache: RenderCache | None) -> RuleSet:
    node = node_info(state, cfg, family)
    ports = service_ports(state, cfg, family, cache.ports if cache is not None else None)
    mark = mark_hex(cfg)
    full = only is None
    local_np = localhost_nodeports(cfg, node, family)
    large = sum(len(cat.all) for _, cat in ports) > LARGE_CLUSTER_ENDPOINTS

    filter_chains = list(FILTER_CHAINS)
    filter_rules: list[str] = []
    nat_chains = list(NAT_CHAINS)
    nat_rules: list[str] = []
    nat_active: set[str] = set()

    nat_rules += [
        f"-A {n.KUBE_POSTROUTING} -m mark ! --mark {mark}/{mark} -j RETURN",
        f"-A {n.KUBE_POSTROUTING} -j MARK --xor-mark {mark}",
        f'-A {n.KUBE_POSTROUTING} -m comment --comment "kubernetes service traffic requiring SNAT" '
        f"-j MASQUERADE --random-fully",
        f"-A {n.KUBE_MARK_MASQ} -j MARK --or-mark {mark}",
    ]
    if local_np:
        filter_chains.append(n.KUBE_FIREWALL)
        filter_rules.append(
            f'-A {n.KUBE_FIREWALL} -m comment --comment "block incoming localnet connections" '
            f"-d 127.0.0.0/8 ! -s 127.0.0.0/8 -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP")

    # per-service chain declarations and rules, as one text block per service port
    svc_decls: list[str] = []
    svc_blocks: list[str] = []
    svc_rule_count = 0
    svc_chain_names: list[str] = []
    tops: dict[tuple[str, str], tuple[list[str], list[str], list[str], list[str]]] = {}
    delta = not full and previous is not None
    blocks: dict[tuple[str, str], list[tuple[str, str, int]]] = {}   # delta: changed Services' chains
    ctx = (family, node.local_cidr, node.local_iface, node.primary_ip, cfg.proxy.masquerade_all, large)
    old = cache.entries if cache is not None and cache.context == ctx else {}
    entries: dict[str, tuple] = {}
    # a partial text over `previous`: the Services it does not touch keep what previous says
    # they hold (the same blocks; a walk of 10,000 of them was most of a partial sync's render)
    kept_tops = previous.tops if delta and previous is not None and previous.tops else None
    if kept_tops is not None:
        assert only is not None
        for key, held in kept_tops.items():
            if key not in only:
                tops[key] = held
                nat_active.update(held[2])
    for pair in ports:
        info, cat = pair
        hit = old.get(info.name)
        if kept_tops is not None and info.service in tops and info.service not in only:
            if hit is not None and hit[0] is pair:
                entries[info.name] = hit
            continue
        if hit is not None and hit[0] is pair:
            block = hit[1]
        else:
            block = _service(info, cat, node, cfg, large)
        entries[info.name] = (pair, block)
        f_rules, top, chains, decls, rules, count = block
        t = tops.get(info.service)
        if t is None:
            tops[info.service] = t = ([], [], [], [])
        t[0].extend(f_rules)
        t[1].extend(top)
        t[2].extend(chains)
        t[3].append(rules)
        if f_rules:
            filter_rules += f_rules
        nat_rules += top
        # the chains that internal traffic uses must exist even when not rewritten
        svc_chain_names += chains
        if full or info.service in only:
            if delta:
                blocks.setdefault(info.service, []).append((decls if chains else "", rules if count else "", count))
                continue
            if chains:
                svc_decls.append(decls)
            if count:
                svc_blocks.append(rules)
                svc_rule_count += count
    nat_active.update(svc_chain_names)
    if cache is not None:
        # only this render's ports are kept: bounded by the state
        cache.context, cache.entries = ctx, entries

    # the last rule of KUBE-SERVICES: hand NodePorts over
    np_comment = '"kubernetes service nodeports; NOTE: this must be the last rule in this chain"'
    if node.nodeport_all:
        dest = "-m addrtype --dst-type LOCAL"
        if family == 6:
            dest += " ! -d ::1/128"
        elif not local_np:
            dest += " ! -d 127.0.0.0/8"
        nat_rules.append(f"-A {n.KUBE_SERVICES} -m comment --comment {np_comment} {dest} -j {n.KUBE_NODEPORTS}")
    else:
        for ip in node.nodeport_ips:
            if ip in ("127.0.0.1", "::1") and not local_np:
                continue
            nat_rules.append(f"-A {n.KUBE_SERVICES} -m comment --comment {np_comment} -d {ip} -j {n.KUBE_NODEPORTS}")

    filter_rules += [
        f"-A {n.KUBE_FORWARD} -m conntrack --ctstate INVALID -j DROP",
        f'-A {n.KUBE_FORWARD} -m comment --comment "kubernetes forwarding rules" -m mark --mark {mark}/{mark} -j ACCEPT',
        f'-A {n.KUBE_FORWARD} -m comment --comment "kubernetes forwarding conntrack rule" '
        f"-m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT",
    ]

    # stale per-service chains: declaring flushes them, then -X deletes them
    deleted: set[str] = set()
    for chain in sorted((existing or {}).get("nat", ())):
        if n.is_service_chain(chain) and chain not in nat_active:
            deleted.add(chain)

    if delta:
        assert previous is not None and only is not None
        return _delta(previous, tops, only, blocks, deleted, nat_active, filter_chains, large)

    deleted_sorted = sorted(deleted)

    jump_lines: dict[str, list[str]] = {"filter": [], "nat": []}
    if full and jumps:
        for table, chain, spec in jump_rules(cfg, family):
            jump_lines[table].append(f"-I {chain} {spec}")

    nat_jumps = list(jump_lines["nat"])
    listed = False
    out: list[str] = []
    if full:
        out += ["*mangle", f":{n.KUBE_PROXY_CANARY} - [0:0]", "COMMIT"]
    out.append("*filter")
    if full:
        out.append(f":{n.KUBE_PROXY_CANARY} - [0:0]")
    out += [f":{c} - [0:0]" for c in filter_chains]
    out += jump_lines["filter"]
    out += filter_rules
    out.append("COMMIT")
    out.append("*nat")
    nat_decls = [f":{c} - [0:0]" for c in nat_chains]
    if full and listing and len(svc_chain_names) + len(deleted_sorted) >= WHOLE_TABLE_FROM:
        # the jumps' targets, the jumps, then the listing (see apply.whole_table_cache)
        targets = {line.rsplit(" ", 1)[1] for line in jump_lines["nat"]}
        out += [d for d, c in zip(nat_decls, nat_chains) if c in targets]
        out += jump_lines["nat"]
        out.append("-S")
        jump_lines["nat"] = []
        nat_decls = [d for d, c in zip(nat_decls, nat_chains) if c not in targets]
        listed = True
    if full:
        out.append(f":{n.KUBE_PROXY_CANARY} - [0:0]")
    out += nat_decls
    out += svc_decls
    out += [f":{c} - [0:0]" for c in deleted_sorted]
    out += jump_lines["nat"]
    out += nat_rules
    out += svc_blocks
    out += [f"-X {c}" for c in deleted_sorted]
    out.append("COMMIT")
    text = "\n".join(out) + "\n"

    filter_keep = set(filter_chains) | {n.KUBE_PROXY_CANARY}
    nat_keep = set(NAT_CHAINS) | nat_active | {n.KUBE_PROXY_CANARY}
    chains = {"filter": frozenset(filter_keep), "nat": frozenset(nat_keep)}
    if full:
        chains["mangle"] = frozenset({n.KUBE_PROXY_CANARY})
    counts = {
        "filter": len(filter_rules) + len(jump_lines["filter"]),
        "nat": len(nat_rules) + svc_rule_count + len(nat_jumps),
    }
    return RuleSet(text=text, chains=chains, counts=counts,
                   deleted={"nat": frozenset(deleted)} if deleted else {}, large_cluster=large, tops=tops,
                   listed=listed)


def _delta(previous: RuleSet, tops: dict, only: set[tuple[str, str]],
           blocks: dict[tuple[str, str], list[tuple[str, str, int]]], deleted: set[str], nat_active: set[str],
           filter_chains: list[str], large: bool) -> RuleSet:
    """A partial text writing only what changed since `previous` (see render)."""
    none: tuple[list[str], list[str], list[str], list[str]] = ([], [], [], [])
    svc_decls: list[str] = []
    svc_blocks: list[str] = []
    svc_rule_count = 0
    f_del: list[str] = []
    f_add: list[str] = []
    n_del: list[str] = []
    n_add: list[str] = []
    for key in sorted(only):
        old = previous.tops.get(key, none)
        new = tops.get(key, none)
        for was, now, dels, adds in ((old[0], new[0], f_del, f_add), (old[1], new[1], n_del, n_add)):
            if was == now:
                continue
            keep = set(now)
            dels += ["-D " + line[3:] for line in was if line not in keep]
            gone = set(was)
            adds += [line for line in now if line not in gone]
        # chains the changed Services used and no longer do
        deleted.update(c for c in old[2] if c not in nat_active)
        # its chains, unless they hold exactly what they held
        if old[2] != new[2] or old[3] != new[3]:
            same = _unchanged_endpoint_chains(old[3], new[3]) if old[3] and new[3] else frozenset()
            for decls, rules, count in blocks.get(key, ()):
                if same:
                    # one endpoint of 5,000 changed: its KUBE-SVC chain, not 4,999 KUBE-SEP chains
                    decls = "\n".join(d for d in decls.split("\n") if d[1:d.find(" ")] not in same)
                    kept = [line for line in rules.split("\n") if line[3:line.find(" ", 3)] not in same]
                    count = len(kept) if rules else 0
                    rules = "\n".join(kept)
                if decls:
                    svc_decls.append(decls)
                if rules:
                    svc_blocks.append(rules)
                    svc_rule_count += count
    n_add = [("-I KUBE-SERVICES 1 " + line[len("-A KUBE-SERVICES "):]) if line.startswith("-A KUBE-SERVICES ")
             else line for line in n_add]
    deleted_sorted = sorted(deleted)
    out: list[str] = []
    if f_del or f_add:
        out += ["*filter", *f_del, *f_add, "COMMIT"]
    if n_del or n_add or svc_decls or deleted_sorted:
        out.append("*nat")
        out += svc_decls
        out += [f":{c} - [0:0]" for c in deleted_sorted]
        out += n_del
        out += n_add
        out += svc_blocks
        out += [f"-X {c}" for c in deleted_sorted]
        out.append("COMMIT")
    text = "\n".join(out) + "\n" if out else ""
    chains = {"filter": frozenset(set(filter_chains) | {n.KUBE_PROXY_CANARY}),
              "nat": frozenset(set(NAT_CHAINS) | nat_active | {n.KUBE_PROXY_CANARY})}
    counts = {"filter": len(f_add), "nat": len(n_add) + svc_rule_count}
    return RuleSet(text=text, chains=chains, counts=counts,
                   deleted={"nat": frozenset(deleted)} if deleted else {}, large_cluster=large, tops=tops)


def _unchanged_endpoint_chains(old: list[str], new: list[str]) -> frozenset[str]:
    """The KUBE-SEP chains whose rules are the same in both renders of a Service (its blocks'
    rule text): a partial sync leaves them as the kernel holds them."""
    def by_chain(blocks: list[str]) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for block in blocks:
            for line in block.split("\n"):
                if line.startswith("-A KUBE-SEP-"):
                    out.setdefault(line[3:line.find(" ", 3)], []).append(line)
        return out
    was, now = by_chain(old), by_chain(new)
    return frozenset(c for c, lines in now.items() if was.get(c) == lines)


def _service(info: ServicePortInfo, cat: Categorized, node: NodeInfo, cfg: Config,
             large: bool) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...], str, str, int]:
    """Rules of one service port (kube-proxy's syncProxyRules loop body).

    Returns (filter rules, nat KUBE-SERVICES/KUBE-NODEPORTS rules, per-service
    nat chains, their declaration lines, their rules, the number of those
    rules); both texts are newline-joined lines without a trailing newline.
    """
    filter_rules: list[str] = []
    nat_top: list[str] = []
    proto = info.protocol
    name = info.name
    port = info.port_number
    has_endpoints = cat.has_endpoints

    h = n.port_proto_hash(name, proto)
    cluster_chain = "KUBE-SVC-" + h
    local_chain = "KUBE-SVL-" + h
    uses_cluster_chain = bool(cat.cluster) and info.uses_cluster_endpoints
    uses_local_chain = bool(cat.local) and info.uses_local_endpoints

    internal_chain = cluster_chain
    has_internal = has_endpoints
    if info.internal_local:
        internal_chain = local_chain
        has_internal = has_internal and bool(cat.local)
    external_policy_chain = cluster_chain
    has_external = has_endpoints
    if info.external_local:
        external_policy_chain = local_chain
        has_external = has_external and bool(cat.local)
    ext_chain = "KUBE-EXT-" + h
    uses_ext_chain = has_endpoints and info.externally_accessible
    fw_chain = "KUBE-FW-" + h
    # ranges only in the other family allow nothing of this one: the chain then only falls through to the DROP
    uses_fw_chain = has_endpoints and bool(info.lb_ips) and info.lb_firewall
    lb_chain = fw_chain if uses_fw_chain else ext_chain

    int_target = ext_target = int_comment = ext_comment = ""
    if not has_endpoints:
        int_target = ext_target = "REJECT"
        int_comment = ext_comment = f'"{name} has no endpoints"'
    else:
        if not has_internal:
            int_target, int_comment = "DROP", f'"{name} has no local endpoints"'
        if not has_external:
            ext_target, ext_comment = "DROP", f'"{name} has no local endpoints"'

    pp = f"-m {proto} -p {proto}"
    cip = info.cluster_ip
    if has_internal:
        nat_top.append(f'-A {n.KUBE_SERVICES} -m comment --comment "{name} cluster IP" {pp} '
                       f"-d {cip} --dport {port} -j {internal_chain}")
    else:
        filter_rules.append(f"-A {n.KUBE_SERVICES} -m comment --comment {int_comment} {pp} "
                            f"-d {cip} --dport {port} -j {int_target}")

    for eip in info.external_ips:
        if has_endpoints:
            nat_top.append(f'-A {n.KUBE_SERVICES} -m comment --comment "{name} external IP" {pp} '
                           f"-d {eip} --dport {port} -j {ext_chain}")
        if not has_external:
            filter_rules.append(f"-A {n.KUBE_EXTERNAL_SERVICES} -m comment --comment {ext_comment} {pp} "
                                f"-d {eip} --dport {port} -j {ext_target}")

    for lbip in info.lb_ips:
        if has_endpoints:
            nat_top.append(f'-A {n.KUBE_SERVICES} -m comment --comment "{name} loadbalancer IP" {pp} '
                           f"-d {lbip} --dport {port} -j {lb_chain}")
        if uses_fw_chain:
            filter_rules.append(f'-A {n.KUBE_PROXY_FIREWALL} -m comment --comment "{name} traffic not accepted by '
                                f'{fw_chain}" {pp} -d {lbip} --dport {port} -j DROP')
    if not has_external:
        for lbip in info.lb_ips:
            filter_rules.append(f"-A {n.KUBE_EXTERNAL_SERVICES} -m comment --comment {ext_comment} {pp} "
                                f"-d {lbip} --dport {port} -j {ext_target}")

    if info.node_port:
        if has_endpoints:
            # kube-proxy also writes a 127.0.0.0/8 copy counting packets with nfacct;
            # it is only a counter, and nfacct objects are not ours to create.
            nat_top.append(f"-A {n.KUBE_NODEPORTS} -m comment --comment {_q(name)} {pp} "
                           f"--dport {info.node_port} -j {ext_chain}")
        if not has_external:
            filter_rules.append(f"-A {n.KUBE_EXTERNAL_SERVICES} -m comment --comment {ext_comment} "
                                f"-m addrtype --dst-type LOCAL {pp} --dport {info.node_port} -j {ext_target}")

    if info.health_check_node_port:
        filter_rules.append(f'-A {n.KUBE_NODEPORTS} -m comment --comment "{name} health check node port" '
                            f"-m tcp -p tcp --dport {info.health_check_node_port} -j ACCEPT")

    # per-service chains: computed always (they are active), written only when asked
    chains: list[str] = []
    rules: list[str] = []
    if has_internal:
        args = f'-m comment --comment "{name} cluster IP" {pp} -d {cip} --dport {port}'
        if cfg.proxy.masquerade_all:
            rules.append(f"-A {internal_chain} {args} -j {n.KUBE_MARK_MASQ}")
        elif node.detects_local:
            rules.append(f"-A {internal_chain} {args} {node.if_local(negate=True)} -j {n.KUBE_MARK_MASQ}")

    if uses_ext_chain:
        chains.append(ext_chain)
        if not info.external_local:
            rules.append(f'-A {ext_chain} -m comment --comment "masquerade traffic for {name} external '
                         f'destinations" -j {n.KUBE_MARK_MASQ}')
        else:
            if node.detects_local:
                rules.append(f'-A {ext_chain} -m comment --comment "pod traffic for {name} external '
                             f'destinations" {node.if_local()} -j {cluster_chain}')
            rules.append(f'-A {ext_chain} -m comment --comment "masquerade LOCAL traffic for {name} external '
                         f'destinations" -m addrtype --src-type LOCAL -j {n.KUBE_MARK_MASQ}')
            rules.append(f'-A {ext_chain} -m comment --comment "route LOCAL traffic for {name} external '
                         f'destinations" -m addrtype --src-type LOCAL -j {cluster_chain}')
        if has_external:
            rules.append(f"-A {ext_chain} -j {external_policy_chain}")

    if uses_fw_chain:
        chains.append(fw_chain)
        fw_args = f'-A {fw_chain} -m comment --comment "{name} loadbalancer IP"'
        allow_from_node = False
        for cidr in info.lb_source_ranges:
            rules.append(f"{fw_args} -s {cidr} -j {ext_chain}")
            if node.primary_ip and _contains(cidr, node.primary_ip):
                allow_from_node = True
        if allow_from_node:
            for lbip in info.lb_ips:
                rules.append(f"{fw_args} -s {lbip} -j {ext_chain}")
        rules.append(f'-A {fw_chain} -m comment --comment "other traffic to {name} will be dropped by '
                     f'{n.KUBE_PROXY_FIREWALL}"')

    # KUBE-SEP names: sha256 of name + protocol + endpoint (names.sep_chain, inlined: this loop is hot)
    prefix = name + proto
    b32 = n._b32_16
    seps = {ep.endpoint: "KUBE-SEP-" + b32(prefix + ep.endpoint) for ep in cat.reachable}
    # endpoint rules go in as one multi-line string per chain: `count` tracks the lines
    count = len(rules)
    if uses_cluster_chain:
        chains.append(cluster_chain)
        count += _endpoint_rules(rules, info, cluster_chain, cat.cluster, large, seps)
    if uses_local_chain:
        chains.append(local_chain)
        count += _endpoint_rules(rules, info, local_chain, cat.local, large, seps)

    if cat.reachable:
        comment = "" if large else f" -m comment --comment {_q(name)}"
        masq = comment + " -s "
        masq_tail = f" -j {n.KUBE_MARK_MASQ}\n-A "
        dnat = f"{comment} {pp} -j DNAT --to-destination "
        lines = []
        if info.affinity_timeout:
            dnat_aff = comment + " -m recent --name "
            dnat_tail = f" --set {pp} -j DNAT --to-destination "
            for ep in cat.reachable:
                sep = seps[ep.endpoint]
                chains.append(sep)
                lines.append("-A " + sep + masq + ep.ip + masq_tail + sep + dnat_aff + sep + dnat_tail + ep.endpoint)
        else:
            for ep in cat.reachable:
                sep = seps[ep.endpoint]
                chains.append(sep)
                lines.append("-A " + sep + masq + ep.ip + masq_tail + sep + dnat + ep.endpoint)
        rules.append("\n".join(lines))
        count += 2 * len(lines)

    return (tuple(filter_rules), tuple(nat_top), tuple(chains),
            "\n".join([f":{c} - [0:0]" for c in chains]), "\n".join(rules), count)


def _endpoint_rules(rules: list[str], info: ServicePortInfo, chain: str,
                    endpoints: tuple[EndpointInfo, ...], large: bool, seps: dict[str, str]) -> int:
    """Appends the chain's endpoint choice as one multi-line string; returns its number of rules."""
    name = info.name
    head = "-A " + chain
    with_comment = head + ' -m comment --comment "' + name + " -> "
    lines = []
    if info.affinity_timeout:
        check = f" -m recent --name {{}} --rcheck --seconds {info.affinity_timeout} --reap -j {{}}"
        for ep in endpoints:
            sep = seps[ep.endpoint]
            lines.append((head if large else with_comment + ep.endpoint + '"') + check.format(sep, sep))
    count = len(endpoints)
    probs = _PROBABILITY_MATCH
    for i, ep in enumerate(endpoints):
        left = count - i
        if left == 1:
            stat = " -j "
        elif left < 64:
            stat = probs[left] + " -j "
        else:
            stat = f" -m statistic --mode random --probability {probability(left)} -j "
        lines.append((head if large else with_comment + ep.endpoint + '"') + stat + seps[ep.endpoint])
    if lines:
        rules.append("\n".join(lines))
    return len(lines)


def probability(n_endpoints: int) -> str:
    """1/n with 10 decimals, as kube-proxy's "%0.10f"."""
    return "%0.10f" % (1.0 / n_endpoints)


_PROBABILITY_MATCH = [""] + [f" -m statistic --mode random --probability {probability(i)}" for i in range(1, 64)]


def _contains(cidr: str, ip: str) -> bool:
    try:
        return ipaddress.ip_address(ip) in ipaddress.ip_network(cidr, strict=False)
    except ValueError:
        return False


def _our_chain(name: str) -> bool:
    return name.startswith("KUBE-") and name != "KUBE-KUBELET-CANARY"


def cleanup_text(existing: dict[str, set[str]], family: int = 4) -> str:
    """iptables-restore input removing every chain and jump clusterdns installs, and nothing else,
    knowing only the chains per table now in the kernel (`existing`, iptsave.chains of a dump):
    the jumps deleted are those a full sync inserts, for each target chain that exists (which
    fails if such a jump was removed by hand). With the dump at hand, use cleanup_saved."""
    jumps_by_table: dict[str, list[str]] = {t: [] for t in _CLEANUP_TABLES}
    for table, chain, extra, comment, target in _JUMPS + _KUBELET_JUMPS:
        if target in existing.get(table, ()):
            parts = [extra] if extra else []
            if comment:
                parts.append(f"-m comment --comment {_q(comment)}")
            parts.append(f"-j {target}")
            jumps_by_table[table].append(f"-D {chain} {' '.join(parts)}")
    return _cleanup(existing, jumps_by_table)


def cleanup_saved(save_text: str) -> str:
    """iptables-restore input removing every chain and jump clusterdns installs from the tables
    of one iptables-save dump (read once), and nothing else: the jumps deleted are exactly the
    rules found there. Empty when the dump holds none of our chains (the kubelet's are not)."""
    tables = iptsave.read(save_text)
    jumps_by_table: dict[str, list[str]] = {t: [] for t in _CLEANUP_TABLES}
    for table, t in tables.items():
        if table in jumps_by_table:
            jumps_by_table[table] = [f"-D {r.chain} {r.spec}" for r in t.rules
                                     if not _our_chain(r.chain) and _our_chain(iptsave.target(r.spec))]
    return _cleanup({name: set(t.chains) for name, t in tables.items()}, jumps_by_table)


_CLEANUP_TABLES = ("mangle", "filter", "nat")


def _cleanup(existing: dict[str, set[str]], jumps_by_table: dict[str, list[str]]) -> str:
    out: list[str] = []
    for table in _CLEANUP_TABLES:
        ours = sorted(c for c in existing.get(table, ()) if _our_chain(c))
        if not ours and not jumps_by_table[table]:
            continue
        out.append(f"*{table}")
        out += [f":{c} - [0:0]" for c in ours]
        out += jumps_by_table[table]
        out += [f"-X {c}" for c in ours]
        out.append("COMMIT")
    return "\n".join(out) + "\n" if out else ""


def foreign_cleanup_text(save_text: str, keep: dict[str, frozenset[str] | set[str]],
                         wanted_jumps: set[tuple[str, str, str]] | None = None) -> str:
    """iptables-restore input removing, from the tables of one backend and family, the
    KUBE-* chains a full sync did not write (`keep`: table -> chains it declared; the
    chains another mode left, e.g. IPVS's KUBE-NODE-PORT or KUBE-LOAD-BALANCER) and
    the jumps from built-in chains to KUBE-* chains other than `wanted_jumps`
    ((table, chain, spec) as jump_rules gives them). The kubelet's chains stay."""
    wanted_jumps = wanted_jumps or set()
    out: list[str] = []
    for table, t in iptsave.read(save_text).items():
        ours = keep.get(table, frozenset())
        stale = sorted(c for c in t.chains if _our_chain(c) and c != n.KUBE_FIREWALL and c not in ours)
        jumps = [f"-D {r.chain} {r.spec}" for r in t.rules
                 if not r.chain.startswith("KUBE-") and (_our_chain(iptsave.target(r.spec))
                                                         and iptsave.target(r.spec) != n.KUBE_FIREWALL)
                 and (table, r.chain, r.spec) not in wanted_jumps]
        if not stale and not jumps:
            continue
        out.append(f"*{table}")
        out += [f":{c} - [0:0]" for c in stale]
        out += jumps
        out += [f"-X {c}" for c in stale]
        out.append("COMMIT")
    return "\n".join(out) + "\n" if out else ""


__all__ = ["RenderCache", "RuleSet", "cleanup_saved", "cleanup_text", "foreign_cleanup_text", "jump_rules", "probability", "render"]
