"""A DNS listener on a wildcard address replies from the address each query was sent to
(IP_PKTINFO), as CoreDNS does: a client that asked a secondary address of the node (a
NodeLocal address, a kube-dns ClusterIP held locally) drops a reply from any other."""
from __future__ import annotations

import sys
import time
from pathlib import Path

from tests.nslib import Namespaces, requires, run

ROOT = Path(__file__).resolve().parents[2]
DEMO = str(ROOT / "examples" / "demo-cluster.yaml")
NAME = "testapp-svc.testapp.svc.cluster.local"


@requires("ip", "dig")
def test_wildcard_listener_replies_from_the_asked_address():
    with Namespaces("pkt") as nss:
        node = nss.add("node")
        run("ip", "addr", "add", "169.254.20.10/32", "dev", "lo", ns=node)
        nss.spawn(node, sys.executable, "-m", "clusterdns", "dns", "--manifest", DEMO, "--listen", "0.0.0.0:53",
                  "--no-upstream", "--metrics-listen", "none", "--health-listen", "none", cwd=str(ROOT))
        deadline = time.monotonic() + 20
        out = ""
        while time.monotonic() < deadline:
            # the client's own address is 127.0.0.1: the route back is lo's, whose source the
            # kernel would pick as 127.0.0.1, not the address asked
            r = run("dig", "+time=1", "+tries=1", "-b", "127.0.0.1", "@169.254.20.10", NAME, "A", ns=node)
            out = r.stdout
            if "172.20.36.232" in out:
                break
            time.sleep(0.2)
        assert "172.20.36.232" in out, out
        assert "reply from unexpected source" not in out
        assert "SERVER: 169.254.20.10#53" in out
        # the slow path (a name the memo has not seen, answered on the event loop) too
        r = run("dig", "+time=2", "+tries=1", "-b", "127.0.0.1", "@169.254.20.10", "nosuch.testapp.svc.cluster.local",
                ns=node)
        assert "status: NXDOMAIN" in r.stdout and "unexpected source" not in r.stdout, r.stdout
        r = run("dig", "+time=2", "+tries=1", "-b", "127.0.0.1", "@169.254.20.10", "example.com", ns=node)
        assert "status: REFUSED" in r.stdout and "unexpected source" not in r.stdout, r.stdout


@requires("ip", "dig")
def test_a_corefile_block_without_bind_listens_on_every_ipv4_and_ipv6_address(tmp_path):
    """`.:53` without bind is CoreDNS's `:53`: IPv6 too (::1, a veth's addresses), each reply from
    the address asked (IPV6_PKTINFO), over UDP (memo and event loop) and TCP."""
    corefile = tmp_path / "Corefile"
    corefile.write_text(".:53 {\n    kubernetes cluster.local in-addr.arpa ip6.arpa\n}\n")
    with Namespaces("pkt6") as nss:
        node, client = nss.add("node"), nss.add("client")
        nss.veth(node, "vn", client, "vc")
        for ns, dev, addrs in ((node, "vn", ["fd00:53::1/64", "fd00:53::53/64", "10.53.0.1/24", "10.53.0.53/24"]),
                               (client, "vc", ["fd00:53::2/64", "10.53.0.2/24"])):
            for a in addrs:
                run("ip", "addr", "add", a, "dev", dev, *(["nodad"] if ":" in a else []), ns=ns)
        nss.spawn(node, sys.executable, "-m", "clusterdns", "dns", "--corefile", str(corefile), "--manifest", DEMO,
                  cwd=str(ROOT))
        deadline, out = time.monotonic() + 30, ""
        while time.monotonic() < deadline:
            out = run("dig", "+time=1", "+tries=1", "@::1", NAME, "A", ns=node).stdout
            if "172.20.36.232" in out:
                break
            time.sleep(0.2)
        assert "172.20.36.232" in out, out
        for server in ("fd00:53::1", "fd00:53::53", "10.53.0.1", "10.53.0.53"):
            for extra in ([], ["+tcp"]):
                r = run("dig", "+time=2", "+tries=1", *extra, f"@{server}", NAME, "A", ns=client)
                assert "172.20.36.232" in r.stdout and "unexpected source" not in r.stdout, (server, extra, r.stdout)
                assert f"SERVER: {server}#53" in r.stdout, r.stdout
            # a name the memo has not seen: answered from the event loop, from the same address
            r = run("dig", "+time=2", "+tries=1", f"@{server}", f"nosuch{len(server)}.testapp.svc.cluster.local",
                    ns=client)
            assert "status: NXDOMAIN" in r.stdout and "unexpected source" not in r.stdout, (server, r.stdout)
