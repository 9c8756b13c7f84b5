"""The zone view: what the served zones contain, compiled from one ClusterState.

`ZoneView(cfg, state, prev)` indexes the state (per-Service data is reused from
`prev` when the Service and its EndpointSlices are unchanged, so an update at
10,000 services costs milliseconds), and `lookup(labels, qtype)` answers one
question inside a served zone with dnslib records, deciding NXDOMAIN vs NODATA
as CoreDNS's kubernetes plugin does (see docs/dns.md for where we differ).
Wire bytes are not made here: the engine packs and memoises them.
"""
from __future__ import annotations

import ipaddress
import socket
from collections import OrderedDict
from operator import itemgetter
from typing import Callable, Iterable, Iterator

from dnslib import AAAA as RD_AAAA
from dnslib import CNAME as RD_CNAME
from dnslib import NS as RD_NS
from dnslib import PTR as RD_PTR
from dnslib import RD, RR, DNSLabel
from dnslib import SOA as RD_SOA
from dnslib import SRV as RD_SRV
from dnslib import TXT as RD_TXT
from dnslib import A as RD_A

from ..config import Config
from ..lifetime import gc_paused
from ..model import EXTERNAL_NAME, IPV4, IPV6, EndpointSlice, Service
from ..state import ClusterState
from . import names
from .names import Labels, Selector
from .wire import AAAA, ANY, CNAME, NOERROR, NS, NXDOMAIN, PTR, SERVFAIL, SOA, SRV, TXT, A

SCHEMA_VERSION = "1.1.0"
BIG = 200                 # endpoints or ports beyond which a Service's records are made lazily
VERSION_TTL = 28800
HINFO_RDATA = RD(b"\x07RFC8482\x00")   # RFC 8482 section 4.2: the minimal answer to ANY
REPLIES_BUDGET = 8 << 20   # bytes of whole replies kept per state version (ZoneView.replies)
REPLY_OVERHEAD = 120       # a kept reply's two bytes objects and dict slot beyond their data


def label(parts: Labels) -> DNSLabel:
    return DNSLabel(tuple(p.encode("latin-1") for p in parts))


class _AddressRR(RR):
    """An A/AAAA record made without dnslib's per-field checks and address parsing (the
    fields come from validated state); packs and reads as any dnslib RR."""
    rname = None     # plain attributes in place of dnslib's checked properties
    rtype = A
    rclass = 1
    ttl = 0

    def __init__(self, rname: DNSLabel, rtype: int, ttl: int, rdata: RD) -> None:
        self.rname, self.rtype, self.ttl, self.rdata = rname, rtype, ttl, rdata


class _AddressRD4(RD_A):
    data = None

    def __init__(self, data: tuple) -> None:
        self.data = data


class _AddressRD6(RD_AAAA):
    data = None

    def __init__(self, data: tuple) -> None:
        self.data = data


def address_rr(owner: DNSLabel, ip: str, ttl: int) -> RR:
    """The A or AAAA record of `ip` (a valid address) at `owner`."""
    if ":" in ip:
        return _AddressRR(owner, AAAA, ttl, _AddressRD6(tuple(socket.inet_pton(socket.AF_INET6, ip))))
    return _AddressRR(owner, A, ttl, _AddressRD4(tuple(socket.inet_pton(socket.AF_INET, ip))))


