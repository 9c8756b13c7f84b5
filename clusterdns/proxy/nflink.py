"""Apply small nftables transactions over nfnetlink, without the nft binary.

nft 1.0.6 fetches the kernel's whole ruleset into its cache before every
`nft -f`; with ~100,000 chains that costs about a second even for a
five-line transaction. The kernel work of such a transaction is tiny, so the
proxier's incremental syncs encode their statements here and send them as one
nfnetlink batch (NFNL_MSG_BATCH_BEGIN ... END: atomic, as `nft -f`).

The input is the renderer's operations (`nftobj.Op`: typed chains, rules,
sets and elements), the same objects the `nft -f` text is encoded from;
nothing is parsed back from text. Only the forms `nftables.render` writes for
Services are known (chains, their rules, map/set elements, affinity sets,
endpoint maps); `supported(ops)` says whether every operation is one of them,
and callers fall back to `nft -f` otherwise. Expressions are encoded the way
nft 1.0.6 encodes the same text (checked with `nft --debug=netlink`), so
`nft list` shows the rules as if nft had added them.
"""
from __future__ import annotations

import ctypes
import ipaddress
import os
import socket
import struct
import threading
from array import array
from functools import lru_cache
from typing import Iterator

from .nftobj import (
    Addr,
    AddrIn,
    BaseChain,
    CtState,
    CtStatus,
    DnatMap,
    DnatTo,
    Dport,
    Element,
    Endpoint,
    FibLocal,
    L4proto,
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
    element_of,
)

NETLINK_NETFILTER = 12
NFNL_SUBSYS_NFTABLES = 10
NFNL_MSG_BATCH_BEGIN = 16
NFNL_MSG_BATCH_END = 17
NLMSG_ERROR = 2
NLMSG_DONE = 3

NLM_F_REQUEST = 0x1
NLM_F_CREATE = 0x400
NLM_F_APPEND = 0x800
NLA_F_NESTED = 0x8000

# nf_tables message types
NEWTABLE, DELTABLE = 0, 2
NEWCHAIN, DELCHAIN, NEWRULE, DELRULE = 3, 5, 6, 8
NEWSET, DELSET, NEWSETELEM, DELSETELEM, NEWGEN, GETGEN = 9, 11, 12, 14, 15, 16

NFPROTO_IPV4, NFPROTO_IPV6 = 2, 10
NFT_REG_VERDICT, NFT_REG_1, NFT_REG_2 = 0, 1, 2
NFT_JUMP, NFT_GOTO, NFT_RETURN = -3, -4, -5
NFT_CT_STATE, NFT_CT_STATUS = 0, 2
NFT_META_MARK = 3
NF_CT_STATE_NEW = 0x08
IPS_DST_NAT = 0x20
NF_NAT_RANGE_PROTO_RANDOM_FULLY = 0x10
NFT_REJECT_ICMP_UNREACH = 0
HOOKS = {"prerouting": 0, "input": 1, "forward": 2, "output": 3, "postrouting": 4}
# named set types: (type id, length)
TYPES = {"ipv4_addr": (7, 4), "ipv6_addr": (8, 16), "inet_proto": (12, 1), "inet_service": (13, 2)}
NF_DROP, NF_ACCEPT = 0, 1
NFT_PAYLOAD_NETWORK, NFT_PAYLOAD_TRANSPORT = 1, 2
NFT_CMP_EQ, NFT_CMP_NEQ = 0, 1
NFT_META_L4PROTO = 16
NFT_NAT_DNAT = 1
NF_NAT_RANGE_PROTO_SPECIFIED = 0x2
NFT_NG_RANDOM = 1
NFT_FIB_RESULT_ADDRTYPE = 3
NFTA_FIB_F_SADDR, NFTA_FIB_F_DADDR = 1, 2
RTN_LOCAL = 2
NFT_SET_ANONYMOUS, NFT_SET_CONSTANT, NFT_SET_MAP = 0x1, 0x2, 0x8
NFT_DATA_VERDICT = 0xFFFFFF00
NFT_TYPE_INTEGER = 4
NFT_TYPE_IPADDR, NFT_TYPE_IP6ADDR = 7, 8
NFT_TYPE_INET_SERVICE = 13
NFT_SET_TIMEOUT, NFT_SET_EVAL = 0x10, 0x20
NFT_DYNSET_OP_UPDATE = 1
# set userdata nft writes for an address-keyed named set: key in network byte order
_ADDR_SET_UDATA = bytes.fromhex("000402000000")
# the set userdata nft writes for `numgen ... vmap { }`: host byte order integer keys, verdict data
_NUMGEN_MAP_UDATA = bytes.fromhex("000401000000" "010400000000" "04080004010000000100" "060400000000")

# ... and for the anonymous interval set of `ip[6] saddr != { CIDR, ... }` (key typeof ip[6] saddr, auto-merge)
_ANON_SET_UDATA = {
    (4, "daddr"): bytes.fromhex("000402000000" "020401000000" "0314" "000407000000" "010c" "00040c000000"
                                "01040c000000"),
    (6, "daddr"): bytes.fromhex("000402000000" "020401000000" "0314" "000407000000" "010c" "00040d000000"
                                "010409000000"),
}
_SADDR_SET_UDATA = {
    4: bytes.fromhex("000402000000" "020401000000" "0314" "000407000000" "010c" "00040c000000" "01040b000000"),
    6: bytes.fromhex("000402000000" "020401000000" "0314" "000407000000" "010c" "00040d000000" "010408000000"),
}
NFT_SET_INTERVAL = 0x4
NFT_SET_ELEM_INTERVAL_END = 0x1
NFT_LOOKUP_F_INV = 0x1

CLONE_NEWNET = 0x40000000
TABLE = "kube-proxy"
PROTOS = {"tcp": 6, "udp": 17, "sctp": 132}

# named sets and maps of the layout: key fields and whether elements carry a verdict
SETS = {
    "service-ips": (("addr", "proto", "port"), True),
    "firewall-ips": (("addr", "proto", "port"), True),
    "service-nodeports": (("proto", "port"), True),
    "no-endpoint-reject": (("addr", "proto", "port"), False),
    "no-endpoint-drop": (("addr", "proto", "port"), False),
    "no-endpoint-nodeport-reject": (("proto", "port"), False),
    "no-endpoint-nodeport-drop": (("proto", "port"), False),
    "hairpin": (("addr", "addr"), False),
    "cluster-ips": (("addr",), False),
    "nodeport-ips": (("addr",), False),
}
ENDPOINTS_PREFIX = "endpoints-"
SLOT = 65536
NFT_BYTEORDER_HTON = 1
NFT_REG32_01 = 9
# the set userdata nft 1.0.6 writes for `typeof numgen random mod 65536 : ip[6] daddr . P dport`
_ENDPOINTS_UDATA_HEAD = {
    4: "000401000000010400000000031a0004170000000112000401000000010400000100020400000000043400040d000000012c00"
       "14000407000000010c00040c00000001040c0000000114000407000000010c",
    6: "000401000000010400000000031a0004170000000112000401000000010400000100020400000000043400040d000000012c00"
       "14000407000000010c00040d0000000104090000000114000407000000010c",
}
_PROTO_DESC = {"tcp": 0x08, "udp": 0x06, "sctp": 0x0a}   # nft's protocol description numbers


