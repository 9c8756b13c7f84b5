"""Configuration: command-line flags, an optional YAML file with the same keys, defaults.

Precedence: flag > environment (NODE_NAME only) > --config file > default.
Everything is validated once into a frozen Config made of sections, one per
part of the process: `source` (where the state comes from), `dns` (the
server), `proxy` (the proxier), `agent` (lifecycle, logging, the health and
metrics listeners) and `run` (what a one-shot command does). Each option lives
in exactly one section, under the name its flag and YAML key have (`--ttl` and
`ttl:` are `cfg.dns.ttl`); a reload restarts the components whose section
changed (agent.py). A bad value is a ConfigError, which the CLI turns into exit
code 2 with a one-line reason.

A new option: a field in its section, a flag in _add_common (or the command's
parser), and a check in _validate when it has a range.
"""
from __future__ import annotations

import argparse
import ipaddress
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from . import kpconfig
from .errors import ConfigError

COMMANDS = ("agent", "dns", "proxy", "rules", "trace", "corefile", "config")
PROXY_MODES = ("iptables", "nftables", "ipvs", "none")
POD_MODES = ("disabled", "insecure", "verified")
CONFIG_KIND = "ClusterDNSConfiguration"
# node name, node IPs, cluster CIDRs, service CIDRs of the embedded demo cluster (clusterdns/demo/cluster.yaml)
DEMO_NODE = ("node-a", ("192.168.49.2",), ("10.161.0.0/16",), ("172.20.0.0/16",))


@dataclass(frozen=True)
class SourceConfig:
    """Where the cluster state comes from."""
    manifest: tuple[str, ...] = ()
    kubeconfig: str = ""
    demo: bool = False                     # no source given: the embedded demo cluster
    manifest_max_bytes: int = 256 * 1024 * 1024   # a bigger manifest file is refused
    manifest_max_objects: int = 1_000_000         # objects in one manifest file
    manifest_allow_shrink: bool = False           # accept a reload that empties a file or loses most objects


@dataclass(frozen=True)
class DnsConfig:
    """The DNS server: what it answers, where it listens, where it forwards."""
    listen: tuple[str, ...] = ()           # empty: derived, see Config.listen_addresses()
    local_ips: tuple[str, ...] = ()        # addresses held on a local device (NodeLocal-style) and listened on
    zones: tuple[str, ...] = ("cluster.local", "in-addr.arpa", "ip6.arpa")
    ttl: int = 5
    pods: str = "insecure"
    upstream: tuple[str, ...] = ()         # empty: nameservers of resolv_conf
    no_upstream: bool = False
    resolv_conf: str = "/etc/resolv.conf"
    namespaces: tuple[str, ...] = ()
    namespace_labels: str = ""
    endpoint_pod_names: bool = False
    noendpoints: bool = False
    ignore_empty_service: bool = False
    fallthrough: tuple[str, ...] | None = None   # None: off; (): every zone
    transfer: bool = False
    autopath: bool = False
    cache_size: int = 9984
    cache_max_ttl: int = 30
    cache_min_ttl: int = 5
    udp_size: int = 1232
    workers: int = 1                       # UDP receive threads per listen address (SO_REUSEPORT)
    tcp_max_connections: int = 1024        # open DNS TCP connections; beyond, the oldest idle is closed
    memo_size: int = 100_000               # prebuilt answers of names asked again, per state version
    memo_probation: int = 20_000           # prebuilt answers of names asked once so far
    corefile: str = ""                     # a CoreDNS / node-local-dns Corefile: what DNS serves, and where
    corefile_flags: tuple[str, ...] = ()   # the DNS flags given beside --corefile (checked against it)
    cluster_corefile: str = ""             # the cluster DNS's Corefile a node-local one's forwards reach

    @property
    def cluster_domain(self) -> str:
        return self.zones[0]