class Lru(OrderedDict):
    """A table that drops its least recently used entry when full. The engine's fast path
    reads it with get() + move_to_end(), both C calls: a hit is the hottest line of the
    server, and cachetools' LRUCache spends four interpreted calls on one."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        if len(self) > self.limit:
            self.popitem(last=False)

    def hit(self, key):
        """get() that counts as a use."""
        v = self.get(key)
        if v is not None:
            self.move_to_end(key)
        return v


class BigAnswer(Exception):
    """lookup(big_ok=False) met a big Service: build the answer where it cannot stall others."""


class Lazy:
    """Records of a big Service, made only as they are packed (wire.pack_body stops at its
    budget, so a reply never costs more than what it can carry). Iterable again and again."""
    __slots__ = ("make", "nonempty")

    def __init__(self, make: Callable[[], Iterator[RR]], nonempty: bool) -> None:
        self.make, self.nonempty = make, nonempty

    def __iter__(self) -> Iterator[RR]:
        return self.make()

    def __bool__(self) -> bool:
        return self.nonempty


def chain(first: list, rest) -> "list | Lazy":
    """first + rest, lazily when rest is Lazy."""
    if isinstance(rest, Lazy):
        return Lazy(lambda: _chain(first, rest), bool(first) or rest.nonempty)
    return first + rest


def _chain(first: list, rest: Lazy) -> Iterator[RR]:
    yield from first
    yield from rest


class Answer:
    """One zone answer: rcode and sections (dnslib records)."""
    __slots__ = ("rcode", "answer", "authority", "additional", "cacheable", "chase", "zone", "dep")

    def __init__(self, rcode: int, answer: list | None = None, authority: list | None = None,
                 additional: list | None = None, cacheable: bool = True,
                 chase: Labels | None = None, zone: Labels = (), dep=None) -> None:
        self.rcode = rcode
        self.answer = answer if answer is not None else []
        self.authority = authority if authority is not None else []
        self.additional = additional if additional is not None else []
        self.cacheable = cacheable
        self.chase = chase          # ExternalName target outside the zones, to ask upstream
        self.zone = zone
        # (service key, ServiceData) when the records come from that Service alone: the answer
        # stays true in a later state version as long as that ServiceData is still current
        self.dep = dep


class _Res:
    """A name that exists: records of the asked type (maybe none), whether it holds any data."""
    __slots__ = ("answer", "additional", "has_data", "cname", "cacheable", "sd")

    def __init__(self, answer=None, additional=None, has_data=True, cname=None, cacheable=True, sd=None):
        self.answer = answer or []
        self.additional = additional or []
        self.has_data = has_data
        self.cname = cname
        self.cacheable = cacheable
        self.sd = sd


_ENT = _Res(has_data=False)


class ServiceData:
    """What DNS needs of one Service and its EndpointSlices; reused while both are unchanged.

    The endpoint entries (`ready` and what is counted from them) of a ClusterIP Service are
    made on first use: its A, AAAA, SRV and PTR answers never need them, so at 10,000
    Services most are never made (~12 MB and 0.1 s of the start at 100,000 endpoints).
    A headless Service's, which every one of its answers needs, are made at once."""
    __slots__ = ("svc", "slices", "kind", "ips4", "ips6", "_ready", "_by_name", "_eps_by_name", "target",
                 "_srv_count", "_port_entries", "_port_counts", "_big", "_families", "_pod_names", "_noendpoints",
                 "_names_by_ip", "_parts", "_addresses", "_names")

    def __init__(self, svc: Service, slices: tuple[EndpointSlice, ...], pod_names: bool, noendpoints: bool,
                 prev: "ServiceData | None" = None):
        self.svc, self.slices = svc, slices
        if svc.type == EXTERNAL_NAME:
            self.kind = "external"
            target = names.split_name(svc.external_name)
            valid = target and all(0 < len(x) < 64 for x in target) and len(".".join(target)) < 254
            self.target = target if valid else ()    # an unusable target: the Service is not served
        elif svc.headless or not svc.cluster_ips:
            self.kind = "headless"
            self.target = ()
        else:
            self.kind = "cluster"
            self.target = ()
        self.ips4 = tuple(ip for ip in svc.cluster_ips if ":" not in ip)
        self.ips6 = tuple(ip for ip in svc.cluster_ips if ":" in ip)
        self._pod_names, self._noendpoints = pod_names, noendpoints
        self._ready: tuple[tuple, ...] | None = None
        self._big: bool | None = None
        self._names_by_ip: dict[str, list[str]] | None = None
        # a Service of several slices keeps each slice's entries, so that its next version
        # (one slice changed) makes only that slice's; and, when big, its address set
        self._parts: tuple[tuple, ...] | None = None
        self._addresses: frozenset[str] | None = None
        self._names: list | None = None    # with _parts: each slice's name -> entries, made when asked
        if self.kind == "headless":
            self._make_ready(prev)   # every answer of a headless Service is made of them
        self._families: tuple[bool, bool] | None = None
        self._by_name: dict[str, list[str]] | None = None
        self._eps_by_name: dict[str, list[tuple]] | None = None

    def ready_addresses(self) -> Iterator[str]:
        """The address of each ready endpoint entry (as `ready` lists them), without making them."""
        if self._noendpoints or self.kind == "external":
            return
        for sl in self.slices:
            if sl.address_type not in (IPV4, IPV6):
                continue
            for ep in sl.endpoints:
                if ep.ready:
                    yield from ep.addresses

    @property
    def ready(self) -> tuple[tuple, ...]:
        """(endpoint name, address, ports of its slice) of every ready endpoint address."""
        if self._ready is None:
            self._make_ready()
        return self._ready   # type: ignore[return-value]

    @property
    def srv_count(self) -> int:
        if self._ready is None:
            self._make_ready()
        return self._srv_count

    @property
    def port_entries(self) -> int:
        if self._ready is None:
            self._make_ready()
        return self._port_entries

    @property
    def port_counts(self) -> dict[tuple[str, str], int]:
        if self._ready is None:
            self._make_ready()
        return self._port_counts

    @property
    def big(self) -> bool:
        """More than BIG ready endpoint addresses or ports: counted, not made (every first
        question about a Service asks this)."""
        big = self._big
        if big is None:
            big = len(self.svc.ports) > BIG
            if not big:
                n = 0
                for _ in self.ready_addresses():
                    n += 1
                    if n > BIG:
                        big = True
                        break
            self._big = big
        return big

    def _make_ready(self, prev: "ServiceData | None" = None) -> None:
        ready: list[tuple] = []    # (endpoint name, address, ports of its slice)
        # SRV weights need the number of matches before de-duplication: counted per slice here
        srv_count = port_entries = 0
        port_counts: dict[tuple[str, str], int] = {}
        parts: list[tuple] | None = [] if len(self.slices) > 1 else None
        had = {}
        if parts is not None and prev is not None and prev._parts is not None and prev._pod_names == self._pod_names:
            had = {id(sl): part for sl, part in zip(prev.slices, prev._parts)}   # prev keeps them alive
        if not self._noendpoints and self.kind != "external":
            for sl in self.slices:
                part = had.get(id(sl))
                if part is None:
                    part = self._slice_entries(sl)
                if parts is not None:
                    parts.append(part)
                ready += part
                k = len(part)
                if k:
                    srv_count += k * max(1, len(sl.ports))
                    port_entries += k * len(sl.ports)
                    for p in sl.ports:
                        if p.name:
                            pk = (p.name.lower(), p.protocol.lower())
                            port_counts[pk] = port_counts.get(pk, 0) + k
        elif parts is not None:
            parts = [() for _ in self.slices]
        self._srv_count, self._port_entries, self._port_counts = srv_count, port_entries, port_counts
        self._ready = tuple(ready)
        self._parts = tuple(parts) if parts is not None else None
        if parts is not None:
            names = {}
            if had and prev is not None and prev._names is not None:
                names = {id(sl): d for sl, d in zip(prev.slices, prev._names) if d is not None}
            self._names = [names.get(id(sl)) for sl in self.slices]

    def _slice_entries(self, sl: EndpointSlice) -> tuple:
        if sl.address_type not in (IPV4, IPV6):
            return ()
        pod_names = self._pod_names
        out = []
        for ep in sl.endpoints:
            if not ep.ready:
                continue
            host = ep.hostname
            for ip in ep.addresses:
                if host and len(host) < 64:
                    name = host.lower()
                elif not pod_names and "." in ip:      # the common case, inlined
                    name = ip.replace(".", "-")
                else:
                    name = names.endpoint_name(host, ep.pod_name, ip, pod_names)
                out.append((name, ip, sl.ports))     # (_names_here names them alike)
        return tuple(out)

    def addresses(self, prev: "ServiceData | None" = None) -> frozenset[str]:
        """The ready endpoint addresses (as ready_addresses() yields them), kept for a big
        Service; a Service of several slices reuses prev's sets of the slices it shares."""
        got = self._addresses
        if got is not None:
            return got
        parts = None
        if self._noendpoints or self.kind == "external":
            got = frozenset()
        elif len(self.slices) > 1:
            had = {}
            if prev is not None and type(prev._addresses) is _Addresses:
                had = {id(sl): part for sl, part in zip(prev.slices, prev._addresses.parts)}
            parts = tuple([had.get(id(sl)) or _slice_addresses(sl) for sl in self.slices])
            got = frozenset().union(*parts)
        elif self._ready is not None:
            got = frozenset(map(_ENTRY_IP, self._ready))
        else:
            got = frozenset(self.ready_addresses())
        if len(got) > BIG:
            self._addresses = _Addresses(got, parts or ()) if parts else got
        return got

    def by_name(self) -> dict[str, list[str]]:
        """Endpoint name -> its addresses (no duplicates)."""
        if self._by_name is None:
            out: dict[str, list[str]] = {}
            eps: dict[str, list[tuple]] = {}
            for entry in self.ready:
                name, ip = entry[0], entry[1]
                eps.setdefault(name, []).append(entry)
                ips = out.setdefault(name, [])
                if ip not in ips:
                    ips.append(ip)
            self._by_name, self._eps_by_name = out, eps
        return self._by_name

    def endpoint_entries(self, name: str) -> list[tuple]:
        """The (name, address, ports) entries of the endpoints called `name`."""
        names = self._names
        if names is not None:
            # a Service of several slices: each slice's index, made when first asked and
            # taken over by the next version for the slices it keeps
            out: list[tuple] = []
            for i, d in enumerate(names):
                if d is None:   # made whole before it is shared (readers in other threads)
                    d = {}
                    for entry in self._parts[i]:      # type: ignore[index]
                        d.setdefault(entry[0], []).append(entry)
                    names[i] = d
                hit = d.get(name)
                if hit:
                    out += hit
            return out
        if self._eps_by_name is None:
            self.by_name()
        return self._eps_by_name.get(name, [])   # type: ignore[union-attr]

    def endpoint_ips(self, name: str) -> list[str]:
        """The addresses of the endpoints called `name` (no duplicates)."""
        if self._names is not None:
            return list(dict.fromkeys([e[1] for e in self.endpoint_entries(name)]))
        return self.by_name().get(name) or []

    @property
    def names_cheap(self) -> bool:
        """Endpoint names are looked up slice by slice (no Service-wide index to make): a
        big Service of small slices answers them as any other."""
        return self._names is not None and all(len(p) <= BIG for p in self._parts)   # type: ignore[union-attr]

    def names_at(self, ip: str) -> list[str]:
        """The names of the ready endpoints with this address, each once, in order (a PTR
        answer: a Service of a few endpoints is looked through without making its entries)."""
        ready = self._ready
        if ready is None:
            n = 0
            for sl in self.slices:
                n += len(sl.endpoints)
            if n <= BIG:
                return self._names_here(ip)
            ready = self.ready
        if len(ready) <= BIG:
            return list(dict.fromkeys(name for name, addr, _ in ready if addr == ip))
        index = self._names_by_ip
        if index is None:
            index = {}
            for name, addr, _ in ready:
                got = index.setdefault(addr, [])
                if name not in got:
                    got.append(name)
            self._names_by_ip = index
        return index.get(ip, [])

    def _names_here(self, ip: str) -> list[str]:
        out: list[str] = []
        for sl in self.slices:
            if sl.address_type not in (IPV4, IPV6):
                continue
            for ep in sl.endpoints:
                if ep.ready and ip in ep.addresses:
                    name = names.endpoint_name(ep.hostname, ep.pod_name, ip, self._pod_names)
                    if name not in out:
                        out.append(name)
        return out

    def ready_ips(self, v6: bool) -> list[str]:
        seen: dict[str, None] = {}
        for _, ip, _ in self.ready:
            if (":" in ip) == v6:
                seen[ip] = None
        return list(seen)

    def iter_ready_ips(self, v6: bool) -> Iterator[str]:
        """ready_ips(), made as consumed."""
        seen: set[str] = set()
        for _, ip, _ in self.ready:
            if (":" in ip) == v6 and ip not in seen:
                seen.add(ip)
                yield ip

    def has_family(self, v6: bool) -> bool:
        if self._families is None:
            has4 = has6 = False
            for _, ip, _ in self.ready:
                if ":" in ip:
                    has6 = True
                else:
                    has4 = True
                if has4 and has6:
                    break
            self._families = (has4, has6)
        return self._families[1 if v6 else 0]


