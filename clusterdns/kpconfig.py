"""kube-proxy's own configuration file (KubeProxyConfiguration v1alpha1), read as kube-proxy reads it.

`--proxy-config FILE` takes the file kube-proxy's `--config` takes: a bare
KubeProxyConfiguration, or the kube-system/kube-proxy ConfigMap holding one
under `config.conf` (EKS: `config`). The steps are kube-proxy's (1.33-1.35,
see docs/migration.md):

1. decode strictly; on unknown or duplicate fields (case-sensitive, so a
   mis-cased key is unknown) decode again leniently and log ONE warning naming
   each of them; a type error, a missing or wrong kind, an unknown apiVersion
   are fatal;
2. default as v1alpha1 defaulting does (zero -> default; the pointer fields
   keep an explicit 0), then pick the mode's section (sync periods,
   masqueradeAll, masquerade bit) as the v1alpha1 -> internal conversion does,
   then kube-proxy's platform defaults (mode "" -> iptables, detectLocalMode
   "" -> ClusterCIDR, nftables without nodePortAddresses -> [primary]);
3. validate as kube-proxy's validation.go does, each error naming the field
   path of kube-proxy's internal config (`KubeProxyConfiguration.Mode.ProxyMode:
   Invalid value: "x": ...`), joined as kube-proxy's aggregate error is.

`options(kp)` maps the result onto clusterdns's ProxyConfig/AgentConfig
options; `apply(values)` (from config.load) puts them over the flags the way
kube-proxy puts its file over its flags: every proxy flag is ignored beside
the file except the hostname override and logging.
"""
from __future__ import annotations

import argparse
import ipaddress
import logging
import re
import socket
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError

log = logging.getLogger("clusterdns.kpconfig")

GROUP = "kubeproxy.config.k8s.io"
API_VERSION = GROUP + "/v1alpha1"
KIND = "KubeProxyConfiguration"
CONFIGMAP_KEYS = ("config.conf", "config")     # kubeadm's key, EKS's key
ROOT = "KubeProxyConfiguration"
HEALTHZ_PORT = 10256
METRICS_PORT = 10249
SCHEDULERS = ("rr", "wrr", "lc", "wlc", "lblc", "lblcr", "sh", "dh", "sed", "nq")
LOCAL_MODES = ("ClusterCIDR", "NodeCIDR", "BridgeInterface", "InterfaceNamePrefix", "")
# Local-traffic detectors the rule generators do not have: refused, never a rule set without one.
UNSUPPORTED_LOCAL_MODES = {
    "NodeCIDR": "clusterdns does not read the Node's spec.podCIDRs; use ClusterCIDR with clusterCIDR",
}
# ... and those the nftables generator does not have (iptables and ipvs match the input interface)
IFACE_MODES = ("BridgeInterface", "InterfaceNamePrefix")
NFT_IFACE = ("clusterdns's nftables rules match local traffic by source CIDR only; use ClusterCIDR with "
             "clusterCIDR, or mode iptables or ipvs")
# The release whose behaviour is reproduced (showHiddenMetricsForVersion accepts its previous minor).
KUBE_MINOR = (1, 35)


class KubeProxyConfigError(ConfigError):
    """A file kube-proxy would not start with; the message is one line."""


# ------------------------------------------------------------------ the v1alpha1 schema

STR, BOOL, INT32, UINT32, FLOAT, DUR, LIST, GATES, QUANTITY, TIME_OR_DUR, VMODULE = (
    "string", "bool", "int32", "uint32", "float", "duration", "[]string", "map[string]bool",
    "quantity", "duration or nanoseconds", "vmodule")


@dataclass(frozen=True)
class Ptr:
    """A pointer field: null stays None (it is defaulted), 0 stays 0."""
    kind: str


_OUTPUT = {"splitStream": BOOL, "infoBufferSize": QUANTITY}
SCHEMA: dict[str, Any] = {
    "apiVersion": STR, "kind": STR,
    "featureGates": GATES,
    "clientConnection": {"kubeconfig": STR, "acceptContentTypes": STR, "contentType": STR,
                         "qps": FLOAT, "burst": INT32},
    "logging": {"format": STR, "flushFrequency": TIME_OR_DUR, "verbosity": UINT32, "vmodule": VMODULE,
                "options": {"json": dict(_OUTPUT), "text": dict(_OUTPUT)}},
    "hostnameOverride": STR, "bindAddress": STR, "healthzBindAddress": STR, "metricsBindAddress": STR,
    "bindAddressHardFail": BOOL, "enableProfiling": BOOL, "showHiddenMetricsForVersion": STR,
    "mode": STR,
    "iptables": {"masqueradeBit": Ptr(INT32), "masqueradeAll": BOOL, "localhostNodePorts": Ptr(BOOL),
                 "syncPeriod": DUR, "minSyncPeriod": DUR},
    "ipvs": {"syncPeriod": DUR, "minSyncPeriod": DUR, "scheduler": STR, "excludeCIDRs": LIST,
             "strictARP": BOOL, "tcpTimeout": DUR, "tcpFinTimeout": DUR, "udpTimeout": DUR},
    "nftables": {"masqueradeBit": Ptr(INT32), "masqueradeAll": BOOL, "syncPeriod": DUR, "minSyncPeriod": DUR},
    "winkernel": {"networkName": STR, "sourceVip": STR, "enableDSR": BOOL, "rootHnsEndpointName": STR,
                  "forwardHealthCheckVip": BOOL},
    "detectLocalMode": STR,
    "detectLocal": {"bridgeInterface": STR, "interfaceNamePrefix": STR},
    "clusterCIDR": STR,
    "nodePortAddresses": LIST,
    "oomScoreAdj": Ptr(INT32),
    "conntrack": {"maxPerCore": Ptr(INT32), "min": Ptr(INT32), "tcpEstablishedTimeout": Ptr(DUR),
                  "tcpCloseWaitTimeout": Ptr(DUR), "tcpBeLiberal": BOOL, "udpTimeout": DUR,
                  "udpStreamTimeout": DUR},
    "configSyncPeriod": DUR,
    "portRange": STR,
    "windowsRunAsService": BOOL,
}


# ------------------------------------------------------------------ Go durations

_UNITS = {"ns": 1, "us": 1_000, "µs": 1_000, "μs": 1_000, "ms": 1_000_000, "s": 10**9,
          "m": 60 * 10**9, "h": 3600 * 10**9}
_DUR_PART = re.compile(r"([0-9]*)(?:\.([0-9]*))?([^0-9.]+)")


