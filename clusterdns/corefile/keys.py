"""Server block keys as CoreDNS reads them (core/dnsserver/register.go InspectServerBlocks,
plugin/normalize.go SplitHostPort, plugin/pkg/cidr):

    .:53              -> dns://.:53
    Cluster.Local     -> dns://cluster.local.:53          (lower-case FQDN, default port)
    tls://example.org -> tls://example.org.:853
    10.0.0.0/24       -> dns://0.0.10.in-addr.arpa.:53
    10.0.0.0/15:5053  -> dns://0.10.in-addr.arpa.:5053 and dns://1.10.in-addr.arpa.:5053

and the check that no zone+port is served twice on the same address (address.go zoneOverlap).
"""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Iterable, Sequence

from .syntax import CorefileError, ServerBlock, Token

# CoreDNS's transports and their default ports (plugin/pkg/transport)
DEFAULT_PORTS = {"dns": 53, "tls": 853, "quic": 853, "grpc": 443, "https": 443, "https3": 443}

# characters that cannot be in a zone key: they are always a typo (`example.com{`, `a,b`)
_BAD_ZONE_CHARS = set('{}[],/:@"\\')


@dataclass(frozen=True)
class Key:
    scheme: str
    zone: str          # lower-case FQDN with the trailing dot; '.' for the root
    port: int
    token: Token       # the key as written (FILE:LINE for errors)

    @property
    def address(self) -> str:
        """CoreDNS's spelling: `dns://cluster.local.:53`."""
        return f"{self.scheme}://{self.zone}:{self.port}"

    def __str__(self) -> str:
        return self.address


def _fqdn(host: str) -> str:
    h = host.lower()
    if not h or h == ".":
        return "."
    return h if h.endswith(".") else h + "."


def _check_zone(host: str) -> None:
    if len(host) > 255:
        raise ValueError(f"specified zone is too long: {len(host)} > 255")
    bad = sorted(set(host) & _BAD_ZONE_CHARS)
    if bad or any(c.isspace() for c in host):
        raise ValueError(f"zone is not a valid domain name: {host!r}")
    if host in ("", "."):
        return
    labels = (host[:-1] if host.endswith(".") else host).split(".")
    for label in labels:
        if not label:
            raise ValueError(f"zone is not a valid domain name (empty label): {host!r}")
        if len(label) > 63:
            raise ValueError(f"zone is not a valid domain name (label longer than 63): {host!r}")


def _digits(s: str) -> bool:
    """ASCII digits only, as Go's strconv.Atoi (str.isdigit also takes '١٢' and int() reads it)."""
    return s.isascii() and s.isdigit()