class _EndpointsName:
    """Endpoint map names: endpoints-<protocol>-<number>."""

    @staticmethod
    def match(name: str) -> "_NameMatch | None":
        parts = name.split("-")
        if len(parts) == 3 and parts[0] == "endpoints" and parts[1] in PROTOS and parts[2].isdigit():
            return _NameMatch(parts[1])
        return None


class _NameMatch:
    def __init__(self, proto: str) -> None:
        self.proto = proto

    def group(self, _: int) -> str:
        return self.proto


_ENDPOINTS_NAME = _EndpointsName()


def _endpoints_udata(family: int, proto: str) -> bytes:
    return bytes.fromhex(_ENDPOINTS_UDATA_HEAD[family] + f"0004{_PROTO_DESC[proto]:02x}000000" + "010402000000060400000000")


class NflinkError(Exception):
    """The kernel refused the batch (nothing was applied), or the socket failed."""

    def __init__(self, message: str, errno: int = 0, line: str = "",
                 failures: list[tuple[int, int]] | None = None) -> None:
        super().__init__(message)
        self.errno = errno
        self.line = line
        # every message the kernel refused: (its batch line, errno)
        self.failures = failures or []


class _TransportError(NflinkError):
    """The socket failed (the batch may not have reached the kernel)."""


class Unsupported(NflinkError, ValueError):
    """A statement form this module does not encode (nothing was sent)."""


# ---------------------------------------------------------------- attributes

def _attr(kind: int, payload: bytes, nested: bool = False) -> bytes:
    length = 4 + len(payload)
    return struct.pack("=HH", length, kind | (NLA_F_NESTED if nested else 0)) + payload + b"\0" * (-length % 4)


def _nest(kind: int, *attrs: bytes) -> bytes:
    return _attr(kind, b"".join(attrs), nested=True)


def _str(kind: int, text: str) -> bytes:
    return _attr(kind, text.encode() + b"\0")


def _u32(kind: int, value: int) -> bytes:
    return _attr(kind, struct.pack(">I", value & 0xFFFFFFFF))


def _value(kind: int, data: bytes) -> bytes:
    return _nest(kind, _attr(1, data))            # NFTA_DATA_VALUE


def _verdict(kind: int, code: int, chain: str | None) -> bytes:
    inner = [_attr(1, struct.pack(">i", code))]  # NFTA_VERDICT_CODE
    if chain is not None:
        inner.append(_str(2, chain))               # NFTA_VERDICT_CHAIN
    return _nest(kind, _nest(2, *inner))           # NFTA_DATA_VERDICT


def _udata_comment(text: str) -> bytes:
    raw = text.encode() + b"\0"
    if len(raw) > 255:
        raise Unsupported("comment longer than 254 bytes")
    return bytes((0, len(raw))) + raw


def _expr(name: str, *attrs: bytes) -> bytes:
    return _nest(1, _str(1, name), _nest(2, *attrs))  # NFTA_LIST_ELEM { NAME, DATA }


def _payload(base: int, offset: int, length: int) -> bytes:
    return _expr("payload", _u32(1, NFT_REG_1), _u32(2, base), _u32(3, offset), _u32(4, length))


def _cmp(op: int, data: bytes) -> bytes:
    return _expr("cmp", _u32(1, NFT_REG_1), _u32(2, op), _value(3, data))


def _l4proto(proto: int) -> bytes:
    return _expr("meta", _u32(2, NFT_META_L4PROTO), _u32(1, NFT_REG_1)) + _cmp(NFT_CMP_EQ, bytes((proto,)))


def _immediate_verdict(code: int, chain: str | None) -> bytes:
    return _expr("immediate", _u32(1, NFT_REG_VERDICT), _verdict(2, code, chain))


# ---------------------------------------------------------------- parsing

_PIECE = 1 << 20   # bytes per buffer piece of a batch (sent together: one sendmsg, one kernel batch)
_FIRST_PIECE = 1 << 14


class _Batch:
    """The messages of one transaction, encoded as they come into 1 MiB pieces: BATCH_BEGIN,
    the messages (sequence numbers set when sent), then BATCH_END once `close`d. A full load
    at 10,000 Services is ~13 MB of messages: kept once, not as message objects, their framed
    copies and the joined send buffer (three times over), and never regrown as a whole.
    `lines` keeps each message's operation index for error reports."""

    def __init__(self) -> None:
        self.pieces = [bytearray(_FIRST_PIECE)]    # most batches are a few messages
        self.fills = [0]
        self.offsets = array("Q")     # piece << 32 | offset of each message
        self.lines = array("L")
        self._put(_header(16 + 4, NFNL_MSG_BATCH_BEGIN, NLM_F_REQUEST, 0), _BATCH_GEN)
        self.next_set_id = 1
        self.set_ids: dict[str, int] = {}    # named sets created in this batch: rules refer to them by id too
        self.current_line = 0
        self.full = False     # the base layout's forms are allowed (a full transaction)

    def new_set_id(self, name: str | None = None) -> int:
        """The batch-local id of a set made in this batch; a named one is remembered for its rules."""
        set_id = self.next_set_id
        self.next_set_id += 1
        if name is not None:
            self.set_ids[name] = set_id
        return set_id

    def _put(self, head: bytes, body: bytes) -> int:
        """Write one message; its place (piece << 32 | offset)."""
        size = len(head) + len(body)
        if self.fills[-1] + size > len(self.pieces[-1]):
            self.pieces.append(bytearray(max(_PIECE, size)))
            self.fills.append(0)
        piece, at = self.pieces[-1], self.fills[-1]
        piece[at:at + len(head)] = head
        piece[at + len(head):at + size] = body
        self.fills[-1] = at + size
        return (len(self.pieces) - 1) << 32 | at

    def add(self, kind: int, flags: int, body: bytes, line: int) -> None:
        head = _header(16 + len(body), (NFNL_SUBSYS_NFTABLES << 8) | kind, NLM_F_REQUEST | flags, 0)
        self.offsets.append(self._put(head, body))
        self.lines.append(line)

    def __len__(self) -> int:
        return len(self.offsets)

    def close(self, first: int) -> list[memoryview]:
        """The batch to send (buffers of one sendmsg), numbered from `first` (BATCH_BEGIN) to
        first + len + 1 (BATCH_END)."""
        pack = _SEQ.pack_into
        pieces = self.pieces
        pack(pieces[0], 8, first)
        for i, place in enumerate(self.offsets):
            pack(pieces[place >> 32], (place & 0xFFFFFFFF) + 8, first + 1 + i)
        end = _header(16 + 4, NFNL_MSG_BATCH_END, NLM_F_REQUEST, first + 1 + len(self.offsets)) + _BATCH_GEN
        return [memoryview(p)[:n] for p, n in zip(pieces, self.fills)] + [memoryview(end)]


