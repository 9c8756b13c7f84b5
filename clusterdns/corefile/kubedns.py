"""The kube-dns ConfigMap (kube-system/kube-dns) and the Corefile it translates to.

kube-dns is configured by JSON strings in a ConfigMap's data (kubernetes/dns
pkg/dns/config/config.go):

    stubDomains          {"acme.local": ["1.2.3.4", "1.2.3.5:5300"]}   suffix -> nameservers
    upstreamNameservers  ["8.8.8.8", "[2001:db8::1]:53"]               instead of resolv.conf
    federations          {"foo": "foo.feddomain.com"}                  legacy federation

`corefile_from_kube_dns` prints what kubeadm's upgrade made of it (dns.go
translateStubDomainOfKubeDNSToForwardCoreDNS / translateUpstreamNameServerOf...,
v1.10-v1.20), brought to today's CoreDNS as coredns/corefile-migration does: the
default `.:53` block of kubeadm's current template with the upstreams in its
`forward`, one block per stub domain (errors, cache 30, loop, forward), and
migration's `max_concurrent 1000` in every forward. As in kubeadm, a nameserver
given as a host name (kube-dns resolves those, CoreDNS's forward does not) is left
out with a note. Federations are refused: the federation plugin left CoreDNS in
1.6.3.

`read` is also what node-cache's stub blocks come from (pillars.stub_blocks).
"""
from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import InputError

STUB_DOMAINS = "stubDomains"
UPSTREAMS = "upstreamNameservers"
FEDERATIONS = "federations"
KEYS = (STUB_DOMAINS, UPSTREAMS, FEDERATIONS)
RESOLV_CONF = "/etc/resolv.conf"
# forward refuses more TO addresses than this ("more than 15 TOs configured")
MAX_FORWARD_TO = 15

_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS1123_SUBDOMAIN = re.compile(rf"{_LABEL}(\.{_LABEL})*")


class KubeDNSError(InputError, ValueError):
    """A kube-dns ConfigMap that cannot be translated; the message names the key."""


@dataclass(frozen=True)
class KubeDNSConfig:
    """The ConfigMap's three keys, validated as kube-dns validates them."""
    stub_domains: dict[str, list[str]]
    upstreams: list[str]
    federations: dict[str, str]


def is_dns_name(name: str) -> bool:
    """A DNS-1123 subdomain (what kube-dns takes as a stub domain or nameserver name)."""
    return (len(name) <= 253 and _DNS1123_SUBDOMAIN.fullmatch(name) is not None
            and all(len(label) <= 63 for label in name.split(".")))


def _is_ip(text: str) -> bool:
    if "%" in text:        # a zone (fe80::1%eth0): Go's net.ParseIP takes none
        return False
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def server_kind(value: str) -> str:
    """'ip' (IP, IP:port, [IPv6]:port), 'name' (a host name, no port), or 'bad'."""
    host, port = value, ""
    if value.startswith("["):
        end = value.find("]")
        if end < 0 or value[end + 1:end + 2] != ":":
            return "bad"
        host, port = value[1:end], value[end + 2:]
        if ":" not in host:   # brackets are for IPv6 only
            return "bad"
    elif value.count(":") == 1:
        host, port = value.split(":")
    if port or value.endswith(":"):
        if not (port.isascii() and port.isdigit()) or not 1 <= int(port) <= 65535:
            return "bad"
        return "ip" if _is_ip(host) else "bad"
    if _is_ip(host):
        return "ip"
    # Digits and dots that are no IPv4 address are a mistyped address, not a name:
    # no top-level domain is all-numeric.
    if all(c in "0123456789." for c in host):
        return "bad"
    return "name" if is_dns_name(host) else "bad"


