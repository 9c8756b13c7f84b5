"""`clusterdns trace NAME`: one name followed from a pod's resolver to the Pods behind it.

The walk replays what a glibc stub resolver does with the pod's resolv.conf
(search list and ndots, A and AAAA sent together per candidate) against the
DNS server as it answers now: an in-process Engine built from the state, or a
running agent over the wire. Then, for the Service the name resolves to, the
rule path the proxier programs (taken from the proxier's own rendered rules,
so trace can never disagree with what is applied) and the endpoints. Each
proxy mode has its own path: iptables chains, nftables objects, or IPVS
virtual and real servers with the ipsets and iptables rules around them.

`build_trace` returns plain data (the `--json` schema, versioned by "schema");
`format_text` renders it for a person.
"""
from __future__ import annotations

import re
from typing import Any, Protocol

import dns.flags
import dns.message
import dns.rcode
import dns.rdatatype

from .config import Config
from .dns import names, resolvconf
from .state import ClusterState

SCHEMA = "clusterdns.trace/v1"
KUBE_DNS = ("kube-system", "kube-dns")
DEMO_POD = ("testapp", "client")     # where a trace on the demo cluster starts by default
QTYPES = ("A", "AAAA")


class TraceError(Exception):
    """Input trace cannot use (unknown pod, unreadable resolv.conf); one line."""


class Asker(Protocol):
    description: str

    async def ask(self, qname: str, qtype: str) -> dns.message.Message: ...

    def route(self, qname: str) -> str:
        """Where the last question for qname was answered: "zone", "upstream" or "refused"
        (outside the zones with no upstream)."""
        ...


