"""nftables mode: one private table whose endpoint choice lives in data maps.

kube-proxy's nftables layout (base chains, `service-ips` verdict map,
per-service chains, masquerade mark) with one deliberate difference
(docs/proxy.md): endpoint churn never makes the kernel validate the table.
An endpoint change rewrites only set and data-map elements, which the kernel
commits without walking the chains; rules and verdict-map elements (which do
trigger the walk) change only when a Service itself changes.

* Endpoint choice: `dnat to numgen random mod 65536 offset O map @endpoints-B`.
  Each service port and traffic policy owns a slot of 65536 numbers (offset
  O = slot * 65536, the slot hashed from its name) in one of BUCKETS shared
  interval maps per protocol; its ready endpoints
  split the slot into even ranges mapping to `address . port`. The maps are
  shared by the Services whose key hashes to the same bucket because the
  kernel looks sets up by name in a list: 10,000 maps in one table made a
  full load quadratic (about 9 s of kernel time at 10,000 Services).
* Hairpin masquerade: postrouting matches `ct status dnat ip saddr . ip daddr
  @hairpin` (pairs `endpoint . endpoint`), instead of a rule per endpoint.
* No endpoints: REJECT and DROP through plain sets (`no-endpoint-reject`,
  `no-endpoint-drop` and their NodePort twins), not goto elements; a Service's
  chains and `service-ips` elements stay while it has no endpoints.
* ClientIP affinity needs per-endpoint state: only those Services keep
  kube-proxy's `numgen ... vmap` to per-endpoint chains with affinity sets.

`render` is pure given its inputs: with `previous` (the NftState the last
applied transaction left) it returns only the changes, as one transaction.
Render caches live in a `RenderCache` the caller owns (the backend).
"""
from __future__ import annotations

import hashlib
import ipaddress
import math
import socket
import struct
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from itertools import compress
from operator import is_not, itemgetter
from typing import Iterable, Iterator, Mapping

from ..config import Config
from ..lifetime import gc_paused
from ..state import ClusterState
from . import names as n
from .nftobj import (
    Addr,
    AddrIn,
    BaseChain,
    CtState,
    CtStatus,
    DnatMap,
    DnatTo,
    Dport,
    FibLocal,
    Lookup,
    MarkIsZero,
    MarkSet,
    Masquerade,
    NumgenVmap,
    Op,
    Rule,
    SetDecl,
    Update,
    Verdict,
    Vmap,
    rule,
    stored,
)
from .nftobj import text as ops_text
from .servicemap import (
    Categorized,
    NodeInfo,
    PortsCache,
    ServicePortInfo,
    format_endpoint,
    node_info,
    service_ports,
    service_ports_for,
)

# (chain, type, hook, priority): kube-proxy's base chains
BASE_CHAINS = (
    ("filter-prerouting-pre-dnat", "filter", "prerouting", -110),
    ("filter-output-pre-dnat", "filter", "output", -110),
    ("filter-input", "filter", "input", 0),
    ("filter-forward", "filter", "forward", 0),
    ("filter-output", "filter", "output", 0),
    ("nat-prerouting", "nat", "prerouting", -100),
    ("nat-output", "nat", "output", -100),
    ("nat-postrouting", "nat", "postrouting", 100),
)
# (from chain, match, to chain)
JUMPS = (
    ("filter-input", "ct state new", "nodeport-endpoints-check"),
    ("filter-input", "ct state new", "service-endpoints-check"),
    ("filter-forward", "ct state new", "service-endpoints-check"),
    ("filter-output", "ct state new", "service-endpoints-check"),
    ("filter-prerouting-pre-dnat", "ct state new", "firewall-check"),
    ("filter-output-pre-dnat", "ct state new", "firewall-check"),
    ("nat-output", "", "services"),
    ("nat-prerouting", "", "services"),
    ("nat-postrouting", "", "masquerading"),
    ("filter-forward", "ct state new", "cluster-ips-check"),
    ("filter-output", "ct state new", "cluster-ips-check"),
)

SERVICES = "services"
MARK_MASQ = "mark-for-masquerade"
MASQUERADING = "masquerading"
CLUSTER_IPS = "cluster-ips"
NODEPORT_IPS = "nodeport-ips"
SERVICE_IPS = "service-ips"
SERVICE_NODEPORTS = "service-nodeports"
FIREWALL_IPS = "firewall-ips"
NO_ENDPOINT_REJECT = "no-endpoint-reject"
NO_ENDPOINT_DROP = "no-endpoint-drop"
NO_ENDPOINT_NODEPORT_REJECT = "no-endpoint-nodeport-reject"
NO_ENDPOINT_NODEPORT_DROP = "no-endpoint-nodeport-drop"
HAIRPIN = "hairpin"
ENDPOINTS_PREFIX = "endpoints-"

BUCKETS = 512          # shared endpoint maps: a bucket holds the slots of the Services hashing to it
SLOT = 65536           # numbers per service port and policy: the modulus of numgen
SLOTS = 65535          # slots per map: offsets stay below 2**32 with room for the last range's end
CLUSTER, LOCAL = "cluster", "local"


def bucket_of(key: tuple[str, str]) -> int:
    """The endpoint map of a Service (namespace, name): stable across runs and renders."""
    digest = hashlib.sha256(f"{key[0]}/{key[1]}".encode()).digest()
    return int.from_bytes(digest[:4], "big") % BUCKETS


def endpoints_map(bucket: tuple[str, int]) -> str:
    """The endpoint map of a bucket (protocol, number): one per protocol, as typeof names it."""
    return f"{ENDPOINTS_PREFIX}{bucket[0]}-{bucket[1]:03d}"


