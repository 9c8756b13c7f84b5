"""The DNS server over real sockets.

Part 1 drives the socket layer (DnsService) with a small engine double, so
the server's own duties are tested alone: fast path vs resolve(), TCP
framing and pipelining, panics, metrics. Part 2 runs the real engine
in-process and as `python3 -m clusterdns dns` subprocesses, queried with
dnspython and dig.
"""
from __future__ import annotations

import asyncio
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import dns.asyncquery
import dns.exception
import dns.flags
import dns.message
import dns.query
import dns.rcode
import dnslib
import pytest
from prometheus_client import generate_latest

from clusterdns.config import load
from clusterdns.dns import metrics
from clusterdns.dns.server import DnsService, error_reply
from clusterdns.metrics import REGISTRY
from clusterdns.state import StateStore
from tests.dns.dnskit import DEMO, RECORDS, FakeUpstream, ServerProcess, closed_port
from tests.netutil import free_port

ROOT = Path(__file__).resolve().parents[2]


class EngineDouble:
    """Answers `fast.*` on the fast path, the rest through resolve()."""

    synced = True

    def __init__(self) -> None:
        self.states = []
        self.clients = []

    def update(self, state, changed=None, since=None) -> None:
        self.states.append(state.version)

    def fast(self, data: bytes, tcp: bool) -> bytes | None:
        name = self._name(data)
        if name and name.startswith("boom."):
            raise RuntimeError("engine bug on the fast path")
        if name and name.startswith("fast."):
            q = dnslib.DNSRecord.parse(data)
            r = q.reply()
            r.add_answer(dnslib.RR(q.q.qname, rdata=dnslib.A("192.0.2.1"), ttl=5))
            return bytes(r.pack())
        return None

    async def resolve(self, data: bytes, client_ip: str, tcp: bool):
        try:
            q = dnslib.DNSRecord.parse(data)
        except Exception:
            return None
        name = str(q.q.qname)
        self.clients.append(client_ip)
        if name.startswith("crash."):
            raise ValueError("engine bug in resolve")
        if name.startswith("slow"):
            await asyncio.sleep(float(name.split(".")[1]) / 1000)
        if name.startswith("xfr.") and tcp:
            out = []
            for i in range(3):
                r = q.reply()
                r.add_answer(dnslib.RR(q.q.qname, dnslib.QTYPE.TXT, rdata=dnslib.TXT(str(i)), ttl=5))
                out.append(bytes(r.pack()))
            return out
        r = q.reply()
        r.add_answer(dnslib.RR(q.q.qname, dnslib.QTYPE.TXT, rdata=dnslib.TXT(name), ttl=5))
        return bytes(r.pack())

    @staticmethod
    def _name(data: bytes) -> str | None:
        try:
            return str(dnslib.DNSRecord.parse(data).q.qname)
        except Exception:
            return None


def cfg_for(*extra: str):
    return load(["dns", "--manifest", "unused.yaml", "--listen", "127.0.0.1:0", "--no-upstream",
                 "--metrics-listen", "none", "--health-listen", "none", *extra])


@pytest.fixture
async def double_server():
    store = StateStore()
    engine = EngineDouble()
    service = DnsService(cfg_for(), store, engine=engine)
    await service.start()
    yield service, engine
    await service.stop()


def addr(service) -> tuple[str, int]:
    return service.bound[0]


async def test_fast_path_and_resolve_over_udp(double_server):
    service, engine = double_server
    host, port = addr(service)
    r = await dns.asyncquery.udp(dns.message.make_query("fast.example.", "A"), host, port=port, timeout=2)
    assert r.answer[0][0].address == "192.0.2.1"
    r = await dns.asyncquery.udp(dns.message.make_query("other.example.", "A"), host, port=port, timeout=2)
    assert r.answer[0][0].strings == (b"other.example.",)
    assert engine.clients == ["127.0.0.1"]


def _skip_without_mmsg() -> None:
    """A test of the batched receive loop runs only where it can: else it would test the other loop."""
    from clusterdns.dns.server import _Mmsg
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        if _Mmsg.make(probe) is None:
            pytest.skip("no recvmmsg/sendmmsg in this C library: the batched receive loop cannot run")


@pytest.mark.parametrize("batched", [True, False])
async def test_a_fast_path_failure_is_servfail_counted_by_either_receive_loop(batched, monkeypatch):
    if not batched:
        monkeypatch.setenv("CLUSTERDNS_RECVMMSG", "0")
    else:
        _skip_without_mmsg()
    service = DnsService(cfg_for(), StateStore(), engine=EngineDouble())
    await service.start()
    try:
        host, port = service.bound[0]
        before = metrics._panics[0]
        r = await dns.asyncquery.udp(dns.message.make_query("boom.example.", "A"), host, port=port, timeout=2)
        assert r.rcode() == dns.rcode.SERVFAIL and metrics._panics[0] == before + 1
        r = await dns.asyncquery.udp(dns.message.make_query("fast.example.", "A"), host, port=port, timeout=2)
        assert r.rcode() == dns.rcode.NOERROR              # the receive thread goes on
        assert _requests_total(port, "udp", "A") == 2      # the failed query counted too
    finally:
        await service.stop()