@dataclass(frozen=True)
class ConntrackConfig:
    """The conntrack sysctls written at start, as kube-proxy writes them (proxy/sysctl.py);
    kube-proxy's defaults. 0 leaves that sysctl alone (max_per_core 0: nf_conntrack_max and min)."""
    max_per_core: int = 32768
    min: int = 131072
    tcp_established_timeout: int = 86400   # whole seconds
    tcp_close_wait_timeout: int = 3600
    tcp_be_liberal: bool = False           # False never resets the sysctl
    udp_timeout: int = 0
    udp_stream_timeout: int = 0


@dataclass(frozen=True)
class ProxyConfig:
    """The proxier and the node it programs."""
    node_name: str = ""
    node_ips: tuple[str, ...] = ()
    cluster_cidrs: tuple[str, ...] = ()
    service_cidrs: tuple[str, ...] = ()
    masquerade_all: bool = False
    masquerade_bit: int = 14
    nodeport_addresses: tuple[str, ...] = ()
    localhost_nodeports: bool = True
    proxy_mode: str = "iptables"
    apply: bool | None = None              # None: apply unless demo (Config.applying)
    ip_family: str = ""                    # rules: ipv4|ipv6; empty = family of first node IP
    sync_period: float = 30.0
    min_sync_period: float = 1.0
    proxy_config: str = ""                 # kube-proxy's config file (kpconfig.py)
    detect_local_mode: str = ""            # "" / ClusterCIDR: --cluster-cidr
    pod_bridge_interface: str = ""
    pod_interface_name_prefix: str = ""
    ipvs_scheduler: str = "rr"
    ipvs_exclude_cidrs: tuple[str, ...] = ()
    ipvs_strict_arp: bool = False
    conntrack: ConntrackConfig | None = None   # None: conntrack sysctls left alone
    oom_score_adj: int | None = None

    @property
    def family(self) -> int:
        """4 or 6: the family `rules` prints."""
        if self.ip_family:
            return 6 if self.ip_family == "ipv6" else 4
        if self.node_ips:
            return ipaddress.ip_address(self.node_ips[0]).version
        return 4


@dataclass(frozen=True)
class AgentConfig:
    """The process: shutdown, logging, the configuration file, health and metrics listeners."""
    lameduck: float = 5.0
    lameduck_handover: float = 20.0        # lameduck goes on until a successor listens, up to this
    metrics_listen: str = "127.0.0.1:9153"
    proxy_metrics_listen: str = "127.0.0.1:10249"   # kube-proxy's metrics address
    proxy_health_listen: str = ""          # kube-proxy's healthz address; "": /healthz on health_listen
    bind_address_hard_fail: bool = False   # kube-proxy's: the healthz/metrics listeners must bind, not retry
    health_listen: str = "127.0.0.1:8080"
    ready_listen: str = ""                 # /ready on its own address (a Corefile's `ready`); "": with health
    config_file: str = ""
    loop: str = "auto"
    log_level: str = "info"


@dataclass(frozen=True)
class RunConfig:
    """What a one-shot command does (rules, trace, proxy --cleanup); never reloaded."""
    cleanup: bool = False
    mode: str = ""
    name: str = ""
    from_pod: str = ""
    trace_resolv_conf: str = ""
    json: bool = False
    from_kube_dns: str = ""                # corefile: the kube-dns ConfigMap to translate
    cluster_domain: str = "cluster.local"  # corefile: the domain its Corefile serves
    action: str = ""                       # config: what to do (check)


SECTIONS: dict[str, type] = {"source": SourceConfig, "dns": DnsConfig, "proxy": ProxyConfig,
                             "agent": AgentConfig, "run": RunConfig}
# option name (the flag's and YAML key's, dashes as underscores) -> its section
OPTION_SECTION: dict[str, str] = {f.name: s for s, cls in SECTIONS.items() for f in fields(cls)}


