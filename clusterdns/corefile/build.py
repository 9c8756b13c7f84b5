"""A Corefile made ready to serve: every block's plugins set up (FILE:LINE errors), the
listeners and which block each zone goes to on each, and the process-wide settings
(health, ready, metrics addresses, lameduck, reload) the agent's listeners take.

    cf = load_corefile("/etc/coredns/Corefile", cfg)
    cf.listeners            # {(host, port): runtime.Listener}
    cf.update(state)        # every kubernetes engine and plugin follows the state
    print(cf.describe())    # `clusterdns config check`

A node-local-dns Corefile (its __PILLAR__ placeholders, filled as node-cache fills
them) forwards the cluster zones to the cluster DNS: that forward is answered in
this process. With the cluster DNS's own Corefile (--cluster-corefile, the
coredns ConfigMap) the query runs that Corefile's chain (its block on the port
forwarded to: kubernetes, hosts, rewrite... as CoreDNS would answer it), whose
listeners are not bound; without it, an implicit kubernetes plugin with the flags'
settings answers, then the node's upstreams (what the cluster DNS itself would do).
"""
from __future__ import annotations

import hashlib
import logging
import os
import socket
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..config import Config
from . import registry
from .plugin import Plugin, SetupContext, fqdn
from .runtime import Block, Listener
from .syntax import CorefileError, Directive, ServerBlock, Token

log = logging.getLogger(__name__)

# What a forward to the cluster DNS looks like once node-cache's placeholders are filled.
IN_PROCESS = "clusterdns:state"


@dataclass
class Corefile:
    path: str
    blocks: list[Block]
    listeners: dict[tuple[str, int], Listener]
    digest: str
    health_listen: str = ""
    lameduck: float | None = None
    ready_listen: str = ""
    metrics_listen: str = ""
    reload: tuple[float, float] | None = None
    engines: list[Any] = field(default_factory=list)
    plugins: list[Plugin] = field(default_factory=list)
    keys: dict[int, list[str]] = field(default_factory=dict)     # id(block) -> its keys, as written
    cluster: "Corefile | None" = None     # --cluster-corefile: what the forwards to the cluster DNS run

    @property
    def synced(self) -> bool:
        return all(e.synced for e in self.engines)

    def update(self, state) -> None:
        for e in self.engines:
            e.update(state)
        for p in self.plugins:
            p.on_state(state)

    async def start(self) -> None:
        for p in self.plugins:
            await p.start()

    def wait_loaded(self) -> None:
        """Block until every plugin's data is read (a big hosts file is read in the background
        and its block's queries wait for it): a reload swaps in a Corefile ready to answer."""
        for p in self.plugins:
            wait = getattr(p, "wait_loaded", None)
            if wait is not None:
                wait()

    async def stop(self) -> None:
        for p in self.plugins:
            try:
                await p.stop()
            except Exception:
                log.exception("stopping plugin %s failed", p.name)

    def describe(self) -> str:
        out = [f"Corefile {self.path}"]
        for b in self.blocks:
            where = [f"{h}:{p}" if ":" not in h else f"[{h}]:{p}"
                     for (h, p), li in self.listeners.items() if b in li.blocks.values()]
            out.append(f"server block {b.where}: zones {' '.join(b.zones)} on {', '.join(where) or '(none)'}")
            if not b.plugins:
                out.append("  (no plugins: every query REFUSED)")
            for i, line in enumerate(b.describe(), 1):
                out.append(f"  {i}. {line}")
        settings = [("health", self.health_listen), ("ready", self.ready_listen),
                    ("metrics", self.metrics_listen)]
        out.append("process: " + ", ".join(f"{k} {v or 'off'}" for k, v in settings)
                   + (f", lameduck {self.lameduck:g}s" if self.lameduck else "")
                   + (f", reload every {self.reload[0]:g}s" if self.reload else ", no reload"))
        if self.cluster is not None:
            out.append(f"cluster DNS (answered in this process, its listeners not bound; its health, ready "
                       f"and prometheus not served): {self.cluster.describe()}")
        return "\n".join(out)


def load_corefile(path: str, cfg: Config, env: Mapping[str, str] | None = None,
                  dns_server: str | None = None) -> Corefile:
    """Read, fill node-cache's placeholders when there are any, set up; CorefileError on any fault.
    With cfg.dns.cluster_corefile, that Corefile is set up first: the forwards to the cluster DNS run it."""
    env = os.environ if env is None else env
    cluster = None
    domain = cfg.dns.cluster_domain
    if cfg.dns.cluster_corefile:
        cpath = cfg.dns.cluster_corefile
        cluster = build(_read(cpath, cfg, env, None, domain), cfg, path=cpath, env=env)
        zones = [z for b in cluster.blocks if b.kube is not None for z in b.kube.zones]  # type: ignore[attr-defined]
        if not zones:
            raise CorefileError("", f"--cluster-corefile {cpath}: no kubernetes plugin (the cluster DNS's "
                                    "Corefile, the coredns ConfigMap, is meant)")
        domain = next((z for z in zones if not z.endswith("arpa.")), zones[0]).rstrip(".") or domain
    cf = build(_read(path, cfg, env, dns_server, domain), cfg, path=path, env=env, dns_server=dns_server, cluster=cluster)
    return cf


