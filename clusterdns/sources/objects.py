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

_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_DNS1123_SUBDOMAIN = re.compile(
    r"^(?=.{1,253}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


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
    try:
        return str(ipaddress.ip_address(value.strip()))
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


def _meta(obj: dict, namespaced: bool) -> tuple[str, str, dict, dict]:
    meta = _get(obj, "metadata", dict, where="")
    if meta is None:
        raise InvalidObject("metadata: missing")
    name = _get(meta, "name", str, where="metadata")
    if not name:
        raise InvalidObject("metadata.name: missing")
    ns = ""
    if namespaced:
        ns = _get(meta, "namespace", str, "default", where="metadata")
    labels = _get(meta, "labels", dict, {}, where="metadata")
    annotations = _get(meta, "annotations", dict, {}, where="metadata")
    return ns, name, labels, annotations


def _labels(labels: dict) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((str(k), str(v)) for k, v in labels.items()))


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


def service_from_dict(obj: dict) -> Service:
    ns, name, labels, annotations = _meta(obj, True)
    spec = _get(obj, "spec", dict, {}, where="")
    stype = _get(spec, "type", str, CLUSTER_IP, where="spec")
    if stype not in SERVICE_TYPES:
        raise InvalidObject(f"spec.type: unknown service type {stype!r}")
    headless = False
    cluster_ips: list[str] = []
    if stype != EXTERNAL_NAME:
        raw_ips = _get(spec, "clusterIPs", list, None, where="spec")
        if raw_ips is None:
            one = spec.get("clusterIP")
            raw_ips = [] if one is None or one == "" else [one]
        for i, raw in enumerate(raw_ips):
            if raw == "None":
                headless = True
                continue
            cluster_ips.append(_ip(raw, f"spec.clusterIPs[{i}]"))
        if len({ipaddress.ip_address(ip).version for ip in cluster_ips}) != len(cluster_ips):
            raise InvalidObject("spec.clusterIPs: two addresses of one family")
    external_name = ""
    if stype == EXTERNAL_NAME:
        external_name = _get(spec, "externalName", str, "", where="spec").rstrip(".").lower()
        if not external_name or not _DNS1123_SUBDOMAIN.match(external_name):
            raise InvalidObject(f"spec.externalName: invalid name {spec.get('externalName')!r}")
    ports = []
    seen = set()
    for i, p in enumerate(_get(spec, "ports", list, [], where="spec")):
        where = f"spec.ports[{i}]"
        pname = _get(p, "name", str, "", where=where)
        proto = _protocol(p.get("protocol"), where)
        port = _port_number(p.get("port"), f"{where}.port")
        node_port = _port_number(p.get("nodePort", 0), f"{where}.nodePort", allow_zero=True)
        target = p.get("targetPort")
        if target is not None and not isinstance(target, (int, str)):
            raise InvalidObject(f"{where}.targetPort: must be an integer or a string")
        if (pname, proto) in seen:
            raise InvalidObject(f"{where}: duplicate port name {pname!r}/{proto}")
        seen.add((pname, proto))
        ports.append(ServicePort(pname, proto, port, node_port, target))
    ext_ips = tuple(_ip(v, f"spec.externalIPs[{i}]")
                    for i, v in enumerate(_get(spec, "externalIPs", list, [], where="spec")))
    lb_ips: list[str] = []
    if stype == LOAD_BALANCER:
        status = _get(obj, "status", dict, {}, where="")
        lb = _get(status, "loadBalancer", dict, {}, where="status")
        for i, ing in enumerate(_get(lb, "ingress", list, [], where="status.loadBalancer")):
            if not isinstance(ing, dict):
                raise InvalidObject(f"status.loadBalancer.ingress[{i}]: expected a mapping")
            if ing.get("ip") and ing.get("ipMode") != "Proxy":
                lb_ips.append(_ip(ing["ip"], f"status.loadBalancer.ingress[{i}].ip"))
    ranges = tuple(_cidr(v, f"spec.loadBalancerSourceRanges[{i}]")
                   for i, v in enumerate(_get(spec, "loadBalancerSourceRanges", list, [], where="spec")))
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
    etp = _get(spec, "externalTrafficPolicy", str, "Cluster", where="spec")
    itp = _get(spec, "internalTrafficPolicy", str, "Cluster", where="spec")
    hc = _port_number(spec.get("healthCheckNodePort", 0), "spec.healthCheckNodePort", allow_zero=True)
    topo = any(str(annotations.get(a, "")) not in ("", "disabled", "Disabled") for a in TOPOLOGY_ANNOTATIONS)
    topo = topo or bool(spec.get("trafficDistribution"))
    return Service(
        namespace=ns, name=name, type=stype, cluster_ips=tuple(cluster_ips),
        headless=headless and not cluster_ips, external_name=external_name,
        ports=tuple(ports), external_ips=ext_ips, lb_ips=tuple(lb_ips),
        lb_source_ranges=ranges, affinity_timeout=timeout,
        external_local=etp == "Local",
        internal_local=itp == "Local", health_check_node_port=hc if etp == "Local" else 0,
        topology_aware=topo, proxy_name=str(labels.get(PROXY_NAME_LABEL, "")),
        labels=_labels(labels))


