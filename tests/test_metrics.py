"""The series the stock dashboards read, produced by the real parts (unit level; the
real-Prometheus test is tests/test_prometheus.py)."""
from __future__ import annotations

import asyncio
import contextlib
from urllib.parse import urlsplit

import pytest

from clusterdns import metrics
from clusterdns.config import load
from clusterdns.sources.kube import KubeSource
from clusterdns.state import StateStore
from tests.common import eventually, sample
from tests.fakeapi import FakeAPIServer, namespace, service


async def test_rest_client_series_count_every_api_request(tmp_path):
    """rest_client_requests_total{code,method,host} and rest_client_request_duration_seconds{verb,host}
    as client-go exports them: one count per request, 5xx and failed connections included."""
    api = FakeAPIServer().start()
    api.add(namespace("testapp"))
    api.add(service("testapp", "a", "10.0.0.1"))
    host = urlsplit(api.url).netloc
    cfg = load(["agent", "--kubeconfig", api.write_kubeconfig(tmp_path / "kubeconfig")], env={})
    before = {code: sample("rest_client_requests_total", code=code, method="GET", host=host)
              for code in ("200", "500", "<error>")}
    count_before = sample("rest_client_request_duration_seconds_count", verb="GET", host=host)
    api.fail_next("services", 500)
    src = KubeSource(cfg, StateStore(), watch_timeout=5, backoff_initial=0.02, backoff_max=0.2)
    task = asyncio.create_task(src.run())
    try:
        await asyncio.wait_for(src.synced.wait(), 10)
        after = lambda code: sample("rest_client_requests_total", code=code, method="GET", host=host) - before[code]
        assert after("500") == 1
        # every list, and every watch once its stream started
        await eventually(lambda: after("200") >= len(src.resources) * 2, what="list and watch requests")
        api.stop()                       # the API server goes away: requests fail without a response
        api.drop_watches()
        await eventually(lambda: after("<error>") >= 1, what="a failed request")
        total = sum(after(c) for c in before)
        count = sample("rest_client_request_duration_seconds_count", verb="GET", host=host) - count_before
        assert count == total
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        api.close()


# ---------------------------------------------------------------- DNS (the real server, engine and forwarder)

class Upstream(asyncio.DatagramProtocol):
    """A real UDP DNS server on loopback: A 192.0.2.1 for every name, RA set as recursors do."""

    def connection_made(self, transport):
        self.transport = transport

    def datagram_received(self, data, addr):
        import dnslib
        q = dnslib.DNSRecord.parse(data)
        r = q.reply(ra=1, aa=0)
        if q.q.qtype == dnslib.QTYPE.A:
            r.add_answer(dnslib.RR(q.q.qname, dnslib.QTYPE.A, rdata=dnslib.A("192.0.2.1"), ttl=300))
        self.transport.sendto(r.pack(), addr)


@contextlib.asynccontextmanager
async def dns_service(*args: str):
    from clusterdns.dns.server import DnsService
    from clusterdns.sources import loader
    from clusterdns.sources.manifest import DEMO_MANIFEST
    loop = asyncio.get_running_loop()
    up, _ = await loop.create_datagram_endpoint(Upstream, local_addr=("127.0.0.1", 0))
    cfg = load(["dns", "--manifest", str(DEMO_MANIFEST), "--listen", "127.0.0.1:0", "--metrics-listen", "none",
                "--health-listen", "none", "--upstream", f"127.0.0.1:{up.get_extra_info('sockname')[1]}",
                *args], env={})
    store = StateStore()
    source = loader.make_source(cfg, store)
    service = DnsService(cfg, store)
    await service.start()
    task = asyncio.create_task(source.run())
    try:
        await eventually(lambda: service.synced, what="the demo state")
        yield service
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await service.stop()
        up.close()


def dns_value(name: str, server: str, **labels: str) -> float:
    """Sum of the samples of `name` at `server` whose labels include `labels`."""
    total = 0.0
    for family in metrics.DNS.collect():
        for s in family.samples:
            if s.name == name and s.labels.get("server") == server and labels.items() <= s.labels.items():
                total += s.value
    return total


async def ask(service, name: str, qtype: str = "A", tcp: bool = False, raw: bytes | None = None, **kw):
    import dns.asyncquery
    import dns.message
    host, port = service.bound[0]
    if raw is not None:
        got: asyncio.Future = asyncio.get_running_loop().create_future()

        class Client(asyncio.DatagramProtocol):
            def datagram_received(self, data, addr):
                if not got.done():
                    got.set_result(data)
        transport, _ = await asyncio.get_running_loop().create_datagram_endpoint(Client, remote_addr=(host, port))
        try:
            transport.sendto(raw)
            return await asyncio.wait_for(got, 3)
        finally:
            transport.close()
    q = dns.message.make_query(name, qtype, **kw)
    send = dns.asyncquery.tcp if tcp else dns.asyncquery.udp
    return await send(q, host, port=port, timeout=3)