def _read(path: str, cfg: Config, env: Mapping[str, str], dns_server: str | None, domain: str) -> list[ServerBlock]:
    from . import parse
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as exc:
        raise CorefileError("", f"{path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise CorefileError("", f"{path}: not UTF-8 text") from None
    if "__PILLAR__" in text:
        text = _fill_pillars(text, cfg, dns_server, path, domain)
    return parse.parse_text(text, filename=path, env=env, base_dir=os.path.dirname(os.path.abspath(path)))


def prepare(cfg: Config, dns_server: str | None = None) -> tuple[Corefile, Config]:
    """cfg.dns.corefile loaded and checked against the flags given beside it; the config the
    process's listeners take from it (health, ready, metrics addresses, lameduck)."""
    cf = load_corefile(cfg.dns.corefile, cfg, dns_server=dns_server)
    if cf.cluster is not None or any(b.kube is not None and not getattr(b.kube, "implicit", False)
                                     for b in cf.blocks):
        for name in cfg.dns.corefile_flags:
            flag = "--" + ("zone" if name == "zones" else name.replace("_", "-"))
            raise CorefileError("", f"{flag}: with --corefile the Corefile's kubernetes plugin says this; "
                                    "remove the flag")
    listen = tuple(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in cf.listeners)
    agent: dict[str, Any] = {"listen": listen, "health_listen": _listen(cf.health_listen) or "none",
             "ready_listen": ",".join(_listen(a) for a in cf.ready_listen.split(",") if a),
             "metrics_listen": _listen(cf.metrics_listen) or "none"}
    if cf.lameduck is not None:
        agent["lameduck"] = cf.lameduck
    return cf, cfg.with_options(**agent)


def _listen(addr: str) -> str:
    """CoreDNS's `:8080` (every address) as the listeners take it."""
    return "0.0.0.0" + addr if addr.startswith(":") else addr


def _fill_pillars(text: str, cfg: Config, dns_server: str | None, path: str, domain: str) -> str:
    from . import pillars
    upstream = " ".join(cfg.dns.upstream) if cfg.dns.upstream else cfg.dns.resolv_conf
    try:
        return pillars.fill(text, local_ips=list(cfg.dns.local_ips), dns_server=dns_server,
                            cluster_domain=domain, upstream=upstream, cluster_dns=None)
    except CorefileError:
        raise
    except ValueError as exc:
        raise CorefileError("", f"{path}: {exc}") from None


def _digest(blocks: list[ServerBlock]) -> str:
    h = hashlib.sha512()

    def add(d: Directive) -> None:
        h.update(repr((d.name, [t.text for t in d.args], d.body is None)).encode())
        for line in d.lines():
            add(line)
    for b in blocks:
        h.update(repr([t.text for t in b.keys]).encode())
        for d in b.directives:
            add(d)
    return h.hexdigest()


def build(blocks: list[ServerBlock], cfg: Config, *, path: str = "Corefile", env: Mapping[str, str] | None = None,
          dns_server: str | None = None, cluster: Corefile | None = None) -> Corefile:
    from .keys import check_duplicates, parse_keys
    env = os.environ if env is None else env
    built: list[Block] = []
    placed: dict[tuple[str, int], dict[str, Block]] = {}
    bound_ports: dict[int, set[bool]] = {}
    cf = Corefile(path=path, blocks=built, listeners={}, digest=_digest(blocks))
    engines: dict[tuple, Any] = {}
    parsed = []
    for sb in blocks:
        keys = parse_keys(sb)
        for k in keys:
            if k.scheme != "dns":
                raise CorefileError(k.token, f"{k.scheme}:// servers are not supported (only dns://)")
        zones = list(dict.fromkeys(k.zone for k in keys))
        plugins, binds = _setup_block(sb, zones, cfg, path, env, dns_server, cluster)
        parsed.append((sb, keys, zones, plugins, binds))
    # CoreDNS's startup check, on the addresses bind resolved to (interface names included)
    check_duplicates([(keys, binds) for _sb, keys, _z, _p, binds in parsed])
    for sb, keys, zones, plugins, binds in parsed:
        for p in plugins:
            if p.name == "kubernetes":
                _engine_for(p, engines, cf)
        block = Block(zones, plugins, where=sb.where, server=f"dns://:{keys[0].port}" if keys else "")
        built.append(block)
        cf.keys[id(block)] = [t.text for t in sb.keys]
        for k in keys:
            bound_ports.setdefault(k.port, set()).add(bool(binds))
            if len(bound_ports[k.port]) > 1:
                raise CorefileError(k.token, f"blocks on port {k.port} must all use bind or none "
                                             "(a block without bind would receive nothing or random traffic)")
            for host in binds or _wildcards():
                placed.setdefault((host, k.port), {})[k.zone] = block
        _process_settings(cf, plugins)
    cf.listeners = {hp: Listener(hp[0], hp[1], zmap, cfg.dns.udp_size) for hp, zmap in placed.items()}
    seen: set[int] = set()
    for b in built:
        for p in b.plugins:
            if id(p) not in seen:
                seen.add(id(p))
                cf.plugins.append(p)
    cf.engines = list(engines.values())
    if cluster is not None:
        if not any(getattr(p, "hop", None) is not None for p in cf.plugins):
            raise CorefileError("", f"--cluster-corefile {cluster.path}: {path} forwards nothing to the cluster "
                                    "DNS (a node-local-dns Corefile's __PILLAR__CLUSTER__DNS__ or the kube-dns "
                                    "Service's address)")
        cf.cluster = cluster
        cf.engines += cluster.engines
        cf.plugins += [p for p in cluster.plugins if p not in cf.plugins]
        cf.digest = hashlib.sha512((cf.digest + cluster.digest).encode()).hexdigest()
    return cf


def _wildcards() -> list[str]:
    """Where a block without bind listens: every address, IPv4 and IPv6, as CoreDNS's `:53`
    (one dual-stack socket there; here one socket per family, each replying from the
    address asked). IPv4 alone where the kernel has no IPv6."""
    if not socket.has_ipv6:
        return ["0.0.0.0"]
    try:
        socket.socket(socket.AF_INET6, socket.SOCK_DGRAM).close()
    except OSError:
        return ["0.0.0.0"]
    return ["0.0.0.0", "::"]


def _engine_for(kube: Any, engines: dict[tuple, Any], cf: Corefile) -> None:
    from ..dns.engine import Engine
    from .plugins.kubernetes import tail_query
    key = kube.config_key()
    engine = engines.get(key)
    if engine is None:
        engine = engines[key] = Engine(kube.cfg, tail_query(kube), server_addresses=lambda: _addresses(cf))
    kube.engine = engine


def _addresses(cf: Corefile) -> list[str]:
    from ..dns.server import interface_addresses
    out: list[str] = []
    for host, _port in cf.listeners:
        out += interface_addresses() if host in ("0.0.0.0", "::") else [host]
    return list(dict.fromkeys(a for a in out if ":" not in a or not a.startswith("fe80")))


def _setup_block(sb: ServerBlock, zones: list[str], cfg: Config, path: str, env: Mapping[str, str],
                 dns_server: str | None, cluster: Corefile | None = None) -> tuple[list[Plugin], list[str]]:
    counts: dict[str, Directive] = {}
    directives: list[Directive] = []
    for d in sb.directives:
        name = d.name.lower()
        if not registry.available(name):
            if name in registry.KNOWN_ELSEWHERE or name in registry.SUPPORTED:
                raise CorefileError(d, f"plugin '{d.name}' is not supported by clusterdns")
            raise CorefileError(d, f"Unknown directive '{d.name}'")
        if name in registry.ONCE and name in counts:
            raise CorefileError(d, f"plugin/{name}: this plugin can only be used once per Server Block "
                                   f"(the first is at {counts[name].where})")
        counts.setdefault(name, d)
        directives.append(d)
    base_dir = os.path.dirname(os.path.abspath(path)) if path else "."
    ctx = SetupContext(zones=zones, corefile=path, base_dir=base_dir, cfg=cfg, env=env)
    plugins: list[tuple[int, int, Plugin]] = []
    # kubernetes first: its zones are the state zones other plugins (cache) must know
    kube_d = counts.get("kubernetes")
    implicit = [d for d in directives if d.name.lower() == "forward" and _to_cluster_dns(d, dns_server)]
    if kube_d is not None:
        kube = registry.setup_for("kubernetes")(kube_d, ctx)
        ctx.state_zones = list(kube.zones)     # type: ignore[attr-defined]
        plugins.append((registry.rank("kubernetes"), 0, kube))
    elif implicit and cluster is not None:
        ctx.state_zones = [z for b in cluster.blocks if b.kube is not None for z in b.kube.zones]  # type: ignore[attr-defined]
    elif implicit:
        kube = _implicit_kubernetes(implicit[0], ctx, cfg)
        ctx.state_zones = list(kube.zones)     # type: ignore[attr-defined]
        plugins.append((registry.rank("kubernetes"), 0, kube))
    autopath = None
    for i, d in enumerate(directives):
        name = d.name.lower()
        if name == "kubernetes":
            continue
        if d in implicit and cluster is not None:
            from .inprocess import setup_hop
            plugins.append((registry.rank(name), i, setup_hop(d, cluster)))
            continue
        if d in implicit:
            d = _node_upstream_forward(d, cfg)
        p = registry.setup_for(name)(d, ctx)
        if name == "autopath":
            autopath = p
        plugins.append((registry.rank(name), i, p))
    plugins.sort(key=lambda t: (t[0], t[1]))
    ordered = [p for _r, _i, p in plugins]
    if autopath is not None:
        kubes = [p for p in ordered if p.name == "kubernetes"]
        if not kubes:
            raise CorefileError(autopath.where, "plugin/autopath: @kubernetes needs the kubernetes plugin "  # type: ignore[attr-defined]
                                                "in the same block")
        k = kubes[0]
        k.cfg = k.cfg.with_options(autopath=True)         # type: ignore[attr-defined]
    binds: list[str] = []
    for p in ordered:
        if p.name == "bind":
            binds += [a for a in p.addresses if a not in binds]     # type: ignore[attr-defined]
    return ordered, binds


def _to_cluster_dns(d: Directive, dns_server: str | None) -> bool:
    """A forward to the cluster DNS (node-local-dns's __PILLAR__CLUSTER__DNS__, or the kube-dns
    Service's ClusterIP), answered in-process instead of a second hop."""
    to = [t.text for t in d.args[1:]]
    return bool(to) and all(t == IN_PROCESS or (dns_server and t.split(":")[0] == dns_server) for t in to)


def _implicit_kubernetes(d: Directive, ctx: SetupContext, cfg: Config) -> Plugin:
    """The cluster DNS's kubernetes plugin, as kubeadm's Corefile has it, from the flags."""
    from .plugins.kubernetes import Kubernetes
    zones = [fqdn(z) for z in cfg.dns.zones]
    fall = cfg.dns.fallthrough
    if fall is None:     # kubeadm's: reverse names that are not the cluster's go upstream
        fall = tuple(z.rstrip(".") for z in zones if z.endswith("arpa."))
    kube = Kubernetes(zones, {"fallthrough": fall}, cfg, d.where)
    kube.implicit = True     # type: ignore[attr-defined]
    return kube


def _node_upstream_forward(d: Directive, cfg: Config) -> Directive:
    """The forward after the in-process cluster DNS: the node's upstreams (--upstream, else
    --resolv-conf), with the directive's own options (force_tcp...) dropped: they were for
    the hop to the cluster DNS."""
    to = [Token(u, d.file, d.line) for u in (cfg.dns.upstream or (cfg.dns.resolv_conf,))]
    return Directive("forward", [Token(".", d.file, d.line)] + to, None, d.file, d.line)


def _process_settings(cf: Corefile, plugins: list[Plugin]) -> None:
    for p in plugins:
        where = getattr(p, "where", "")
        if p.name == "health":
            listen, lameduck = p.listen, p.lameduck         # type: ignore[attr-defined]
            if cf.health_listen and (cf.health_listen != listen or cf.lameduck != lameduck):
                raise CorefileError(where, f"plugin/health: a second health address or lameduck ({listen}); "
                                           f"the first is {cf.health_listen}: health is process-wide")
            cf.health_listen, cf.lameduck = listen, lameduck
        elif p.name == "ready":
            # one /ready per address (blocks naming one address share it)
            have = cf.ready_listen.split(",") if cf.ready_listen else []
            if p.listen not in have:                                # type: ignore[attr-defined]
                cf.ready_listen = ",".join(have + [p.listen])      # type: ignore[attr-defined]
        elif p.name == "prometheus":
            if cf.metrics_listen and cf.metrics_listen != p.listen:  # type: ignore[attr-defined]
                raise CorefileError(where, f"plugin/prometheus: a second address ({p.listen}); "  # type: ignore[attr-defined]
                                           f"the first is {cf.metrics_listen}: the metrics are one registry here")
            cf.metrics_listen = p.listen                            # type: ignore[attr-defined]
        elif p.name == "reload":
            interval, jitter = p.interval, p.jitter                 # type: ignore[attr-defined]
            if cf.reload is None or interval < cf.reload[0]:
                cf.reload = (interval, jitter)
