"""Which ClusterIP ports a previous process left in the kernel, read cheaply at start.

A restarted agent may answer DNS for a Service before its own first sync only
when the Service's rules are still in the kernel (restart adoption,
clusterdns/dnsview.py). The full read-back (`Proxier.programmed()`: every
port's endpoints) walks the whole table: seconds at 10,000 Services, and in
iptables mode on the nf_tables backend `iptables-nft-save` of ~330,000 rules.
The readers here take only the per-port entry points, over netlink, in tens
of milliseconds (in the namespace a runner prefixed `ip netns exec NAME` names:
`apply.netlink_netns`):

- nftables: the elements of the `service-ips` verdict map (ClusterIP . protocol
  . port -> goto service-/local- chain), as `nftables.programmed()` reads them;
- iptables on the nf_tables backend: the rules of KUBE-SERVICES in the nat
  table (`-d IP/32 -p PROTO --dport PORT -j KUBE-SVC-/KUBE-SVL-...`) and of
  KUBE-SERVICES in the filter table (REJECT or DROP: a port without endpoints),
  decoded from the expressions iptables-nft writes for them (1.8: `meta l4proto`
  or the IPv4 protocol field, the address as a payload compare without a mask,
  the port as a payload compare or an xt `tcp`/`udp` match), as
  `iptsave.programmed()` reads the same rules from `iptables-save`.

A rule whose expressions are not all understood is left out: the Service then
waits for the first sync (shown less, never more).
"""
from __future__ import annotations

import ipaddress
import socket
import struct

from . import nflink
from .names import KUBE_SERVICES, NFT_TABLE

ServiceKey = tuple[str, str, int]     # (ClusterIP, protocol upper case, port)

_unpack = struct.unpack_from
_PROTOS = {6: "TCP", 17: "UDP", 132: "SCTP"}

# nf_tables attribute and value numbers (linux/netfilter/nf_tables.h)
_ELEM, _ELEM_KEY, _ELEM_DATA = 1, 1, 2          # NFTA_LIST_ELEM; NFTA_SET_ELEM_KEY, _DATA
_DATA_VALUE, _DATA_VERDICT = 1, 2               # NFTA_DATA_*
_VERDICT_CODE, _VERDICT_CHAIN = 1, 2            # NFTA_VERDICT_*
_RULE_CHAIN, _RULE_EXPRESSIONS = 2, 4           # NFTA_RULE_*
_EXPR_NAME, _EXPR_DATA = 1, 2                   # NFTA_EXPR_*
_JUMP, _GOTO, _DROP = -3, -4, 0                 # verdict codes
_META_L4PROTO = 16
_CMP_EQ = 0
_BASE_NETWORK, _BASE_TRANSPORT = 1, 2


def _walk(buf: bytes):
    """(type without the nested flag, payload) of each attribute of one level."""
    pos, end = 0, len(buf)
    while pos + 4 <= end:
        length, kind = _unpack("=HH", buf, pos)
        if length < 4:
            return
        yield kind & 0x3FFF, buf[pos + 4:pos + length]
        pos += (length + 3) & ~3


def _first(buf: bytes, want: int) -> bytes | None:
    for kind, payload in _walk(buf):
        if kind == want:
            return payload
    return None


def _verdict(attr: bytes) -> tuple[int, str] | None:
    """(code, chain or "") of an NFTA_DATA_VERDICT-holding attribute."""
    v = _first(attr, _DATA_VERDICT)
    if v is None:
        return None
    code = chain = None
    for kind, payload in _walk(v):
        if kind == _VERDICT_CODE and len(payload) == 4:
            code = _unpack(">i", payload)[0]
        elif kind == _VERDICT_CHAIN:
            chain = payload.rstrip(b"\0").decode(errors="replace")
    return None if code is None else (code, chain or "")


def _ntop(family: int, raw: bytes) -> str:
    return socket.inet_ntop(socket.AF_INET, raw) if family == 4 else str(ipaddress.IPv6Address(raw))


# ------------------------------------------------------------------ nftables