def _condition(conds: dict, key: str, where: str) -> bool | None:
    value = conds.get(key)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise InvalidObject(f"{where}.conditions.{key}: expected a boolean, got {value!r}"[:200])
    return value


def _parse_time(text: Any) -> float | None:
    if not isinstance(text, str):
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def endpointslice_from_dict(obj: dict) -> EndpointSlice:
    ns, name, labels, annotations = _meta(obj, True)
    service = labels.get(SERVICE_NAME_LABEL)
    if not isinstance(service, str) or not service:
        raise InvalidObject(f"metadata.labels: missing {SERVICE_NAME_LABEL}")
    atype = _get(obj, "addressType", str, None, where="")
    if atype not in (IPV4, IPV6, FQDN):
        raise InvalidObject(f"addressType: invalid value {atype!r}")
    endpoints = []
    for i, ep in enumerate(_get(obj, "endpoints", list, [], where="")):
        where = f"endpoints[{i}]"
        addrs = _get(ep, "addresses", list, [], where=where)
        if not addrs:
            raise InvalidObject(f"{where}.addresses: empty")
        if atype == FQDN:
            addresses = tuple(str(a) for a in addrs)
        else:
            addresses = tuple(_ip(a, f"{where}.addresses[{j}]") for j, a in enumerate(addrs))
            want = 4 if atype == IPV4 else 6
            if any((6 if ":" in a else 4) != want for a in addresses):   # canonical forms: IPv6 has ":"
                raise InvalidObject(f"{where}.addresses: not of addressType {atype}")
        conds = _get(ep, "conditions", dict, {}, where=where)
        ready = _condition(conds, "ready", where)
        serving = _condition(conds, "serving", where)
        terminating = _condition(conds, "terminating", where)
        ready = True if ready is None else ready
        hostname = _get(ep, "hostname", str, "", where=where)
        if hostname and not _DNS1123_LABEL.match(hostname):
            raise InvalidObject(f"{where}.hostname: not a DNS label {hostname!r}")
        ref = _get(ep, "targetRef", dict, {}, where=where)
        hints = _get(ep, "hints", dict, None, where=where)
        hint_zones = None
        if hints is not None:
            hint_zones = tuple(str(z.get("name", "")) for z in _get(hints, "forZones", list, [], where=f"{where}.hints")
                               if isinstance(z, dict))
        endpoints.append(Endpoint(
            addresses=addresses, ready=ready,
            serving=ready if serving is None else serving,
            terminating=bool(terminating), hostname=hostname,
            node_name=_get(ep, "nodeName", str, "", where=where),
            zone=_get(ep, "zone", str, "", where=where), hint_zones=hint_zones,
            pod_name=str(ref.get("name", "")) if ref.get("kind") == "Pod" else "",
            pod_namespace=str(ref.get("namespace", ns)) if ref.get("kind") == "Pod" else ""))
    ports = []
    for i, p in enumerate(_get(obj, "ports", list, [], where="")):
        where = f"ports[{i}]"
        port = p.get("port") if isinstance(p, dict) else None
        ports.append(EndpointPort(
            name=_get(p, "name", str, "", where=where),
            protocol=_protocol(p.get("protocol"), where),
            port=None if port is None else _port_number(port, f"{where}.port")))
    return EndpointSlice(ns, name, service, atype, tuple(endpoints), tuple(ports),
                         _parse_time(annotations.get(TRIGGER_TIME_ANNOTATION)))


def namespace_from_dict(obj: dict) -> Namespace:
    _, name, labels, _ = _meta(obj, False)
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
    return f"{ns}/{name}" if ns else str(name)


def convert(kind: str, obj: dict) -> Any:
    """Convert one raw object of a known kind; raises InvalidObject."""
    try:
        return CONVERTERS[kind](obj)
    except InvalidObject:
        raise
    except (AttributeError, TypeError, KeyError, ValueError) as exc:
        raise InvalidObject(f"malformed object: {exc}"[:200]) from None
