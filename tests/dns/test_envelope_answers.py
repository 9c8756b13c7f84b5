"""A headless Service of thousands of endpoints in slices of 100 (as the EndpointSlice
controller cuts them), served by `clusterdns dns --manifest` and asked with dnspython and
dig over real sockets.

As CoreDNS (request.Scrub, then miekg/dns Msg.Truncate): every reply is fitted to what its
transport carries, 1232 bytes over UDP with EDNS (the Flag Day size, whatever the client
offers), 512 without, 65535 over TCP; records are dropped from the end (answer first kept,
glue last) and TC is set whenever one was left out, over TCP too. So 5,000 A records
(16 bytes each, 80 KB) are TC over TCP with as many as fit, 4,000 come whole.
"""
from __future__ import annotations

import json
import subprocess

import dns.flags
import dns.message
import dns.query
import dns.rcode
import dns.rdatatype
import pytest

from clusterdns.synthetic import envelope_records, to_manifest
from tests.dns.dnskit import ServerProcess

NAME = "big-headless.ns-0.svc.cluster.local."
SRV = "_http._tcp." + NAME


@pytest.fixture(scope="module", params=[5000, 4000])
def served(request, tmp_path_factory):
    big = request.param
    path = tmp_path_factory.mktemp("envelope") / "cluster.json"
    records = envelope_records(services=20, endpoints=2 * big + 180, big=big, headless=2)
    path.write_text(to_manifest(records))
    addresses = {e.addresses[0] for k, r in records if k == "EndpointSlice" and r.service == "big-headless"
                 for e in r.endpoints}
    assert len(addresses) == big
    server = ServerProcess("--manifest", str(path), "--no-upstream")
    yield server, addresses
    server.stop()


def ask(server: ServerProcess, name: str, rdtype: str, tcp: bool = False, **kw) -> dns.message.Message:
    """As server.query, with time for a loaded machine (a big answer's first build is seconds there)."""
    q = dns.message.make_query(name, rdtype, **kw)
    send = dns.query.tcp if tcp else dns.query.udp
    return send(q, "127.0.0.1", port=server.port, timeout=30)


def _a(m: dns.message.Message) -> list[str]:
    return [rd.address for rrset in m.answer if rrset.rdtype == dns.rdatatype.A for rd in rrset]


def _fits_no_more(m: dns.message.Message, limit: int, smallest: int) -> bool:
    return len(m.to_wire(max_size=70000)) + smallest > limit


@pytest.mark.parametrize("transport", ["udp-edns", "udp", "tcp"])
def test_a_answers_fill_what_the_transport_carries(served, transport):
    server, addresses = served
    kw = {"udp-edns": {"use_edns": 0, "payload": 4096}, "udp": {}, "tcp": {"tcp": True, "use_edns": 0}}[transport]
    limit = {"udp-edns": 1232, "udp": 512, "tcp": 65535}[transport]
    m = ask(server, NAME, "A", **kw)
    got = _a(m)
    assert m.rcode() == dns.rcode.NOERROR
    assert len(got) == len(set(got)) and set(got) <= addresses
    assert len(m.to_wire(max_size=70000)) <= limit
    if len(got) < len(addresses):
        assert m.flags & dns.flags.TC
        assert _fits_no_more(m, limit, 16), "TC although another A record would have fitted"
    else:
        assert transport == "tcp" and not m.flags & dns.flags.TC
    if transport == "tcp":
        # 4,000 records fit in 65535 bytes (64 KB of 16-byte records), 5,000 do not
        assert (len(got) == len(addresses)) == (len(addresses) == 4000)


@pytest.mark.parametrize("transport", ["udp-edns", "tcp"])
def test_srv_answers_fill_what_the_transport_carries(served, transport):
    server, addresses = served
    tcp = transport == "tcp"
    m = ask(server, SRV, "SRV", tcp=tcp, use_edns=0, payload=4096)
    limit = 65535 if tcp else 1232
    targets = [(rd.target.to_text(), rd.port) for rrset in m.answer for rd in rrset]
    assert targets and all(port == 8080 and t.endswith("." + NAME) for t, port in targets)
    ips = [t.split(".", 1)[0].replace("-", ".") for t, _ in targets]
    assert len(ips) == len(set(ips)) and set(ips) <= addresses
    glue = {rrset.name.to_text(): [rd.address for rd in rrset] for rrset in m.additional
            if rrset.rdtype == dns.rdatatype.A}
    assert all(glue[t] == [t.split(".", 1)[0].replace("-", ".")] for t in glue)
    assert set(glue) <= {t for t, _ in targets}
    assert len(m.to_wire(max_size=70000)) <= limit
    # the SRV records of 4,000 or 5,000 endpoints alone are more than 64 KB: cut in the answer
    # section, no glue after it (miekg/dns: nothing is added once a record did not fit)
    assert m.flags & dns.flags.TC and not glue
    # the smallest SRV record here: owner pointer, fixed fields, and the target written out
    # whole (SRV targets are never compressed, RFC 2782/3597): a dashed address label of at
    # least 7 characters and the Service's name (37 bytes)
    assert _fits_no_more(m, limit, 2 + 10 + 6 + 8 + 37), "TC although another record would have fitted"


def test_dig_sees_tc_over_udp_and_the_records_over_tcp(served):
    server, addresses = served
    udp = server.dig(NAME, "A", "+ignore", "+bufsize=1232")
    assert " tc" in udp.split("flags:")[1].split(";")[0] and "MSG SIZE  rcvd: 1232" in udp
    tcp = server.dig(NAME, "A", "+tcp", "+nocmd")
    got = [p[4] for p in map(str.split, tcp.splitlines()) if len(p) == 5 and p[0] == NAME and p[3] == "A"]
    assert len(got) >= 4000 and len(got) == len(set(got)) and set(got) <= addresses
    size = int(tcp.split("MSG SIZE  rcvd:")[1].split()[0])
    if len(addresses) == 4000:
        assert len(got) == 4000 and " tc" not in tcp.split("flags:")[1].split(";")[0]
    else:
        assert " tc" in tcp.split("flags:")[1].split(";")[0] and size <= 65535 < size + 16


def test_manifest_reload_changes_the_answers(served, tmp_path):
    """The same names after a one-endpoint change of the file: the new address answers, the old is gone."""
    server, addresses = served
    path = server.argv[server.argv.index("--manifest") + 1]
    doc = json.loads(open(path).read())
    sl = next(it for it in doc["items"] if it["kind"] == "EndpointSlice"
              and it["metadata"]["name"] == "big-headless-017")
    old = sl["endpoints"][3]["addresses"][0]
    sl["endpoints"][3]["addresses"] = ["10.250.0.1"]
    tmp = tmp_path / "new.json"
    tmp.write_text(json.dumps(doc))
    subprocess.run(["cp", str(tmp), path + ".tmp"], check=True)
    subprocess.run(["mv", path + ".tmp", path], check=True)
    import time
    deadline = time.monotonic() + 30
    while True:
        m = ask(server, "10-250-0-1." + NAME, "A")
        if m.rcode() == dns.rcode.NOERROR:
            break
        assert time.monotonic() < deadline, "the change was not served"
        time.sleep(0.1)
    assert _a(m) == ["10.250.0.1"]
    assert ask(server, old.replace(".", "-") + "." + NAME, "A").rcode() == dns.rcode.NXDOMAIN
    got = _a(ask(server, NAME, "A", tcp=True, use_edns=0))
    assert old not in got and set(got) <= (addresses - {old}) | {"10.250.0.1"}
    addresses.discard(old)
    addresses.add("10.250.0.1")
