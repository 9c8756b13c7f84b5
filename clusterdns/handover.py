"""Who else listens on our ports: the hand-over between an agent and its successor.

The agent's DNS sockets use SO_REUSEPORT, so during a restart (or a DaemonSet
rollout with maxSurge) two processes can listen on one address. The old process
keeps answering in lameduck until another socket is bound on its DNS addresses;
the new one, when an old one still answers, binds only once it can answer at
once (its first rule sync done). Both read the kernel's socket tables
(/proc/net/udp, udp6, tcp, tcp6 of the process's network namespace); a socket
is "ours" by its inode (the one os.fstat gives for its descriptor).
"""
from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Collection

_LISTEN = "0A"   # TCP_LISTEN in /proc/net/tcp*


def _hex_addr(host: str) -> str:
    """An address as /proc/net/{udp,tcp}{,6} print it (host byte order per 32-bit word)."""
    packed = ipaddress.ip_address(host).packed
    words = [packed[i:i + 4][::-1] for i in range(0, len(packed), 4)]
    return b"".join(words).hex().upper()


def bound_inodes(host: str, port: int, proto: str = "udp") -> set[int]:
    """Inodes of the sockets bound to (host, port): UDP sockets not connected to a peer,
    or TCP listeners. Empty when the tables cannot be read."""
    v6 = ":" in host
    table = f"/proc/self/net/{proto}{'6' if v6 else ''}"
    want = f"{_hex_addr(host)}:{port:04X}"
    out: set[int] = set()
    try:
        with open(table) as f:
            next(f, None)
            for line in f:
                parts = line.split()
                if len(parts) < 10 or parts[1] != want:
                    continue
                if proto == "tcp" and parts[3] != _LISTEN:
                    continue
                if proto == "udp" and not parts[2].endswith(":0000"):
                    continue   # a connected socket (a client), not a listener
                out.add(int(parts[9]))
    except OSError:
        return set()
    out.discard(0)
    return out


def inode(sock: socket.socket) -> int:
    return os.fstat(sock.fileno()).st_ino


def others_on(addresses: list[tuple[str, int]], ours: Collection[int] = (), proto: str = "udp") -> bool:
    """True when every (host, port) has a socket bound that is not one of `ours`."""
    if not addresses:
        return False
    return all(bound_inodes(h, p, proto) - set(ours) for h, p in addresses)
