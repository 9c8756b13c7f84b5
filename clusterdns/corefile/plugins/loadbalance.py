"""CoreDNS's loadbalance plugin: shuffle address, MX and NS records of successful replies.

    loadbalance [round_robin] [{ prefer CIDR...; limit_answers N }]
    loadbalance weighted WEIGHTFILE [{ reload DURATION }]

As coredns/coredns plugin/loadbalance: a NOERROR reply (not AXFR/IXFR) has each section
reordered CNAMEs first, then other records, then the shuffled A/AAAA, MX and NS records
(glibc wants the CNAME chain before the addresses). `prefer` then moves addresses inside the
CIDRs, in the order given, to the front; `limit_answers` keeps the first N answers.

`weighted` (weighted.go): for A, AAAA and SRV questions one address record of the answer and
of the additional section is picked at random by the weights WEIGHTFILE gives its owner name's
addresses (1 for an address it does not list) and swapped to the top; the file is re-read every
DURATION (default 30s, 0s: never) when its content changed, a broken one logged and the last
good weights kept. Names in the file are matched case-insensitively.

The cluster zones' answers from the memo are rotated per query by the DNS engine already, so a
plain `loadbalance` is transparent there; with `prefer` or `limit_answers` it is not.
"""
from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import logging
import os
import random

import dnslib

from ..plugin import Next, Plugin, Request, SetupContext, fqdn, is_subdomain
from ..syntax import Directive, plugin_error
from . import _coredns
from ._coredns import go_duration, go_duration_string

A, NS, CNAME, MX, AAAA, SRV, IXFR, AXFR = 1, 2, 5, 15, 28, 33, 251, 252
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def round_robin(records: list[dnslib.RR], rand: random.Random) -> list[dnslib.RR]:
    if len(records) < 2:
        return records
    cname: list[dnslib.RR] = []
    address: list[dnslib.RR] = []
    mx: list[dnslib.RR] = []
    ns: list[dnslib.RR] = []
    rest: list[dnslib.RR] = []
    for rr in records:
        t = rr.rtype
        if t == A or t == AAAA:
            address.append(rr)
        elif t == CNAME:
            cname.append(rr)
        elif t == MX:
            mx.append(rr)
        elif t == NS:
            ns.append(rr)
        else:
            rest.append(rr)
    for group in (address, mx, ns):
        if len(group) > 1:
            rand.shuffle(group)
    return cname + rest + address + mx + ns


def _copy(reply: dnslib.DNSRecord) -> dnslib.DNSRecord:
    """A shallow copy (copy.copy takes ~14 us on a DNSRecord; this ~1)."""
    out = dnslib.DNSRecord.__new__(dnslib.DNSRecord)
    out.__dict__.update(reply.__dict__)
    return out


def prefer(records: list[dnslib.RR], subnets: list[Network]) -> list[dnslib.RR]:
    cname: list[dnslib.RR] = []
    address: list[dnslib.RR] = []
    mx: list[dnslib.RR] = []
    rest: list[dnslib.RR] = []
    for rr in records:
        {CNAME: cname, A: address, AAAA: address, MX: mx}.get(rr.rtype, rest).append(rr)
    first, seen = [], set()
    for net in subnets:
        for i, rr in enumerate(address):
            ip = _ip(rr)
            if i not in seen and ip is not None and ip.version == net.version and ip in net:
                first.append(rr)
                seen.add(i)
    return cname + first + [rr for i, rr in enumerate(address) if i not in seen] + mx + rest


def _ip(rr: dnslib.RR) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(str(rr.rdata))
    except ValueError:
        return None


