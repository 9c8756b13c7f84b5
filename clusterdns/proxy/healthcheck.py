"""Health for load balancers and for the node: kube-proxy's two kinds of health server.

- ServiceHealthServers: one HTTP server per healthCheckNodePort of an
  externalTrafficPolicy: Local service. 200 and the local endpoint count while
  the node has at least one local ready endpoint, 503 otherwise, so a cloud
  load balancer only sends to nodes that can serve without a second hop.
- ProxierHealth: /healthz and /livez. Unhealthy (503) once a queued change has
  waited longer than the timeout (2 x sync period) without a successful sync.

The HTTP side is a tiny asyncio server (GET, one response, close) so the
proxier needs no web framework; `respond(path)` is a plain function that a
shared HTTP server can mount instead.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from datetime import datetime, timezone
from typing import Callable, Mapping

from ..model import IPV4, IPV6
from ..state import ClusterState

log = logging.getLogger(__name__)

Handler = Callable[[str], tuple[int, dict[str, str], bytes]]
_REASONS = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable"}


async def _serve_http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, handler: Handler) -> None:
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
        parts = head.split(b"\r\n", 1)[0].decode("latin-1").split()
        if len(parts) < 2:
            return
        method, path = parts[0], parts[1]
        if method not in ("GET", "HEAD"):
            status, headers, body = 405, {"Content-Type": "text/plain"}, b"method not allowed\n"
        else:
            status, headers, body = handler(path.split("?", 1)[0])
        lines = [f"HTTP/1.1 {status} {_REASONS.get(status, '')}"]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        lines += [f"Content-Length: {len(body)}", "Connection: close", "", ""]
        writer.write("\r\n".join(lines).encode("latin-1") + (body if method == "GET" else b""))
        await writer.drain()
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError,
            ConnectionError, UnicodeError):
        pass
    finally:
        writer.close()


async def start_http(host: str | None, port: int, handler: Handler) -> asyncio.AbstractServer:
    return await asyncio.start_server(lambda r, w: _serve_http(r, w, handler), host, port,
                                      reuse_address=True)


def aiohttp_handler(respond: Handler):
    """Mount a `respond(path)` function on the shared aiohttp server (clusterdns.health)."""
    from aiohttp import web

    async def handler(request: "web.Request") -> "web.Response":
        status, headers, body = respond(request.path)
        return web.Response(status=status, body=body, headers=headers)
    return handler


# ------------------------------------------------------------- per service

def local_endpoint_counts(state: ClusterState, node_name: str, family: int | None = None,
                          keys=None) -> dict[tuple[str, str], tuple[int, int]]:
    """{service key: (healthCheckNodePort, local ready endpoints)} for eTP:Local services
    (keys: only these Services).

    Terminating endpoints do not count: a draining node must fail the check."""
    types = {4: (IPV4,), 6: (IPV6,), None: (IPV4, IPV6)}[family]
    out = {}
    services = state.services.items() if keys is None else [
        (k, s) for k in keys if (s := state.services.get(k)) is not None]
    for key, svc in services:
        if not (svc.external_local and svc.health_check_node_port) or svc.headless:
            continue
        local = set()
        for sl in state.slices_for(*key):
            if sl.address_type not in types:
                continue
            for ep in sl.endpoints:
                if ep.ready and not ep.terminating and ep.addresses and node_name and ep.node_name == node_name:
                    local.add(ep.addresses[0])
        out[key] = (svc.health_check_node_port, len(local))
    return out


class ServiceHealthServers:
    """Opens, updates and closes the healthCheckNodePort servers as services change."""

    def __init__(self, host: str | None = None) -> None:
        self.host = host   # None: every address of the node
        self._servers: dict[int, asyncio.AbstractServer] = {}
        self._by_port: dict[int, tuple[tuple[str, str], int]] = {}

    def respond_for(self, port: int) -> Handler:
        def respond(path: str) -> tuple[int, dict[str, str], bytes]:
            key, count = self._by_port.get(port, (("", ""), 0))
            body = json.dumps({"service": {"namespace": key[0], "name": key[1]},
                               "localEndpoints": count, "serviceProxyHealthy": True}).encode()
            headers = {"Content-Type": "application/json", "X-Content-Type-Options": "nosniff",
                       "X-Load-Balancing-Endpoint-Weight": str(count)}
            return (200 if count > 0 else 503), headers, body
        return respond

    async def sync(self, wanted: Mapping[tuple[str, str], tuple[int, int]]) -> None:
        by_port: dict[int, tuple[tuple[str, str], int]] = {}
        for key, (port, count) in sorted(wanted.items()):
            if port in by_port:
                log.warning("healthCheckNodePort %d claimed by %s/%s and %s/%s", port, *by_port[port][0], *key)
                continue
            by_port[port] = (key, count)
        self._by_port = by_port
        for port in sorted(set(self._servers) - set(by_port)):
            server = self._servers.pop(port)
            server.close()
            log.info("closed health check server on port %d", port)
        for port in sorted(set(by_port) - set(self._servers)):
            try:
                self._servers[port] = await start_http(self.host, port, self.respond_for(port))
                log.info("health check server for %s/%s on port %d", *by_port[port][0], port)
            except OSError as exc:  # retried at the next sync
                log.error("cannot open health check port %d: %s", port, exc.strerror or exc)

    @property
    def ports(self) -> set[int]:
        return set(self._servers)

    async def close(self) -> None:
        for server in self._servers.values():
            server.close()
        for server in self._servers.values():
            await server.wait_closed()
        self._servers.clear()


# ------------------------------------------------------------- proxier

def _rfc3339(t: float | None) -> str:
    if not t:
        return "0001-01-01T00:00:00Z"   # Go's zero time, as kube-proxy prints it
    return datetime.fromtimestamp(t, timezone.utc).isoformat().replace("+00:00", "Z")


class ProxierHealth:
    """kube-proxy's /healthz: healthy unless a queued change waits longer than `timeout`."""

    def __init__(self, timeout: float, clock: Callable[[], float] = time.time) -> None:
        self.timeout = timeout
        self.clock = clock
        self.last_updated: float | None = None
        self.oldest_pending: float | None = None

    def queued_update(self) -> None:
        if self.oldest_pending is None:
            self.oldest_pending = self.clock()

    def updated(self) -> None:
        self.last_updated = self.clock()
        self.oldest_pending = None

    def healthy(self) -> bool:
        if self.oldest_pending is None:
            return True
        return self.clock() - self.oldest_pending < self.timeout

    def respond(self, path: str) -> tuple[int, dict[str, str], bytes]:
        if path not in ("/healthz", "/livez"):
            return 404, {"Content-Type": "text/plain"}, b"404 page not found\n"
        now = self.clock()
        body: dict[str, object] = {"lastUpdated": _rfc3339(self.last_updated), "currentTime": _rfc3339(now)}
        if path == "/healthz":
            body["nodeEligible"] = True
        headers = {"Content-Type": "application/json", "X-Content-Type-Options": "nosniff"}
        return (200 if self.healthy() else 503), headers, json.dumps(body).encode()


__all__ = ["ProxierHealth", "ServiceHealthServers", "aiohttp_handler", "local_endpoint_counts", "start_http"]
