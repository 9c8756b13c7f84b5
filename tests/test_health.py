"""The health/ready/metrics HTTP server over real sockets."""
from __future__ import annotations

import socket

import aiohttp
import pytest
from aiohttp import web

from clusterdns.config import load
from clusterdns.health import HealthServer


async def get(port: int, path: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as s:
        async with s.get(f"http://127.0.0.1:{port}{path}") as r:
            return r.status, await r.text()


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
        assert await get(port, "/health") == (200, "OK")
        status, body = await get(port, "/ready")
        assert status == 503 and "dns" in body and "broken" in body
        state["synced"] = True
        assert await get(port, "/ready") == (200, "OK")
        srv.lameduck = True
        assert await get(port, "/health") == (200, "OK")      # still alive
        status, body = await get(port, "/ready")
        assert status == 503 and "lameduck" in body
        status, body = await get(port, "/metrics")
        assert status == 200 and "clusterdns_state_version" in body   # the shared REGISTRY
        assert await get(port, "/livez") == (200, "ok")
        assert (await get(port, "/nothing"))[0] == 404
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
