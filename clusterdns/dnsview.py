"""The state DNS serves in the agent: the store, held back to what the kernel routes.

Ordering guarantee. The source writes the main StateStore; the proxier syncs
from it. DNS does not read that store directly: it reads a DnsView, a state
derived from two inputs, the store now (C) and the store as it was at the
version the proxier last put into the kernel (P):

- a Service that needs rules (it has a ClusterIP and ports) enters DNS only
  once P has it, and a changed ClusterIP, ports or type show in DNS only once
  P has them: until then DNS keeps the old record, whose rules are still in
  the kernel. A name never resolves to an address that does not work yet.
- a deleted Service, and an endpoint that went away or stopped being ready,
  leave DNS at once (from C): DNS first, rules after.
- Services without rules (headless, ExternalName, other proxies' Services)
  and Namespaces, Pods and Nodes follow the store directly.
- restart adoption: before the proxier's first sync there is no P, but the
  rules a previous process left are usually still in the kernel. `adopt()`
  takes what the proxier found there ((ClusterIP, protocol, port) -> "ip:port"
  endpoints, or None where only the port was read) and counts a Service as
  applied when its ClusterIPs and exact port set are there, showing only its
  endpoints present both in the kernel and in C (none where they were not
  read). A Service whose address or ports differ from the kernel's waits
  for the first sync, as does one the kernel lacks. The first sync replaces
  adoption with P for good.
- until the first sync nothing counts as synced: a name DNS cannot show yet
  gets SERVFAIL (try again), not NXDOMAIN.
With --proxy-mode none there are no rules to wait for: the view follows the store.
"""
from __future__ import annotations

import ipaddress
import logging
import socket
import time
from types import MappingProxyType
from typing import Callable, Iterable, Mapping

from prometheus_client import Histogram

from .metrics import DNS as DNS_REGISTRY
from .model import Endpoint, EndpointSlice, Service
from .proxy.servicemap import parse_endpoint
from .state import ClusterState, Delta, StateStore, Subscriber

log = logging.getLogger(__name__)

DNS_PROGRAMMING = Histogram(
    "coredns_kubernetes_dns_programming_duration_seconds",
    "Time from an EndpointSlice change (its last-change-trigger-time) to DNS serving it.",
    ["service_kind"], registry=DNS_REGISTRY,
    buckets=tuple(0.001 * 2 ** i for i in range(20)))
# States kept for versions the proxier may still report as applied. The
# proxier syncs the newest state, so old ones are almost never asked for;
# when one was dropped the nearest older one is used (showing less, never more).
HISTORY = 32


def needs_rules(svc: Service) -> bool:
    """True when the proxier programs rules for this Service (see servicemap)."""
    return bool(svc.cluster_ips and svc.ports and not svc.headless
                and not svc.is_external_name and not svc.proxy_name)


def _shape(svc: Service) -> tuple:
    """The fields whose change needs new rules before DNS may show it."""
    return (svc.type, svc.cluster_ips, svc.ports, svc.headless, svc.external_name)


def _ready_addresses(slices: tuple[EndpointSlice, ...]) -> set[str]:
    return {a for sl in slices for ep in sl.endpoints if ep.ready for a in ep.addresses}


def _canonical_ip(text: str) -> str | None:
    """The address's canonical text (as the store holds it), or None when it is none."""
    if ":" not in text:
        try:
            if socket.inet_ntop(socket.AF_INET, socket.inet_pton(socket.AF_INET, text)) == text:
                return text      # the common case, without ipaddress (100,000 calls at scale)
        except OSError:
            return None
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        return None


def _endpoint_ip(endpoint: str) -> str | None:
    """The address of an "ip:port" or "[ip]:port" endpoint, canonical; None when malformed."""
    if endpoint[:1] != "[":
        ip, sep, port = endpoint.rpartition(":")
        if sep and port.isdigit() and "." in ip:
            return _canonical_ip(ip)
    hp = parse_endpoint(endpoint)
    return hp[0] if hp is not None else None


def _filter_slice(sl: EndpointSlice, allowed: set[str] | frozenset[str]) -> EndpointSlice:
    """The slice without ready endpoints the kernel does not route to yet."""
    keep: list[Endpoint] = []
    dropped = False
    routed = allowed.issuperset    # C loops: 100,000 endpoints when a restart adopts 10,000 Services
    for ep in sl.endpoints:
        if ep.ready and not routed(ep.addresses):
            dropped = True
            continue
        keep.append(ep)
    if not dropped:
        return sl
    return EndpointSlice(sl.namespace, sl.name, sl.service, sl.address_type, tuple(keep), sl.ports,
                         sl.trigger_time)


