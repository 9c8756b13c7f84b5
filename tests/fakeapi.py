"""A fake Kubernetes API server that speaks the real list/watch HTTP protocol.

It runs an aiohttp server on 127.0.0.1 (ephemeral port) in a background thread
with its own event loop, so synchronous and asynchronous tests can drive it the
same way. It holds objects per resource with one resourceVersion counter (as
etcd has) and a bounded event history per resource, and serves the
cluster-wide collections the agent reads:

    /api/v1/services  /api/v1/namespaces  /api/v1/pods  /api/v1/nodes
    /apis/discovery.k8s.io/v1/endpointslices

LIST honours limit/continue (a consistent snapshot per paginated list),
resourceVersion (served from the current state; a future one is a 504, as
kube-apiserver's "Too large resource version"), fieldSelector and
labelSelector (equality forms). WATCH (?watch=1) streams JSON
lines (ADDED, MODIFIED, DELETED, BOOKMARK when allowWatchBookmarks), replays
history after the requested resourceVersion, answers a resourceVersion older
than its history with an ERROR event of code 410 in a 200 stream (as the watch
cache does; or HTTP 410 with `gone_as_http=True`), sends BOOKMARKs as the
watch cache does (2 s before timeoutSeconds, and every `bookmark_interval`,
60 s by default) and closes the stream after timeoutSeconds. /readyz, /livez,
/healthz and /version answer without authentication, as kube-apiserver's do
for system:public-info-viewer.

Test controls: add/update/apply/delete objects, compact() the history (forces
410 for older versions), bookmark(), drop_watches(), stall_watches() (a dead
connection: nothing more is sent and the stream never ends), stall(seconds)
(a stuck server: open watches go silent for good and every request arriving
meanwhile, probes included, is accepted and never answered; after `seconds`
new requests are served again), stop()/start() (an outage; the port is
kept), forbid() a resource (403), fail_next() (5xx), and write_kubeconfig().
Every request is recorded in `requests` (probes with their path as resource).

    with FakeAPIServer() as api:
        api.add(service_dict)
        path = api.write_kubeconfig(tmp_path / "kubeconfig")
"""
from __future__ import annotations

import asyncio
import base64
import collections
import copy
import itertools
import json
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from aiohttp import web


@dataclass(frozen=True)
class Resource:
    name: str            # plural, as in the URL
    kind: str
    api_version: str
    path: str
    namespaced: bool
    group: str = ""


RESOURCES: dict[str, Resource] = {r.name: r for r in (
    Resource("services", "Service", "v1", "/api/v1/services", True),
    Resource("endpointslices", "EndpointSlice", "discovery.k8s.io/v1",
             "/apis/discovery.k8s.io/v1/endpointslices", True, "discovery.k8s.io"),
    Resource("namespaces", "Namespace", "v1", "/api/v1/namespaces", False),
    Resource("pods", "Pod", "v1", "/api/v1/pods", True),
    Resource("nodes", "Node", "v1", "/api/v1/nodes", False),
)}
BY_KIND = {r.kind: r for r in RESOURCES.values()}
PROBE_PATHS = ("/readyz", "/livez", "/healthz", "/version")


@dataclass(frozen=True)
class RequestRecord:
    """One request the fake received."""
    resource: str
    verb: str                    # list | watch
    params: dict[str, str]
    authorization: str
    time: float


@dataclass
class _Watcher:
    resource: Resource
    selectors: tuple[Callable[[dict], bool], ...]
    bookmarks: bool
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    stalled: bool = False
    request: web.Request | None = None


_DROP = object()


def _key(res: Resource, namespace: str | None, name: str) -> tuple[str, str]:
    return ((namespace or "") if res.namespaced else "", name)


def _obj_key(res: Resource, obj: dict) -> tuple[str, str]:
    meta = obj.get("metadata") or {}
    return _key(res, meta.get("namespace"), meta.get("name", ""))


def _status(code: int, reason: str, message: str, kind: str = "") -> dict:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "details": {"kind": kind} if kind else {},
            "code": code}