@dataclass(frozen=True)
class Config:
    command: str = "agent"
    source: SourceConfig = field(default_factory=SourceConfig)
    dns: DnsConfig = field(default_factory=DnsConfig)
    proxy: ProxyConfig = field(default_factory=ProxyConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    run: RunConfig = field(default_factory=RunConfig)

    @classmethod
    def from_options(cls, command: str = "agent", **options: Any) -> Config:
        """A Config from options named as the flags are (`ttl=3`, `node_ips=(...)`), unvalidated."""
        return cls(command=command).with_options(**options)

    def with_options(self, **options: Any) -> Config:
        """A copy with these options (flag names) changed, each in its own section."""
        by_section: dict[str, dict[str, Any]] = {}
        for name, value in options.items():
            section = OPTION_SECTION.get(name)
            if section is None:
                raise TypeError(f"unknown option {name!r}")
            by_section.setdefault(section, {})[name] = value
        return replace(self, **{s: replace(getattr(self, s), **v) for s, v in by_section.items()})

    def options(self) -> dict[str, Any]:
        """Every option by its flag name (the inverse of from_options)."""
        return {f.name: getattr(getattr(self, s), f.name) for s, cls in SECTIONS.items() for f in fields(cls)}

    @property
    def applying(self) -> bool:
        """The proxier (and local DNS addresses) change the kernel: --apply, or not the demo."""
        return (not self.source.demo) if self.proxy.apply is None else self.proxy.apply

    def listen_addresses(self) -> list[tuple[str, int]]:
        """The (host, port) pairs the DNS server binds."""
        if self.dns.listen:
            return [parse_hostport(x, 53) for x in self.dns.listen]
        if self.dns.local_ips:
            return [(ip, 53) for ip in self.dns.local_ips]
        if self.source.demo:
            return [("127.0.0.1", 5353)]
        return [("0.0.0.0", 53)]


def parse_hostport(text: str, default_port: int) -> tuple[str, int]:
    """HOST:PORT, [V6]:PORT, HOST, or :PORT (all addresses)."""
    text = text.strip()
    host, port = text, str(default_port)
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise ConfigError(f"bad address {text!r}: missing ']'")
        host, rest = text[1:end], text[end + 1:]
        if rest:
            if not rest.startswith(":"):
                raise ConfigError(f"bad address {text!r}")
            port = rest[1:]
    elif text.count(":") == 1:
        host, port = text.split(":")
    elif text.count(":") > 1:
        host = text  # a bare IPv6 address
    host = host or "0.0.0.0"
    try:
        ipaddress.ip_address(host)
    except ValueError:
        if host != "localhost":
            raise ConfigError(f"bad address {text!r}: {host!r} is not an IP address") from None
        host = "127.0.0.1"
    try:
        number = int(port)
    except ValueError:
        raise ConfigError(f"bad address {text!r}: port {port!r} is not a number") from None
    if not 0 <= number <= 65535:
        raise ConfigError(f"bad address {text!r}: port out of range")
    return host, number


def _add_common(p: argparse.ArgumentParser) -> None:
    S = argparse.SUPPRESS
    a = p.add_argument
    a("--config", dest="config_file", metavar="FILE", default=S, help="YAML file with the same keys as the flags")
    a("--manifest", action="append", metavar="PATH", default=S, help="read state from this file (repeatable)")
    a("--corefile", metavar="FILE", default=S,
      help="serve DNS as this CoreDNS (or node-local-dns) Corefile says (agent, dns)")
    a("--cluster-corefile", metavar="FILE", default=S,
      help="with a node-local-dns --corefile: the cluster DNS's (coredns) Corefile its forwards to the "
           "cluster DNS are answered with, in this process")
    a("--manifest-max-bytes", type=int, metavar="BYTES", default=S,
      help="refuse a manifest file bigger than this (default 256 MiB)")
    a("--manifest-max-objects", type=int, metavar="N", default=S,
      help="refuse a manifest file holding more objects (default 1,000,000)")
    a("--manifest-allow-shrink", action="store_true", default=S,
      help="accept a reloaded manifest that is empty or lost most of its objects")
    a("--kubeconfig", metavar="PATH", default=S, help="read state from a cluster (also KUBECONFIG, in-cluster)")
    a("--listen", action="append", metavar="HOST:PORT", default=S, help="DNS address, UDP and TCP (repeatable)")
    a("--zone", dest="zones", action="append", metavar="ZONE", default=S,
      help="zone served authoritatively (repeatable; first is the cluster domain)")
    a("--ttl", type=int, default=S, help="TTL of cluster records (default 5)")
    a("--pods", choices=POD_MODES, default=S, help="pod records (default insecure)")
    a("--upstream", action="append", metavar="HOST[:PORT]", default=S, help="forwarder (repeatable)")
    a("--no-upstream", action="store_true", default=S, help="answer REFUSED for non-cluster names")
    a("--resolv-conf", dest="resolv_conf", metavar="FILE", default=S,
      help="upstreams from this file (agent/dns); the pod's resolv.conf (trace)")
    a("--namespaces", nargs="+", metavar="NS", default=S, help="serve only these namespaces")
    a("--namespace-labels", metavar="SELECTOR", default=S, help="serve only namespaces matching")
    a("--endpoint-pod-names", action="store_true", default=S)
    a("--noendpoints", action="store_true", default=S)
    a("--ignore-empty-service", action="store_true", default=S)
    a("--fallthrough", nargs="*", metavar="ZONE", default=S)
    a("--transfer", action="store_true", default=S, help="allow AXFR/IXFR over TCP")
    a("--autopath", action="store_true", default=S)
    a("--cache-size", type=int, default=S)
    a("--workers", type=int, default=S, metavar="N",
      help="UDP receive threads per listen address, each on its own SO_REUSEPORT socket (default 1)")
    a("--tcp-max-connections", type=int, default=S, metavar="N",
      help="open DNS TCP connections; a new one closes the oldest idle one (default 1024)")
    a("--memo-size", type=int, default=S, metavar="N",
      help="prebuilt answers kept for names asked more than once, least recently used dropped (default 100000)")
    a("--memo-probation", type=int, default=S, metavar="N",
      help="prebuilt answers kept for names asked once so far (default 20000)")
    a("--node-name", default=S)
    a("--node-ip", dest="node_ips", action="append", metavar="IP", default=S)
    a("--cluster-cidr", dest="cluster_cidrs", action="append", metavar="CIDR", default=S)
    a("--service-cidr", dest="service_cidrs", action="append", metavar="CIDR", default=S)
    a("--masquerade-all", action="store_true", default=S)
    a("--masquerade-bit", type=int, default=S)
    a("--nodeport-addresses", action="append", metavar="CIDR", default=S)
    a("--no-localhost-nodeports", dest="localhost_nodeports", action="store_false", default=S)
    a("--proxy-mode", choices=PROXY_MODES, default=S)
    a("--apply", dest="apply", action="store_true", default=S, help="apply rules")
    a("--dry-run", dest="apply", action="store_false", default=S, help="print rules instead of applying")
    a("--ip-family", choices=("ipv4", "ipv6"), default=S)
    a("--sync-period", type=float, default=S)
    a("--min-sync-period", type=float, default=S)
    a("--local-ip", dest="local_ips", action="append", metavar="IP", default=S)
    a("--lameduck", type=float, default=S, metavar="SECONDS")
    a("--lameduck-handover", type=float, default=S, metavar="SECONDS",
      help="after --lameduck, keep answering until another process listens on the DNS "
           "addresses, up to this many seconds after the signal; 0 disables")
    a("--metrics-listen", default=S, metavar="HOST:PORT", help="coredns_* metrics; 'none' disables")
    a("--proxy-metrics-listen", default=S, metavar="HOST:PORT",
      help="kubeproxy_* and rest_client_* metrics (kube-proxy's 127.0.0.1:10249); 'none' disables")
    a("--health-listen", default=S, metavar="HOST:PORT", help="'none' disables")
    a("--ready-listen", default=S, metavar="HOST:PORT",
      help="/ready on addresses of its own, comma-separated (CoreDNS's ready :8181); default: with --health-listen")
    a("--loop", choices=("auto", "asyncio", "uvloop"), default=S)
    a("--log-level", choices=("debug", "info", "warning", "error"), default=S)


class _Version(argparse.Action):
    """--version: computed only when asked (it may run git), not at every parse."""

    def __init__(self, option_strings: list[str], dest: str, help: str | None = None) -> None:
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, nargs=0, help=help)

    def __call__(self, parser: argparse.ArgumentParser, *_args: Any) -> None:
        from .version import text
        try:
            print(text(), flush=True)
        except BrokenPipeError:     # `clusterdns --version | head -1`: the reader has gone
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        parser.exit(0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="clusterdns", description="Cluster DNS and Service proxy node agent.")
    parser.add_argument("--version", action=_Version, help="print the version and the git revision, and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    helps = {
        "agent": "the node agent: DNS, proxier and watch",
        "dns": "DNS only",
        "proxy": "proxier only",
        "rules": "print the rules the proxier would apply, and exit",
        "trace": "follow one name through DNS and the rules",
        "corefile": "print the Corefile a kube-dns ConfigMap translates to, and exit",
        "config": "check a configuration (--corefile, --proxy-config) and print what it makes effective",
    }
    for name in COMMANDS:
        p = sub.add_parser(name, help=helps[name], description=helps[name])
        if name == "corefile":   # reads one file, no cluster state: none of the shared flags
            p.add_argument("--from-kube-dns", metavar="FILE", default=argparse.SUPPRESS,
                           help="the kube-dns ConfigMap (YAML, the object or its data; - for stdin)")
            p.add_argument("--cluster-domain", metavar="DOMAIN", default=argparse.SUPPRESS,
                           help="the cluster domain (default cluster.local)")
            continue
        _add_common(p)
        if name in ("agent", "proxy", "rules", "config"):
            kpconfig.add_flags(p)
        if name == "proxy":
            p.add_argument("--cleanup", action="store_true", default=argparse.SUPPRESS,
                           help="remove everything clusterdns installed, and exit")
        if name == "rules":
            p.add_argument("--mode", choices=PROXY_MODES[:3], default=argparse.SUPPRESS)
        if name == "config":
            p.add_argument("action", choices=("check",), metavar="check")
        if name == "trace":
            p.add_argument("name", metavar="NAME")
            p.add_argument("--from-pod", metavar="NS/POD", default=argparse.SUPPRESS)
            p.add_argument("--json", action="store_true", default=argparse.SUPPRESS)
    return parser


