"""Slim, frozen records of the cluster objects clusterdns uses.

Raw Kubernetes objects stop at the source layer (see sources/objects.py);
everything downstream (DNS zone, proxier, trace) reads only these records.
"""
from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from operator import attrgetter
from types import MemberDescriptorType

TCP, UDP, SCTP = "TCP", "UDP", "SCTP"
PROTOCOLS = (TCP, UDP, SCTP)

CLUSTER_IP, NODE_PORT, LOAD_BALANCER, EXTERNAL_NAME = (
    "ClusterIP", "NodePort", "LoadBalancer", "ExternalName")
SERVICE_TYPES = (CLUSTER_IP, NODE_PORT, LOAD_BALANCER, EXTERNAL_NAME)

IPV4, IPV6, FQDN = "IPv4", "IPv6", "FQDN"


def _fast_init(cls):
    """A frozen dataclass's __init__ sets each field through object.__setattr__ (looked up by
    name every time): 1.4 us for an Endpoint, 100,000 of them at every load of a 10,000-Service
    state. Setting the slots through their descriptors directly takes half that."""
    fs = fields(cls)
    if any(f.default_factory is not MISSING or not f.init  # type: ignore[misc]
           or not isinstance(getattr(cls, f.name, None), MemberDescriptorType) for f in fs):
        return   # only plain slots fields
    env = {f"_s{i}": getattr(cls, f.name).__set__ for i, f in enumerate(fs)}
    params = []
    for i, f in enumerate(fs):
        if f.default is MISSING:
            params.append(f.name)
        else:
            env[f"_d{i}"] = f.default
            params.append(f"{f.name}=_d{i}")
    body = "".join(f"  _s{i}(self, {f.name})\n" for i, f in enumerate(fs))
    src = f"def _make({', '.join(env)}):\n def __init__(self, {', '.join(params)}):\n{body} return __init__\n"
    ns: dict = {}
    exec(src, ns)   # built from the class's own field names only
    init = ns["_make"](**env)
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__doc__ = cls.__init__.__doc__
    cls.__init__ = init


def _picklable(cls):
    """Pickle as cls(*fields): the manifest parse worker streams 100,000s of records to the
    agent, and the slots dataclass default (a __setstate__ loop in Python) unpickles at half the speed."""
    _fast_init(cls)
    names = tuple(f.name for f in fields(cls))
    get = attrgetter(*names)
    if len(names) == 1:
        cls.__reduce__ = lambda self: (cls, (get(self),))
    else:
        cls.__reduce__ = lambda self: (cls, get(self))
    return cls


@_picklable
@dataclass(frozen=True, slots=True)
class ServicePort:
    name: str            # "" for an unnamed port
    protocol: str        # TCP, UDP or SCTP
    port: int
    node_port: int = 0   # 0 when not allocated
    target_port: int | str | None = None


@_picklable
@dataclass(frozen=True, slots=True)
class Service:
    namespace: str
    name: str
    type: str = CLUSTER_IP
    cluster_ips: tuple[str, ...] = ()       # canonical text, first is primary
    headless: bool = False                   # clusterIP: None
    external_name: str = ""                  # ExternalName target, no trailing dot
    ports: tuple[ServicePort, ...] = ()
    external_ips: tuple[str, ...] = ()
    lb_ips: tuple[str, ...] = ()             # status ingress IPs (ipMode Proxy excluded)
    lb_source_ranges: tuple[str, ...] = ()   # normalised CIDRs
    affinity_timeout: int = 0                # ClientIP affinity seconds; 0 = none
    external_local: bool = False             # externalTrafficPolicy: Local
    internal_local: bool = False             # internalTrafficPolicy: Local
    health_check_node_port: int = 0
    topology_aware: bool = False             # topology-mode annotation / trafficDistribution
    proxy_name: str = ""                     # service.kubernetes.io/service-proxy-name label
    labels: tuple[tuple[str, str], ...] = ()

    @property
    def key(self) -> tuple[str, str]:
        return (self.namespace, self.name)

    @property
    def is_external_name(self) -> bool:
        return self.type == EXTERNAL_NAME


@_picklable
@dataclass(frozen=True, slots=True)
class EndpointPort:
    name: str
    protocol: str
    port: int | None


@_picklable
@dataclass(frozen=True, slots=True)
class Endpoint:
    addresses: tuple[str, ...]
    ready: bool = True          # absent counts as ready
    serving: bool = True        # absent takes the value of ready
    terminating: bool = False
    hostname: str = ""
    node_name: str = ""
    zone: str = ""
    hint_zones: tuple[str, ...] | None = None   # None: no hints at all
    pod_name: str = ""          # targetRef name when kind is Pod
    pod_namespace: str = ""


@_picklable
@dataclass(frozen=True, slots=True)
class EndpointSlice:
    namespace: str
    name: str
    service: str                 # kubernetes.io/service-name label
    address_type: str = IPV4
    endpoints: tuple[Endpoint, ...] = ()
    ports: tuple[EndpointPort, ...] = ()
    trigger_time: float | None = None   # endpoints.kubernetes.io/last-change-trigger-time

    @property
    def key(self) -> tuple[str, str]:
        return (self.namespace, self.name)

    @property
    def service_key(self) -> tuple[str, str]:
        return (self.namespace, self.service)


@_picklable
@dataclass(frozen=True, slots=True)
class Namespace:
    name: str
    labels: tuple[tuple[str, str], ...] = ()


@_picklable
@dataclass(frozen=True, slots=True)
class Pod:
    namespace: str
    name: str
    ips: tuple[str, ...] = ()
    node_name: str = ""
    host_network: bool = False
    phase: str = "Running"
    deleting: bool = False

    @property
    def key(self) -> tuple[str, str]:
        return (self.namespace, self.name)

    @property
    def live(self) -> bool:
        """Counted by CoreDNS's pod cache (not finished, not being deleted)."""
        return not self.deleting and self.phase not in ("Succeeded", "Failed", "Unknown")


@_picklable
@dataclass(frozen=True, slots=True)
class Node:
    name: str
    addresses: tuple[str, ...] = ()     # InternalIP first, then ExternalIP
    labels: tuple[tuple[str, str], ...] = ()

    @property
    def zone(self) -> str:
        return dict(self.labels).get("topology.kubernetes.io/zone", "")


# The kinds a source delivers, in the order a full state is built.
KINDS = ("Namespace", "Service", "EndpointSlice", "Pod", "Node")


@dataclass(frozen=True, slots=True)
class Invalid:
    """An object that failed validation: kept only to be reported."""
    kind: str
    name: str
    reason: str
    extra: dict = field(default_factory=dict, compare=False)
