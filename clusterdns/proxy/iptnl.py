"""iptables-restore texts for the nf_tables backend, sent as one nfnetlink batch.

`iptables-nft-restore --noflush` 1.8.9 spends most of a 10,000-Service full restore
looking chains up (a hash of 512 buckets holding 110,000 names: strcmp, strlen and
nftnl_chain_get_data are two thirds of its CPU time, with or without --noflush; see
docs/proxy-runtime.md). This module writes the same nf_tables objects itself: for each
line of the text the messages iptables-nft 1.8.9 sends for it (its expressions, xt
matches and targets with the same revisions and data, a counter in every rule, the
base chains it creates on first use), so that `iptables-nft-save` prints the rules it
would have printed and the kernel holds the same objects. Checked against the tool:
tests/proxy/test_iptnl.py compares the kernel's own dump of the rules, attribute by
attribute, and iptables-nft-save, after both load the same texts.

The whole text is one transaction (iptables-nft-restore commits table by table), so a
refused text leaves every table as it was. Only the forms the renderers write are known;
anything else raises Unsupported before anything is sent, and the caller uses the tool.
"""
from __future__ import annotations

import logging
import os
import re
import socket
import struct
import threading
import time

from . import nflink
from .nflink import (
    DELCHAIN,
    DELRULE,
    NEWCHAIN,
    NEWRULE,
    NEWTABLE,
    NLM_F_APPEND,
    NLM_F_CREATE,
    NflinkError,
    Unsupported,
    _attr,
    _Batch,
    _expr,
    _fam_hdr,
    _immediate_verdict,
    _nest,
    _str,
    _u32,
    _value,
)

log = logging.getLogger(__name__)

GETCHAIN = 4
NFT_JUMP, NFT_RETURN = -3, -5
VERDICTS = {"ACCEPT": 1, "DROP": 0, "RETURN": NFT_RETURN}
PROTOS = {"tcp": 6, "udp": 17, "sctp": 132}
META_MARK, META_IIFNAME, META_OIFNAME, META_L4PROTO = 3, 6, 7, 16

# iptables-nft's built-in chains: table -> chain -> (hook, priority, type)
BASE_CHAINS = {
    "filter": {"INPUT": (1, 0, "filter"), "FORWARD": (2, 0, "filter"), "OUTPUT": (3, 0, "filter")},
    "nat": {"PREROUTING": (0, -100, "nat"), "INPUT": (1, 100, "nat"), "OUTPUT": (3, -100, "nat"),
            "POSTROUTING": (4, 100, "nat")},
    "mangle": {"PREROUTING": (0, -150, "filter"), "INPUT": (1, -150, "filter"), "FORWARD": (2, -150, "filter"),
               "OUTPUT": (3, -150, "route"), "POSTROUTING": (4, -150, "filter")},
    "raw": {"PREROUTING": (0, -300, "filter"), "OUTPUT": (3, -300, "filter")},
}

# xt_conntrack states: INVALID, then 1 << (ctinfo + 1), then SNAT, DNAT, UNTRACKED
CT_STATES = {"INVALID": 1, "ESTABLISHED": 2, "RELATED": 4, "NEW": 8, "SNAT": 64, "DNAT": 128, "UNTRACKED": 256}
ADDRTYPES = {"UNSPEC": 1, "UNICAST": 2, "LOCAL": 4, "BROADCAST": 8, "ANYCAST": 16, "MULTICAST": 32,
             "BLACKHOLE": 64, "UNREACHABLE": 128, "PROHIBIT": 256, "THROW": 512, "NAT": 1024, "XRESOLVE": 2048}
REJECT_DEFAULT = {4: 3, 6: 4}    # icmp-port-unreachable / icmp6-port-unreachable
NF_NAT_RANGE_MAP_IPS, NF_NAT_RANGE_PROTO_SPECIFIED, NF_NAT_RANGE_PROTO_RANDOM_FULLY = 1, 2, 16

# how many values each option of a match (or target) takes
_ARITY = {
    "comment": {"--comment": 1},
    "tcp": {"--dport": 1, "--sport": 1},
    "udp": {"--dport": 1, "--sport": 1},
    "sctp": {"--dport": 1, "--sport": 1},
    "conntrack": {"--ctstate": 1},
    "mark": {"--mark": 1},
    "statistic": {"--mode": 1, "--probability": 1},
    "recent": {"--name": 1, "--rcheck": 0, "--set": 0, "--reap": 0, "--seconds": 1},
    "addrtype": {"--src-type": 1, "--dst-type": 1},
    "DNAT": {"--to-destination": 1},
    "MARK": {"--or-mark": 1, "--xor-mark": 1, "--set-xmark": 1},
    "MASQUERADE": {"--random-fully": 0},
    "REJECT": {"--reject-with": 1},
}
_TARGETS_WITH_OPTIONS = ("DNAT", "MARK", "MASQUERADE", "REJECT")
# other target extensions (not chains): never written by the renderers
_XT_TARGETS = frozenset(("SNAT", "LOG", "NFLOG", "NOTRACK", "CT", "TPROXY", "CONNMARK", "TRACE", "REDIRECT",
                         "NETMAP", "TCPMSS", "CLASSIFY", "SET", "AUDIT", "CHECKSUM", "NFQUEUE", "QUEUE"))


# ---------------------------------------------------------------- expression pieces

def _split_data(make, n: int) -> tuple[bytes, bytes]:
    """An expression whose last attribute holds n bytes of data, as (prefix, padding)."""
    full = make(b"\xa5" * n)
    pad = -n % 4
    return full[:len(full) - pad - n], full[len(full) - pad:]


_CMP: dict[tuple[int, int], tuple[bytes, bytes]] = {}


def _cmp(op: int, data: bytes) -> bytes:
    key = (op, len(data))
    parts = _CMP.get(key)
    if parts is None:
        parts = _CMP[key] = _split_data(lambda d: nflink._cmp(op, d), len(data))
    return parts[0] + data + parts[1]


def _CMP_PREFIX(op: int, n: int) -> bytes:      # noqa: N802 (a table lookup, named as one)
    """A cmp expression up to its n bytes of data (n a multiple of 4: no padding after)."""
    _cmp(op, bytes(n))
    return _CMP[(op, n)][0]


_PAYLOADS: dict[tuple[int, int, int], bytes] = {}


def _payload(base: int, offset: int, length: int) -> bytes:
    key = (base, offset, length)
    got = _PAYLOADS.get(key)
    if got is None:
        got = _PAYLOADS[key] = nflink._payload(base, offset, length)
    return got


def _meta(key: int) -> bytes:
    return _expr("meta", _u32(2, key), _u32(1, 1))


COUNTER = _expr("counter", _attr(1, bytes(8)), _attr(2, bytes(8)))
_L4 = _meta(META_L4PROTO)