def _network(cidr: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    """A CIDR as Go's net.ParseCIDR takes it (address/prefix-length; host bits allowed)."""
    addr, sep, plen = cidr.partition("/")
    if not sep or not _digits(plen) or "%" in addr:
        raise ValueError(f"invalid CIDR {cidr}")
    if addr.startswith(":") or (addr.startswith("0") and ":" in addr):
        # CoreDNS refuses these (`::/64`, `0::/64`): SplitHostPort "invalid CIDR"
        raise ValueError(f"invalid CIDR {cidr}")
    try:
        return ipaddress.ip_network(f"{addr}/{int(plen)}", strict=False)
    except ValueError:
        raise ValueError(f"invalid CIDR {cidr}") from None


def reverse_zones(cidr: str) -> list[str]:
    """The reverse zones a CIDR is served as: its prefix widened to the next label boundary
    (8 bits in in-addr.arpa, 4 in ip6.arpa), one zone per resulting subnet.
    `10.0.0.0/24` -> [`0.0.10.in-addr.arpa.`]; `10.0.0.0/15` -> [`0.10.in-addr.arpa.`, `1.10.in-addr.arpa.`].
    ValueError for anything that is not a CIDR."""
    net = _network(cidr)
    digit = 8 if net.version == 4 else 4
    prefix = -(-net.prefixlen // digit) * digit          # rounded up to a label boundary
    subnets: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = (
        [net] if prefix == net.prefixlen else list(net.subnets(new_prefix=prefix)))
    out = []
    for sub in subnets:
        labels = sub.network_address.reverse_pointer.split(".")
        # reverse_pointer has one label per digit, then in-addr/ip6 and arpa
        keep = len(labels) - 2 - prefix // digit
        out.append(".".join(labels[keep:]) + ".")
    return out


def _split(text: str, default_port: int, token: Token) -> tuple[str, list[str], int]:
    scheme, sep, rest = text.partition("://")
    if not sep:
        scheme, rest = "dns", text
    scheme = scheme.lower()
    if scheme not in DEFAULT_PORTS:
        raise CorefileError(token, f"unknown scheme {scheme!r} in server block key {text!r} "
                                   f"(known: {', '.join(DEFAULT_PORTS)})")
    host, port = rest, DEFAULT_PORTS[scheme] if scheme != "dns" else default_port
    colon = rest.rfind(":")
    if colon >= 0 and rest.find("/") < colon:
        # as CoreDNS: the port is after the last colon (a reverse key has its /mask before it)
        ptext = rest[colon + 1:]
        if not ptext:
            raise CorefileError(token, f"expecting data after last colon: {text!r}")
        if not _digits(ptext) or int(ptext) > 65535:
            raise CorefileError(token, f"invalid port {ptext!r} in server block key {text!r}")
        host, port = rest[:colon], int(ptext)
    try:
        if "/" in host:
            zones = reverse_zones(host)
        else:
            _check_zone(host)
            zones = [_fqdn(host)]
    except ValueError as e:
        raise CorefileError(token, f"{e} (server block key {text!r})") from None
    return scheme, zones, port


def parse_key(token: Token, default_port: int = 53) -> list[Key]:
    """One key: several when a CIDR expands to several reverse zones."""
    scheme, zones, port = _split(token.text, default_port, token)
    return [Key(scheme, z, port, token) for z in zones]


def parse_keys(block: ServerBlock, default_port: int = 53) -> list[Key]:
    """The block's keys, normalized and expanded, in order. `default_port` is the port of a
    dns:// key without one (CoreDNS's -dns.port)."""
    out: list[Key] = []
    for t in block.keys:
        out += parse_key(t, default_port)
    return out


def bind_addresses(block: ServerBlock) -> list[str]:
    """The arguments of the block's `bind` directives, in order (interfaces unresolved)."""
    return [a.text for d in block.directives if d.name == "bind" for a in d.args]


def _addr(a: str) -> str:
    try:
        return str(ipaddress.ip_address(a))
    except ValueError:
        return a


def _spell(k: Key, address: str) -> str:
    return k.address + (f" on {address}" if address else "")


def check_duplicates(blocks_keys: Iterable[Sequence]) -> None:
    """Refuse a zone+port served twice on one address, as CoreDNS does at startup.

    Each item is (keys, bind_addresses) of one block, or (keys, bind_addresses, filtered)
    where a filtered block (one with a `view`) may share its zones with another. An empty
    bind list means every address; such a block also collides with a bound one of the same
    zone+port ("zone overlap listener capacity")."""
    registered: dict[tuple[str, str, int, str], Key] = {}
    latest: dict[tuple[str, str, int], tuple[Key, str]] = {}   # (scheme, zone, port) -> last registered
    for item in blocks_keys:
        keys, addresses = item[0], item[1]
        filtered = bool(item[2]) if len(item) > 2 else False
        hosts = list(dict.fromkeys(_addr(a) for a in addresses)) or [""]   # `bind a a` is one address
        for k in keys:
            for h in hosts:
                exact = (k.scheme, k.zone, k.port, h)
                unbound = (k.scheme, k.zone, k.port)
                if exact in registered:
                    raise CorefileError(k.token, f"cannot serve {_spell(k, h)} - it is already defined")
                other = latest.get(unbound)
                if other is not None:
                    if not h:
                        raise CorefileError(k.token, f"cannot serve {_spell(k, h)} - zone overlap listener "
                                                     f"capacity with {_spell(*other)}")
                    if (*unbound, "") in registered:
                        raise CorefileError(k.token, f"cannot serve {_spell(k, h)} - zone overlap listener "
                                                     f"capacity with {k.address}")
                if filtered:
                    continue
                registered[exact] = k
                latest[unbound] = (k, h)


def listen_address(scheme: str, host: str, port: int) -> str:
    """A listener as CoreDNS names its group: `dns://:53`, `dns://127.0.0.1:53`, `dns://[::1]:53`."""
    h = _addr(host)
    return f"{scheme}://[{h}]:{port}" if ":" in h else f"{scheme}://{h}:{port}"


def listen_groups(blocks_keys: Iterable[Sequence]) -> dict[str, list[tuple[int, Key]]]:
    """Which (block index, key) pairs each listener serves, listeners in first-seen order
    (CoreDNS's groupConfigsByListenAddr): one listener per scheme, bind address and port,
    shared by all blocks on it; a block without `bind` listens on the wildcard (`dns://:53`).
    Items are (keys, bind_addresses[, filtered]) as for check_duplicates; interface names are
    expected resolved to addresses by the caller."""
    groups: dict[str, list[tuple[int, Key]]] = {}
    for i, item in enumerate(blocks_keys):
        keys, addresses = item[0], item[1]
        for k in keys:
            for addr in dict.fromkeys(listen_address(k.scheme, h, k.port) for h in addresses or [""]):
                groups.setdefault(addr, []).append((i, k))
    return groups


def inspect_blocks(blocks: Sequence[ServerBlock], default_port: int = 53) -> list[list[Key]]:
    """Every block's keys (parse_keys), checked for zones served twice as CoreDNS does at
    startup, with the blocks' `bind` arguments as written and a `view` marking a filtered
    block. A caller that resolves interface names should call check_duplicates itself."""
    all_keys = [parse_keys(b, default_port) for b in blocks]
    check_duplicates([(ks, bind_addresses(b), any(d.name == "view" for d in b.directives))
                      for ks, b in zip(all_keys, blocks)])
    return all_keys