AFFINITY_PREFIX = "affinity-"


def _addr(text: str, family: int) -> bytes:
    try:   # inet_pton: an address of the other family, or no address, is refused (a full load: 400,000 calls)
        return socket.inet_pton(socket.AF_INET6 if family == 6 else socket.AF_INET, text)
    except (OSError, TypeError):
        pass
    try:
        ipaddress.ip_address(text)
    except ValueError:
        raise Unsupported(f"not an address: {text}") from None
    raise Unsupported(f"address {text} is not IPv{family}")


def _proto(text: str) -> int:
    if text not in PROTOS:
        raise Unsupported(f"protocol {text}")
    return PROTOS[text]


def _port(value: str | int) -> int:
    port = value if isinstance(value, int) else int(value) if str(value).isdigit() else -1
    if not 0 < port < 65536:
        raise Unsupported(f"port {value}")
    return port


def _addr_match(field: str, neg: bool, text: str, family: int) -> bytes:
    """`ip saddr|daddr [!=] ADDR[/LEN]` as nft encodes it: a shorter load for byte-aligned prefixes."""
    size = 4 if family == 4 else 16
    offset = {("saddr", 4): 12, ("daddr", 4): 16, ("saddr", 6): 8, ("daddr", 6): 24}[(field, family)]
    try:
        net = ipaddress.ip_network(text, strict=True)
    except ValueError:
        raise Unsupported(f"not an address or network: {text}") from None
    if net.version != family or (net.prefixlen == 0):
        raise Unsupported(f"network {text}")
    op = NFT_CMP_NEQ if neg else NFT_CMP_EQ
    plen = net.prefixlen
    if plen == size * 8 or plen % 8 == 0:
        nbytes = plen // 8
        return _payload(NFT_PAYLOAD_NETWORK, offset, nbytes) + _cmp(op, net.network_address.packed[:nbytes])
    mask = net.netmask.packed
    bitwise = _expr("bitwise", _u32(1, NFT_REG_1), _u32(2, NFT_REG_1), _u32(3, size),
                    _value(4, mask), _value(5, b"\0" * size))
    return _payload(NFT_PAYLOAD_NETWORK, offset, size) + bitwise + _cmp(op, net.network_address.packed)


_VERDICTS = {"drop": NF_DROP, "accept": NF_ACCEPT, "jump": NFT_JUMP, "goto": NFT_GOTO}


def _verdict_code(v: Verdict) -> tuple[int, str | None]:
    if v.kind not in _VERDICTS or (v.kind in ("jump", "goto")) != bool(v.chain):
        raise Unsupported(f"verdict {v.text()!r}")
    return _VERDICTS[v.kind], (v.chain or None)


def _rule(batch: _Batch, family: int, chain: str, r: Rule, line: int) -> None:
    """One rule of a Service's chains, expression by expression as nft 1.0.6 encodes it."""
    exprs: list[bytes] = []
    ipword = "ip6" if family == 6 else "ip"
    saddr = (NFT_PAYLOAD_NETWORK, 12 if family == 4 else 8, 4 if family == 4 else 16)
    last_was_addr = False
    for st in r.stmts:
        kind = type(st)
        if kind is Addr:
            if st.ipx != ipword:
                raise Unsupported(f"match {st.text()} in an IPv{family} table")
            if last_was_addr:
                raise Unsupported("adjacent address matches (nft merges them)")
            exprs.append(_addr_match(st.field, st.neg, st.value, family))
            last_was_addr = True
            continue
        last_was_addr = False
        if kind is AddrIn and not (batch.full and st.field == "daddr"):
            # `ip saddr != { CIDR, ... }`: LoadBalancerSourceRanges
            if st.ipx != ipword or st.field != "saddr" or not st.neg:
                raise Unsupported(f"set match {st.text()}")
            exprs.append(_saddr_not_in(batch, family, st.items))
        elif kind is Dport:
            exprs.append(_l4proto(_proto(st.proto)))
            exprs.append(_payload(NFT_PAYLOAD_TRANSPORT, 2, 2) + _cmp(NFT_CMP_EQ, struct.pack(">H", _port(st.port))))
        elif kind is L4proto:
            exprs.append(_l4proto(_proto(st.proto)))
        elif kind is DnatTo:
            exprs.append(_l4proto(_proto(st.proto)))
            exprs.append(_expr("immediate", _u32(1, NFT_REG_1), _value(2, _addr(st.ip, family))))
            exprs.append(_expr("immediate", _u32(1, NFT_REG_2), _value(2, struct.pack(">H", _port(st.port)))))
            exprs.append(_expr("nat", _u32(1, NFT_NAT_DNAT), _u32(2, _nfproto(family)),
                               _u32(3, NFT_REG_1), _u32(5, NFT_REG_2), _u32(7, NF_NAT_RANGE_PROTO_SPECIFIED)))
        elif kind is DnatMap:
            # `dnat to numgen random mod 65536 [offset O] map @endpoints-P-N`
            em = _ENDPOINTS_NAME.match(st.map)
            if not em or st.modulus != SLOT or st.offset % SLOT or not 0 <= st.offset < 1 << 32 \
                    or em.group(1) != st.proto:
                raise Unsupported(f"dnat {st.text()}")
            exprs.append(_l4proto(_proto(st.proto)))
            exprs.append(_expr("numgen", _u32(1, NFT_REG_1), _u32(2, SLOT), _u32(3, NFT_NG_RANDOM),
                               _u32(4, st.offset)))
            exprs.append(_expr("byteorder", _u32(1, NFT_REG_1), _u32(2, NFT_REG_1), _u32(3, NFT_BYTEORDER_HTON),
                               _u32(4, 4), _u32(5, 4)))
            exprs.append(_expr("lookup", _u32(2, NFT_REG_1), _u32(3, NFT_REG_1), _str(1, st.map),
                               *_set_ref(batch, st.map, 4)))
            exprs.append(_expr("nat", _u32(1, NFT_NAT_DNAT), _u32(2, _nfproto(family)),
                               _u32(3, NFT_REG_1), _u32(5, NFT_REG_2 if family == 6 else NFT_REG32_01)))
        elif kind is FibLocal and st.field == "saddr":
            exprs.append(_expr("fib", _u32(1, NFT_REG_1), _u32(2, NFT_FIB_RESULT_ADDRTYPE), _u32(3, NFTA_FIB_F_SADDR)))
            exprs.append(_cmp(NFT_CMP_EQ, struct.pack("=I", RTN_LOCAL)))
        elif kind is Lookup and st.fields == (f"{ipword} saddr",) and st.set.startswith(AFFINITY_PREFIX):
            # `ip saddr @affinity-X`: a client already pinned to this endpoint
            exprs.append(_payload(*saddr))
            exprs.append(_expr("lookup", _u32(2, NFT_REG_1), _str(1, st.set), *_set_ref(batch, st.set, 4)))
        elif kind is Update and st.ipx == ipword and st.set.startswith(AFFINITY_PREFIX):
            # `update @affinity-X { ip saddr }`: pin the client (the set's own timeout applies)
            exprs.append(_payload(*saddr))
            exprs.append(_expr("dynset", _u32(3, NFT_DYNSET_OP_UPDATE), _u32(4, NFT_REG_1), _str(1, st.set),
                               *_set_ref(batch, st.set, 2)))
        elif kind is Verdict and st.kind in _VERDICTS:
            exprs.append(_immediate_verdict(*_verdict_code(st)))
        elif kind is NumgenVmap:
            if not st.targets:
                raise Unsupported("numgen map without entries")
            mod = len(st.targets)
            elems = [_nest(1, _value(1, struct.pack("=I", i)), _verdict(2, NFT_GOTO, target))
                     for i, target in enumerate(st.targets)]
            set_id = batch.new_set_id()
            fam = _nfproto(family)
            batch.add(NEWSET, NLM_F_CREATE, _fam_hdr(fam) + b"".join((
                _str(1, TABLE), _str(2, "__map%d"),
                _u32(3, NFT_SET_ANONYMOUS | NFT_SET_CONSTANT | NFT_SET_MAP),
                _u32(4, NFT_TYPE_INTEGER), _u32(5, 4), _u32(6, NFT_DATA_VERDICT), _u32(7, 0),
                _u32(10, set_id), _nest(9, _u32(1, mod)), _attr(13, _NUMGEN_MAP_UDATA))), line)
            batch.add(NEWSETELEM, NLM_F_CREATE, _fam_hdr(fam) + b"".join((
                _str(1, TABLE), _str(2, "__map%d"), _u32(4, set_id), _nest(3, *elems))), line)
            exprs.append(_expr("numgen", _u32(1, NFT_REG_1), _u32(2, mod), _u32(3, NFT_NG_RANDOM), _u32(4, 0)))
            exprs.append(_expr("lookup", _u32(2, NFT_REG_1), _u32(3, NFT_REG_VERDICT), _str(1, "__map%d"),
                               _u32(4, set_id)))
        else:
            base = _base_stmt(batch, st, family) if batch.full else None
            if base is None:
                raise Unsupported(f"statement {st.text()!r}")
            exprs += base
    if not exprs:
        raise Unsupported("empty rule")
    attrs = [_str(1, TABLE), _str(2, chain), _nest(4, *exprs)]
    if r.comment:
        attrs.append(_attr(7, _udata_comment(r.comment)))
    batch.add(NEWRULE, NLM_F_CREATE | NLM_F_APPEND, _fam_hdr(_nfproto(family)) + b"".join(attrs), line)