def _xt(kind: str, name: str, rev: int, info: bytes) -> bytes:
    info += b"\0" * (-len(info) % 8)          # XT_ALIGN
    return _expr(kind, _str(1, name), _u32(2, rev), _attr(3, info))


_COMMENTS: dict[str, bytes] = {}


def _comment(text: str) -> bytes:
    got = _COMMENTS.get(text)
    if got is None:
        raw = text.encode()
        if len(raw) > 255:
            raise Unsupported("comment longer than 255 bytes")
        got = _xt("match", "comment", 0, raw + bytes(256 - len(raw)))
        if len(_COMMENTS) < 50000:
            _COMMENTS[text] = got
    return got


_ATTR_HDR = struct.Struct("=HH")
_PADS = (b"", b"\0\0\0", b"\0\0", b"\0")


def _sattr(kind: int, raw: bytes) -> bytes:
    """A NUL-terminated string attribute (_str for bytes, without the encode)."""
    n = len(raw) + 5
    return _ATTR_HDR.pack(n, kind) + raw + b"\0" + _PADS[n % 4]


_JUMP_HEAD: dict[int, bytes] = {}


def _jump(chain: str) -> bytes:
    """`immediate reg 0 jump -> CHAIN`: a template per name length, the name put in."""
    raw = chain.encode()
    n = len(raw)
    head = _JUMP_HEAD.get(n)
    if head is None:
        full = _immediate_verdict(NFT_JUMP, "x" * n)
        head = _JUMP_HEAD[n] = full[:len(full) - len(_sattr(2, raw)) + 4]
    return head + raw + b"\0" + _PADS[(n + 5) % 4]


_ONES = {4: b"\xff" * 4, 6: b"\xff" * 16}


_NETS: dict[tuple[str, int], tuple[bytes, bytes]] = {}


def _net(text: str, family: int) -> tuple[bytes, bytes]:
    """(address & mask, mask) of an iptables address argument: ADDR (a host) or ADDR/PREFIXLEN."""
    af = socket.AF_INET if family == 4 else socket.AF_INET6
    if "/" not in text:
        try:
            return socket.inet_pton(af, text), _ONES[family]
        except OSError:
            raise Unsupported(f"address {text!r} in an IPv{family} table") from None
    got = _NETS.get((text, family))
    if got is not None:
        return got
    addr, _, plen = text.partition("/")
    try:
        packed = socket.inet_pton(af, addr)
    except OSError:
        raise Unsupported(f"network {text!r} in an IPv{family} table") from None
    bits = len(packed) * 8
    if not plen.isdigit() or int(plen) > bits:
        raise Unsupported(f"network {text!r}")
    mask = ((1 << int(plen)) - 1) << (bits - int(plen))
    got = ((int.from_bytes(packed, "big") & mask).to_bytes(len(packed), "big"), mask.to_bytes(len(packed), "big"))
    if len(_NETS) < 4096:      # networks are few (cluster CIDRs, source ranges); hosts are not cached
        _NETS[(text, family)] = got
    return got


def _addr(offset: int, text: str, neg: bool, family: int) -> bytes:
    """iptables-nft's add_addr: the prefix bytes alone when the mask is byte-aligned, else the
    whole address through a bitwise mask; nothing for 0.0.0.0/0 (unless negated)."""
    data, mask = _net(text, family)
    if mask is _ONES[family]:
        size = len(mask)
        return _payload(1, offset, size) + _cmp(1 if neg else 0, data)
    if not neg and not any(mask):
        return b""
    size = len(mask)
    i = 0
    while i < size and mask[i] == 0xFF:
        i += 1
    bitwise = i < size and (mask[i] != 0 or any(mask[i + 1:]))
    op = 1 if neg else 0
    if not bitwise:
        return _payload(1, offset, i) + _cmp(op, data[:i])
    bw = _expr("bitwise", _u32(1, 1), _u32(2, 1), _u32(3, size), _u32(6, 0), _value(4, mask), _value(5, bytes(size)))
    return _payload(1, offset, size) + bw + _cmp(op, data)


def _iface(key: int, name: str, neg: bool) -> bytes:
    raw = name.encode()
    if not raw or len(raw) > 15:
        raise Unsupported(f"interface {name!r}")
    data = raw[:-1] if raw.endswith(b"+") else raw + b"\0"
    return _meta(key) + _cmp(1 if neg else 0, data)


def _port(text: str) -> int:
    if not text.isdigit() or not 0 <= int(text) <= 65535:
        raise Unsupported(f"port {text!r}")
    return int(text)


def _number(text: str) -> int:
    try:
        return int(text, 0)
    except ValueError:
        raise Unsupported(f"number {text!r}") from None


# ---------------------------------------------------------------- matches

def _match(name: str, opts: dict[str, tuple[bool, str]], family: int, proto: int) -> bytes:
    """One -m NAME with its options ({option: (negated, value)}), as iptables-nft encodes it."""
    try:
        return _match_of(name, opts, family, proto)
    except KeyError as exc:
        raise Unsupported(f"-m {name} without {exc}") from None