def _match(want: str, have: str) -> bool:
    return want == have.lower()


class ZoneView:
    """The served zones as of one state version (immutable once built, except memo)."""

    def __init__(self, cfg: Config, state: ClusterState | None = None, prev: "ZoneView | None" = None,
                 selector: Selector | None = None,
                 server_addresses: Callable[[], list[str]] = lambda: [],
                 changed: "Iterable[tuple[str, str]] | None" = None) -> None:
        """changed (with prev): the Service keys whose Service or slices differ between
        prev.state and state; only those are looked at (None: every Service is compared)."""
        self.cfg = cfg
        self.state = state if state is not None else ClusterState()
        st = self.state
        self.selector = selector
        self.server_addresses = server_addresses
        self.ttl = cfg.dns.ttl
        self.serial = st.serial & 0xFFFFFFFF
        needed = ["Service", "EndpointSlice"]
        if cfg.dns.namespace_labels:
            needed.append("Namespace")
        if cfg.dns.pods == "verified" or cfg.dns.autopath:
            needed.append("Pod")
        self.synced = state is not None and st.is_synced(*needed)
        zones = [names.split_name(z) for z in cfg.dns.zones]
        self.zones = sorted(zones, key=len, reverse=True)
        forward = [z for z in zones if not names.is_reverse(z)]
        self.primary: Labels = forward[0] if forward else zones[0]
        # prebuilt answers (the engine's): asked again -> memo, asked once so far -> probation
        # (a flood of new names churns only that one); least recently used go when full
        self.memo = Lru(cfg.dns.memo_size)
        self.probation = Lru(cfg.dns.memo_probation)
        # whole UDP replies of memo answers but their ID, by the query's bytes after its ID
        # (the engine's first lookup); emptied when full (REPLIES_BUDGET bytes or as many
        # replies as the memo holds answers)
        self.replies: dict[bytes, bytes] = {}
        self._replies_size = 0
        self._soas: dict[Labels, RR] = {}
        if prev is not None and (prev.cfg is not cfg or prev.selector is not selector):
            prev = None
        if prev is None:
            changed = None
        # earlier versions' prebuilt answers, newest first: the engine takes over those still true
        self.carried: tuple[dict, ...] = ((prev.memo,) + prev.carried[:2]) if prev is not None else ()
        with gc_paused():   # compiling allocates many small objects: collections would only rescan the state
            self.by_service = st.slices_by_service   # the store's index, kept up to date per change
            self.services, changes = self._compile_services(prev, changed)
            if prev is not None and (not any((c[1] is None) != (c[2] is None) for c in changes)
                                     if changes is not None
                                     else prev.state.services.keys() == self.state.services.keys()):
                self.svc_namespaces = prev.svc_namespaces
            else:
                self.svc_namespaces = {k[0] for k in self.services}
            self._exposed: dict[str, bool] = {}
            self.cips, self.eps = self._index_addresses(prev, changes)

    def remember_reply(self, query: bytes, reply: bytes) -> None:
        """Keep `reply` (the message after its ID) for the query bytes after its ID."""
        size = len(query) + len(reply) + REPLY_OVERHEAD
        if self._replies_size + size > REPLIES_BUDGET or len(self.replies) >= self.memo.limit:
            self.replies.clear()        # a new working set: the hot names come back at once
            self._replies_size = 0
        self.replies[query] = reply
        self._replies_size += size

    # --- compile ---------------------------------------------------------------------

    def _compile_services(self, prev: "ZoneView | None", changed) -> tuple[dict, list | None]:
        """The ServiceData of every Service, and (key, old, new) of those that changed when
        `changed` tells which (None otherwise)."""
        old = prev.services if prev is not None else {}
        by_service = self.by_service
        pod_names, noeps = self.cfg.dns.endpoint_pod_names, self.cfg.dns.noendpoints
        if changed is not None:
            services = old.copy()
            changes = []
            for key in changed:
                svc = self.state.services.get(key)
                o = old.get(key)
                if svc is None:
                    if o is not None:
                        del services[key]
                        changes.append((key, o, None))
                    continue
                slices = by_service.get(key, ())
                if o is not None and o.svc is svc and o.slices == slices:
                    continue
                sd = services[key] = ServiceData(svc, slices, pod_names, noeps, o)
                changes.append((key, o, sd))
            return services, changes
        services = {}
        for key, svc in self.state.services.items():
            slices = by_service.get(key, ())
            o = old.get(key)
            if o is not None and o.svc is svc and o.slices == slices:
                services[key] = o
            else:
                services[key] = ServiceData(svc, slices, pod_names, noeps, o)
        return services, None

    def _indexed(self, sd: "ServiceData | None") -> bool:
        return sd is not None and sd.kind != "external" and self.exposed(sd.svc.namespace)

    def _index_addresses(self, prev: "ZoneView | None", changes: list | None) -> tuple[dict, "_AddressIndex"]:
        """address -> [(service, None)] for ClusterIPs, and address -> the key of the Service
        (a list of keys when several) whose ready endpoints have it: no per-endpoint list and
        tuple (13 MB at 100,000 endpoints); reverse() finds the endpoint names in the service's
        entries. Keyed by Service, an unchanged address stays as it is when its Service
        changes: a change costs the addresses it adds or removes."""
        rebuild = prev is None or (self.selector is not None and prev.state.namespaces is not self.state.namespaces)
        if rebuild:
            cips: dict[str, list] = {}
            eps = _AddressIndex()
            for key, sd in self.services.items():
                if self._indexed(sd):
                    for ip in sd.svc.cluster_ips:
                        _index_add(cips, "c", ip, (sd, None), None)
                    for ip in sd.ready_addresses():
                        eps.add(ip, key)
            eps.seal()
            return cips, eps
        assert prev is not None
        old, new = prev.services, self.services
        if changes is None:
            changes = [(k, old.get(k), new.get(k)) for k in old.keys() | new.keys() if old.get(k) is not new.get(k)]
        if not changes:
            return prev.cips, prev.eps
        cips = prev.cips.copy()
        eps = prev.eps.derive()
        copied: set = set()
        for key, o, sd in changes:
            was_in, now_in = prev._indexed(o), self._indexed(sd)
            if was_in:
                assert o is not None
                for ip in o.svc.cluster_ips:
                    lst = cips.get(ip)
                    if lst is not None:
                        keep = [x for x in lst if x[0] is not o]
                        if keep:
                            cips[ip] = keep
                        else:
                            del cips[ip]
                        copied.add(("c", ip))
            if now_in:
                assert sd is not None
                for ip in sd.svc.cluster_ips:
                    _index_add(cips, "c", ip, (sd, None), copied)
            before = o.addresses() if was_in and o is not None else frozenset()
            after = sd.addresses(o) if now_in and sd is not None else frozenset()
            for ip in before - after:
                eps.remove(ip, key)
            for ip in after - before:
                eps.add(ip, key)
        eps.seal()
        return cips, eps

    # --- namespaces ------------------------------------------------------------------

    def exposed(self, ns: str) -> bool:
        """The namespace exists and is served (--namespaces, --namespace-labels)."""
        r = self._exposed.get(ns)
        if r is None:
            r = self._compute_exposed(ns)
            # remembered for namespaces that exist only: asking unique names must not grow it
            if ns in self.state.namespaces or ns in self.svc_namespaces:
                self._exposed[ns] = r
        return r

    def _compute_exposed(self, ns: str) -> bool:
        cfg = self.cfg
        if cfg.dns.namespaces and ns not in cfg.dns.namespaces:
            return False
        obj = self.state.namespaces.get(ns)
        if self.selector is not None:
            return obj is not None and self.selector(dict(obj.labels))
        return obj is not None or ns in self.svc_namespaces

    def service(self, ns: str, name: str) -> ServiceData | None:
        """The served Service `name` in `ns`, or None (absent, hidden, or empty per the options)."""
        if not self.exposed(ns):
            return None
        sd = self.services.get((ns, name))
        if sd is None:
            return None
        if sd.kind == "headless" and not sd.ready:
            return None
        if sd.kind == "cluster" and self.cfg.dns.ignore_empty_service and next(sd.ready_addresses(), None) is None:
            return None
        if sd.kind == "external" and not sd.target:
            return None
        return sd

    # --- reverse index -----------------------------------------------------------------

    def reverse(self, ip: str) -> list[tuple["ServiceData", str | None]]:
        """Who owns an address: ClusterIPs win over endpoints (every name an address has)."""
        return self.cips.get(ip) or self.endpoints_at(ip)

    def endpoints_at(self, ip: str) -> list[tuple["ServiceData", str | None]]:
        """(service, endpoint name) of every ready endpoint with this address."""
        had = self.eps.get(ip)
        if had is None:
            return []
        out: list[tuple[ServiceData, str | None]] = []
        for key in (had if type(had) is list else (had,)):
            sd = self.services.get(key)
            if sd is not None:
                out += [(sd, name) for name in sd.names_at(ip)]
        return out

    # --- records -----------------------------------------------------------------------

    def soa(self, zone: Labels) -> RR:
        """The zone's SOA (one object per zone and view: records are only ever packed, never changed)."""
        rr = self._soas.get(zone)
        if rr is None:
            z = label(zone)
            rr = self._soas[zone] = RR(z, SOA, ttl=min(self.ttl, 300), rdata=RD_SOA(
                label(("ns", "dns") + zone), label(("hostmaster",) + zone),
                (self.serial, 7200, 1800, 86400, self.ttl)))
        return rr

    def _addr_lazy(self, owner: DNSLabel, ips: Callable[[], Iterator[str]], qtype: int, nonempty: bool) -> "Lazy":
        if qtype not in (A, AAAA):
            return Lazy(lambda: iter(()), False)
        ttl, v6 = self.ttl, qtype == AAAA

        def make() -> Iterator[RR]:
            for ip in ips():
                if (":" in ip) == v6:
                    yield address_rr(owner, ip, ttl)
        return Lazy(make, nonempty)

    def _addr(self, owner: DNSLabel, ips, qtype: int) -> list[RR]:
        if qtype == A:
            return [address_rr(owner, ip, self.ttl) for ip in ips if ":" not in ip]
        if qtype == AAAA:
            return [address_rr(owner, ip, self.ttl) for ip in ips if ":" in ip]
        return []

    def _srv_lazy(self, owner: DNSLabel, entries: Callable[[], Iterator[tuple]], count: int,
                  with_port: bool) -> tuple[Lazy, Lazy]:
        """_srv() for a big Service: `entries` makes the (target, address, port) entries again
        on each call, `count` is how many there are (weights), `with_port` whether any has a port."""
        weight = max(1, 100 // count) if count else 100
        ttl = self.ttl

        def srvs() -> Iterator[RR]:
            seen = set()
            for target, _ip, port in entries():
                if port is not None and (target, port) not in seen:
                    seen.add((target, port))
                    yield RR(owner, SRV, ttl=ttl, rdata=RD_SRV(0, weight, port, label(target)))

        def glue() -> Iterator[RR]:
            seen = set()
            for target, ip, port in entries():
                if port is not None and (target, ip) not in seen:
                    seen.add((target, ip))
                    yield address_rr(label(target), ip, ttl)
        return Lazy(srvs, with_port), Lazy(glue, with_port)

    def _srv(self, owner: DNSLabel, entries: list[tuple[Labels, str, int | None]]) -> tuple[list, list]:
        """SRV records and glue from (target, address, port) entries, weighted as CoreDNS does."""
        if not entries:
            return [], []
        weight = max(1, 100 // len(entries))
        srvs, glue, seen_srv, seen_glue = [], [], set(), set()
        for target, ip, port in entries:
            if port is None:
                continue
            if (target, port) not in seen_srv:
                seen_srv.add((target, port))
                srvs.append(RR(owner, SRV, ttl=self.ttl, rdata=RD_SRV(0, weight, port, label(target))))
            if (target, ip) not in seen_glue:
                seen_glue.add((target, ip))
                t = label(target)
                glue.append(address_rr(t, ip, self.ttl))
        return srvs, glue

    # --- lookup ------------------------------------------------------------------------

    def lookup(self, q: Labels, qtype: int, big_ok: bool = True) -> Answer:
        """Answer (q, qtype) for a name inside one of the served zones.

        `big_ok=False`: raise BigAnswer instead of answering from a big Service (one with
        more than BIG endpoints or ports), whose records are then made lazily."""
        zone = names.zone_of(q, self.zones)
        if zone is None:
            raise ValueError("name outside the served zones")
        if names.is_reverse(zone):
            res = self._reverse_node(q, zone, qtype)
        else:
            res = self._forward_node(q, zone, qtype, big_ok)
        if res is None:
            rcode = NXDOMAIN if self.synced else SERVFAIL
            return Answer(rcode, [], [self.soa(zone)], zone=zone, cacheable=self.synced)
        answer, additional = res.answer, res.additional
        chase = None
        if res.cname is not None:
            cname = RR(label(q), CNAME, ttl=self.ttl, rdata=RD_CNAME(label(res.cname)))
            if qtype in (CNAME, ANY):
                answer, additional = [cname], []
            elif qtype in (A, AAAA):
                answer, additional, chase = self._chase(q, res.cname, qtype, cname, big_ok)
            else:
                answer, additional = [], []
        elif qtype == ANY:
            answer = [RR(label(q), 13, ttl=self.ttl, rdata=HINFO_RDATA)] if res.has_data else []
            additional = []
        authority = [] if answer else [self.soa(zone)]
        dep = None
        if res.sd is not None and (res.cname is None or qtype not in (A, AAAA)):
            dep = (res.sd.svc.key, res.sd)
        return Answer(NOERROR, answer, authority, additional, cacheable=res.cacheable and chase is None,
                      chase=chase, zone=zone, dep=dep)

    def _chase(self, q: Labels, target: Labels, qtype: int, cname: RR,
               big_ok: bool = True) -> tuple["list | Lazy", list, Labels | None]:
        """Follow an ExternalName CNAME inside the zones (limit 10, loops dropped)."""
        answer = [cname]
        seen = {q}
        for _ in range(10):
            if target in seen:
                return answer, [], None
            seen.add(target)
            zone = names.zone_of(target, self.zones)
            if zone is None:
                return answer, [], target
            res = (self._reverse_node(target, zone, qtype) if names.is_reverse(zone)
                   else self._forward_node(target, zone, qtype, big_ok))
            if res is None:
                return answer, [], None
            if res.cname is None:
                return chain(answer, res.answer), [], None
            answer.append(RR(label(target), CNAME, ttl=self.ttl, rdata=RD_CNAME(label(res.cname))))
            target = res.cname
        return answer, [], None

    def _forward_node(self, q: Labels, zone: Labels, qtype: int, big_ok: bool = True) -> _Res | None:
        p = names.parse(q[:len(q) - len(zone)])
        kind = p.kind
        if kind == "nx":
            return None
        if kind in ("service", "endpoint", "port"):
            sd = self.service(p.namespace, p.service)
            if sd is None:
                return None
            # a ClusterIP Service's own name answers with its addresses and ports only, however
            # many endpoints it has (not counted then: every first question would)
            if not big_ok and (len(sd.svc.ports) > BIG if (kind == "service" and sd.kind == "cluster")
                               or (kind == "endpoint" and sd.names_cheap) else sd.big):
                raise BigAnswer(sd.svc.key)
        if kind in ("namespace", "ent", "dnsent"):
            return _ENT if kind != "namespace" or self.exposed(p.namespace) else None
        owner = label(q)
        if kind in ("service", "endpoint", "port"):
            if kind == "service":
                res = self._service_node(sd, owner, zone, qtype)
            elif sd.kind == "external":
                return None
            elif kind == "endpoint":
                ips = sd.endpoint_ips(p.endpoint)
                if not ips:
                    return None
                if qtype == SRV:
                    # CoreDNS: the endpoint's own ports, target its name, its addresses as glue
                    svc = sd.svc
                    target = (p.endpoint, svc.name, svc.namespace, "svc") + zone
                    entries = [(target, ip, port.port)
                               for _, ip, ports in sd.endpoint_entries(p.endpoint) for port in ports]
                    res = _Res(*self._srv(owner, entries))
                else:
                    res = _Res(self._addr(owner, ips, qtype))
            else:
                res = self._port_node(sd, owner, zone, qtype, p.port, p.proto)
            if res is not None:
                res.sd = sd
            return res
        if kind == "apex":
            if qtype == SOA:
                return _Res([self.soa(zone)])
            if qtype == NS:
                answer, glue = self.ns_records(zone)
                return _Res(answer, glue, cacheable=False)
            return _Res()
        if kind == "version":
            if qtype == TXT:
                return _Res([RR(owner, TXT, ttl=VERSION_TTL, rdata=RD_TXT(SCHEMA_VERSION))])
            return _Res()
        if kind == "nsname":
            return _Res(self._addr(owner, self._own_addresses(), qtype), cacheable=False)
        if kind == "podns":
            return _ENT if self.cfg.dns.pods != "disabled" and self.exposed(p.namespace) else None
        if kind == "pod":
            return self._pod_node(owner, p.namespace, p.endpoint, qtype)
        return None

    def _service_node(self, sd: ServiceData, owner: DNSLabel, zone: Labels, qtype: int) -> _Res:
        if sd.kind == "external":
            return _Res(cname=sd.target)
        svc = sd.svc
        if sd.kind == "cluster":
            if qtype in (A, AAAA):
                return _Res(self._addr(owner, svc.cluster_ips, qtype))
            if qtype == SRV:
                target = (svc.name, svc.namespace, "svc") + zone
                if sd.big:
                    return _Res(*self._srv_lazy(owner, lambda: ((target, ip, p.port) for p in svc.ports
                                                                for ip in svc.cluster_ips),
                                                len(svc.ports) * len(svc.cluster_ips), bool(svc.ports)))
                entries = [(target, ip, p.port) for p in svc.ports for ip in svc.cluster_ips]
                return _Res(*self._srv(owner, entries))
            return _Res()
        # headless: the ready endpoints
        if qtype in (A, AAAA):
            v6 = qtype == AAAA
            if sd.big:
                return _Res(self._addr_lazy(owner, lambda: sd.iter_ready_ips(v6), qtype, sd.has_family(v6)))
            return _Res(self._addr(owner, sd.ready_ips(v6), qtype))
        if qtype == SRV:
            base = (svc.name, svc.namespace, "svc") + zone
            if sd.big:
                def entries() -> Iterator[tuple]:
                    for name, ip, ports in sd.ready:
                        t = (name,) + base
                        for p in ports:
                            yield t, ip, p.port
                return _Res(*self._srv_lazy(owner, entries, sd.srv_count, sd.port_entries > 0))
            entries = []
            for name, ip, ports in sd.ready:
                if not ports:
                    entries.append(((name,) + base, ip, None))
                for p in ports:
                    entries.append(((name,) + base, ip, p.port))
            return _Res(*self._srv(owner, entries))
        return _Res()

    def _port_node(self, sd: ServiceData, owner: DNSLabel, zone: Labels, qtype: int,
                   port: str, proto: str) -> _Res | None:
        svc = sd.svc
        if sd.kind == "cluster":
            ports = [p for p in svc.ports if p.name and _match(port, p.name) and _match(proto, p.protocol)]
            if not ports:
                return None
            if qtype == SRV:
                target = (svc.name, svc.namespace, "svc") + zone
                return _Res(*self._srv(owner, [(target, ip, p.port) for p in ports for ip in svc.cluster_ips]))
            # CoreDNS answers the port name's address queries with the ClusterIPs.
            return _Res(self._addr(owner, svc.cluster_ips, qtype))
        base = (svc.name, svc.namespace, "svc") + zone
        if sd.big:
            count = sd.port_counts.get((port, proto), 0)
            if not count:
                return None

            def matching() -> Iterator[tuple]:
                for name, ip, ports in sd.ready:
                    for p in ports:
                        if p.name and _match(port, p.name) and _match(proto, p.protocol):
                            yield (name,) + base, ip, p.port
            if qtype == SRV:
                return _Res(*self._srv_lazy(owner, matching, count, True))
            v6 = qtype == AAAA
            nonempty = any((":" in ip) == v6 for _, ip, _ in matching())     # stops at the first
            return _Res(self._addr_lazy(owner, lambda: _unique(ip for _, ip, _ in matching()), qtype, nonempty))
        entries = [((name,) + base, ip, p.port) for name, ip, ports in sd.ready for p in ports
                   if p.name and _match(port, p.name) and _match(proto, p.protocol)]
        if not entries:
            return None
        if qtype == SRV:
            return _Res(*self._srv(owner, entries))
        ips = list(dict.fromkeys(ip for _, ip, _ in entries))
        return _Res(self._addr(owner, ips, qtype))

    def _pod_node(self, owner: DNSLabel, ns: str, podlabel: str, qtype: int) -> _Res | None:
        mode = self.cfg.dns.pods
        if mode == "disabled" or not self.exposed(ns):
            return None
        ip = names.pod_label_ip(podlabel)
        if ip is None:
            return None
        if mode == "verified":
            if not any(p.namespace == ns for p in self.state.pods_by_ip.get(ip, ())):
                return None
        return _Res(self._addr(owner, [ip], qtype))

    def _reverse_node(self, q: Labels, zone: Labels, qtype: int) -> _Res | None:
        if q == zone:
            if qtype == SOA:
                return _Res([self.soa(zone)])
            if qtype == NS:
                answer, glue = self.ns_records(zone)
                return _Res(answer, glue, cacheable=False)
            return _Res()
        ip = names.reverse_ip(q)
        if ip is None:
            return None
        hits = self.reverse(ip)
        if not hits:
            return None
        if qtype != PTR:
            return _Res()
        owner = label(q)
        out = []
        for sd, name in hits:
            target = (sd.svc.name, sd.svc.namespace, "svc") + self.primary
            if name is not None:
                target = (name,) + target
            out.append(RR(owner, PTR, ttl=self.ttl, rdata=RD_PTR(label(target))))
        return _Res(out)

    # --- NS ------------------------------------------------------------------------------

    def _own_addresses(self) -> list[str]:
        out = []
        for a in self.server_addresses():
            try:
                ip = ipaddress.ip_address(a)
            except ValueError:
                continue
            if not ip.is_loopback and not ip.is_unspecified and str(ip) not in out:
                out.append(str(ip))
        return out

    def ns_records(self, zone: Labels) -> tuple[list, list]:
        """NS at the apex: the Services whose endpoints are this server, else ns.dns.<zone>."""
        mine = self._own_addresses()
        if not mine:
            return [], []
        fz = self.primary if names.is_reverse(zone) else zone
        owner = label(zone)
        answer, glue, seen = [], [], set()
        for ip in mine:
            for sd, _ in self.reverse(ip):
                if sd.kind == "cluster" and not any(ip == r[1] for r in sd.ready):
                    continue
                svc = sd.svc
                if sd.kind == "cluster":
                    target = (svc.name, svc.namespace, "svc") + fz
                    addrs = list(svc.cluster_ips)
                else:
                    target = next(n for n, a, _ in sd.ready if a == ip)
                    target = (target, svc.name, svc.namespace, "svc") + fz
                    addrs = [ip]
                if target in seen:
                    continue
                seen.add(target)
                answer.append(RR(owner, NS, ttl=self.ttl, rdata=RD_NS(label(target))))
                glue += self._addr(label(target), addrs, A) + self._addr(label(target), addrs, AAAA)
        if not answer:
            target = ("ns", "dns") + fz
            answer = [RR(owner, NS, ttl=self.ttl, rdata=RD_NS(label(target)))]
            glue = self._addr(label(target), mine, A) + self._addr(label(target), mine, AAAA)
        return answer, glue


def _unique(items) -> Iterator:
    seen = set()
    for x in items:
        if x not in seen:
            seen.add(x)
            yield x


_ENTRY_IP = itemgetter(1)


class _Addresses(frozenset):
    """A big Service's address set, with the set of each of its slices (`parts`)."""
    parts: tuple = ()

    def __new__(cls, items, parts: tuple) -> "_Addresses":
        self = super().__new__(cls, items)
        self.parts = parts
        return self


def _slice_addresses(sl: EndpointSlice) -> frozenset[str]:
    if sl.address_type not in (IPV4, IPV6):
        return frozenset()
    return frozenset([a for ep in sl.endpoints if ep.ready for a in ep.addresses])


class _AddressIndex:
    """Endpoint address -> Service key (or a list of keys): 64 dicts picked by the address's
    hash, so that a view derived from the previous one copies only the dicts its changes
    touch (one dict of 150,000 addresses was copied whole on every change)."""
    __slots__ = ("shards", "_own")
    N = 64

    def __init__(self, shards: list | None = None) -> None:
        self.shards: list[dict] = shards if shards is not None else [{} for _ in range(self.N)]
        self._own: set[int] | None = set(range(self.N)) if shards is None else set()

    def get(self, ip: str):
        return self.shards[hash(ip) & 63].get(ip)

    def __len__(self) -> int:
        return sum(len(d) for d in self.shards)

    def __iter__(self) -> Iterator[str]:
        for d in self.shards:
            yield from d

    def derive(self) -> "_AddressIndex":
        return _AddressIndex(list(self.shards))

    def seal(self) -> None:
        self._own = None       # shared with later views from here on

    def _writable(self, ip: str) -> dict:
        i = hash(ip) & 63
        own = self._own
        assert own is not None, "a sealed index"
        if i not in own:
            self.shards[i] = self.shards[i].copy()
            own.add(i)
        return self.shards[i]

    def add(self, ip: str, key: tuple) -> None:
        d = self._writable(ip)
        had = d.get(ip)
        if had is None:
            d[ip] = key
        elif type(had) is list:
            if key not in had:
                d[ip] = had + [key]       # lists may be shared with an earlier view
        elif had != key:
            d[ip] = [had, key]

    def remove(self, ip: str, key: tuple) -> None:
        d = self._writable(ip)
        had = d.get(ip)
        if had is None:
            return
        if type(had) is list:
            keep = [k for k in had if k != key]
            d[ip] = keep if len(keep) > 1 else keep[0]
        elif had == key:
            del d[ip]


def _index_add(table: dict, tag: str, ip: str, item: tuple, copied: set | None) -> None:
    """Add item under ip once. A list shared with the previous view (copied is not None
    during an incremental build) is copied before its first change in this build."""
    lst = table.get(ip)
    if lst is None:
        table[ip] = [item]
        return
    if copied is not None and (tag, ip) not in copied:
        lst = table[ip] = list(lst)
        copied.add((tag, ip))
    if item not in lst:
        lst.append(item)