def parse_duration(text: str) -> int:
    """Go's time.ParseDuration, in nanoseconds ("0" alone needs no unit); ValueError otherwise."""
    s, neg = text, False
    if s[:1] in ("+", "-"):
        neg, s = s[0] == "-", s[1:]
    if s == "0":
        return 0
    if not s:
        raise ValueError(f'time: invalid duration "{text}"')
    total, pos = 0, 0
    while pos < len(s):
        m = _DUR_PART.match(s, pos)
        if not m or (not m.group(1) and not m.group(2)):
            raise ValueError(f'time: invalid duration "{text}"')
        whole, frac, unit = m.group(1) or "0", m.group(2) or "", m.group(3)
        if unit not in _UNITS:
            raise ValueError(f'time: unknown unit "{unit}" in duration "{text}"')
        scale = _UNITS[unit]
        total += int(whole) * scale + (int(frac) * scale // 10 ** len(frac) if frac else 0)
        pos = m.end()
    if total > 2**63 - 1:
        raise ValueError(f'time: invalid duration "{text}"')
    return -total if neg else total


def format_duration(ns: int) -> str:
    """Go's time.Duration.String(): 0s, 250ms, 1.5s, 1h0m0s."""
    if ns == 0:
        return "0s"
    sign, u = ("-", -ns) if ns < 0 else ("", ns)

    def frac(v: int, digits: int) -> str:
        whole, rest = divmod(v, 10 ** digits)
        tail = str(rest).rjust(digits, "0").rstrip("0")
        return f"{whole}.{tail}" if tail else str(whole)

    if u < 10**9:
        for unit, digits in (("ns", 0), ("µs", 3), ("ms", 6)):
            if u < 10 ** (digits + 3):
                return sign + (frac(u, digits) if digits else str(u)) + unit
    h, rem = divmod(u, 3600 * 10**9)
    m, rem = divmod(rem, 60 * 10**9)
    out = frac(rem, 9) + "s"
    if h or m:
        out = f"{m}m" + out
    if h:
        out = f"{h}h" + out
    return sign + out


# ------------------------------------------------------------------ YAML reading

_YAML: tuple | None = None


def _yaml():
    global _YAML
    if _YAML is not None:
        return _YAML
    # imported only when a file is read: PyYAML costs ~20 ms of every start
    import yaml

    class Dups(dict):
        """A mapping that remembers the keys given twice (the strict decoder's duplicate fields)."""
        dups: list[str]

    # libyaml's parser when built with it (several times faster), the same constructors
    class Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
        pass

    def mapping(loader, node, deep=False):
        out = Dups()
        out.dups = []
        loader.flatten_mapping(node)
        for key_node, value_node in node.value:
            key = loader.construct_object(key_node, deep=True)
            # sigs.k8s.io/yaml turns every key into a JSON string
            key = ("true" if key else "false") if isinstance(key, bool) else \
                ("null" if key is None else str(key))
            if key in out:
                out.dups.append(key)
            out[key] = loader.construct_object(value_node, deep=True)
        return out

    Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    # a timestamp-looking scalar stays the string sigs.k8s.io/yaml hands the JSON decoder
    Loader.add_constructor("tag:yaml.org,2002:timestamp", yaml.SafeLoader.construct_yaml_str)
    _YAML = (yaml, Loader)
    return _YAML


def _documents(text: str, path: str) -> list[Any]:
    yaml, Loader = _yaml()
    try:
        docs = [d for d in yaml.load_all(text, Loader=Loader) if d is not None]
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else path
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise KubeProxyConfigError(f"{where}: failed to decode: {problem}") from None
    return docs


def _is_configmap(doc: Any) -> bool:
    return isinstance(doc, dict) and doc.get("kind") == "ConfigMap" and doc.get("apiVersion") == "v1"


def _config_text(doc: dict, path: str) -> str:
    data = doc.get("data")
    if isinstance(data, dict):
        for key in CONFIGMAP_KEYS:
            if isinstance(data.get(key), str):
                return data[key]
    keys = ", ".join(sorted(data)) if isinstance(data, dict) else "none"
    raise KubeProxyConfigError(f"{path}: ConfigMap has no data key {' or '.join(CONFIGMAP_KEYS)} "
                               f"(its keys: {keys})")


def read_document(text: str, path: str) -> tuple[Any, str]:
    """The KubeProxyConfiguration document of a file: (decoded YAML, where it came from).

    A ConfigMap is opened at its data key. kube-proxy reads one document; a stream
    of several is accepted when exactly one of them is a KubeProxyConfiguration or a
    ConfigMap holding one (a DaemonSet beside it, as in EKS's manifests, is skipped)."""
    docs = _documents(text, path)
    if len(docs) > 1:
        picked = [d for d in docs if (isinstance(d, dict) and d.get("kind") == KIND)
                  or (_is_configmap(d) and any(k in (d.get("data") or {}) for k in CONFIGMAP_KEYS))]
        if len(picked) != 1:
            raise KubeProxyConfigError(f"{path}: {len(docs)} YAML documents, {len(picked)} of them a "
                                       f"{KIND} (or a ConfigMap holding one): kube-proxy reads exactly one")
        docs = picked
    if not docs:
        raise KubeProxyConfigError(f"{path}: failed to decode: Object 'Kind' is missing (the file is empty)")
    doc = docs[0]
    if _is_configmap(doc):
        where = f"{path} (ConfigMap {((doc.get('metadata') or {}).get('name') or '?')})"
        inner = _documents(_config_text(doc, path), where)
        if len(inner) != 1:
            raise KubeProxyConfigError(f"{where}: the config key holds {len(inner)} YAML documents, not one")
        return inner[0], where
    return doc, path


# ------------------------------------------------------------------ strict decoding

def _type_name(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    if isinstance(v, dict):
        return "object"
    return type(v).__name__


class _Decoder:
    def __init__(self) -> None:
        self.strict: list[str] = []     # unknown and duplicate fields, as the strict decoder names them

    def fail(self, path: str, kind: str, value: Any) -> None:
        shown = f" {value!r}" if isinstance(value, (str, int, float)) and not isinstance(value, bool) else ""
        raise KubeProxyConfigError(f"failed to decode: {ROOT}.{path}: cannot unmarshal "
                                   f"{_type_name(value)}{shown} into {kind}")

    def struct(self, schema: dict, data: Any, prefix: str) -> dict:
        if data is None:
            data = {}
        if not isinstance(data, dict):
            self.fail(prefix.rstrip("."), "an object", data)
        for key in getattr(data, "dups", ()):
            self.strict.append(f'duplicate field "{prefix}{key}"')
        out: dict[str, Any] = {}
        for key, value in data.items():
            if key not in schema:
                self.strict.append(f'unknown field "{prefix}{key}"')
                continue
            out[key] = self.value(schema[key], value, prefix + key)
        for key, kind in schema.items():
            if key not in out:
                out[key] = self.value(kind, None, prefix + key)
        return out

    def value(self, kind: Any, v: Any, path: str) -> Any:
        if isinstance(kind, dict):
            return self.struct(kind, v, path + ".")
        if isinstance(kind, Ptr):
            return None if v is None else self.value(kind.kind, v, path)
        if kind == STR:
            if v is None:
                return ""
            if not isinstance(v, str):
                self.fail(path, "a string", v)
            return v
        if kind == BOOL:
            if v is None:
                return False
            if not isinstance(v, bool):
                self.fail(path, "a bool", v)
            return v
        if kind in (INT32, UINT32):
            if v is None:
                return 0
            if isinstance(v, bool) or not isinstance(v, int):
                self.fail(path, kind, v)
            lo, hi = (-2**31, 2**31 - 1) if kind == INT32 else (0, 2**32 - 1)
            if not lo <= v <= hi:
                self.fail(path, kind, v)
            return v
        if kind == FLOAT:
            if v is None:
                return 0.0
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                self.fail(path, "a number", v)
            return float(v)
        if kind in (DUR, TIME_OR_DUR):
            if v is None:
                return 0
            if kind == TIME_OR_DUR and isinstance(v, int) and not isinstance(v, bool):
                return v    # nanoseconds, as component-base's TimeOrMetaDuration takes them
            if not isinstance(v, str):
                self.fail(path, 'a duration string such as "30s"', v)
            try:
                return parse_duration(v)
            except ValueError as exc:
                raise KubeProxyConfigError(f"failed to decode: {ROOT}.{path}: {exc}") from None
        if kind == LIST:
            if v is None:
                return None
            if not isinstance(v, list):
                self.fail(path, "a list of strings", v)
            out = []
            for i, item in enumerate(v):
                if item is not None and not isinstance(item, str):
                    self.fail(f"{path}[{i}]", "a string", item)
                out.append(item or "")
            return out
        if kind == GATES:
            if v is None:
                return {}
            if not isinstance(v, dict):
                self.fail(path, "a map of feature gates to booleans", v)
            for name, on in v.items():
                if not isinstance(on, bool):
                    self.fail(f"{path}.{name}", "a bool", on)
            return dict(v)
        if kind == QUANTITY:
            if v is None:
                return "0"
            if isinstance(v, bool) or not isinstance(v, (str, int, float)):
                self.fail(path, "a quantity", v)
            return str(v)
        if kind == VMODULE:
            if v is None:
                return []
            if not isinstance(v, list):
                self.fail(path, "a list of {filePattern, verbosity}", v)
            return [self.struct({"filePattern": STR, "verbosity": UINT32}, item, f"{path}[{i}].")
                    for i, item in enumerate(v)]
        raise AssertionError(kind)


def decode(doc: Any, where: str = "") -> tuple[dict, list[str]]:
    """The v1alpha1 tree of one decoded YAML document, undefaulted, and the strict-decoding
    complaints (unknown and duplicate fields) that made kube-proxy fall back to lenient decoding."""
    prefix = f"{where}: " if where else ""
    if not isinstance(doc, dict):
        raise KubeProxyConfigError(f"{prefix}failed to decode: expected a {KIND} object, got {_type_name(doc)}")
    api, kind = doc.get("apiVersion"), doc.get("kind")
    if not kind:
        raise KubeProxyConfigError(f"{prefix}failed to decode: Object 'Kind' is missing")
    if not api:
        raise KubeProxyConfigError(f"{prefix}failed to decode: Object 'apiVersion' is missing")
    if api != API_VERSION or kind != KIND:
        raise KubeProxyConfigError(f'{prefix}failed to decode: no kind "{kind}" is registered for version '
                                   f'"{api}" (kube-proxy reads {KIND} {API_VERSION})')
    dec = _Decoder()
    try:
        tree = dec.struct(SCHEMA, doc, "")
    except KubeProxyConfigError as exc:
        raise KubeProxyConfigError(prefix + str(exc)) from None
    return tree, dec.strict


# ------------------------------------------------------------------ defaulting and selection

@dataclass(frozen=True)
class KubeProxyConfig:
    """A defaulted, validated KubeProxyConfiguration and what kube-proxy's internal config picks from it."""
    tree: dict                            # the v1alpha1 fields after defaulting (durations in ns)
    mode: str                             # after platform defaults: never ""
    sync_period: int                      # ns, from the mode's section
    min_sync_period: int
    masquerade_all: bool
    masquerade_bit: int
    cluster_cidrs: tuple[str, ...]
    detect_local_mode: str
    nodeport_addresses: tuple[str, ...]
    source: str = ""
    lenient: tuple[str, ...] = field(default=())   # the strict decoder's complaints


def _default_host(bind: str, ipv4: str, ipv6: str) -> str:
    ip = _parse_ip(bind)
    return ipv6 if ip is not None and ip.version == 6 else ipv4


def _append_port(addr: str, port: int) -> str:
    """proxyutil.AppendPortIfNeeded: IP -> IP:port; an IP:port or anything else unchanged."""
    if _split_host_port(addr) is not None:
        return addr
    ip = _parse_ip(addr)
    if ip is None:
        return addr
    return f"[{addr}]:{port}" if ip.version == 6 else f"{addr}:{port}"


def set_defaults(t: dict) -> dict:
    """SetDefaults_KubeProxyConfiguration, in place on the decoded tree."""
    if not t["bindAddress"]:
        t["bindAddress"] = "0.0.0.0"
    healthz_host = _default_host(t["bindAddress"], "0.0.0.0", "[::]")
    metrics_host = _default_host(t["bindAddress"], "127.0.0.1", "[::1]")
    t["healthzBindAddress"] = (_append_port(t["healthzBindAddress"], HEALTHZ_PORT) if t["healthzBindAddress"]
                               else f"{healthz_host}:{HEALTHZ_PORT}")
    t["metricsBindAddress"] = (_append_port(t["metricsBindAddress"], METRICS_PORT) if t["metricsBindAddress"]
                               else f"{metrics_host}:{METRICS_PORT}")
    ipt, ipvs, nft, ct, cc = t["iptables"], t["ipvs"], t["nftables"], t["conntrack"], t["clientConnection"]
    for section in (ipt, nft):
        if section["masqueradeBit"] is None:
            section["masqueradeBit"] = 14
        if section["syncPeriod"] == 0:
            section["syncPeriod"] = 30 * 10**9
        if section["minSyncPeriod"] == 0:
            section["minSyncPeriod"] = 1 * 10**9
    if ipt["localhostNodePorts"] is None:
        ipt["localhostNodePorts"] = True
    if ipvs["syncPeriod"] == 0:
        ipvs["syncPeriod"] = 30 * 10**9    # ipvs.minSyncPeriod is not defaulted: 0 = sync on every change
    if t["configSyncPeriod"] == 0:
        t["configSyncPeriod"] = 15 * 60 * 10**9
    if ct["maxPerCore"] is None:
        ct["maxPerCore"] = 32 * 1024
    if ct["min"] is None:
        ct["min"] = 128 * 1024
    if ct["tcpEstablishedTimeout"] is None:
        ct["tcpEstablishedTimeout"] = 24 * 3600 * 10**9
    if ct["tcpCloseWaitTimeout"] is None:
        ct["tcpCloseWaitTimeout"] = 3600 * 10**9
    if t["oomScoreAdj"] is None:
        t["oomScoreAdj"] = -999
    if cc["contentType"] == "":
        cc["contentType"] = "application/vnd.kubernetes.protobuf"
    if cc["qps"] == 0:
        cc["qps"] = 5.0
    if cc["burst"] == 0:
        cc["burst"] = 10
    lg = t["logging"]
    if lg["format"] == "":
        lg["format"] = "text"
    if lg["flushFrequency"] == 0:
        lg["flushFrequency"] = 5 * 10**9
    return t


def internal(t: dict, source: str = "", lenient: tuple[str, ...] = ()) -> KubeProxyConfig:
    """The v1alpha1 -> internal conversion (the mode picks its section), then platformApplyDefaults."""
    mode = t["mode"]
    section = t["ipvs"] if mode == "ipvs" else t["nftables"] if mode == "nftables" else t["iptables"]
    masq_all = t["nftables"]["masqueradeAll"] if mode == "nftables" else t["iptables"]["masqueradeAll"]
    masq_bit = t["nftables"]["masqueradeBit"] if mode == "nftables" else t["iptables"]["masqueradeBit"]
    cidrs = tuple(t["clusterCIDR"].split(",")) if t["clusterCIDR"] else ()
    mode = mode or "iptables"
    nodeports = tuple(t["nodePortAddresses"] or ())
    if mode == "nftables" and not nodeports:
        nodeports = ("primary",)
    return KubeProxyConfig(tree=t, mode=mode, sync_period=section["syncPeriod"],
                           min_sync_period=section["minSyncPeriod"], masquerade_all=masq_all,
                           masquerade_bit=masq_bit, cluster_cidrs=cidrs,
                           detect_local_mode=t["detectLocalMode"] or "ClusterCIDR",
                           nodeport_addresses=nodeports, source=source, lenient=lenient)


# ------------------------------------------------------------------ validation (validation.go)

def _go_value(v: Any) -> str:
    """How field.Error prints a bad value: strings quoted, durations as Go prints them."""
    if isinstance(v, _Dur):
        return format_duration(v.ns)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, list):
        return "[]string{" + ", ".join(_go_value(x) for x in v) + "}"
    return str(v)


@dataclass(frozen=True)
class _Dur:
    ns: int


def invalid(path: str, value: Any, detail: str) -> str:
    return f"{path}: Invalid value: {_go_value(value)}: {detail}"


def not_supported(path: str, value: Any, allowed: tuple[str, ...]) -> str:
    return (f"{path}: Unsupported value: {_go_value(value)}: supported values: "
            + ", ".join(_go_value(a) for a in allowed))


def _parse_ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """netutils.ParseIPSloppy: an IPv4 octet may carry leading zeros (read as decimal)."""
    if not isinstance(text, str) or not text or text != text.strip():
        return None
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        pass
    parts = text.split(".")
    if len(parts) == 4 and all(p.isdigit() and p.isascii() for p in parts):
        try:
            return ipaddress.ip_address(".".join(str(int(p)) for p in parts))
        except ValueError:
            return None
    return None


def _parse_cidr(text: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network | None:
    """netutils.ParseCIDRSloppy: ADDR/BITS (host bits may be set); None if not a CIDR."""
    if not isinstance(text, str) or "/" not in text:
        return None
    addr, _, bits = text.partition("/")
    ip = _parse_ip(addr)
    if ip is None or not bits.isdigit() or not bits.isascii() or (len(bits) > 1 and bits[0] == "0"):
        return None
    if int(bits) > ip.max_prefixlen:
        return None
    return ipaddress.ip_network(f"{ip}/{bits}", strict=False)


def _split_host_port(text: str) -> tuple[str, str] | None:
    """net.SplitHostPort; None where Go reports an error."""
    if text.startswith("["):
        end = text.find("]")
        if end < 0 or text[end + 1:end + 2] != ":" or "[" in text[1:end] or "]" in text[end + 1:]:
            return None
        return text[1:end], text[end + 2:]
    i = text.rfind(":")
    if i < 0:
        return None
    host, port = text[:i], text[i + 1:]
    if ":" in host or "[" in host or "]" in host or "[" in port or "]" in port:
        return None
    return host, port


def validate_host_port(value: str, path: str) -> list[str]:
    hp = _split_host_port(value)
    if hp is None:
        return [invalid(path, value, "must be IP:port")]
    host, port = hp
    errs = []
    if _parse_ip(host) is None:
        errs.append(invalid(path, host, "must be a valid IP"))
    if not re.fullmatch(r"[+-]?[0-9]+", port) or not 1 <= int(port) <= 65535:
        errs.append(invalid(path, port, "must be a valid port"))
    return errs


def _valid_port_range(text: str) -> bool:
    """utilnet.ParsePortRange: "", N, N-M or N+SIZE within 0-65535."""
    s = text.strip()
    if not s:
        return True
    m = re.fullmatch(r"([0-9]+)(?:([-+])([0-9]+))?", s)
    if not m:
        return False
    base = int(m.group(1))
    if not m.group(2):
        return 0 <= base <= 65535
    other = int(m.group(3))
    high = other if m.group(2) == "-" else base + other - 1
    return 0 <= base <= 65535 and base <= high <= 65535


def validate_dual_stack_cidrs(cidrs: list[str], path: str) -> list[str]:
    if not cidrs:
        return [invalid(path, list(cidrs), "must contain at least one CIDR")]
    if len(cidrs) > 2:
        return [invalid(path, list(cidrs), "must be a either a single CIDR or dual-stack pair of CIDRs "
                                           "(e.g. [10.100.0.0/16, fde4:8dba:82e1::/48]")]
    errs, nets = [], []
    for i, c in enumerate(cidrs):
        net = _parse_cidr(c)
        if net is None:
            errs.append(invalid(f"{path}[{i}]", c, "must be a valid CIDR block (e.g. 10.100.0.0/16 or "
                                                   "fde4:8dba:82e1::/48)"))
        nets.append(net)
    if len(cidrs) == 2 and None not in nets and nets[0].version == nets[1].version:   # type: ignore[union-attr]
        errs.append(invalid(path, list(cidrs), "must be a either a single CIDR or dual-stack pair of CIDRs "
                                               "(e.g. [10.100.0.0/16, fde4:8dba:82e1::/48]"))
    return errs


def validate_nodeport_addresses(addresses: tuple[str, ...] | list[str], path: str) -> list[str]:
    errs = []
    for i, a in enumerate(addresses):
        if a == "primary":
            if i != 0 or len(addresses) != 1:
                errs.append(invalid(f"{path}[{i}]", a, "can't use both 'primary' and CIDRs"))
            break
        if _parse_cidr(a) is None:
            errs.append(invalid(f"{path}[{i}]", a, "must be a valid CIDR"))
    return errs


def validate_exclude_cidrs(cidrs: list[str], path: str) -> list[str]:
    return [invalid(f"{path}[{i}]", c, "must be a valid CIDR") for i, c in enumerate(cidrs)
            if _parse_cidr(c) is None]


def validate(kp: KubeProxyConfig) -> list[str]:
    """validation.Validate on the internal config: every error, in kube-proxy's order and words."""
    t, p = kp.tree, ROOT
    errs: list[str] = []

    def non_negative(path: str, ns: int) -> None:
        if ns < 0:
            errs.append(invalid(path, _Dur(ns), "must be greater than or equal to 0"))

    def bit(value: int, path: str) -> None:
        if not 0 <= value <= 31:
            errs.append(invalid(path, value, "must be within the range [0, 31]"))

    bit(t["iptables"]["masqueradeBit"], f"{p}.KubeProxyIPTablesConfiguration.MasqueradeBit")
    if kp.mode == "ipvs":
        ipvs, q = t["ipvs"], f"{p}.KubeProxyIPVSConfiguration"
        non_negative(f"{q}.TCPTimeout", ipvs["tcpTimeout"])
        non_negative(f"{q}.TCPFinTimeout", ipvs["tcpFinTimeout"])
        non_negative(f"{q}.UDPTimeout", ipvs["udpTimeout"])
        errs += validate_exclude_cidrs(ipvs["excludeCIDRs"] or [], f"{q}.ExcludeCidrs")
    elif kp.mode == "nftables":
        bit(t["nftables"]["masqueradeBit"], f"{p}.KubeProxyNFTablesConfiguration.MasqueradeBit")
    ct, q = t["conntrack"], f"{p}.KubeProxyLinuxConfiguration.KubeProxyConntrackConfiguration"
    for name in ("maxPerCore", "min"):
        if ct[name] < 0:
            errs.append(invalid(f"{q}.{name[0].upper()}{name[1:]}", ct[name], "must be greater than or equal to 0"))
    non_negative(f"{q}.TCPEstablishedTimeout", ct["tcpEstablishedTimeout"])
    non_negative(f"{q}.TCPCloseWaitTimeout", ct["tcpCloseWaitTimeout"])
    non_negative(f"{q}.UDPTimeout", ct["udpTimeout"])
    non_negative(f"{q}.UDPStreamTimeout", ct["udpStreamTimeout"])
    if not -1000 <= t["oomScoreAdj"] <= 1000:
        errs.append(invalid(f"{p}.KubeProxyLinuxConfiguration.OOMScoreAdj", t["oomScoreAdj"],
                            "must be within the range [-1000, 1000]"))
    if kp.mode not in ("iptables", "ipvs", "nftables"):
        errs.append(invalid(f"{p}.Mode.ProxyMode", kp.mode, "must be iptables, ipvs, nftables or blank "
                                                             "(blank means the best-available proxy [currently iptables])"))
    if t["clientConnection"]["burst"] < 0:
        errs.append(invalid(f"{p}.ClientConnection.Burst", t["clientConnection"]["burst"],
                            "must be greater than or equal to 0"))
    if t["configSyncPeriod"] <= 0:
        errs.append(invalid(f"{p}.ConfigSyncPeriod", _Dur(t["configSyncPeriod"]), "must be greater than 0"))
    if kp.sync_period <= 0:
        errs.append(invalid(f"{p}.SyncPeriod", _Dur(kp.sync_period), "must be greater than 0"))
    non_negative(f"{p}.MinSyncPeriod", kp.min_sync_period)
    if kp.min_sync_period > kp.sync_period:
        errs.append(invalid(f"{p}.SyncPeriod", _Dur(kp.min_sync_period),
                            f"must be greater than or equal to {p}.MinSyncPeriod"))
    if _parse_ip(t["bindAddress"]) is None:
        errs.append(invalid(f"{p}.BindAddress", t["bindAddress"], "not a valid textual representation of an IP address"))
    if t["healthzBindAddress"]:
        errs += validate_host_port(t["healthzBindAddress"], f"{p}.HealthzBindAddress")
    errs += validate_host_port(t["metricsBindAddress"], f"{p}.MetricsBindAddress")
    if not _valid_port_range(t["portRange"]):
        errs.append(invalid(f"{p}.PortRange", t["portRange"], "must be a valid port range (e.g. 300-2000)"))
    errs += validate_nodeport_addresses(kp.nodeport_addresses, f"{p}.NodePortAddresses")
    hidden = t["showHiddenMetricsForVersion"]
    previous = f"{KUBE_MINOR[0]}.{KUBE_MINOR[1] - 1}"
    if hidden and hidden != previous:
        errs.append(invalid(f"{p}.ShowHiddenMetricsForVersion", hidden,
                            f"--show-hidden-metrics-for-version must be omitted or have the value '{previous}'. "
                            "Only the previous minor version is allowed"))
    if kp.detect_local_mode not in LOCAL_MODES:
        errs.append(not_supported(f"{p}.DetectLocalMode", kp.detect_local_mode, LOCAL_MODES))
    q = f"{p}.DetectLocalConfiguration"
    if kp.detect_local_mode == "BridgeInterface" and not t["detectLocal"]["bridgeInterface"]:
        errs.append(invalid(f"{q}.InterfaceName", "", "must not be empty"))
    elif kp.detect_local_mode == "InterfaceNamePrefix" and not t["detectLocal"]["interfaceNamePrefix"]:
        errs.append(invalid(f"{q}.InterfacePrefix", "", "must not be empty"))
    elif kp.detect_local_mode == "ClusterCIDR" and kp.cluster_cidrs:
        errs += validate_dual_stack_cidrs(list(kp.cluster_cidrs), f"{q}.ClusterCIDRs")
    if t["logging"]["format"] not in ("text", "json"):
        errs.append(invalid(f"{p}.logging.format", t["logging"]["format"], "Unsupported log format"))
    return errs


def aggregate(errs: list[str]) -> str:
    """utilerrors.NewAggregate(...).Error(): one error as it is, several in brackets."""
    return errs[0] if len(errs) == 1 else "[" + ", ".join(errs) + "]"


# ------------------------------------------------------------------ what clusterdns refuses

def refusals(kp: KubeProxyConfig) -> list[str]:
    """Fields kube-proxy would honour that clusterdns cannot: refused, not skipped."""
    t, out = kp.tree, []
    if kp.detect_local_mode in UNSUPPORTED_LOCAL_MODES:
        out.append(f"{ROOT}.DetectLocalMode: Unsupported value: {_go_value(kp.detect_local_mode)}: "
                   f"{UNSUPPORTED_LOCAL_MODES[kp.detect_local_mode]}")
    if kp.detect_local_mode in IFACE_MODES and kp.mode == "nftables":
        out.append(f"{ROOT}.DetectLocalMode: Unsupported value: {_go_value(kp.detect_local_mode)} in mode "
                   f"nftables: {NFT_IFACE}")
    sched = t["ipvs"]["scheduler"]
    if kp.mode == "ipvs" and sched and sched not in SCHEDULERS:
        out.append(not_supported(f"{ROOT}.KubeProxyIPVSConfiguration.Scheduler", sched, SCHEDULERS))
    return out


def not_applied(kp: KubeProxyConfig) -> list[str]:
    """Fields set away from their default that have no effect in clusterdns (logged, one line)."""
    t, out = kp.tree, []
    cc = t["clientConnection"]
    if cc["kubeconfig"]:
        out.append("clientConnection.kubeconfig (the state comes from --kubeconfig, KUBECONFIG or in-cluster)")
    for key, default in (("qps", 5.0), ("burst", 10), ("acceptContentTypes", ""),
                         ("contentType", "application/vnd.kubernetes.protobuf")):
        if cc[key] != default:
            out.append(f"clientConnection.{key}")
    if t["enableProfiling"]:
        out.append("enableProfiling")
    if t["showHiddenMetricsForVersion"]:
        out.append("showHiddenMetricsForVersion")
    if t["featureGates"]:
        out.append("featureGates (" + ", ".join(f"{k}={str(v).lower()}" for k, v in t["featureGates"].items()) + ")")
    if kp.mode == "ipvs":
        for key in ("tcpTimeout", "tcpFinTimeout", "udpTimeout"):
            if t["ipvs"][key]:
                out.append(f"ipvs.{key}")
    if t["portRange"]:
        out.append("portRange (unused by kube-proxy too since 1.26)")
    lg = t["logging"]
    if lg["format"] != "text":
        out.append(f"logging.format {lg['format']} (clusterdns logs text lines)")
    if lg["vmodule"]:
        out.append("logging.vmodule")
    return out


# ------------------------------------------------------------------ the file

def load(path: str) -> KubeProxyConfig:
    """Read, decode, default and validate one kube-proxy config file; KubeProxyConfigError otherwise."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as exc:
        raise KubeProxyConfigError(f"{path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise KubeProxyConfigError(f"{path}: failed to decode: not UTF-8 text") from None
    return loads(text, path)


def loads(text: str, path: str = "<config>") -> KubeProxyConfig:
    doc, where = read_document(text, path)
    tree, strict = decode(doc, where)
    if strict:
        log.warning("%s: using lenient decoding as strict decoding failed: strict decoding error: %s",
                    where, ", ".join(strict))
    kp = internal(set_defaults(tree), where, tuple(strict))
    errs = validate(kp)
    if errs:
        raise KubeProxyConfigError(f"{where}: failed validate: {aggregate(errs)}")
    refused = refusals(kp)
    if refused:
        raise KubeProxyConfigError(f"{where}: {aggregate(refused)}")
    return kp


def hostname(value: str) -> str:
    """kube-proxy's hostname override: trimmed and lower-cased; whitespace only is an error."""
    name = value.strip().lower()
    if value and not name:
        raise KubeProxyConfigError("--hostname-override: empty hostname-override is invalid")
    return name


def _listen(addr: str) -> str:
    """An IP:port of the file as clusterdns's listener options spell it."""
    return addr


def options(kp: KubeProxyConfig) -> dict[str, Any]:
    """clusterdns's options (flag names) for what the file says."""
    from .config import ConntrackConfig
    t = kp.tree
    bind = _parse_ip(t["bindAddress"])
    ct = t["conntrack"]
    sec = 1e9
    return {
        "proxy_mode": kp.mode,
        "sync_period": kp.sync_period / sec,
        "min_sync_period": kp.min_sync_period / sec,
        "masquerade_all": kp.masquerade_all,
        "masquerade_bit": kp.masquerade_bit,
        "localhost_nodeports": t["iptables"]["localhostNodePorts"],
        "cluster_cidrs": kp.cluster_cidrs if kp.detect_local_mode == "ClusterCIDR" else (),
        "detect_local_mode": kp.detect_local_mode,
        "pod_bridge_interface": t["detectLocal"]["bridgeInterface"],
        "pod_interface_name_prefix": t["detectLocal"]["interfaceNamePrefix"],
        "nodeport_addresses": kp.nodeport_addresses,
        # a specific bindAddress is the node's IP; 0.0.0.0 / :: leaves it to the Node object
        "node_ips": (str(bind),) if bind is not None and not bind.is_unspecified else (),
        "ipvs_scheduler": t["ipvs"]["scheduler"] or "rr",
        "ipvs_exclude_cidrs": tuple(t["ipvs"]["excludeCIDRs"] or ()),
        "ipvs_strict_arp": t["ipvs"]["strictARP"],
        "conntrack": ConntrackConfig(
            max_per_core=ct["maxPerCore"], min=ct["min"],
            tcp_established_timeout=ct["tcpEstablishedTimeout"] // 10**9,
            tcp_close_wait_timeout=ct["tcpCloseWaitTimeout"] // 10**9,
            tcp_be_liberal=ct["tcpBeLiberal"],
            udp_timeout=ct["udpTimeout"] // 10**9, udp_stream_timeout=ct["udpStreamTimeout"] // 10**9),
        "oom_score_adj": t["oomScoreAdj"],
        "proxy_health_listen": _listen(t["healthzBindAddress"]),
        "bind_address_hard_fail": t["bindAddressHardFail"],
        "proxy_metrics_listen": _listen(t["metricsBindAddress"]),
    }


# ------------------------------------------------------------------ kube-proxy's own flags

# option -> the clusterdns and kube-proxy flags that set it, for the "ignored" message
COVERED = {
    "proxy_mode": "--proxy-mode", "sync_period": "--sync-period/--iptables-sync-period/--ipvs-sync-period",
    "min_sync_period": "--min-sync-period/--iptables-min-sync-period/--ipvs-min-sync-period",
    "masquerade_all": "--masquerade-all", "masquerade_bit": "--masquerade-bit/--iptables-masquerade-bit",
    "localhost_nodeports": "--no-localhost-nodeports/--iptables-localhost-nodeports",
    "cluster_cidrs": "--cluster-cidr", "detect_local_mode": "--detect-local-mode",
    "pod_bridge_interface": "--pod-bridge-interface", "pod_interface_name_prefix": "--pod-interface-name-prefix",
    "nodeport_addresses": "--nodeport-addresses", "node_ips": "--node-ip/--bind-address",
    "ipvs_scheduler": "--ipvs-scheduler", "ipvs_exclude_cidrs": "--ipvs-exclude-cidrs",
    "ipvs_strict_arp": "--ipvs-strict-arp", "conntrack": "--conntrack-*", "oom_score_adj": "--oom-score-adj",
    "proxy_health_listen": "--healthz-bind-address", "bind_address_hard_fail": "--bind-address-hard-fail",
    "proxy_metrics_listen": "--proxy-metrics-listen/--metrics-bind-address",
}
_KP = "kp_"     # dests of kube-proxy's flags, turned into options by apply()


def _gobool(text: str) -> bool:
    """pflag's bool values."""
    low = text.lower()
    if low in ("1", "t", "true"):
        return True
    if low in ("0", "f", "false"):
        return False
    raise argparse.ArgumentTypeError(f"invalid boolean {text!r}")


def _godur(text: str) -> float:
    try:
        return parse_duration(text) / 1e9
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_flags(p: argparse.ArgumentParser) -> None:
    """--proxy-config, and kube-proxy's own flags as kube-proxy spells them (k3s and RKE2 pass only
    these), for agent, proxy and rules."""
    S = argparse.SUPPRESS
    a = p.add_argument
    a("--proxy-config", metavar="FILE", default=S,
      help="kube-proxy's configuration file (KubeProxyConfiguration, or the kube-proxy ConfigMap); "
           "beside it the proxy flags are ignored, as kube-proxy ignores its flags beside --config, "
           "except --node-name/--hostname-override and logging")
    a("--hostname-override", dest=_KP + "hostname_override", metavar="NAME", default=S,
      help="kube-proxy's spelling of --node-name (trimmed, lower-cased)")
    for name, kind, what in (
            ("bind-address", str, "a specific IP is the node's IP; 0.0.0.0 or :: use the Node object"),
            ("metrics-bind-address", str, "kube-proxy's metrics address; an IP gets port 10249"),
            ("conntrack-max-per-core", int, "nf_conntrack_max = this x CPUs (at least --conntrack-min); 0 leaves it"),
            ("conntrack-min", int, "floor of nf_conntrack_max"),
            ("conntrack-tcp-timeout-established", _godur, "Go duration; 0 leaves the sysctl"),
            ("conntrack-tcp-timeout-close-wait", _godur, "Go duration; 0 leaves the sysctl"),
            ("conntrack-udp-timeout", _godur, "Go duration; 0 leaves the sysctl"),
            ("conntrack-udp-timeout-stream", _godur, "Go duration; 0 leaves the sysctl"),
            ("iptables-sync-period", _godur, "Go duration (iptables and nftables modes)"),
            ("iptables-min-sync-period", _godur, "Go duration (iptables and nftables modes)"),
            ("ipvs-sync-period", _godur, "Go duration (ipvs mode)"),
            ("ipvs-min-sync-period", _godur, "Go duration (ipvs mode)"),
            ("iptables-masquerade-bit", int, "kube-proxy's --masquerade-bit"),
            ("config-sync-period", _godur, "accepted for kube-proxy's command line; no effect (no informer resync)")):
        a(f"--{name}", dest=_KP + name.replace("-", "_"), type=kind, default=S, metavar="VALUE", help=what)
    for name, what in (("conntrack-tcp-be-liberal", "set nf_conntrack_tcp_be_liberal=1"),
                       ("ipvs-strict-arp", "arp_ignore=1 and arp_announce=2 (ipvs mode)"),
                       ("bind-address-hard-fail", "exit when the healthz or proxy metrics address cannot be "
                                                  "bound, instead of retrying every 5 s"),
                       ("iptables-localhost-nodeports", "NodePorts on 127.0.0.1 (default true)")):
        dest = name.replace("-", "_") if name in ("ipvs-strict-arp", "bind-address-hard-fail") else \
            _KP + name.replace("-", "_")
        a(f"--{name}", dest=dest, type=_gobool, nargs="?", const=True, default=S, metavar="BOOL", help=what)
    # kube-proxy flags that are options as they are
    a("--healthz-bind-address", dest="proxy_health_listen", metavar="IP[:PORT]", default=S,
      help="/healthz and /livez only (kube-proxy's 0.0.0.0:10256; an IP gets port 10256); "
           "default: on --health-listen")
    a("--ipvs-scheduler", default=S, metavar="NAME", help="IPVS scheduler (default rr)")
    a("--ipvs-exclude-cidrs", action="append", default=S, metavar="CIDR[,CIDR]",
      help="IPVS services in these CIDRs are never removed")
    a("--detect-local-mode", default=S, metavar="MODE", help="how traffic from local pods is told apart: "
      "ClusterCIDR (--cluster-cidr), BridgeInterface, InterfaceNamePrefix (not in nftables mode); NodeCIDR "
      "is refused")
    a("--pod-bridge-interface", default=S, metavar="NAME", help="detect-local-mode BridgeInterface: the bridge")
    a("--pod-interface-name-prefix", default=S, metavar="PREFIX",
      help="detect-local-mode InterfaceNamePrefix: the prefix of pod interfaces")
    a("--oom-score-adj", type=int, default=S, metavar="N", help="this process's oom_score_adj (kube-proxy's -999)")
    a("--v", "-v", dest=_KP + "v", type=int, default=S, metavar="N",
      help="kube-proxy's log verbosity: 4 or more is --log-level debug")


def _addr_flag(value: str, port: int, flag: str) -> str:
    addr = _append_port(value, port)
    errs = validate_host_port(addr, flag)
    if errs:
        raise KubeProxyConfigError(errs[0])
    return addr


def _from_kube_proxy_flags(values: dict[str, Any]) -> dict[str, Any]:
    """Turn the kp_* flag values into options, as kube-proxy's flag handling (no --config) does."""
    kp = {k[len(_KP):]: values.pop(k) for k in [k for k in values if k.startswith(_KP)]}
    out: dict[str, Any] = {}
    mode = values.get("proxy_mode", "iptables")
    if "hostname_override" in kp:
        out["node_name"] = hostname(kp["hostname_override"])
    if "bind_address" in kp:
        ip = _parse_ip(kp["bind_address"])
        if ip is None:
            raise KubeProxyConfigError(f"--bind-address {kp['bind_address']!r}: not a valid IP address")
        if not ip.is_unspecified:
            out["node_ips"] = (str(ip),)
    if values.get("proxy_health_listen"):
        out["proxy_health_listen"] = _addr_flag(values["proxy_health_listen"], HEALTHZ_PORT, "--healthz-bind-address")
    if "metrics_bind_address" in kp:
        out["proxy_metrics_listen"] = _addr_flag(kp["metrics_bind_address"], METRICS_PORT, "--metrics-bind-address")
    # processV1Alpha1Flags: the ipvs pair in ipvs mode, the iptables pair otherwise (nftables too)
    pair = ("ipvs_sync_period", "ipvs_min_sync_period") if mode == "ipvs" else \
        ("iptables_sync_period", "iptables_min_sync_period")
    if pair[0] in kp:
        out["sync_period"] = kp[pair[0]]
    if pair[1] in kp:
        out["min_sync_period"] = kp[pair[1]]
    if "iptables_masquerade_bit" in kp:
        out["masquerade_bit"] = kp["iptables_masquerade_bit"]
    if "iptables_localhost_nodeports" in kp:
        out["localhost_nodeports"] = kp["iptables_localhost_nodeports"]
    conntrack = {k[len("conntrack_"):]: v for k, v in kp.items() if k.startswith("conntrack_")}
    if conntrack:
        from .config import ConntrackConfig
        names = {"tcp_timeout_established": "tcp_established_timeout",
                 "tcp_timeout_close_wait": "tcp_close_wait_timeout",
                 "udp_timeout_stream": "udp_stream_timeout"}
        given = {names.get(k, k): v for k, v in conntrack.items()}
        for key in ("tcp_established_timeout", "tcp_close_wait_timeout", "udp_timeout", "udp_stream_timeout"):
            if key in given:
                given[key] = int(given[key])     # whole seconds, as kube-proxy writes them
        out["conntrack"] = ConntrackConfig(**given)
    if kp.get("v", 0) >= 4 and "log_level" not in values:
        out["log_level"] = "debug"
    return out


def _split_commas(values: dict[str, Any]) -> None:
    # kube-proxy's list flags take "a,b" (k3s: --cluster-cidr=10.42.0.0/16,fd00:42::/56)
    for name in ("cluster_cidrs", "nodeport_addresses", "ipvs_exclude_cidrs"):
        if values.get(name):
            items = values[name] if isinstance(values[name], (list, tuple)) else [values[name]]
            values[name] = [c for item in items for c in str(item).split(",") if c]


def _check_flag_values(values: dict[str, Any]) -> None:
    mode = values.get("detect_local_mode", "")
    if mode and mode not in LOCAL_MODES:
        raise KubeProxyConfigError(not_supported("--detect-local-mode", mode, LOCAL_MODES))
    if mode == "BridgeInterface" and not values.get("pod_bridge_interface"):
        raise KubeProxyConfigError("--detect-local-mode BridgeInterface needs --pod-bridge-interface")
    if mode == "InterfaceNamePrefix" and not values.get("pod_interface_name_prefix"):
        raise KubeProxyConfigError("--detect-local-mode InterfaceNamePrefix needs --pod-interface-name-prefix")
    if mode in UNSUPPORTED_LOCAL_MODES:
        raise KubeProxyConfigError(f"--detect-local-mode {mode}: not supported: {UNSUPPORTED_LOCAL_MODES[mode]}")
    _check_iface_mode(values)
    sched = values.get("ipvs_scheduler")
    if sched is not None and sched not in SCHEDULERS:
        raise KubeProxyConfigError(not_supported("--ipvs-scheduler", sched, SCHEDULERS))
    errs = validate_exclude_cidrs(list(values.get("ipvs_exclude_cidrs") or ()), "--ipvs-exclude-cidrs")
    ct = values.get("conntrack")
    if ct is not None:
        for name in ("max_per_core", "min", "tcp_established_timeout", "tcp_close_wait_timeout",
                     "udp_timeout", "udp_stream_timeout"):
            if getattr(ct, name) < 0:
                errs.append(f"--conntrack-{name.replace('_', '-')}: must be greater than or equal to 0")
    adj = values.get("oom_score_adj")
    if adj is not None and not -1000 <= adj <= 1000:
        errs.append(f"--oom-score-adj {adj}: must be within the range [-1000, 1000]")
    if errs:
        raise KubeProxyConfigError(errs[0])


def _check_iface_mode(values: dict[str, Any]) -> None:
    """An interface detector with nftables rules (the mode, or `rules --mode`) is refused."""
    printed = values.get("mode") or values.get("proxy_mode") or "iptables"
    if values.get("detect_local_mode") in IFACE_MODES and printed == "nftables":
        raise KubeProxyConfigError(f"detect-local-mode {values['detect_local_mode']} in mode nftables: "
                                   f"not supported: {NFT_IFACE}")


def apply(values: dict[str, Any]) -> dict[str, Any]:
    """config.load's hook: kube-proxy's flags made options, then --proxy-config over the proxy options.

    `values` holds only what the command line (and --config, NODE_NAME) gave."""
    values = dict(values)
    values.update(_from_kube_proxy_flags(values))
    _split_commas(values)
    path = values.get("proxy_config")
    if not path:
        _check_flag_values(values)
        return values
    kp = load(path)
    _LOADED[path] = kp
    ignored = sorted({COVERED[k] for k in values if k in COVERED})
    if ignored:
        log.warning("--proxy-config %s: ignoring the proxy settings given beside it (flags or --config): %s "
                    "(kube-proxy ignores its flags beside --config, except the hostname override and logging)",
                    path, ", ".join(ignored))
    unused = not_applied(kp)
    if unused:
        log.warning("%s: not applied by clusterdns: %s", kp.source, "; ".join(unused))
    values.update(options(kp))
    _check_iface_mode(values)
    # --node-name / --hostname-override / NODE_NAME win over hostnameOverride, as kube-proxy's flag does
    name = values.get("node_name")
    values["node_name"] = hostname(str(name)) if name else hostname(kp.tree["hostnameOverride"])
    level = kp.tree["logging"]["verbosity"]
    if level >= 4 and "log_level" not in values:
        values["log_level"] = "debug"
    return values


_LOADED: dict[str, KubeProxyConfig] = {}


def loaded(path: str) -> KubeProxyConfig:
    """The file apply() read (config check reports it without decoding and warning twice)."""
    return _LOADED[path] if path in _LOADED else load(path)


def default_hostname() -> str:
    """nodeutil.GetHostname(""): the host's name, lower-cased."""
    return socket.gethostname().strip().lower()