def _match_of(name: str, opts: dict[str, tuple[bool, str]], family: int, proto: int) -> bytes:
    if name == "comment":
        return _comment(opts["--comment"][1])
    if name in ("tcp", "udp"):
        if not opts:
            # no port: the xt match itself (spts 0:65535, dpts 0:65535, no flags)
            return _xt("match", name, 0, struct.pack("=HHHH", 0, 0xFFFF, 0, 0xFFFF) + bytes(4))
        if proto != PROTOS[name] or "--sport" in opts or opts["--dport"][0]:
            raise Unsupported(f"-m {name} with {sorted(opts)}")
        return _payload(2, 2, 2) + _cmp(0, struct.pack(">H", _port(opts["--dport"][1])))
    if name == "sctp":
        flags, dpts = 0, (0, 0)
        if opts:
            if "--sport" in opts or opts["--dport"][0]:
                raise Unsupported(f"-m sctp with {sorted(opts)}")
            port = _port(opts["--dport"][1])
            flags, dpts = 2, (port, port)
        return _xt("match", "sctp", 0, struct.pack("=HHHH", *dpts, 0, 0) + bytes(256) + bytes(4)
                   + b"\xff\0\0" * 4 + struct.pack("=iII", 0, flags, 0))
    if name == "conntrack":
        neg, states = opts["--ctstate"]
        mask = 0
        for s in states.split(","):
            if s not in CT_STATES:
                raise Unsupported(f"conntrack state {s}")
            mask |= CT_STATES[s]
        # xt_conntrack_mtinfo3: addresses (128 bytes), expires, l4proto and ports, then the flags
        # l4proto, four ports, match_flags (XT_CONNTRACK_STATE), invert_flags, state_mask, status_mask,
        # four high ports, padding
        info = bytes(136) + struct.pack("=13H", 0, 0, 0, 0, 0, 1, 1 if neg else 0, mask, 0, 0, 0, 0, 0) + bytes(2)
        return _xt("match", "conntrack", 3, info)
    if name == "mark":
        neg, value = opts["--mark"]
        mark, _, mask_text = value.partition("/")
        if not mask_text:
            raise Unsupported("-m mark without a mask")
        m, k = _number(mark), _number(mask_text)
        bw = _expr("bitwise", _u32(1, 1), _u32(2, 1), _u32(3, 4), _u32(6, 0),
                   _value(4, struct.pack("=I", k)), _value(5, bytes(4)))
        return _meta(META_MARK) + bw + _cmp(1 if neg else 0, struct.pack("=I", m & k))
    if name == "statistic":
        if opts.get("--mode", (False, ""))[1] != "random" or any(n for n, _ in opts.values()):
            raise Unsupported("-m statistic other than --mode random --probability")
        try:
            p = float(opts["--probability"][1])
        except (KeyError, ValueError):
            raise Unsupported("-m statistic without a probability") from None
        if not 0.0 <= p <= 1.0:
            raise Unsupported(f"probability {p}")
        prob = int(0x80000000 * p + 0.5)      # libxt_statistic: lround(0x80000000 * p)
        # mode, flags, every/probability, packet, count (= every - packet), the kernel's pointer
        return _xt("match", "statistic", 0, struct.pack("=HHIIIQ", 0, 0, prob, 0, prob, 0))
    if name == "recent":
        if any(n for n, _ in opts.values()) or "--name" not in opts:
            raise Unsupported("-m recent form")
        check = (1 if "--rcheck" in opts else 0) | (2 if "--set" in opts else 0) | (32 if "--reap" in opts else 0)
        if bin(check & 15).count("1") != 1:
            raise Unsupported("-m recent needs exactly one of --rcheck, --set")
        seconds = _number(opts["--seconds"][1]) if "--seconds" in opts else 0
        raw = opts["--name"][1].encode()
        if not raw or len(raw) > 199:
            raise Unsupported("-m recent name")
        # xt_recent_mtinfo_v1: seconds, hit_count, check_set, invert, name[200], side, mask (all ones)
        info = struct.pack("=IIBB", seconds, 0, check, 0) + raw + bytes(200 - len(raw)) + b"\0\0" + b"\xff" * 16
        return _xt("match", "recent", 1, info)
    if name == "addrtype":
        src = dst = flags = 0
        for opt, (neg, value) in opts.items():
            types = 0
            for t in value.split(","):
                if t not in ADDRTYPES:
                    raise Unsupported(f"address type {t}")
                types |= ADDRTYPES[t]
            if opt == "--src-type":
                src, flags = types, flags | (1 if neg else 0)
            else:
                dst, flags = types, flags | (2 if neg else 0)
        return _xt("match", "addrtype", 1, struct.pack("=HHI", src, dst, flags))
    raise Unsupported(f"-m {name}")


_DROP = _immediate_verdict(VERDICTS["DROP"], None)
# target names a jump slot must not take for a chain's
_NOT_CHAINS = frozenset(VERDICTS) | frozenset(_TARGETS_WITH_OPTIONS) | _XT_TARGETS


def _dnat(dest: str, family: int) -> bytes:
    """-j DNAT --to-destination IP:PORT ([IP]:PORT for IPv6), revision 2 (nf_nat_range2)."""
    if family == 6:
        if not dest.startswith("[") or "]:" not in dest:
            raise Unsupported(f"DNAT to {dest}")
        host, _, port = dest[1:].partition("]:")
    else:
        host, _, port = dest.rpartition(":")
    if "/" in host or not port:
        raise Unsupported(f"DNAT to {dest}")
    addr, _ = _net(host, family)
    p = _port(port)
    a = addr + bytes(16 - len(addr))
    # flags, min/max address, min/max port, base port (then XT_ALIGN)
    return _DNAT_HEAD + a + a + struct.pack(">HHH", p, p, 0) + bytes(6)


# the DNAT target up to its nf_nat_range2's addresses
_DNAT_HEAD = _xt("target", "DNAT", 2, struct.pack("=I", NF_NAT_RANGE_MAP_IPS | NF_NAT_RANGE_PROTO_SPECIFIED) + bytes(44))[:-44]


def _target(name: str, opts: dict[str, tuple[bool, str]], family: int) -> bytes:
    try:
        return _target_of(name, opts, family)
    except KeyError as exc:
        raise Unsupported(f"-j {name} without {exc}") from None


def _target_of(name: str, opts: dict[str, tuple[bool, str]], family: int) -> bytes:
    if name in VERDICTS and not opts:
        return _immediate_verdict(VERDICTS[name], None)
    if name == "DNAT":
        if len(opts) != 1:
            raise Unsupported("DNAT form")
        return _dnat(opts["--to-destination"][1], family)
    if name == "MARK":
        if len(opts) != 1:
            raise Unsupported("MARK form")
        (opt, (neg, value)), = opts.items()
        if neg:
            raise Unsupported("MARK form")
        if opt == "--or-mark":
            v = _number(value)
            mark, mask = v, v
        elif opt == "--xor-mark":
            mark, mask = _number(value), 0
        else:
            v_text, _, m_text = value.partition("/")
            if not m_text:
                raise Unsupported("--set-xmark without a mask")
            mark, mask = _number(v_text), _number(m_text)
        return _xt("target", "MARK", 2, struct.pack("=II", mark, mask))
    if name == "MASQUERADE":
        flags = NF_NAT_RANGE_PROTO_RANDOM_FULLY if "--random-fully" in opts else 0
        if family == 4:   # nf_nat_ipv4_multi_range_compat with one range
            return _xt("target", "MASQUERADE", 0, struct.pack("=II", 1, flags) + bytes(12))
        return _xt("target", "MASQUERADE", 0, struct.pack("=I", flags) + bytes(36))   # nf_nat_range
    if name == "REJECT":
        if opts:
            raise Unsupported("REJECT --reject-with")
        return _xt("target", "REJECT", 0, struct.pack("=I", REJECT_DEFAULT[family]))
    if opts or not name or name.startswith("-") or name in _TARGETS_WITH_OPTIONS or name in _XT_TARGETS:
        raise Unsupported(f"-j {name}")
    return _jump(name)


# ---------------------------------------------------------------- rules

def _tokens(spec: str) -> list[str]:
    if '"' not in spec:
        return spec.split()
    if "\\" in spec or "'" in spec or spec.count('"') % 2:
        raise Unsupported("quoting")
    out: list[str] = []
    for i, part in enumerate(spec.split('"')):
        if i % 2:
            out.append(part)
        else:
            out += part.split()
    return out


def rule(spec: str, family: int) -> tuple[bytes, int]:
    """The expressions (NFTA_RULE_EXPRESSIONS' content) and the protocol of one rule spec."""
    pre, target, proto, _ = _parse(spec, family)
    return pre + target, proto


