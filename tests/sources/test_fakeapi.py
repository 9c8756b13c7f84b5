"""The fake API server's protocol, checked with a plain HTTP client (not the
reflector), so a reflector bug cannot be hidden by the same bug in the fake."""
from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from tests.fakeapi import FakeAPIServer, namespace, node, service

AUTH = {"Authorization": "Bearer fake-token"}


@pytest.fixture
def api():
    server = FakeAPIServer(history=5).start()
    try:
        yield server
    finally:
        server.close()


async def get(api, path, **params):
    async with aiohttp.ClientSession(headers=AUTH) as s:
        async with s.get(api.url + path, params={k: str(v) for k, v in params.items()}) as r:
            return r.status, await r.json()


async def watch(api, path, limit_events=100, read_timeout=3.0, **params):
    """Events of one watch until the server ends it (or limit_events)."""
    events = []
    timeout = aiohttp.ClientTimeout(sock_read=read_timeout)
    async with aiohttp.ClientSession(headers=AUTH, timeout=timeout) as s:
        async with s.get(api.url + path, params={"watch": "1", **{k: str(v) for k, v in params.items()}}) as r:
            assert r.status == 200
            async for line in r.content:
                events.append(json.loads(line))
                if len(events) >= limit_events:
                    break
    return events


async def test_list_pages_are_a_consistent_snapshot(api):
    for i in range(5):
        await asyncio.to_thread(api.add, service("ns", f"s{i}", f"10.0.0.{i + 1}"))
    status, page1 = await get(api, "/api/v1/services", limit=2)
    assert status == 200 and page1["kind"] == "ServiceList"
    assert [o["metadata"]["name"] for o in page1["items"]] == ["s0", "s1"]
    assert "kind" not in page1["items"][0]          # list items carry no TypeMeta
    rv = page1["metadata"]["resourceVersion"]
    await asyncio.to_thread(api.delete, "services", "s4", "ns")   # after the snapshot
    _, page2 = await get(api, "/api/v1/services", limit=2, **{"continue": page1["metadata"]["continue"]})
    _, page3 = await get(api, "/api/v1/services", limit=2, **{"continue": page2["metadata"]["continue"]})
    assert [o["metadata"]["name"] for o in page2["items"] + page3["items"]] == ["s2", "s3", "s4"]
    assert page3["metadata"]["resourceVersion"] == rv and "continue" not in page3["metadata"]
    status, body = await get(api, "/api/v1/services", resourceVersion=0)
    assert status == 200 and len(body["items"]) == 4
    status, body = await get(api, "/api/v1/services", resourceVersion=api.resource_version + 5)
    assert status == 504 and "Too large resource version" in body["message"]
    status, body = await get(api, "/api/v1/services", **{"continue": "bogus"})
    assert status == 410 and body["reason"] == "Expired"


async def test_watch_replays_history_and_expires_with_410(api):
    a = await asyncio.to_thread(api.add, service("ns", "a", "10.0.0.1"))
    rv = a["metadata"]["resourceVersion"]
    await asyncio.to_thread(api.update, service("ns", "a", "10.0.0.2"))
    await asyncio.to_thread(api.delete, "services", "a", "ns")
    events = await watch(api, "/api/v1/services", resourceVersion=rv, timeoutSeconds=1)
    assert [e["type"] for e in events] == ["MODIFIED", "DELETED"]
    assert events[1]["object"]["kind"] == "Service"
    # A watch with no version starts with the current objects.
    await asyncio.to_thread(api.add, service("ns", "b", "10.0.0.3"))
    events = await watch(api, "/api/v1/services", timeoutSeconds=1)
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [("ADDED", "b")]
    # History is bounded (5 here): older versions are expired, as after compaction.
    for i in range(6):
        await asyncio.to_thread(api.add, namespace(f"n{i}"))
    await asyncio.to_thread(api.add, namespace("last"))
    events = await watch(api, "/api/v1/namespaces", resourceVersion=rv, timeoutSeconds=1)
    assert events[0]["type"] == "ERROR" and events[0]["object"]["code"] == 410
    await asyncio.to_thread(api.compact)
    events = await watch(api, "/api/v1/services", resourceVersion=int(rv) + 1, timeoutSeconds=1)
    assert events[0]["type"] == "ERROR"
    api.gone_as_http = True
    status, body = await get(api, "/api/v1/services", watch=1, resourceVersion=rv)
    assert status == 410 and body["code"] == 410