def _saddr_not_in(batch: _Batch, family: int, items: tuple[str, ...], field: str = "saddr",
                  neg: bool = True) -> bytes:
    """An anonymous constant interval set of networks, and the inverted lookup in it, as nft sends them.

    Only disjoint, non-adjacent ranges that neither start at the lowest address nor end
    at the highest: nft merges or encodes the others differently.
    """
    bits = 32 if family == 4 else 128
    if len(items) == 1:
        return _addr_match(field, neg, items[0].strip(), family)   # nft drops a one-element set
    ranges = []
    for item in items:
        try:
            net = ipaddress.ip_network(item.strip(), strict=True)
        except ValueError:
            raise Unsupported(f"not a network: {item.strip()}") from None
        if net.version != family:
            raise Unsupported(f"network {net} is not IPv{family}")
        start = int(net.network_address)
        ranges.append((start, start + net.num_addresses))
    ranges.sort()
    if not ranges or ranges[0][0] == 0 or ranges[-1][1] >= 1 << bits:
        raise Unsupported("range at the edge of the address space")
    if any(a[1] >= b[0] for a, b in zip(ranges, ranges[1:])):
        raise Unsupported("overlapping or adjacent ranges (nft merges them)")
    size = bits // 8

    def elem(value: int, end: bool) -> bytes:
        flags = [_u32(3, NFT_SET_ELEM_INTERVAL_END)] if end else []
        return _nest(1, *flags, _value(1, value.to_bytes(size, "big")))

    elems = [elem(0, True)]
    for start, end in ranges:
        elems += [elem(start, False), elem(end, True)]
    set_id = batch.new_set_id()
    hdr = _fam_hdr(_nfproto(family))
    batch.add(NEWSET, NLM_F_CREATE, hdr + b"".join((
        _str(1, TABLE), _str(2, "__set%d"), _u32(3, NFT_SET_ANONYMOUS | NFT_SET_CONSTANT | NFT_SET_INTERVAL),
        _u32(4, NFT_TYPE_IPADDR if family == 4 else NFT_TYPE_IP6ADDR), _u32(5, size), _u32(10, set_id),
        _nest(9, _u32(1, len(elems))), _attr(13, _ANON_SET_UDATA[(family, field)]))), batch.current_line)
    batch.add(NEWSETELEM, NLM_F_CREATE, hdr + b"".join((
        _str(1, TABLE), _str(2, "__set%d"), _u32(4, set_id), _nest(3, *elems))), batch.current_line)
    offset = {("saddr", 4): 12, ("daddr", 4): 16, ("saddr", 6): 8, ("daddr", 6): 24}[(field, family)]
    inv = [_u32(5, NFT_LOOKUP_F_INV)] if neg else []
    return (_payload(NFT_PAYLOAD_NETWORK, offset, size)
            + _expr("lookup", _u32(2, NFT_REG_1), _str(1, "__set%d"), _u32(4, set_id), *inv))


_ANON_SET_UDATA.update({(4, "saddr"): _SADDR_SET_UDATA[4], (6, "saddr"): _SADDR_SET_UDATA[6]})

# ---------------------------------------------------------------- the base layout (full transactions)


def _field_loads(fields: tuple[str, ...], family: int) -> list[bytes]:
    """Concatenated field loads into consecutive registers, as nft allocates them (reg 1, then 32-bit regs)."""
    out = []
    used = 0
    for f in fields:
        reg = NFT_REG_1 if used == 0 else 8 + used // 4
        if f in ("ip saddr", "ip daddr", "ip6 saddr", "ip6 daddr"):
            ipx, which = f.split()
            if (ipx == "ip6") != (family == 6):
                raise Unsupported(f"field {f} in an IPv{family} table")
            size = 16 if family == 6 else 4
            offset = {("saddr", 4): 12, ("daddr", 4): 16, ("saddr", 6): 8, ("daddr", 6): 24}[(which, family)]
            out.append(_expr("payload", _u32(1, reg), _u32(2, NFT_PAYLOAD_NETWORK), _u32(3, offset), _u32(4, size)))
        elif f == "meta l4proto":
            size = 1
            out.append(_expr("meta", _u32(2, NFT_META_L4PROTO), _u32(1, reg)))
        elif f == "th dport":
            size = 2
            out.append(_expr("payload", _u32(1, reg), _u32(2, NFT_PAYLOAD_TRANSPORT), _u32(3, 2), _u32(4, 2)))
        else:
            raise Unsupported(f"field {f}")
        used += (size + 3) & ~3
    return out


