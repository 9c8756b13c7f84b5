"""Cluster DNS names: zone matching, the query-name grammar, endpoint and pod names.

Everything here works on lower-cased labels as `str` (decoded latin-1, so any
byte survives the round trip) and is pure: the zone view and the tests use it.
The grammar is CoreDNS's (plugin/kubernetes parse.go), left of the zone:

    (empty)                              apex
    dns-version                          schema TXT
    ns.dns / dns                         the fallback name server / its parent
    svc | pod                            empty non-terminals
    <ns>.svc | <ns>.pod                  namespace (empty non-terminal)
    <svc>.<ns>.svc                       service
    <ep>.<svc>.<ns>.svc                  endpoint
    <port>.<proto>.<svc>.<ns>.svc        SRV port (leading "_" optional)
    <a-b-c-d>.<ns>.pod                   pod
"""
from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Callable, Mapping

from ..config import ConfigError

REVERSE_V4 = ("in-addr", "arpa")
REVERSE_V6 = ("ip6", "arpa")

Labels = tuple[str, ...]


def split_name(name: str) -> Labels:
    """'A.b.c.' -> ('a', 'b', 'c'); '' or '.' -> ()."""
    name = name.strip(".").lower()
    return tuple(name.split(".")) if name else ()


def is_reverse(zone: Labels) -> bool:
    return zone[-2:] in (REVERSE_V4, REVERSE_V6)


def zone_of(labels: Labels, zones: list[Labels]) -> Labels | None:
    """The longest zone (from `zones`, sorted longest first) that contains `labels`."""
    n = len(labels)
    for z in zones:
        k = len(z)
        if k <= n and labels[n - k:] == z:
            return z
    return None


def is_subdomain(labels: Labels, zone: Labels) -> bool:
    return len(labels) >= len(zone) and labels[len(labels) - len(zone):] == zone


@dataclass(frozen=True, slots=True)
class Parsed:
    """A name inside a forward (non-reverse) zone, by what it designates."""
    kind: str            # apex version nsname dnsent ent namespace service endpoint port podns pod nx
    namespace: str = ""
    service: str = ""
    endpoint: str = ""   # endpoint label, or the pod label
    port: str = ""
    proto: str = ""


NX = Parsed("nx")


def _strip_underscore(label: str) -> str:
    return label[1:] if label.startswith("_") else label


def parse(rest: Labels) -> Parsed:
    """Parse the labels left of the zone (e.g. ('web', 'testapp', 'svc'))."""
    n = len(rest)
    if n == 0:
        return Parsed("apex")
    last = rest[-1]
    if n == 1:
        if last in ("svc", "pod"):
            return Parsed("ent")
        if last == "dns-version":
            return Parsed("version")
        if last == "dns":
            return Parsed("dnsent")
        return NX
    if last == "dns" and n == 2 and rest[0] == "ns":
        return Parsed("nsname")
    if last == "svc":
        if n == 2:
            return Parsed("namespace", rest[0])
        if n == 3:
            return Parsed("service", rest[1], rest[0])
        if n == 4:
            return Parsed("endpoint", rest[2], rest[1], rest[0])
        if n == 5:
            port, proto = _strip_underscore(rest[0]), _strip_underscore(rest[1])
            if not port or not proto:
                return NX
            return Parsed("port", rest[3], rest[2], port=port, proto=proto)
        return NX
    if last == "pod":
        if n == 2:
            return Parsed("podns", rest[0])
        if n == 3:
            return Parsed("pod", rest[1], endpoint=rest[0])
    return NX


def endpoint_name(hostname: str, pod_name: str, ip: str, pod_names: bool) -> str:
    """The endpoint's DNS label: hostname, else (option) the pod name, else the dashed IP."""
    if hostname and len(hostname) < 64:
        return hostname.lower()
    if pod_names and pod_name and len(pod_name) < 64:
        return pod_name.lower()
    if "." in ip:
        return ip.replace(".", "-")
    dashed = ip.replace(":", "-").lower()
    return dashed + "0" if dashed.endswith("-") else dashed