async def test_engine_follows_the_store(double_server):
    service, engine = double_server
    service.store.mark_synced("Service")
    assert engine.states[-1] == service.store.current.version and len(engine.states) == 2


async def test_panic_answers_servfail_and_server_survives(double_server):
    service, _ = double_server
    host, port = addr(service)
    before = metrics._panics[0]
    for name in ("boom.example.", "crash.example."):
        for query in (dns.asyncquery.udp, dns.asyncquery.tcp):
            r = await query(dns.message.make_query(name, "A"), host, port=port, timeout=2)
            assert r.rcode() == dns.rcode.SERVFAIL and r.question[0].name.to_text() == name
    assert metrics._panics[0] == before + 4
    r = await dns.asyncquery.udp(dns.message.make_query("fast.example.", "A"), host, port=port, timeout=2)
    assert r.rcode() == dns.rcode.NOERROR


async def test_tcp_pipelined_answers_out_of_order(double_server):
    """Several queries on one connection; a slow one does not hold back the others."""
    service, _ = double_server
    host, port = addr(service)
    reader, writer = await asyncio.open_connection(host, port)
    names = ["slow.300.example.", "fast.a.example.", "x.example.", "fast.b.example."]
    ids = {}
    for n in names:
        m = dns.message.make_query(n, "A")
        ids[m.id] = n
        wire = m.to_wire()
        writer.write(struct.pack("!H", len(wire)) + wire)
    await writer.drain()
    got = []
    for _ in names:
        size = struct.unpack("!H", await asyncio.wait_for(reader.readexactly(2), 3))[0]
        r = dns.message.from_wire(await reader.readexactly(size))
        got.append(ids[r.id])
    writer.close()
    assert sorted(got) == sorted(names)
    assert got[-1] == "slow.300.example."        # answered last, the others did not wait


async def test_tcp_multi_message_reply(double_server):
    service, _ = double_server
    host, port = addr(service)
    reader, writer = await asyncio.open_connection(host, port)
    wire = dns.message.make_query("xfr.example.", "TXT").to_wire()
    writer.write(struct.pack("!H", len(wire)) + wire)
    texts = []
    for _ in range(3):
        size = struct.unpack("!H", await asyncio.wait_for(reader.readexactly(2), 3))[0]
        texts.append(dns.message.from_wire(await reader.readexactly(size)).answer[0][0].strings[0])
    writer.close()
    assert texts == [b"0", b"1", b"2"]


async def test_tcp_garbage_and_eof_do_not_hurt(double_server):
    service, _ = double_server
    host, port = addr(service)
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(b"\x00\x05hello\x00")      # a 5-byte "query", then half a length prefix
    writer.close()
    r = await dns.asyncquery.tcp(dns.message.make_query("fast.example.", "A"), host, port=port, timeout=2)
    assert r.rcode() == dns.rcode.NOERROR


async def test_metrics_count_requests(double_server):
    service, _ = double_server
    host, port = addr(service)
    for _ in range(3):
        await dns.asyncquery.udp(dns.message.make_query("fast.example.", "AAAA"), host, port=port, timeout=2)
    await dns.asyncquery.tcp(dns.message.make_query("other.example.", "SRV"), host, port=port, timeout=2)
    text = generate_latest(REGISTRY).decode()
    server = f'server="dns://127.0.0.1:{port}"'
    lines = [ln for ln in text.splitlines() if server in ln]
    assert any(ln.startswith("coredns_dns_requests_total") and 'proto="udp"' in ln and 'type="AAAA"' in ln
               and ln.endswith(" 3.0") for ln in lines)
    assert any(ln.startswith("coredns_dns_requests_total") and 'proto="tcp"' in ln and 'type="SRV"' in ln
               for ln in lines)
    assert any(ln.startswith("coredns_dns_responses_total") and 'rcode="NOERROR"' in ln for ln in lines)
    # Every query is timed, fast-path answers included.
    assert any(ln.startswith("coredns_dns_request_duration_seconds_count") and 'type="SRV"' in ln
               and ln.endswith(" 1.0") for ln in lines)
    assert any(ln.startswith("coredns_dns_request_duration_seconds_count") and 'type="AAAA"' in ln
               and ln.endswith(" 3.0") for ln in lines)
    assert "coredns_build_info" in text and "coredns_panics_total" in text


def test_receive_buffer_is_large():
    from clusterdns.dns.server import _bind
    udp, tcp = _bind("127.0.0.1", 0)
    try:
        assert udp.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) >= 1 << 20
        assert tcp.getsockname()[1] == udp.getsockname()[1]
    finally:
        udp.close()
        tcp.close()


async def test_address_in_use_is_an_oserror_naming_it(double_server):
    service, _ = double_server
    host, port = addr(service)
    other = DnsService(cfg_for("--listen", f"{host}:{port}"), StateStore(), engine=EngineDouble())
    with pytest.raises(OSError, match=f"127.0.0.1:{port}"):
        await other.start()