def _field_getter(path: str) -> Callable[[dict], str]:
    parts = path.split(".")

    def get(obj: dict) -> str:
        cur: Any = obj
        for p in parts:
            cur = cur.get(p) if isinstance(cur, dict) else None
        return "" if cur is None else str(cur)
    return get


def _parse_field_selector(text: str) -> list[Callable[[dict], bool]]:
    out = []
    for term in filter(None, (t.strip() for t in text.split(","))):
        if "!=" in term:
            k, v = term.split("!=", 1)
            g = _field_getter(k.strip())
            out.append(lambda o, g=g, v=v.strip(): g(o) != v)
        else:
            k, v = term.split("==", 1) if "==" in term else term.split("=", 1)
            g = _field_getter(k.strip())
            out.append(lambda o, g=g, v=v.strip(): g(o) == v)
    return out


def _parse_label_selector(text: str) -> list[Callable[[dict], bool]]:
    def labels(o: dict) -> dict:
        return (o.get("metadata") or {}).get("labels") or {}

    out = []
    for term in filter(None, (t.strip() for t in text.split(","))):
        if "!=" in term:
            k, v = (x.strip() for x in term.split("!=", 1))
            out.append(lambda o, k=k, v=v: labels(o).get(k) != v)
        elif "=" in term:
            k, v = (x.strip() for x in (term.split("==", 1) if "==" in term else term.split("=", 1)))
            out.append(lambda o, k=k, v=v: labels(o).get(k) == v)
        elif term.startswith("!"):
            out.append(lambda o, k=term[1:]: k not in labels(o))
        else:
            out.append(lambda o, k=term: k in labels(o))
    return out


