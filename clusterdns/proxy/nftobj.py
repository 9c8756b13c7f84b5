"""nftables objects: the typed rules, elements and operations the nftables renderer produces.

The `nft -f` text (`clusterdns rules`, the nft applier) and the netlink
messages (`nflink`) are both encoded from these objects; nothing parses rule
text back. Statements are small named tuples (a full render builds hundreds of
thousands of elements) whose `text()` is nft 1.0.6's input syntax.
"""
from __future__ import annotations

from typing import NamedTuple, Union

# ---------------------------------------------------------------- statements (in rule order)

class CtState(NamedTuple):
    state: str                                  # "new"

    def text(self) -> str:
        return f"ct state {self.state}"


class CtStatus(NamedTuple):
    status: str                                 # "dnat"

    def text(self) -> str:
        return f"ct status {self.status}"


class Addr(NamedTuple):
    """`ip saddr 10.0.0.1`, `ip6 daddr != fd00::/64`: one address or prefix."""
    ipx: str                                    # "ip" or "ip6"
    field: str                                  # "saddr" or "daddr"
    value: str
    neg: bool = False

    def text(self) -> str:
        return f"{self.ipx} {self.field} {'!= ' if self.neg else ''}{self.value}"


class AddrIn(NamedTuple):
    """`ip saddr != { 203.0.113.0/25, 1.2.3.4 }`: an anonymous set of addresses or prefixes."""
    ipx: str
    field: str
    items: tuple[str, ...]
    neg: bool = False

    def text(self) -> str:
        return f"{self.ipx} {self.field} {'!= ' if self.neg else ''}{{ {', '.join(self.items)} }}"


class Dport(NamedTuple):
    proto: str                                  # tcp, udp, sctp
    port: int

    def text(self) -> str:
        return f"{self.proto} dport {self.port}"


class L4proto(NamedTuple):
    proto: str

    def text(self) -> str:
        return f"meta l4proto {self.proto}"


class FibLocal(NamedTuple):
    field: str                                  # "saddr" or "daddr"

    def text(self) -> str:
        return f"fib {self.field} type local"


class Lookup(NamedTuple):
    """`ip daddr . meta l4proto . th dport @set`: a lookup of concatenated fields in a named set."""
    fields: tuple[str, ...]                     # "ip daddr", "meta l4proto", "th dport", "ip saddr", ...
    set: str

    def text(self) -> str:
        return f"{' . '.join(self.fields)} @{self.set}"


class Vmap(NamedTuple):
    """`... vmap @map`: the verdict is the named map's element."""
    fields: tuple[str, ...]
    map: str

    def text(self) -> str:
        return f"{' . '.join(self.fields)} vmap @{self.map}"


class MarkIsZero(NamedTuple):
    mask: str                                   # "0x4000"

    def text(self) -> str:
        return f"mark and {self.mask} == 0"


class MarkSet(NamedTuple):
    op: str                                     # "or" or "xor"
    mask: str

    def text(self) -> str:
        return f"mark set mark {self.op} {self.mask}"


class Masquerade(NamedTuple):
    def text(self) -> str:
        return "masquerade fully-random"


class DnatTo(NamedTuple):
    """`meta l4proto tcp dnat to 10.0.0.1:80` (IPv6: `[fd00::1]:80`)."""
    proto: str
    ip: str
    port: int

    def text(self) -> str:
        target = f"[{self.ip}]" if ":" in self.ip else self.ip
        return f"meta l4proto {self.proto} dnat to {target}:{self.port}"


class DnatMap(NamedTuple):
    """`meta l4proto tcp dnat to numgen random mod 65536 offset O map @endpoints-...`."""
    proto: str
    modulus: int
    offset: int
    map: str

    def text(self) -> str:
        offset = f" offset {self.offset}" if self.offset else ""
        return f"meta l4proto {self.proto} dnat to numgen random mod {self.modulus}{offset} map @{self.map}"


class NumgenVmap(NamedTuple):
    """`numgen random mod N vmap { 0 : goto a , 1 : goto b }` (affinity Services' dispatch)."""
    targets: tuple[str, ...]                    # chains, by number

    def text(self) -> str:
        body = " , ".join(f"{i} : goto {t}" for i, t in enumerate(self.targets))
        return f"numgen random mod {len(self.targets)} vmap {{ {body} }}"