def _parse(spec: str, family: int) -> tuple[bytes, bytes, int, str]:
    """(the expressions up to the target, counter included; the target's; the protocol; what the
    spec's last token is: "jump" for a chain jumped to, "dnat" for a DNAT destination, else "").

    As iptables' getopt: a --option belongs to the last -m (or -j) before it that has it,
    wherever it stands (the text writes `-m tcp -p tcp -d IP --dport 80`)."""
    toks = _tokens(spec)
    n = len(toks)
    i = 0
    neg = False
    iif = oif = src = dst = b""
    proto = 0
    proto_expr = b""
    matches: list[tuple[str, dict[str, tuple[bool, str]]]] = []
    target: tuple[str, dict[str, tuple[bool, str]]] | None = None
    saddr, daddr = (12, 16) if family == 4 else (8, 24)
    while i < n:
        t = toks[i]
        i += 1
        if t == "!":
            if neg:
                raise Unsupported("double negation")
            neg = True
            continue
        if t.startswith("--"):
            owner = None
            if target is not None and t in _ARITY.get(target[0], ()):
                owner = target
            else:
                for m in reversed(matches):
                    if t in _ARITY.get(m[0], ()):
                        owner = m
                        break
            if owner is None or t in owner[1]:
                raise Unsupported(f"option {t}")
            if _ARITY[owner[0]][t]:
                if i >= n:
                    raise Unsupported(f"{t} without a value")
                owner[1][t] = (neg, toks[i])
                i += 1
            else:
                owner[1][t] = (neg, "")
            neg = False
            continue
        if i >= n:
            raise Unsupported(f"option {t} without a value")
        value = toks[i]
        i += 1
        if t == "-m":
            if neg or value not in _ARITY or target is not None:
                raise Unsupported(f"-m {value}")
            matches.append((value, {}))
        elif t == "-j":
            if neg or target is not None:
                raise Unsupported(f"-j {value}")
            target = (value, {})
        elif t == "-p":
            if proto or value not in PROTOS:
                raise Unsupported(f"-p {value}")
            proto = PROTOS[value]
            proto_expr = _L4 + _cmp(1 if neg else 0, bytes((proto,)))
        elif t == "-s":
            src = _addr(saddr, value, neg, family)
        elif t == "-d":
            dst = _addr(daddr, value, neg, family)
        elif t == "-i":
            iif = _iface(META_IIFNAME, value, neg)
        elif t == "-o":
            oif = _iface(META_OIFNAME, value, neg)
        else:
            raise Unsupported(f"option {t}")
        neg = False
    if neg:
        raise Unsupported("trailing !")
    parts = [iif, oif, proto_expr, src, dst]
    for name, opts in matches:
        parts.append(_match(name, opts, family, proto))
    parts.append(COUNTER)
    slot = ""
    tail = b""
    if target is not None:
        tail = _target(target[0], target[1], family)
        if n >= 2 and toks[-2] == "-j" and target[0] == toks[-1] and target[0] not in VERDICTS:
            slot = "jump"
        elif n >= 2 and toks[-2] == "--to-destination" and target[0] == "DNAT" and len(target[1]) == 1:
            slot = "dnat"
    return b"".join(parts), tail, proto, slot


# ---------------------------------------------------------------- the batch

def chains(family: int, netns: str | None = None) -> dict[str, dict[str, bool]]:
    """The kernel's chains of a family's tables: table -> chain -> is a base chain."""
    out: dict[str, dict[str, bool]] = {}
    for m in nflink.dump(GETCHAIN, family, b"", netns=netns):
        if 1 in m and 3 in m:
            table = m[1][0].rstrip(b"\0").decode()
            out.setdefault(table, {})[m[3][0].rstrip(b"\0").decode()] = 4 in m
    return out


_NLHDR = struct.Struct("=IHHII")
_REQUEST = 1
LOOKUP_BYTES = 4 << 20      # texts shorter than this look their chains up one by one
# the chains a text names: declared (`:NAME`) or holding its rules (`-A/-I/-D NAME`)
_NAMED = re.compile(r"^(?::|-[AID] )([^ \n]+)", re.M)


_DELETES = re.compile(r"^-D ([^ \n]+)", re.M)


def named_chains(text: str) -> tuple[dict[str, set[str]], set[tuple[str, str]]]:
    """table -> the chains each of the text's tables names, and the (table, chain) it deletes
    rules from by their spec (`-D`); one C-speed pass per table."""
    out: dict[str, set[str]] = {}
    deletes: set[tuple[str, str]] = set()
    starts = [m.start() for m in re.finditer(r"^\*", text, re.M)]
    for i, start in enumerate(starts):
        end = text.find("\n", start)
        table = text[start + 1:end if end >= 0 else len(text)].strip()
        stop = starts[i + 1] if i + 1 < len(starts) else len(text)
        out.setdefault(table, set()).update(_NAMED.findall(text, start, stop))
        deletes.update((table, c) for c in _DELETES.findall(text, start, stop))
    return out, deletes


def chain_rules(family: int, table: str, chain: str, netns: str | None = None) -> list[tuple[int, bytes]]:
    """(handle, expressions as the kernel dumps them) of one chain's rules, in order."""
    out = []
    for m in nflink.dump(nflink.GETRULE, family, _str(1, table) + _str(2, chain), netns=netns):
        if 3 in m and 4 in m:
            out.append((int.from_bytes(m[3][0][:8], "big"), m[4][0]))
    return out


def _kernel_form(data: bytes) -> bytes:
    """Attributes as the kernel dumps them: nf_tables nests without NLA_F_NESTED."""
    out = []
    pos = 0
    while pos + 4 <= len(data):
        length, kind = _ATTR_HDR.unpack_from(data, pos)
        if length < 4:
            break
        body = data[pos + 4:pos + length]
        if kind & nflink.NLA_F_NESTED:
            body = _kernel_form(body)
            kind &= ~nflink.NLA_F_NESTED
        out.append(_ATTR_HDR.pack(length, kind) + body + _PADS[length % 4])
        pos += (length + 3) & ~3
    return b"".join(out)


def _find_rule(rules: list[tuple[int, bytes]], used: set[int], spec: str, family: int) -> int | None:
    """The handle of the first rule not yet deleted whose expressions are the spec's (its counter's
    values aside), as `iptables -D CHAIN spec` picks it; None when there is none."""
    pre, tail, _, _ = _parse(spec, family)
    before = _kernel_form(pre[:len(pre) - len(COUNTER)])
    counter = _kernel_form(COUNTER)
    after = _kernel_form(tail)
    size = len(before) + len(counter) + len(after)
    k = len(before)
    for handle, exprs in rules:
        if len(exprs) == size and handle not in used and exprs.startswith(before) and exprs.endswith(after) \
                and exprs[k:k + 16] == counter[:16]:
            return handle
    return None