class FakeAPIServer:
    """See the module docstring. Methods are thread-safe; they run on the server's loop."""

    def __init__(self, *, history: int = 1000, token: str | None = "fake-token",
                 gone_as_http: bool = False, bookmark_interval: float | None = 60.0,
                 deadline_bookmarks: bool = True) -> None:
        self.history_size = history
        self.token = token
        self.gone_as_http = gone_as_http
        self.bookmark_interval = bookmark_interval
        self.deadline_bookmarks = deadline_bookmarks
        self._stall_until: float | None = None    # monotonic; inf: until unstall()
        self.requests: list[RequestRecord] = []
        self.port = 0
        self._rv = 0
        self._objects: dict[str, dict[tuple[str, str], dict]] = {r: {} for r in RESOURCES}
        self._history: dict[str, collections.deque] = {r: collections.deque() for r in RESOURCES}
        self._floor: dict[str, int] = {r: 0 for r in RESOURCES}   # versions below are expired
        self._watchers: list[_Watcher] = []
        self._forbidden: dict[str, set[str]] = {}
        self._failures: dict[str, list[int]] = {}
        self._encoded: dict[tuple[str, tuple[str, str]], tuple[str, bytes]] = {}   # see _list
        self._snapshots: collections.OrderedDict[str, tuple[int, list[dict]]] = collections.OrderedDict()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._ids = itertools.count(1)

    # -- lifecycle ---------------------------------------------------------
    def __enter__(self) -> "FakeAPIServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self._runner is not None

    def start(self) -> "FakeAPIServer":
        """Start serving (again, on the same port after stop())."""
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            ready = threading.Event()
            self._thread = threading.Thread(target=self._thread_main, args=(ready,),
                                            name="fakeapi", daemon=True)
            self._thread.start()
            ready.wait()
        self._call(self._start)
        return self

    def stop(self) -> None:
        """An outage: open watches are cut and connections refused; objects are kept."""
        self._call(self._stop)

    def close(self) -> None:
        if self._loop is None:
            return
        self._call(self._stop)
        self._loop.call_soon_threadsafe(self._loop.stop)
        assert self._thread is not None
        self._thread.join(5)
        self._loop.close()
        self._loop = None

    def _thread_main(self, ready: threading.Event) -> None:
        assert self._loop is not None
        asyncio.set_event_loop(self._loop)
        self._loop.call_soon(ready.set)
        self._loop.run_forever()

    def _call(self, fn: Callable, *args: Any) -> Any:
        """Run fn on the server loop and return its result (a coroutine function is awaited)."""
        assert self._loop is not None, "the fake API server is not started"
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            raise RuntimeError("FakeAPIServer methods must not be called from its own loop")

        async def call() -> Any:
            result = fn(*args)
            if asyncio.iscoroutine(result):
                result = await result
            return result
        # (generous: adding 20,000 objects takes seconds on a loaded 2-core machine)
        return asyncio.run_coroutine_threadsafe(call(), self._loop).result(60)

    async def _start(self) -> None:
        if self._runner is not None:
            return
        app = web.Application()
        for res in RESOURCES.values():
            app.router.add_get(res.path, self._handler(res))
        for path in PROBE_PATHS:
            app.router.add_get(path, self._probe_handler)
        runner = web.AppRunner(app, shutdown_timeout=0.5, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", self.port)
        await site.start()
        if not self.port:
            self.port = runner.addresses[0][1]
        self._runner = runner

    async def _stop(self) -> None:
        if self._runner is None:
            return
        self._drop(None)
        runner, self._runner = self._runner, None
        await runner.cleanup()

    # -- objects -----------------------------------------------------------
    @property
    def resource_version(self) -> int:
        return self._rv

    def add(self, obj: dict) -> dict:
        """Create an object (kind and apiVersion required); returns the stored copy."""
        return self._call(self._write, obj, "ADDED")

    def update(self, obj: dict) -> dict:
        return self._call(self._write, obj, "MODIFIED")

    def apply(self, obj: dict) -> dict:
        """Create or update."""
        return self._call(self._write, obj, None)

    def add_all(self, objs: Iterable[dict]) -> None:
        objs = list(objs)
        self._call(lambda: [self._write(o, None, copy_out=False) for o in objs])

    def load_manifest(self, path: str) -> int:
        """Add every supported object of a manifest file (kubectl -o yaml dump, List, stream),
        e.g. the demo cluster; returns how many. Other kinds are ignored."""
        from clusterdns.sources.manifest import read_documents

        def flatten(doc: Any) -> Iterable[Any]:
            if isinstance(doc, list):
                for d in doc:
                    yield from flatten(d)
            elif isinstance(doc, dict) and isinstance(doc.get("items"), list):
                yield from flatten(doc["items"])
            else:
                yield doc
        objs = [o for o in flatten(read_documents(path))
                if isinstance(o, dict) and o.get("kind") in BY_KIND]
        self.add_all(objs)
        return len(objs)

    def delete(self, resource: str, name: str, namespace: str | None = None) -> dict | None:
        """Delete by resource (plural or kind) and name; returns the object or None."""
        return self._call(self._delete, self._resource(resource), namespace, name)

    def get(self, resource: str, name: str, namespace: str | None = None) -> dict | None:
        res = self._resource(resource)
        obj = self._call(lambda: self._objects[res.name].get(_key(res, namespace, name)))
        return copy.deepcopy(obj)

    def objects(self, resource: str) -> list[dict]:
        res = self._resource(resource)
        return copy.deepcopy(self._call(lambda: list(self._objects[res.name].values())))

    def _resource(self, name: str) -> Resource:
        if name in RESOURCES:
            return RESOURCES[name]
        if name in BY_KIND:
            return BY_KIND[name]
        raise KeyError(f"unknown resource {name!r}")

    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    def _write(self, obj: dict, want: str | None, copy_out: bool = True) -> dict | None:
        res = BY_KIND.get(obj.get("kind", ""))
        if res is None:
            raise ValueError(f"unsupported kind {obj.get('kind')!r}")
        obj = copy.deepcopy(obj)
        obj.setdefault("apiVersion", res.api_version)
        meta = obj.setdefault("metadata", {})
        if not meta.get("name"):
            raise ValueError("metadata.name is required")
        if res.namespaced:
            meta.setdefault("namespace", "default")
        key = _obj_key(res, obj)
        table = self._objects[res.name]
        old = table.get(key)
        if want == "ADDED" and old is not None:
            raise ValueError(f"{res.name} {key} already exists")
        if want == "MODIFIED" and old is None:
            raise ValueError(f"{res.name} {key} does not exist")
        meta["uid"] = (old or {}).get("metadata", {}).get("uid") or meta.get("uid") or str(uuid.uuid4())
        meta.setdefault("creationTimestamp", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        meta["resourceVersion"] = self._next_rv()
        table[key] = obj
        self._emit(res, "MODIFIED" if old is not None else "ADDED", obj, old)
        return copy.deepcopy(obj) if copy_out else None

    def _delete(self, res: Resource, namespace: str | None, name: str) -> dict | None:
        old = self._objects[res.name].pop(_key(res, namespace, name), None)
        self._encoded.pop((res.name, _key(res, namespace, name)), None)
        if old is None:
            return None
        gone = copy.deepcopy(old)
        gone["metadata"]["resourceVersion"] = self._next_rv()
        self._emit(res, "DELETED", gone, old)
        return gone

    def _emit(self, res: Resource, kind: str, obj: dict, old: dict | None) -> None:
        hist = self._history[res.name]
        hist.append((self._rv, kind, obj, old))
        while len(hist) > self.history_size:
            self._floor[res.name] = hist.popleft()[0]
        for w in self._watchers:
            if w.resource is res and not w.stalled:
                ev = self._event_for(w, kind, obj, old)
                if ev is not None:
                    w.queue.put_nowait(ev)

    @staticmethod
    def _event_for(w: _Watcher, kind: str, obj: dict, old: dict | None) -> dict | None:
        """The event a selective watcher sees (an object leaving its selection is a DELETED)."""
        def match(o: dict | None) -> bool:
            return o is not None and all(s(o) for s in w.selectors)
        if kind == "DELETED":
            return {"type": kind, "object": obj} if match(old) else None
        now, before = match(obj), match(old)
        if now:
            return {"type": "ADDED" if kind == "ADDED" or not before else "MODIFIED", "object": obj}
        if before:
            return {"type": "DELETED", "object": obj}
        return None

    # -- controls ----------------------------------------------------------
    def compact(self, resource: str | None = None) -> int:
        """Forget the history: a watch from any version a client holds now gets 410 Gone.

        The version moves on by one (as etcd's does with writes elsewhere), so a
        client's current version is expired too, and a re-list gets a version
        that can be watched from. Open watches are not affected; drop them to
        make their clients come back with the expired version.
        """
        def run() -> int:
            self._rv += 1
            for name in ([self._resource(resource).name] if resource else RESOURCES):
                self._history[name].clear()
                self._floor[name] = self._rv
            return self._rv
        return self._call(run)

    def bookmark(self, resource: str | None = None) -> int:
        """Send a BOOKMARK at the current version to watches that asked for them."""
        def run() -> int:
            for w in self._watchers:
                if w.bookmarks and not w.stalled and (resource is None or w.resource is self._resource(resource)):
                    w.queue.put_nowait(self._bookmark_event(w.resource))
            return self._rv
        return self._call(run)

    def _bookmark_event(self, res: Resource) -> dict:
        return {"type": "BOOKMARK", "object": {
            "kind": res.kind, "apiVersion": res.api_version,
            "metadata": {"resourceVersion": str(self._rv)}}}

    def drop_watches(self, resource: str | None = None) -> int:
        """Cut open watch connections abruptly (no final chunk); returns how many."""
        return self._call(self._drop, resource)

    def _drop(self, resource: str | None) -> int:
        n = 0
        for w in list(self._watchers):
            if resource is None or w.resource is self._resource(resource):
                w.stalled = False
                w.queue.put_nowait(_DROP)
                n += 1
        return n

    def stall_watches(self, resource: str | None = None) -> int:
        """Open watches go silent and never end, as over a dead TCP connection."""
        def run() -> int:
            n = 0
            for w in self._watchers:
                if resource is None or w.resource is self._resource(resource):
                    w.stalled = True
                    n += 1
            return n
        return self._call(run)

    def stall(self, seconds: float | None = None) -> int:
        """A stuck server: open watches go silent for good; requests arriving in the next
        `seconds` (or until unstall()) are accepted and never answered. Returns how many
        watches were open."""
        def run() -> int:
            self._stall_until = float("inf") if seconds is None else time.monotonic() + seconds
            for w in self._watchers:
                w.stalled = True
            return len(self._watchers)
        return self._call(run)

    def unstall(self) -> None:
        """End a stall now: new requests are served (stalled watches stay dead)."""
        self._stall_until = None

    @property
    def stalling(self) -> bool:
        return self._stall_until is not None and time.monotonic() < self._stall_until

    async def _hang(self, request: web.Request) -> web.StreamResponse:
        """Hold an accepted request without answering until its client gives up."""
        while request.transport is not None and not request.transport.is_closing():
            await asyncio.sleep(0.05)
        return web.Response(status=504)   # never reaches the client

    async def _probe_handler(self, request: web.Request) -> web.StreamResponse:
        self.requests.append(RequestRecord(request.path.lstrip("/"), "get", dict(request.query),
                                           request.headers.get("Authorization", ""), time.time()))
        if self.stalling:
            return await self._hang(request)
        if request.path == "/version":
            return web.json_response({"major": "1", "minor": "30", "gitVersion": "v1.30.0-fake"})
        return web.Response(text="ok")

    def probes(self, path: str = "/readyz") -> list[RequestRecord]:
        return [r for r in list(self.requests) if r.resource == path.lstrip("/")]

    def forbid(self, resource: str, verbs: Iterable[str] = ("list", "watch")) -> None:
        """Answer 403 Forbidden for these verbs on the resource (RBAC missing)."""
        name = self._resource(resource).name
        self._forbidden[name] = set(verbs)

    def allow(self, resource: str) -> None:
        self._forbidden.pop(self._resource(resource).name, None)

    def fail_next(self, resource: str, status: int = 500, count: int = 1) -> None:
        """The next `count` requests for the resource fail with this HTTP status."""
        self._failures.setdefault(self._resource(resource).name, []).extend([status] * count)

    def open_watches(self, resource: str | None = None) -> int:
        return sum(1 for w in list(self._watchers)
                   if resource is None or w.resource is self._resource(resource))

    def requests_for(self, resource: str, verb: str | None = None) -> list[RequestRecord]:
        name = self._resource(resource).name
        return [r for r in list(self.requests) if r.resource == name and (verb is None or r.verb == verb)]

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> None:
        """Poll predicate until true (for use from sync tests)."""
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for {what}")
            time.sleep(0.01)

    def write_kubeconfig(self, path: Any, token: str | None = None) -> str:
        """Write a kubeconfig pointing at this server; returns the path."""
        token = self.token if token is None else token
        user: dict[str, Any] = {"token": token} if token else {}
        doc = {
            "apiVersion": "v1", "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": user}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
            "current-context": "fake",
        }
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(doc, fh, indent=1)   # JSON is YAML
        return str(path)

    # -- HTTP ----------------------------------------------------------------
    def _handler(self, res: Resource) -> Callable:
        async def handle(request: web.Request) -> web.StreamResponse:
            q = request.query
            watching = q.get("watch", "").lower() in ("1", "true")
            verb = "watch" if watching else "list"
            self.requests.append(RequestRecord(res.name, verb, dict(q),
                                               request.headers.get("Authorization", ""), time.time()))
            if self.stalling:
                return await self._hang(request)
            if self.token and request.headers.get("Authorization", "") != f"Bearer {self.token}" \
                    and request.headers.get("Authorization", "") != f"bearer {self.token}":
                return web.json_response(_status(401, "Unauthorized", "Unauthorized"), status=401)
            if verb in self._forbidden.get(res.name, ()):
                resource = f"{res.name}.{res.group}" if res.group else res.name
                msg = (f'{resource} is forbidden: User "system:serviceaccount:kube-system:clusterdns" '
                       f'cannot {verb} resource "{res.name}" in API group "{res.group}" at the cluster scope')
                return web.json_response(_status(403, "Forbidden", msg, res.name), status=403)
            fails = self._failures.get(res.name)
            if fails:
                code = fails.pop(0)
                return web.json_response(_status(code, "InternalError", "injected failure"), status=code)
            try:
                selectors = tuple(_parse_field_selector(q.get("fieldSelector", ""))
                                  + _parse_label_selector(q.get("labelSelector", "")))
            except ValueError:
                return web.json_response(_status(400, "BadRequest", "invalid selector"), status=400)
            if watching:
                return await self._watch(request, res, selectors)
            return self._list(request, res, selectors)
        return handle

    def _list(self, request: web.Request, res: Resource, selectors: tuple) -> web.Response:
        q = request.query
        try:
            limit = int(q.get("limit", "0") or 0)
        except ValueError:
            return web.json_response(_status(400, "BadRequest", "invalid limit"), status=400)
        # Any resourceVersion is "not older than" the current state, unless it is from the future.
        wanted = q.get("resourceVersion", "")
        if wanted.isdigit() and int(wanted) > self._rv:
            return web.json_response(_status(504, "Timeout", f"Too large resource version: {wanted}, "
                                                             f"current: {self._rv}"), status=504)
        token = q.get("continue", "")
        if token:
            snap = self._snapshots.get(token)
            if snap is None:
                return web.json_response(_status(
                    410, "Expired", "The provided continue parameter is too old"), status=410)
            rv, items = snap
        else:
            rv = self._rv
            items = [o for _, o in sorted(self._objects[res.name].items()) if all(s(o) for s in selectors)]
        page, rest = (items[:limit], items[limit:]) if limit > 0 else (items, [])
        meta: dict[str, Any] = {"resourceVersion": str(rv)}
        if rest:
            nxt = base64.urlsafe_b64encode(f"{res.name}:{next(self._ids)}".encode()).decode()
            self._snapshots[nxt] = (rv, rest)
            while len(self._snapshots) > 100:
                self._snapshots.popitem(last=False)
            meta["continue"] = nxt
            meta["remainingItemCount"] = len(rest)
        # Each item's JSON is made once per resourceVersion and kept, as kube-apiserver's watch
        # cache keeps serialized objects: a 10,000-slice list is then quick to serve here
        # (deep copies and a fresh encoding per page took ~20 s, far beyond a real server).
        out = []
        for o in page:
            k = (res.name, _obj_key(res, o))
            rv_o = o["metadata"]["resourceVersion"]
            hit = self._encoded.get(k)
            if hit is None or hit[0] != rv_o:
                # list items carry no TypeMeta, as from kube-apiserver
                item = {f: v for f, v in o.items() if f not in ("kind", "apiVersion")}
                hit = self._encoded[k] = (rv_o, json.dumps(item).encode())
            out.append(hit[1])
        head = json.dumps({"kind": res.kind + "List", "apiVersion": res.api_version, "metadata": meta})
        body = head[:-1].encode() + b', "items": [' + b", ".join(out) + b"]}"
        return web.Response(body=body, content_type="application/json")

    async def _watch(self, request: web.Request, res: Resource, selectors: tuple) -> web.StreamResponse:
        q = request.query
        rv_text = q.get("resourceVersion", "")
        try:
            since = int(rv_text) if rv_text else 0
            timeout = float(q["timeoutSeconds"]) if q.get("timeoutSeconds") else None
        except ValueError:
            return web.json_response(_status(400, "BadRequest", "invalid resourceVersion"), status=400)
        expired = rv_text not in ("", "0") and since < self._floor[res.name]
        if expired and self.gone_as_http:
            return web.json_response(_status(410, "Expired", f"too old resource version: {since} "
                                                           f"({self._floor[res.name]})"), status=410)
        w = _Watcher(res, selectors, q.get("allowWatchBookmarks", "").lower() == "true", request=request)
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        if expired:
            await self._send(resp, {"type": "ERROR", "object": _status(
                410, "Expired", f"too old resource version: {since} ({self._floor[res.name]})")})
            return resp
        # Replay and register without awaiting in between, so no event falls in a gap.
        if rv_text in ("", "0"):
            for _, o in sorted(self._objects[res.name].items()):
                if all(s(o) for s in selectors):
                    w.queue.put_nowait({"type": "ADDED", "object": o})
        else:
            for ev_rv, kind, obj, old in self._history[res.name]:
                if ev_rv > since:
                    ev = self._event_for(w, kind, obj, old)
                    if ev is not None:
                        w.queue.put_nowait(ev)
        self._watchers.append(w)
        deadline = None if timeout is None else time.monotonic() + timeout
        next_bookmark = (time.monotonic() + self.bookmark_interval
                         if self.bookmark_interval and w.bookmarks else None)
        # As the watch cache: one BOOKMARK 2 s before the deadline, if that is still ahead.
        pre_deadline = (deadline - 2.0 if deadline is not None and w.bookmarks and self.deadline_bookmarks
                        and deadline - 2.0 > time.monotonic() else None)
        try:
            while True:
                if request.transport is None or request.transport.is_closing():
                    break   # the client went away
                now = time.monotonic()
                # Wake up now and then to notice a client that went away.
                wait = [0.25] + ([] if w.stalled else
                                 [t - now for t in (deadline, next_bookmark, pre_deadline) if t is not None])
                try:
                    item = await asyncio.wait_for(w.queue.get(), max(0.0, min(wait)))
                except asyncio.TimeoutError:
                    if w.stalled:
                        continue
                    now = time.monotonic()
                    if deadline is not None and now >= deadline:
                        return resp   # normal end: final chunk, stream closed
                    if pre_deadline is not None and now >= pre_deadline:
                        pre_deadline = None
                        await self._send(resp, self._bookmark_event(res))
                    elif next_bookmark is not None and now >= next_bookmark:
                        await self._send(resp, self._bookmark_event(res))
                        next_bookmark = now + (self.bookmark_interval or 0)
                    continue
                # Events queued together go out in one write, as a busy apiserver's do.
                batch = [item]
                while not w.queue.empty() and batch[-1] is not _DROP:
                    batch.append(w.queue.get_nowait())
                dropped = batch[-1] is _DROP
                if dropped:
                    batch.pop()
                if batch and not w.stalled:
                    await resp.write(b"".join(json.dumps(ev).encode() + b"\n" for ev in batch))
                if dropped:
                    break
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            if w in self._watchers:
                self._watchers.remove(w)
        # Cut the connection without the terminating chunk: the client sees a broken stream.
        if request.transport is not None:
            request.transport.abort()
        return resp

    @staticmethod
    async def _send(resp: web.StreamResponse, event: dict) -> None:
        await resp.write(json.dumps(event).encode() + b"\n")


# -- object builders for tests ------------------------------------------------

def service(namespace: str, name: str, cluster_ip: str, ports: Iterable[tuple] = (("http", 80, "TCP"),),
            **spec: Any) -> dict:
    """A v1 Service dict; ports are (name, port, protocol)."""
    body: dict[str, Any] = {"type": "ClusterIP", "clusterIP": cluster_ip,
                            "clusterIPs": [cluster_ip] if cluster_ip != "None" else ["None"],
                            "ports": [{"name": n, "port": p, "protocol": pr, "targetPort": p}
                                      for n, p, pr in ports]}
    body.update(spec)
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"namespace": namespace, "name": name}, "spec": body}