class LoadBalance(Plugin):
    name = "loadbalance"

    def __init__(self, subnets: list[Network] | None = None, limit: int = 0,
                 rand: random.Random | None = None) -> None:
        self.subnets = subnets or []
        self.limit = limit
        self.rand = rand or random.Random()
        # the runtime takes loadbalance as transparent for the memo's answers unless this is False
        self.state_transparent = not self.subnets and not self.limit

    async def serve(self, req: Request, next: Next) -> dnslib.DNSRecord:
        reply = await next(req)
        if reply.header.rcode != 0:
            return reply
        qtype = reply.q.qtype if reply.questions else req.qtype
        if qtype in (AXFR, IXFR):
            return reply
        out = _copy(reply)          # new section lists: the reply may be a cache's
        out.rr = round_robin(reply.rr, self.rand)
        out.auth = round_robin(reply.auth, self.rand)
        out.ar = round_robin(reply.ar, self.rand)
        if self.subnets:
            out.rr = prefer(out.rr, self.subnets)
            out.ar = prefer(out.ar, self.subnets)
        if self.limit:
            out.rr = out.rr[:self.limit]
        return out

    def transparent(self, qname: str, qtype: int) -> bool:
        return not self.subnets and not self.limit

    def describe(self) -> str:
        parts = ["round_robin"]
        if self.subnets:
            parts.append("prefer " + " ".join(str(n) for n in self.subnets))
        if self.limit:
            parts.append(f"limit_answers {self.limit}")
        if not self.subnets and not self.limit:
            parts.append("(cluster answers from the memo: the engine rotates address records per query)")
        return " ".join(parts)


Weights = dict[str, dict[ipaddress.IPv4Address | ipaddress.IPv6Address, int]]


def parse_weights(text: str, path: str) -> Weights:
    """The weight file: `NAME` lines, each followed by `IP WEIGHT` lines (1..255); # comments."""
    domains: Weights = {}
    name = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        fields = line.split()
        if len(fields) == 1:
            if _addr(fields[0]) is not None:
                raise ValueError(f'Wrong domain name:"{fields[0]}" in weight file {path}. (Maybe a missing weight value?)')
            name = fqdn(fields[0])
            domains.setdefault(name, {})
        elif len(fields) == 2:
            ip = _addr(fields[0])
            if ip is None:
                raise ValueError(f'Wrong IP address:"{fields[0]}" in weight file {path}')
            if not fields[1].isdigit() or not 0 < int(fields[1]) <= 255:
                raise ValueError(f'Wrong weight value:"{fields[1]}" in weight file {path}')
            if not name:
                raise ValueError(f"Missing domain name in weight file {path}")
            domains[name].setdefault(ip, int(fields[1]))      # the first weight of an address counts
        else:
            raise ValueError(f'Could not parse weight line:"{line}" in weight file {path}')
    return domains


def _addr(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


class Weighted(Plugin):
    name = "loadbalance"

    def __init__(self, path: str, reload: float, weights: Weights, digest: bytes, state_zones: list[str],
                 rand: random.Random | None = None) -> None:
        self.path, self.reload = path, reload
        self.weights, self.digest = weights, digest
        self.state_zones = state_zones
        self.rand = rand or random.Random()
        self._task: asyncio.Task[None] | None = None
        self.state_transparent = False      # the memo knows nothing of weights: transparent() says

    async def serve(self, req: Request, next: Next) -> dnslib.DNSRecord:
        reply = await next(req)
        qtype = reply.q.qtype if reply.questions else req.qtype
        if reply.header.rcode != 0 or qtype not in (A, AAAA, SRV):
            return reply
        out = _copy(reply)
        out.rr = self._top(reply.rr)
        out.ar = self._top(reply.ar)
        return out

    def _top(self, records: list[dnslib.RR]) -> list[dnslib.RR]:
        cname: list[dnslib.RR] = []
        address: list[dnslib.RR] = []
        mx: list[dnslib.RR] = []
        rest: list[dnslib.RR] = []
        for rr in records:
            {CNAME: cname, A: address, AAAA: address, MX: mx}.get(rr.rtype, rest).append(rr)
        if not address:
            return records
        weights = [self.weights.get(fqdn(str(rr.rname)), {}).get(_ip(rr), 1) for rr in address]   # type: ignore[arg-type]
        order = sorted(range(len(address)), key=lambda i: -weights[i])
        v, acc, top = self.rand.randrange(sum(weights)), 0, 0
        for i in order:
            acc += weights[i]
            if v < acc:
                top = i
                break
        address[0], address[top] = address[top], address[0]
        return cname + rest + address + mx

    def transparent(self, qname: str, qtype: int) -> bool:
        # the memo answers state-zone names only: transparent unless the file weighs one of them
        if qtype not in (A, AAAA, SRV):
            return True
        return not any(is_subdomain(n, z) for n in self.weights for z in self.state_zones)

    def load(self) -> bool:
        """updateWeights: re-read the file when its content changed; True when new weights are in."""
        try:
            with open(self.path, "rb") as f:
                data = f.read()
        except OSError as exc:
            _coredns.log(logging.ERROR, f"weight file open error: {self.path}: {exc.strerror}", "loadbalance")
            return False
        digest = hashlib.md5(data, usedforsecurity=False).digest()
        if digest == self.digest:
            return False
        self.digest = digest        # as CoreDNS: a broken content is reported once, not every DURATION
        try:
            weights = parse_weights(data.decode("utf-8", "replace"), self.path)
        except ValueError as exc:
            _coredns.log(logging.ERROR, str(exc), "loadbalance")
            return False
        self.weights = weights
        _coredns.log(logging.INFO, f"Successfully reloaded weight file {self.path}", "loadbalance")
        return True

    async def _reloading(self) -> None:
        while True:
            await asyncio.sleep(self.reload)
            self.load()

    async def start(self) -> None:
        if self.reload > 0 and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._reloading())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    def describe(self) -> str:
        names = sum(1 for _ in self.weights)
        return f"weighted {self.path} reload {go_duration_string(self.reload)} ({names} names weighted)"