class Update(NamedTuple):
    """`update @affinity-... { ip saddr }`: remember the client (the set's timeout applies)."""
    set: str
    ipx: str

    def text(self) -> str:
        return f"update @{self.set} {{ {self.ipx} saddr }}"


class Verdict(NamedTuple):
    kind: str                                   # jump, goto, drop, accept, return, reject
    chain: str = ""

    def text(self) -> str:
        return f"{self.kind} {self.chain}" if self.chain else self.kind


Stmt = Union[CtState, CtStatus, Addr, AddrIn, Dport, L4proto, FibLocal, Lookup, Vmap, MarkIsZero, MarkSet,
             Masquerade, DnatTo, DnatMap, NumgenVmap, Update, Verdict]


class Rule(NamedTuple):
    stmts: tuple
    comment: str = ""

    def text(self) -> str:
        body = " ".join([s.text() for s in self.stmts])
        return f'{body} comment "{self.comment}"' if self.comment else body

    def targets(self) -> list[str]:
        """Chains this rule jumps or goes to."""
        out = [s.chain for s in self.stmts if isinstance(s, Verdict) and s.chain]
        for s in self.stmts:
            if isinstance(s, NumgenVmap):
                out += list(s.targets)
        return out

    def sets(self) -> list[str]:
        """Named sets and maps this rule refers to."""
        out = []
        for s in self.stmts:
            if isinstance(s, (Lookup, Update)):
                out.append(s.set)
            elif isinstance(s, (Vmap, DnatMap)):
                out.append(s.map)
        return out


def rule(*stmts, comment: str = "") -> Rule:
    # stmts is a tuple already; tuple.__new__ skips the named tuple's keyword-handling __new__ (hot in renders)
    return tuple.__new__(Rule, (stmts, comment))


# ---------------------------------------------------------------- elements

class Endpoint(NamedTuple):
    """The data of an endpoint-map element: `address . port`."""
    ip: str
    port: int

    def text(self) -> str:
        return f"{self.ip} . {self.port}"


class Element(NamedTuple):
    """One element: `key [comment "c"] [: value]`.

    key: the fields (addresses, protocol names, ports: all text) of a
    concatenated key, or (lo, hi) integers of an interval. value: None (a
    set), a Verdict (a verdict map) or an Endpoint (an endpoint map).
    """
    key: tuple
    value: Verdict | Endpoint | None = None
    comment: str = ""
    interval: bool = False
    spelled: str = ""       # text() precomputed by the hot paths that build many elements (equal to it)

    def key_text(self) -> str:
        if self.interval:
            return f"{self.key[0]}-{self.key[1]}"
        return " . ".join(self.key)          # the fields are text

    def text(self) -> str:
        if self.spelled:
            return self.spelled
        out = self.key_text()
        if self.comment:
            out += f' comment "{self.comment}"'
        if self.value is not None:
            out += f" : {self.value.text()}"
        return out


# ---------------------------------------------------------------- declarations and operations

class BaseChain(NamedTuple):
    type: str
    hook: str
    priority: int

    def text(self) -> str:
        return f"{{ type {self.type} hook {self.hook} priority {self.priority} ; }}"


class SetDecl(NamedTuple):
    """A named set or map: `{ type|typeof ... ; flags ... ; timeout Ns ; comment "..." ; }`."""
    kind: str                                   # "set" or "map"
    type: str = ""                              # `type` spelling, e.g. "ipv4_addr . inet_proto . inet_service"
    typeof: str = ""                            # `typeof` spelling, e.g. "numgen random mod 65536 : ip daddr . tcp dport"
    flags: str = ""                             # "interval", "dynamic,timeout"
    timeout: int = 0
    comment: str = ""

    def text(self) -> str:
        parts = [f"type {self.type}" if self.type else f"typeof {self.typeof}"]
        if self.flags:
            parts.append(f"flags {self.flags}")
        if self.timeout:
            parts.append(f"timeout {self.timeout}s")
        if self.comment:
            parts.append(f'comment "{self.comment}"')
        return "{ " + " ; ".join(parts) + " ; }"