def shares(count: int, offset: int = 0) -> list[tuple[int, int]]:
    """Inclusive ranges splitting [offset, offset + SLOT) into `count` shares as even as integers allow."""
    return [(offset + i * SLOT // count, offset + (i + 1) * SLOT // count - 1) for i in range(count)]


@dataclass(frozen=True, slots=True)
class Objects:
    """Chains, sets and elements that one owner (the base layout, or one Service) puts in the table.

    `shared_sets` (the bucket maps) may also come from other owners: the table
    holds them while any owner does. The two kinds of element there are
    100,000s of are kept compactly, as what they are made of (the elements
    are made when read, see `range_elements`): `ranges`, each slot's
    endpoints (endpoint map, slot offset, endpoints with .ip and .port), and
    `hairpin`, the endpoint addresses whose `a . a` pair the owner adds to the
    shared hairpin set. `slot_keys` are the endpoint-map slots the owner uses.
    """
    chains: Mapping[str, tuple[Rule, ...]] = field(default_factory=dict)  # chain -> rules, in order
    chain_decls: Mapping[str, BaseChain | None] = field(default_factory=dict)
    sets: Mapping[str, SetDecl] = field(default_factory=dict)
    elements: tuple[tuple[str, str, tuple], ...] = ()                     # (set, key text, element_of-able)
    shared_sets: Mapping[str, SetDecl] = field(default_factory=dict)
    ranges: tuple[tuple[str, int, tuple], ...] = ()                       # (endpoint map, offset, endpoints)
    hairpin: tuple[str, ...] = ()
    slot_keys: tuple[tuple, ...] = ()
    slots: tuple[tuple[int, int], ...] = ()                               # (bucket, slot) of each slot key

    def range_elements(self) -> Iterator[tuple[str, str, tuple]]:
        """(endpoint map, key text, element) of each endpoint-map element, as `elements` holds the others."""
        for name, offset, endpoints in self.ranges:
            yield from _slot_elements(name, offset, endpoints)


def _slot_elements(name: str, offset: int, endpoints) -> Iterator[tuple[str, str, tuple]]:
    """The interval elements of one slot: its even shares, in order, each to one endpoint."""
    count = len(endpoints)
    for i, ep in enumerate(endpoints):
        lo, hi = offset + i * SLOT // count, offset + (i + 1) * SLOT // count - 1
        key = f"{lo}-{hi}"
        # stored(...) inlined: 100,000 of these per full load at 10,000 Services
        yield name, key, (True, "", f"{key} : {ep.ip} . {ep.port}", 2, ep.ip, ep.port, lo, hi)


@lru_cache(maxsize=256)
def _shares(count: int) -> tuple[tuple[int, int], ...]:
    """shares(count), kept: the (lo, hi) of a slot's shares from its offset, as _slot_elements spells them."""
    return tuple(shares(count))


def _hairpin_element(ip: str) -> tuple[str, str, tuple]:
    pair = f"{ip} . {ip}"
    return HAIRPIN, pair, (False, "", pair, 0, "", "", ip, ip)


def _bulk(name: str) -> bool:
    """A set whose elements the state derives from its owners' compact data (not kept one by one)."""
    return name == HAIRPIN or name.startswith(ENDPOINTS_PREFIX)


class _Elements(Mapping):
    """NftState.elements: set name -> (key text -> element_of-able).

    `plain` holds the elements of most sets; for the bulk ones (_bulk: the
    endpoint maps, the hairpin set) it holds None and the elements are read
    from the owners' ranges (through the slots of `buckets`) or from
    `hairpin` (address -> number of owners), made when asked. Keeping
    220,000 elements one by one at 10,000 Services cost ~80 MB.
    """
    __slots__ = ("plain", "owned", "buckets", "hairpin")

    def __init__(self, plain: Mapping, owned: Mapping, buckets: Mapping, hairpin: Mapping) -> None:
        self.plain, self.owned, self.buckets, self.hairpin = plain, owned, buckets, hairpin

    def __getitem__(self, name: str) -> Mapping:
        elems = self.plain[name]
        if elems is None:
            if name == HAIRPIN:
                return _HairpinView(self.hairpin)
            return _RangeView(name, self.owned, self.buckets)
        return elems

    def __contains__(self, name) -> bool:
        return name in self.plain

    def __iter__(self):
        return iter(self.plain)

    def __len__(self) -> int:
        return len(self.plain)

    def __repr__(self) -> str:
        return repr({k: dict(v) for k, v in self.items()})


class _HairpinView(Mapping):
    __slots__ = ("refs",)

    def __init__(self, refs: Mapping[str, int]) -> None:
        self.refs = refs

    def __getitem__(self, key: str) -> tuple:
        ip, sep, other = key.partition(" . ")
        if not sep or ip != other or ip not in self.refs:
            raise KeyError(key)
        return _hairpin_element(ip)[2]

    def __iter__(self):
        for ip in self.refs:
            yield f"{ip} . {ip}"

    def __len__(self) -> int:
        return len(self.refs)

    def values(self):
        return _Values(self, lambda: (_hairpin_element(ip)[2] for ip in self.refs), self._texts)

    def _texts(self) -> list[str]:
        return [f"{ip} . {ip}" for ip in self.refs]

    def items(self):
        return _Values(self, lambda: (_hairpin_element(ip)[1:] for ip in self.refs))


class _RangeView(Mapping):
    """One endpoint map's elements, from the ranges of the owners of its slots."""
    __slots__ = ("name", "owned", "members")

    def __init__(self, name: str, owned: Mapping, buckets: Mapping) -> None:
        proto, _, number = name[len(ENDPOINTS_PREFIX):].rpartition("-")
        self.name, self.owned = name, owned
        self.members = buckets.get((proto, int(number)), {}) if number.isdigit() else {}

    def _slot(self, slot_key: tuple, index: int) -> tuple | None:
        objs = self.owned.get((slot_key[0], slot_key[1]))
        if objs is not None:
            offset = index * SLOT
            for name, off, endpoints in objs.ranges:
                if off == offset and name == self.name:
                    return endpoints
        return None

    def _elements(self) -> Iterator[tuple[str, str, tuple]]:
        # as a full render adds them: owners in key order, each owner's slots in its order
        owners = sorted({(sk[0], sk[1]) for sk in self.members})
        for owner in owners:
            objs = self.owned.get(owner)
            if objs is not None:
                for name, offset, endpoints in objs.ranges:
                    if name == self.name:
                        yield from _slot_elements(name, offset, endpoints)

    def __getitem__(self, key: str) -> tuple:
        lo_text, sep, hi_text = key.partition("-")
        if not sep or not lo_text.isdigit() or not hi_text.isdigit():
            raise KeyError(key)
        lo = int(lo_text)
        index = lo // SLOT
        for sk, i in self.members.items():
            if i == index:
                endpoints = self._slot(sk, i)
                if endpoints:
                    for _, k, elem in _slot_elements(self.name, index * SLOT, endpoints):
                        if k == key:
                            return elem
        raise KeyError(key)

    def __iter__(self):
        return (k for _, k, _ in self._elements())

    def __len__(self) -> int:
        return sum(len(e) for sk, i in self.members.items() if (e := self._slot(sk, i)))

    def _texts(self) -> list[str]:
        """The elements' texts (as _slot_elements spells them), in _elements' order, made directly."""
        out: list[str] = []
        add = out.append
        for owner in sorted({(sk[0], sk[1]) for sk in self.members}):
            objs = self.owned.get(owner)
            if objs is not None:
                for name, offset, endpoints in objs.ranges:
                    if name == self.name:
                        for (lo, hi), ep in zip(_shares(len(endpoints)), endpoints):
                            add(f"{offset + lo}-{offset + hi} : {ep.ip} . {ep.port}")
        return out

    def values(self):
        return _Values(self, lambda: (e for _, _, e in self._elements()), self._texts)

    def items(self):
        return _Values(self, lambda: ((k, e) for _, k, e in self._elements()))


class _Values:
    """A re-iterable, sized sequence of a view's elements, made as it is read (an operation's
    body: encoding a full load element by element keeps no list of them all)."""
    __slots__ = ("view", "make", "texts")

    def __init__(self, view: Mapping, make, texts=None) -> None:
        # texts: the elements' texts in one list, for the nft -f text (Op.text), when the view can spell them directly
        self.view, self.make, self.texts = view, make, texts

    def __iter__(self):
        return self.make()

    def __len__(self) -> int:
        return len(self.view)

    def __bool__(self) -> bool:
        return len(self.view) > 0

    def __eq__(self, other) -> bool:
        return tuple(self) == tuple(other)

    def __repr__(self) -> str:
        return repr(tuple(self))


@dataclass(frozen=True)
class NftState:
    """What the table holds after a transaction is applied: enough to compute the next one.

    The mappings are never mutated once built. `owned` records which objects
    each Service contributed, so a sync that knows which Services changed
    rebuilds only those; `refs` counts the owners of shared sets and
    elements (`hairpin`: of the hairpin pairs, by address); `buckets` maps
    each endpoint map's slot keys to their slots;
    `context` is what every Service's objects depend on besides the Service
    itself (base layout, node, options): when it changes, a sync rebuilds
    everything.
    """
    family: int = 4
    chains: Mapping[str, tuple[Rule, ...]] = field(default_factory=dict)
    chain_decls: Mapping[str, BaseChain | None] = field(default_factory=dict)
    sets: Mapping[str, SetDecl] = field(default_factory=dict)
    elements: Mapping[str, Mapping[str, tuple]] = field(default_factory=dict)  # name -> key text -> element_of-able
    owned: Mapping[tuple[str, str], Objects] = field(default_factory=dict)
    context: tuple = ()
    refs: Mapping[tuple, int] = field(default_factory=dict)
    buckets: Mapping[tuple[str, int], Mapping[tuple, int]] = field(default_factory=dict)
    hairpin: Mapping[str, int] = field(default_factory=dict)   # endpoint address -> owners of its pair

    def summary(self) -> dict[str, int]:
        return {"chains": len(self.chains), "rules": sum(len(r) for r in self.chains.values()),
                "sets": len(self.sets), "elements": sum(len(e) for e in self.elements.values())}


@dataclass(frozen=True)
class NftRuleSet:
    family: int
    state: NftState
    full: bool = True
    changes: int = 0      # statements in the transaction (a measure of its size)
    ops: tuple[Op, ...] = ()   # the transaction as objects: the text and netlink batches are encoded from them

    @cached_property
    def text(self) -> str:
        """The `nft -f` text of `ops`: made only when asked (printing, or a sync that
        cannot use netlink), not on every sync."""
        return ops_text(self.ops, self.family)


class RenderCache:
    """Each Service's Objects across renders, owned by whoever renders repeatedly (the backend).

    servicemap hands out the same (info, categorized) pairs while a Service
    and its slices are unchanged (through `ports`), so a hit is an identity
    check plus the Service's slots; everything else is in the context.
    """

    def __init__(self) -> None:
        self.context: tuple | None = None
        self.entries: dict[tuple[str, str], tuple] = {}
        self.ports = PortsCache()


def _fam(family: int) -> tuple[str, str, str]:
    """(table family, address match keyword, address type)."""
    return ("ip6", "ip6", "ipv6_addr") if family == 6 else ("ip", "ip", "ipv4_addr")


class _Builder:
    """Collects one owner's objects in write order."""

    def __init__(self) -> None:
        self.chains: dict[str, list[Rule]] = {}
        self.chain_decls: dict[str, BaseChain | None] = {}
        self.sets: dict[str, SetDecl] = {}
        self.elements: list[tuple[str, str, tuple]] = []
        self.shared_sets: dict[str, SetDecl] = {}
        self.ranges: list[tuple[str, int, tuple]] = []
        self.hairpin: list[str] = []

    def chain(self, name: str, decl: BaseChain | None = None) -> list[Rule]:
        rules = self.chains.get(name)
        if rules is None:
            rules = self.chains[name] = []
            self.chain_decls[name] = decl
        return rules

    def set(self, name: str, decl: SetDecl) -> None:
        self.sets[name] = decl

    def element(self, name: str, key: tuple, value: tuple | None = None, comment: str = "") -> None:
        """An element as the state keeps it: (key fields, plain verdict, comment, interval, text)."""
        self.elements.append((name, " . ".join(key), stored(key, value, comment)))

    def objects(self, slot_keys: tuple = (), slots: tuple = ()) -> Objects:
        return Objects({k: tuple(v) for k, v in self.chains.items()}, self.chain_decls, self.sets,
                       tuple(self.elements), self.shared_sets, tuple(self.ranges), tuple(self.hairpin),
                       slot_keys, slots)


def _merge(family: int, base: Objects, owned: Mapping[tuple[str, str], Objects], context: tuple,
           buckets: Mapping[tuple[str, int], Mapping[tuple, int]] | None = None,
           partial: bool = False) -> NftState:
    """The state of a table holding base and owned. partial: a side of a diff (_partial), whose
    owners are not keyed by Service and whose elements are all kept one by one, in plain dicts."""
    chains: dict[str, tuple[Rule, ...]] = dict(base.chains)
    decls: dict[str, BaseChain | None] = dict(base.chain_decls)
    sets: dict[str, SetDecl] = dict(base.sets)
    elements: dict[str, dict[str, tuple] | None] = {
        name: None if _bulk(name) and not partial else {} for name in sets}
    refs: dict[tuple, int] = {}
    hairpin: dict[str, int] = {}
    for name, key, text in base.elements:
        elements[name][key] = text                      # type: ignore[index]
    for key in sorted(owned):
        objs = owned[key]
        chains.update(objs.chains)
        decls.update(objs.chain_decls)
        for name, spec in objs.sets.items():
            sets[name] = spec
            elements.setdefault(name, {})
        for name, spec in objs.shared_sets.items():
            rk = ("set", name)
            if rk not in refs:
                sets[name] = spec
                elements.setdefault(name, {} if partial else None)
            refs[rk] = refs.get(rk, 0) + 1
        for name, ekey, text in objs.elements:
            elements.setdefault(name, {})[ekey] = text  # type: ignore[index]
        for ip in objs.hairpin:
            hairpin[ip] = hairpin.get(ip, 0) + 1
        if partial:
            for name, ekey, text in objs.range_elements():
                elements.setdefault(name, {})[ekey] = text  # type: ignore[index]
    if partial:
        if hairpin:
            side = elements.setdefault(HAIRPIN, {})
            for ip in hairpin:
                _, ekey, text = _hairpin_element(ip)
                side[ekey] = text                       # type: ignore[index]
        return NftState(family, chains, decls, sets, elements, owned, context, refs, buckets or {},  # type: ignore[arg-type]
                        hairpin)
    if buckets is None:
        buckets = _buckets((key, objs.slot_keys) for key, objs in owned.items())
    return NftState(family, chains, decls, sets, _Elements(elements, owned, buckets, hairpin), owned, context,
                    refs, buckets, hairpin)


def _buckets(slot_keys: Iterable[tuple[tuple[str, str], tuple]]) -> dict[tuple[str, int], dict[tuple, int]]:
    """Slots of every Service's slot keys ((Service key, its slot keys) pairs), per bucket."""
    out: dict[tuple[str, int], list] = {}
    for key, sks in slot_keys:
        if sks:
            b = bucket_of(key)
            for sk in sks:
                out.setdefault((sk[3], b), []).append(sk)
    return {b: _assign(v) for b, v in out.items()}


def _preferred_slot(slot_key: tuple) -> int:
    digest = hashlib.sha256("/".join(slot_key).encode()).digest()
    return int.from_bytes(digest[:4], "big") % SLOTS


def _assign(members) -> dict[tuple, int]:
    """Slots for one bucket's slot keys: each its hashed slot, the next free one on a collision.

    A function of the membership alone (so an incremental sync and a full
    render agree), and a Service joining or leaving moves another one only
    when their slots collide (about 20 members in 65535 slots at 10,000
    Services): a new Service rewrites no other Service's rules.
    """
    taken: set[int] = set()
    out: dict[tuple, int] = {}
    for preferred, sk in sorted([(_preferred_slot(k), k) for k in members]):   # each hashed once
        slot = preferred
        while slot in taken:
            slot = (slot + 1) % SLOTS
        taken.add(slot)
        out[sk] = slot
    return out


class _Layered(Mapping):
    """A read-only mapping: a base dict with some keys removed, replaced or added.

    It iterates exactly as a dict copy of the base would after the same pops
    and assignments (a re-added key goes to the end, a replaced one keeps its
    place), but deriving one costs O(changes), not O(size): a one-Service
    sync at 10,000 Services would otherwise copy 120,000 chains. After many
    changes it is flattened back into a dict (amortised O(1) per change).
    """
    __slots__ = ("_base", "_gone", "_vals", "_tail")

    def __init__(self, base: Mapping, gone: set, vals: dict, tail: dict) -> None:
        self._base = base      # never mutated
        self._gone = gone      # base keys no longer at their place (removed, or re-added at the end)
        self._vals = vals      # values that differ from the base, and those of the tail
        self._tail = tail      # keys after the base's, in order (values unused)

    @classmethod
    def derive(cls, m: Mapping) -> "_Layered":
        """A writable layer over m (m itself is left as it is)."""
        if isinstance(m, _Layered):
            return cls(m._base, set(m._gone), dict(m._vals), dict(m._tail))  # O(changes so far)
        return cls(m if isinstance(m, dict) else dict(m), set(), {}, {})

    def __getitem__(self, key):
        vals = self._vals
        if key in vals:
            return vals[key]
        if key in self._gone:
            raise KeyError(key)
        return self._base[key]

    def __contains__(self, key) -> bool:
        return key in self._vals or (key not in self._gone and key in self._base)

    def __iter__(self):
        gone = self._gone
        if gone:
            for key in self._base:
                if key not in gone:
                    yield key
        else:
            yield from self._base
        yield from self._tail

    def __len__(self) -> int:
        return len(self._base) - len(self._gone) + len(self._tail)

    def get(self, key, default=None):
        vals = self._vals
        if key in vals:
            return vals[key]
        if key in self._gone:
            return default
        return self._base.get(key, default)

    def __repr__(self) -> str:
        return repr(dict(self))

    # building (only while _apply makes the next state)
    def pop(self, key, default=None):
        if key in self._tail:
            del self._tail[key]
            return self._vals.pop(key)
        if key in self._base and key not in self._gone:
            self._gone.add(key)
            return self._vals.pop(key, self._base[key])
        return default

    def __setitem__(self, key, value) -> None:
        if key not in self:
            self._tail[key] = None
        self._vals[key] = value

    def update(self, other: Mapping) -> None:
        for key, value in other.items():
            self[key] = value

    def settled(self) -> Mapping:
        """Flattened into a dict once the changes outgrow ~sqrt(size).

        Each derive copies the changes so far and a flatten copies everything:
        a limit near sqrt(size) keeps both small per sync (about 1,500 entries
        for 120,000 chains, against 120,000 for a plain copy).
        """
        if len(self._gone) + len(self._vals) > 64 + 4 * math.isqrt(len(self._base)):
            # the base copied at C speed, then the changes: a 100,000-entry flatten (the hairpin
            # counts) took ~0.1 s item by item, one sync in ~130 at 10,000 Services
            out = dict(self._base)
            for key in self._gone:
                del out[key]
            tail = self._tail
            for key, value in self._vals.items():
                if key not in tail:
                    out[key] = value      # replaced in place
            for key in tail:
                out[key] = self._vals[key]
            return out
        return self


def _apply(previous: NftState, changes: Mapping[tuple[str, str], Objects | None],
           buckets: Mapping[tuple[str, int], Mapping[tuple, int]], hairpin_delta: Mapping[str, int]) -> NftState:
    """previous with the objects of the changed Services replaced (None: the Service is gone).

    O(changed Services): every mapping is a _Layered view over the previous one.
    """
    chains = _Layered.derive(previous.chains)
    decls = _Layered.derive(previous.chain_decls)
    sets = _Layered.derive(previous.sets)
    prev_elements = previous.elements
    # the bulk sets' elements follow from owned, buckets and hairpin: only the others are kept
    elements = _Layered.derive(prev_elements.plain if isinstance(prev_elements, _Elements) else prev_elements)
    owned = _Layered.derive(previous.owned)
    refs = _Layered.derive(previous.refs)
    hairpin = _Layered.derive(previous.hairpin)
    copied: set[str] = set()

    def writable(name: str) -> _Layered | None:
        if _bulk(name):
            if elements.get(name, 0) is not None:
                elements[name] = None
            return None
        if name not in copied:
            elements[name] = _Layered.derive(elements.get(name) or {})
            copied.add(name)
        return elements[name]  # type: ignore[return-value]

    # hairpin owners: only the net change of each address (the layered map stays small)
    for ip, d in hairpin_delta.items():
        if d:
            count = hairpin.get(ip, 0) + d
            if count > 0:
                hairpin[ip] = count
            else:
                hairpin.pop(ip, None)
    for key, objs in changes.items():
        old = owned.pop(key, None)
        if old is None:
            continue
        for name in old.chains:
            chains.pop(name, None)
            decls.pop(name, None)
        for name in old.sets:
            sets.pop(name, None)
            elements.pop(name, None)
            copied.discard(name)
        for name, ekey, _ in old.elements:
            if name in elements:
                writable(name).pop(ekey, None)   # type: ignore[union-attr]
        for name in old.shared_sets:
            count = refs.get(("set", name), 0) - 1
            if count > 0:
                refs[("set", name)] = count
            else:
                # the last owner: its elements went with the owners above
                refs.pop(("set", name), None)
                sets.pop(name, None)
                elements.pop(name, None)
                copied.discard(name)
    for key, objs in changes.items():
        if objs is None:
            continue
        owned[key] = objs
        chains.update(objs.chains)
        decls.update(objs.chain_decls)
        for name, spec in objs.sets.items():
            sets[name] = spec
            writable(name)
        for name, spec in objs.shared_sets.items():
            count = refs.get(("set", name), 0)
            if not count:
                sets[name] = spec
                writable(name)
            refs[("set", name)] = count + 1
        for name, ekey, text in objs.elements:
            writable(name)[ekey] = text          # type: ignore[index]
    for name in copied:
        if name in elements:
            elements[name] = elements[name].settled()
    owned_now, hairpin_now = owned.settled(), hairpin.settled()
    return NftState(previous.family, chains.settled(), decls.settled(), sets.settled(),
                    _Elements(elements.settled(), owned_now, buckets, hairpin_now),
                    owned_now, previous.context, refs.settled(), buckets, hairpin_now)


def _partial(family: int, objs: list[Objects]) -> NftState:
    """A state holding only these objects: the two sides of a diff restricted to changed Services."""
    return _merge(family, Objects(), {(str(i), ""): o for i, o in enumerate(objs)}, (), {}, partial=True)


def _align_shared(old_side: NftState, new_side: NftState, previous: NftState, new: NftState) -> None:
    """Make the diff of the changed Services' objects respect what other owners hold.

    A set or element the changed Services gave up stays when the whole new
    table still holds it (a bucket map, a hairpin pair of an endpoint shared
    with another Service), and one they bring is not added again when the
    table already held it. The sides are fresh dicts from _partial.
    """
    old_sets, new_sets = old_side.sets, new_side.sets
    old_el, new_el = old_side.elements, new_side.elements
    for name in list(old_sets):
        if name not in new_sets and name in new.sets:
            new_sets[name] = new.sets[name]            # type: ignore[index]
            new_el.setdefault(name, {})                # type: ignore[attr-defined]
    for name in list(new_sets):
        if name not in old_sets and name in previous.sets:
            old_sets[name] = previous.sets[name]       # type: ignore[index]
            old_el.setdefault(name, {})                # type: ignore[attr-defined]
    for name, elems in list(old_el.items()):
        now = new.elements.get(name, {})
        side = new_el.setdefault(name, {})             # type: ignore[attr-defined]
        for key, text in elems.items():
            if key not in side and now.get(key) == text:
                side[key] = text
    for name, elems in list(new_el.items()):
        was = previous.elements.get(name, {})
        side = old_el.setdefault(name, {})             # type: ignore[attr-defined]
        for key, text in elems.items():
            if key not in side and was.get(key) == text:
                side[key] = text


def render(state: ClusterState, cfg: Config, family: int = 4, *,
           previous: NftState | None = None,
           changed: Iterable[tuple[str, str]] | None = None,
           resync: bool = False, cache: RenderCache | None = None) -> NftRuleSet:
    """The nft -f transaction for `state`.

    previous None: a full transaction (recreates the table). previous given:
    only the changes from it. changed (with previous): the Service keys whose
    Service or EndpointSlices changed since `previous` was rendered
    (StateStore deltas); only those (and, when a Service's slots change, the
    Services sharing its endpoint map) are rebuilt, so a small change costs
    little however large the cluster. Without it every Service is rebuilt and
    compared. resync (with previous): a full sync that keeps the table, as
    kube-proxy's periodic full syncs: every chain is flushed and refilled,
    every map re-filled, objects `previous` had and the state no longer needs
    deleted; session-affinity sets keep their entries. cache: per-Service
    work kept across renders by the caller (output never depends on it).
    """
    with gc_paused():
        base, context, node, zone = _base(state, cfg, family)
        if previous is None or previous.family != family:
            new = _full_state(state, cfg, family, node, zone, base, context, cache)
            ops = full_ops(new)
            return NftRuleSet(family=family, state=new, full=True,
                              changes=sum(new.summary().values()), ops=tuple(ops))
        if resync:
            new = _full_state(state, cfg, family, node, zone, base, context, cache, previous)
            ops = resync_ops(previous, new)
            return NftRuleSet(family=family, state=new, full=True, changes=len(ops), ops=tuple(ops))
        if changed is None or previous.context != context:
            new = _full_state(state, cfg, family, node, zone, base, context, cache, previous)
            ops = diff_ops(previous, new)
            return NftRuleSet(family=family, state=new, full=False, changes=len(ops), ops=tuple(ops))
        updates, buckets = _changed_objects(state, cfg, family, node, zone, previous, set(changed),
                                            cache.ports if cache is not None else None)
        if cache is not None:
            # a full render's entries of these Services are stale now: kept, they held every
            # Service's first objects beside its new ones until the next full render (the
            # hourly resync), ~5 KB more per Service changed since (+50 MB under churn)
            for key in updates:
                cache.entries.pop(key, None)
        hairpin = _hairpin_delta(updates, previous.owned)
        new = _apply(previous, updates, buckets, hairpin)
        olds = [o for k in updates if (o := previous.owned.get(k)) is not None]
        news = [o for o in updates.values() if o is not None]
        # the endpoint-map ranges and hairpin pairs (thousands for a big Service) are compared
        # slot by slot and address by address below, not made into elements on both sides
        old_side = _partial(family, [_without_bulk(o) for o in olds])
        new_side = _partial(family, [_without_bulk(o) for o in news])
        _align_shared(old_side, new_side, previous, new)
        dels, adds = _bulk_ops(olds, news, previous, new, hairpin)
        ops = dels + diff_ops(old_side, new_side) + adds
        return NftRuleSet(family=family, state=new, full=False, changes=_statements(ops), ops=tuple(ops))


def build(state: ClusterState, cfg: Config, family: int = 4, cache: RenderCache | None = None) -> NftState:
    """The complete table contents for `state`."""
    with gc_paused():
        base, context, node, zone = _base(state, cfg, family)
        return _full_state(state, cfg, family, node, zone, base, context, cache)


def nodeport_addresses(cfg: Config, node: NodeInfo, family: int) -> tuple[bool, tuple[str, ...]]:
    """(all local addresses?, else these): kube-proxy's nftables default is the primary node IP."""
    if cfg.proxy.nodeport_addresses:
        if not node.nodeport_all:
            # loopback never accepts NodePorts in nftables mode
            return False, tuple(ip for ip in node.nodeport_ips if ip not in ("127.0.0.1", "::1"))
        return True, ()
    if node.primary_ip:
        return False, (node.primary_ip,)
    return True, ()


def _uses_cluster(info: ServicePortInfo) -> bool:
    """The Cluster-policy chain is needed: internal Cluster traffic, or the eTP Local short-circuits."""
    return not info.internal_local or info.externally_accessible


def _slot_keys(pairs: list[tuple[ServicePortInfo, Categorized]]) -> tuple[tuple, ...]:
    out = []
    for info, _ in pairs:
        if info.affinity_timeout:
            continue    # per-endpoint chains instead
        head = (info.namespace, info.service_name, info.port_name, info.protocol)
        if _uses_cluster(info):
            out.append(head + (CLUSTER,))
        if info.uses_local_endpoints:
            out.append(head + (LOCAL,))
    return tuple(out)


def _group(pairs: list[tuple[ServicePortInfo, Categorized]]) -> dict[tuple[str, str], list]:
    groups: dict[tuple[str, str], list] = {}
    for pair in pairs:
        group = groups.get(pair[0].service)
        if group is None:
            groups[pair[0].service] = [pair]
        else:
            group.append(pair)
    return groups


def _full_state(state: ClusterState, cfg: Config, family: int, node: NodeInfo, zone: str, base: Objects,
                context: tuple, cache: RenderCache | None, previous: NftState | None = None) -> NftState:
    """Every Service's objects, merged. previous: returned as it is when it holds the very same
    objects (a periodic resync of an unchanged cluster builds no second table state beside it)."""
    groups = _group(service_ports(state, cfg, family, cache.ports if cache is not None else None))
    slot_keys = {key: _slot_keys(pairs) for key, pairs in groups.items()}
    buckets = _buckets(slot_keys.items())
    index = {sk: (b, i) for b, sks in buckets.items() for sk, i in sks.items()}
    _, ipx, addr_type = _fam(family)
    ctx = (family, node, zone, cfg.proxy.masquerade_all)
    old = cache.entries if cache is not None and cache.context == ctx else {}
    entries: dict[tuple[str, str], tuple] = {}
    owned: dict[tuple[str, str], Objects] = {}
    for key, pairs in groups.items():
        sks = slot_keys[key]
        slots = tuple(index[sk] for sk in sks)
        hit = old.get(key)
        if hit is not None and hit[1] == slots and len(hit[0]) == len(pairs) \
                and all(a is b for a, b in zip(hit[0], pairs)):
            objs = hit[2]
        else:
            objs = _objects(pairs, sks, slots, node, cfg, ipx, addr_type)
            was = previous.owned.get(key) if previous is not None else None
            if was is not None:
                objs = _keep_places(objs, was)     # as a targeted sync would have placed them
        owned[key] = objs
        entries[key] = (pairs, slots, objs)
    if cache is not None:
        # only this render's Services are kept: bounded by the state
        cache.context, cache.entries = ctx, entries
    if previous is not None and previous.family == family and previous.context == context \
            and len(previous.owned) == len(owned) and previous.buckets == buckets \
            and all(previous.owned.get(key) is objs for key, objs in owned.items()):
        return previous
    return _merge(family, base, owned, context, buckets)


def _changed_objects(state: ClusterState, cfg: Config, family: int, node: NodeInfo, zone: str,
                     previous: NftState, changed: set[tuple[str, str]], ports: PortsCache | None):
    """The new Objects of the changed Services, and of those whose slot moved because of them."""
    pairs = {key: service_ports_for(state, key, family, cfg.proxy.node_name, zone, ports) for key in changed}
    buckets = dict(previous.buckets)
    touched: set[tuple[str, int]] = set()
    for key, ps in pairs.items():
        old = previous.owned.get(key)
        old_sk = old.slot_keys if old is not None else ()
        new_sk = _slot_keys(ps)
        if old_sk != new_sk:
            num = bucket_of(key)
            for proto in {sk[3] for sk in old_sk} | {sk[3] for sk in new_sk}:
                b = (proto, num)
                now = (set(buckets.get(b, ())) - set(old_sk)) | {sk for sk in new_sk if sk[3] == proto}
                if now:
                    buckets[b] = _assign(now)
                else:
                    buckets.pop(b, None)
                touched.add(b)
    for b in touched:
        before = previous.buckets.get(b, {})
        for sk, i in buckets.get(b, {}).items():
            mate = (sk[0], sk[1])
            if before.get(sk) != i and mate not in pairs:
                pairs[mate] = service_ports_for(state, mate, family, cfg.proxy.node_name, zone, ports)
    _, ipx, addr_type = _fam(family)
    updates: dict[tuple[str, str], Objects | None] = {}
    for key, ps in pairs.items():
        if not ps:
            updates[key] = None
            continue
        sks = _slot_keys(ps)
        num = bucket_of(key) if sks else 0
        slots = tuple(((sk[3], num), buckets[(sk[3], num)][sk]) for sk in sks)
        objs = _objects(ps, sks, slots, node, cfg, ipx, addr_type)
        was = previous.owned.get(key)
        updates[key] = _keep_places(objs, was) if was is not None else objs
    return updates, buckets


def _keep_places(new: Objects, old: Objects) -> Objects:
    """new, with each slot's endpoints where old had them when the slot keeps its size.

    A slot's shares are fixed by its endpoint count alone; a replaced endpoint (a Pod
    recreated) takes the share the one it replaces had, and every other endpoint keeps
    its own: the change is one element, not the shift of every endpoint sorted after
    it (thousands in a big Service). New endpoints fill the freed places in sorted order;
    a full render (previous None) lays every slot out sorted again."""
    if not new.ranges or not old.ranges:
        return new
    before = {(name, offset): eps for name, offset, eps in old.ranges}
    ranges = []
    moved = False
    for name, offset, eps in new.ranges:
        was = before.get((name, offset))
        if was is not None and was is not eps and len(was) == len(eps):
            placed = _placed(was, eps)
            moved = moved or placed is not eps
            ranges.append((name, offset, placed))
        else:
            ranges.append((name, offset, eps))
    if not moved:
        return new
    return Objects(new.chains, new.chain_decls, new.sets, new.elements, new.shared_sets, tuple(ranges),
                   new.hairpin, new.slot_keys, new.slots)


def _placed(was: tuple, eps: tuple) -> tuple:
    """eps (sorted) in the places of was (as many): the same endpoint (address and port) where
    it was, the others in the places left, in order. (C-level passes: 5,000 endpoints.)"""
    old_keys = list(map(_EP_KEY, was))
    new_by = dict(zip(map(_EP_KEY, eps), eps))
    before = set(old_keys)
    came = new_by.keys() - before
    if came:
        gone = before - new_by.keys()
        if len(gone) > 16:
            places = [i for i, k in enumerate(old_keys) if k in gone]
        else:
            places = sorted(old_keys.index(k) for k in gone)
        for i, k in zip(places, sorted(came)):
            old_keys[i] = k
    return tuple(map(new_by.__getitem__, old_keys))


_EP_KEY, _EP_IP = itemgetter(2), itemgetter(0)     # EndpointInfo.endpoint ("ip:port"), .ip


def _without_bulk(objs: Objects) -> Objects:
    if not objs.ranges and not objs.hairpin:
        return objs
    return Objects(objs.chains, objs.chain_decls, objs.sets, objs.elements, objs.shared_sets, (), (),
                   objs.slot_keys, objs.slots)


def _slot_element(name: str, offset: int, count: int, i: int, ep) -> tuple:
    """The i-th of `count` interval elements of a slot (as _slot_elements makes it)."""
    lo, hi = offset + i * SLOT // count, offset + (i + 1) * SLOT // count - 1
    key = f"{lo}-{hi}"
    return (True, "", f"{key} : {ep.ip} . {ep.port}", 2, ep.ip, ep.port, lo, hi)


def _hairpin_delta(changes: Mapping[tuple[str, str], Objects | None], owned: Mapping) -> dict[str, int]:
    """The net change of each address's hairpin owners when the changed Services' objects
    replace those in `owned` (a replaced endpoint of a Service of 5,000 changes two counts)."""
    delta: dict[str, int] = {}
    for key, objs in changes.items():
        old = owned.get(key)
        was = old.hairpin if old is not None else ()
        now = objs.hairpin if objs is not None else ()
        if was == now:
            continue
        a, b = set(was), set(now)
        if len(a) == len(was) and len(b) == len(now):    # each address once (the usual one port)
            for ip in a - b:
                delta[ip] = delta.get(ip, 0) - 1
            for ip in b - a:
                delta[ip] = delta.get(ip, 0) + 1
            continue
        for ip in was:
            delta[ip] = delta.get(ip, 0) - 1
        for ip in now:
            delta[ip] = delta.get(ip, 0) + 1
    return delta


def _bulk_ops(olds: list[Objects], news: list[Objects], previous: NftState, new: NftState,
              hairpin: Mapping[str, int]) -> tuple[list, list]:
    """(deletes, adds) of endpoint-map and hairpin elements turning the changed Services' old
    objects into their new ones: per slot, only the places whose endpoint changed (all of
    them when the slot's size changed); per address, only pairs the whole table gains or loses."""
    before = {(name, offset): eps for o in olds for name, offset, eps in o.ranges}
    after = {(name, offset): eps for o in news for name, offset, eps in o.ranges}
    dels: dict[str, list] = {}
    adds: dict[str, list] = {}
    for (name, offset), eps in before.items():
        now = after.get((name, offset))
        if now is eps:
            continue
        gone = dels.setdefault(name, []) if name in new.sets else None   # a deleted map takes its elements
        if now is not None and len(now) == len(eps):
            count = len(eps)
            put = adds.setdefault(name, [])
            for i in compress(range(count), map(is_not, eps, now)):
                if eps[i][2] == now[i][2]:     # the same "ip:port": the same element
                    continue
                if gone is not None:
                    gone.append(_slot_element(name, offset, count, i, eps[i]))
                put.append(_slot_element(name, offset, count, i, now[i]))
            continue
        old_elems = [e for _, _, e in _slot_elements(name, offset, eps)]
        new_elems = [e for _, _, e in _slot_elements(name, offset, now)] if now is not None else []
        if new_elems:    # another size: every share moves, but an element may happen to stay
            same = set(old_elems).intersection(new_elems)
            if same:
                old_elems = [e for e in old_elems if e not in same]
                new_elems = [e for e in new_elems if e not in same]
            adds.setdefault(name, []).extend(new_elems)
        if gone is not None:
            gone += old_elems
    for (name, offset), eps in after.items():
        if (name, offset) not in before:
            adds.setdefault(name, []).extend(e for _, _, e in _slot_elements(name, offset, eps))
    was, now_refs = previous.hairpin, new.hairpin
    for ip, d in hairpin.items():
        if d:
            had, has = ip in was, ip in now_refs
            if had and not has:
                dels.setdefault(HAIRPIN, []).append(_hairpin_element(ip)[2])
            elif has and not had:
                adds.setdefault(HAIRPIN, []).append(_hairpin_element(ip)[2])
    return ([Op("delete", "element", name, tuple(e)) for name, e in dels.items() if e],
            [Op("add", "element", name, tuple(e)) for name, e in adds.items() if e])


def _statements(ops: list[Op]) -> int:
    """Statements of a transaction (an element operation counts each element)."""
    return sum(len(op.body) if op.kind == "element" and isinstance(op.body, tuple) else 1 for op in ops)


def _objects(pairs, slot_keys: tuple, slots: tuple, node: NodeInfo, cfg: Config, ipx: str,
             addr_type: str) -> Objects:
    b = _Builder()
    where = dict(zip(slot_keys, slots))
    for info, cat in pairs:
        head = (info.namespace, info.service_name, info.port_name, info.protocol)
        _service(b, info, cat, node, cfg, ipx, addr_type, where.get(head + (CLUSTER,)), where.get(head + (LOCAL,)))
    return b.objects(slot_keys, slots)


def _base(state: ClusterState, cfg: Config, family: int) -> tuple[Objects, tuple, NodeInfo, str]:
    """The table's fixed layout, and the context every Service's objects depend on."""
    _, ipx, addr_type = _fam(family)
    node = node_info(state, cfg, family)
    mark = hex(1 << cfg.proxy.masquerade_bit)
    np_all, np_ips = nodeport_addresses(cfg, node, family)
    b = _Builder()

    for name, ctype, hook, prio in BASE_CHAINS:
        b.chain(name, BaseChain(ctype, hook, prio))
    for src, match, dst in JUMPS:
        b.chain(dst)
        b.chain(src).append(rule(CtState("new"), Verdict("jump", dst)) if match else rule(Verdict("jump", dst)))
    for name in (SERVICES, "cluster-ips-check", MASQUERADING, MARK_MASQ):
        b.chain(name)
    b.chain(MARK_MASQ).append(rule(MarkSet("or", mark)))
    b.set(HAIRPIN, SetDecl("set", type=f"{addr_type} . {addr_type}",
                           comment="endpoint . endpoint: a Pod reaching itself through a Service"))
    b.chain(MASQUERADING).extend([
        rule(CtStatus("dnat"), Lookup((f"{ipx} saddr", f"{ipx} daddr"), HAIRPIN), Verdict("jump", MARK_MASQ)),
        rule(MarkIsZero(mark), Verdict("return")), rule(MarkSet("xor", mark)), rule(Masquerade())])

    b.set(CLUSTER_IPS, SetDecl("set", type=addr_type, comment="Active ClusterIPs"))
    check = b.chain("cluster-ips-check")
    check.append(rule(Lookup((f"{ipx} daddr",), CLUSTER_IPS), Verdict("reject"),
                      comment="Reject traffic to invalid ports of ClusterIPs"))
    cidrs = tuple(c for c in cfg.proxy.service_cidrs if (":" in c) == (family == 6))
    if cidrs:
        check.append(rule(AddrIn(ipx, "daddr", cidrs), Verdict("drop"), comment="Drop traffic to unallocated ClusterIPs"))

    np_match: tuple
    if not np_all:
        b.set(NODEPORT_IPS, SetDecl("set", type=addr_type, comment="IPs that accept NodePort traffic"))
        for ip in np_ips:
            b.element(NODEPORT_IPS, (ip,))
        np_match = (Lookup((f"{ipx} daddr",), NODEPORT_IPS),)
    else:
        np_match = (FibLocal("daddr"), Addr(ipx, "daddr", "127.0.0.0/8" if family == 4 else "::1", neg=True))

    svc_key = (f"{ipx} daddr", "meta l4proto", "th dport")
    np_key = ("meta l4proto", "th dport")
    svc_type = f"{addr_type} . inet_proto . inet_service"
    b.set(NO_ENDPOINT_REJECT, SetDecl("set", type=svc_type, comment="Service addresses without endpoints: rejected"))
    b.set(NO_ENDPOINT_DROP, SetDecl("set", type=svc_type, comment="Service addresses without endpoints for their "
                                                                  "Local policy: dropped"))
    b.set(NO_ENDPOINT_NODEPORT_REJECT, SetDecl("set", type="inet_proto . inet_service",
                                               comment="NodePorts without endpoints: rejected"))
    b.set(NO_ENDPOINT_NODEPORT_DROP, SetDecl("set", type="inet_proto . inet_service",
                                             comment="NodePorts without local endpoints: dropped"))
    b.chain("service-endpoints-check").extend([rule(Lookup(svc_key, NO_ENDPOINT_REJECT), Verdict("reject")),
                                               rule(Lookup(svc_key, NO_ENDPOINT_DROP), Verdict("drop"))])
    b.chain("nodeport-endpoints-check").extend([
        rule(*np_match, Lookup(np_key, NO_ENDPOINT_NODEPORT_REJECT), Verdict("reject")),
        rule(*np_match, Lookup(np_key, NO_ENDPOINT_NODEPORT_DROP), Verdict("drop"))])

    b.set(FIREWALL_IPS, SetDecl("map", type=f"{svc_type} : verdict",
                                comment="destinations that are subject to LoadBalancerSourceRanges"))
    # without endpoints the address is rejected later, whatever the source (as kube-proxy)
    b.chain("firewall-check").extend([rule(Lookup(svc_key, NO_ENDPOINT_REJECT), Verdict("return")),
                                      rule(Vmap(svc_key, FIREWALL_IPS))])

    b.set(SERVICE_IPS, SetDecl("map", type=f"{svc_type} : verdict",
                               comment="ClusterIP, ExternalIP and LoadBalancer IP traffic"))
    b.set(SERVICE_NODEPORTS, SetDecl("map", type="inet_proto . inet_service : verdict", comment="NodePort traffic"))
    b.chain(SERVICES).append(rule(Vmap(svc_key, SERVICE_IPS)))
    b.chain(SERVICES).append(rule(*np_match, Vmap(np_key, SERVICE_NODEPORTS)))

    zone = ""
    if cfg.proxy.node_name and cfg.proxy.node_name in state.nodes:
        zone = state.nodes[cfg.proxy.node_name].zone
    base = b.objects()
    # everything a Service's objects depend on besides the Service itself
    context = (base, node, zone, cfg.proxy.masquerade_all)
    return base, context, node, zone


def _service(b: _Builder, info: ServicePortInfo, cat: Categorized, node: NodeInfo, cfg: Config,
             ipx: str, addr_type: str, cluster_slot: tuple | None,
             local_slot: tuple | None) -> None:
    proto = info.protocol
    name = info.name
    port = info.port_number
    sport = str(port)
    cip = info.cluster_ip
    base = info.nft_base
    cluster_chain = n.nft_service_chain(base)
    local_chain = n.nft_local_chain(base)
    ext_chain = n.nft_external_chain(base)
    fw_chain = n.nft_firewall_chain(base)
    has_endpoints = cat.has_endpoints
    has_internal = has_endpoints and (bool(cat.local) if info.internal_local else True)
    has_external = has_endpoints and (bool(cat.local) if info.external_local else True)
    internal_chain = local_chain if info.internal_local else cluster_chain
    int_set = NO_ENDPOINT_REJECT if not has_endpoints else (NO_ENDPOINT_DROP if not has_internal else "")
    ext_set = NO_ENDPOINT_REJECT if not has_endpoints else (NO_ENDPOINT_DROP if not has_external else "")
    np_set = NO_ENDPOINT_NODEPORT_REJECT if not has_endpoints else (
        NO_ENDPOINT_NODEPORT_DROP if not has_external else "")

    # entries stay while the Service exists, with or without endpoints: no verdict element changes with them
    b.element(CLUSTER_IPS, (cip,))
    b.element(SERVICE_IPS, (cip, proto, sport), ("goto", internal_chain))
    if int_set:
        b.element(int_set, (cip, proto, sport), None, name)
    to_ext = ("goto", ext_chain)
    for eip in info.external_ips:
        b.element(SERVICE_IPS, (eip, proto, sport), to_ext)
        if ext_set:
            b.element(ext_set, (eip, proto, sport), None, name)
    firewall = bool(info.lb_ips) and info.lb_firewall
    for lbip in info.lb_ips:
        b.element(SERVICE_IPS, (lbip, proto, sport), to_ext)
        if firewall:
            b.element(FIREWALL_IPS, (lbip, proto, sport), ("goto", fw_chain), name)
        if ext_set:
            b.element(ext_set, (lbip, proto, sport), None, name)
    if info.node_port:
        nport = str(info.node_port)
        b.element(SERVICE_NODEPORTS, (proto, nport), to_ext)
        if np_set:
            b.element(np_set, (proto, nport), None, name)

    masq: Rule | None = None
    if cfg.proxy.masquerade_all:
        masq = rule(Addr(ipx, "daddr", cip), Dport(proto, port), Verdict("jump", MARK_MASQ))
    elif node.local_cidr:
        masq = rule(Addr(ipx, "daddr", cip), Dport(proto, port), Addr(ipx, "saddr", node.local_cidr, neg=True),
                    Verdict("jump", MARK_MASQ))
    ep_bases: dict[str, str] = {}
    if info.affinity_timeout:
        # nft_endpoint_base inlined: kube-proxy's names for the per-endpoint chains
        prefix = f"{info.namespace}/{info.service_name}/{proto}/{info.port_name}__"
        for ep in cat.reachable:
            text = f"{prefix}{ep.ip.replace(':', '.')}/{ep.port}"
            ep_bases[ep.endpoint] = n._b32_16(text)[:8] + "-" + (text if len(text) <= 240 else text[:237] + "...")
    if _uses_cluster(info):
        rules = b.chain(cluster_chain)
        if masq and not info.internal_local:
            rules.append(masq)
        _dispatch(b, rules, info, cat.cluster, cluster_slot, ep_bases, ipx)
    if info.uses_local_endpoints:
        rules = b.chain(local_chain)
        if masq and info.internal_local:
            rules.append(masq)
        _dispatch(b, rules, info, cat.local, local_slot, ep_bases, ipx)

    if info.externally_accessible:
        rules = b.chain(ext_chain)
        if not info.external_local:
            rules += [rule(Verdict("jump", MARK_MASQ)), rule(Verdict("goto", cluster_chain))]
        else:
            if node.local_cidr:
                rules.append(rule(Addr(ipx, "saddr", node.local_cidr), Verdict("goto", cluster_chain),
                                  comment="short-circuit pod traffic"))
            rules.append(rule(FibLocal("saddr"), Verdict("jump", MARK_MASQ), comment="masquerade local traffic"))
            rules.append(rule(FibLocal("saddr"), Verdict("goto", cluster_chain), comment="short-circuit local traffic"))
            rules.append(rule(Verdict("goto", local_chain)))

    if firewall:
        sources = list(info.lb_source_ranges)
        if node.primary_ip and any(_contains(c, node.primary_ip) for c in info.lb_source_ranges):
            sources += list(info.lb_ips)
        # ranges only in the other family allow nothing of this one
        b.chain(fw_chain).append(rule(AddrIn(ipx, "saddr", tuple(sources), neg=True), Verdict("drop"))
                                 if sources else rule(Verdict("drop")))

    b.hairpin += map(_EP_IP, cat.reachable)     # the `ep . ep` pairs of the shared hairpin set
    if info.affinity_timeout:
        for ep in cat.reachable:
            ep_base = ep_bases[ep.endpoint]
            aff = n.nft_affinity_set(ep_base)
            b.set(aff, SetDecl("set", type=addr_type, flags="dynamic,timeout", timeout=info.affinity_timeout))
            b.chain(n.nft_endpoint_chain(ep_base)).extend([rule(Update(aff, ipx)), rule(DnatTo(proto, ep.ip, ep.port))])


def _dispatch(b: _Builder, rules: list[Rule], info: ServicePortInfo, endpoints, slot: tuple | None,
              ep_bases: dict[str, str], ipx: str) -> None:
    if info.affinity_timeout:
        # kube-proxy's shape: a client seen recently goes back to its endpoint, others are spread
        for ep in endpoints:
            base = ep_bases[ep.endpoint]
            rules.append(rule(Lookup((f"{ipx} saddr",), n.nft_affinity_set(base)),
                              Verdict("goto", n.nft_endpoint_chain(base))))
        if endpoints:
            rules.append(rule(NumgenVmap(tuple(n.nft_endpoint_chain(ep_bases[ep.endpoint]) for ep in endpoints))))
        return
    assert slot is not None
    bucket, index = slot
    name = endpoints_map(bucket)
    offset = index * SLOT
    b.shared_sets[name] = _endpoints_decl(ipx, info.protocol)
    rules.append(rule(DnatMap(info.protocol, SLOT, offset, name)))
    if endpoints:
        # the endpoints themselves (shared with servicemap's cache): the elements are made when read
        b.ranges.append((name, offset, endpoints))


@lru_cache(maxsize=None)
def _endpoints_decl(ipx: str, protocol: str) -> SetDecl:
    """An endpoint map's declaration: one object for all the Services of a family and protocol."""
    return SetDecl("map", typeof=f"numgen random mod {SLOT} : {ipx} daddr . {protocol} dport", flags="interval")


def endpoint_share(text_key: str) -> float:
    """The share of new connections an endpoint-map element's range gets ("lo-hi")."""
    lo, _, hi = text_key.partition("-")
    return (int(hi) - int(lo) + 1) / SLOT


def _contains(cidr: str, ip: str) -> bool:
    try:
        return ipaddress.ip_address(ip) in ipaddress.ip_network(cidr, strict=False)
    except ValueError:
        return False


TABLE_COMMENT = "rules for kube-proxy"


def full_ops(new: NftState) -> list[Op]:
    """A transaction that replaces the whole table with `new` (atomic: one nft -f or netlink batch)."""
    t = n.NFT_TABLE
    ops = [Op("add", "table", t, TABLE_COMMENT), Op("delete", "table", t), Op("add", "table", t, TABLE_COMMENT)]
    ops += [Op("add", "chain", name, decl) for name, decl in new.chain_decls.items()]
    ops += [Op("add", sdecl.kind, name, sdecl) for name, sdecl in new.sets.items()]
    _rules_and_elements(ops, new)
    return ops


def _rules_and_elements(ops: list[Op], new: NftState) -> None:
    """Every rule, then every element, of `new` (hot: hundreds of thousands of objects)."""
    for name, rules in new.chains.items():
        ops += [Op("add", "rule", name, r) for r in rules]
    # one statement per set: nft sends its elements in few messages (one per element was
    # 220,000 commands at 10,000 Services, each looking the set up by name in the kernel)
    for name, elems in new.elements.items():
        if elems:
            # a bulk set's elements are made as the operation is encoded, not all kept at once
            values = elems.values()
            ops.append(Op("add", "element", name, values if isinstance(values, _Values) else tuple(values)))


def resync_ops(old: NftState, new: NftState) -> list[Op]:
    """Rewrite everything in place: repairs any drift in our objects, keeps affinity entries.

    Affinity sets are the only objects the kernel fills by itself (`update @set`);
    they are re-declared (idempotent) but not flushed, unless their declaration changed.
    """
    ops = [Op("add", "table", n.NFT_TABLE, TABLE_COMMENT)]
    redeclared = [c for c in new.chains if c in old.chain_decls and old.chain_decls[c] != new.chain_decls[c]]
    for name, decl in new.chain_decls.items():
        if name not in redeclared:
            ops.append(Op("add", "chain", name, decl))
    for name in old.chains:
        ops.append(Op("flush", "chain", name))
    for name in new.chains:
        if name not in old.chains:
            ops.append(Op("flush", "chain", name))   # it may exist without our knowing (drift)
    recreated = [s for s in new.sets if s in old.sets and old.sets[s] != new.sets[s]]
    for name, sdecl in new.sets.items():
        if name not in recreated:
            ops.append(Op("add", sdecl.kind, name, sdecl))
            if "dynamic" not in sdecl.flags:
                ops.append(Op("flush", sdecl.kind, name))
    for name in old.chains:
        if name not in new.chains:
            ops.append(Op("delete", "chain", name))
    for name in redeclared:
        ops.append(Op("delete", "chain", name))
        ops.append(Op("add", "chain", name, new.chain_decls[name]))
    for name in old.sets:
        if name not in new.sets or name in recreated:
            ops.append(Op("delete", old.sets[name].kind, name))
    for name in recreated:
        ops.append(Op("add", new.sets[name].kind, name, new.sets[name]))
    _rules_and_elements(ops, new)
    return ops


def diff_ops(old: NftState, new: NftState) -> list[Op]:
    """The transaction turning `old` into `new`: only changed elements and chains."""
    ops: list[Op] = []
    # sets whose declaration changed are recreated; chains using them are refilled
    recreated = {s for s in new.sets if s in old.sets and old.sets[s] != new.sets[s]}
    removed_sets = [s for s in old.sets if s not in new.sets]
    added_sets = [s for s in new.sets if s not in old.sets]
    removed_chains = [c for c in old.chains if c not in new.chains]
    added_chains = [c for c in new.chains if c not in old.chains]
    redeclared = [c for c in new.chains if c in old.chains and old.chain_decls.get(c) != new.chain_decls.get(c)]
    changed = [c for c in new.chains if c in old.chains and (
        old.chains[c] != new.chains[c] or c in redeclared
        or (recreated and any(s in recreated for r in new.chains[c] for s in r.sets())))]

    for c in added_chains:
        ops.append(Op("add", "chain", c, new.chain_decls.get(c)))
    for s in added_sets:
        ops.append(Op("add", new.sets[s].kind, s, new.sets[s]))
    # elements that go away or change value
    for s, elems in old.elements.items():
        if s in removed_sets or s in recreated:
            continue
        now = new.elements.get(s, {})
        for key, elem in elems.items():
            if now.get(key) != elem:
                ops.append(Op("delete", "element", s, (elem,)))   # stored form: text and netlink read it
    for c in changed + removed_chains:
        ops.append(Op("flush", "chain", c))
    for c in removed_chains:
        ops.append(Op("delete", "chain", c))
    for c in redeclared:
        # a base chain's hook or priority changed: recreate it (flushed above)
        ops.append(Op("delete", "chain", c))
        ops.append(Op("add", "chain", c, new.chain_decls[c]))
    for s in removed_sets + sorted(recreated):
        ops.append(Op("delete", old.sets[s].kind, s))
    for s in sorted(recreated):
        ops.append(Op("add", new.sets[s].kind, s, new.sets[s]))
    for c in added_chains + changed:
        ops += [Op("add", "rule", c, r) for r in new.chains[c]]
    for s, elems in new.elements.items():
        before = {} if (s in recreated or s in added_sets) else old.elements.get(s, {})
        for key, elem in elems.items():
            if before.get(key) != elem:
                ops.append(Op("add", "element", s, (elem,)))   # stored form: text and netlink read it
    return ops


def programmed(family: int = 4, netns: str | None = None) -> dict[tuple[str, str, int], frozenset[str]]:
    """What a previous clusterdns left in the kernel: (ClusterIP, protocol, port) -> "ip:port" endpoints.

    Read over netlink (no nft process, no listing of the whole ruleset):
    `service-ips` elements whose verdict goes to a service-/local- chain, those
    chains' rules (the endpoint map and offset of their dnat, or the endpoint
    chains of an affinity Service), and the endpoint maps' elements in the slot.
    Both the Cluster and the Local chain of a port count. A port without
    endpoints maps to an empty set; no table (or no access): an empty dict.
    IPv6 endpoints are "[ip]:port"; protocols are upper case (TCP, UDP, SCTP).
    """
    from . import nflink
    try:
        return _programmed(family, netns, nflink)
    except nflink.NflinkError as exc:
        if exc.errno == 2:   # ENOENT: no table
            return {}
        raise


_PROGRAMMED_EXPRS = frozenset({"numgen", "lookup", "immediate", "nat"})


def _programmed(family: int, netns: str | None, nflink) -> dict[tuple[str, str, int], frozenset[str]]:
    table = nflink._str(1, n.NFT_TABLE)
    size = 16 if family == 6 else 4

    unpack = struct.unpack_from
    af = socket.AF_INET6 if family == 6 else socket.AF_INET

    def ntop(raw: bytes) -> str:
        """ipaddress's text for the address (inet_ntop: a tenth of the time; 110,000 calls at scale)."""
        return str(ipaddress.ip_address(raw)) if af == socket.AF_INET6 else socket.inet_ntop(af, raw)

    def walk(buf: bytes):
        """(attribute type, payload) of one attribute level, without building dicts (hot: 10^6 attributes)."""
        pos, end = 0, len(buf)
        while pos + 4 <= end:
            length, kind = unpack("=HH", buf, pos)
            if length < 4:
                return
            yield kind & 0x3FFF, buf[pos + 4:pos + length]
            pos += (length + 3) & ~3

    def first(buf: bytes, want: int) -> bytes | None:
        for kind, payload in walk(buf):
            if kind == want:
                return payload
        return None

    def data(attr: bytes) -> bytes:
        return first(attr, 1) or b""                  # NFTA_DATA_VALUE

    def verdict_chain(attr: bytes) -> str | None:
        v = first(attr, 2)                            # NFTA_DATA_VERDICT
        chain = first(v, 2) if v is not None else None
        return chain.rstrip(b"\0").decode() if chain is not None else None

    def elements(set_name: str):
        """(key, data attribute or None, flags) of each element of a named set."""
        for msg in nflink.dump(nflink.GETSETELEM, family, table + nflink._str(2, set_name), netns=netns):
            for lst in msg.get(3, ()):
                # the attribute walk inlined, two levels (hot: 210,000 elements at 10,000 x 10)
                pos, end = 0, len(lst)
                while pos + 4 <= end:
                    length, kind = unpack("=HH", lst, pos)
                    if length < 4:
                        break
                    nxt = pos + ((length + 3) & ~3)
                    if kind & 0x3FFF == 1:
                        key = value = None
                        flags = 0
                        p2, e2 = pos + 4, pos + length
                        while p2 + 4 <= e2:
                            l2, k2 = unpack("=HH", lst, p2)
                            if l2 < 4:
                                break
                            k2 &= 0x3FFF
                            if k2 == 1:
                                key = data(lst[p2 + 4:p2 + l2])
                            elif k2 == 2:
                                value = lst[p2 + 4:p2 + l2]
                            elif k2 == 3:
                                flags = unpack(">I", lst, p2 + 4)[0]
                            p2 += (l2 + 3) & ~3
                        yield key, value, flags
                    pos = nxt

    # ClusterIP port -> the dispatch chain it goes to (externalIPs and LB IPs: external- chains)
    from .readback import service_ips
    ports = service_ips(family, netns)
    # every rule of the table: (map, offset) of each dnat, the endpoint chains of affinity dispatch
    dnat: dict[str, list[tuple[str, int]]] = {}
    targets: dict[str, list[str]] = {}
    direct: dict[str, str] = {}
    for msg in nflink.dump(nflink.GETRULE, family, table, netns=netns):
        chain = msg[2][0].rstrip(b"\0").decode()
        if not chain.startswith(("service-", "local-", "endpoint-")) or 4 not in msg:
            continue
        offset, lookup, ep_ip = 0, None, ""
        for kind, ex in walk(msg[4][0]):
            if kind != 1:
                continue
            name, body = "", {}
            for k2, payload in walk(ex):
                if k2 == 1:
                    name = payload.rstrip(b"\0").decode()
                    if name not in _PROGRAMMED_EXPRS:
                        break          # payload, cmp, meta...: their bodies say nothing here
                elif k2 == 2:
                    body = {k3: p3 for k3, p3 in walk(payload)}
            if name == "numgen":
                offset = int.from_bytes(body[4], "big") if 4 in body else 0
            elif name == "lookup" and 3 in body:
                lookup = body[1].rstrip(b"\0").decode()
            elif name == "immediate" and 2 in body:
                verdict = first(body[2], 2)
                if verdict is not None:        # a verdict: an affinity Service's endpoint chains
                    target = verdict_chain(body[2])
                    if target and target.startswith("endpoint-"):
                        targets.setdefault(chain, []).append(target)
                else:                          # the address, then the port, of `dnat to IP:port`
                    raw = data(body[2])
                    if len(raw) == size:
                        ep_ip = ntop(raw)
                    elif len(raw) == 2 and ep_ip:
                        direct[chain] = format_endpoint(ep_ip, int.from_bytes(raw, "big"))
            elif name == "nat" and lookup and lookup.startswith(ENDPOINTS_PREFIX):
                dnat.setdefault(chain, []).append((lookup, offset))
    slots_wanted: dict[str, list[int]] = {}
    for chains in dnat.values():
        for m, off in chains:
            slots_wanted.setdefault(m, []).append(off)
    in_slot: dict[tuple[str, int], set[str]] = {}
    for m, offsets in slots_wanted.items():
        wanted = set(offsets)
        for key, raw, flags in elements(m):
            if key is None or raw is None or flags & 1:
                continue   # interval ends
            start = int.from_bytes(key, "big")
            off = start - start % SLOT
            if off not in wanted:
                continue
            value = data(raw)
            ip = ntop(value[:size])
            port = int.from_bytes(value[size:size + 2], "big")
            in_slot.setdefault((m, off), set()).add(format_endpoint(ip, port))
    out: dict[tuple[str, str, int], frozenset[str]] = {}
    for key, chain in ports.items():
        base = chain.split("-", 1)[1]
        eps: set[str] = set()
        for c in ("service-" + base, "local-" + base):
            for m, off in dnat.get(c, ()):
                eps |= in_slot.get((m, off), set())
            for target in targets.get(c, ()):
                if direct.get(target):
                    eps.add(direct[target])
        out[key] = frozenset(eps)
    return out


def cleanup_text(family: int = 4) -> str:
    """An nft -f script removing clusterdns's table (and nothing else); safe when it is absent."""
    fam, _, _ = _fam(family)
    return f"add table {fam} {n.NFT_TABLE}\ndelete table {fam} {n.NFT_TABLE}\n"


__all__ = ["NftRuleSet", "NftState", "RenderCache", "build", "cleanup_text", "diff_ops", "full_ops",
           "programmed", "render", "resync_ops", "shares"]