def endpoint_slice(namespace: str, service_name: str, ips: Iterable[str], port: int = 80,
                   name: str | None = None, port_name: str = "http", ready: bool = True) -> dict:
    ips = list(ips)
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"namespace": namespace, "name": name or f"{service_name}-abc",
                         "labels": {"kubernetes.io/service-name": service_name}},
            "addressType": "IPv6" if ips and ":" in ips[0] else "IPv4",
            "endpoints": [{"addresses": [ip], "conditions": {"ready": ready}} for ip in ips],
            "ports": [{"name": port_name, "port": port, "protocol": "TCP"}]}


def namespace(name: str) -> dict:
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}


def pod(namespace: str, name: str, ip: str, phase: str = "Running") -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"namespace": namespace, "name": name},
            "spec": {"nodeName": "node-a"},
            "status": {"phase": phase, "podIP": ip, "podIPs": [{"ip": ip}]}}


def node(name: str, ip: str, zone: str = "") -> dict:
    labels = {"topology.kubernetes.io/zone": zone} if zone else {}
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels},
            "status": {"addresses": [{"type": "InternalIP", "address": ip}]}}


__all__ = ["FakeAPIServer", "RESOURCES", "RequestRecord", "endpoint_slice", "namespace", "node",
           "pod", "service"]