def service_ips(family: int = 4, netns: str | None = None) -> dict[ServiceKey, str]:
    """(ClusterIP, protocol, port) -> the service-/local- chain its `service-ips` element goes
    to. ExternalIPs and load-balancer IPs (external- chains) are left out. Raises
    nflink.NflinkError (errno 2, ENOENT: no table or no map)."""
    size = 16 if family == 6 else 4
    body = nflink._str(1, NFT_TABLE) + nflink._str(2, "service-ips")
    out: dict[ServiceKey, str] = {}
    for msg in nflink.dump(nflink.GETSETELEM, family, body, netns=netns):
        for lst in msg.get(3, ()):                       # NFTA_SET_ELEM_LIST_ELEMENTS
            for kind, elem in _walk(lst):
                if kind != _ELEM:
                    continue
                key = data = None
                for k2, payload in _walk(elem):
                    if k2 == _ELEM_KEY:
                        key = _first(payload, _DATA_VALUE)
                    elif k2 == _ELEM_DATA:
                        data = payload
                if key is None or data is None or len(key) < size + 6:
                    continue
                verdict = _verdict(data)
                if verdict is None or not verdict[1].startswith(("service-", "local-")):
                    continue
                proto = _PROTOS.get(key[size], str(key[size]))
                out[(_ntop(family, key[:size]), proto, int.from_bytes(key[size + 4:size + 6], "big"))] = verdict[1]
    return out


def nftables_ports(family: int = 4, netns: str | None = None) -> set[ServiceKey]:
    """The ClusterIP ports whose nftables rules are in the kernel; empty without our table."""
    try:
        return set(service_ips(family, netns))
    except nflink.NflinkError as exc:
        if exc.errno == 2:
            return set()
        raise


# ------------------------------------------------------------------ iptables on nf_tables

def _expr_op(ex: bytes, family: int) -> tuple:
    """What one expression (an NFTA_LIST_ELEM of NFTA_RULE_EXPRESSIONS) does, for _rule_match:
    ("load", register, source), ("cmp", register, op, value), ("port", port), ("verdict",
    code, chain), ("skip",) for a comment or counter, or ("bad",) for anything else."""
    name, body = "", b""
    for k2, payload in _walk(ex):
        if k2 == _EXPR_NAME:
            name = payload.rstrip(b"\0").decode(errors="replace")
        elif k2 == _EXPR_DATA:
            body = payload
    a = {k: v for k, v in _walk(body)}

    def u32(i: int) -> int:
        v = a.get(i, b"")
        return _unpack(">I", v)[0] if len(v) == 4 else -1

    if name == "meta" and 1 in a:
        return ("load", u32(1), ("meta", u32(2)))
    if name == "payload" and 1 in a:
        return ("load", u32(1), ("payload", u32(2), u32(3), u32(4)))
    if name == "cmp":
        value = _first(a.get(3, b""), _DATA_VALUE)
        return ("bad",) if value is None else ("cmp", u32(1), u32(2), value)
    if name == "match":
        mname = (a.get(1) or b"").rstrip(b"\0").decode(errors="replace")
        info = a.get(3) or b""
        if mname == "comment":
            return ("skip",)
        if mname in ("tcp", "udp") and len(info) >= 9:
            lo, hi = _unpack("=HH", info, 4)             # xt_tcp / xt_udp: spts[2], dpts[2]
            inv = info[11] if mname == "tcp" and len(info) > 11 else info[8]   # xt_tcp's 4 flag bytes
            if lo == hi and not inv & 0x02:              # XT_TCP_INV_DSTPT / XT_UDP_INV_DSTPT
                return ("port", lo)
        return ("bad",)        # conntrack, addrtype, statistic, a port range...: not a ClusterIP rule
    if name == "immediate":
        v = _verdict(a.get(2, b""))
        return ("bad",) if v is None else ("verdict",) + v
    if name == "target":           # an xt target (REJECT...)
        return ("verdict", 1, (a.get(1) or b"").rstrip(b"\0").decode(errors="replace"))
    if name == "reject":
        return ("verdict", 1, "REJECT")
    if name == "counter":
        return ("skip",)
    return ("bad",)                # bitwise (a CIDR: not one Service address), range, lookup...


_MATCH_COMMENT = b"\x0a\x00\x01\x00match\x00\x00\x00", b"\x0c\x00\x01\x00comment\x00"
_CMP = b"\x08\x00\x01\x00cmp\x00"
_IMMEDIATE = b"\x0e\x00\x01\x00immediate\x00\x00\x00"


