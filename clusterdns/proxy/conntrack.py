"""UDP conntrack cleanup after a successful sync.

A UDP flow keeps its DNAT in conntrack for as long as packets keep coming, so
a DNS client sending from a fixed port keeps talking to an endpoint that went
away, and a flow created while a Service had no endpoints (so no DNAT) keeps
bypassing the new rules. Two ways decide which flows to delete:

- `stale_flows` (events): from the state whose rules were in the kernel
  before and the state just applied, for the Services that changed; cheap,
  used on partial syncs;
- `reconcile` (kube-proxy's since 1.32): the UDP flows in the kernel now
  (one `conntrack -L -p udp` dump of the family, parsed for three fields)
  compared with the endpoints just programmed; after the first sync, full
  syncs, and at least every --sync-period, so that a change made while no
  agent ran (or one missed) is caught too.
"""
from __future__ import annotations

import ipaddress
import logging
import re
import socket
from dataclasses import dataclass
from typing import Iterable

from ..model import IPV4, IPV6, UDP
from ..state import ClusterState
from .apply import CommandRunner, Result

log = logging.getLogger(__name__)


@dataclass(frozen=True, order=True)
class Flow:
    """A conntrack delete filter: UDP flows to (dst, port), DNATed to reply_src.

    dst None: any destination (NodePorts). reply_src None: every flow to the
    destination (the Service had no endpoints, so none of them was DNATed)."""
    port: int
    dst: str | None = None
    reply_src: str | None = None

    def argv(self, family: int = 4) -> list[str]:
        out = ["conntrack", "-D", "-f", "ipv4" if family == 4 else "ipv6", "-p", "udp"]
        if self.dst is not None:
            out += ["--orig-dst", self.dst]
        out += ["--orig-port-dst", str(self.port)]
        if self.reply_src is not None:
            out += ["--reply-src", self.reply_src]
        return out


@dataclass(frozen=True)
class _UdpPort:
    port: int
    node_port: int
    addresses: tuple[str, ...]        # ClusterIPs, externalIPs, LB IPs of the family
    endpoints: frozenset[str]         # IPs of endpoints that can receive traffic


def _of_family(ips: Iterable[str], family: int) -> tuple[str, ...]:
    out = []
    for ip in ips:
        try:
            if ipaddress.ip_address(ip).version == family:
                out.append(ip)
        except ValueError:
            continue
    return tuple(out)


def udp_ports(state: ClusterState, family: int = 4,
              keys: Iterable[tuple[str, str]] | None = None) -> dict[tuple, _UdpPort]:
    """UDP service ports with their addresses and usable endpoint IPs, by (ns, name, port name)."""
    addr_type = IPV4 if family == 4 else IPV6
    out: dict[tuple, _UdpPort] = {}
    services = state.services if keys is None else {
        k: state.services[k] for k in keys if k in state.services}
    for key, svc in services.items():
        if svc.headless or svc.is_external_name or not svc.cluster_ips:
            continue
        ports = [p for p in svc.ports if p.protocol == UDP]
        if not ports:
            continue
        addresses = _of_family(svc.cluster_ips + svc.external_ips + svc.lb_ips, family)
        if not addresses:
            continue
        slices = [s for s in state.slices_for(*key) if s.address_type == addr_type]
        for sp in ports:
            eps = set()
            for sl in slices:
                if not any(p.name == sp.name and p.protocol == UDP for p in sl.ports):
                    continue
                for ep in sl.endpoints:
                    # Ready endpoints, or serving-terminating ones (the fallback set).
                    if ep.addresses and (ep.ready or (ep.serving and ep.terminating)):
                        eps.add(ep.addresses[0])
            out[key + (sp.name,)] = _UdpPort(sp.port, sp.node_port, addresses, frozenset(eps))
    return out


def stale_flows(old: ClusterState, new: ClusterState, family: int = 4,
                keys: Iterable[tuple[str, str]] | None = None) -> list[Flow]:
    """The UDP flows to delete after `new`'s rules replaced `old`'s.

    keys: the Services changed between the two (None: compare everything).
    - an endpoint that left a UDP port (or whose Service or port was deleted):
      flows to each service address:port and to the NodePort DNATed to it;
    - a UDP port that went from no endpoints to some: every flow to its
      addresses:port and NodePort (they were created without DNAT).
    """
    keys = None if keys is None else set(keys)
    before = udp_ports(old, family, keys)
    after = udp_ports(new, family, keys)
    flows: set[Flow] = set()
    for k, o in before.items():
        n = after.get(k)
        gone = o.endpoints - (n.endpoints if n else frozenset())
        for ep in gone:
            for addr in o.addresses:
                flows.add(Flow(o.port, addr, ep))
            if o.node_port:
                flows.add(Flow(o.node_port, None, ep))
    for k, n in after.items():
        o = before.get(k)
        if n.endpoints and (o is None or not o.endpoints):
            for addr in n.addresses:
                flows.add(Flow(n.port, addr, None))
            if n.node_port:
                flows.add(Flow(n.node_port, None, None))
    return sorted(flows, key=lambda f: (f.dst or "", f.port, f.reply_src or ""))


@dataclass(frozen=True)
class Entry:
    """One UDP conntrack entry: original destination and port, reply source (the DNAT target)."""
    dst: str
    dport: int
    reply_src: str

    @property
    def dnat(self) -> bool:
        return self.reply_src != self.dst