def _lookup(batch: _Batch, st, family: int, verdict: bool) -> list[bytes]:
    name = st.map if verdict else st.set
    dreg = [_u32(3, NFT_REG_VERDICT)] if verdict else []
    return _field_loads(st.fields, family) + [
        _expr("lookup", _u32(2, NFT_REG_1), *dreg, _str(1, name), *_set_ref(batch, name, 4))]


def _ct_bits(key: int, mask: int) -> list[bytes]:
    return [_expr("ct", _u32(1, NFT_REG_1), _u32(2, key)),
            _expr("bitwise", _u32(1, NFT_REG_1), _u32(2, NFT_REG_1), _u32(3, 4),
                  _value(4, struct.pack("=I", mask)), _value(5, b"\0\0\0\0")),
            _cmp(NFT_CMP_NEQ, b"\0\0\0\0")]


def _mark(mask: int, xor: int, then_set: bool) -> list[bytes]:
    out = [_expr("meta", _u32(2, NFT_META_MARK), _u32(1, NFT_REG_1)),
           _expr("bitwise", _u32(1, NFT_REG_1), _u32(2, NFT_REG_1), _u32(3, 4),
                 _value(4, struct.pack("=I", mask)), _value(5, struct.pack("=I", xor)))]
    if then_set:
        out.append(_expr("meta", _u32(2, NFT_META_MARK), _u32(3, NFT_REG_1)))
    return out


def _base_stmt(batch: _Batch, st, family: int) -> list[bytes] | None:
    """The statements only the base layout uses; None for the others."""
    kind = type(st)
    if kind is CtState and st.state == "new":
        return _ct_bits(NFT_CT_STATE, NF_CT_STATE_NEW)
    if kind is CtStatus and st.status == "dnat":
        return _ct_bits(NFT_CT_STATUS, IPS_DST_NAT)
    if kind is Lookup:
        return _lookup(batch, st, family, False)
    if kind is Vmap:
        return _lookup(batch, st, family, True)
    if kind is MarkIsZero:
        return _mark(int(st.mask, 0), 0, False) + [_cmp(NFT_CMP_EQ, b"\0\0\0\0")]
    if kind is MarkSet and st.op == "xor":
        return _mark(0xFFFFFFFF, int(st.mask, 0), True)
    if kind is MarkSet and st.op == "or":
        m = int(st.mask, 0)
        return _mark(~m & 0xFFFFFFFF, m, True)
    if kind is Masquerade:
        return [_expr("masq", _u32(1, NF_NAT_RANGE_PROTO_RANDOM_FULLY))]
    if kind is FibLocal and st.field == "daddr":
        return [_expr("fib", _u32(1, NFT_REG_1), _u32(2, NFT_FIB_RESULT_ADDRTYPE), _u32(3, NFTA_FIB_F_DADDR)),
                _cmp(NFT_CMP_EQ, struct.pack("=I", RTN_LOCAL))]
    if kind is AddrIn and st.field == "daddr":
        return [_saddr_not_in(batch, family, st.items, "daddr", st.neg)]
    if kind is Verdict and st.kind == "return":
        return [_immediate_verdict(NFT_RETURN, None)]
    if kind is Verdict and st.kind == "reject":
        return [_expr("reject", _u32(1, NFT_REJECT_ICMP_UNREACH), _attr(2, bytes((4 if family == 6 else 3,))))]
    return None


def _set_type(spec: str) -> tuple[int, int]:
    """(type id, length) of `a . b . c` as the kernel stores concatenations (6 bits per type, 4-byte fields)."""
    ident, length = 0, 0
    for part in spec.split(" . "):
        if part not in TYPES:
            raise Unsupported(f"set type {part}")
        t, size = TYPES[part]
        ident = ident << 6 | t
        length += (size + 3) & ~3
    return ident, (length if " . " in spec else TYPES[spec][1])


def _udata_tlv(kind: int, payload: bytes) -> bytes:
    return bytes((kind, len(payload))) + payload


def _named_set(batch: _Batch, family: int, kind: str, name: str, decl: SetDecl, index: int) -> None:
    """A named set or map of the base layout (`type ... [: verdict] ; comment "..."`)."""
    if not decl.type or decl.flags or decl.timeout:
        raise Unsupported(f"add {kind} {name} {decl.text()}")
    key, _, data = decl.type.partition(" : ")
    is_map = kind == "map"
    if is_map != (data == "verdict"):
        raise Unsupported(f"{kind} {name} of {decl.type}")
    key_type, key_len = _set_type(key)
    concat = " . " in key
    udata = _udata_tlv(0, struct.pack("=I", 0 if concat else 2))       # key byte order
    if is_map:
        udata += _udata_tlv(1, struct.pack("=I", 0))                    # data byte order
    if concat:
        udata += bytes.fromhex("0308" "00040d000000" "0100")
    if is_map:
        udata += _udata_tlv(6, struct.pack("=I", 0))
    if decl.comment:
        udata += _udata_tlv(7, decl.comment.encode() + b"\0")
    attrs = [_str(1, TABLE), _str(2, name)]
    if is_map:
        attrs.append(_u32(3, NFT_SET_MAP))
    attrs += [_u32(4, key_type), _u32(5, key_len)]
    if is_map:
        attrs += [_u32(6, NFT_DATA_VERDICT), _u32(7, 0)]
    set_id = batch.new_set_id(name)
    attrs += [_u32(10, set_id), _attr(13, udata)]
    batch.add(NEWSET, NLM_F_CREATE, _fam_hdr(_nfproto(family)) + b"".join(attrs), index)


def _set_ref(batch: _Batch, name: str, id_attr: int) -> list[bytes]:
    """The set id attribute when the set is created in this batch (the kernel finds it by name otherwise)."""
    set_id = batch.set_ids.get(name)
    return [] if set_id is None else [_u32(id_attr, set_id)]


def _nfproto(family: int) -> int:
    return NFPROTO_IPV6 if family == 6 else NFPROTO_IPV4


def _fam_hdr(nfproto: int, res_id: int = 0) -> bytes:
    return struct.pack("=BBH", nfproto, 0, socket.htons(res_id))