class _SeenForwarder:
    """The engine's forwarder, noting every name the engine sends upstream."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.asked: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def query(self, request: Any, tcp: bool) -> Any:
        self.asked.add(str(request.q.qname).lower())
        return await self.inner.query(request, tcp)


def _query(qname: str, qtype: str) -> dns.message.Message:
    # glibc sends plain queries with RD set and no EDNS unless `options edns0`.
    return dns.message.make_query(qname, qtype)


class EngineAsker:
    """Asks an in-process DNS engine (the one the agent runs) built from the state."""

    def __init__(self, engine: Any, client_ip: str, description: str,
                 seen: _SeenForwarder | None = None, zones: tuple[str, ...] = ()) -> None:
        self.engine = engine
        self.zones = [names.split_name(z) for z in zones]
        self.client_ip = client_ip
        self.description = description
        self.seen = seen

    def route(self, qname: str) -> str:
        if self.seen is not None and qname.lower() in self.seen.asked:
            return "upstream"
        return "zone" if names.zone_of(names.split_name(qname), self.zones) is not None else "refused"

    async def ask(self, qname: str, qtype: str) -> dns.message.Message:
        q = _query(qname, qtype)
        # As over TCP: trace shows the whole answer, not a truncated UDP one.
        wire = await self.engine.resolve(q.to_wire(), self.client_ip, True)
        if not wire:
            raise TraceError(f"the engine gave no reply for {qname} {qtype}")
        return dns.message.from_wire(wire)


class WireAsker:
    """Asks a running server over UDP, retrying over TCP when the reply is truncated."""

    def __init__(self, host: str, port: int, timeout: float = 2.0, zones: tuple[str, ...] = ()) -> None:
        self.host, self.port, self.timeout = host, port, timeout
        self.zones = [names.split_name(z) for z in zones]
        self.description = f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"

    def route(self, qname: str) -> str:
        # A running server forwards what is outside its zones; whether it has upstreams is its own.
        return "zone" if names.zone_of(names.split_name(qname), self.zones) is not None else "upstream"

    async def ask(self, qname: str, qtype: str) -> dns.message.Message:
        import dns.asyncquery
        import dns.exception
        q = _query(qname, qtype)
        try:
            reply, _ = await dns.asyncquery.udp_with_fallback(q, self.host, timeout=self.timeout, port=self.port)
        except (dns.exception.Timeout, OSError) as exc:
            raise TraceError(f"no answer from {self.description} for {qname} {qtype}: "
                             f"{exc.__class__.__name__} {exc}".strip()) from None
        return reply


class CorefileAsker:
    """Asks the server blocks of a Corefile in-process, noting for each question the block
    and the plugin that answered."""

    def __init__(self, corefile: Any, listener: Any, client_ip: str) -> None:
        self.corefile, self.listener, self.client_ip = corefile, listener, client_ip
        self.description = f"Corefile {corefile.path} (in-process, listener {listener.server})"
        self.info: dict[str, dict] = {}

    def route(self, qname: str) -> str:
        info = self.info.get(qname.lower(), {})
        if not info.get("block"):
            return "refused"
        return "upstream" if info.get("plugin") == "forward" else "zone"

    def where(self, qname: str) -> dict:
        info = self.info.get(qname.lower(), {})
        return {"block": info.get("block", ""), "zone": info.get("zone", ""), "plugin": info.get("plugin", ""),
                "upstream": info.get("upstream", ""), "cache": info.get("cache", ""), "trail": info.get("trail", [])}

    async def ask(self, qname: str, qtype: str) -> dns.message.Message:
        q = _query(qname, qtype)
        info: dict = {}
        wire = await self.listener.resolve(q.to_wire(), self.client_ip, True, 0, info)
        if not wire:
            raise TraceError(f"the Corefile gave no reply for {qname} {qtype}")
        self.info[qname.lower()] = info
        return dns.message.from_wire(wire if isinstance(wire, bytes) else wire[0])


# ---------------------------------------------------------------- resolver view

def pod_resolv_conf(namespace: str, cfg: Config, state: ClusterState) -> resolvconf.ResolvConf:
    """What kubelet writes for a ClusterFirst pod in `namespace`."""
    zone = cfg.dns.cluster_domain
    search = (f"{namespace}.svc.{zone}", f"svc.{zone}", zone)
    return resolvconf.ResolvConf(nameservers=_kube_dns_ips(state, cfg)[:1], search=search, ndots=5,
                                 options=("ndots:5",))


def _kube_dns_ips(state: ClusterState, cfg: Config) -> tuple[str, ...]:
    svc = state.services.get(KUBE_DNS)
    if svc is not None and svc.cluster_ips:
        return svc.cluster_ips
    return cfg.dns.local_ips


def resolver_view(cfg: Config, state: ClusterState) -> tuple[resolvconf.ResolvConf, dict]:
    """The resolv.conf to replay and a description of where it came from."""
    if cfg.run.trace_resolv_conf:
        try:
            conf = resolvconf.read(cfg.run.trace_resolv_conf)
        except OSError as exc:
            raise TraceError(f"{cfg.run.trace_resolv_conf}: {exc.strerror or exc}") from None
        return conf, {"source": "file", "path": cfg.run.trace_resolv_conf, "pod": None, "client_ip": None}
    namespace, pod_name = "default", ""
    from_pod = cfg.run.from_pod
    if not from_pod and cfg.source.demo and DEMO_POD in state.pods:
        from_pod = "/".join(DEMO_POD)       # the client pod of the design's path
    if from_pod:
        namespace, pod_name = from_pod.split("/", 1)
        if not namespace or not pod_name:
            raise TraceError(f"--from-pod {from_pod!r}: expected NAMESPACE/POD")
    client_ip = None
    if pod_name:
        pod = state.pods.get((namespace, pod_name))
        if pod is None and "Pod" in state.synced and state.pods:
            raise TraceError(f"pod {namespace}/{pod_name} not found")
        client_ip = pod.ips[0] if pod is not None and pod.ips else None
    return pod_resolv_conf(namespace, cfg, state), {
        "source": "pod" if pod_name else "namespace-defaults",
        "path": None, "pod": f"{namespace}/{pod_name}" if pod_name else None,
        "namespace": namespace, "client_ip": client_ip}


# ---------------------------------------------------------------- the walk

def _answers(msg: dns.message.Message) -> list[dict]:
    out = []
    for rrset in msg.answer:
        for rd in rrset:
            out.append({"name": rrset.name.to_text(), "type": dns.rdatatype.to_text(rrset.rdtype),
                        "ttl": rrset.ttl, "data": rd.to_text()})
    return out


async def walk(name: str, conf: resolvconf.ResolvConf, asker: Asker) -> dict:
    """Every query glibc would send for `name`, in order, and where it stops.

    glibc (res_search) moves to the next candidate on NXDOMAIN, on NODATA and
    on SERVFAIL, and stops at the first candidate where either A or AAAA has
    an answer, or on any other error (REFUSED, FORMERR...) while walking the
    search list; the as-is try made first (ndots reached) never stops it.
    """
    queries: list[dict] = []
    stopped_at = None
    outcome = "not-found"
    for step, cand in enumerate(resolvconf.candidates(name, conf), 1):
        replies = {}
        for qtype in QTYPES:
            msg = await asker.ask(cand, qtype)
            replies[qtype] = msg
            queries.append({"step": step, "name": cand, "type": qtype, "route": asker.route(cand),
                            "rcode": dns.rcode.to_text(msg.rcode()),
                            "aa": bool(msg.flags & dns.flags.AA), "tc": bool(msg.flags & dns.flags.TC),
                            "answers": _answers(msg)})
            where = getattr(asker, "where", None)
            if where is not None:
                queries[-1].update(where(cand))
        if any(_answers(m) for m in replies.values()):
            stopped_at, outcome = cand, "answer"
            break
        rcodes = {m.rcode() for m in replies.values()}
        # The as-is try made before the search list goes on whatever it got.
        first_as_is = step == 1 and cand.rstrip(".").lower() == name.strip().rstrip(".").lower() and (
            name.strip().endswith(".") or name.count(".") >= conf.ndots)
        if rcodes - {dns.rcode.NOERROR, dns.rcode.NXDOMAIN, dns.rcode.SERVFAIL} and not first_as_is:
            stopped_at, outcome = cand, "error"
            break
    if queries:
        for q in queries:
            q["stop"] = q["name"] == stopped_at
    addresses = [a["data"] for q in queries if q["name"] == stopped_at
                 for a in q["answers"] if a["type"] in QTYPES]
    upstream = [q["name"] for q in queries if q["route"] == "upstream"]
    return {"queries": queries, "stopped_at": stopped_at, "outcome": outcome,
            "addresses": list(dict.fromkeys(addresses)), "upstream": list(dict.fromkeys(upstream))}


# ---------------------------------------------------------------- service, rules, endpoints

def find_service(state: ClusterState, cfg: Config, fqdn: str | None, addresses: list[str]):
    """The Service a resolved name belongs to: by name under <zone>, else by ClusterIP."""
    if fqdn:
        labels = fqdn.rstrip(".").lower().split(".")
        zone = cfg.dns.cluster_domain.split(".")
        if labels[-len(zone):] == zone and len(labels) == len(zone) + 3 and labels[-len(zone) - 1] == "svc":
            svc = state.services.get((labels[1], labels[0]))
            if svc is not None:
                return svc
    for svc in state.services.values():
        if any(ip in svc.cluster_ips for ip in addresses):
            return svc
    return None


def _service_data(svc) -> dict:
    return {"namespace": svc.namespace, "name": svc.name, "type": svc.type,
            "cluster_ips": list(svc.cluster_ips), "headless": svc.headless,
            "external_name": svc.external_name or None,
            "ports": [{"name": p.name, "protocol": p.protocol, "port": p.port,
                       "node_port": p.node_port or None,
                       "target_port": p.target_port} for p in svc.ports],
            "external_ips": list(svc.external_ips), "lb_ips": list(svc.lb_ips),
            "external_traffic_policy": "Local" if svc.external_local else "Cluster",
            "internal_traffic_policy": "Local" if svc.internal_local else "Cluster",
            "session_affinity_timeout": svc.affinity_timeout or None}


def _endpoint_data(state: ClusterState, svc) -> list[dict]:
    out = []
    for sl in state.slices_for(svc.namespace, svc.name):
        ports = [{"name": p.name, "protocol": p.protocol, "port": p.port} for p in sl.ports]
        for ep in sl.endpoints:
            for addr in ep.addresses:
                out.append({"address": addr, "ready": ep.ready, "serving": ep.serving,
                            "terminating": ep.terminating, "node": ep.node_name or None,
                            "zone": ep.zone or None,
                            "pod": f"{ep.pod_namespace}/{ep.pod_name}" if ep.pod_name else None,
                            "slice": sl.name, "ports": ports})
    return out


# ---------------------------------------------------------------- rules (iptables)

_JUMP = re.compile(r"-j (\S+)")
_PROB = re.compile(r"--probability (\S+)")
_DNAT = re.compile(r"--to-destination (\S+)")
_NOT_SRC = re.compile(r"! -s (\S+)")
_SRC = re.compile(r"(?<!! )-s (\S+)")


def _iptables_tables(text: str) -> dict[str, list[str]]:
    from .proxy import iptsave
    return {name: [r.line for r in t.rules] for name, t in iptsave.read(text).items()}


def _chain_of(rule: str) -> str:
    return rule.split()[1]


def _target(rule: str) -> str:
    m = _JUMP.search(rule)
    return m.group(1) if m else ""


def _masq_reason(rule: str, cfg: Config) -> str:
    if "--src-type LOCAL" in rule:
        return "traffic from the node itself"
    m = _NOT_SRC.search(rule)
    if m:
        return f"source outside the cluster CIDR {m.group(1)}"
    chain = _chain_of(rule)
    m = _SRC.search(rule)
    if chain.startswith("KUBE-SEP-") and m:
        return f"hairpin: the endpoint {m.group(1)} reaching itself through the Service"
    if chain.startswith("KUBE-EXT-"):
        return "all external traffic (externalTrafficPolicy Cluster)"
    if cfg.proxy.masquerade_all:
        return "all traffic (--masquerade-all)"
    return "always"


def iptables_path(state: ClusterState, cfg: Config, svc, family: int) -> list[dict]:
    """The service's rules as the iptables proxier renders them, port by port."""
    from .proxy import iptables as ipt
    from .proxy.servicemap import service_ports_for
    node = state.nodes.get(cfg.proxy.node_name) if cfg.proxy.node_name else None
    ports = service_ports_for(state, svc.key, family, cfg.proxy.node_name, node.zone if node else "")
    if not ports:
        return []
    tables = _iptables_tables(ipt.render(state, cfg, family).text)
    nat, flt = tables.get("nat", []), tables.get("filter", [])
    out = []
    for info, cat in ports:
        ours = {info.svc_chain, info.svl_chain, info.ext_chain, info.fw_chain}
        ours |= {info.sep_chain(ep) for ep in cat.reachable}
        entry = [r for r in nat if _chain_of(r) in ("KUBE-SERVICES", "KUBE-NODEPORTS") and _target(r) in ours]
        chains: dict[str, list[str]] = {}
        for r in nat:
            c = _chain_of(r)
            if c in ours:
                chains.setdefault(c, []).append(r)
        quoted = f'"{info.name} '
        filt = [r for r in flt if quoted in r]
        dnat = {c: m.group(1) for c, rs in chains.items() for r in rs if (m := _DNAT.search(r))}
        by_endpoint = {info.sep_chain(ep): ep for ep in cat.reachable}
        dispatch = []
        for chain in (info.svc_chain, info.svl_chain):
            for r in chains.get(chain, []):
                target = _target(r)
                if not target.startswith("KUBE-SEP-") or "--rcheck" in r:
                    continue
                m = _PROB.search(r)
                ep = by_endpoint.get(target)
                dispatch.append({"chain": chain, "target": target,
                                 "probability": float(m.group(1)) if m else 1.0,
                                 "probability_text": m.group(1) if m else None,
                                 "endpoint": dnat.get(target),
                                 "node": ep.node_name if ep else None, "zone": ep.zone if ep else None,
                                 "ready": ep.ready if ep else None})
        masq = [{"chain": _chain_of(r), "when": _masq_reason(r, cfg), "rule": r}
                for c, rs in chains.items() for r in rs if _target(r) == "KUBE-MARK-MASQ"]
        out.append({
            "port": info.name, "protocol": info.protocol, "cluster_ip": info.cluster_ip,
            "port_number": info.port_number, "node_port": info.node_port or None,
            "entry": entry, "filter": filt,
            "chains": [{"table": "nat", "name": c, "rules": rs} for c, rs in chains.items()],
            "dispatch": dispatch, "masquerade": masq,
            "endpoints_total": len(cat.all), "endpoints_used": len(cat.reachable),
            "has_endpoints": cat.has_endpoints,
        })
    return out