async def test_watch_timeout_bookmarks_and_drop(api):
    await asyncio.to_thread(api.add, service("ns", "a", "10.0.0.1"))
    rv = api.resource_version
    t0 = time.monotonic()
    assert await watch(api, "/api/v1/services", resourceVersion=rv, timeoutSeconds=1) == []
    assert 0.9 <= time.monotonic() - t0 < 10     # ended by its timeoutSeconds, not left open

    async def later(fn, *args):
        await asyncio.sleep(0.3)
        return await asyncio.to_thread(fn, *args)
    # Bookmarks only for watches that asked for them.
    task = asyncio.create_task(later(api.bookmark))
    plain = await watch(api, "/api/v1/services", resourceVersion=rv, timeoutSeconds=1)
    await task
    assert plain == []
    task = asyncio.create_task(later(api.bookmark))
    marked = await watch(api, "/api/v1/services", resourceVersion=rv, timeoutSeconds=1, allowWatchBookmarks="true")
    await task
    assert marked == [{"type": "BOOKMARK", "object": {"kind": "Service", "apiVersion": "v1",
                                                      "metadata": {"resourceVersion": str(rv)}}}]
    # A dropped watch is a broken stream, not a clean end.
    task = asyncio.create_task(later(api.drop_watches))
    with pytest.raises(aiohttp.ClientPayloadError):
        await watch(api, "/api/v1/services", resourceVersion=rv, timeoutSeconds=5)
    assert await task == 1


async def test_field_selector_turns_leaving_objects_into_deletes(api):
    await asyncio.to_thread(api.add, node("node-a", "192.168.49.2"))
    await asyncio.to_thread(api.add, node("node-b", "192.168.49.3"))
    _, body = await get(api, "/api/v1/nodes", fieldSelector="metadata.name=node-a")
    assert [o["metadata"]["name"] for o in body["items"]] == ["node-a"]
    rv = body["metadata"]["resourceVersion"]
    await asyncio.to_thread(api.update, node("node-b", "192.168.49.30"))
    await asyncio.to_thread(api.update, node("node-a", "192.168.49.20"))
    events = await watch(api, "/api/v1/nodes", resourceVersion=rv, timeoutSeconds=1,
                         fieldSelector="metadata.name=node-a")
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [("MODIFIED", "node-a")]


async def test_errors_auth_outage(api):
    async with aiohttp.ClientSession() as s:
        async with s.get(api.url + "/api/v1/services") as r:
            assert r.status == 401
    api.forbid("endpointslices", ["watch"])
    status, _ = await get(api, "/apis/discovery.k8s.io/v1/endpointslices")
    assert status == 200
    status, body = await get(api, "/apis/discovery.k8s.io/v1/endpointslices", watch=1)
    assert status == 403 and "cannot watch resource" in body["message"]
    api.fail_next("services", 503)
    assert (await get(api, "/api/v1/services"))[0] == 503
    assert (await get(api, "/api/v1/services"))[0] == 200
    port = api.port
    await asyncio.to_thread(api.stop)
    with pytest.raises(aiohttp.ClientConnectorError):
        await get(api, "/api/v1/services")
    await asyncio.to_thread(api.start)
    assert api.port == port and (await get(api, "/api/v1/services"))[0] == 200
    assert [r.verb for r in api.requests_for("endpointslices")] == ["list", "watch"]


async def test_periodic_bookmarks_only_when_asked():
    with FakeAPIServer(bookmark_interval=0.2) as server:
        marked = await watch(server, "/api/v1/services", resourceVersion=0, timeoutSeconds=1,
                             allowWatchBookmarks="true")
        plain = await watch(server, "/api/v1/services", resourceVersion=0, timeoutSeconds=1)
    assert 3 <= len(marked) <= 5 and {e["type"] for e in marked} == {"BOOKMARK"}
    assert plain == []
