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

def _rule_match(exprs: bytes, family: int) -> tuple[ServiceKey, int, str] | None:
    """((ClusterIP, protocol, port), verdict code, target) of one KUBE-SERVICES rule when
    it matches exactly one address, protocol and destination port; None otherwise."""
    size, daddr_at, proto_at = (16, 24, None) if family == 6 else (4, 16, 9)
    regs: dict[int, tuple] = {}          # register -> what was loaded into it
    addr = proto = port = None
    verdict: tuple[int, str] | None = None
    for kind, ex in _walk(exprs):
        if kind != 1:                    # NFTA_LIST_ELEM
            continue
        name, body = "", b""
        for k2, payload in _walk(ex):
            if k2 == _EXPR_NAME:
                name = payload.rstrip(b"\0").decode(errors="replace")
            elif k2 == _EXPR_DATA:
                body = payload
        a = {k: v for k, v in _walk(body)}
        if name == "meta":
            key = _unpack(">I", a[2])[0] if len(a.get(2, b"")) == 4 else -1
            if 1 in a:
                regs[_unpack(">I", a[1])[0]] = ("meta", key)
        elif name == "payload":
            if 1 in a and all(len(a.get(i, b"")) == 4 for i in (2, 3, 4)):
                regs[_unpack(">I", a[1])[0]] = ("payload",) + tuple(_unpack(">I", a[i])[0] for i in (2, 3, 4))
        elif name == "cmp":
            reg = _unpack(">I", a[1])[0] if len(a.get(1, b"")) == 4 else -1
            op = _unpack(">I", a[2])[0] if len(a.get(2, b"")) == 4 else -1
            value = _first(a.get(3, b""), _DATA_VALUE)
            loaded = regs.pop(reg, None)
            if op != _CMP_EQ or value is None or loaded is None:
                return None              # a negation, a range or something unknown
            if loaded == ("meta", _META_L4PROTO) and len(value) == 1:
                proto = value[0]
            elif loaded == ("payload", _BASE_NETWORK, daddr_at, size) and len(value) == size:
                addr = _ntop(family, value)
            elif proto_at is not None and loaded == ("payload", _BASE_NETWORK, proto_at, 1) and len(value) == 1:
                proto = value[0]
            elif loaded == ("payload", _BASE_TRANSPORT, 2, 2) and len(value) == 2:
                port = int.from_bytes(value, "big")
            else:
                return None
        elif name == "bitwise":
            return None                  # a masked address: a CIDR, not one Service address
        elif name == "match":
            mname = (a.get(1) or b"").rstrip(b"\0").decode(errors="replace")
            info = a.get(3) or b""
            if mname in ("tcp", "udp") and len(info) >= 8:
                lo, hi = _unpack("=HH", info, 4)             # xt_tcp / xt_udp: spts[2], dpts[2]
                inv = info[11] if mname == "tcp" and len(info) > 11 else info[8]   # xt_tcp's 4 flag bytes
                if lo != hi or inv & 0x02:                   # XT_TCP_INV_DSTPT / XT_UDP_INV_DSTPT
                    return None
                port = lo
            elif mname not in ("comment",):
                return None              # conntrack, addrtype, statistic...: not a ClusterIP rule
        elif name == "immediate":
            v = _verdict(a.get(2, b""))
            if v is not None:
                verdict = v
        elif name == "target":
            tname = (a.get(1) or b"").rstrip(b"\0").decode(errors="replace")
            verdict = (1, tname)        # an xt target (REJECT...)
        elif name == "reject":
            verdict = (1, "REJECT")
        elif name != "counter":
            return None
    if addr is None or proto is None or port is None or verdict is None:
        return None
    return (addr, _PROTOS.get(proto, str(proto)), port), verdict[0], verdict[1]


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
    for exprs in _chain_rules(family, "nat", KUBE_SERVICES, netns):
        hit = _rule_match(exprs, family)
        if hit is not None and hit[1] in (_JUMP, _GOTO) and hit[2].startswith(("KUBE-SVC-", "KUBE-SVL-")):
            out.add(hit[0])
    for exprs in _chain_rules(family, "filter", KUBE_SERVICES, netns):
        hit = _rule_match(exprs, family)
        if hit is not None and (hit[1] == _DROP or hit[2] == "REJECT"):
            out.add(hit[0])
    return out


__all__ = ["ServiceKey", "iptables_nft_ports", "nftables_ports", "service_ips"]