# ---------------------------------------------------------------- rules (ipvs)

_MATCH_SET = re.compile(r"--match-set (\S+) ")


def _ipvs_set_members(name: str, entries: frozenset[str], info, servers: list, hcnp: int) -> list[str]:
    """The entries of ipset `name` that stand for this service port (kube-proxy's entry formats)."""
    proto = info.protocol
    portals = {f"{vs.address},{proto}:{vs.port}" for vs in servers}
    reals = {f"{r.ip},{proto}:{r.port},{r.ip}" for vs in servers for r in vs.reals}
    addresses = {info.cluster_ip, *info.external_ips, *info.lb_ips}
    out = []
    for e in sorted(entries):
        if "HEALTH-CHECK" in name:
            hit = bool(hcnp) and e == str(hcnp)
        elif "NODE-PORT" in name and "SCTP" not in name:
            hit = bool(info.node_port) and e == str(info.node_port) and proto.upper() in name
        elif "LOOP-BACK" in name:
            hit = e in reals
        elif "IPVS-IPS" in name:
            hit = e in addresses
        else:
            hit = e in portals or any(e.startswith(p + ",") for p in portals)
        if hit:
            out.append(e)
    return out


def _ipvs_masq_reason(rule: str, cfg: Config) -> str:
    if "-j MASQUERADE" in rule:
        return "hairpin: an endpoint reaching itself through the Service (KUBE-LOOP-BACK)"
    m = _NOT_SRC.search(rule)
    if m:
        return f"source outside the cluster CIDR {m.group(1)}"
    if " src,dst " in rule:
        return "traffic from the node itself (its source is a service address on kube-ipvs0)"
    if "NODE-PORT" in rule:
        return "NodePort traffic (externalTrafficPolicy Cluster)"
    if "EXTERNAL-IP" in rule:
        return "traffic to an external IP (externalTrafficPolicy Cluster)"
    if "KUBE-LOAD-BALANCER" in rule:
        return "LoadBalancer traffic (externalTrafficPolicy Cluster)"
    if cfg.proxy.masquerade_all:
        return "all traffic (--masquerade-all)"
    return "always"