def _fast_op(ex: bytes) -> tuple | None:
    """_expr_op of the expressions that differ from rule to rule (the comment, the address
    compare, the jump), read at the offsets netlink's layout puts them (10,000 rules at
    10,000 Services: half the read's time went to decoding them attribute by attribute);
    None when the bytes are not exactly that layout (_expr_op then decides)."""
    if ex.startswith(_MATCH_COMMENT[0]):
        return ("skip",) if ex[16:28] == _MATCH_COMMENT[1] else None
    if ex.startswith(_CMP):
        # data: SREG, OP, DATA { VALUE }
        if ex[12:16] != b"\x08\x00\x01\x00" or ex[20:24] != b"\x08\x00\x02\x00" or ex[30:32] != b"\x03\x00" \
                or ex[34:36] != b"\x01\x00":
            return None
        vlen = _unpack("=H", ex, 32)[0] - 4
        if vlen < 1 or 36 + vlen > len(ex):
            return None
        return ("cmp", _unpack(">I", ex, 16)[0], _unpack(">I", ex, 24)[0], ex[36:36 + vlen])
    if ex.startswith(_IMMEDIATE):
        # data: DREG (0: the verdict register), DATA { VERDICT { CODE, CHAIN } }
        if ex[20:28] != b"\x08\x00\x01\x00\x00\x00\x00\x00" or ex[30:32] != b"\x02\x00" \
                or ex[34:36] != b"\x02\x00" or ex[36:40] != b"\x08\x00\x01\x00":
            return None
        code = _unpack(">i", ex, 40)[0]
        if len(ex) < 48 or ex[46:48] != b"\x02\x00":
            return ("verdict", code, "")
        clen = _unpack("=H", ex, 44)[0] - 4
        return ("verdict", code, ex[48:48 + clen].rstrip(b"\0").decode(errors="replace"))
    return None


def _rule_match(exprs: bytes, family: int, memo: dict[bytes, tuple]) -> tuple[ServiceKey, int, str] | None:
    """((ClusterIP, protocol, port), verdict code, target) of one KUBE-SERVICES rule when
    it matches exactly one address, protocol and destination port; None otherwise. memo:
    expressions already decoded, by their bytes (most are the same in every rule)."""
    size = 16 if family == 6 else 4
    daddr = ("payload", _BASE_NETWORK, 24 if family == 6 else 16, size)
    proto_byte = ("payload", _BASE_NETWORK, 9, 1) if family == 4 else None
    dport = ("payload", _BASE_TRANSPORT, 2, 2)
    regs: dict[int, tuple] = {}          # register -> what was loaded into it
    addr = proto = port = None
    verdict = None
    for kind, ex in _walk(exprs):
        if kind != 1:                    # NFTA_LIST_ELEM
            continue
        op = memo.get(ex)
        if op is None:
            op = _fast_op(ex) or _expr_op(ex, family)
            if len(ex) <= 64:       # not the comments: each is one rule's own
                memo[ex] = op
        what = op[0]
        if what == "load":
            regs[op[1]] = op[2]
        elif what == "cmp":
            loaded = regs.pop(op[1], None)
            value = op[3]
            if op[2] != _CMP_EQ or loaded is None:
                return None              # a negation, a range or something unknown
            if loaded == ("meta", _META_L4PROTO) and len(value) == 1:
                proto = value[0]
            elif loaded == daddr and len(value) == size:
                addr = _ntop(family, value)
            elif loaded == proto_byte and len(value) == 1:
                proto = value[0]
            elif loaded == dport and len(value) == 2:
                port = int.from_bytes(value, "big")
            else:
                return None
        elif what == "port":
            port = op[1]
        elif what == "verdict":
            verdict = op
        elif what != "skip":
            return None
    if addr is None or proto is None or port is None or verdict is None:
        return None
    return (addr, _PROTOS.get(proto, str(proto)), port), verdict[1], verdict[2]


def _chain_rules(family: int, table: str, chain: str, netns: str | None):
    body = nflink._str(1, table) + nflink._str(_RULE_CHAIN, chain)
    try:
        for msg in nflink.dump(nflink.GETRULE, family, body, netns=netns):
            if _RULE_EXPRESSIONS in msg:
                yield msg[_RULE_EXPRESSIONS][0]
    except nflink.NflinkError as exc:
        if exc.errno != 2:       # ENOENT: no such table or chain
            raise


def iptables_nft_ports(family: int = 4, netns: str | None = None) -> set[ServiceKey]:
    """The ClusterIP ports an iptables-nft KUBE-SERVICES sends to a KUBE-SVC-/KUBE-SVL- chain
    (nat) or rejects or drops (filter: no endpoints). Raises nflink.NflinkError."""
    out: set[ServiceKey] = set()
    memo: dict[bytes, tuple] = {}
    for exprs in _chain_rules(family, "nat", KUBE_SERVICES, netns):
        hit = _rule_match(exprs, family, memo)
        if hit is not None and hit[1] in (_JUMP, _GOTO) and hit[2].startswith(("KUBE-SVC-", "KUBE-SVL-")):
            out.add(hit[0])
    for exprs in _chain_rules(family, "filter", KUBE_SERVICES, netns):
        hit = _rule_match(exprs, family, memo)
        if hit is not None and (hit[1] == _DROP or hit[2] == "REJECT"):
            out.add(hit[0])
    return out


__all__ = ["ServiceKey", "iptables_nft_ports", "nftables_ports", "service_ips"]