def _element_key(set_name: str, key: tuple, family: int) -> bytes:
    fields, _ = SETS[set_name]
    if len(key) != len(fields):
        raise Unsupported(f"key {key!r} does not fit {set_name}")
    out = b""
    for kind, value in zip(fields, key):
        if kind == "addr":
            out += _addr(value, family)
        elif kind == "proto":
            out += struct.pack("=I", _proto(value))[:1] + b"\0\0\0"
        else:
            out += struct.pack(">H", _port(value)) + b"\0\0"
    return out


# the bulk elements of a full load, written from their flat tuples (nftobj.stored) in one piece:
# an endpoint-map range (start element with `address . port` data, then its interval end) and
# a hairpin pair; 280,000 of them at 10,000 Services x 15 endpoints, as _element would encode them
_INTERVAL_END = _u32(3, NFT_SET_ELEM_INTERVAL_END)


def _hdr(length: int, kind: int, nested: bool = False) -> bytes:
    return struct.pack("=HH", length, kind | (NLA_F_NESTED if nested else 0))


@lru_cache(maxsize=None)
def _frames(family: int, verb: str) -> tuple[bytes, bytes, bytes, bytes]:
    """The fixed attribute headers around a range element's start key, its data, its end key,
    and before a hairpin pair's key (all lengths multiples of 4: no padding)."""
    alen = 16 if family == 6 else 4
    key = _hdr(12, 1, True) + _hdr(8, 1)                    # NFTA_SET_ELEM_KEY { NFTA_DATA_VALUE u32 }
    if verb == "add":
        dlen = alen + 4                                    # address . port (2 bytes, padded to 4)
        start = _hdr(4 + 12 + 8 + dlen, 1, True) + key
        data = _hdr(8 + dlen, 2, True) + _hdr(4 + dlen, 1)  # NFTA_SET_ELEM_DATA { NFTA_DATA_VALUE }
    else:
        start, data = _hdr(16, 1, True) + key, b""
    end = _hdr(24, 1, True) + _INTERVAL_END + key
    pair = _hdr(12 + 2 * alen, 1, True) + _hdr(8 + 2 * alen, 1, True) + _hdr(4 + 2 * alen, 1)
    return start, data, end, pair


def _bulk_element(name: str, t: tuple, verb: str, family: int) -> bytes | None:
    """_element() of a flat endpoint-map or hairpin element, or None for any other."""
    if type(t) is not tuple or t[1]:
        return None
    if t[3] == 2 and t[0] and _ENDPOINTS_NAME.match(name):     # (interval, "", text, endpoint, ip, port, lo, hi)
        lo, hi, port = t[6], t[7], t[5]
        if type(lo) is not int or type(hi) is not int or not 0 <= lo <= hi < 0xFFFFFFFF:
            return None
        start, data, end, _ = _frames(family, verb)
        if verb == "add":
            if type(port) is not int or not 0 < port < 65536:
                return None
            return b"".join((start, struct.pack(">I", lo), data, _addr(t[4], family), struct.pack(">Hxx", port),
                             end, struct.pack(">I", hi + 1)))
        return b"".join((start, struct.pack(">I", lo), end, struct.pack(">I", hi + 1)))
    if t[3] == 0 and not t[0] and name == "hairpin" and len(t) == 8 and t[6] == t[7]:   # an `a . a` pair
        a = _addr(t[6], family)
        return b"".join((_frames(family, verb)[3], a, a))
    return None


def _element(name: str, elem: Element, verb: str, family: int) -> bytes:
    fast = _bulk_element(name, elem, verb, family)      # type: ignore[arg-type]
    if fast is not None:
        return fast
    elem = element_of(elem)           # an Element, or the flat tuple the table state keeps
    if _ENDPOINTS_NAME.match(name):
        # `lo-hi : address . port`: a start element and an interval-end element
        if not elem.interval or elem.comment:
            raise Unsupported(f"element {elem.text()!r} of {name}")
        lo, hi = elem.key
        if not 0 <= lo <= hi < 0xFFFFFFFF:
            raise Unsupported(f"range {lo}-{hi}")
        start = [_value(1, struct.pack(">I", lo))]
        if verb == "add":
            if not isinstance(elem.value, Endpoint):
                raise Unsupported(f"endpoint {elem.value!r}")
            start.append(_value(2, _addr(elem.value.ip, family) + struct.pack(">H", _port(elem.value.port))
                                + b"\0\0"))
        end = [_u32(3, NFT_SET_ELEM_INTERVAL_END), _value(1, struct.pack(">I", hi + 1))]
        return _nest(1, *start) + _nest(1, *end)
    if name not in SETS or elem.interval:
        raise Unsupported(f"element of {name}")
    out = [_value(1, _element_key(name, elem.key, family))]      # NFTA_SET_ELEM_KEY
    if verb == "add":
        _, is_map = SETS[name]
        if is_map != isinstance(elem.value, Verdict) or (elem.value is not None and not is_map):
            raise Unsupported(f"element data does not fit {name}")
        if isinstance(elem.value, Verdict):
            out.append(_verdict(2, *_verdict_code(elem.value)))  # NFTA_SET_ELEM_DATA
        if elem.comment:
            out.append(_attr(6, _udata_comment(elem.comment)))
    return _nest(1, *out)