def test_error_reply_from_raw_bytes():
    q = dnslib.DNSRecord.question("Example.ORG", "MX")
    q.header.rd = 1
    r = dnslib.DNSRecord.parse(error_reply(bytes(q.pack()), 2))
    assert r.header.id == q.header.id and r.header.rcode == 2 and r.header.qr == 1 and r.header.rd == 1
    assert str(r.q.qname) == "Example.ORG." and r.q.qtype == dnslib.QTYPE.MX
    assert error_reply(b"\x01\x02", 2) is None
    assert dnslib.DNSRecord.parse(error_reply(b"\x12\x34" + b"\x00" * 4 + b"\x00" * 6 + b"\x05ab", 1)).header.q == 0


# ---------------------------------------------------------------------------------------
# Part 2: the real engine, in-process and as `python3 -m clusterdns dns`.

HEADLESS_IPS = [f"10.99.{i // 200}.{i % 200 + 1}" for i in range(100)]


def big_headless_manifest() -> str:
    """A headless service with 100 ready endpoints: too big for UDP, whole over TCP."""
    import json
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": [
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "big", "namespace": "testapp"},
         "spec": {"clusterIP": "None", "clusterIPs": ["None"], "ports": [{"name": "http", "port": 80, "protocol": "TCP"}]}},
        {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
         "metadata": {"name": "big-1", "namespace": "testapp", "labels": {"kubernetes.io/service-name": "big"}},
         "addressType": "IPv4", "ports": [{"name": "http", "port": 80, "protocol": "TCP"}],
         "endpoints": [{"addresses": [ip], "conditions": {"ready": True}} for ip in HEADLESS_IPS]},
    ]})


@pytest.fixture(scope="module")
def manifests(tmp_path_factory):
    d = tmp_path_factory.mktemp("manifests")
    big = d / "big.json"
    big.write_text(big_headless_manifest())
    return [str(DEMO), str(big)]


@pytest.fixture(scope="module")
def server(manifests):
    srv = ServerProcess("--manifest", manifests[0], "--manifest", manifests[1], "--no-upstream", http=True)
    yield srv
    srv.stop()


needs_dig = pytest.mark.skipif(shutil.which("dig") is None, reason="dig (bind9-dnsutils) not installed")


@needs_dig
def test_dig_udp_and_tcp(server):
    assert server.dig("+short", "testapp-svc.testapp.svc.cluster.local").split() == ["172.20.36.232"]
    assert server.dig("+short", "+tcp", "TESTAPP-SVC.testapp.svc.cluster.local").split() == ["172.20.36.232"]
    out = server.dig("testapp-svc.testapp.svc.cluster.local")
    assert "status: NOERROR" in out and "flags: qr aa rd" in out and "udp: 1232" in out
    assert "status: NXDOMAIN" in server.dig("nope.testapp.svc.cluster.local")


@needs_dig
def test_dig_default_cookie_answered_without_echoing_it(server):
    # dig sends a COOKIE option by default; we implement no options, so none comes back
    out = server.dig("+qr", "testapp-svc.testapp.svc.cluster.local")
    sent, _, got = out.partition(";; Got answer:")
    assert "; COOKIE:" in sent                       # the query carried one
    assert "status: NOERROR" in got and "COOKIE" not in got and "udp: 1232" in got and "172.20.36.232" in got
    assert "status: NXDOMAIN" in server.dig("+cookie", "nope.testapp.svc.cluster.local")


def test_question_echoed_exactly(server):
    r = server.query("TestApp-Svc.TESTAPP.svc.Cluster.Local.")
    assert r.question[0].name.to_text() == "TestApp-Svc.TESTAPP.svc.Cluster.Local."
    assert r.answer[0][0].address == "172.20.36.232"


def test_truncation_without_edns_with_edns_and_tcp(server):
    name = "big.testapp.svc.cluster.local."
    plain = server.query(name)                                  # no EDNS: 512 bytes
    assert plain.flags & dns.flags.TC and len(plain.to_wire()) <= 512
    edns = server.query(name, use_edns=0, payload=4096)         # offered 4096, we never exceed 1232
    assert edns.flags & dns.flags.TC and len(edns.to_wire()) <= 1232
    assert edns.payload == 1232
    whole = server.query(name, tcp=True)
    assert not whole.flags & dns.flags.TC
    assert sorted(rr.address for rr in whole.answer[0]) == sorted(HEADLESS_IPS)


@needs_dig
def test_dig_retries_truncated_answer_over_tcp(server):
    out = server.dig("+ignore", "+noedns", "big.testapp.svc.cluster.local")
    assert "flags: qr aa tc rd" in out.replace(" ra", "")
    out = server.dig("big.testapp.svc.cluster.local")          # dig falls back to TCP by itself
    assert "ANSWER: 100" in out and "(TCP)" in out


def test_edns_echo_and_badvers(server):
    r = server.query("testapp-svc.testapp.svc.cluster.local.", use_edns=0, payload=4096, want_dnssec=True)
    assert r.edns == 0 and r.payload == 1232 and r.ednsflags & dns.flags.DO
    r = server.query("testapp-svc.testapp.svc.cluster.local.", use_edns=1)
    assert r.rcode() == dns.rcode.BADVERS and not r.answer


