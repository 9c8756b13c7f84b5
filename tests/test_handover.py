"""clusterdns.handover: which sockets are bound to an address, read from the kernel's tables."""
import socket

import pytest

from clusterdns import handover
from tests.netutil import free_port


def _udp(host, port, family=socket.AF_INET):
    s = socket.socket(family, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind((host, port))
    return s


def test_udp_sockets_sharing_a_port_are_told_apart():
    port = free_port()
    a = _udp("127.0.0.1", port)
    try:
        assert handover.bound_inodes("127.0.0.1", port) == {handover.inode(a)}
        assert not handover.others_on([("127.0.0.1", port)], {handover.inode(a)})
        b = _udp("127.0.0.1", port)
        try:
            assert handover.others_on([("127.0.0.1", port)], {handover.inode(a)})
            assert handover.others_on([("127.0.0.1", port)])
        finally:
            b.close()
        assert not handover.others_on([("127.0.0.1", port)], {handover.inode(a)})
        # the same port on another address is another address
        assert handover.bound_inodes("127.0.0.2", port) == set()
    finally:
        a.close()
    assert handover.bound_inodes("127.0.0.1", port) == set()


def test_tcp_listeners_only_and_ipv6():
    port = free_port()
    t = socket.socket()
    t.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    t.bind(("127.0.0.1", port))
    try:
        assert handover.bound_inodes("127.0.0.1", port, "tcp") == set()   # bound, not listening
        t.listen(1)
        assert handover.bound_inodes("127.0.0.1", port, "tcp") == {handover.inode(t)}
    finally:
        t.close()
    try:
        s6 = _udp("::1", port, socket.AF_INET6)
    except OSError:
        pytest.skip("no IPv6 loopback here")
    try:
        assert handover.bound_inodes("::1", port) == {handover.inode(s6)}
    finally:
        s6.close()


async def test_a_dns_servers_own_sockets_are_not_a_successor():
    """What the agent's lameduck asks: is another process bound where DnsService receives?"""
    from clusterdns.config import load
    from clusterdns.dns.server import DnsService
    from clusterdns.state import StateStore
    port = free_port()
    cfg = load(["dns", "--manifest", "unused.yaml", "--listen", f"127.0.0.1:{port}", "--no-upstream",
                "--metrics-listen", "none", "--health-listen", "none", "--workers", "2"])
    service = DnsService(cfg, StateStore(), reuse_port=True)     # as the agent binds them
    await service.start()
    try:
        ours = {handover.inode(s) for s in service.udp_sockets()}
        assert len(ours) == 2 and handover.bound_inodes("127.0.0.1", port) == ours
        assert not handover.others_on(service.bound, ours)
        successor = _udp("127.0.0.1", port)
        try:
            assert handover.others_on(service.bound, ours)
        finally:
            successor.close()
    finally:
        await service.stop()
