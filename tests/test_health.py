"""The health/ready/metrics HTTP server over real sockets."""
from __future__ import annotations

import asyncio
import socket

import aiohttp
import pytest
from aiohttp import web

from clusterdns.config import load
from clusterdns.health import HealthServer
from tests.common import http_get


async def test_health_ready_metrics_and_extra_routes():
    srv = HealthServer(addresses=[("127.0.0.1", 0)])
    state = {"synced": False}
    srv.add_ready_check("dns", lambda: state["synced"])
    srv.add_ready_check("broken", lambda: 1 / 0 if not state["synced"] else True)

    async def livez(_request):
        return web.Response(text="ok")
    srv.add_route("/livez", livez)
    await srv.start()
    try:
        port = srv.bound[0][1]
        assert await http_get(port, "/health") == (200, "OK")
        status, body = await http_get(port, "/ready")
        assert status == 503 and "dns" in body and "broken" in body
        state["synced"] = True
        assert await http_get(port, "/ready") == (200, "OK")
        srv.lameduck = True
        assert await http_get(port, "/health") == (200, "OK")      # still alive
        status, body = await http_get(port, "/ready")
        assert status == 503 and "lameduck" in body
        status, body = await http_get(port, "/metrics")
        assert status == 200 and "clusterdns_state_version" in body and "process_cpu_seconds_total" in body
        assert await http_get(port, "/livez") == (200, "ok")
        assert (await http_get(port, "/nothing"))[0] == 404
        with pytest.raises(RuntimeError):
            srv.add_route("/late", livez)
    finally:
        await srv.stop()


def test_addresses_from_config_dedup_and_none():
    cfg = load(["dns", "--manifest", "x", "--metrics-listen", "127.0.0.1:9153", "--health-listen", "127.0.0.1:9153"])
    assert HealthServer(cfg).addresses == [("127.0.0.1", 9153)]
    cfg = load(["dns", "--manifest", "x", "--metrics-listen", "none", "--health-listen", "[::1]:8080"])
    assert HealthServer(cfg).addresses == [("::1", 8080)]
    cfg = load(["dns", "--manifest", "x", "--metrics-listen", "none", "--health-listen", "none"])
    assert HealthServer(cfg).addresses == []


async def test_address_in_use_is_a_clear_error():
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        srv = HealthServer(addresses=[("127.0.0.1", port)])
        with pytest.raises(OSError, match=f"127.0.0.1:{port}"):
            await srv.start()
    finally:
        taken.close()


def _families(text: str) -> set[str]:
    return {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}


def _listen_cfg(*extra: str):
    from tests.netutil import free_port
    ports = {k: free_port() for k in ("health", "dns", "proxy")}
    cfg = load(["agent", "--manifest", "x", "--health-listen", f"127.0.0.1:{ports['health']}",
                "--metrics-listen", f"127.0.0.1:{ports['dns']}",
                "--proxy-metrics-listen", f"127.0.0.1:{ports['proxy']}", *extra], env={})
    return cfg, ports


async def test_each_series_on_one_listener_and_no_metrics_on_health():
    import clusterdns.dns.metrics  # noqa: F401  (registers coredns_*)
    import clusterdns.proxy.proxier  # noqa: F401  (registers kubeproxy_*)
    from clusterdns import metrics
    metrics.api_request("GET", "https://10.96.0.1:443/api/v1/services?watch=true", 0.0, 200)
    cfg, ports = _listen_cfg()
    srv = HealthServer(cfg, roles=("dns", "proxy"))
    await srv.start()
    try:
        assert await http_get(ports["health"], "/health") == (200, "OK")
        assert (await http_get(ports["health"], "/metrics"))[0] == 404
        status, dns_text = await http_get(ports["dns"], "/metrics")
        assert status == 200
        status, proxy_text = await http_get(ports["proxy"], "/metrics")
        assert status == 200
        assert (await http_get(ports["dns"], "/health"))[0] == 404
        dns_f, proxy_f = _families(dns_text), _families(proxy_text)
        # Every scrape job sees the process's CPU and memory ...
        for f in (dns_f, proxy_f):
            assert {"process_cpu_seconds_total", "process_resident_memory_bytes"} <= f
        # ... and nothing else twice.
        assert {f for f in dns_f & proxy_f if not f.startswith("process_")} == set()
        assert "coredns_build_info" in dns_f and not any(f.startswith("kubeproxy_") for f in dns_f)
        assert "kubeproxy_sync_proxy_rules_duration_seconds" in proxy_f
        assert not any(f.startswith("coredns_") for f in proxy_f)
        # The API client's series go with kube-proxy's.
        assert 'rest_client_requests_total{code="200",host="10.96.0.1:443",method="GET"}' in proxy_text
        assert 'rest_client_request_duration_seconds_bucket{host="10.96.0.1:443",le="0.005",verb="GET"}' \
            in proxy_text
        assert "clusterdns_state_version" in proxy_f and "clusterdns_state_version" not in dns_f
        assert set(srv.bound_kinds) == {"health", "metrics", "proxy-metrics"}
        assert await http_get(ports["proxy"], "/proxyMode") == (200, "iptables")   # kube-proxy's answer
    finally:
        await srv.stop()


