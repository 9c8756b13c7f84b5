"""The answer engine on the demo cluster: zone answers checked with dnspython."""
from __future__ import annotations

import dns.flags
import dns.rcode
import pytest

SERIAL = 1_700_000_001   # tests/dns/conftest.py builds states at this serial

SOA = f"cluster.local. 5 in soa ns.dns.cluster.local. hostmaster.cluster.local. {SERIAL} 7200 1800 86400 5"
SOA_V4 = f"in-addr.arpa. 5 in soa ns.dns.in-addr.arpa. hostmaster.in-addr.arpa. {SERIAL} 7200 1800 86400 5"

# (qname, qtype, rcode, answer, authority, additional)
CASES = [
    ("testapp-svc.testapp.svc.cluster.local", "A", "NOERROR",
     ["testapp-svc.testapp.svc.cluster.local. 5 in a 172.20.36.232"], [], []),
    ("testapp-svc.testapp.svc.cluster.local", "AAAA", "NOERROR", [], [SOA], []),
    ("nope.testapp.svc.cluster.local", "A", "NXDOMAIN", [], [SOA], []),
    ("cluster.local", "SOA", "NOERROR", [SOA], [], []),
    ("dns-version.cluster.local", "TXT", "NOERROR", ['dns-version.cluster.local. 28800 in txt "1.1.0"'], [], []),
    ("232.36.20.172.in-addr.arpa", "PTR", "NOERROR",
     ["232.36.20.172.in-addr.arpa. 5 in ptr testapp-svc.testapp.svc.cluster.local."], [], []),
    ("9.9.9.9.in-addr.arpa", "PTR", "NXDOMAIN", [], [SOA_V4], []),
    ("multiport.testapp.svc.cluster.local", "SRV", "NOERROR",
     ["multiport.testapp.svc.cluster.local. 5 in srv 0 16 443 multiport.testapp.svc.cluster.local.",
      "multiport.testapp.svc.cluster.local. 5 in srv 0 16 53 multiport.testapp.svc.cluster.local.",
      "multiport.testapp.svc.cluster.local. 5 in srv 0 16 80 multiport.testapp.svc.cluster.local."], [],
     ["multiport.testapp.svc.cluster.local. 5 in a 172.20.50.5",
      "multiport.testapp.svc.cluster.local. 5 in aaaa fd00:20::5"]),
]


@pytest.fixture(scope="module")
def engine(demo_state, h):
    assert h.SERIAL == SERIAL
    return h.make_engine(demo_state)


@pytest.mark.parametrize("qname,qtype,rcode,answer,authority,additional", CASES,
                         ids=[f"{c[0]}/{c[1]}" for c in CASES])
def test_demo_answers(engine, h, qname, qtype, rcode, answer, authority, additional):
    m = h.ask(engine, qname, qtype)
    assert dns.rcode.to_text(m.rcode()) == rcode
    assert m.flags & dns.flags.AA and not m.flags & dns.flags.RA
    assert h.lines(m.answer) == sorted(answer)
    assert h.lines(m.authority) == sorted(authority)
    assert h.lines(m.additional) == sorted(additional)