_FIELDS = {f.name: f for cls in SECTIONS.values() for f in fields(cls)}
_TUPLES = {n for n, f in _FIELDS.items() if str(f.type).startswith("tuple")}


def _from_file(path: str) -> dict[str, Any]:
    # only for --config: PyYAML's import costs ~20 ms of every command's start
    import yaml
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh) or {}
    except OSError as exc:
        raise ConfigError(f"{path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        raise ConfigError(f"{path}:{mark.line + 1 if mark else '?'}: invalid YAML") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of options")
    data = {k: v for k, v in data.items() if k not in ("apiVersion", "kind")}
    aliases = {"zone": "zones", "node_ip": "node_ips", "cluster_cidr": "cluster_cidrs",
               "service_cidr": "service_cidrs", "local_ip": "local_ips"}
    out = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        name = aliases.get(name, name)
        if name not in _FIELDS or name in ("demo", "config_file", "name", "from_kube_dns", "cluster_domain",
                                           "conntrack"):
            raise ConfigError(f"{path}: unknown option {key!r}")
        out[name] = value
    return out


def _coerce(values: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for name, value in values.items():
        if name in _TUPLES and value is not None:
            value = tuple(value) if isinstance(value, (list, tuple)) else (value,)
            value = tuple(str(v) for v in value)
        out[name] = value
    return out


def _validate(cfg: Config) -> Config:
    def err(msg: str) -> None:
        raise ConfigError(msg)

    src, dns, proxy, agent = cfg.source, cfg.dns, cfg.proxy, cfg.agent
    if not 0 <= dns.ttl <= 3600:
        err(f"--ttl {dns.ttl}: must be between 0 and 3600")
    if not isinstance(src.manifest_max_bytes, int) or src.manifest_max_bytes < 1:
        err(f"--manifest-max-bytes {src.manifest_max_bytes}: must be a positive number of bytes")
    if not isinstance(src.manifest_max_objects, int) or src.manifest_max_objects < 1:
        err(f"--manifest-max-objects {src.manifest_max_objects}: must be a positive number")
    if dns.pods not in POD_MODES:
        err(f"--pods {dns.pods!r}: must be one of {', '.join(POD_MODES)}")
    if proxy.proxy_mode not in PROXY_MODES:
        err(f"--proxy-mode {proxy.proxy_mode!r}: must be one of {', '.join(PROXY_MODES)}")
    if not dns.zones:
        err("--zone: at least one zone is needed")
    zones = tuple(z.strip(".").lower() + "" for z in dns.zones)
    if any(not z for z in zones):
        err("--zone: the root zone cannot be served authoritatively")
    for x in dns.listen:
        parse_hostport(x, 53)
    for x in dns.upstream:
        parse_hostport(x, 53)
    options = cfg.options()
    for name in ("node_ips", "local_ips"):
        for ip in options[name]:
            try:
                ipaddress.ip_address(ip)
            except ValueError:
                err(f"--{name[:-1].replace('_', '-')} {ip!r}: not an IP address")
    for name in ("cluster_cidrs", "service_cidrs", "nodeport_addresses"):
        for c in options[name]:
            if name == "nodeport_addresses" and c in ("primary", "all"):
                continue
            try:
                ipaddress.ip_network(c, strict=False)
            except ValueError:
                err(f"--{name.rstrip('s').replace('_', '-')} {c!r}: not a CIDR")
    if proxy.sync_period <= 0 or proxy.min_sync_period < 0:
        err("--sync-period must be positive and --min-sync-period not negative")
    if not 0 <= proxy.masquerade_bit <= 31:
        err("--masquerade-bit must be between 0 and 31")
    if dns.namespaces and dns.namespace_labels:
        err("--namespaces and --namespace-labels cannot be combined")
    if agent.lameduck < 0 or agent.lameduck_handover < 0:
        err("--lameduck and --lameduck-handover must not be negative")
    if not 1 <= dns.workers <= 64:
        err(f"--workers {dns.workers}: must be between 1 and 64")
    if dns.tcp_max_connections < 1:
        err(f"--tcp-max-connections {dns.tcp_max_connections}: must be at least 1")
    for flag, n in (("--memo-size", dns.memo_size), ("--memo-probation", dns.memo_probation)):
        if not 0 <= n <= 10_000_000:
            err(f"{flag} {n}: must be between 0 and 10000000")
    for name in ("metrics_listen", "proxy_metrics_listen", "health_listen", "ready_listen",
                 "proxy_health_listen"):
        for v in options[name].split(",") if name == "ready_listen" else [options[name]]:
            if v and v != "none":
                parse_hostport(v, 0)
    if cfg.run.from_pod and cfg.run.from_pod.count("/") != 1:
        err(f"--from-pod {cfg.run.from_pod!r}: expected NAMESPACE/POD")
    fall = None if dns.fallthrough is None else tuple(z.strip(".").lower() for z in dns.fallthrough)
    return cfg.with_options(zones=zones, fallthrough=fall)


# With --corefile, the Corefile says what these flags would: giving one is an error.
COREFILE_SAYS = {"listen": "bind and the server block keys", "upstream": "forward", "no_upstream": "forward",
                 "cache_size": "cache", "metrics_listen": "prometheus", "health_listen": "health",
                 "ready_listen": "ready",
                 "lameduck": "health { lameduck }", "transfer": "transfer", "autopath": "autopath"}
# ... and these, unless it has no kubernetes plugin (a node-local-dns Corefile: they then
# describe the cluster DNS it forwards to, answered in this process).
KUBERNETES_FLAGS = ("zones", "ttl", "pods", "fallthrough", "namespaces", "namespace_labels",
                    "endpoint_pod_names", "noendpoints", "ignore_empty_service")


def _corefile_flags(values: dict[str, Any]) -> tuple[str, ...]:
    for name, says in COREFILE_SAYS.items():
        if name in values:
            flag = "--" + name.replace("_", "-")
            raise ConfigError(f"{flag}: with --corefile the Corefile says this ({says}); remove the flag")
    return tuple(n for n in KUBERNETES_FLAGS if n in values)


def load(argv: list[str] | None = None, env: Mapping[str, str] | None = None) -> Config:
    """Parse argv into a validated Config; raises ConfigError (SystemExit for --help)."""
    if env is None:
        env = os.environ
    parser = build_parser()
    try:
        ns = parser.parse_args(argv)
    except SystemExit as exc:
        if exc.code == 0:
            raise
        raise ConfigError("bad command line (see the usage above)") from None
    flags = vars(ns)
    command = flags.pop("command", None)
    if not command:
        raise ConfigError("missing command: one of " + ", ".join(COMMANDS))
    values: dict[str, Any] = {}
    if flags.get("config_file"):
        values.update(_from_file(flags["config_file"]))
    if env.get("NODE_NAME"):
        values["node_name"] = env["NODE_NAME"]
    if command == "trace" and "resolv_conf" in flags:
        flags["trace_resolv_conf"] = flags.pop("resolv_conf")
    values.update(flags)
    if values.get("corefile"):
        values["corefile_flags"] = _corefile_flags(values)
    elif values.get("cluster_corefile"):
        raise ConfigError("--cluster-corefile: it names what a node-local-dns Corefile forwards to; "
                          "give that Corefile with --corefile")
    values = kpconfig.apply(values)
    if "fallthrough" in values and values["fallthrough"] is not None:
        values["fallthrough"] = tuple(values["fallthrough"])
    try:
        cfg = Config.from_options(command, **_coerce(values))
    except TypeError as exc:
        raise ConfigError(str(exc)) from None
    for name, v in cfg.options().items():
        kind = _FIELDS[name].type
        if kind in ("int", "float") and (not isinstance(v, (int, float)) or isinstance(v, bool)):
            raise ConfigError(f"{name}: expected a number, got {v!r}")
        if kind == "bool" and not isinstance(v, bool):
            raise ConfigError(f"{name}: expected true or false, got {v!r}")
    src = cfg.source
    kube = src.kubeconfig or env.get("KUBECONFIG", "") or (
        "in-cluster" if env.get("KUBERNETES_SERVICE_HOST") else "")
    demo = not src.manifest and not kube and command != "config"
    cfg = cfg.with_options(kubeconfig="" if src.manifest else kube, demo=demo)
    if demo:
        # The demo cluster's own node, so local endpoints and masquerade rules show.
        px = cfg.proxy
        cfg = cfg.with_options(node_name=px.node_name or DEMO_NODE[0], node_ips=px.node_ips or DEMO_NODE[1],
                               cluster_cidrs=px.cluster_cidrs or DEMO_NODE[2],
                               service_cidrs=px.service_cidrs or DEMO_NODE[3])
    if cfg.proxy.proxy_config and not cfg.proxy.node_name:
        cfg = cfg.with_options(node_name=kpconfig.default_hostname())   # kube-proxy's fallback
    return _validate(cfg)
