"""whoami and nsid (AKS LocalDNS's Corefile uses both), over real sockets, pinned to CoreDNS's
whoami_test.go / nsid_test.go: whoami answers with the client's address and port in the
additional section; nsid puts its data in the OPT only when the query asks for it."""
from __future__ import annotations

import dns.edns
import dns.flags
import dns.rdatatype

from tests.corefile.cfserve import CorefileServer

TEXT = """health-check.localdns.local:{PORT} {
    bind 127.0.0.1
    whoami
}
cluster.local:{PORT} {
    bind 127.0.0.1
    nsid localdns
    kubernetes
}
"""


async def test_whoami_answers_the_clients_address_and_port(tmp_path):
    async with CorefileServer(TEXT, tmp_path) as s:
        for name, tcp in (("health-check.localdns.local", False), ("HEALTH-check.localdns.local", True)):
            r = await s.ask(name, "A", tcp=tcp)
            assert r.rcode() == 0 and r.flags & dns.flags.AA and not r.answer
            extra = {rrset.rdtype: rrset for rrset in r.additional}
            a, srv = extra[dns.rdatatype.A], extra[dns.rdatatype.SRV]
            assert a[0].address == "127.0.0.1" and a.ttl == 0
            assert srv.name.to_text().lower() == ("_tcp." if tcp else "_udp.") + name.lower() + "."
            assert 0 < srv[0].port < 65536 and srv[0].target.to_text() == "."


async def test_nsid_is_returned_when_the_query_asks(tmp_path):
    async with CorefileServer(TEXT, tmp_path) as s:
        name = "testapp-svc.testapp.svc.cluster.local"
        r = await s.ask(name, "A", use_edns=0, options=[dns.edns.GenericOption(dns.edns.NSID, b"")])
        assert [o.nsid for o in r.options if o.otype == dns.edns.NSID] == [b"localdns"]
        assert [rd.to_text() for rs in r.answer for rd in rs] == ["172.20.36.232"]
        r = await s.ask(name, "A", use_edns=0)
        assert not [o for o in r.options if o.otype == dns.edns.NSID]
        assert [rd.to_text() for rs in r.answer for rd in rs] == ["172.20.36.232"]