async def test_every_query_is_counted_timed_and_attributed_to_the_part_that_answered():
    async with dns_service() as service:
        server = f"dns://127.0.0.1:{service.bound[0][1]}"
        n = 200   # far more than the 1-in-32 sampling this replaces: every one must be timed
        for _ in range(n):
            await ask(service, "testapp-svc.testapp.svc.cluster.local.")          # zone, fast path
        await ask(service, "testapp-svc.testapp.svc.cluster.local.", "SRV", tcp=True)
        await ask(service, "nope.testapp.svc.cluster.local.")                     # NXDOMAIN of the zone
        await ask(service, "www.example.")                                        # upstream
        for _ in range(3):
            await ask(service, "www.example.")                                    # the cache (fast path)
        await ask(service, "www.example.", "A", want_dnssec=True)                 # DO bit: upstream again
        garbage = await ask(service, "", raw=b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\x03www")
        assert garbage[3] & 15 == 1                                               # FORMERR, from the server

        a = dns_value("coredns_dns_requests_total", server, type="A", proto="udp", zone=".", view="")
        assert a == n + 1 + 1 + 3 + 1
        assert dns_value("coredns_dns_request_duration_seconds_count", server, type="A") == a
        assert dns_value("coredns_dns_request_duration_seconds_bucket", server, type="A", le="+Inf") == a
        assert dns_value("coredns_dns_request_duration_seconds_count", server, type="SRV") == 1
        assert dns_value("coredns_dns_request_duration_seconds_sum", server, type="A") > 0
        total = dns_value("coredns_dns_requests_total", server)
        assert dns_value("coredns_dns_request_duration_seconds_count", server) == total
        resp = lambda **kw: dns_value("coredns_dns_responses_total", server, **kw)  # noqa: E731
        assert resp(plugin="kubernetes", rcode="NOERROR") == n + 1
        assert resp(plugin="kubernetes", rcode="NXDOMAIN") == 1
        assert resp(plugin="forward", rcode="NOERROR") == 2       # the first ask, and the DO one (its own key)
        assert resp(plugin="cache", rcode="NOERROR") == 3
        assert resp(plugin="", rcode="FORMERR") == 1
        assert resp() == total
        assert dns_value("coredns_dns_do_requests_total", server, zone=".", view="") == 1
        assert dns_value("coredns_cache_hits_total", server, type="success", zones=".", view="") >= 3
        assert dns_value("coredns_cache_misses_total", server, zones=".", view="") >= 2
        assert dns_value("coredns_cache_entries", server, type="success", zones=".", view="") >= 1
        enabled = {s.labels["name"] for f in metrics.DNS.collect() for s in f.samples
                   if s.name == "coredns_plugin_enabled" and s.labels.get("server") == server}
        assert {"kubernetes", "forward", "cache", "loop"} <= enabled
        assert "prometheus" not in enabled            # --metrics-listen none


def test_forward_aliases_of_the_proxy_series():
    """coredns-mixin's alerts read coredns_forward_request_duration_seconds{to,rcode} and
    coredns_forward_healthcheck_failures_total{to} (CoreDNS < 1.11 names)."""
    from clusterdns.dns import metrics as dm
    to = "192.0.2.53:53"
    dm.proxy_duration.labels("forward", to, "NOERROR").observe(0.003)
    dm.healthcheck_failures.labels("forward", to).inc(2)
    values = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in metrics.DNS.collect() for s in f.samples}
    base = ("coredns_proxy_request_duration_seconds_count", (("proxy_name", "forward"), ("rcode", "NOERROR"), ("to", to)))
    assert values[("coredns_forward_request_duration_seconds_count", (("rcode", "NOERROR"), ("to", to)))] == values[base]
    assert values[("coredns_forward_request_duration_seconds_bucket", (("le", "0.004"), ("rcode", "NOERROR"), ("to", to)))] \
        >= 1
    assert values[("coredns_forward_healthcheck_failures_total", (("to", to),))] == \
        values[("coredns_proxy_healthcheck_failures_total", (("proxy_name", "forward"), ("to", to)))]