def test_tcp_pipelining_with_the_real_engine(server):
    names = ["testapp-svc.testapp.svc.cluster.local.", "kube-dns.kube-system.svc.cluster.local.",
             "nope.testapp.svc.cluster.local.", "big.testapp.svc.cluster.local."] * 3
    with socket.create_connection(("127.0.0.1", server.port), timeout=3) as s:
        wanted = {}
        for n in names:
            m = dns.message.make_query(n, "A")
            wanted[m.id] = n
            w = m.to_wire()
            s.sendall(struct.pack("!H", len(w)) + w)
        buf = b""
        got = {}
        while len(got) < len(names):
            chunk = s.recv(65536)
            assert chunk, "server closed the connection early"
            buf += chunk
            while len(buf) >= 2 and len(buf) >= 2 + struct.unpack("!H", buf[:2])[0]:
                size = struct.unpack("!H", buf[:2])[0]
                r = dns.message.from_wire(buf[2:2 + size])
                buf = buf[2 + size:]
                got[r.id] = r
    assert set(got) == set(wanted)
    for i, r in got.items():
        if wanted[i].startswith("nope"):
            assert r.rcode() == dns.rcode.NXDOMAIN
        else:
            assert r.rcode() == dns.rcode.NOERROR and r.answer


def test_no_upstream_refuses_outside_names(server):
    assert server.query("www.example.org.").rcode() == dns.rcode.REFUSED


def http_get(port: int, path: str) -> tuple[int, str]:
    import urllib.error
    import urllib.request
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=3) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_health_ready_and_metrics_of_the_command(server):
    assert http_get(server.http_port, "/health") == (200, "OK")
    assert http_get(server.http_port, "/ready") == (200, "OK")
    server.query("kube-dns.kube-system.svc.cluster.local.", "SRV")
    status, text = http_get(server.http_port, "/metrics")
    assert status == 200
    srv = f'server="dns://127.0.0.1:{server.port}"'
    counted = [ln for ln in text.splitlines() if ln.startswith("coredns_dns_requests_total") and srv in ln
               and 'type="SRV"' in ln]
    assert counted and float(counted[0].rsplit(" ", 1)[1]) >= 1
    assert "coredns_dns_responses_total" in text and "coredns_dns_request_duration_seconds_bucket" in text


def test_sigterm_lameduck_keeps_answering_then_exits_zero(manifests):
    srv = ServerProcess("--manifest", manifests[0], "--no-upstream", "--lameduck", "1.5", http=True)
    try:
        # DNS answers first and the health listener comes up after it (by design): the
        # lameduck is about a process whose probes are up, so wait for them
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                if http_get(srv.http_port, "/health")[0] == 200:
                    break
            except OSError:
                time.sleep(0.05)
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        assert srv.query("testapp-svc.testapp.svc.cluster.local.").answer   # still answering
        assert http_get(srv.http_port, "/health")[0] == 200
        status, body = http_get(srv.http_port, "/ready")
        assert status == 503 and "lameduck" in body
        assert srv.proc.wait(timeout=5) == 0
    finally:
        srv.stop()


def test_bind_failure_exits_2_with_one_line(server, manifests):
    r = subprocess.run([sys.executable, "-m", "clusterdns", "dns", "--manifest", manifests[0], "--listen",
                        f"127.0.0.1:{server.port}", "--metrics-listen", "none", "--health-listen", "none"],
                       cwd=ROOT, capture_output=True, text=True, timeout=20)
    assert r.returncode == 2
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("clusterdns: cannot listen on 127.0.0.1:") and "in use" in last


def test_unreadable_manifest_exits_2(tmp_path):
    r = subprocess.run([sys.executable, "-m", "clusterdns", "dns", "--manifest", str(tmp_path / "missing.yaml"),
                        "--listen", "127.0.0.1:0", "--metrics-listen", "none", "--health-listen", "none"],
                       cwd=ROOT, capture_output=True, text=True, timeout=20)
    assert r.returncode == 2 and "missing.yaml" in r.stderr


# -- in-process: reload, forwarding through the server, loop detection ------------------------

async def start_inprocess(*args: str, manifest: str | None = None, port: int = 0):
    from clusterdns.sources import loader
    cfg = load(["dns", "--manifest", manifest or str(DEMO), "--listen", f"127.0.0.1:{port}",
                "--metrics-listen", "none", "--health-listen", "none", *args])
    store = StateStore()
    source = loader.make_source(cfg, store)
    source.interval = 0.1
    service = DnsService(cfg, store)
    await service.start()
    task = asyncio.ensure_future(source.run())
    return service, task


async def stop_inprocess(service, task):
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await service.stop()


async def aquery(service, name, rdtype="A", tcp=False, timeout=3.0):
    host, port = service.bound[0]
    q = dns.message.make_query(name, rdtype)
    if tcp:
        return await dns.asyncquery.tcp(q, host, port=port, timeout=timeout)
    return await dns.asyncquery.udp(q, host, port=port, timeout=timeout)