def chains_of(family: int, wanted: dict[str, set[str]], netns: str | None = None,
              chunk: int = 2048) -> dict[str, dict[str, bool]]:
    """The kernel's chains among `wanted` (table -> names): table -> chain -> is a base chain,
    with every table the family has (empty when none of its chains is wanted or held). One
    GETCHAIN per name, sent `chunk` at a time: the kernel finds each in a hash, where a dump of
    every chain restarts its walk of the list on each 32 KB reply (1.6 s of kernel time for
    110,000 chains at 10,000 Services, against ~0.1 s for the few hundred a partial text names)."""
    out: dict[str, dict[str, bool]] = {t: {} for t in nflink.table_names(family, netns=netns)}
    asks = [(t, n) for t, names in wanted.items() if t in out for n in names]
    if not asks:
        return out
    link = nflink._link(netns)
    hdr = _fam_hdr(nflink._nfproto(family))
    kind = (nflink.NFNL_SUBSYS_NFTABLES << 8) | GETCHAIN
    newchain = (nflink.NFNL_SUBSYS_NFTABLES << 8) | NEWCHAIN
    with link.lock:
        try:
            for at in range(0, len(asks), chunk):
                part = asks[at:at + chunk]
                first = link.seq
                link.seq += len(part)
                msgs = []
                for i, (table, name) in enumerate(part):
                    body = hdr + _str(1, table) + _str(3, name)
                    msgs.append(_NLHDR.pack(16 + len(body), kind, _REQUEST, first + i, 0) + body)
                link.sock.sendall(b"".join(msgs))
                left = len(part)
                while left:
                    reply = link.sock.recv(1 << 20)
                    pos = 0
                    while pos + 16 <= len(reply):
                        length, mtype, _flags, rseq, _pid = _NLHDR.unpack_from(reply, pos)
                        if length < 16:
                            break
                        i = rseq - first
                        if 0 <= i < len(part):
                            left -= 1
                            table, name = part[i]
                            if mtype == newchain:
                                out[table][name] = 4 in nflink.attrs(reply[pos + 20:pos + length])
                            elif mtype == nflink.NLMSG_ERROR:
                                (err,) = struct.unpack_from("=i", reply, pos + 16)
                                if err and -err != ENOENT:
                                    raise NflinkError(f"nftables getchain {table}/{name}: {os.strerror(-err)}", -err)
                        pos += (length + 3) & ~3
        except OSError as exc:
            nflink._forget(netns, link)
            raise nflink._TransportError(f"netlink getchain failed: {exc}") from None
        except NflinkError:
            nflink._forget(netns, link)     # replies left unread on the socket
            raise
    return out
_MSG = {k: (nflink.NFNL_SUBSYS_NFTABLES << 8) | k
        for k in (NEWTABLE, nflink.DELTABLE, NEWCHAIN, DELCHAIN, NEWRULE, DELRULE)}


NFNL_BATCH_GENID = 1


class _Writer(_Batch):
    """nflink's batch, with one message written in place per call (a full load is 430,000).
    Its BATCH_BEGIN carries a generation (set_genid; 0: none): the kernel refuses the batch
    (ERESTART) when the ruleset changed since, as iptables-nft's batches, for the chains it
    was encoded against are then stale."""

    def __init__(self, genid: int = 0) -> None:
        super().__init__()
        begin = nflink._BATCH_GEN + _ATTR_HDR.pack(8, NFNL_BATCH_GENID) + struct.pack(">I", genid)
        self.pieces[0][:len(begin) + 16] = _NLHDR.pack(16 + len(begin), nflink.NFNL_MSG_BATCH_BEGIN,
                                                      _REQUEST, 0, 0) + begin
        self.fills[0] = 16 + len(begin)

    def set_genid(self, genid: int) -> None:
        struct.pack_into(">I", self.pieces[0], 24, genid)

    def close(self, first: int) -> list[memoryview]:
        """As nflink's, without renumbering when sent numbered from 0 (see _send_numbered):
        every message was written with its sequence number (its index + 1)."""
        if first:
            return super().close(first)
        end = nflink._header(20, nflink.NFNL_MSG_BATCH_END, _REQUEST, len(self.offsets) + 1) + nflink._BATCH_GEN
        return [memoryview(p)[:n] for p, n in zip(self.pieces, self.fills)] + [memoryview(end)]

    def msg(self, kind: int, flags: int, body: bytes, line: int) -> None:
        size = 16 + len(body)
        piece = self.pieces[-1]
        at = self.fills[-1]
        if at + size > len(piece):
            piece = bytearray(max(nflink._PIECE, size))
            self.pieces.append(piece)
            self.fills.append(0)
            at = 0
        _NLHDR.pack_into(piece, at, size, _MSG[kind], _REQUEST | flags, len(self.offsets) + 1, 0)
        piece[at + 16:at + size] = body
        self.fills[-1] = at + size
        self.offsets.append((len(self.pieces) - 1) << 32 | at)
        self.lines.append(line)


class Created:
    """What the early batches of one load made: tables and chains nothing else refers to yet."""

    def __init__(self) -> None:
        self.tables: list[str] = []
        self.chains: dict[str, list[str]] = {}


