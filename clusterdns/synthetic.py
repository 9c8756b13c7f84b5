"""Generated cluster states of any size, for benchmarks and scale tests.

Deterministic for the same arguments. Addresses: ClusterIPs in 10.96.0.0/12
(IPv4) and fd00:96::/108-ish (IPv6, when dual_stack); endpoints in 10.0.0.0/8.
"""
from __future__ import annotations

import ipaddress
import json
from typing import Any

from .model import (
    CLUSTER_IP,
    IPV4,
    NODE_PORT,
    Endpoint,
    EndpointPort,
    EndpointSlice,
    Namespace,
    Node,
    Service,
    ServicePort,
)

SERVICE_BASE = int(ipaddress.ip_address("10.96.0.0"))
POD_BASE = int(ipaddress.ip_address("10.0.0.0"))


def synthetic_records(services: int = 1000, endpoints: int = 10, namespaces: int = 10,
                      headless_every: int = 0, nodeport_every: int = 0,
                      node_name: str = "node-0", nodes: int = 2) -> list[tuple[str, Any]]:
    """(kind, record) pairs: `services` Services with `endpoints` ready endpoints each.

    Service i is `svc-i` in namespace `ns-(i % namespaces)`; one TCP port 80
    named "http" (target 8080). Every `headless_every`-th service is headless
    and every `nodeport_every`-th a NodePort (0 disables either).
    """
    out: list[tuple[str, Any]] = [("Namespace", Namespace(f"ns-{n}")) for n in range(namespaces)]
    out += [("Node", Node(f"node-{n}", (f"192.168.0.{n + 2}",),
                          (("topology.kubernetes.io/zone", f"zone-{n % 3}"),))) for n in range(nodes)]
    next_ep = POD_BASE + 256
    for i in range(services):
        ns, name = f"ns-{i % namespaces}", f"svc-{i}"
        headless = bool(headless_every) and i % headless_every == 0
        nodeport = bool(nodeport_every) and not headless and i % nodeport_every == 0
        cip = () if headless else (str(ipaddress.ip_address(SERVICE_BASE + 1 + i)),)
        port = ServicePort("http", "TCP", 80, 30000 + (i % 2767) if nodeport else 0, 8080)
        out.append(("Service", Service(ns, name, NODE_PORT if nodeport else CLUSTER_IP, cip,
                                       headless=headless, ports=(port,))))
        eps = []
        for j in range(endpoints):
            ip = str(ipaddress.ip_address(next_ep))
            next_ep += 1
            eps.append(Endpoint((ip,), node_name=f"node-{j % nodes}", pod_name=f"{name}-{j}",
                                pod_namespace=ns, zone=f"zone-{j % 3}"))
        out.append(("EndpointSlice", EndpointSlice(ns, f"{name}-abcde", name, "IPv4", tuple(eps),
                                                   (EndpointPort("http", "TCP", 8080),))))
    return out


