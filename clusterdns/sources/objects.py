"""Raw Kubernetes objects (dicts as the API server or kubectl prints them) to records.

Fields are validated by their API type, not by what Python would accept: a
clusterIP written as a YAML integer is invalid even though ipaddress would take
it. An invalid object raises InvalidObject; the caller skips it with a warning.
"""
from __future__ import annotations

import ipaddress
import re
import socket
from datetime import datetime
from typing import Any, Callable

from ..model import (
    CLUSTER_IP,
    EXTERNAL_NAME,
    FQDN,
    IPV4,
    IPV6,
    LOAD_BALANCER,
    PROTOCOLS,
    SERVICE_TYPES,
    Endpoint,
    EndpointPort,
    EndpointSlice,
    Namespace,
    Node,
    Pod,
    Service,
    ServicePort,
)

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
PROXY_NAME_LABEL = "service.kubernetes.io/service-proxy-name"
TRIGGER_TIME_ANNOTATION = "endpoints.kubernetes.io/last-change-trigger-time"
TOPOLOGY_ANNOTATIONS = ("service.kubernetes.io/topology-mode",
                        "service.kubernetes.io/topology-aware-hints")

# The API server's name rules (k8s.io/apimachinery validation). Names reach rule
# text (comments, chain names), netlink attributes and DNS labels, so anything
# else is refused here. \Z, not $: "$" would accept a trailing newline.
_DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?\Z")
_DNS1035_LABEL = re.compile(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?\Z")
_DNS1123_SUBDOMAIN = re.compile(
    r"(?=.{1,253}\Z)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*\Z")
# IANA_SVC_NAME: 1-15 of [a-z0-9-], at least one letter, no leading/trailing/double hyphen.
_IANA_SVC_NAME = re.compile(r"(?=.{1,15}\Z)(?=.*[a-z])[a-z0-9]+(-[a-z0-9]+)*\Z")
# Label values: at most 63, alphanumerics at both ends, -_. inside.
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?\Z")
TRAFFIC_POLICIES = ("Cluster", "Local")


class InvalidObject(ValueError):
    """The object breaks its API type; the message says which field and why."""


def _get(obj: Any, key: str, kind: type | tuple, default: Any = None, where: str = "") -> Any:
    if not isinstance(obj, dict):
        raise InvalidObject(f"{where or 'object'}: expected a mapping")
    value = obj.get(key, default)
    if value is None:
        return default
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise InvalidObject(f"{where}{'.' if where else ''}{key}: expected "
                            f"{_type_name(kind)}, got {type(value).__name__} {value!r}"[:200])
    return value


def _name(value: str, pattern: re.Pattern, what: str, where: str) -> str:
    if not pattern.match(value):
        raise InvalidObject(f"{where}: {value!r} is not a valid {what}"[:200])
    return value


_SEEN: dict[re.Pattern, dict[str, str | None]] = {}


def _check_label(value: str, pattern: re.Pattern, what: str, where: str) -> str:
    """_name for values that repeat across many objects (namespaces, node names, zones):
    memoised, and the one string object returned for every copy (~100,000 fewer strings
    held at 10,000 Services x 10)."""
    seen = _SEEN.get(pattern)
    if seen is None:
        seen = _SEEN[pattern] = {}
    got = seen.get(value, "")
    if got == "":
        got = value if pattern.match(value) else None
        if len(seen) > 4096:
            seen.clear()
        seen[value] = got
    if got is None:
        raise InvalidObject(f"{where}: {value!r} is not a valid {what}"[:200])
    return got


_NODE_NAMES = _SEEN.setdefault(_DNS1123_SUBDOMAIN, {})   # value -> the shared string, or None if invalid
_NAMESPACES = _SEEN.setdefault(_DNS1123_LABEL, {})
_ZONES = _SEEN.setdefault(_LABEL_VALUE, {})


def _opt_str(obj: dict, key: str, where: str) -> str:
    """An optional string field ("" when absent); anything but a string is invalid."""
    value = obj.get(key)
    if value is None:
        return ""
    if type(value) is not str:
        raise InvalidObject(f"{where}.{key}: expected string, got {type(value).__name__} {value!r}"[:200])
    return value


def _type_name(kind: type | tuple) -> str:
    if isinstance(kind, tuple):
        return " or ".join(k.__name__ for k in kind)
    return {str: "string", int: "integer", dict: "mapping", list: "list", bool: "boolean"}.get(kind, kind.__name__)


def _ip(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise InvalidObject(f"{where}: IP address must be a string, got {type(value).__name__} {value!r}"[:200])
    try:
        # The common case, ~20x cheaper than ipaddress: strict dotted-quad IPv4 already in canonical form.
        if socket.inet_ntop(socket.AF_INET, socket.inet_pton(socket.AF_INET, value)) == value:
            return value
    except OSError:
        pass
    if "%" in value or value != value.strip():   # scoped IPv6 ("fe80::1%eth0") or padding
        raise InvalidObject(f"{where}: invalid IP address {value!r}"[:200])
    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        raise InvalidObject(f"{where}: invalid IP address {value!r}"[:200]) from None


def _cidr(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise InvalidObject(f"{where}: CIDR must be a string")
    text = value.strip()
    try:
        if "/" in text:
            addr, plen = text.split("/", 1)
            # kube-proxy normalises leading zeros ("203.0.113.000/025").
            if "." in addr:
                addr = ".".join(str(int(o)) for o in addr.split("."))
            return str(ipaddress.ip_network(f"{addr}/{int(plen)}", strict=False))
        return str(ipaddress.ip_network(text, strict=False))
    except ValueError:
        raise InvalidObject(f"{where}: invalid CIDR {value!r}"[:200]) from None


def _meta(obj: dict, namespaced: bool, name_rule: re.Pattern = _DNS1123_SUBDOMAIN,
          name_what: str = "DNS-1123 subdomain") -> tuple[str, str, dict, dict]:
    # each field of the usual type taken as it is; anything else through _get, which
    # gives the default for null or says what is wrong
    meta = obj.get("metadata") if type(obj) is dict else None
    if type(meta) is not dict:
        meta = _get(obj, "metadata", dict, where="")
        if meta is None:
            raise InvalidObject("metadata: missing")
    name = meta.get("name")
    if type(name) is not str:
        name = _get(meta, "name", str, where="metadata")
    if not name:
        raise InvalidObject("metadata.name: missing")
    _name(name, name_rule, name_what, "metadata.name")
    ns = ""
    if namespaced:
        got = meta.get("namespace")
        ns = got if type(got) is str else _get(meta, "namespace", str, "default", where="metadata")
        ns = _NAMESPACES.get(ns) or _check_label(ns, _DNS1123_LABEL, "namespace (DNS-1123 label)",
                                                 "metadata.namespace")
    labels = meta.get("labels")
    if type(labels) is not dict:
        labels = _get(meta, "labels", dict, {}, where="metadata")
    annotations = meta.get("annotations")
    if type(annotations) is not dict:
        annotations = _get(meta, "annotations", dict, {}, where="metadata")
    return ns, name, labels, annotations


def _labels(labels: dict) -> tuple[tuple[str, str], ...]:
    for k, v in labels.items():
        # Keys and values are strings of bounded size in the API; only the values we
        # match on are checked further (service-name, service-proxy-name).
        if type(k) is not str or type(v) is not str or len(k) > 317 or len(v) > 63:
            raise InvalidObject(f"metadata.labels: {k!r}: keys and values must be strings "
                                f"(values at most 63 characters)"[:200])
    return tuple(sorted(labels.items()))


def _protocol(value: Any, where: str) -> str:
    if value is None:
        return "TCP"
    if value not in PROTOCOLS:
        raise InvalidObject(f"{where}.protocol: unsupported protocol {value!r}")
    return value


def _port_number(value: Any, where: str, allow_zero: bool = False) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidObject(f"{where}: port must be an integer, got {value!r}"[:200])
    if not (0 if allow_zero else 1) <= value <= 65535:
        raise InvalidObject(f"{where}: port {value} out of range")
    return value


def _target_port(value: Any, where: str) -> int | str | None:
    if value is None:
        return None
    if type(value) is int:
        if not 1 <= value <= 65535:
            raise InvalidObject(f"{where}.targetPort: port {value} out of range")
        return value
    if type(value) is str:
        if value.isdigit():   # the API's IntOrString takes "8080" as a string: a name, and invalid as one
            raise InvalidObject(f"{where}.targetPort: {value!r} must be an integer or an IANA service name")
        return _name(value, _IANA_SVC_NAME, "port name (IANA_SVC_NAME)", f"{where}.targetPort")
    raise InvalidObject(f"{where}.targetPort: must be an integer or a string")


def _checked_port(p: Any, where: str) -> ServicePort:
    """One Service port, every field checked with its message."""
    pname = _get(p, "name", str, "", where=where)
    if pname:
        _name(pname, _DNS1123_LABEL, "port name (DNS-1123 label)", f"{where}.name")
    proto = _protocol(p.get("protocol"), where)
    port = _port_number(p.get("port"), f"{where}.port")
    node_port = _port_number(p.get("nodePort", 0), f"{where}.nodePort", allow_zero=True)
    target = _target_port(p.get("targetPort"), where)
    return ServicePort(pname, proto, port, node_port, target)


def _plain_port(p: Any) -> ServicePort | None:
    """_checked_port for the common shape (a name or none, a known protocol or none, numeric
    ports in range), without building messages; None for anything else, which _checked_port
    then accepts or refuses."""
    if type(p) is not dict:
        return None
    get = p.get
    pname, proto, port, node_port, target = (get("name"), get("protocol"), get("port"), get("nodePort", 0),
                                              get("targetPort"))
    if pname is None:
        pname = ""
    elif type(pname) is not str or (pname and not _DNS1123_LABEL.match(pname)):
        return None
    if proto is None:
        proto = "TCP"
    elif proto not in PROTOCOLS:
        return None
    if type(port) is not int or not 1 <= port <= 65535 or type(node_port) is not int \
            or not 0 <= node_port <= 65535:
        return None
    if target is not None and (type(target) is not int or not 1 <= target <= 65535):
        return None
    return ServicePort(pname, proto, port, node_port, target)


def service_from_dict(obj: dict) -> Service:
    ns, name, labels, annotations = _meta(obj, True, _DNS1035_LABEL, "Service name (DNS-1035 label)")
    # each field of the usual type taken as it is; anything else through _get (as in _meta)
    spec = obj.get("spec")
    if type(spec) is not dict:
        spec = _get(obj, "spec", dict, {}, where="")
    stype = spec.get("type")
    if type(stype) is not str:
        stype = _get(spec, "type", str, CLUSTER_IP, where="spec")
    if stype not in SERVICE_TYPES:
        raise InvalidObject(f"spec.type: unknown service type {stype!r}")
    headless = False
    cluster_ips: list[str] = []
    if stype != EXTERNAL_NAME:
        raw_ips = spec.get("clusterIPs")
        if type(raw_ips) is not list:
            raw_ips = _get(spec, "clusterIPs", list, None, where="spec")
        if raw_ips is None:
            one = spec.get("clusterIP")
            raw_ips = [] if one is None or one == "" else [one]
        for i, raw in enumerate(raw_ips):
            if raw == "None":
                headless = True
                continue
            try:   # _ip's common case (canonical IPv4) without the call and its message's text
                if type(raw) is str and _ntop(_AF_INET, _pton(_AF_INET, raw)) == raw:
                    cluster_ips.append(raw)
                    continue
            except OSError:
                pass
            cluster_ips.append(_ip(raw, f"spec.clusterIPs[{i}]"))
        # canonical: only IPv6 has ":"
        if len(cluster_ips) > 1 and len({":" in ip for ip in cluster_ips}) != len(cluster_ips):
            raise InvalidObject("spec.clusterIPs: two addresses of one family")
    external_name = ""
    if stype == EXTERNAL_NAME:
        external_name = _get(spec, "externalName", str, "", where="spec").rstrip(".").lower()
        if not external_name or not _DNS1123_SUBDOMAIN.match(external_name):
            raise InvalidObject(f"spec.externalName: invalid name {spec.get('externalName')!r}")
    ports = []
    seen = set()
    raw_ports = spec.get("ports")
    if type(raw_ports) is not list:
        raw_ports = _get(spec, "ports", list, [], where="spec")
    for i, p in enumerate(raw_ports):
        sp = _plain_port(p) or _checked_port(p, f"spec.ports[{i}]")
        name_proto = (sp.name, sp.protocol)
        if name_proto in seen:
            raise InvalidObject(f"spec.ports[{i}]: duplicate port name {sp.name!r}/{sp.protocol}")
        seen.add(name_proto)
        ports.append(sp)
    # absent optional fields (most Services) skip the checks' calls: _get gives () for None
    ext_ips = () if spec.get("externalIPs") is None else tuple(
        _ip(v, f"spec.externalIPs[{i}]") for i, v in enumerate(_get(spec, "externalIPs", list, [], where="spec")))
    lb_ips: list[str] = []
    if stype == LOAD_BALANCER:
        status = _get(obj, "status", dict, {}, where="")
        lb = _get(status, "loadBalancer", dict, {}, where="status")
        for i, ing in enumerate(_get(lb, "ingress", list, [], where="status.loadBalancer")):
            if not isinstance(ing, dict):
                raise InvalidObject(f"status.loadBalancer.ingress[{i}]: expected a mapping")
            if ing.get("ip") and ing.get("ipMode") != "Proxy":
                lb_ips.append(_ip(ing["ip"], f"status.loadBalancer.ingress[{i}].ip"))
    ranges = () if spec.get("loadBalancerSourceRanges") is None else tuple(
        _cidr(v, f"spec.loadBalancerSourceRanges[{i}]")
        for i, v in enumerate(_get(spec, "loadBalancerSourceRanges", list, [], where="spec")))
    affinity = spec.get("sessionAffinity")
    if affinity is None:
        affinity = "None"
    elif type(affinity) is not str:
        affinity = _get(spec, "sessionAffinity", str, "None", where="spec")
    timeout = 0
    if affinity == "ClientIP":
        cfg = _get(spec, "sessionAffinityConfig", dict, {}, where="spec")
        cip = _get(cfg, "clientIP", dict, {}, where="spec.sessionAffinityConfig")
        timeout = _get(cip, "timeoutSeconds", int, 10800, where="spec.sessionAffinityConfig.clientIP")
        if not 0 < timeout <= 86400:
            raise InvalidObject("spec.sessionAffinityConfig.clientIP.timeoutSeconds: out of range")
    elif affinity != "None":
        raise InvalidObject(f"spec.sessionAffinity: unknown value {affinity!r}")
    etp = spec.get("externalTrafficPolicy")
    itp = spec.get("internalTrafficPolicy")
    if etp is not None or itp is not None:
        etp = _get(spec, "externalTrafficPolicy", str, "Cluster", where="spec")
        itp = _get(spec, "internalTrafficPolicy", str, "Cluster", where="spec")
    else:
        etp = itp = "Cluster"
    for key, value in (("externalTrafficPolicy", etp), ("internalTrafficPolicy", itp)):
        if value not in TRAFFIC_POLICIES:
            raise InvalidObject(f"spec.{key}: unknown value {value!r}"[:200])
    label_items = _labels(labels)
    proxy_name = labels.get(PROXY_NAME_LABEL, "")
    if proxy_name:
        _name(proxy_name, _LABEL_VALUE, "label value", f"metadata.labels[{PROXY_NAME_LABEL}]")
    hc = spec.get("healthCheckNodePort", 0)
    if type(hc) is not int or not 0 <= hc <= 65535:
        hc = _port_number(hc, "spec.healthCheckNodePort", allow_zero=True)
    topo = bool(annotations) and any(str(annotations.get(a, "")) not in ("", "disabled", "Disabled")
                                     for a in TOPOLOGY_ANNOTATIONS)
    topo = topo or bool(spec.get("trafficDistribution"))
    # positional, in the fields' order (test_objects checks it): half the call's cost of 17 keywords
    return Service(ns, name, stype, tuple(cluster_ips), headless and not cluster_ips, external_name,
                   tuple(ports), ext_ips, tuple(lb_ips), ranges, timeout, etp == "Local", itp == "Local",
                   hc if etp == "Local" else 0, topo, proxy_name, label_items)


def _parse_time(text: Any) -> float | None:
    if not isinstance(text, str):
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


_CONDITIONS: dict[tuple, tuple[bool, bool, bool]] = {}


def _conditions(conds: Any, where: str) -> tuple[bool, bool, bool]:
    """(ready, serving, terminating) with the API's defaults: absent ready counts as ready,
    absent serving takes ready's value. Memoised: slices repeat a few shapes."""
    if conds is None:
        return True, True, False
    if type(conds) is not dict:
        raise InvalidObject(f"{where}.conditions: expected a mapping")
    key = (conds.get("ready"), conds.get("serving"), conds.get("terminating"))
    # the types checked before the memo is read: 1 == True, so {"ready": 1} would find true's entry
    for name, value in zip(("ready", "serving", "terminating"), key):
        if value is not None and type(value) is not bool:
            raise InvalidObject(f"{where}.conditions.{name}: expected a boolean, got {value!r}"[:200])
    got = _CONDITIONS.get(key)
    if got is None:
        ready = True if key[0] is None else key[0]
        got = (ready, ready if key[1] is None else key[1], bool(key[2]))
        _CONDITIONS[key] = got
    return got


_pton, _ntop, _AF_INET = socket.inet_pton, socket.inet_ntop, socket.AF_INET


def _field_error(i: int, key: str, value: Any) -> InvalidObject:
    return InvalidObject(f"endpoints[{i}].{key}: expected string, got {type(value).__name__} {value!r}"[:200])


def _endpoint(ep: Any, i: int, atype: str, ns: str) -> Endpoint:
    """One endpoint; written for speed (a 10,000-Service cluster has 100,000 of them):
    the common shapes take the straight path, messages are built only on failure."""
    if type(ep) is not dict:
        raise InvalidObject(f"endpoints[{i}]: expected a mapping")
    get = ep.get
    addrs = get("addresses")
    if type(addrs) is not list or not addrs:
        raise InvalidObject(f"endpoints[{i}].addresses: a non-empty list is required")
    first = addrs[0]
    canonical = False
    if atype == IPV4 and len(addrs) == 1 and type(first) is str:
        try:
            canonical = _ntop(_AF_INET, _pton(_AF_INET, first)) == first
        except OSError:
            pass
    addresses: tuple[str, ...]
    if canonical:
        addresses = (first,)
    elif atype == FQDN:
        addresses = tuple(_name(a, _DNS1123_SUBDOMAIN, "FQDN (DNS-1123 subdomain)", f"endpoints[{i}].addresses")
                          if type(a) is str else _bad_address(a, f"endpoints[{i}]") for a in addrs)
    else:
        addresses = tuple(_ip(a, f"endpoints[{i}].addresses[{j}]") for j, a in enumerate(addrs))
        v6 = atype == IPV6
        for a in addresses:   # canonical forms: only IPv6 has ":"
            if (":" in a) != v6:
                raise InvalidObject(f"endpoints[{i}].addresses: {a} is not of addressType {atype}")
    conds = get("conditions")
    if conds is None:
        ready, serving, terminating = True, True, False
    else:
        ready, serving, terminating = _conditions(conds, f"endpoints[{i}]")
    hostname = get("hostname")
    if hostname is None:
        hostname = ""
    elif type(hostname) is not str:
        raise _field_error(i, "hostname", hostname)
    elif hostname and not _DNS1123_LABEL.match(hostname):
        _name(hostname, _DNS1123_LABEL, "hostname (DNS-1123 label)", f"endpoints[{i}].hostname")
    # node names and zones repeat: the memo of _check_label, read here without the call
    node_name = get("nodeName")
    if node_name is None:
        node_name = ""
    elif type(node_name) is not str:
        raise _field_error(i, "nodeName", node_name)
    elif node_name:
        node_name = _NODE_NAMES.get(node_name) or _check_label(
            node_name, _DNS1123_SUBDOMAIN, "node name", f"endpoints[{i}].nodeName")
    zone = get("zone")
    if zone is None:
        zone = ""
    elif type(zone) is not str:
        raise _field_error(i, "zone", zone)
    elif zone:
        zone = _ZONES.get(zone) or _check_label(zone, _LABEL_VALUE, "zone (label value)", f"endpoints[{i}].zone")
    pod_name = pod_ns = ""
    ref = get("targetRef")
    if ref is not None:
        if type(ref) is not dict:
            raise InvalidObject(f"endpoints[{i}].targetRef: expected a mapping")
        if ref.get("kind") == "Pod":
            pod_name = _opt_str(ref, "name", f"endpoints[{i}].targetRef")
            if pod_name and not _DNS1123_SUBDOMAIN.match(pod_name):
                _name(pod_name, _DNS1123_SUBDOMAIN, "Pod name", f"endpoints[{i}].targetRef.name")
            pod_ns = _opt_str(ref, "namespace", f"endpoints[{i}].targetRef") or ns
            if pod_ns != ns:
                pod_ns = _check_label(pod_ns, _DNS1123_LABEL, "namespace", f"endpoints[{i}].targetRef.namespace")
            else:
                pod_ns = ns     # the slice's string, shared
    hints = get("hints")
    hint_zones = None
    if hints is not None:
        where = f"endpoints[{i}].hints"
        if type(hints) is not dict:
            raise InvalidObject(f"{where}: expected a mapping")
        zones = []
        for z in _get(hints, "forZones", list, [], where=where):
            if isinstance(z, dict):
                zn = _opt_str(z, "name", f"{where}.forZones")
                zones.append(_check_label(zn, _LABEL_VALUE, "zone", f"{where}.forZones"))
        hint_zones = tuple(zones)
    return Endpoint(addresses, ready, serving, terminating, hostname, node_name, zone,
                         hint_zones, pod_name, pod_ns)


class _NotPlain(Exception):
    """An endpoint _plain_endpoints leaves to _endpoint."""


def _plain_endpoints(eps: list, ns: str, E: Any = Endpoint, pton: Any = _pton, ntop: Any = _ntop,
                     af: int = _AF_INET, label: Any = _DNS1123_LABEL.match,
                     subdomain: Any = _DNS1123_SUBDOMAIN.match) -> list[Endpoint]:
    """_endpoint of each endpoint of an IPv4 slice: the common shape (one canonical address,
    conditions of booleans, known or no node name and zone, a Pod targetRef, no hints) inline,
    without a call, and anything else through _endpoint, which takes it or words the error.
    100,000 endpoints at 10,000 Services: this loop is most of turning a manifest into records."""
    out: list[Endpoint] = []
    append = out.append
    node_names = _NODE_NAMES
    zones = _ZONES
    not_plain = _NotPlain
    for i, ep in enumerate(eps):
        try:
            if type(ep) is not dict:
                raise not_plain
            get = ep.get
            addrs = get("addresses")
            if type(addrs) is not list or len(addrs) != 1 or get("hints") is not None:
                raise not_plain
            a = addrs[0]
            try:
                if type(a) is not str or ntop(af, pton(af, a)) != a:
                    raise not_plain
            except OSError:
                raise not_plain from None
            conds = get("conditions")
            ready: Any
            serving: Any
            terminating: Any
            if conds is None:
                ready = serving = True
                terminating = False
            elif type(conds) is dict:
                # identity, not ==: 1 == True, and a 1 is invalid here
                ready = conds.get("ready")
                serving = conds.get("serving")
                terminating = conds.get("terminating")
                if ready is None:
                    ready = True
                elif ready is not True and ready is not False:
                    raise not_plain
                if serving is None:
                    serving = ready
                elif serving is not True and serving is not False:
                    raise not_plain
                if terminating is None:
                    terminating = False
                elif terminating is not True and terminating is not False:
                    raise not_plain
            else:
                raise not_plain
            hostname = get("hostname")
            if hostname is None:
                hostname = ""
            elif type(hostname) is not str or (hostname and not label(hostname)):
                raise not_plain
            # the shared strings of names seen before; None (not plain) when invalid or new
            node_name = get("nodeName")
            if node_name is None or node_name == "":
                node_name = ""
            else:
                node_name = node_names.get(node_name) if type(node_name) is str else None
                if node_name is None:
                    raise not_plain
            zone = get("zone")
            if zone is None or zone == "":
                zone = ""
            else:
                zone = zones.get(zone) if type(zone) is str else None
                if zone is None:
                    raise not_plain
            pod_name: Any = ""
            pod_ns: Any = ""
            ref = get("targetRef")
            if ref is not None:
                if type(ref) is not dict:
                    raise not_plain
                if ref.get("kind") == "Pod":
                    pod_name = ref.get("name")
                    if pod_name is None:
                        pod_name = ""
                    elif type(pod_name) is not str or (pod_name and not subdomain(pod_name)):
                        raise not_plain
                    pod_ns = ref.get("namespace")
                    if pod_ns is not None and pod_ns != ns:
                        raise not_plain
                    pod_ns = ns
        except not_plain:
            append(_endpoint(ep, i, IPV4, ns))
            continue
        append(E((a,), ready, serving, terminating, hostname, node_name, zone, None, pod_name, pod_ns))
    return out


def _bad_address(value: Any, where: str) -> str:
    raise InvalidObject(f"{where}.addresses: expected strings, got {type(value).__name__} {value!r}"[:200])


# (name, protocol, port) as written -> the EndpointPort they make (only valid ones are kept)
_EP_PORTS: dict[tuple, EndpointPort] = {}


def _ep_port_key(p: Any) -> tuple | None:
    """_EP_PORTS' key for a port of exact types (str or null, an int port): with them equal
    keys mean equal fields (8080.0 == 8080 and True == 1 do not get in)."""
    if type(p) is not dict:
        return None
    name, proto, port = p.get("name"), p.get("protocol"), p.get("port")
    if type(port) is not int or not (name is None or type(name) is str) \
            or not (proto is None or type(proto) is str):
        return None
    return (name, proto, port)


def endpointslice_from_dict(obj: dict) -> EndpointSlice:
    ns, name, labels, annotations = _meta(obj, True)
    service = labels.get(SERVICE_NAME_LABEL)
    if not isinstance(service, str) or not service:
        raise InvalidObject(f"metadata.labels: missing {SERVICE_NAME_LABEL}")
    # Only a Service's name can match a Service: anything else could never be used.
    if not _DNS1035_LABEL.match(service):
        _name(service, _DNS1035_LABEL, "Service name (DNS-1035 label)", f"metadata.labels[{SERVICE_NAME_LABEL}]")
    atype = _get(obj, "addressType", str, None, where="")
    if atype not in (IPV4, IPV6, FQDN):
        raise InvalidObject(f"addressType: invalid value {atype!r}")
    eps = _get(obj, "endpoints", list, [], where="")
    endpoints = tuple(_plain_endpoints(eps, ns) if atype == IPV4 else
                      [_endpoint(ep, i, atype, ns) for i, ep in enumerate(eps)])
    ports = []
    for i, p in enumerate(_get(obj, "ports", list, [], where="")):
        key = _ep_port_key(p)
        if key is not None:   # slices repeat a few ports: one shared record for each
            got = _EP_PORTS.get(key)
            if got is not None:
                ports.append(got)
                continue
        where = f"ports[{i}]"
        if type(p) is not dict:
            raise InvalidObject(f"{where}: expected a mapping")
        pname = _opt_str(p, "name", where)
        if pname:
            _name(pname, _DNS1123_LABEL, "port name (DNS-1123 label)", f"{where}.name")
        port = p.get("port")
        rec = EndpointPort(name=pname, protocol=_protocol(p.get("protocol"), where),
                           port=None if port is None else _port_number(port, f"{where}.port"))
        if key is not None:
            if len(_EP_PORTS) > 4096:
                _EP_PORTS.clear()
            _EP_PORTS[key] = rec
        ports.append(rec)
    return EndpointSlice(ns, name, service, atype, endpoints, tuple(ports),
                         _parse_time(annotations.get(TRIGGER_TIME_ANNOTATION)))


def namespace_from_dict(obj: dict) -> Namespace:
    _, name, labels, _ = _meta(obj, False, _DNS1123_LABEL, "namespace name (DNS-1123 label)")
    return Namespace(name, _labels(labels))


def pod_from_dict(obj: dict) -> Pod:
    ns, name, _, _ = _meta(obj, True)
    meta = obj["metadata"]
    spec = _get(obj, "spec", dict, {}, where="")
    status = _get(obj, "status", dict, {}, where="")
    ips = [x.get("ip") for x in _get(status, "podIPs", list, [], where="status") if isinstance(x, dict)]
    if not ips and status.get("podIP"):
        ips = [status["podIP"]]
    return Pod(ns, name, tuple(_ip(v, f"status.podIPs[{i}]") for i, v in enumerate(ips)),
               node_name=_get(spec, "nodeName", str, "", where="spec"),
               host_network=bool(spec.get("hostNetwork", False)),
               phase=_get(status, "phase", str, "Running", where="status"),
               deleting=meta.get("deletionTimestamp") is not None)


def node_from_dict(obj: dict) -> Node:
    _, name, labels, _ = _meta(obj, False)
    status = _get(obj, "status", dict, {}, where="")
    addrs = _get(status, "addresses", list, [], where="status")
    ordered = [a for t in ("InternalIP", "ExternalIP") for a in addrs
               if isinstance(a, dict) and a.get("type") == t]
    return Node(name, tuple(_ip(a.get("address"), "status.addresses") for a in ordered), _labels(labels))


CONVERTERS: dict[str, Callable[[dict], Any]] = {
    "Service": service_from_dict,
    "EndpointSlice": endpointslice_from_dict,
    "Namespace": namespace_from_dict,
    "Pod": pod_from_dict,
    "Node": node_from_dict,
}

API_VERSIONS = {
    "Service": ("v1",), "Namespace": ("v1",), "Pod": ("v1",), "Node": ("v1",),
    "EndpointSlice": ("discovery.k8s.io/v1",),
}


def object_name(obj: Any) -> str:
    """A printable ns/name for messages, whatever the object's shape."""
    meta = obj.get("metadata") if isinstance(obj, dict) else None
    if not isinstance(meta, dict):
        return "?"
    ns, name = meta.get("namespace"), meta.get("name")
    ns = ns if isinstance(ns, str) else ""
    name = name if isinstance(name, str) else "?"   # never repr() a hostile value of any depth
    return f"{ns}/{name}" if ns else name


def convert(kind: str, obj: dict) -> Any:
    """Convert one raw object of a known kind; raises InvalidObject."""
    try:
        return CONVERTERS[kind](obj)
    except InvalidObject:
        raise
    except (AttributeError, TypeError, KeyError, ValueError) as exc:
        raise InvalidObject(f"malformed object: {exc}"[:200]) from None