class DnsView:
    """The state DNS serves in the agent; quacks like a StateStore for readers.

    `current` and `subscribe(fn(old, new, delta))` as StateStore; the agent
    calls `adopt(found)` with what the kernel held at start, before the first
    sync, and `applied(version)` after each successful proxier sync.
    """

    def __init__(self, store: StateStore, clock: Callable[[], float] = time.monotonic,
                 follow: bool = False) -> None:
        self.store = store
        self.clock = clock
        self.follow = follow   # no proxier (--proxy-mode none): every version counts as applied
        self._subscribers: list[Subscriber] = []
        self._history: dict[int, ClusterState] = {}
        self._deltas: list[tuple[int, frozenset, bool]] = []   # (version, service keys, full)
        self.applied_state = ClusterState()
        self.applied_version = -1
        self._services: dict[tuple[str, str], Service] = {}
        self._slices: dict[tuple[str, str], EndpointSlice] = {}
        self._slice_keys: dict[tuple[str, str], tuple[tuple[str, str], ...]] = {}
        # the view's slices per Service (ClusterState.slices_by_service), kept per change:
        # rebuilt from every slice it is ~15 ms at 10,000 Services, on every change DNS shows
        self._index: dict[tuple[str, str], tuple[EndpointSlice, ...]] | None = None
        self.current = ClusterState()
        self._version = 0
        self._observed: dict[tuple[str, str], float] = {}   # slice key -> last trigger time observed
        # Restart adoption (before the first sync): ClusterIP -> {(protocol, port): endpoint IPs,
        # or None when they were not read}
        self._kernel: dict[str, dict[tuple[str, int], frozenset[str] | None]] | None = None
        self._kernel_families: frozenset[int] = frozenset()
        self._adopted: set[tuple[str, str]] = set()
        if follow:
            self.applied_state, self.applied_version = store.current, store.current.version
        self._remember(store.current)
        # Services already in the store wait for a sync like any change.
        self._deltas.append((store.current.version, frozenset(store.current.services), True))
        self._recompute(set(store.current.services), store.current, full=True)
        store.subscribe(self._on_store)

    # -- StateStore-compatible reading side
    def subscribe(self, fn: Subscriber) -> None:
        self._subscribers.append(fn)

    # -- inputs
    def _remember(self, state: ClusterState) -> None:
        self._history[state.version] = state
        if len(self._history) > HISTORY:
            for v in sorted(self._history)[:-HISTORY]:
                if v != self.applied_version:
                    del self._history[v]

    def _on_store(self, old: ClusterState, new: ClusterState, delta: Delta) -> None:
        if self.follow:
            self.applied_state, self.applied_version = new, new.version
            self._history = {new.version: new}
            self._recompute(set(delta.services) | (set(old.services) | set(new.services) if delta.full else set()),
                            new, kinds=delta.kinds)
            return
        self._remember(new)
        keys = set(delta.services)
        if delta.full and ("Service" in delta.kinds or "EndpointSlice" in delta.kinds):
            keys |= set(old.services) | set(new.services)
        self._deltas.append((new.version, frozenset(keys), delta.full))
        self._recompute(keys, new, kinds=delta.kinds)

    @property
    def adopted(self) -> int:
        """Services shown now because the kernel held their rules at start (0 after the first sync)."""
        return len(self._adopted)

    @property
    def adopting(self) -> bool:
        """Whether what the kernel held at start still decides (adopt() done, no sync yet)."""
        return self._kernel is not None

    def adopt(self, found: Mapping[tuple[str, str, int], Iterable[str] | None],
              families: Iterable[int] = (4, 6)) -> int:
        """Count what a previous process left in the kernel as applied, until the first sync.

        found: (ClusterIP, protocol, port) -> "ip:port" endpoints its rules DNAT to
        (protocol in any case, IPv6 endpoints as "[ip]:port"), as the proxier
        backends' `programmed()` read it, or None when only the port was read
        (`programmed_ports()`): the Service is shown without ready endpoints until
        a later adopt() with them, or the first sync. A later call replaces an
        earlier one. families: those the proxier programs; a Service's ClusterIPs
        of other families are not looked for. Returns the number of Services
        adopted. Ignored once a sync was applied (P decides)."""
        if self.follow or self.applied_version >= 0:
            return 0
        kernel: dict[str, dict[tuple[str, int], frozenset[str] | None]] = {}
        unread = 0
        for (ip, proto, port), eps in found.items():
            addr = _canonical_ip(ip)
            if addr is None:
                continue
            if eps is None:
                unread += 1
            kernel.setdefault(addr, {})[(str(proto).upper(), int(port))] = None if eps is None else frozenset(
                ip for ip in map(_endpoint_ip, eps) if ip is not None)
        first = self._kernel is None
        self._kernel = kernel
        self._kernel_families = frozenset(families)
        now = self.store.current
        self._recompute(set(now.services) | set(self._services), now)
        if first:
            log.info("restart adoption: %d Service ports found in the kernel%s; %d Services listed so far "
                     "match them and are answered before the first sync", len(found),
                     " (endpoints not read yet)" if unread else "", len(self._adopted))
        else:
            log.info("restart adoption: endpoints read for %d of %d Service ports in the kernel; %d Services "
                     "answered before the first sync", len(found) - unread, len(found), len(self._adopted))
        return len(self._adopted)

    def _kernel_match(self, svc: Service) -> frozenset[str] | None:
        """The endpoint IPs the kernel routes svc to, when its ClusterIPs and exact port
        set are in the kernel as they are now; None otherwise (it waits for a sync)."""
        assert self._kernel is not None
        want = {(p.protocol.upper(), p.port) for p in svc.ports}
        allowed: set[str] = set()
        checked = False
        for ip in svc.cluster_ips:   # canonical text (the source validated them)
            if (6 if ":" in ip else 4) not in self._kernel_families:
                continue
            ports = self._kernel.get(ip)
            if ports is None or set(ports) != want:
                return None
            checked = True
            for eps in ports.values():
                if eps is not None:     # None: not read yet, none shown
                    allowed |= eps
        return frozenset(allowed) if checked else None

    def applied(self, version: int) -> None:
        """The proxier has put the state of `version` into the kernel."""
        if version <= self.applied_version:
            return
        state = self._history.get(version)
        if state is None:
            older = [v for v in self._history if v <= version]
            if not older:
                log.debug("applied version %d is unknown; ignored", version)
                return
            version = max(older)
            state = self._history[version]
        self.applied_version, self.applied_state = version, state
        for v in [v for v in self._history if v < version]:
            del self._history[v]
        keys: set = set()
        rest = []
        for v, k, _full in self._deltas:
            if v <= version:
                keys |= k
            else:
                rest.append((v, k, _full))
        self._deltas = rest
        if self._kernel is not None:
            # The first sync replaced what the kernel held: P decides from now on.
            log.info("restart adoption ends with the first sync: %d of %d Services were answered "
                     "from the kernel's rules", len(self._adopted),
                     sum(1 for s in self.store.current.services.values() if needs_rules(s)))
            self._kernel = None
            keys |= self._adopted
            self._adopted = set()
        self._recompute(keys, self.store.current)

    # -- the view
    def _entry(self, key: tuple[str, str], now: ClusterState) -> tuple[Service | None, tuple[EndpointSlice, ...]]:
        c_svc = now.services.get(key)
        self._adopted.discard(key)
        if c_svc is None:
            return None, ()
        c_slices = now.slices_for(*key)
        if not needs_rules(c_svc):
            return c_svc, c_slices
        p_svc = self.applied_state.services.get(key)
        if p_svc is None:
            if self._kernel is not None:
                allowed = self._kernel_match(c_svc)
                if allowed is not None:
                    self._adopted.add(key)
                    return c_svc, tuple(_filter_slice(sl, allowed) for sl in c_slices)
            return None, ()       # new: not before its rules
        p_slices = self.applied_state.slices_for(*key)
        if p_svc is c_svc and p_slices == c_slices:
            return c_svc, c_slices   # as applied (the common case: a sync of this very state)
        svc = c_svc if _shape(p_svc) == _shape(c_svc) else p_svc
        # a slice the kernel has as it is needs no filter: only the others are looked through
        # (one changed slice of a Service of 50 is 100 endpoints, not 5,000)
        applied = {id(sl) for sl in p_slices}
        if all(id(sl) in applied for sl in c_slices):
            return svc, c_slices
        allowed = _ready_addresses(p_slices)
        return svc, tuple(sl if id(sl) in applied else _filter_slice(sl, allowed) for sl in c_slices)

    def _recompute(self, keys: set, now: ClusterState, full: bool = False, kinds: frozenset = frozenset()) -> None:
        changed = set()
        for key in keys:
            svc, slices = self._entry(key, now)
            old_svc = self._services.get(key)
            old_keys = self._slice_keys.get(key, ())
            old_slices = tuple(self._slices[k] for k in old_keys)
            if svc == old_svc and slices == old_slices:
                continue
            changed.add(key)
            for k in old_keys:
                self._slices.pop(k, None)
            if svc is None:
                self._services.pop(key, None)
                self._slice_keys.pop(key, None)
                continue
            self._services[key] = svc
            self._slice_keys[key] = tuple(sl.key for sl in slices)
            for sl in slices:
                self._slices[sl.key] = sl
        base = self.current
        others = (now.namespaces is not base.namespaces or now.pods is not base.pods
                  or now.nodes is not base.nodes or self._synced(now) != base.synced)
        if not changed and not others and not full:
            return
        self._publish(now, changed, kinds, full)

    def _slices_by_service(self, changed: set, full: bool) -> Mapping[tuple[str, str], tuple[EndpointSlice, ...]]:
        slices, slice_keys = self._slices, self._slice_keys
        if full or self._index is None:
            index = {key: tuple([slices[k] for k in ks]) for key, ks in slice_keys.items() if ks}
        else:
            index = self._index.copy()
            for key in changed:
                ks = slice_keys.get(key)
                if ks:
                    index[key] = tuple([slices[k] for k in ks])
                else:
                    index.pop(key, None)
        self._index = index
        return MappingProxyType(index)

    def _observe_programming(self, now: ClusterState, changed: set) -> None:
        """coredns_kubernetes_dns_programming_duration_seconds: from the EndpointSlice
        trigger time to the change being served, for slices DNS now shows as they are."""
        wall = time.time()
        for key in changed:
            svc = self._services.get(key)
            if svc is None:
                continue
            kind = "cluster_ip" if needs_rules(svc) else (
                "headless_with_selector" if svc.headless else "")
            if not kind:
                continue
            for skey in self._slice_keys.get(key, ()):
                sl = self._slices[skey]
                if sl.trigger_time is None or now.slices.get(skey) is not sl:
                    continue
                if sl.trigger_time > self._observed.get(skey, 0.0):
                    self._observed[skey] = sl.trigger_time
                    DNS_PROGRAMMING.labels(kind).observe(max(0.0, wall - sl.trigger_time))
        if len(self._observed) > 2 * max(1, len(now.slices)):
            self._observed = {k: v for k, v in self._observed.items() if k in now.slices}

    def _synced(self, now: ClusterState) -> frozenset:
        """Nothing counts as synced before the first rule sync: DNS then answers SERVFAIL,
        not NXDOMAIN, for the Services it cannot show yet (after an agent restart their
        rules may well be in the kernel; a negative answer would be wrong and cached)."""
        return now.synced if self.follow or self.applied_version >= 0 else frozenset()

    def _publish(self, now: ClusterState, changed: set, kinds: frozenset, full: bool) -> None:
        old = self.current
        self._version += 1
        new = ClusterState(
            version=self._version,
            services=MappingProxyType(self._services.copy()) if changed or full else old.services,
            slices=MappingProxyType(self._slices.copy()) if changed or full else old.slices,
            namespaces=now.namespaces, pods=now.pods, nodes=now.nodes,
            synced=self._synced(now), serial=max(now.serial, old.serial + (1 if changed else 0)))
        if changed or full:
            new.__dict__["slices_by_service"] = self._slices_by_service(changed, full)   # fills the cached_property
        else:
            new.__dict__["slices_by_service"] = old.slices_by_service
        self._observe_programming(now, changed)
        view_kinds = set(kinds) | ({"Service", "EndpointSlice"} if changed else set())
        delta = Delta(frozenset(changed), frozenset(view_kinds), full)
        self.current = new
        for fn in list(self._subscribers):
            try:
                fn(old, new, delta)
            except Exception:  # one consumer's bug must not stop the others
                log.exception("DNS view subscriber failed")

    def unsubscribe(self, fn: Subscriber) -> None:
        if fn in self._subscribers:
            self._subscribers.remove(fn)


