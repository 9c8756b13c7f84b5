"""DNS wire helpers the engine needs and dnslib lacks: prebuilt reply bodies,
rendering with the client's ID / question spelling / EDNS, and truncation.

A reply is stored as a `Body`: the packed resource records that follow the
question, built once against the lower-cased question, so that compression
pointers aim at the question (offset 12) or backwards. Rendering a query is
then: the client's ID, our flags and counts, the client's question bytes
(same length, so every pointer still holds and owner names echo its case),
the body, and our OPT record. Truncation keeps a prefix of the records: as
pointers only go backwards, any prefix is a valid message.
"""
from __future__ import annotations

import struct
from bisect import bisect_right
from typing import Iterable, Sequence

from dnslib import QTYPE, RR, DNSLabel
from dnslib.buffer import BufferError as DNSBufferError
from dnslib.label import DNSBuffer, DNSLabelError

QR, AA, TC, RD, RA, AD, CD = 0x8000, 0x0400, 0x0200, 0x0100, 0x0080, 0x0020, 0x0010
NOERROR, FORMERR, SERVFAIL, NXDOMAIN, NOTIMP, REFUSED = 0, 1, 2, 3, 4, 5
BADVERS = 16
QUERY_FLAGS = RD | CD            # copied from the query into every reply

OPT_TYPE = 41
A, NS, CNAME, SOA, PTR, HINFO, TXT, AAAA, SRV = 1, 2, 5, 6, 12, 13, 16, 28, 33
IXFR, AXFR, ANY = 251, 252, 255
ADDRESS_TYPES = (A, AAAA)

MAX_UDP_PLAIN = 512
MAX_TCP = 65535


class Body:
    """Packed records after the question: `data`, end offset of each record, section counts.

    `spots`: offsets in `data` where the zone's labels are written out in full (inside SRV
    targets, which are never compressed), `zlen` bytes each: render() writes them as the
    question spells its zone. `cut`: more records existed than were packed (see pack_body)."""
    __slots__ = ("data", "ends", "an", "ns", "ar", "spots", "zlen", "cut")

    def __init__(self, data: bytes, ends: Sequence[int], an: int, ns: int, ar: int,
                 spots: tuple[int, ...] = (), zlen: int = 0, cut: bool = False) -> None:
        self.data, self.ends, self.an, self.ns, self.ar = data, tuple(ends), an, ns, ar
        self.spots, self.zlen, self.cut = spots, zlen, cut


class Entry:
    """A complete prebuilt answer: header flags (QR, AA, TC, RA..., rcode) and rotations of the body."""
    __slots__ = ("flags", "bodies", "cacheable", "dep", "serial")

    def __init__(self, flags: int, bodies: Sequence[Body], cacheable: bool = True, dep=None,
                 serial: int | None = None) -> None:
        self.flags, self.bodies, self.cacheable, self.dep = flags, tuple(bodies), cacheable, dep
        self.serial = serial    # the SOA serial of a negative answer (its SOA is the last record)

    def with_serial(self, serial: int) -> "Entry":
        """The same negative answer with another SOA serial (patched in place of the old one)."""
        patch = struct.pack(">I", serial)
        bodies = [Body(b.data[:-20] + patch + b.data[-16:], b.ends, b.an, b.ns, b.ar, b.spots, b.zlen, b.cut)
                  for b in self.bodies]
        return Entry(self.flags, bodies, self.cacheable, self.dep, serial)


class _Buffer(DNSBuffer):
    """dnslib's buffer, but never pointing past offset 0x3FFF (a 14-bit pointer cannot;
    dnslib would write a corrupt one in messages over 16 KiB). `exact`: a name that is a
    compression target only as a whole (the question, see pack_body)."""

    exact: tuple | None = None

    def encode_name(self, name) -> None:
        # dnslib's algorithm, with the name's bytes joined and appended once (it is the
        # hottest step of building an answer)
        if not isinstance(name, DNSLabel):
            name = DNSLabel(name)
        labels = tuple(name.label)
        if labels == self.exact:
            self.data += b"\xc0\x0c"
            self.offset += 2
            return
        if len(b".".join(labels)) > 253:
            raise DNSLabelError(f"name too long: {name!r}")
        names = self.names
        pos = self.offset
        parts = []
        for i in range(len(labels)):
            key = labels[i:]
            pointer = names.get(key)
            if pointer is not None:
                parts.append(struct.pack("!H", 0xC000 | pointer))
                break
            if pos <= 0x3FFF:
                names[key] = pos
            element = labels[i]
            if len(element) > 63:
                raise DNSLabelError(f"label too long: {element!r}")
            parts.append(bytes((len(element),)) + element)
            pos += len(element) + 1
        else:
            parts.append(b"\x00")
        data = b"".join(parts)
        self.offset += len(data)
        self.data += data


BODY_BUDGET = MAX_TCP      # bytes of records worth packing: no reply carries more


def zone_wire(labels: Sequence[bytes]) -> bytes:
    return b"".join(bytes((len(x),)) + x for x in labels)