def parse_entries(text: str) -> list[Entry]:
    """`conntrack -L -p udp` lines -> entries (first dst=/dport= are the original
    direction's, the second src= is the reply's source)."""
    out: list[Entry] = []
    for line in text.splitlines():
        dst = dport = reply = None
        srcs = 0
        for word in line.split():
            if word.startswith("src="):
                srcs += 1
                if srcs == 2:
                    reply = word[4:]
                    break
            elif dst is None and word.startswith("dst="):
                dst = word[4:]
            elif dport is None and word.startswith("dport="):
                dport = word[6:]
        if dst and reply and dport and dport.isdigit():
            out.append(Entry(_canonical(dst), int(dport), _canonical(reply)))
    return out


def _canonical(ip: str) -> str:
    try:   # IPv4 through the C parser (a reconcile canonicalises every flow's and Service's address)
        return socket.inet_ntop(socket.AF_INET, socket.inet_pton(socket.AF_INET, ip))
    except (OSError, TypeError):
        pass
    try:
        return str(ipaddress.ip_address(ip))
    except ValueError:
        return ip


def reconcile(entries: Iterable[Entry], state: ClusterState, family: int = 4,
              service_cidrs: Iterable[str] = ()) -> list[Flow]:
    """The UDP flows to delete so that the kernel's flows agree with `state`'s rules.

    - a flow to a Service address:port (ClusterIP, externalIP, LB IP) DNATed to
      an address that is not one of its usable endpoints now (removed, or the
      port has none left);
    - a flow to a Service address:port that was not DNATed (made before the rules
      existed) while the port has endpoints now;
    - a DNATed flow to a NodePort whose target is not one of that port's endpoints;
    - a DNATed flow to an address inside --service-cidr that no Service holds now
      (a Service deleted while no agent ran).
    """
    ports = udp_ports(state, family)
    by_addr: dict[tuple[str, int], frozenset[str]] = {}
    by_node_port: dict[int, frozenset[str]] = {}
    for p in ports.values():
        for addr in p.addresses:
            key = (_canonical(addr), p.port)
            by_addr[key] = by_addr.get(key, frozenset()) | p.endpoints
        if p.node_port:
            by_node_port[p.node_port] = by_node_port.get(p.node_port, frozenset()) | p.endpoints
    service_ips = {_canonical(ip) for svc in state.services.values()
                   for ip in svc.cluster_ips + svc.external_ips + svc.lb_ips}
    nets = []
    for cidr in service_cidrs:
        try:
            net = ipaddress.ip_network(cidr, strict=False)
        except ValueError:
            continue
        if net.version == family:
            nets.append(net)
    flows: set[Flow] = set()
    for e in entries:
        eps = by_addr.get((e.dst, e.dport))
        if eps is not None:
            if e.dnat and e.reply_src not in eps:
                flows.add(Flow(e.dport, e.dst, e.reply_src))
            elif not e.dnat and eps:
                flows.add(Flow(e.dport, e.dst, e.reply_src))
            continue
        if not e.dnat:
            continue
        np_eps = by_node_port.get(e.dport)
        if np_eps is not None:
            if e.reply_src not in np_eps:
                flows.add(Flow(e.dport, None, e.reply_src))
            continue
        if nets and e.dst not in service_ips and _in(e.dst, nets):
            flows.add(Flow(e.dport, e.dst, e.reply_src))
    return sorted(flows, key=lambda f: (f.dst or "", f.port, f.reply_src or ""))


def _in(ip: str, nets: list) -> bool:
    try:
        addr = ipaddress.ip_address(ip)
    except ValueError:
        return False
    return any(addr in net for net in nets)


_DELETED = re.compile(r"(\d+) flow entries have been deleted")


def deleted_count(res: Result) -> int | None:
    """Entries deleted, or None when the CLI failed (exit 1 with '0 ... deleted' is success)."""
    m = _DELETED.search(res.stderr + res.stdout)
    if m:
        return int(m.group(1))
    return 0 if res.returncode == 0 else None


class ConntrackCleaner:
    """Runs the deletes; failures are logged, never raised (the rules are already in)."""

    def __init__(self, runner: CommandRunner, family: int = 4) -> None:
        self.runner = runner
        self.family = family
        self.failures = 0

    async def reconcile(self, state: ClusterState, service_cidrs: Iterable[str] = ()) -> int:
        """One UDP dump of this family; delete what `reconcile` finds stale. Never raises."""
        fam = "ipv4" if self.family == 4 else "ipv6"
        res = await self.runner.run(["conntrack", "-L", "-f", fam, "-p", "udp"])
        if res.returncode != 0:
            self.failures += 1
            log.warning("conntrack reconcile: cannot list UDP flows: %s", (res.stderr or res.stdout).strip())
            return 0
        flows = reconcile(parse_entries(res.stdout), state, self.family, service_cidrs)
        return await self.clear(flows) if flows else 0

    async def clear(self, flows: Iterable[Flow]) -> int:
        total = 0
        for flow in flows:
            res = await self.runner.run(flow.argv(self.family))
            n = deleted_count(res)
            if n is None:
                self.failures += 1
                log.warning("conntrack cleanup failed: %s: %s", " ".join(flow.argv(self.family)),
                            (res.stderr or res.stdout).strip())
                continue
            total += n
        if total:
            log.info("deleted %d stale UDP conntrack entries", total)
        return total


__all__ = ["ConntrackCleaner", "Entry", "Flow", "deleted_count", "parse_entries", "reconcile", "stale_flows",
           "udp_ports"]
