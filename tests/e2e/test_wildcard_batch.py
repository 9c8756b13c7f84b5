"""A wildcard listener's batched receive loop (recvmmsg/sendmmsg) replies to each query from
the address it was sent to (IP_PKTINFO / IPV6_PKTINFO per datagram), when a burst from many
sockets to two addresses of the node, the receive thread's answers and misses (answered on the
event loop) mixed, arrives in the same batches."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from tests.nslib import Namespaces, requires, run

ROOT = Path(__file__).resolve().parents[2]
DEMO = str(ROOT / "examples" / "demo-cluster.yaml")

# Run inside the node's namespace: 8 sockets bound to loopback each send 24 queries (alternating
# the two addresses, known names and names never asked) before any reply is read; each reply
# must come from the address its query went to and answer its own question.
CLIENT = r"""
import select, socket, sys
import dns.message, dns.rcode
family, addrs, port = int(sys.argv[1]), sys.argv[2].split(","), 53
socks = [socket.socket(family, socket.SOCK_DGRAM) for _ in range(8)]
for s in socks:    # from loopback: the route back would pick loopback's address as the source
    s.bind((addrs[0], 0))
sent = {}
for round in range(3):
    for k, s in enumerate(socks):
        for q in range(8):
            n = len(sent)
            # a memo answer, a first-time NXDOMAIN (both the receive thread's), an outside name
            # (--no-upstream: REFUSED by resolve() on the event loop)
            name = ("testapp-svc.testapp.svc.cluster.local.", f"nosuch{n}.testapp.svc.cluster.local.",
                    f"outside{n}.example.")[n % 3]
            m = dns.message.make_query(name, "A")
            m.id = n
            addr = addrs[n % 2]
            sent[(s.fileno(), m.id)] = (addr, name)
            s.sendto(m.to_wire(), (addr, port))
got, bad = 0, []
deadline = 10.0
while got < len(sent):
    ready, _, _ = select.select(socks, [], [], deadline)
    if not ready:
        break
    for s in ready:
        data, src = s.recvfrom(4096)
        r = dns.message.from_wire(data)
        addr, name = sent[(s.fileno(), r.id)]
        got += 1
        want = {"n": dns.rcode.NXDOMAIN, "o": dns.rcode.REFUSED}.get(name[0], dns.rcode.NOERROR)
        ok = r.question[0].name.to_text() == name and r.rcode() == want and (want or bool(r.answer))
        if src[0] != addr or not ok:
            bad.append((addr, src[0], name, dns.rcode.to_text(r.rcode())))
print(got, len(sent), bad[:5])
sys.exit(0 if got == len(sent) and not bad else 1)
"""


@requires("ip")
@pytest.mark.parametrize("family", ["4", "6"])
def test_a_burst_to_two_addresses_is_answered_from_each_asked_address(family):
    import socket
    with Namespaces("pktb" + family) as nss:
        node = nss.add("node")
        if family == "4":
            listen, addrs, fam = "0.0.0.0:53", "127.0.0.1,169.254.20.10", socket.AF_INET
            run("ip", "addr", "add", "169.254.20.10/32", "dev", "lo", ns=node)
        else:
            listen, addrs, fam = "[::]:53", "::1,fd00:53::53", socket.AF_INET6
            run("ip", "addr", "add", "fd00:53::53/128", "dev", "lo", "nodad", ns=node)
        nss.spawn(node, sys.executable, "-m", "clusterdns", "dns", "--manifest", DEMO, "--listen", listen,
                  "--no-upstream", "--metrics-listen", "none", "--health-listen", "none", cwd=str(ROOT))
        first = addrs.split(",")[0]
        deadline, out = time.monotonic() + 20, ""
        while time.monotonic() < deadline:
            out = run(sys.executable, "-c", "import dns.message, dns.query, sys; "
                      f"print(dns.query.udp(dns.message.make_query('testapp-svc.testapp.svc.cluster.local', 'A'), "
                      f"'{first}', port=53, timeout=0.5))", ns=node).stdout
            if "172.20.36.232" in out:
                break
            time.sleep(0.2)
        assert "172.20.36.232" in out, out
        for _ in range(2):     # the second time the known names come from the memo and whole replies
            r = run(sys.executable, "-c", CLIENT, str(int(fam)), addrs, ns=node)
            assert r.returncode == 0, (r.stdout, r.stderr)
