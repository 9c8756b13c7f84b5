"""Helpers that test modules of several folders use (kernel tests: tests/nslib; DNS tests:
tests/dns/dnskit.py; the API server double: tests/fakeapi.py; ports: tests/netutil.py)."""
from __future__ import annotations

import asyncio
import inspect
import time

import aiohttp

from clusterdns import metrics


async def eventually(pred, timeout: float = 10.0, what: str = "condition") -> float:
    """Poll pred() (a plain or an async predicate) until it is true; fail naming `what` after
    timeout seconds. Returns the seconds it took (for a report, never for an assertion)."""
    start = time.monotonic()
    while True:
        ok = pred()
        if inspect.isawaitable(ok):
            ok = await ok
        if ok:
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)


def sample(name: str, **labels: str) -> float:
    """A sample of the process's metrics registry (0 when the series does not exist yet)."""
    return metrics.REGISTRY.get_sample_value(name, labels) or 0.0


async def dns_ask(port: int, name: str, qtype: str = "A", timeout: float = 2.0):
    """One UDP query to 127.0.0.1:port: (rcode, answer rdata texts in order, TTL of the first answer)."""
    import dns.asyncquery
    import dns.message
    import dns.rcode
    r = await dns.asyncquery.udp(dns.message.make_query(name, qtype), "127.0.0.1", port=port, timeout=timeout)
    return (dns.rcode.to_text(r.rcode()), [rd.to_text() for rrset in r.answer for rd in rrset],
            r.answer[0].ttl if r.answer else None)


async def http_get(port: int, path: str) -> tuple[int, str]:
    """GET http://127.0.0.1:port/path: (status, body)."""
    async with aiohttp.ClientSession() as s:
        async with s.get(f"http://127.0.0.1:{port}{path}") as r:
            return r.status, await r.text()


def shown_ips(view, name: str, namespace: str = "ns"):
    """The ClusterIPs a DnsView shows for a Service (None: not shown)."""
    s = view.current.services.get((namespace, name))
    return s.cluster_ips if s else None


def shown_eps(view, name: str, namespace: str = "ns") -> list[str]:
    """The ready endpoint addresses a DnsView shows for a Service."""
    return sorted(a for sl in view.current.slices_for(namespace, name) for e in sl.endpoints if e.ready
                  for a in e.addresses)


def endpoint_slots(items) -> list[str]:
    """nftables endpoint-map elements ("lo-hi : ip . port") as each slot's ranges and its
    endpoints apart: which endpoint holds which of its slot's shares depends on the changes
    that led there (a replaced endpoint takes the share of the one it replaces), not on the
    state alone."""
    ranges: dict[int, list[str]] = {}
    data: dict[int, list[str]] = {}
    for item in items:
        key, _, value = item.partition(" : ")
        slot = int(key.split("-")[0]) // 65536
        ranges.setdefault(slot, []).append(key)
        data.setdefault(slot, []).append(value)
    return sorted(f"slot {slot}: {sorted(ranges[slot])} {sorted(data[slot])}" for slot in ranges)


def nft_elements(state) -> dict:
    """An NftState's elements per set, the endpoint maps' as endpoint_slots."""
    out = {}
    for name, elems in state.elements.items():
        if name.startswith("endpoints-"):
            out[name] = endpoint_slots(e[2] for e in elems.values())
        else:
            out[name] = dict(elems)
    return out
