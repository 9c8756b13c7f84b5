"""Every chain, set and map name the proxier uses, computed in one place.

iptables: KUBE-<KIND>-<16 chars of base32(sha256(...))>. The prefix is at most
10 characters, so names stay within iptables' 28-character chain limit.
nftables: <kind>-<8 chars of base32(sha256(name))>-<name>, the readable name
cut to 237 characters plus "..." when longer than 240, which with the longest
prefix ("endpoint-", 9) stays inside nft's 256-character name limit.
Both are kube-proxy's schemes, so names equal kube-proxy's for the same objects.
"""
from __future__ import annotations

import base64
import hashlib
import struct

# iptables chains (kube-proxy's names)
KUBE_SERVICES = "KUBE-SERVICES"
KUBE_EXTERNAL_SERVICES = "KUBE-EXTERNAL-SERVICES"
KUBE_NODEPORTS = "KUBE-NODEPORTS"
KUBE_POSTROUTING = "KUBE-POSTROUTING"
KUBE_MARK_MASQ = "KUBE-MARK-MASQ"
KUBE_FORWARD = "KUBE-FORWARD"
KUBE_PROXY_FIREWALL = "KUBE-PROXY-FIREWALL"
KUBE_FIREWALL = "KUBE-FIREWALL"
KUBE_PROXY_CANARY = "KUBE-PROXY-CANARY"

SERVICE_CHAIN_PREFIXES = ("KUBE-SVC-", "KUBE-SVL-", "KUBE-EXT-", "KUBE-FW-", "KUBE-SEP-")

# nftables
NFT_TABLE = "kube-proxy"


_ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567"
_TRIPLES = [a + b + c for a in _ALPHABET for b in _ALPHABET for c in _ALPHABET]


def _b32_16(text: str) -> str:
    """The first 16 characters of base32(sha256(text)): exactly the first 10 bytes.

    base64.b32encode is pure Python and dominated large renders; this is the
    same encoding (RFC 4648 alphabet) done with a table of 15-bit triples.
    """
    # the 80 bits as 64 + 16: shifts of machine-size ints, not of one 80-bit int
    hi, lo = _HEAD(_sha256(text.encode("utf-8")).digest())
    t = _TRIPLES
    # one f-string builds the result at once (five + made four throwaway strings): ~9 % of a call
    return (f"{t[hi >> 49]}{t[(hi >> 34) & 32767]}{t[(hi >> 19) & 32767]}{t[(hi >> 4) & 32767]}"
            f"{t[((hi & 15) << 11) | (lo >> 5)]}{_ALPHABET[lo & 31]}")


_HEAD = struct.Struct(">QH").unpack_from
_sha256 = hashlib.sha256


def _b32(text: str) -> str:
    return base64.b32encode(hashlib.sha256(text.encode("utf-8")).digest()).decode("ascii")


def port_proto_hash(port_name: str, protocol: str) -> str:
    """kube-proxy's portProtoHash: 16 base32 chars of sha256(name + lower-case proto)."""
    return _b32_16(port_name + protocol.lower())


def svc_chain(port_name: str, protocol: str) -> str:
    return "KUBE-SVC-" + port_proto_hash(port_name, protocol)


def svl_chain(port_name: str, protocol: str) -> str:
    return "KUBE-SVL-" + port_proto_hash(port_name, protocol)


def ext_chain(port_name: str, protocol: str) -> str:
    return "KUBE-EXT-" + port_proto_hash(port_name, protocol)


def fw_chain(port_name: str, protocol: str) -> str:
    return "KUBE-FW-" + port_proto_hash(port_name, protocol)


def sep_chain(port_name: str, protocol: str, endpoint: str) -> str:
    """endpoint is "IP:port" or "[IPv6]:port"."""
    return "KUBE-SEP-" + _b32_16(port_name + protocol.lower() + endpoint)


def is_service_chain(name: str) -> bool:
    """Per-service chains that a sync may delete when they are no longer used."""
    return name.startswith(SERVICE_CHAIN_PREFIXES)


def hash_and_truncate(name: str) -> str:
    """kube-proxy nftables' hashAndTruncate: 8 hash chars, "-", the name (cut at 240)."""
    prefix = _b32_16(name)[:8]
    if len(name) > 240:
        name = name[:237] + "..."
    return prefix + "-" + name


def nft_service_base(namespace: str, service: str, protocol: str, port_name: str) -> str:
    return hash_and_truncate(f"{namespace}/{service}/{protocol.lower()}/{port_name}")


def nft_endpoint_base(namespace: str, service: str, protocol: str, port_name: str,
                      ip: str, port: int) -> str:
    # colons of IPv6 addresses become dots: nft names must not look like addresses
    return hash_and_truncate(
        f"{namespace}/{service}/{protocol.lower()}/{port_name}__{ip.replace(':', '.')}/{port}")


def nft_service_chain(base: str) -> str:
    return "service-" + base


def nft_local_chain(base: str) -> str:
    return "local-" + base


def nft_external_chain(base: str) -> str:
    return "external-" + base


def nft_firewall_chain(base: str) -> str:
    return "firewall-" + base


def nft_endpoint_chain(ep_base: str) -> str:
    return "endpoint-" + ep_base


def nft_affinity_set(ep_base: str) -> str:
    return "affinity-" + ep_base