def ipvs_path(state: ClusterState, cfg: Config, svc, family: int) -> list[dict]:
    """The service's IPVS virtual servers and real servers, the ipset entries that stand for
    it and the iptables rules matching those ipsets, as the IPVS proxier renders them."""
    from .proxy import ipvs
    from .proxy.servicemap import service_ports_for
    node = state.nodes.get(cfg.proxy.node_name) if cfg.proxy.node_name else None
    ports = service_ports_for(state, svc.key, family, cfg.proxy.node_name, node.zone if node else "")
    if not ports:
        return []
    conf = ipvs.render(state, cfg, family)
    tables = _iptables_tables(conf.iptables)
    out = []
    for info, cat in ports:
        servers = [vs for vs in conf.virtual_servers if vs.service == info.name]
        sets = {name: members for name, entries in sorted((conf.set_entries or {}).items())
                if (members := _ipvs_set_members(name, entries, info, servers, info.health_check_node_port))}
        chains: dict[tuple[str, str], list[str]] = {}
        for table in ("nat", "filter"):
            for r in tables.get(table, []):
                m = _MATCH_SET.search(r)
                if m and m.group(1) in sets:
                    chains.setdefault((table, _chain_of(r)), []).append(r)
        # the set-less rules these chains end with: masquerade for LoadBalancer traffic, and
        # the DROP for sources outside loadBalancerSourceRanges
        for (table, chain), rs in list(chains.items()):
            if chain in ("KUBE-LOAD-BALANCER", "KUBE-SOURCE-RANGES-FIREWALL"):
                rs += [r for r in tables.get(table, []) if _chain_of(r) == chain and r not in rs
                       and not _MATCH_SET.search(r)]
        by_real = {(ep.ip, ep.port): ep for ep in cat.all}
        cluster_vs = next((vs for vs in servers if vs.address == info.cluster_ip and vs.port == info.port_number),
                          None)
        dispatch = []
        if cluster_vs is not None:
            n = len(cluster_vs.reals)
            for real in cluster_vs.reals:
                ep = by_real.get((real.ip, real.port))
                dispatch.append({"chain": f"virtual server {cluster_vs.key}", "target": "real server",
                                 "probability": round(1.0 / n, 10),
                                 "probability_text": f"1/{n} ({cluster_vs.scheduler})",
                                 "endpoint": ep.endpoint if ep else f"{real.ip}:{real.port}",
                                 "node": ep.node_name if ep else None, "zone": ep.zone if ep else None,
                                 "ready": ep.ready if ep else None})
        # externalTrafficPolicy Local: the set's RETURN comes first in KUBE-LOAD-BALANCER and
        # KUBE-NODE-PORT, so their masquerade rules never see this Service's traffic
        skipped = ("KUBE-LOAD-BALANCER", "KUBE-NODE-PORT") if info.external_local else ()
        masq = [{"chain": c, "when": _ipvs_masq_reason(r, cfg), "rule": r,
                 "set": (m.group(1) if (m := _MATCH_SET.search(r)) else None)}
                for (_, c), rs in chains.items() for r in rs
                if r.endswith(("-j KUBE-MARK-MASQ", "-j MASQUERADE")) and c not in skipped]
        cluster_set = ipvs.set_name(ipvs.CLUSTER_IP, family)
        out.append({
            "port": info.name, "protocol": info.protocol, "cluster_ip": info.cluster_ip,
            "port_number": info.port_number, "node_port": info.node_port or None,
            "entry": [f"ipset {name}: {', '.join(members[:3])}" + (f", ... ({len(members)} entries)"
                                                                     if len(members) > 3 else "")
                      for name, members in sets.items()],
            "filter": [],
            "chains": [{"table": tb, "name": c, "rules": rs} for (tb, c), rs in chains.items()],
            "dispatch": dispatch, "masquerade": masq,
            "cluster_masquerade": any(m["set"] == cluster_set for m in masq),
            "virtual_servers": [{"key": vs.key, "address": vs.address, "protocol": vs.protocol, "port": vs.port,
                                 "scheduler": vs.scheduler, "persistence": vs.persistence or None,
                                 "real_servers": [{"address": r.ip, "port": r.port, "weight": r.weight}
                                                  for r in vs.reals]} for vs in servers],
            "ipsets": sets,
            "endpoints_total": len(cat.all), "endpoints_used": len(cluster_vs.reals) if cluster_vs else 0,
            "has_endpoints": cat.has_endpoints,
        })
    return out