def _weighted(d: Directive, args: list[str], ctx: SetupContext) -> Plugin:
    if len(args) < 2:
        raise plugin_error(d, "missing weight file argument")
    if len(args) > 2:
        raise plugin_error(d, "unexpected argument(s)")
    path = args[1] if os.path.isabs(args[1]) else os.path.join(ctx.base_dir, args[1])
    reload = 30.0
    for line in d.lines():
        if line.name != "reload":
            raise plugin_error(line, f"unknown property '{line.name}'", "loadbalance")
        if len(line.values) != 1:
            raise plugin_error(line, "reload duration value is missing" if not line.values else "unexpected argument",
                               "loadbalance")
        try:
            reload = go_duration(line.values[0])
        except ValueError:
            raise plugin_error(line, f"invalid reload duration '{line.values[0]}'", "loadbalance") from None
        if reload < 0:
            raise plugin_error(line, f"invalid reload duration '{line.values[0]}'", "loadbalance")
    weights: Weights = {}
    digest = b""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        if reload == 0:
            raise plugin_error(d, f"weight file open error: {path}: {exc.strerror}") from None
        _coredns.log(logging.WARNING, f"Failed to open weight file:{path}: {exc.strerror}. Will try again in "
                                      f"{go_duration_string(reload)}", "loadbalance")
    else:
        try:
            weights = parse_weights(data.decode("utf-8", "replace"), path)
        except ValueError as exc:
            raise plugin_error(d, str(exc)) from None
        digest = hashlib.md5(data, usedforsecurity=False).digest()
    return Weighted(path, reload, weights, digest, list(ctx.state_zones))


def setup(directive: Directive, ctx: SetupContext) -> Plugin:
    d, args = directive, directive.values
    if args:
        if args[0] == "weighted":
            return _weighted(d, args, ctx)
        if args[0] != "round_robin":
            raise plugin_error(d, f"unknown policy: {args[0]}")
        if len(args) > 1:
            raise plugin_error(d, f"unknown property for {args[0]}")
    subnets: list[Network] = []
    limit = 0
    for line in d.lines():
        if line.name == "prefer":
            for cidr in line.values:
                try:
                    subnets.append(ipaddress.ip_network(cidr, strict=False))
                except ValueError as exc:
                    raise plugin_error(line, f"invalid CIDR {cidr!r}: {exc}", "loadbalance") from None
        elif line.name == "limit_answers":
            if len(line.values) != 1 or not line.values[0].isdigit() or int(line.values[0]) < 1:
                raise plugin_error(line, "limit_answers takes one number of answers, at least 1", "loadbalance")
            limit = int(line.values[0])
        else:
            raise plugin_error(line, f"unknown property '{line.name}'", "loadbalance")
    return LoadBalance(subnets, limit)