async def test_changed_manifest_is_served_and_broken_one_keeps_last_good(tmp_path, caplog):
    path = tmp_path / "cluster.yaml"
    demo = DEMO.read_text()
    path.write_text(demo)
    service, task = await start_inprocess("--no-upstream", manifest=str(path))
    try:
        new = "newsvc.testapp.svc.cluster.local."
        assert (await aquery(service, new)).rcode() == dns.rcode.NXDOMAIN
        extra = ("\n---\napiVersion: v1\nkind: Service\nmetadata: {name: newsvc, namespace: testapp}\n"
                 "spec: {clusterIP: 172.20.99.99, clusterIPs: [172.20.99.99], ports: [{port: 80, protocol: TCP}]}\n")
        # The demo is a List document; append the new Service as another YAML document.
        path.write_text(demo + extra)
        started = time.monotonic()
        while True:
            r = await aquery(service, new)
            if r.answer:
                break
            assert time.monotonic() - started < 30, "change never served"   # how fast: bench/
            await asyncio.sleep(0.05)
        assert r.answer[0][0].address == "172.20.99.99"
        path.write_text(demo + extra + "\n---\nkind: [unclosed\n")
        # the source reads a file once it is unchanged across two polls
        for _ in range(100):
            if any("keeping the last good state" in rec.getMessage() for rec in caplog.records):
                break
            await asyncio.sleep(0.05)
        assert any("keeping the last good state" in rec.getMessage() for rec in caplog.records)
        r = await aquery(service, new)
        assert r.answer[0][0].address == "172.20.99.99"      # the last good state still serves
    finally:
        await stop_inprocess(service, task)


async def test_forwarding_cache_and_failover_through_the_server():
    up = await FakeUpstream(RECORDS).start()
    service, task = await start_inprocess("--upstream", f"127.0.0.1:{closed_port()}",
                                          "--upstream", f"127.0.0.1:{up.port}")
    try:
        for proto in (False, True, False):
            r = await aquery(service, "www.example.", tcp=proto)
            assert r.rcode() == dns.rcode.NOERROR and r.answer[0][0].address == "192.0.2.1"
        # Loop-probe (HINFO) queries aside, only one query for www reached the upstream: the cache served the rest.
        assert sum(1 for p, n, t in up.received if n == "www.example.") == 1
        r = await aquery(service, "missing.example.")
        assert r.rcode() == dns.rcode.NXDOMAIN
        # Cluster names never reach the upstream.
        await aquery(service, "testapp-svc.testapp.svc.cluster.local.")
        assert all("cluster.local" not in n for _, n, _ in up.received)
    finally:
        await stop_inprocess(service, task)
        await up.stop()


async def test_all_upstreams_down_is_servfail_in_bounded_time():
    service, task = await start_inprocess("--upstream", f"127.0.0.1:{closed_port()}",
                                          "--upstream", f"127.0.0.1:{closed_port()}")
    try:
        # answered before a client gives up (the C library's resolver waits 5 s per try)
        r = await aquery(service, "www.example.", timeout=5.5)
        assert r.rcode() == dns.rcode.SERVFAIL
    finally:
        await stop_inprocess(service, task)


async def test_truncating_upstream_is_retried_over_tcp_and_fitted_to_the_client():
    up = await FakeUpstream(RECORDS, truncate_udp=True).start()
    service, task = await start_inprocess("--upstream", f"127.0.0.1:{up.port}")
    try:
        r = await aquery(service, "big.example.")
        assert r.flags & dns.flags.TC                    # 60 A records do not fit 512 bytes
        r = await aquery(service, "big.example.", tcp=True)
        assert len(r.answer[0]) == 60 and not r.flags & dns.flags.TC
    finally:
        await stop_inprocess(service, task)
        await up.stop()


async def test_forwarding_loop_is_detected_and_the_upstream_disabled(caplog):
    port = free_port()
    service, task = await start_inprocess("--upstream", f"127.0.0.1:{port}", port=port)
    try:
        fwd = service.forwarder
        for _ in range(100):
            if fwd.upstreams[0].looped:
                break
            await asyncio.sleep(0.05)
        assert fwd.upstreams[0].looped
        assert any("forwarding loop detected" in r.getMessage() for r in caplog.records)
        asked = _requests_total(port, "udp", "A")
        r = await aquery(service, "www.example.")
        assert r.rcode() == dns.rcode.SERVFAIL
        assert _requests_total(port, "udp", "A") == asked + 1    # the looped upstream (itself) was not asked
        assert (await aquery(service, "testapp-svc.testapp.svc.cluster.local.")).answer  # still serving
    finally:
        await stop_inprocess(service, task)


def test_stats_stay_bounded_under_odd_traffic():
    """Random types and sizes fold into bounded totals even when nobody scrapes."""
    import random
    stats = metrics.ServerStats("dns://test", 1)
    rnd = random.Random(7)
    started = time.perf_counter()
    for _ in range(30000):
        q = dnslib.DNSRecord.question("x.example", "A")
        q.q.qtype = rnd.randrange(65536)
        data = bytes(q.pack()) + b"\x00" * rnd.randrange(300)
        stats.record(data, data[:2] + b"\x81\x83" + data[4:], rnd.random() < 0.5, started)
    assert len(stats.udp) <= metrics.RAW_LIMIT and len(stats.tcp) <= metrics.RAW_LIMIT
    assert len(stats.durations) <= len(metrics.MONITORED_TYPES) + 1
    stats.fold()
    assert sum(stats.requests.values()) == 30000
    assert len(stats.requests) <= 2 * (len(metrics.MONITORED_TYPES) + 1)
    assert sum(n for (_zone, rcode, _plugin), n in stats.responses.items() if rcode == 3) == 30000