# ---------------------------------------------------------------- putting it together

def make_asker(cfg: Config, state: ClusterState, resolver: dict, conf: resolvconf.ResolvConf) -> Asker:
    """A running server when --listen is given, else an in-process engine on `state`."""
    if cfg.dns.corefile:
        from .corefile.build import prepare
        corefile, _ = prepare(cfg)
        corefile.update(state)
        listener = _listener_for(corefile, conf)
        return CorefileAsker(corefile, listener, resolver.get("client_ip") or "127.0.0.1")
    if cfg.dns.listen:
        host, port = cfg.listen_addresses()[0]
        return WireAsker(host, port, zones=cfg.dns.zones)
    from .dns.engine import Engine
    from .dns.forward import Forward
    forwarder = Forward.from_config(cfg)
    seen = _SeenForwarder(forwarder) if forwarder is not None else None
    engine = Engine(cfg, seen, server_addresses=lambda: list(conf.nameservers[:1]))
    engine.update(state)
    ups = ", ".join(u.address for u in getattr(forwarder, "upstreams", ()))
    return EngineAsker(engine, resolver.get("client_ip") or "127.0.0.1",
                       f"in-process engine (state version {state.version}; "
                       + (f"upstream {ups})" if ups else "no upstream)"), seen, cfg.dns.zones)


def _listener_for(corefile: Any, conf: resolvconf.ResolvConf) -> Any:
    """The Corefile's listener on the pod's first nameserver at port 53 if there is one, else
    one on port 53 (a wildcard first), else the first."""
    ls = corefile.listeners
    ns = conf.nameservers[0] if conf.nameservers else ""
    for key in ((ns, 53), ("0.0.0.0", 53)):
        if key in ls:
            return ls[key]
    on53 = [li for (_h, p), li in ls.items() if p == 53]
    return on53[0] if on53 else next(iter(ls.values()))


