"""Zone transfer (AXFR, and IXFR answered as a full transfer) of a served forward zone.

The records are what queries return: SOA, NS and glue, then every served
Service in (namespace, name) order: its A/AAAA, its CNAME (ExternalName), SRV
at its name (ClusterIP Services) and at each named port, and for headless
Services each endpoint name; the SOA closes the transfer. Messages stay well
under 64 KiB. SRV weights are as CoreDNS's transfer writes them: per owner
name and port, 100 / the number of such records (a query's weight counts
every match of the name instead).
"""
from __future__ import annotations

from dnslib import RR
from dnslib import SRV as RD_SRV
from dnslib.label import DNSBuffer

from .names import Labels
from .wire import AAAA, CNAME, SRV, A, Body, pack_body
from .zone import ZoneView, label

MESSAGE_BUDGET = 32_000     # bytes of records per message before compression


def transfer_records(view: ZoneView, zone: Labels) -> list[RR]:
    soa = view.soa(zone)
    out: list[RR] = [soa]
    ns, glue = view.ns_records(zone)
    out += ns + glue
    for key in sorted(view.services):
        sd = view.service(*key)
        if sd is None:
            continue
        name = (sd.svc.name, sd.svc.namespace, "svc") + zone
        if sd.kind == "external":
            out += view.lookup(name, CNAME).answer
            continue
        for qtype in (A, AAAA):
            out += view.lookup(name, qtype).answer
        if sd.kind == "cluster":
            out += view.lookup(name, SRV).answer
        ports: dict[tuple[str, str], None] = {}
        if sd.kind == "cluster":
            for p in sd.svc.ports:
                if p.name:
                    ports[(p.name.lower(), p.protocol.lower())] = None
        else:
            for _, _, eports in sd.ready:
                for p in eports:
                    if p.name:
                        ports[(p.name.lower(), p.protocol.lower())] = None
        for pname, proto in ports:
            ans = view.lookup(("_" + pname, "_" + proto) + name, SRV)
            out += ans.answer
        if sd.kind == "headless":
            for ep in sd.by_name():
                for qtype in (A, AAAA):
                    out += view.lookup((ep,) + name, qtype).answer
    out.append(soa)
    return _transfer_weights(out)


def _transfer_weights(records: list[RR]) -> list[RR]:
    """SRV weight = max(1, 100 // n), n = SRV records of the same owner name and port."""
    counts: dict[tuple, int] = {}
    for rr in records:
        if rr.rtype == SRV:
            k = (str(rr.rname).lower(), rr.rdata.port)
            counts[k] = counts.get(k, 0) + 1
    out = []
    for rr in records:
        if rr.rtype == SRV:
            w = max(1, 100 // counts[(str(rr.rname).lower(), rr.rdata.port)])
            if w != rr.rdata.weight:
                d = rr.rdata
                rr = RR(rr.rname, SRV, ttl=rr.ttl, rdata=RD_SRV(d.priority, w, d.port, d.target))
        out.append(rr)
    return out


def _size(rr: RR) -> int:
    buf = DNSBuffer()
    rr.pack(buf)
    return len(buf.data)


def transfer_bodies(view: ZoneView, zone: Labels, question: tuple[bytes, ...]) -> list[Body]:
    """The transfer split into message bodies (each follows the echoed question)."""
    lower = tuple(x.lower() for x in question)
    bodies, chunk, size = [], [], 0
    for rr in transfer_records(view, zone):
        n = _size(rr)
        if chunk and size + n > MESSAGE_BUDGET:
            bodies.append(pack_body(lower, chunk, zone_len=len(lower)))
            chunk, size = [], 0
        chunk.append(rr)
        size += n
    if chunk:
        bodies.append(pack_body(lower, chunk, zone_len=len(lower)))
    return bodies


__all__ = ["transfer_records", "transfer_bodies", "label"]