def _json(data: Mapping[str, Any], key: str) -> Any:
    raw = data.get(key)
    if raw is None:
        return None
    if not isinstance(raw, str):
        kind = type(raw).__name__
        raise KubeDNSError(f"{key}: expected a JSON string (a ConfigMap value is text), got a YAML {kind}")
    if not raw.strip():
        return None
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise KubeDNSError(f"{key}: invalid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None


def read(data: Mapping[str, Any]) -> KubeDNSConfig:
    """The ConfigMap data (key -> JSON text), parsed and checked; KubeDNSError names the bad key."""
    if not isinstance(data, Mapping):
        raise KubeDNSError("the kube-dns ConfigMap data must be a mapping of keys to JSON strings")
    for key in data:
        if key not in KEYS:
            raise KubeDNSError(f"{key}: not a key kube-dns reads (it reads {', '.join(KEYS)})")

    stubs_raw = _json(data, STUB_DOMAINS)
    stubs: dict[str, list[str]] = {}
    if stubs_raw is not None:
        if not isinstance(stubs_raw, dict):
            raise KubeDNSError(f"{STUB_DOMAINS}: expected a JSON object of domain -> list of nameservers")
        for domain, servers in stubs_raw.items():
            if not is_dns_name(domain):
                raise KubeDNSError(f"{STUB_DOMAINS}: invalid domain name {domain!r} "
                                   "(a lowercase DNS-1123 subdomain, no trailing dot)")
            if not isinstance(servers, list) or not all(isinstance(s, str) for s in servers):
                raise KubeDNSError(f"{STUB_DOMAINS}: {domain!r}: expected a list of nameserver strings")
            for s in servers:
                if server_kind(s) == "bad":
                    raise KubeDNSError(f"{STUB_DOMAINS}: {domain!r}: invalid nameserver {s!r} "
                                       "(an IP address, IP:port, [IPv6]:port or a host name)")
            stubs[domain] = list(servers)

    ups_raw = _json(data, UPSTREAMS)
    upstreams: list[str] = []
    if ups_raw is not None:
        if not isinstance(ups_raw, list) or not all(isinstance(s, str) for s in ups_raw):
            raise KubeDNSError(f"{UPSTREAMS}: expected a JSON list of nameserver strings")
        for s in ups_raw:
            if server_kind(s) == "bad":
                raise KubeDNSError(f"{UPSTREAMS}: invalid nameserver {s!r} (an IP address, IP:port or [IPv6]:port)")
        upstreams = list(ups_raw)

    fed_raw = _json(data, FEDERATIONS)
    federations: dict[str, str] = {}
    if fed_raw is not None:
        if not isinstance(fed_raw, dict) or not all(isinstance(v, str) for v in fed_raw.values()):
            raise KubeDNSError(f"{FEDERATIONS}: expected a JSON object of federation name -> domain")
        federations = dict(fed_raw)
    return KubeDNSConfig(stubs, upstreams, federations)


def check_domain(domain: str, what: str = "--cluster-domain") -> str:
    """The cluster domain, lowercased without its trailing dot; KubeDNSError if it is no DNS name."""
    d = domain.strip().rstrip(".").lower()
    if not is_dns_name(d):
        raise KubeDNSError(f"{what} {domain!r}: not a DNS name")
    return d


def _forward(indent: str, targets: list[str]) -> list[str]:
    return [f"{indent}forward . {' '.join(targets)} {{",
            f"{indent}   max_concurrent 1000",
            f"{indent}}}"]


def corefile_from_kube_dns(data: Mapping[str, Any], domain: str, *, notes: list[str] | None = None) -> str:
    """The Corefile for kube-dns ConfigMap `data` in cluster domain `domain`.

    What was left out (host-name nameservers, stub domains with none left) is
    appended to `notes` when given. KubeDNSError for input that cannot be
    translated: bad JSON, a bad address, a stub domain that is the cluster domain,
    federations, more upstreams than forward takes.
    """
    domain = check_domain(domain)
    cfg = read(data)
    said = notes if notes is not None else []
    if cfg.federations:
        raise KubeDNSError(f"{FEDERATIONS}: not translatable: the federation plugin is no longer built into "
                           "CoreDNS (it left in 1.6.3 for github.com/coredns/federation); remove the key "
                           "to translate the rest")

    upstreams = [s for s in cfg.upstreams if server_kind(s) == "ip"]
    for s in cfg.upstreams:
        if s not in upstreams:
            said.append(f"{UPSTREAMS}: {s!r} left out: a host name, and forward takes IP addresses")
    if len(upstreams) > MAX_FORWARD_TO:
        raise KubeDNSError(f"{UPSTREAMS}: {len(upstreams)} nameservers; forward takes at most {MAX_FORWARD_TO}")
    if cfg.upstreams and not upstreams:
        said.append(f"{UPSTREAMS}: no IP address left; forwarding to {RESOLV_CONF} as kube-dns does without the key")

    blocks = [[
        ".:53 {",
        "    errors",
        "    health {",
        "       lameduck 5s",
        "    }",
        "    ready",
        f"    kubernetes {domain} in-addr.arpa ip6.arpa {{",
        "       pods insecure",
        "       fallthrough in-addr.arpa ip6.arpa",
        "       ttl 30",
        "    }",
        "    prometheus :9153",
        *_forward("    ", upstreams or [RESOLV_CONF]),
        "    cache 30 {",
        f"       disable success {domain}",
        f"       disable denial {domain}",
        "    }",
        "    loop",
        "    reload",
        "    loadbalance",
        "}",
    ]]
    for stub, servers in cfg.stub_domains.items():
        if stub == domain:
            raise KubeDNSError(f"{STUB_DOMAINS}: {stub!r} is the cluster domain; its block would take "
                               "every cluster name away from the kubernetes plugin")
        ips = [s for s in servers if server_kind(s) == "ip"]
        for s in servers:
            if s not in ips:
                said.append(f"{STUB_DOMAINS}: {stub!r}: {s!r} left out: a host name, and forward takes IP addresses")
        if not ips:
            said.append(f"{STUB_DOMAINS}: {stub!r} left out: no IP address to forward to")
            continue
        if len(ips) > MAX_FORWARD_TO:
            raise KubeDNSError(f"{STUB_DOMAINS}: {stub!r}: {len(ips)} nameservers; "
                               f"forward takes at most {MAX_FORWARD_TO}")
        blocks.append([f"{stub}:53 {{", "    errors", "    cache 30", "    loop", *_forward("    ", ips), "}"])
    return "\n\n".join("\n".join(b) for b in blocks) + "\n"


def data_from_yaml(text: str, source: str) -> dict[str, Any]:
    """The data of the one kube-dns ConfigMap (or bare data mapping) in YAML `text`;
    KubeDNSError saying SOURCE[:LINE] otherwise."""
    import yaml  # only here: PyYAML's import costs every other command's start
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark else source
        problem = getattr(exc, "problem", None) or "cannot be read"
        raise KubeDNSError(f"{where}: invalid YAML ({problem})") from None
    if not docs:
        raise KubeDNSError(f"{source}: empty; expected a kube-dns ConfigMap or its data")
    if len(docs) > 1:
        raise KubeDNSError(f"{source}: {len(docs)} YAML documents; give one kube-dns ConfigMap")
    doc = docs[0]
    if not isinstance(doc, dict):
        raise KubeDNSError(f"{source}: expected a ConfigMap or a mapping of its data keys")
    if any(k in doc for k in ("apiVersion", "kind", "metadata", "data")):
        if doc.get("kind", "ConfigMap") != "ConfigMap":
            raise KubeDNSError(f"{source}: kind {doc.get('kind')!r}; expected a ConfigMap")
        data = doc.get("data") or {}
        if not isinstance(data, dict):
            raise KubeDNSError(f"{source}: the ConfigMap's data is not a mapping")
        return data
    return doc