def _op(batch: _Batch, family: int, op: Op, index: int) -> None:
    batch.current_line = index
    hdr = _fam_hdr(_nfproto(family))
    table = _str(1, TABLE)
    verb, kind, name, body = op
    if kind == "table" and batch.full and name == TABLE:
        if verb == "add":
            udata = [_attr(6, _udata_tlv(0, str(body).encode() + b"\0"))] if body else []
            batch.add(NEWTABLE, NLM_F_CREATE, hdr + _str(1, TABLE) + b"".join(udata), index)
        elif verb == "delete" and body is None:
            batch.add(DELTABLE, 0, hdr + _str(1, TABLE), index)
        else:
            raise Unsupported(f"{verb} table")
        return
    if kind == "chain" and body is not None:
        if not batch.full or verb != "add" or not isinstance(body, BaseChain) or body.hook not in HOOKS \
                or body.type not in ("filter", "nat"):
            raise Unsupported("chain declarations (base chains)")
        hook = _nest(4, _u32(1, HOOKS[body.hook]), _u32(2, body.priority))
        batch.add(NEWCHAIN, NLM_F_CREATE, hdr + table + _str(3, name) + hook + _str(7, body.type), index)
        return
    if kind in ("set", "map") and verb == "add" and batch.full and isinstance(body, SetDecl) and body.type \
            and not name.startswith(AFFINITY_PREFIX):
        _named_set(batch, family, kind, name, body, index)
        return
    if kind in ("set", "map") and verb == "flush" and batch.full and body is None:
        batch.add(DELSETELEM, 0, hdr + table + _str(2, name), index)      # no element list: every element
        return
    if kind == "chain":
        if verb == "add":
            batch.add(NEWCHAIN, NLM_F_CREATE, hdr + table + _str(3, name), index)
        elif verb == "flush":
            batch.add(DELRULE, 0, hdr + table + _str(2, name), index)
        else:
            batch.add(DELCHAIN, 0, hdr + table + _str(3, name), index)
    elif kind in ("set", "map") and verb == "delete" and body is None \
            and (name.startswith(AFFINITY_PREFIX) if kind == "set" else _ENDPOINTS_NAME.match(name)):
        batch.add(DELSET, 0, hdr + table + _str(2, name), index)
    elif kind == "set" and verb == "add" and name.startswith(AFFINITY_PREFIX) and isinstance(body, SetDecl) \
            and body.flags == "dynamic,timeout" and body.timeout and not body.comment \
            and body.type == ("ipv6_addr" if family == 6 else "ipv4_addr"):
        set_id = batch.new_set_id(name)
        v6 = family == 6
        batch.add(NEWSET, NLM_F_CREATE, hdr + b"".join((
            table, _str(2, name), _u32(3, NFT_SET_TIMEOUT | NFT_SET_EVAL),
            _u32(4, NFT_TYPE_IP6ADDR if v6 else NFT_TYPE_IPADDR), _u32(5, 16 if v6 else 4),
            _u32(10, set_id), _attr(11, struct.pack(">Q", body.timeout * 1000)), _attr(13, _ADDR_SET_UDATA))), index)
    elif kind == "map" and verb == "add" and isinstance(body, SetDecl) and _ENDPOINTS_NAME.match(name):
        proto = name.split("-")[1]
        ipword = "ip6" if family == 6 else "ip"
        if body != SetDecl("map", typeof=f"numgen random mod {SLOT} : {ipword} daddr . {proto} dport",
                           flags="interval"):
            raise Unsupported(f"add map {name} {body.text()}")
        set_id = batch.new_set_id(name)
        v6 = family == 6
        batch.add(NEWSET, NLM_F_CREATE, hdr + b"".join((
            table, _str(2, name), _u32(3, NFT_SET_INTERVAL | NFT_SET_MAP), _u32(4, NFT_TYPE_INTEGER), _u32(5, 4),
            _u32(6, (NFT_TYPE_IP6ADDR if v6 else NFT_TYPE_IPADDR) << 6 | NFT_TYPE_INET_SERVICE),
            _u32(7, 20 if v6 else 8), _u32(10, set_id), _attr(13, _endpoints_udata(family, proto)))), index)
    elif kind == "rule" and verb == "add" and isinstance(body, Rule):
        _rule(batch, family, name, body, index)
    elif kind == "element" and verb in ("add", "delete") and body:
        head = hdr + table + _str(2, name)
        mtype, flags = (NEWSETELEM, NLM_F_CREATE) if verb == "add" else (DELSETELEM, 0)
        # an attribute's length is 16 bits: a long element list goes in several messages
        # (encoded as they come: a full load's body makes its elements as it is read)
        chunk: list[bytes] = []
        size = 0
        for e in body:                                            # type: ignore[attr-defined]
            item = _element(name, e, verb, family)
            if chunk and size + len(item) > 60000:
                batch.add(mtype, flags, head + _nest(3, *chunk), index)
                chunk, size = [], 0
            chunk.append(item)
            size += len(item)
        batch.add(mtype, flags, head + _nest(3, *chunk), index)
    else:
        raise Unsupported(f"{verb} {kind} {name}")


def _encode(ops, family: int, full: bool = False) -> _Batch:
    batch = _Batch()
    batch.full = full
    for index, op in enumerate(ops):
        _op(batch, family, op, index)
    return batch


def supported(ops, family: int = 4, full: bool = False) -> bool:
    """Whether every operation of this transaction is one `apply` encodes itself
    (full: also the table, base chains, named sets and base rules of a full transaction)."""
    try:
        _encode(ops, family, full)
    except Unsupported:
        return False
    return True


# ---------------------------------------------------------------- sockets

_libc = ctypes.CDLL(None, use_errno=True)
_sockets: dict[tuple[str | None, int], "_Link"] = {}
_sockets_lock = threading.Lock()


def _open_socket() -> socket.socket:
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    sock.bind((0, 0))
    return sock