def to_manifest(records: list[tuple[str, Any]]) -> str:
    """The records as a kubectl-style JSON List, so a server can load them with --manifest."""
    items: list[dict] = []
    for kind, r in records:
        if kind == "Namespace":
            items.append({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": r.name}})
        elif kind == "Node":
            items.append({"apiVersion": "v1", "kind": "Node",
                          "metadata": {"name": r.name, "labels": dict(r.labels)},
                          "status": {"addresses": [{"type": "InternalIP", "address": a} for a in r.addresses]}})
        elif kind == "Service":
            spec: dict[str, Any] = {"type": r.type, "ports": [
                {"name": p.name, "protocol": p.protocol, "port": p.port, "targetPort": p.target_port,
                 **({"nodePort": p.node_port} if p.node_port else {})} for p in r.ports]}
            spec["clusterIPs"] = list(r.cluster_ips) if not r.headless else ["None"]
            spec["clusterIP"] = spec["clusterIPs"][0]
            items.append({"apiVersion": "v1", "kind": "Service",
                          "metadata": {"name": r.name, "namespace": r.namespace}, "spec": spec})
        elif kind == "EndpointSlice":
            items.append({
                "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                "metadata": {"name": r.name, "namespace": r.namespace,
                             "labels": {"kubernetes.io/service-name": r.service}},
                "addressType": r.address_type,
                "endpoints": [{"addresses": list(e.addresses), "conditions": {"ready": e.ready},
                               "nodeName": e.node_name, "zone": e.zone,
                               "targetRef": {"kind": "Pod", "name": e.pod_name, "namespace": e.pod_namespace}}
                              for e in r.endpoints],
                "ports": [{"name": p.name, "protocol": p.protocol, "port": p.port} for p in r.ports]})
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": items})


def envelope_records(services: int = 10000, endpoints: int = 150000, big: int = 5000, headless: int = 1000,
                     namespaces: int = 10, slice_size: int = 100, nodes: int = 2) -> list[tuple[str, Any]]:
    """Kubernetes' scalability envelope: `services` Services holding `endpoints` endpoints in all.

    `big` (ClusterIP) and `big-headless` in ns-0 select the same `big` Pods, each through its own
    EndpointSlices of `slice_size` endpoints (as the EndpointSlice controller cuts them);
    `headless` Services are headless, big-headless among them; the other Services share what is
    left of `endpoints` as evenly as integers allow, one slice each. Endpoints carry no hostname
    (Deployment Pods): their DNS names are dashed addresses. Port "http" TCP 80 -> 8080 on all.
    """
    out: list[tuple[str, Any]] = [("Namespace", Namespace(f"ns-{n}")) for n in range(namespaces)]
    out += [("Node", Node(f"node-{n}", (f"192.168.0.{n + 2}",),
                          (("topology.kubernetes.io/zone", f"zone-{n % 3}"),))) for n in range(nodes)]
    port = ServicePort("http", "TCP", 80, 0, 8080)
    eport = (EndpointPort("http", "TCP", 8080),)
    next_ep = POD_BASE + 256

    def pods(n: int, owner: str, ns: str) -> list[Endpoint]:
        nonlocal next_ep
        eps = [Endpoint((str(ipaddress.ip_address(next_ep + j)),), node_name=f"node-{j % nodes}",
                        pod_name=f"{owner}-{j}", pod_namespace=ns, zone=f"zone-{j % 3}") for j in range(n)]
        next_ep += n
        return eps

    big_pods = pods(big, "big", "ns-0")
    for name, is_headless in (("big", False), ("big-headless", True)):
        cip = () if is_headless else (str(ipaddress.ip_address(SERVICE_BASE + 1)),)
        out.append(("Service", Service("ns-0", name, CLUSTER_IP, cip, headless=is_headless, ports=(port,))))
        for k in range(0, big, slice_size):
            out.append(("EndpointSlice", EndpointSlice("ns-0", f"{name}-{k // slice_size:03d}", name, IPV4,
                                                       tuple(big_pods[k:k + slice_size]), eport)))
    rest, left = services - 2, endpoints - 2 * big
    headless_left = headless - 1
    every = max(1, rest // headless_left) if headless_left > 0 else 0
    for i in range(rest):
        ns, name = f"ns-{i % namespaces}", f"svc-{i}"
        is_headless = bool(every) and i % every == 0 and headless_left > 0
        headless_left -= is_headless
        cip = () if is_headless else (str(ipaddress.ip_address(SERVICE_BASE + 2 + i)),)
        out.append(("Service", Service(ns, name, CLUSTER_IP, cip, headless=is_headless, ports=(port,))))
        n = left // rest + (1 if i < left % rest else 0)
        out.append(("EndpointSlice", EndpointSlice(ns, f"{name}-abcde", name, IPV4, tuple(pods(n, name, ns)), eport)))
    return out