def pack_body(qname: Sequence[bytes], answer: Iterable[RR], authority: Iterable[RR] = (),
              additional: Iterable[RR] = (), zone_len: int | None = None,
              budget: int = BODY_BUDGET) -> Body:
    """Pack records as they follow a question for `qname` (labels as bytes).

    `zone_len`: the question's last `zone_len` labels are the served zone. Names made from
    objects are then spelled as CoreDNS spells them: their own labels, then the zone as the
    question spells it. So only the whole question (as the owner of answer and authority
    records) and the zone (and its parents) are compression targets, and SRV targets ending
    in the zone are noted in `spots`.
    Packing stops once the records pass `budget` bytes (the sections may be generators):
    what no reply can carry is never built; the Body is then `cut` (replies set TC)."""
    qname = tuple(qname)
    if not authority and not additional and isinstance(answer, list) and len(answer) <= 64:
        direct = _addresses_of(qname, answer)
        if direct is not None:
            return direct
    buf = _Buffer()
    buf.append(b"\x00" * 12)
    buf.encode_name(DNSLabel(qname))
    zwire = b""
    if zone_len is not None:
        n = len(qname)
        for i in range(0, n - zone_len):
            buf.names.pop(qname[i:], None)
        if n > zone_len:
            buf.exact = qname
        zwire = zone_wire(qname[n - zone_len:]) if zone_len else b""
    buf.pack("!HH", 0, 1)
    start = buf.offset
    ends: list[int] = []
    counts = []
    spots: list[int] = []
    zl = len(zwire)
    cut = False
    for i, section in enumerate((answer, authority, additional)):
        k = 0
        if i == 2:
            buf.exact = None     # glue is owned by object names, even the one the question asked
        if not cut:
            for rr in section:
                rr.pack(buf)
                end = buf.offset - start
                ends.append(end)
                k += 1
                if zl and rr.rtype == SRV:
                    at = end - 1 - zl
                    if buf.data[start + at:start + end - 1] == zwire:
                        spots.append(at)
                if end > budget:
                    cut = True
                    break
        counts.append(k)
    return Body(bytes(buf.data[start:]), ends, *counts, tuple(spots), zl, cut)


def _addresses_of(qname: tuple, answer: list) -> Body | None:
    """pack_body() of an answer of A/AAAA records owned by the question, written directly:
    each record is a pointer to the question and fixed fields (the common first answer)."""
    chunks = []
    for rr in answer:
        rtype = rr.rtype
        if (rtype != A and rtype != AAAA) or rr.rclass != 1 or tuple(rr.rname.label) != qname:
            return None
        rd = bytes(rr.rdata.data)
        chunks.append(b"\xc0\x0c" + struct.pack(">HHIH", rtype, 1, rr.ttl, len(rd)) + rd)
    ends, at = [], 0
    for c in chunks:
        at += len(c)
        ends.append(at)
    return Body(b"".join(chunks), ends, len(chunks), 0, 0)


def ttl_offsets(body: Body) -> tuple[int, ...]:
    """Offsets of every record's TTL field in `body` (owner names are labels or pointers)."""
    data, out, pos = body.data, [], 0
    for end in body.ends:
        while True:
            length = data[pos]
            if length == 0:
                pos += 1
                break
            if length & 0xC0:
                pos += 2
                break
            pos += length + 1
        out.append(pos + 4)
        pos = end
    return tuple(out)


def with_ttl(body: Body, offsets: Sequence[int], ttl: int) -> Body:
    """The same records with every TTL at `offsets` set to `ttl`."""
    data = bytearray(body.data)
    for off in offsets:
        struct.pack_into(">I", data, off, ttl)
    return Body(bytes(data), body.ends, body.an, body.ns, body.ar, body.spots, body.zlen, body.cut)


def opt_record(udp_size: int, do: bool, ext_rcode: int = 0) -> bytes:
    """Our OPT pseudo-record: root owner, no options."""
    return struct.pack(">BHHBBHH", 0, OPT_TYPE, udp_size, ext_rcode, 0, 0x8000 if do else 0, 0)


def render(body: Body, flags: int, query: bytes, question: bytes, qdcount: int, opt: bytes, limit: int) -> bytes:
    """A reply: ID and RD/CD from `query`, our flags, the question bytes, the body, the OPT.

    Records are dropped from the end until the reply fits `limit`; TC is then set
    (also when the body itself was cut short).
    """
    qflags = (query[2] << 8 | query[3]) & QUERY_FLAGS if len(query) >= 4 else 0
    head = query[:2] if len(query) >= 2 else b"\x00\x00"
    fixed = 12 + len(question) + len(opt)
    data = body.data
    if body.spots:
        data = spell_zone(body, question)
    an, ns, ar = body.an, body.ns, body.ar
    if fixed + len(data) > limit:
        keep = bisect_right(body.ends, limit - fixed)
        data = data[:body.ends[keep - 1]] if keep else b""
        an, ns, ar = min(an, keep), min(ns, max(0, keep - an)), max(0, keep - an - ns)
        flags |= TC
    elif body.cut:
        flags |= TC
    return b"".join((head, struct.pack(">HHHHH", flags | qflags, qdcount, an, ns, ar + (1 if opt else 0)),
                     question, data, opt))