def test_nodecache_setup_error_types_start_at_zero():
    for t in ("interface_add", "interface_check", "iptables", "iptables_lock", "configmap"):
        assert metrics.DNS.get_sample_value("coredns_nodecache_setup_errors_total", {"errortype": t}) is not None


def _setup_errors(t: str) -> float:
    return metrics.DNS.get_sample_value("coredns_nodecache_setup_errors_total", {"errortype": t}) or 0.0


async def test_local_dns_setup_failures_count_as_nodelocal_setup_errors():
    """coredns_nodecache_setup_errors_total{errortype}, where the agent does NodeLocal's job."""
    import pytest

    from clusterdns.localdns import LocalDNS, LocalDNSError
    from clusterdns.proxy.apply import RecordingRunner, Result

    def no_device(argv, _stdin):
        if argv[:3] == ("ip", "link", "add"):
            return Result(argv, 2, "", "RTNETLINK answers: Operation not permitted")
        if argv[:2] == ("ip", "-d"):
            return Result(argv, 1, "", 'Device "nodelocaldns" does not exist.')
        return None
    before = _setup_errors("interface_add")
    with pytest.raises(LocalDNSError):
        await LocalDNS(["169.254.20.10"], RecordingRunner(no_device)).setup()
    assert _setup_errors("interface_add") == before + 1

    def locked(argv, _stdin):
        if argv[0].endswith("-restore"):
            return Result(argv, 4, "", "Another app is currently holding the xtables lock. Stopped waiting after 5s.")
        return None
    lock_before, ipt_before = _setup_errors("iptables_lock"), _setup_errors("iptables")
    with pytest.raises(LocalDNSError):
        await LocalDNS(["169.254.20.10"], RecordingRunner(locked)).setup()
    assert _setup_errors("iptables_lock") == lock_before + 1 and _setup_errors("iptables") == ipt_before

    def refused(argv, _stdin):
        if argv[0].endswith("-restore"):
            return Result(argv, 2, "", "iptables-restore v1.8.9 (nf_tables): line 3: RULE_APPEND failed")
        if argv[:3] == ("ip", "-o", "addr"):
            return Result(argv, 1, "", "Dump terminated")
        return None
    check_before = _setup_errors("interface_check")
    local = LocalDNS(["169.254.20.10"], RecordingRunner(refused))
    with pytest.raises(LocalDNSError):
        await local.check()       # the device could not be read; the rules could not be put back
    assert _setup_errors("iptables") == ipt_before + 1
    assert _setup_errors("interface_check") == check_before + 1


@pytest.mark.parametrize("order", ["stop-then-start", "start-then-stop"])
async def test_a_replaced_listener_keeps_one_series_that_continues(order):
    """A reload replaces the DNS server on the same address (before or after stopping the old
    one): its counters carry on in one series, and coredns_plugin_enabled is the new one's."""
    from clusterdns.dns.server import DnsService
    from clusterdns.sources.manifest import DEMO_MANIFEST, load_files, publish
    from tests.netutil import free_port
    port = free_port()
    store = StateStore()
    publish(store, load_files([DEMO_MANIFEST])[0])
    common = ["dns", "--listen", f"127.0.0.1:{port}", "--no-upstream", "--health-listen", "none"]
    old = DnsService(load([*common, "--metrics-listen", "none"], env={}), store, reuse_port=True)
    new = DnsService(load([*common, "--metrics-listen", "127.0.0.1:0"], env={}), store, reuse_port=True)
    server = f"dns://127.0.0.1:{port}"
    await old.start()
    try:
        for _ in range(3):
            await ask(old, "testapp-svc.testapp.svc.cluster.local.")
        if order == "stop-then-start":
            await old.stop()
            await new.start()
        else:
            await new.start()
            await ask(old, "testapp-svc.testapp.svc.cluster.local.")   # the old one still answers meanwhile
            await old.stop()
        await ask(new, "testapp-svc.testapp.svc.cluster.local.")
        wanted = 4 if order == "stop-then-start" else 5
        samples = [s for f in metrics.DNS.collect() for s in f.samples
                   if s.name == "coredns_dns_requests_total" and s.labels["server"] == server]
        assert sum(s.value for s in samples) == wanted
        assert len(samples) == len({tuple(sorted(s.labels.items())) for s in samples})   # no duplicate series
        enabled = {s.labels["name"] for f in metrics.DNS.collect() for s in f.samples
                   if s.name == "coredns_plugin_enabled" and s.labels["server"] == server}
        assert "prometheus" in enabled and "health" not in enabled
    finally:
        await new.stop()
        await old.stop()
        old.detach()
        new.detach()