class Op(NamedTuple):
    """One statement of a transaction.

    verb: add, delete, flush. kind: table, chain, rule, set, map, element.
    name: the chain or set (the table's own name for kind "table"). body: a
    BaseChain (or None) for add chain, a SetDecl for add set/map, a Rule for
    add rule, a tuple of Elements (or the flat tuples the table state keeps,
    see `stored`) for add/delete element, a table comment.
    """
    verb: str
    kind: str
    name: str
    body: object = None

    def text(self, table: str) -> str:
        """The nft -f line; table is "ip kube-proxy" or "ip6 kube-proxy"."""
        verb, kind = self.verb, self.kind
        if kind == "table":
            return f'{verb} table {table} {{ comment "{self.body}" ; }}' if self.body else f"{verb} table {table}"
        head = f"{verb} {kind} {table} {self.name}"
        body = self.body
        if body is None:
            return head
        if kind == "element":
            if verb == "delete":
                return head + " { " + ", ".join([element_key_text(e) for e in body]) + " }"  # type: ignore[attr-defined]
            texts = None if type(body) is tuple else getattr(body, "texts", None)
            if texts is not None:   # a bulk set's view spells its elements without making them
                return head + " { " + ", ".join(texts()) + " }"
            return head + " { " + ", ".join([element_text(e) for e in body]) + " }"          # type: ignore[attr-defined]
        return f"{head} {body.text()}"                                                 # type: ignore[attr-defined]


# The table state keeps each element as one flat tuple of plain values, (interval,
# comment, text, value kind, value a, value b, key fields...): the collector untracks
# plain tuples of plain values (not named tuples, and nested tuples cost a pass each),
# and a full collection over 220,000 tracked elements took ~0.6 s.
_NO_VALUE, _VERDICT, _ENDPOINT = 0, 1, 2


def stored(key: tuple, value: tuple | None = None, comment: str = "", interval: bool = False,
           spelled: str = "", endpoint: bool = False) -> tuple:
    """The flat tuple of an element (value: a verdict's (kind, chain) or an endpoint's (ip, port))."""
    if value is None:
        return (interval, comment, spelled, _NO_VALUE, "", "") + tuple(key)
    return (interval, comment, spelled, _ENDPOINT if endpoint else _VERDICT, value[0], value[1]) + tuple(key)


def element_of(t) -> Element:
    """The Element of a stored (flat) element; an Element as it is."""
    if type(t) is Element:
        return t
    interval, comment, spelled, vkind, va, vb = t[:6]
    value = None if vkind == _NO_VALUE else (Endpoint(va, vb) if vkind == _ENDPOINT else Verdict(va, vb))
    return tuple.__new__(Element, (t[6:], value, comment, interval, spelled))


def element_text(e) -> str:
    """The text of an Element or of a stored element."""
    if type(e) is not Element:
        if e[2]:
            return e[2]
        # Element.text spelled from the flat tuple: no Element and value objects made for it
        out = f"{e[6]}-{e[7]}" if e[0] else " . ".join(e[6:])
        if e[1]:
            out += f' comment "{e[1]}"'
        if e[3] == _VERDICT:
            out += f" : {e[4]} {e[5]}" if e[5] else f" : {e[4]}"
        elif e[3] == _ENDPOINT:
            out += f" : {e[4]} . {e[5]}"
        return out
    return e.text()


def element_key_text(e) -> str:
    if type(e) is not Element:
        e = element_of(e)
    return e.key_text()


def text(ops, family: int, table: str = "kube-proxy") -> str:
    """The nft -f script of a list of operations."""
    t = f"{'ip6' if family == 6 else 'ip'} {table}"
    return "".join([op.text(t) + "\n" for op in ops])


__all__ = ["element_key_text", "element_of", "element_text", "stored", "Addr", "AddrIn", "BaseChain", "CtState", "CtStatus", "DnatMap", "DnatTo", "Dport", "Element",
           "Endpoint", "FibLocal", "L4proto", "Lookup", "MarkIsZero", "MarkSet", "Masquerade", "NumgenVmap",
           "Op", "Rule", "SetDecl", "Update", "Verdict", "Vmap", "rule", "text"]