def encode(text: str, family: int, present: dict[str, dict[str, bool]],
           skip_delete: frozenset[tuple[str, str]] = frozenset(), genid: int = 0,
           early=None, early_bytes: int = 16 << 20, created: Created | None = None,
           rules: dict[tuple[str, str], list[tuple[int, bytes]]] | None = None) -> _Writer:
    """The batch for one iptables-restore --noflush text, given the kernel's chains (`chains`);
    message i came from the line at offset batch.lines[i] of the text (line_at). `skip_delete`:
    (table, chain) whose -X is left out (kept, flushed). `genid`: the generation `present`
    was read at (0: none). `rules`: (table, chain) -> chain_rules, for the chains the text
    deletes rules from by their spec (`-D`). The text is read line by line in place (430,000 lines at 10,000
    Services: a list of them would be 50 MB more beside the batch).

    early(batch): when given, the tables and chains the kernel does not hold yet, with their
    rules, go into batches of about `early_bytes` handed to it as they fill (the last one before
    this returns; `created` gets their names); what is returned holds the rest: the flushes
    and rules of chains the kernel holds, base chains, jumps from them, deletions. Until that
    last batch commits, nothing the kernel held refers to anything the early ones made."""
    nfproto = nflink._nfproto(family)
    hdr = _fam_hdr(nfproto)
    final = _Writer(genid)
    ew = _Writer() if early is not None else final        # the early stream's batch being filled
    early_pieces = max(1, early_bytes // nflink._PIECE)
    created = created if created is not None else Created()
    # NEWRULE messages are written directly into the current stream's batch (the hot path)
    cw = final
    pieces, fills = cw.pieces, cw.fills
    offsets_append, lines_append = cw.offsets.append, cw.lines.append
    piece = pieces[-1]
    at = fills[-1]
    cap = len(piece)
    pack_msg = _NLHDR.pack_into
    newrule = _MSG[NEWRULE]
    append_flags = _REQUEST | NLM_F_CREATE | NLM_F_APPEND
    insert_flags = _REQUEST | NLM_F_CREATE
    size = len(text)
    find = text.find
    pos = 0
    table = ""
    t_attr = b""
    have: set[str] = set()       # the table's chains, in the kernel or made by this batch
    flushed: set[str] = set()    # ... the ones the text declares or adds rules to
    deleted: set[int] = set()    # handles of the rules `-D` lines delete
    new: set[str] = set()        # ... of them the ones this text makes (the early stream's)
    bases: dict[str, tuple[int, int, str]] = {}
    compat: dict[int, bytes] = {}
    # rules differing only in the chain they jump to or where they DNAT to (the endpoint chains'
    # rules) share everything before it; rules `-s ADDR REST` share REST's expressions
    heads: dict[str, tuple[bytes, int, str]] = {}
    rests: dict[str, tuple[bytes, int]] = {}
    last_chain = ""
    c_attr = b""
    pack_hdr = _ATTR_HDR.pack
    exprs_kind = 4 | nflink.NLA_F_NESTED
    saddr = 12 if family == 4 else 8
    af = socket.AF_INET if family == 4 else socket.AF_INET6
    pton = socket.inet_pton
    src_head = _payload(1, saddr, 4 if family == 4 else 16) + _CMP_PREFIX(0, 4 if family == 4 else 16)
    jump_heads = _JUMP_HEAD
    pads = _PADS
    not_chains = _NOT_CHAINS
    ht_attr = b""
    while pos < size:
        no = pos
        end = find("\n", pos)
        if end < 0:
            end = size
        line = text[pos:end]
        pos = end + 1
        if not line or line[0] == "#":
            continue
        c = line[0]
        if c == "-" and line[1] in "AI" and line[2] == " ":
            if not table:
                raise Unsupported("a rule outside a table")
            sp = line.find(" ", 3)
            chain = line[3:sp] if sp > 0 else line[3:]
            if chain != last_chain:
                if chain in bases and chain not in have:
                    hook, prio, ctype = bases[chain]
                    cw.fills[-1] = at
                    final.msg(NEWCHAIN, NLM_F_CREATE, ht_attr + _str(3, chain)
                              + _nest(4, _u32(1, hook), _u32(2, prio & 0xFFFFFFFF)) + _u32(5, 1)
                              + _str(7, ctype), no)
                    piece, at = pieces[-1], fills[-1]
                    cap = len(piece)
                    have.add(chain)
                elif chain not in have:
                    raise Unsupported(f"chain {chain} neither declared nor in the kernel")
                last_chain = chain
                flushed.add(chain)      # (a later -D there would not see what this adds)
                c_attr = ht_attr + _sattr(2, chain.encode())
                target = ew if chain in new else final
                if target is not cw:
                    cw.fills[-1] = at
                    cw = target
                    pieces, fills = cw.pieces, cw.fills
                    offsets_append, lines_append = cw.offsets.append, cw.lines.append
                    piece = pieces[-1]
                    at = fills[-1]
                    cap = len(piece)
                if cw is ew and early is not None and len(pieces) > early_pieces:
                    # a full early batch: handed over (sent while this goes on encoding)
                    fills[-1] = at
                    early(ew)
                    ew = cw = _Writer()
                    pieces, fills = cw.pieces, cw.fills
                    offsets_append, lines_append = cw.offsets.append, cw.lines.append
                    piece = pieces[-1]
                    at = fills[-1]
                    cap = len(piece)
            spec = line[sp + 1:] if sp > 0 else ""
            if line[1] == "I" and spec[:1].isdigit():
                # `-I CHAIN 1 spec`: first in the chain, as `-I CHAIN spec`
                num, _, spec = spec.partition(" ")
                if num != "1":
                    raise Unsupported(f"-I at position {num}")
            head, _, last = spec.rpartition(" ")
            hit = None if spec.startswith("-s ") else heads.get(head)
            if hit is not None and (hit[2] == "dnat" or last not in not_chains):
                pre, proto, slot = hit
                if slot == "jump":
                    raw = last.encode()
                    n = len(raw)
                    jh = jump_heads.get(n)
                    exprs = pre + (jh + raw + b"\0" + pads[(n + 5) % 4] if jh is not None else _jump(last))
                else:
                    exprs = pre + _dnat(last, family)
            elif spec.startswith("-s ") and (sp2 := spec.find(" ", 3)) > 0 and spec[sp2 + 1:] in rests:
                tail, proto = rests[spec[sp2 + 1:]]
                addr = spec[3:sp2]
                if "/" in addr:
                    exprs = _addr(saddr, addr, False, family) + tail
                else:
                    try:
                        exprs = src_head + pton(af, addr) + tail
                    except OSError:
                        raise Unsupported(f"address {addr!r} in an IPv{family} table") from None
            else:
                pre, tail, proto, slot = _parse(spec, family)
                if tail == _DROP and table == "nat":
                    raise Unsupported("DROP in the nat table (iptables refuses it)")
                exprs = pre + tail
                if spec.startswith("-s ") and (sp2 := spec.find(" ", 3)) > 0:
                    rest = spec[sp2 + 1:]
                    r_pre, r_tail, r_proto, _ = _parse(rest, family)
                    # only when the address is the rule's first expression (REST has no -i, -o, -p)
                    src = _addr(saddr, spec[3:sp2], False, family)
                    if src and src + r_pre + r_tail == exprs:
                        if len(rests) >= 4096:
                            rests.clear()
                        rests[rest] = (r_pre + r_tail, r_proto)
                elif slot:
                    if len(heads) >= 4096:
                        heads.clear()
                    heads[head] = (pre, proto, slot)
            ca = compat.get(proto)
            if ca is None:
                ca = compat[proto] = _nest(5, _u32(1, proto), _u32(2, 0))
            body = c_attr + pack_hdr(4 + len(exprs), exprs_kind) + exprs + ca
            total = 16 + len(body)
            if at + total > cap:
                fills[-1] = at
                piece = bytearray(max(nflink._PIECE, total))
                pieces.append(piece)
                fills.append(0)
                at, cap = 0, len(piece)
            pack_msg(piece, at, total, newrule, append_flags if line[1] == "A" else insert_flags,
                     len(cw.offsets) + 1, 0)
            piece[at + 16:at + total] = body
            offsets_append((len(pieces) - 1) << 32 | at)
            lines_append(no)
            at += total
            continue
        cw.fills[-1] = at
        if c == ":":
            sp = line.find(" ")
            name = line[1:sp]
            if not table or name in bases or not line.startswith(" - ", sp) or not 0 < len(name) <= 28 \
                    or name[0] in "-!":
                raise Unsupported(f"declaration {line!r}")
            flushed.add(name)
            if name in have:
                final.msg(DELRULE, 0, ht_attr + _sattr(2, name.encode()), no)        # flush it
            else:
                ew.msg(NEWCHAIN, NLM_F_CREATE, ht_attr + _sattr(3, name.encode()), no)
                have.add(name)
                new.add(name)
                if early is not None:
                    created.chains.setdefault(table, []).append(name)
        elif c == "*":
            if table:
                raise Unsupported("a table without COMMIT")
            table = line[1:].strip()
            if table not in BASE_CHAINS:
                raise Unsupported(f"table {table}")
            t_attr = _str(1, table)
            ht_attr = hdr + t_attr
            have = set(present.get(table, ()))
            new = set()
            flushed = set()
            bases = BASE_CHAINS[table]
            last_chain = ""
            if table not in present:
                ew.msg(NEWTABLE, NLM_F_CREATE, ht_attr, no)
                present = {**present, table: {}}
                if early is not None:
                    created.tables.append(table)
        elif line == "COMMIT":
            if not table:
                raise Unsupported("COMMIT outside a table")
            present = {**present, table: dict.fromkeys(have, False)}
            table = ""
            last_chain = ""
        elif line == "-S":
            pass          # the listing iptables-nft-restore needs (apply.whole_table_cache)
        elif line.startswith("-D "):
            sp = line.find(" ", 3)
            chain = line[3:sp] if sp > 0 else line[3:]
            got = rules.get((table, chain)) if rules is not None and table else None
            if got is None or chain in flushed or chain not in have:
                raise Unsupported(f"line {line!r}")
            handle = _find_rule(got, deleted, line[sp + 1:], family)
            if handle is None:
                # the tool decides (its match is iptables' own; it fails the text if none matches)
                raise Unsupported(f"no rule in the kernel is {line!r}")
            deleted.add(handle)
            final.msg(DELRULE, 0, ht_attr + _sattr(2, chain.encode()) + _attr(3, handle.to_bytes(8, "big")), no)
        elif line.startswith("-X "):
            name = line[3:].strip()
            if not table or name in bases or " " in name:
                raise Unsupported(f"line {line!r}")
            if (table, name) not in skip_delete:
                final.msg(DELCHAIN, 0, ht_attr + _str(3, name), no)
                have.discard(name)
                new.discard(name)
                last_chain = ""
        else:
            raise Unsupported(f"line {line!r}")
        piece, at = pieces[-1], fills[-1]
        cap = len(piece)
    cw.fills[-1] = at
    if table:
        raise Unsupported("a table without COMMIT")
    if early is not None and len(ew):
        early(ew)
    return final


def line_at(text: str, offset: int) -> str:
    end = text.find("\n", offset)
    return text[offset:end if end >= 0 else len(text)]


ENOENT, EBUSY, ERESTART = 2, 16, 85


def _genid(netns: str | None) -> int:
    """The ruleset's generation now (NFT_MSG_GETGEN)."""
    link = nflink._link(netns)
    with link.lock:
        seq = link.seq
        link.seq += 1
        try:
            link.sock.send(nflink._message((nflink.NFNL_SUBSYS_NFTABLES << 8) | nflink.GETGEN, 1, seq,
                                           _fam_hdr(0)))
            while True:
                reply = link.sock.recv(65536)
                pos = 0
                while pos + 16 <= len(reply):
                    length, kind, _flags, rseq, _pid = _NLHDR.unpack_from(reply, pos)
                    if length < 16:
                        break
                    if rseq == seq:
                        if kind == nflink.NLMSG_ERROR:
                            (err,) = struct.unpack_from("=i", reply, pos + 16)
                            raise NflinkError(f"nftables getgen: errno {-err}", -err)
                        got = nflink.attrs(reply[pos + 20:pos + length]).get(1)
                        return struct.unpack(">I", got[0][:4])[0] if got else 0
                    pos += (length + 3) & ~3
        except OSError as exc:
            nflink._forget(netns, link)
            raise nflink._TransportError(f"netlink getgen failed: {exc}") from None


def _send_numbered(link, batch: _Writer, describe) -> int:
    """nflink._send of a batch numbered as written (from 0: this socket's own sequence
    restarts there; each send reads every reply up to its own end first)."""
    with link.lock:
        link.seq = 0
        return nflink._send(link, batch, describe)


class _Sender:
    """Sends the early batches of one load in a thread of its own, in order, while the caller
    goes on encoding (the kernel's work in sendmsg runs without the GIL). Each batch carries
    the generation the previous one left, so anyone else's change in between is refused."""

    def __init__(self, link, genid: int, describe) -> None:
        import queue
        self.link, self.genid, self.describe = link, genid, describe
        self.sent = 0
        self.error: BaseException | None = None
        self.queue: queue.Queue = queue.Queue(maxsize=1)     # one batch waiting, one being sent
        self.kernel_s = 0.0
        self.thread = threading.Thread(target=self._run, name="iptnl-send", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            batch = self.queue.get()
            if batch is None:
                return
            if self.error is not None:
                continue
            t0 = time.monotonic()
            try:
                batch.set_genid(self.genid)
                self.genid = _send_numbered(self.link, batch, self.describe) or self.genid
                self.sent += 1
            except BaseException as exc:     # handed to the encoding thread
                self.error = exc
            self.kernel_s += time.monotonic() - t0

    def put(self, batch: _Writer) -> None:
        if self.error is not None:
            raise self.error
        self.queue.put(batch)

    def stop(self) -> None:
        if self.thread.is_alive():
            self.queue.put(None)
            self.thread.join()

    def finish(self) -> int:
        """Wait for every batch handed over; the generation the last one left."""
        self.stop()
        if self.error is not None:
            raise self.error
        return self.genid


def apply(text: str, family: int = 4, *, netns: str | None = None,
          stats: dict | None = None, early_bytes: int = 16 << 20) -> list[tuple[str, str]]:
    """Load one restore text, encoded against the kernel's chains of this moment (a change in
    between makes the kernel refuse it; it is encoded again).

    What the kernel does not hold yet (the tables and chains of a first sync, new Services'
    chains later) goes in first, in batches of about `early_bytes` sent while the rest is
    encoded; nothing refers to it until the last batch, which holds everything else (the
    rewritten chains, the jumps from base chains, the deletions) and commits as one. So the
    previous rules stay in force until that last batch, and a refusal anywhere leaves them as
    they were: what the early batches made is then deleted again. (early_bytes=0: one batch.)

    A `-X` the kernel refuses because the chain is still referenced from outside the text
    (another component's rule jumps to it) or is already gone is left out and the text sent
    again: the chain stays, flushed, and everything else goes in. Returns those (table, chain).
    NflinkError for any other refusal (nothing applied); Unsupported before anything is sent.
    `stats` gets what it took (messages, MB, seconds and CPU seconds of each step)."""
    skipped: frozenset[tuple[str, str]] = frozenset()
    # a whole table's text names every chain: one dump is cheaper than 100,000 lookups then
    wanted, deletes = named_chains(text) if len(text) < LOOKUP_BYTES else (None, set())
    for attempt in range(4):
        t0 = time.monotonic()
        genid = _genid(netns)
        present = chains_of(family, wanted, netns) if wanted is not None else chains(family, netns)
        rules = {(t, c): chain_rules(family, t, c, netns) for t, c in deletes if c in present.get(t, ())}
        t1, c1 = time.monotonic(), time.thread_time()
        link = nflink._link(netns)
        describe = lambda i: line_at(text, i)      # noqa: E731
        sender = _Sender(link, genid, describe) if early_bytes else None
        created = Created()
        early_msgs = [0]

        def hand_over(batch: _Writer) -> None:
            early_msgs[0] += len(batch)
            sender.put(batch)                    # type: ignore[union-attr]

        try:
            try:
                final = encode(text, family, present, skipped, genid, early=hand_over if sender else None,
                               early_bytes=early_bytes, created=created, rules=rules)
            except Unsupported:
                # a line it does not encode, after some early batches went in: take them back
                # (the caller gives the whole text to the tool)
                if sender is not None:
                    sender.stop()
                    if sender.sent:
                        _undo(link, family, created, sender.genid)
                raise
            finally:
                del present, rules
            last_genid = sender.finish() if sender is not None else genid
            t2, c2 = time.monotonic(), time.thread_time()
            if len(final):
                final.set_genid(last_genid)
                _send_numbered(link, final, describe)
            if stats is not None:
                stats.update(messages=early_msgs[0] + len(final), early_batches=sender.sent if sender else 0,
                             final_messages=len(final), attempts=attempt + 1, read_s=round(t1 - t0, 3),
                             encode_s=round(t2 - t1, 3), encode_cpu_s=round(c2 - c1, 3),
                             early_kernel_s=round(sender.kernel_s, 3) if sender else 0.0,
                             final_s=round(time.monotonic() - t2, 3))
            return sorted(skipped)
        except nflink._TransportError:
            nflink._forget(netns, link)
            raise
        except Unsupported:
            raise
        except NflinkError as exc:
            if sender is not None:
                sender.stop()
                if sender.sent:
                    _undo(link, family, created, sender.genid)
            restart = exc.errno == ERESTART or any(errno == ERESTART for _, errno in exc.failures)
            refused = _refused_deletes(text, exc.failures)
            if attempt == 3 or not restart and (not refused or len(refused) != len(exc.failures)):
                raise _refusal(text, exc) from None
            if restart:
                continue        # the ruleset changed under us: read it again
            log.warning("iptables IPv%d: %s still referenced from outside our rules (or already gone): "
                        "kept, flushed", family, ", ".join(f"{t}/{c}" for t, c in sorted(refused)))
            skipped = skipped | refused
    raise AssertionError("unreachable")


def _undo(link, family: int, created: Created, genid: int) -> None:
    """Delete what committed early batches made (nothing refers to it), unless the ruleset
    changed since the last of them (then it is left: unreferenced chains change no packet)."""
    hdr = _fam_hdr(nflink._nfproto(family))
    batch = _Writer(genid)
    for table, names in created.chains.items():
        if table in created.tables:
            continue
        t = hdr + _str(1, table)
        for name in names:
            batch.msg(DELRULE, 0, t + _sattr(2, name.encode()), 0)
        for name in names:
            batch.msg(DELCHAIN, 0, t + _sattr(3, name.encode()), 0)
    for table in created.tables:
        batch.msg(nflink.DELTABLE, 0, hdr + _str(1, table), 0)
    try:
        _send_numbered(link, batch, lambda i: "undo")
    except NflinkError as exc:
        log.warning("iptables IPv%d: could not delete the chains of a refused load again (%s); they are "
                    "referenced by nothing", family, exc)


def _refusal(text: str, exc: NflinkError) -> NflinkError:
    """The kernel's refusal, naming the text's line (and its number) it refused first."""
    if not exc.failures:
        return exc
    offset, errno = exc.failures[0]
    line = line_at(text, offset)
    more = f" (and {len(exc.failures) - 1} more)" if len(exc.failures) > 1 else ""
    return NflinkError(f"nf_tables refused line {text.count(chr(10), 0, offset) + 1}: {line}: "
                       f"{os.strerror(errno)}{more}", errno, line, exc.failures)


def _refused_deletes(text: str, failures: list[tuple[int, int]]) -> frozenset[tuple[str, str]]:
    """(table, chain) of the `-X` lines among the kernel's refusals (busy: still referenced; or gone)."""
    out = set()
    for offset, errno in failures:
        line = line_at(text, offset)
        if line.startswith("-X ") and errno in (EBUSY, ENOENT):
            head = text.rfind("\n*", 0, offset)
            table = line_at(text, head + 1)[1:].strip() if head >= 0 or text.startswith("*") else ""
            out.add((table, line[3:].strip()))
    return frozenset(out)


# ---------------------------------------------------------------- as a child process

EXIT_REFUSED, EXIT_UNSUPPORTED = 1, 3


def main(argv: list[str] | None = None) -> int:
    """`python -m clusterdns.proxy.iptnl --family 4|6`: apply the restore text on stdin in this
    process's network namespace. The proxier runs it as a child, like the tool it replaces: the
    batch (115 MB at 10,000 Services) is never the agent's memory, and the encoding does not
    share the agent's GIL. Prints {"kept": [[table, chain]...], "stats": {...}} on success;
    exit status 3 (text not encoded: use the tool) or 1 (refused), the reason on stderr."""
    import argparse
    import json
    import sys
    ap = argparse.ArgumentParser(prog="python -m clusterdns.proxy.iptnl")
    ap.add_argument("--family", type=int, choices=(4, 6), default=4)
    ap.add_argument("--early-mb", type=float, default=16.0,
                    help="size of the batches of new chains sent ahead (0: everything in one batch)")
    args = ap.parse_args(argv)
    text = sys.stdin.read()
    stats: dict = {}
    try:
        kept = apply(text, args.family, stats=stats, early_bytes=int(args.early_mb * (1 << 20)))
    except Unsupported as exc:
        print(f"not encoded: {exc}", file=sys.stderr)
        return EXIT_UNSUPPORTED
    except (NflinkError, OSError) as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_REFUSED
    json.dump({"kept": kept, "stats": stats}, sys.stdout)
    return 0


__all__ = ["NflinkError", "Unsupported", "apply", "chains", "encode", "main", "rule"]


if __name__ == "__main__":
    raise SystemExit(main())