def _socket_in(netns: str) -> socket.socket:
    """A netlink socket in /run/netns/NAME: opened by a helper thread that enters it (setns is per thread)."""
    result: list = []

    def enter() -> None:
        try:
            with open(f"/run/netns/{netns}", "rb") as f:
                if _libc.setns(f.fileno(), CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns {netns}: {os.strerror(err)}")
            result.append(_open_socket())
        except BaseException as exc:  # reported to the caller's thread
            result.append(exc)

    t = threading.Thread(target=enter, name=f"nflink-{netns}")
    t.start()
    t.join()
    if isinstance(result[0], BaseException):
        raise NflinkError(f"cannot open a netlink socket in netns {netns}: {result[0]}")
    return result[0]


class _Link:
    """One nfnetlink socket; sends serialized by a lock."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.lock = threading.Lock()
        self.seq = 1
        self.sndbuf = 0
        sock.settimeout(10.0)
        try:
            # room for the kernel's error replies to a large failing batch
            sock.setsockopt(socket.SOL_SOCKET, 33, 4 << 20)   # SO_RCVBUFFORCE (root)
        except OSError:
            pass

    def close(self) -> None:
        self.sock.close()


def _link(netns: str | None) -> _Link:
    try:
        ident = os.stat(f"/run/netns/{netns}").st_ino if netns else 0
    except OSError as exc:
        raise NflinkError(f"no network namespace {netns}: {exc.strerror}") from None
    key = (netns, ident)
    with _sockets_lock:
        link = _sockets.get(key)
        if link is None:
            # a recreated namespace of the same name gets a new inode: drop the stale socket
            for old in [k for k in _sockets if k[0] == netns]:
                _sockets.pop(old).close()
            try:
                link = _Link(_socket_in(netns) if netns else _open_socket())
            except OSError as exc:
                raise NflinkError(f"cannot open a netlink socket: {exc}") from None
            _sockets[key] = link
        return link


def close_all() -> None:
    """Close every cached socket (tests, shutdown)."""
    with _sockets_lock:
        for link in _sockets.values():
            link.close()
        _sockets.clear()


# ---------------------------------------------------------------- sending

def _header(length: int, kind: int, flags: int, seq: int) -> bytes:
    return struct.pack("=IHHII", length, kind, flags, seq, 0)


_SEQ = struct.Struct("=I")
_BATCH_GEN = _fam_hdr(0, NFNL_SUBSYS_NFTABLES)   # nfgenmsg, res_id: the subsystem


def _message(kind: int, flags: int, seq: int, body: bytes) -> bytes:
    return _header(16 + len(body), kind, flags, seq) + body


def apply(ops, family: int = 4, *, netns: str | None = None, full: bool = False) -> None:
    """Send the operations (nftobj.Op) as one nfnetlink batch; NflinkError (nothing applied) on failure.

    Raises Unsupported (an NflinkError; nothing sent) for an operation this module does not encode
    (check with `supported` first). `netns` names a namespace under /run/netns.
    """
    ops = list(ops)
    batch = _encode(ops, family, full)
    if not len(batch):
        return
    t = f"{'ip6' if family == 6 else 'ip'} {TABLE}"
    link = _link(netns)
    with link.lock:
        try:
            _send(link, batch, lambda i: ops[i].text(t))
        except _TransportError:
            _forget(netns, link)     # socket trouble, not a refusal: the next call opens a new one
            raise


def _forget(netns: str | None, link: _Link) -> None:
    with _sockets_lock:
        for key in [k for k, v in _sockets.items() if v is link]:
            del _sockets[key]
    link.close()


def _send(link: _Link, batch: _Batch, describe) -> int:
    """Send one batch and wait for the kernel's answer; the ruleset's generation after it."""
    first = link.seq
    buffers = batch.close(first)
    total = sum(len(b) for b in buffers)
    seq = first + 1 + len(batch)      # BATCH_END's
    # the kernel handles each send synchronously (and ignores anything after a batch in the same
    # send): a second request's reply marks the end of the batch's replies
    marker = seq + 1
    link.seq = marker + 1
    sock = link.sock
    if total + 4096 > link.sndbuf:
        size = max(total * 2, 1 << 20)
        try:
            sock.setsockopt(socket.SOL_SOCKET, 32, size)   # SO_SNDBUFFORCE (root)
        except OSError:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)
        link.sndbuf = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    try:
        sent = sock.sendmsg(buffers)    # one datagram: the kernel sees one batch
        if sent != total:
            raise OSError(0, f"netlink sent {sent} bytes of the batch")
        sock.send(_message((NFNL_SUBSYS_NFTABLES << 8) | GETGEN, NLM_F_REQUEST, marker, _fam_hdr(0)))
    except OSError as exc:
        raise _TransportError(f"netlink send failed: {exc.strerror or exc}", exc.errno or 0) from None
    errors: list[tuple[int, int]] = []
    genid = 0
    while True:
        try:
            reply = sock.recv(1 << 20)
        except socket.timeout:
            raise _TransportError("no reply from the kernel (netlink)") from None
        except OSError as exc:
            raise _TransportError(f"netlink receive failed: {exc.strerror or exc}", exc.errno or 0) from None
        done = False
        pos = 0
        while pos + 16 <= len(reply):
            length, kind, _flags, rseq, _pid = struct.unpack_from("=IHHII", reply, pos)
            if length < 16:
                break
            if first <= rseq <= marker:
                if kind == NLMSG_ERROR:
                    (err,) = struct.unpack_from("=i", reply, pos + 16)
                    if err:
                        if rseq == marker:
                            done = True
                        else:
                            errors.append((rseq, -err))
                elif rseq == marker:
                    done = True
                    if kind == (NFNL_SUBSYS_NFTABLES << 8) | NEWGEN:
                        gen = attrs(reply[pos + 20:pos + length]).get(1)   # NFTA_GEN_ID
                        genid = struct.unpack(">I", gen[0][:4])[0] if gen else 0
            pos += (length + 3) & ~3
        if done:
            break
    if errors:
        rseq, errno = errors[0]
        index = batch.lines[rseq - first - 1] if first < rseq < seq else None
        line = describe(index) if index is not None else ""
        where = f" at statement {index + 1}: {line}" if index is not None else " (batch)"
        failures = [(batch.lines[r - first - 1], e) for r, e in errors if first < r < seq]
        raise NflinkError(f"nftables: {os.strerror(errno)}{where}", errno, line, failures)
    return genid


__all__ = ["NflinkError", "Unsupported", "apply", "close_all", "supported"]


# ---------------------------------------------------------------- reading (dumps)

NLM_F_DUMP = 0x300
GETTABLE, GETRULE, GETSET, GETSETELEM = 1, 7, 10, 13


def table_names(family: int, *, netns: str | None = None) -> list[str]:
    """The nf_tables tables of a family: one dump of tables alone (`nft list tables` loads every
    rule first: over two minutes with iptables-nft's 320,000 rules at 10,000 Services)."""
    return [m[1][0].rstrip(b"\0").decode() for m in dump(GETTABLE, family, b"", netns=netns) if 1 in m]


def attrs(data: bytes) -> dict[int, list[bytes]]:
    """Netlink attributes of one level: type (nested flag cleared) -> payloads, in order."""
    out: dict[int, list[bytes]] = {}
    pos = 0
    while pos + 4 <= len(data):
        length, kind = struct.unpack_from("=HH", data, pos)
        if length < 4:
            break
        out.setdefault(kind & 0x3FFF, []).append(data[pos + 4:pos + length])
        pos += (length + 3) & ~3
    return out


def _dump_on(link: _Link, kind: int, family: int, body: bytes) -> Iterator[bytes]:
    """The dump's reply messages (after nlmsghdr and nfgenmsg), as each receive brings them."""
    seq = link.seq
    link.seq += 1
    msg = _message((NFNL_SUBSYS_NFTABLES << 8) | kind, NLM_F_REQUEST | NLM_F_DUMP, seq,
                   _fam_hdr(_nfproto(family)) + body)
    try:
        link.sock.send(msg)
    except OSError as exc:
        raise _TransportError(f"netlink send failed: {exc.strerror or exc}", exc.errno or 0) from None
    while True:
        try:
            reply = link.sock.recv(1 << 20)
        except socket.timeout:
            raise _TransportError("no reply from the kernel (netlink dump)") from None
        except OSError as exc:
            raise _TransportError(f"netlink receive failed: {exc.strerror or exc}", exc.errno or 0) from None
        pos = 0
        while pos + 16 <= len(reply):
            length, mtype, _flags, rseq, _pid = struct.unpack_from("=IHHII", reply, pos)
            if length < 16:
                break
            if rseq == seq:
                if mtype == NLMSG_DONE:
                    return
                if mtype == NLMSG_ERROR:
                    (err,) = struct.unpack_from("=i", reply, pos + 16)
                    if err:
                        raise NflinkError(f"nftables dump: {os.strerror(-err)}", -err)
                    return
                yield reply[pos + 20:pos + length]
            pos += (length + 3) & ~3


def dump(kind: int, family: int, body: bytes, *, netns: str | None = None) -> Iterator[dict[int, list[bytes]]]:
    """One nf_tables dump request (GETSET, GETSETELEM, ...): each reply message's attributes, as
    they arrive (a 10,000-Service table's rules are never all held at once). The socket is
    locked until the dump is read to its end; one not read to its end is closed."""
    link = _link(netns)
    done = False
    with link.lock:
        try:
            for msg in _dump_on(link, kind, family, body):
                yield attrs(msg)
            done = True
        except _TransportError:
            _forget(netns, link)
            raise
        except NflinkError:
            done = True     # the kernel's answer ends the dump
            raise
        finally:
            if not done:
                _forget(netns, link)   # replies left unread on the socket