async def test_ipv6_listener():
    try:
        s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
        s.bind(("::1", 0))
        s.close()
    except OSError:
        pytest.skip("no IPv6 loopback in this environment")
    service = DnsService(load(["dns", "--manifest", "x", "--listen", "[::1]:0", "--no-upstream"]),
                         StateStore(), engine=EngineDouble())
    await service.start()
    try:
        host, port = service.bound[0]
        assert host == "::1"
        for query in (dns.asyncquery.udp, dns.asyncquery.tcp):
            r = await query(dns.message.make_query("fast.example.", "A"), "::1", port=port, timeout=2)
            assert r.answer[0][0].address == "192.0.2.1"
            # through resolve(): the reply goes back to the IPv6 client's address
            r = await query(dns.message.make_query("other.example.", "A"), "::1", port=port, timeout=2)
            assert r.answer[0][0].strings == (b"other.example.",)
    finally:
        await service.stop()


async def test_idle_tcp_connection_is_closed(double_server, monkeypatch):
    from clusterdns.dns import server as server_mod
    monkeypatch.setattr(server_mod, "TCP_IDLE_TIMEOUT", 0.3)
    service, _ = double_server
    host, port = addr(service)
    conns = [await asyncio.open_connection(host, port) for _ in range(2)]
    conns[1][1].write(b"\x00")                 # half a length prefix, then nothing: idle too
    for r, w in conns:                                                 # idle ones closed after 0.3 s
        assert await asyncio.wait_for(r.read(1), 3) == b""
        w.close()
    r = await dns.asyncquery.tcp(dns.message.make_query("fast.example.", "A"), host, port=port, timeout=2)
    assert r.rcode() == dns.rcode.NOERROR


async def _tcp_ask(reader, writer, name: str, timeout: float = 3) -> dns.message.Message:
    wire = dns.message.make_query(name, "A").to_wire()
    writer.write(struct.pack("!H", len(wire)) + wire)
    await writer.drain()
    size = struct.unpack("!H", await asyncio.wait_for(reader.readexactly(2), timeout))[0]
    return dns.message.from_wire(await asyncio.wait_for(reader.readexactly(size), timeout))


async def _closed(reader, timeout: float = 2) -> bool:
    try:
        return await asyncio.wait_for(reader.read(1), timeout) == b""
    except ConnectionError:
        return True


async def test_full_tcp_slots_evict_the_oldest_idle_connection():
    """With every slot held, a new client gets in and the connection idle the longest goes
    (not the new one); busy connections (answers in flight) are never evicted."""
    service = DnsService(cfg_for("--tcp-max-connections", "2"), StateStore(), engine=EngineDouble())
    await service.start()
    host, port = service.bound[0]
    opened = []
    try:
        c1 = await asyncio.open_connection(host, port)
        c2 = await asyncio.open_connection(host, port)
        opened += [c1, c2]
        assert (await _tcp_ask(*c1, "fast.1.example.")).rcode() == dns.rcode.NOERROR
        await asyncio.sleep(0.05)
        assert (await _tcp_ask(*c2, "fast.2.example.")).rcode() == dns.rcode.NOERROR
        c3 = await asyncio.open_connection(host, port)               # c1 idle the longest: closed
        opened.append(c3)
        assert (await _tcp_ask(*c3, "fast.3.example.")).rcode() == dns.rcode.NOERROR
        assert await _closed(c1[0])
        assert (await _tcp_ask(*c2, "fast.2b.example.")).rcode() == dns.rcode.NOERROR
        # both slots busy: a slow answer in flight on each; the next client is refused
        slow = []
        for reader, writer in (c2, c3):
            wire = dns.message.make_query("slow.800.example.", "A").to_wire()
            writer.write(struct.pack("!H", len(wire)) + wire)
            await writer.drain()
            slow.append(reader)
        await asyncio.sleep(0.1)
        c4 = await asyncio.open_connection(host, port)
        opened.append(c4)
        assert await _closed(c4[0])
        for reader in slow:                                          # their answers still come
            size = struct.unpack("!H", await asyncio.wait_for(reader.readexactly(2), 3))[0]
            r = dns.message.from_wire(await reader.readexactly(size))
            assert r.question[0].name.to_text() == "slow.800.example."
        # many clients through 2 slots, one after the other: each is answered
        for i in range(8):
            c = await asyncio.open_connection(host, port)
            opened.append(c)
            assert (await _tcp_ask(*c, f"fast.n{i}.example.")).rcode() == dns.rcode.NOERROR
        assert len(service._tcp_conns) <= 2
    finally:
        for _, w in opened:
            w.close()
        await service.stop()


async def _udp_burst(host: str, port: int, n: int, name: str = "fast.example.", clients: int = 16) -> int:
    """n queries from `clients` sockets (different source ports), every answer awaited."""
    loop = asyncio.get_running_loop()

    def burst() -> int:
        answered = 0
        socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(clients)]
        try:
            for s in socks:
                s.settimeout(2)
            wire = dns.message.make_query(name, "A").to_wire()
            for i in range(n):
                s = socks[i % clients]
                s.sendto(wire, (host, port))
                if s.recvfrom(4096)[0][:2] == wire[:2]:
                    answered += 1
        finally:
            for s in socks:
                s.close()
        return answered

    return await loop.run_in_executor(None, burst)