def pod_label_ip(label: str) -> str | None:
    """'10-1-2-3' -> '10.1.2.3'; 'fd00--1' -> 'fd00::1'; None when not an address."""
    if label.count("-") == 3 and "--" not in label:
        text = label.replace("-", ".")
    else:
        text = label.replace("-", ":")
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        return None


_DEC = re.compile(r"(0|[1-9][0-9]{0,2})\Z")
_NIBBLE = re.compile(r"[0-9a-f]\Z")


def reverse_ip(labels: Labels) -> str | None:
    """The address a full reverse name designates, or None (partial or malformed)."""
    if labels[-2:] == REVERSE_V4:
        parts = labels[:-2]
        if len(parts) != 4 or not all(_DEC.match(p) and int(p) < 256 for p in parts):
            return None
        return ".".join(reversed(parts))
    if labels[-2:] == REVERSE_V6:
        parts = labels[:-2]
        if len(parts) != 32 or not all(_NIBBLE.match(p) for p in parts):
            return None
        hexs = "".join(reversed(parts))
        return str(ipaddress.IPv6Address(int(hexs, 16)))
    return None


def reverse_name(ip: str) -> Labels:
    """'10.0.0.1' -> ('1', '0', '0', '10', 'in-addr', 'arpa')."""
    return split_name(ipaddress.ip_address(ip).reverse_pointer)


# --- label selectors (--namespace-labels) -------------------------------------------

Selector = Callable[[Mapping[str, str]], bool]

_KEY = r"[A-Za-z0-9]([-A-Za-z0-9_./]*[A-Za-z0-9])?"
_VAL = r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?"
_SET = re.compile(rf"\s*({_KEY})\s+(in|notin)\s*\(\s*([^()]*)\)\s*\Z")
_EQ = re.compile(rf"\s*({_KEY})\s*(==|=|!=)\s*({_VAL})\s*\Z")
_EXISTS = re.compile(rf"\s*(!?)\s*({_KEY})\s*\Z")


def _split_requirements(text: str) -> list[str]:
    out, depth, cur = [], 0, []
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth < 0:
                raise ConfigError(f"--namespace-labels {text!r}: unbalanced ')'")
        if ch == "," and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise ConfigError(f"--namespace-labels {text!r}: unbalanced '('")
    out.append("".join(cur))
    return out


def parse_selector(text: str) -> Selector:
    """A Kubernetes label selector: k=v, k==v, k!=v, k, !k, k in (a,b), k notin (a,b); ',' = AND.

    Raises ConfigError on bad syntax. The empty selector matches everything.
    """
    reqs: list[Callable[[Mapping[str, str]], bool]] = []
    if not text.strip():
        return lambda labels: True
    for part in _split_requirements(text):
        m = _SET.match(part)
        if m:
            key, op = m.group(1), m.group(3)
            values = frozenset(v.strip() for v in m.group(4).split(",") if v.strip())
            if not values:
                raise ConfigError(f"--namespace-labels: empty value set in {part.strip()!r}")
            if op == "in":
                reqs.append(lambda l, k=key, vs=values: l.get(k) in vs)
            else:
                reqs.append(lambda l, k=key, vs=values: l.get(k) not in vs)
            continue
        m = _EQ.match(part)
        if m:
            key, op, val = m.group(1), m.group(3), m.group(4)
            if op == "!=":
                reqs.append(lambda l, k=key, v=val: l.get(k) != v)
            else:
                reqs.append(lambda l, k=key, v=val: l.get(k) == v)
            continue
        m = _EXISTS.match(part)
        if m:
            neg, key = m.group(1), m.group(2)
            if neg:
                reqs.append(lambda l, k=key: k not in l)
            else:
                reqs.append(lambda l, k=key: k in l)
            continue
        raise ConfigError(f"--namespace-labels: cannot parse {part.strip()!r}")
    return lambda labels: all(r(labels) for r in reqs)
