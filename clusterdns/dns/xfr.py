"""Zone transfer (AXFR, and IXFR answered as a full transfer) of a served forward zone.

The records are what queries return: SOA, NS and glue, then every served
Service in (namespace, name) order: its A/AAAA, its CNAME (ExternalName), SRV
at its name (ClusterIP Services) and at each named port, and for headless
Services each endpoint name; the SOA closes the transfer. Messages stay well
under 64 KiB. SRV weights are as CoreDNS's transfer writes them: 100 for a
ClusterIP Service's records; for a headless Service's, 100 / the number of
ready addresses of the EndpointSlice the endpoint is in (a query's weight counts
every match of the name instead).
"""
from __future__ import annotations

from dnslib import RR
from dnslib import SRV as RD_SRV
from dnslib.label import DNSBuffer

from ..model import IPV4, IPV6
from . import names
from .names import Labels
from .wire import AAAA, CNAME, SRV, A, Body, pack_body
from .zone import ZoneView, label

MESSAGE_BUDGET = 32_000     # bytes of records per message before compression


def transfer_records(view: ZoneView, zone: Labels) -> list[RR]:
    soa = view.soa(zone)
    out: list[RR] = [soa]
    weights: dict[tuple[str, str, int], int] = {}     # (owner, target, port) -> weight
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
            _slice_weights(sd, name, weights)
        if sd.kind == "headless":
            for ep in sd.by_name():
                for qtype in (A, AAAA):
                    out += view.lookup((ep,) + name, qtype).answer
    out.append(soa)
    return _transfer_weights(out, weights)


def _slice_weights(sd, name: Labels, weights: dict[tuple[str, str, int], int]) -> None:
    """Each named port's SRV of each endpoint of a headless Service weighs 100 / the ready
    addresses of its EndpointSlice (CoreDNS's transfer, per subset)."""
    base = ".".join(name) + "."
    for sl in sd.slices:
        if sl.address_type not in (IPV4, IPV6):
            continue
        addrs = [(ep, ip) for ep in sl.endpoints if ep.ready for ip in ep.addresses]
        if not addrs:
            continue
        w = max(1, 100 // len(addrs))
        for ep, ip in addrs:
            target = f"{names.endpoint_name(ep.hostname, ep.pod_name, ip, sd._pod_names)}.{base}"
            for p in sl.ports:
                if p.name:
                    owner = f"_{p.name.lower()}._{p.protocol.lower()}.{base}"
                    weights[(owner, target, p.port)] = w


def _transfer_weights(records: list[RR], weights: dict[tuple[str, str, int], int]) -> list[RR]:
    """Every SRV weighs 100 unless `weights` says otherwise (a headless Service's)."""
    out = []
    for rr in records:
        if rr.rtype == SRV:
            w = weights.get((str(rr.rname).lower(), str(rr.rdata.target).lower(), rr.rdata.port), 100)
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