async def test_without_a_proxy_the_shared_series_go_with_dns():
    cfg, ports = _listen_cfg("--proxy-mode", "none")
    srv = HealthServer(cfg, roles=("dns",))
    await srv.start()
    try:
        text = (await http_get(ports["dns"], "/metrics"))[1]
        assert "clusterdns_state_version" in _families(text)
        with pytest.raises(aiohttp.ClientConnectionError):
            await http_get(ports["proxy"], "/metrics")     # no kube-proxy listener at all
    finally:
        await srv.stop()


async def test_metrics_and_health_on_one_address_share_a_server():
    from tests.netutil import free_port
    port = free_port()
    cfg = load(["proxy", "--manifest", "x", "--health-listen", f"127.0.0.1:{port}",
                "--proxy-metrics-listen", f"127.0.0.1:{port}"], env={})
    srv = HealthServer(cfg, roles=("proxy",))
    assert srv.addresses == [("127.0.0.1", port)]
    await srv.start()
    try:
        assert await http_get(port, "/health") == (200, "OK")
        assert "kubeproxy_sync_proxy_rules_duration_seconds" in _families((await http_get(port, "/metrics"))[1])
    finally:
        await srv.stop()


async def test_a_busy_proxy_metrics_port_is_retried_not_fatal(monkeypatch, caplog):
    from clusterdns import health
    monkeypatch.setattr(health, "RETRY_INTERVAL", 0.1)
    cfg, ports = _listen_cfg()
    taken = socket.socket()
    taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    taken.bind(("127.0.0.1", ports["proxy"]))
    taken.listen()
    srv = HealthServer(cfg, roles=("dns", "proxy"))
    try:
        await srv.start()     # kube-proxy's behaviour: log and retry
        assert "proxy-metrics" not in srv.bound_kinds
        assert f"127.0.0.1:{ports['proxy']}" in caplog.text
        assert await http_get(ports["health"], "/health") == (200, "OK")
        taken.close()
        for _ in range(100):
            if "proxy-metrics" in srv.bound_kinds:
                break
            await asyncio.sleep(0.05)
        assert (await http_get(ports["proxy"], "/metrics"))[0] == 200
    finally:
        taken.close()
        await srv.stop()


async def test_a_busy_dns_metrics_port_stops_the_start():
    cfg, ports = _listen_cfg()
    taken = socket.socket()
    taken.bind(("127.0.0.1", ports["dns"]))
    taken.listen()
    try:
        srv = HealthServer(cfg, roles=("dns", "proxy"))
        with pytest.raises(OSError, match=f"127.0.0.1:{ports['dns']}"):
            await srv.start()
        # Nothing stays bound after the failed start.
        with pytest.raises(aiohttp.ClientConnectionError):
            await http_get(ports["health"], "/health")
    finally:
        taken.close()


async def test_dns_and_proxy_metrics_on_one_address_serve_each_family_once():
    import clusterdns.dns.metrics  # noqa: F401
    import clusterdns.proxy.proxier  # noqa: F401
    from tests.netutil import free_port
    port = free_port()
    cfg = load(["agent", "--manifest", "x", "--health-listen", "none", "--metrics-listen", f"127.0.0.1:{port}",
                "--proxy-metrics-listen", f"127.0.0.1:{port}"], env={})
    srv = HealthServer(cfg, roles=("dns", "proxy"))
    await srv.start()
    try:
        text = (await http_get(port, "/metrics"))[1]
        types = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")]
        assert len(types) == len(set(types))          # process_* of both registries once
        assert {"coredns_build_info", "kubeproxy_sync_proxy_rules_duration_seconds",
                "process_cpu_seconds_total", "clusterdns_state_version"} <= set(types)
        assert (await http_get(port, "/health"))[0] == 404
    finally:
        await srv.stop()


async def test_with_reuse_port_a_port_held_without_it_is_waited_for(monkeypatch):
    """The agent (reuse_port) shares its ports with a successor; a port held by a process
    that does not share it (an agent of an earlier version during a rollout) is retried
    until that process lets go, instead of ending the start."""
    from clusterdns import health
    monkeypatch.setattr(health, "RETRY_INTERVAL", 0.1)
    cfg, ports = _listen_cfg()
    taken = socket.socket()
    taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    taken.bind(("127.0.0.1", ports["health"]))
    taken.listen()
    srv = HealthServer(cfg, roles=("dns", "proxy"), reuse_port=True)
    try:
        await srv.start()
        assert "health" not in srv.bound_kinds
        assert (await http_get(ports["dns"], "/metrics"))[0] == 200
        taken.close()
        for _ in range(100):
            if "health" in srv.bound_kinds:
                break
            await asyncio.sleep(0.05)
        assert await http_get(ports["health"], "/health") == (200, "OK")
        # and a second server with reuse_port shares the port at once
        other = HealthServer(cfg, roles=("dns", "proxy"), reuse_port=True)
        await other.start()
        try:
            assert other.bound_kinds.get("health")
        finally:
            await other.stop()
    finally:
        taken.close()
        await srv.stop()