EMPTY = Body(b"", (), 0, 0, 0)


def spell_zone(body: Body, question: bytes) -> bytes:
    """body.data with the zone inside SRV targets spelled as in `question` (name, type, class)."""
    zl = body.zlen
    zone = question[len(question) - 5 - zl:len(question) - 5]
    if len(zone) != zl or zone == zone.lower():
        return body.data
    data = bytearray(body.data)
    for at in body.spots:
        data[at:at + zl] = zone
    return bytes(data)


def read_query(data: bytes, tcp: bool, udp_size: int) -> tuple[int, int, int, int] | None:
    """The byte-level reading of an ordinary query for the fast path, without a parse:
    (end of the name, end of the question, EDNS, reply size limit), or None when the query
    is anything else (a response, opcode != QUERY, other counts, class != IN, an OPT that is
    not version 0 at the root or whose options do not fill it). EDNS: -1 without an OPT,
    0 with one, 1 with the DO bit. Options (a COOKIE from dig and many resolvers) are
    ignored, as RFC 6891 says for options one does not implement: we implement none, so
    they are only checked to be well-formed."""
    n = len(data)
    if n < 17 or data[2] & 0xF8:          # QR set or opcode != QUERY
        return None
    end = data.find(b"\x00", 12)
    if end < 0:
        return None
    qend = end + 5
    counts = data[4:12]
    if counts == b"\x00\x01\x00\x00\x00\x00\x00\x00":
        if qend != n:
            return None
        edns, limit = -1, (MAX_TCP if tcp else MAX_UDP_PLAIN)
    elif counts == b"\x00\x01\x00\x00\x00\x00\x00\x01":
        # exactly one OPT: root owner, version 0 (extended rcode 0)
        if n < qend + 11 or data[qend + 2] != 41 or data[qend] or data[qend + 1] or data[qend + 5] \
                or data[qend + 6]:
            return None
        if n != qend + 11:
            pos = qend + 11
            if n != pos + (data[qend + 9] << 8 | data[qend + 10]):
                return None
            while pos < n:      # option TLVs must fill the OPT's data exactly
                if pos + 4 > n:
                    return None
                pos += 4 + (data[pos + 2] << 8 | data[pos + 3])
            if pos != n:
                return None
        elif data[qend + 9] or data[qend + 10]:
            return None
        edns = 1 if data[qend + 7] & 0x80 else 0
        if tcp:
            limit = MAX_TCP
        else:
            size = data[qend + 3] << 8 | data[qend + 4]
            limit = MAX_UDP_PLAIN if size < MAX_UDP_PLAIN else (size if size < udp_size else udp_size)
    else:
        return None
    if data[end + 3] or data[end + 4] != 1:     # class IN only
        return None
    return end, qend, edns, limit


def question_end(data: bytes) -> int:
    """Offset just past the first question (name, type, class); -1 if malformed or compressed."""
    pos = 12
    n = len(data)
    while pos < n:
        length = data[pos]
        if length == 0:
            end = pos + 5
            return end if end <= n and end - 12 <= 259 else -1
        if length > 63:
            return -1
        pos += length + 1
    return -1


def question_labels(data: bytes, end: int) -> tuple[bytes, ...] | None:
    """The raw labels of the question name, walked from offset 12; None unless the walk ends
    on the zero byte at `end` (read_query found it by a search: a label may hold a zero
    byte) and the name is at most 255 octets."""
    labels = []
    pos = 12
    while pos < end:
        length = data[pos]
        if length == 0 or length > 63:
            return None
        labels.append(data[pos + 1:pos + 1 + length])
        pos += length + 1
    if pos != end or end - 12 > 254:
        return None
    return tuple(labels)


def qname_labels(data: bytes, end: int) -> tuple[bytes, ...]:
    """The raw labels of the question name ending before `end` - 4."""
    labels = []
    pos = 12
    while data[pos]:
        length = data[pos]
        labels.append(data[pos + 1:pos + 1 + length])
        pos += length + 1
    return tuple(labels)


def udp_limit(client_size: int | None, our_size: int) -> int:
    if client_size is None:
        return MAX_UDP_PLAIN
    return max(MAX_UDP_PLAIN, min(client_size, our_size))


def rotations(answer: list[RR], max_variants: int = 8) -> list[list[RR]]:
    """Rotations of the address records of an answer (CNAMEs stay in front), for load balancing."""
    i = 0
    while i < len(answer) and answer[i].rtype not in ADDRESS_TYPES:
        i += 1
    lead, addrs = answer[:i], answer[i:]
    n = len(addrs)
    if n < 2 or any(rr.rtype not in ADDRESS_TYPES for rr in addrs):
        return [answer]
    v = min(n, max_variants)
    out = []
    for i in range(v):
        k = i * n // v
        out.append(lead + addrs[k:] + addrs[:k])
    return out


__all__ = ["Body", "Entry", "pack_body", "ttl_offsets", "with_ttl", "render", "opt_record", "question_end", "qname_labels",
           "udp_limit", "rotations", "read_query", "question_labels", "spell_zone", "zone_wire", "DNSBufferError", "QTYPE"]
