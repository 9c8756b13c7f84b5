"""The series the stock dashboards read, produced by the real parts (unit level; the
real-Prometheus test is tests/test_prometheus.py)."""
from __future__ import annotations

import asyncio
import contextlib
import time
from urllib.parse import urlsplit

from clusterdns import metrics
from clusterdns.config import load
from clusterdns.sources.kube import KubeSource
from clusterdns.state import StateStore
from tests.fakeapi import FakeAPIServer, namespace, service


def value(name: str, **labels: str) -> float:
    return metrics.REGISTRY.get_sample_value(name, labels) or 0.0


async def eventually(pred, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def test_rest_client_series_count_every_api_request(tmp_path):
    """rest_client_requests_total{code,method,host} and rest_client_request_duration_seconds{verb,host}
    as client-go exports them: one count per request, 5xx and failed connections included."""
    api = FakeAPIServer().start()
    api.add(namespace("testapp"))
    api.add(service("testapp", "a", "10.0.0.1"))
    host = urlsplit(api.url).netloc
    cfg = load(["agent", "--kubeconfig", api.write_kubeconfig(tmp_path / "kubeconfig")], env={})
    before = {code: value("rest_client_requests_total", code=code, method="GET", host=host)
              for code in ("200", "500", "<error>")}
    count_before = value("rest_client_request_duration_seconds_count", verb="GET", host=host)
    api.fail_next("services", 500)
    src = KubeSource(cfg, StateStore(), watch_timeout=5, backoff_initial=0.02, backoff_max=0.2)
    task = asyncio.create_task(src.run())
    try:
        await asyncio.wait_for(src.synced.wait(), 10)
        after = lambda code: value("rest_client_requests_total", code=code, method="GET", host=host) - before[code]
        assert after("500") == 1
        # every list, and every watch once its stream started
        await eventually(lambda: after("200") >= len(src.resources) * 2, what="list and watch requests")
        api.stop()                       # the API server goes away: requests fail without a response
        api.drop_watches()
        await eventually(lambda: after("<error>") >= 1, what="a failed request")
        total = sum(after(c) for c in before)
        count = value("rest_client_request_duration_seconds_count", verb="GET", host=host) - count_before
        assert count == total
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        api.close()