def _requests_total(port: int, proto: str, qtype: str) -> float:
    text = generate_latest(REGISTRY).decode()
    want = f'server="dns://127.0.0.1:{port}"'
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
               if ln.startswith("coredns_dns_requests_total{") and want in ln and f'proto="{proto}"' in ln
               and f'type="{qtype}"' in ln)


@pytest.mark.parametrize("workers,batched", [(1, True), (3, True), (1, False), (3, False)])
async def test_udp_receive_threads_answer_and_count_exactly_at_scrape(workers, batched, monkeypatch):
    """Answers come from receive threads (one per SO_REUSEPORT socket with --workers), batched
    (recvmmsg/sendmmsg) or one datagram per call; a scrape right after the last answer counts
    every query, also those still held by a thread."""
    if not batched:
        monkeypatch.setenv("CLUSTERDNS_RECVMMSG", "0")
    else:
        _skip_without_mmsg()
    service = DnsService(cfg_for("--workers", str(workers)), StateStore(), engine=EngineDouble())
    await service.start()
    try:
        host, port = service.bound[0]
        assert len(service._receivers) == workers
        # an oversized datagram is dropped, the thread goes on
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as junk:
            junk.sendto(b"\x12\x34" + b"\x00" * 5000, (host, port))
        assert all(r.thread.is_alive() for r in service._receivers)
        answered = await _udp_burst(host, port, 600)
        assert answered == 600
        assert _requests_total(port, "udp", "A") == 600
        # a miss goes to resolve() on the loop and is answered from there
        r = await dns.asyncquery.udp(dns.message.make_query("other.example.", "A"), host, port=port, timeout=2)
        assert r.answer[0][0].strings == (b"other.example.",)
        assert await _udp_burst(host, port, 100) == 100
        assert _requests_total(port, "udp", "A") == 701
    finally:
        await service.stop()
    assert not any(r.thread.is_alive() for r in service._receivers or [])


async def test_a_batch_with_misses_answers_each_sender_its_own_question(monkeypatch):
    """One recvmmsg batch of queries from different sockets, fast-path answers and misses
    (resolve() on the loop) mixed: every sender gets the answer to its own question, in this
    batch and in the next (whose replies all go where their datagrams came from)."""
    _skip_without_mmsg()
    from clusterdns.dns.server import _Mmsg
    batches: list[int] = []
    receive = _Mmsg.receive

    def spy(self) -> int:
        got = receive(self)
        batches.append(got)
        return got
    monkeypatch.setattr(_Mmsg, "receive", spy)
    service = DnsService(cfg_for(), StateStore(), engine=EngineDouble())
    await service.start()
    loop = asyncio.get_running_loop()
    socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(12)]
    try:
        host, port = service.bound[0]

        def exchange(names: list[str], hold: bool) -> list[dns.message.Message]:
            for s in socks:
                s.settimeout(3)
            if hold:   # the thread takes the first datagram and waits for the lock: the rest queue up
                service.engine_lock.acquire()
            try:
                for s, name in zip(socks, names):
                    s.sendto(dns.message.make_query(name, "A").to_wire(), (host, port))
                    if hold and s is socks[0]:
                        time.sleep(0.2)
                time.sleep(0.1)
            finally:
                if hold:
                    service.engine_lock.release()
            return [dns.message.from_wire(s.recvfrom(4096)[0]) for s in socks[:len(names)]]

        for hold, names in ((True, [f"{'fast' if i % 3 else 'slow.1'}.n{i}.example." for i in range(12)]),
                            (True, [f"fast.m{i}.example." for i in range(12)])):
            replies = await loop.run_in_executor(None, exchange, names, hold)
            for name, r in zip(names, replies):
                assert r.question[0].name.to_text() == name
                if name.startswith("fast."):
                    assert r.answer[0][0].address == "192.0.2.1"
                else:
                    assert r.answer[0][0].strings == (name.encode(),)
        assert max(batches) >= 11, batches     # the queued datagrams came in one batch
    finally:
        for s in socks:
            s.close()
        await service.stop()


async def test_stop_ends_the_receive_threads_and_keeps_their_counts():
    service = DnsService(cfg_for("--workers", "2"), StateStore(), engine=EngineDouble())
    await service.start()
    receivers = list(service._receivers)
    host, port = service.bound[0]
    assert await _udp_burst(host, port, 50) == 50
    await service.stop()
    assert receivers and not any(r.thread.is_alive() for r in receivers)
    assert _requests_total(port, "udp", "A") == 50


def test_workers_flag_is_validated():
    from clusterdns.config import ConfigError
    with pytest.raises(ConfigError, match="--workers"):
        cfg_for("--workers", "0")
    with pytest.raises(ConfigError, match="--tcp-max-connections"):
        cfg_for("--tcp-max-connections", "0")


def _metric(text: str, name: str) -> float:
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(name + " ")
               or ln.startswith(name + "{"))


