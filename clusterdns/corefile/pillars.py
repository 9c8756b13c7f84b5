"""node-local-dns's Corefile placeholders, filled as the documented sed and node-cache fill them.

The upstream NodeLocal DNSCache Corefile (kubernetes/kubernetes cluster/addons/dns/nodelocaldns)
is a template; the operator seds some placeholders, node-cache
(kubernetes/dns cmd/node-cache/app/configmap.go updateCorefile) fills the rest at run time:

    __PILLAR__DNS__DOMAIN__        the cluster domain (sed)
    __PILLAR__LOCAL__DNS__         the listen addresses, space-separated (sed, or node-cache's -localip)
    __PILLAR__DNS__SERVER__        the kube-dns Service IP (sed in iptables mode); removed in IPVS mode
    __PILLAR__CLUSTER__DNS__       where cluster names go: the kube-dns-upstream Service's ClusterIP
    __PILLAR__UPSTREAM__SERVERS__  /etc/resolv.conf, or the kube-dns ConfigMap's upstreamNameservers;
                                   with custom servers node-cache also rewrites
                                   "forward . __PILLAR__UPSTREAM__SERVERS__ { force_tcp }" to plain
                                   "forward . SERVERS" (custom resolvers are often UDP-only,
                                   kubernetes/dns PR #377)

and appends one block per kube-dns stub domain (`stub_blocks`). clusterdns answers cluster names
itself, so without a ClusterIP to forward to `__PILLAR__CLUSTER__DNS__` becomes IN_PROCESS, a
token the runtime's forward recognises as "answer from the cluster state in this process".

Where this differs from node-cache, on purpose:
- `__PILLAR__LOCAL__DNS__:PORT` (health's address) takes the first local IP only ([bracketed] if
  IPv6): the listed form would give health several arguments, which it refuses; the docs' sed
  puts the one link-local IP there.
- The kube-dns Service IP is not listed twice when it is also among the local IPs.
- The force_tcp block is matched whatever its indentation (node-cache matches its own bytes only,
  and otherwise keeps TCP to the custom servers).
- A placeholder left unknown is an error naming its line (node-cache leaves it for CoreDNS to trip on).
"""
from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from typing import Any

from ..errors import InputError
from . import kubedns

LOCAL_DNS = "__PILLAR__LOCAL__DNS__"
DNS_SERVER = "__PILLAR__DNS__SERVER__"
DNS_DOMAIN = "__PILLAR__DNS__DOMAIN__"
UPSTREAM_SERVERS = "__PILLAR__UPSTREAM__SERVERS__"
CLUSTER_DNS = "__PILLAR__CLUSTER__DNS__"
PLACEHOLDERS = (LOCAL_DNS, DNS_SERVER, DNS_DOMAIN, UPSTREAM_SERVERS, CLUSTER_DNS)

# In place of __PILLAR__CLUSTER__DNS__ when no ClusterIP is given: the runtime answers from its
# own cluster state. One Corefile token (no space, brace, quote or '#'), and no address a real
# forward target could be, so it can never be taken for one.
IN_PROCESS = "clusterdns:state"
RESOLV_CONF = kubedns.RESOLV_CONF
STUB_CACHE_TTL = 30   # node-cache's defaultTTL for stub blocks

_ANY = re.compile(r"__PILLAR__[A-Z0-9]+(?:__[A-Z0-9]+)*__")
# node-cache's upstreamTCPBlock, any indentation
_UPSTREAM_TCP = re.compile(r"(forward[ \t]+\.[ \t]+)" + UPSTREAM_SERVERS
                           + r"[ \t]*\{[ \t]*\r?\n[ \t]*force_tcp[ \t]*\r?\n[ \t]*\}")
_STUB_BLOCK = """
{domain}:{port} {{
    errors
    cache {ttl}
    bind {local}
    forward . {servers}
}}
"""


class PillarError(InputError, ValueError):
    """A value that cannot fill a placeholder, or a placeholder nothing fills."""


def _code(line: str) -> str:
    """The line without its comment: '#' starts one at the start of a token outside quotes."""
    quoted = escaped = False
    for i, ch in enumerate(line):
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch == '"':
            quoted = not quoted
        elif ch == "#" and not quoted and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def has_pillars(text: str) -> bool:
    """Whether the Corefile (outside its comments) still holds a __PILLAR__ placeholder."""
    return any(_ANY.search(_code(line)) for line in text.splitlines())


def _ip(value: str, what: str) -> str:
    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        raise PillarError(f"{what} {value!r}: not an IP address") from None


def _upstream(upstream: str) -> list[str] | None:
    """The servers of `upstream`, or None when it is a resolv.conf path."""
    tokens = upstream.split()
    if not tokens:
        raise PillarError("upstream: empty; give a resolv.conf path or nameserver addresses")
    if len(tokens) == 1 and tokens[0].startswith(("/", ".")):
        return None
    for t in tokens:
        if kubedns.server_kind(t) != "ip":
            raise PillarError(f"upstream {t!r}: not an IP address, IP:port, [IPv6]:port or a resolv.conf path")
    return tokens