async def build_trace(cfg: Config, state: ClusterState, asker: Asker | None = None) -> dict:
    """The whole trace as plain data (the --json schema)."""
    conf, resolver = resolver_view(cfg, state)
    resolver.update({"search": list(conf.search), "ndots": conf.ndots,
                     "nameservers": list(conf.nameservers), "options": list(conf.options)})
    asker = asker or make_asker(cfg, state, resolver, conf)
    try:
        result = await walk(cfg.run.name, conf, asker)
    finally:
        seen = getattr(asker, "seen", None)
        if seen is not None and hasattr(seen.inner, "close"):
            await seen.inner.close()
    svc = find_service(state, cfg, result["stopped_at"], result["addresses"])
    mode = cfg.proxy.proxy_mode if cfg.proxy.proxy_mode != "none" else "iptables"
    family = 4
    if result["addresses"] and ":" in result["addresses"][0]:
        family = 6
    data: dict[str, Any] = {
        "schema": SCHEMA, "name": cfg.run.name, "resolver": resolver, "server": asker.description,
        "libc": "glibc", "walk": result, "service": None, "rules": None, "endpoints": [],
    }
    if svc is not None:
        data["service"] = _service_data(svc)
        data["endpoints"] = _endpoint_data(state, svc)
        if mode == "iptables":
            ports = iptables_path(state, cfg, svc, family)
        elif mode == "ipvs":
            ports = ipvs_path(state, cfg, svc, family)
        else:
            ports = nftables_path(state, cfg, svc, family, mode)
        data["rules"] = {"mode": mode, "family": family, "ports": ports,
                         "note": _rules_note(svc, ports)}
    return data


def _rules_note(svc, ports: list) -> str | None:
    if svc.is_external_name:
        return f"ExternalName: a CNAME to {svc.external_name}; no proxy rules"
    if svc.headless:
        return "headless: DNS answers the endpoint addresses themselves; no proxy rules"
    if svc.proxy_name:
        return f"served by the proxy {svc.proxy_name!r}, not by clusterdns"
    if not ports:
        return "no rules for this family"
    return None


def nftables_path(state: ClusterState, cfg: Config, svc, family: int, mode: str) -> list[dict]:
    """The service's objects as the nftables (or another) proxier renders them."""
    try:
        from .proxy import nftables as nft
    except ImportError:
        raise TraceError(f"--proxy-mode {mode}: this build cannot render its rules") from None
    from .proxy.servicemap import service_ports_for
    node = state.nodes.get(cfg.proxy.node_name) if cfg.proxy.node_name else None
    ports = service_ports_for(state, svc.key, family, cfg.proxy.node_name, node.zone if node else "")
    if not ports:
        return []
    table = nft.build(state, cfg, family)
    objs = table.owned.get(svc.key)
    if objs is None:
        return []
    return [_nft_port(nft, table, objs, info, cat) for info, cat in ports]


def _nft_port(nft, table, objs, info, cat) -> dict:
    """One service port's part of the Service's nftables objects (read from them, not from text)."""
    from .proxy import names
    from .proxy.nftobj import Addr, Endpoint, FibLocal, Lookup, Verdict, element_of
    fam = "ip6" if table.family == 6 else "ip"
    base = info.nft_base
    svc_chain, local_chain = names.nft_service_chain(base), names.nft_local_chain(base)
    ours = {svc_chain, local_chain, names.nft_external_chain(base), names.nft_firewall_chain(base)}
    by_endpoint = {ep.endpoint: ep for ep in cat.reachable}
    if info.affinity_timeout:
        ours |= {names.nft_endpoint_chain(info.nft_endpoint_base(ep)) for ep in cat.reachable}
    addresses = {info.cluster_ip, *info.external_ips, *info.lb_ips}
    service_key = (info.protocol, str(info.port_number))
    node_key = (info.protocol, str(info.node_port))
    entry = []
    for set_name, _, stored in objs.elements:
        elem = element_of(stored)
        if set_name.startswith(nft.ENDPOINTS_PREFIX) or set_name == nft.HAIRPIN or elem.interval:
            continue
        targets_ours = isinstance(elem.value, Verdict) and elem.value.chain in ours
        keyed_ours = (len(elem.key) == 3 and elem.key[0] in addresses and tuple(elem.key[1:]) == service_key) or \
            (bool(info.node_port) and tuple(elem.key) == node_key)
        if targets_ours or (keyed_ours and set_name.startswith("no-endpoint")):
            entry.append(f"add element {fam} {names.NFT_TABLE} {set_name} {{ {elem.text()} }}")
    rules = {c: rs for c, rs in objs.chains.items() if c in ours}
    head = (info.namespace, info.service_name, info.port_name, info.protocol)
    slots = dict(zip(objs.slot_keys, objs.slots))
    dispatch = []
    for chain, policy in ((svc_chain, nft.CLUSTER), (local_chain, nft.LOCAL)):
        slot = slots.get(head + (policy,))
        if slot is not None:
            bucket, index = slot
            map_name = nft.endpoints_map(bucket)
            lo_slot, hi_slot = index * nft.SLOT, (index + 1) * nft.SLOT - 1
            for set_name, key, stored in objs.range_elements():
                elem = element_of(stored)
                value = elem.value
                if set_name != map_name or not lo_slot <= elem.key[0] <= hi_slot or not isinstance(value, Endpoint):
                    continue
                lo, hi = elem.key
                ip, port = value.ip, value.port
                endpoint = f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
                ep = by_endpoint.get(endpoint)
                dispatch.append({"chain": chain, "target": f"@{map_name} {key}",
                                 "probability": round(nft.endpoint_share(key), 10),
                                 "probability_text": f"{hi - lo + 1}/{nft.SLOT}",
                                 "endpoint": endpoint, "node": ep.node_name if ep else None,
                                 "zone": ep.zone if ep else None, "ready": ep.ready if ep else None})
        elif info.affinity_timeout and chain in rules:
            endpoints = cat.local if policy == nft.LOCAL else cat.cluster
            for ep in endpoints:
                dispatch.append({"chain": chain, "target": names.nft_endpoint_chain(info.nft_endpoint_base(ep)),
                                 "probability": round(1.0 / len(endpoints), 10),
                                 "probability_text": f"1/{len(endpoints)}", "endpoint": ep.endpoint,
                                 "node": ep.node_name, "zone": ep.zone, "ready": ep.ready})
        if dispatch:
            break

    def reason(r) -> str:
        for st in r.stmts:
            if isinstance(st, Addr) and st.field == "saddr" and st.neg:
                return f"source outside the cluster CIDR {st.value}"
            if isinstance(st, FibLocal) and st.field == "saddr":
                return "traffic from the node itself"
        return "always"

    masq = [{"chain": c, "when": reason(r), "rule": r.text()}
            for c, rs in rules.items() for r in rs if nft.MARK_MASQ in r.targets()]
    hairpin = [r for r in table.chains.get(nft.MASQUERADING, ())
               if any(isinstance(st, Lookup) and st.set == nft.HAIRPIN for st in r.stmts)]
    if hairpin and cat.reachable:
        masq.append({"chain": nft.MASQUERADING, "rule": hairpin[0].text(),
                     "when": "hairpin: an endpoint reaching itself through the Service (the @hairpin set)"})
    return {"port": info.name, "protocol": info.protocol, "cluster_ip": info.cluster_ip,
            "port_number": info.port_number, "node_port": info.node_port or None,
            "entry": entry, "filter": [],
            "chains": [{"table": names.NFT_TABLE, "name": c, "rules": [r.text() for r in rs]}
                       for c, rs in rules.items()],
            "dispatch": dispatch, "masquerade": masq,
            "endpoints_total": len(cat.all), "endpoints_used": len(cat.reachable),
            "has_endpoints": cat.has_endpoints}