def test_clients_resetting_with_pipelined_queries_are_not_panics(server):
    """Clients that send many pipelined queries and reset the connection at once (the server
    then writes answers to a transport uvloop has closed): no panic, no traceback, and the
    server keeps answering over TCP."""
    import urllib.request
    url = f"http://127.0.0.1:{server.http_port}/metrics"
    before = _metric(urllib.request.urlopen(url, timeout=5).read().decode(), "coredns_panics_total")
    names = ["testapp-svc.testapp.svc.cluster.local.", "big.testapp.svc.cluster.local.",
             "missing.testapp.svc.cluster.local.", "_http._tcp.big.testapp.svc.cluster.local."]
    batch = b""
    for i in range(200):
        wire = dns.message.make_query(names[i % len(names)], "SRV" if names[i % len(names)][0] == "_" else "A").to_wire()
        batch += struct.pack("!H", len(wire)) + wire
    for _ in range(300):
        s = socket.create_connection(("127.0.0.1", server.port), timeout=2)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))   # close = RST
        s.sendall(batch)
        s.recv(2)            # the server is now writing answers: reset under it
        s.close()
    time.sleep(0.5)
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    assert _metric(text, "coredns_panics_total") == before
    r = server.query("testapp-svc.testapp.svc.cluster.local.", tcp=True)
    assert r.answer[0][0].address == "172.20.36.232"


class OneAtATimeEngine(EngineDouble):
    """Records whether two threads were ever inside the engine at once (the engine's memos
    are not thread-safe); the sleeps let another thread run in the middle if it may."""

    def __init__(self) -> None:
        super().__init__()
        self.inside = 0
        self.overlaps = 0
        self.calls = 0

    def _enter(self) -> None:
        self.inside += 1
        self.calls += 1
        if self.inside > 1:
            self.overlaps += 1
        time.sleep(0.0002)

    def fast(self, data: bytes, tcp: bool) -> bytes | None:
        self._enter()
        try:
            return super().fast(data, tcp)
        finally:
            self.inside -= 1

    async def resolve(self, data: bytes, client_ip: str, tcp: bool):
        self._enter()
        self.inside -= 1
        await asyncio.sleep(0)          # suspended: other threads may use the engine meanwhile
        self._enter()
        try:
            return await super().resolve(data, client_ip, tcp)
        finally:
            self.inside -= 1


async def test_engine_is_never_entered_by_two_threads_at_once():
    engine = OneAtATimeEngine()
    service = DnsService(cfg_for("--workers", "3"), StateStore(), engine=engine)
    await service.start()
    try:
        host, port = service.bound[0]

        async def tcp_and_slow() -> int:
            ok = 0
            for i in range(40):
                r = await dns.asyncquery.tcp(dns.message.make_query(f"fast.t{i}.example.", "A"), host,
                                             port=port, timeout=3)
                r2 = await dns.asyncquery.udp(dns.message.make_query(f"other{i}.example.", "A"), host,
                                              port=port, timeout=3)
                ok += r.rcode() == dns.rcode.NOERROR and r2.rcode() == dns.rcode.NOERROR
            return ok

        answered = await asyncio.gather(_udp_burst(host, port, 300), _udp_burst(host, port, 300), tcp_and_slow())
        assert answered == [300, 300, 40]
        assert engine.calls >= 720 and engine.overlaps == 0
    finally:
        await service.stop()


async def test_locked_coroutine_returns_raises_and_is_cancelled_with_the_lock_free():
    import threading

    from clusterdns.dns.server import _Locked
    lock = threading.Lock()
    seen = []

    async def work(x):
        seen.append(lock.locked())
        await asyncio.sleep(0.01)
        seen.append(lock.locked())
        if x == "raise":
            raise KeyError(x)
        if x == "wait":
            await asyncio.sleep(10)
        return x * 2

    assert await _Locked(work(21), lock) == 42
    assert seen == [True, True] and not lock.locked()
    with pytest.raises(KeyError):
        await _Locked(work("raise"), lock)
    task = asyncio.ensure_future(_Locked(work("wait"), lock))
    await asyncio.sleep(0.05)
    assert not lock.locked()            # suspended: the lock is free for the receive threads
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not lock.locked()


async def test_stop_answers_queries_queued_after_the_receive_thread_ended():
    """A query the kernel queued on the socket while the server stops (with SO_REUSEPORT a
    successor already shares the address) is answered before the socket closes, not lost."""
    service = DnsService(cfg_for(), StateStore(), engine=EngineDouble())
    await service.start()
    host, port = addr(service)
    client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    client.settimeout(3)
    try:
        for r in service._receivers:       # the receive threads end first, as in stop()
            r.stopping = True
            await asyncio.get_running_loop().run_in_executor(None, r.stop)
            assert not r.thread.is_alive()
        q = dns.message.make_query("fast.example.", "A")
        client.sendto(q.to_wire(), (host, port))
        await asyncio.sleep(0.1)           # queued: nothing reads the socket now
        before = _requests_total(port, "udp", "A")
        await service.stop()
        data, _ = client.recvfrom(512)
        assert dns.message.from_wire(data).answer[0][0].address == "192.0.2.1"
        assert _requests_total(port, "udp", "A") == before + 1     # counted, as the loops count
    finally:
        client.close()