def fill(text: str, *, local_ips: list[str], dns_server: str | None, cluster_domain: str, upstream: str,
         cluster_dns: str | None) -> str:
    """The node-local-dns Corefile `text` with its placeholders filled (see the module doc).

    local_ips: the addresses node-local-dns listens on; dns_server: the kube-dns Service IP, or
    None to drop it (IPVS mode); upstream: a resolv.conf path or space-separated nameservers;
    cluster_dns: the ClusterIP cluster names are forwarded to, or None for IN_PROCESS.
    """
    ips = [_ip(ip, "local IP") for ip in local_ips]
    server = _ip(dns_server, "DNS server") if dns_server is not None else None
    target = _ip(cluster_dns, "cluster DNS") if cluster_dns is not None else IN_PROCESS
    if not kubedns.is_dns_name(cluster_domain):
        raise PillarError(f"cluster domain {cluster_domain!r}: not a DNS name")
    servers = _upstream(upstream)
    if not ips and LOCAL_DNS in text:
        raise PillarError(f"{LOCAL_DNS}: no local IP to fill it with")

    if servers is None:
        text = text.replace(UPSTREAM_SERVERS, upstream.strip())
    else:
        joined = " ".join(servers)
        text = _UPSTREAM_TCP.sub(lambda m: m.group(1) + joined, text)
        text = text.replace(UPSTREAM_SERVERS, joined)
    text = text.replace(CLUSTER_DNS, target)
    if ips:
        first = ips[0] if ":" not in ips[0] else f"[{ips[0]}]"
        text = text.replace(LOCAL_DNS + ":", first + ":").replace(LOCAL_DNS, " ".join(ips))
    if server is None or server in ips:
        text = re.sub(r"[ \t]*" + DNS_SERVER, "", text)
    else:
        text = text.replace(DNS_SERVER, server)
    text = text.replace(DNS_DOMAIN, cluster_domain)

    for n, line in enumerate(text.splitlines(), 1):
        m = _ANY.search(_code(line))
        if m:
            raise PillarError(f"line {n}: unknown placeholder {m.group(0)} (known: {', '.join(PLACEHOLDERS)})")
    return text


def upstream_from_kube_dns(kube_dns_data: Mapping[str, Any]) -> str:
    """What node-cache puts for __PILLAR__UPSTREAM__SERVERS__: the ConfigMap's
    upstreamNameservers, or /etc/resolv.conf without them."""
    cfg = kubedns.read(kube_dns_data)
    for s in cfg.upstreams:
        if kubedns.server_kind(s) != "ip":
            raise kubedns.KubeDNSError(f"{kubedns.UPSTREAMS}: {s!r} is a host name; node-cache's forward "
                                       "takes IP addresses (node-cache refuses this ConfigMap)")
    return " ".join(cfg.upstreams) or RESOLV_CONF


def stub_blocks(kube_dns_data: Mapping[str, Any], local_ips: list[str], *, port: int = 53) -> str:
    """The server blocks node-cache appends for the kube-dns ConfigMap's stubDomains, in its
    template's shape (errors, cache 30, bind the local IPs, forward to the stub's servers)."""
    cfg = kubedns.read(kube_dns_data)
    ips = [_ip(ip, "local IP") for ip in local_ips]
    if cfg.stub_domains and not ips:
        raise PillarError("stub domains: no local IP to bind their blocks to")
    out = []
    for domain, servers in cfg.stub_domains.items():
        if not servers:
            raise kubedns.KubeDNSError(f"{kubedns.STUB_DOMAINS}: {domain!r}: no nameservers")
        for s in servers:
            if kubedns.server_kind(s) != "ip":
                # node-cache's ValidateNodeLocalCacheConfig (kubernetes/dns#539): forward cannot use it
                raise kubedns.KubeDNSError(f"{kubedns.STUB_DOMAINS}: {domain!r}: {s!r} is a host name; "
                                           "node-cache's forward takes IP addresses (node-cache refuses "
                                           "this ConfigMap)")
        out.append(_STUB_BLOCK.format(domain=domain, port=port, ttl=STUB_CACHE_TTL, local=" ".join(ips),
                                      servers=" ".join(servers)))
    return "".join(out)


def node_cache_corefile(base: str, kube_dns_data: Mapping[str, Any], *, local_ips: list[str],
                        dns_server: str | None, cluster_domain: str, cluster_dns: str | None,
                        port: int = 53) -> str:
    """node-cache's effective Corefile: the base filled, upstreams from the kube-dns ConfigMap,
    its stub-domain blocks appended (configmap.go updateCorefile)."""
    filled = fill(base, local_ips=local_ips, dns_server=dns_server, cluster_domain=cluster_domain,
                  upstream=upstream_from_kube_dns(kube_dns_data), cluster_dns=cluster_dns)
    return filled + stub_blocks(kube_dns_data, local_ips, port=port)