# ---------------------------------------------------------------- text output

class _Style:
    def __init__(self, color: bool) -> None:
        self.color = color

    def _c(self, code: str, text: str) -> str:
        return f"\033[{code}m{text}\033[0m" if self.color else text

    def bold(self, t: str) -> str:
        return self._c("1", t)

    def good(self, t: str) -> str:
        return self._c("32", t)

    def bad(self, t: str) -> str:
        return self._c("31", t)

    def dim(self, t: str) -> str:
        return self._c("2", t)


def _table(rows: list[list[str]], indent: str = "  ") -> list[str]:
    """Aligned columns; widths from the text without colour codes."""
    plain = [[re.sub(r"\033\[[0-9;]*m", "", c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in plain) for i in range(len(rows[0]))]
    out = []
    for r, p in zip(rows, plain):
        cells = [c + " " * (widths[i] - len(p[i])) for i, c in enumerate(r)]
        out.append((indent + "  ".join(cells)).rstrip())
    return out


def format_text(data: dict, color: bool = False) -> str:
    s = _Style(color)
    r = data["resolver"]
    lines = []
    who = {"pod": f"pod {r.get('pod')}", "namespace-defaults": f"a pod in namespace {r.get('namespace')}",
           "file": f"resolv.conf {r.get('path')}"}[r["source"]]
    lines.append(s.bold(f"trace {data['name']}") + f"  from {who}")
    lines.append(f"  search {' '.join(r['search']) or '(none)'}   ndots:{r['ndots']}   "
                 f"nameserver {', '.join(r['nameservers']) or '(none)'}")
    lines.append(f"  asking {data['server']}")
    lines.append("")
    w = data["walk"]
    lines.append(s.bold("DNS walk") + s.dim("  (glibc: A and AAAA together per candidate, next on "
                                               "NXDOMAIN/NODATA/SERVFAIL)"))
    rows = [["#", "NAME", "TYPE", "FROM", "RCODE", "ANSWER"]]
    route_text = {"zone": "zone", "upstream": s.bold("upstream"), "refused": "no upstream"}
    for q in w["queries"]:
        ans = ", ".join(f"{a['data']}" + (f" ({a['type']})" if a["type"] != q["type"] else "")
                        for a in q["answers"][:4])
        if len(q["answers"]) > 4:
            ans += f", ... ({len(q['answers'])} records)"
        if q["answers"]:
            ans += s.dim(f"  ttl {q['answers'][0]['ttl']}")
        rcode = q["rcode"]
        if q["answers"]:
            rcode = s.good(rcode)
        elif rcode == "NOERROR":
            rcode = "NODATA"
        elif rcode != "NXDOMAIN":
            rcode = s.bad(rcode)
        source = route_text.get(q.get("route", ""), "-")
        if "block" in q:        # a Corefile: the server block (FILE:LINE) and the plugin that answered
            source = f"{q['block'] or 'no block'} {q.get('plugin') or ('REFUSED' if not q['block'] else '-')}"
            if q.get("upstream"):       # which upstream forward's answer came from
                source += f" {q['upstream']}"
            if q.get("cache"):
                source += f" ({q['cache']})"
        rows.append([str(q["step"]), q["name"], q["type"], source, rcode, ans or "-"])
    lines += _table(rows)
    notes = [f"  {q['step']} {q['name']} {q['type']}: " + "; ".join(q["trail"]) for q in w["queries"] if q.get("trail")]
    if notes:
        lines.append(s.dim("  what the plugins did:"))
        lines += notes
    if w.get("upstream"):
        lines.append("  " + f"sent upstream (outside the served zones): {', '.join(w['upstream'])}")
    if w["outcome"] == "answer":
        lines.append("  " + s.good(f"stops at {w['stopped_at']}") + f" -> {', '.join(w['addresses']) or 'CNAME'}")
    elif w["outcome"] == "error":
        lines.append("  " + s.bad(f"stops at {w['stopped_at']} with an error"))
    else:
        lines.append("  " + s.bad("no candidate answered: the name does not resolve"))
    svc = data["service"]
    if svc is None:
        return "\n".join(lines) + "\n"
    lines.append("")
    ports = ", ".join(f"{p['port']}/{p['protocol']}" + (f" ({p['name']})" if p["name"] else "")
                      + (f" nodePort {p['node_port']}" if p["node_port"] else "") for p in svc["ports"])
    addr = ", ".join(svc["cluster_ips"]) or ("None (headless)" if svc["headless"] else svc["external_name"] or "-")
    lines.append(s.bold(f"Service {svc['namespace']}/{svc['name']}") + f"  {svc['type']}  {addr}  ports {ports or '-'}")
    rules = data["rules"]
    if rules:
        lines.append("")
        lines.append(s.bold(f"Rules ({rules['mode']}, IPv{rules['family']})"))
        if rules["note"]:
            lines.append("  " + rules["note"])
        for p in rules["ports"]:
            lines.append(f"  {p['port']} {p['protocol']} {p['cluster_ip']}:{p['port_number']}"
                         f"  ({p['endpoints_used']} of {p['endpoints_total']} endpoints used)")
            for e in p["entry"]:
                lines.append("    " + s.dim(e))
            for f in p["filter"]:
                lines.append("    " + s.bad(f))
            for c in p["chains"] if rules["mode"] == "ipvs" else ():
                for rule in c["rules"]:
                    lines.append("    " + s.dim(f"{c['table']}: {rule}"))
            for vs in p.get("virtual_servers", [])[1:]:
                lines.append(f"    virtual server {vs['key']} ({vs['scheduler']}): "
                             f"{len(vs['real_servers'])} real servers")
            if p["dispatch"]:
                chain = p["dispatch"][0]["chain"]
                head = {"iptables": "KUBE-SERVICES -> ", "ipvs": ""}.get(rules["mode"], "service-ips map -> ")
                lines.append(f"    {head}{chain} -> one of {len(p['dispatch'])}:")
                shown = p["dispatch"]
                if len(shown) > 8:   # the whole list is in --json
                    shown = shown[:5] + [None] + shown[-2:]
                rows = [[d["target"], f"p={d['probability_text'] or '1 (rest)'}", f"-> {d['endpoint']}",
                         d["node"] or "-", d["zone"] or "-"] if d else
                        ["...", f"({len(p['dispatch']) - 7} more)", "", "", ""] for d in shown]
                lines += _table(rows, "      ")
            elif p["has_endpoints"] is False:
                lines.append("    " + s.bad("no endpoints: connections are rejected"))
            hairpin = [m for m in p["masquerade"] if m["when"].startswith("hairpin")]
            other = [m for m in p["masquerade"] if not m["when"].startswith("hairpin")]
            for m in other:
                lines.append(f"    masquerade in {m['chain']}: {m['when']}")
            cluster_masq = p["cluster_masquerade"] if "cluster_masquerade" in p else any(
                m["chain"] == (p["dispatch"][0]["chain"] if p["dispatch"] else "") for m in other)
            if not cluster_masq:
                lines.append("    masquerade of cluster traffic: none (no --cluster-cidr or --masquerade-all)")
            if hairpin and rules["mode"] == "ipvs":
                lines.append(f"    masquerade when an endpoint reaches itself through the Service (hairpin: "
                             f"local endpoints in {hairpin[0]['set']})")
            elif hairpin:
                lines.append(f"    masquerade when an endpoint reaches itself through the Service (hairpin, "
                             f"{len(hairpin)} endpoint chain{'s' if len(hairpin) != 1 else ''})")
    eps = data["endpoints"]
    lines.append("")
    ready = sum(1 for e in eps if e["ready"])
    lines.append(s.bold(f"Endpoints ({ready} ready of {len(eps)})"))
    if eps:
        rows = [["ADDRESS", "READY", "NODE", "ZONE", "POD"]]
        for e in eps:
            rows.append([e["address"], s.good("yes") if e["ready"] else s.bad("no"),
                         e["node"] or "-", e["zone"] or "-", e["pod"] or "-"])
        lines += _table(rows)
    return "\n".join(lines) + "\n"
