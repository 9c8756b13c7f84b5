"""One list+watch loop per resource, feeding the StateStore with slim records.

The loop every correct Kubernetes reflector runs (client-go's Reflector,
CoreDNS's informers): LIST (paginated) -> replace the kind in the store (the
store diffs, so a re-list emits deletes only for vanished objects) -> WATCH
from the list's resourceVersion with bookmarks -> apply events, advancing the
version on every event and BOOKMARK -> re-watch when the stream ends -> re-list
only on 410 Gone. Errors back off with jitter; the last state stays in the
store while the API server is away.

HTTP goes through the official client's ApiClient (kubeconfig, TLS, token
refresh) but raw: responses are read as JSON lines and converted straight into
records, never into the client's pydantic models.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import time
from dataclasses import dataclass
from typing import Any, Callable

import aiohttp
from prometheus_client import Counter, Gauge, Histogram

from .. import metrics
from ..state import StateStore
from .objects import InvalidObject, convert, object_name

log = logging.getLogger(__name__)

lists_total = Counter(
    "clusterdns_kube_lists_total", "Complete LISTs of a resource.", ["resource"],
    registry=metrics.REGISTRY)
watch_events_total = Counter(
    "clusterdns_kube_watch_events_total", "Watch events received.", ["resource", "type"],
    registry=metrics.REGISTRY)
relists_total = Counter(
    "clusterdns_kube_relists_total", "LISTs after the first one, by cause.", ["resource", "reason"],
    registry=metrics.REGISTRY)
errors_total = Counter(
    "clusterdns_kube_errors_total", "Failed list or watch requests, by cause.", ["resource", "reason"],
    registry=metrics.REGISTRY)
synced_gauge = Gauge(
    "clusterdns_kube_synced", "1 once the first LIST of a resource completed.", ["resource"],
    registry=metrics.REGISTRY)
api_up = Gauge(
    "clusterdns_kube_api_up",
    "1 while the API server answers the liveness probe, 0 while it is declared unreachable.",
    registry=metrics.REGISTRY)
api_outages_total = Counter(
    "clusterdns_kube_api_outages_total",
    "Times the API server was declared unreachable, by cause (timeout: accepts but does not answer; "
    "connection: cannot connect).", ["reason"], registry=metrics.REGISTRY)
api_probes_total = Counter(
    "clusterdns_kube_api_probes_total", "Liveness probes of the API server, by result.", ["result"],
    registry=metrics.REGISTRY)
event_lag = Histogram(
    "clusterdns_kube_watch_event_apply_seconds",
    "Time from reading a watch event to its publication in the state.", ["resource"],
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
    registry=metrics.REGISTRY)


@dataclass(frozen=True)
class Resource:
    """A cluster-wide collection the agent lists and watches."""
    name: str                 # plural, as in the URL and in metric labels
    kind: str                 # record kind in the StateStore
    path: str
    group: str = ""
    field_selector: str = ""

    @property
    def qualified(self) -> str:
        """The RBAC resource name: endpointslices.discovery.k8s.io."""
        return f"{self.name}.{self.group}" if self.group else self.name


SERVICES = Resource("services", "Service", "/api/v1/services")
ENDPOINTSLICES = Resource("endpointslices", "EndpointSlice",
                          "/apis/discovery.k8s.io/v1/endpointslices", "discovery.k8s.io")
NAMESPACES = Resource("namespaces", "Namespace", "/api/v1/namespaces")
PODS = Resource("pods", "Pod", "/api/v1/pods")
NODES = Resource("nodes", "Node", "/api/v1/nodes")


# kube-apiserver's watch cache sends a BOOKMARK about once a minute and 2 s
# before the watch's timeoutSeconds; these bound a healthy watch's silence.
SERVER_BOOKMARK_PERIOD = 60.0
SERVER_BOOKMARK_LEAD = 2.0


@dataclass(frozen=True)
class Options:
    """Timeouts and pacing; tests shorten them."""
    watch_timeout: int = 15             # server-side timeoutSeconds of a watch (before jitter)
    watch_jitter: float = 0.3           # each watch asks for watch_timeout * (1 .. 1 + jitter)
    read_timeout: float | None = None   # client read timeout; default: expected bookmark gap + grace
    read_grace: float = 5.0             # slack over the expected bookmark gap
    connect_timeout: float = 10.0
    list_timeout: float = 60.0          # a whole LIST page
    page_size: int = 500
    backoff_initial: float = 0.8        # client-go's values
    backoff_max: float = 30.0
    batch_window: float = 0.002         # watch events closer than this publish as one version
    # Under sustained churn, versions no closer than this: each version costs every consumer
    # O(Services) (the store's, the DNS view's and the zone's table copies, the DNS memo
    # starting over), so 50 events a second cost ~0.3 core one version each. A lone event
    # still publishes after batch_window.
    batch_spacing: float = 0.25
    probe_path: str = "/readyz"         # the liveness probe (APF-exempt, no auth needed)
    probe_interval: float = 5.0         # between probes while the API answers
    probe_retry: float = 1.0            # between probes while it does not
    probe_timeout: float = 3.0
    probe_failures: int = 2             # consecutive failed probes that declare it unreachable

    def read_timeout_for(self, timeout_seconds: float) -> float:
        """The longest silence a healthy watch asking for timeout_seconds has, plus grace:
        the server's next BOOKMARK (or its end of the stream) is due by then."""
        if self.read_timeout is not None:
            return self.read_timeout
        gap = min(SERVER_BOOKMARK_PERIOD, max(timeout_seconds - SERVER_BOOKMARK_LEAD, 0.0))
        return gap + self.read_grace

    @property
    def effective_read_timeout(self) -> float:
        return self.read_timeout_for(self.watch_timeout * (1 + self.watch_jitter))


class ApiError(Exception):
    """A failed request or an ERROR watch event; `status` is the HTTP code (0 if unknown)."""

    def __init__(self, status: int, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason


class Expired(ApiError):
    """410 Gone: the resourceVersion is older than the server's history; re-list."""


class Forbidden(ApiError):
    """403: RBAC does not allow the verb on the resource."""


class Unreachable(Exception):
    """The liveness probe declared the API server unreachable while a request was open."""


class Transport:
    """GET requests through the official client's ApiClient, returning raw aiohttp responses."""

    def __init__(self, api_client: Any) -> None:
        self.api = api_client

    @property
    def host(self) -> str:
        return str(self.api.configuration.host)

    async def get(self, path: str, params: dict[str, str], timeout: aiohttp.ClientTimeout) -> aiohttp.ClientResponse:
        method, url, headers, body, post = await self.api.param_serialize(
            "GET", path, query_params=list(params.items()),
            header_params={"Accept": "application/json"}, auth_settings=["BearerToken"])
        # call_api hands _request_timeout to aiohttp unchanged, so a ClientTimeout
        # with a read timeout (not a total one that would cut long watches) works.
        started = time.monotonic()
        try:
            rest = await self.api.call_api(method, url, headers, body, post,
                                           _request_timeout=timeout, _preload_content=False)
        except Exception:
            metrics.api_request(method, url, started, None)    # rest_client_*: code "<error>"
            raise
        metrics.api_request(method, url, started, rest.response.status)
        return rest.response

    async def close(self) -> None:
        await self.api.close()


async def _raise_for_status(resp: aiohttp.ClientResponse) -> None:
    if resp.status < 300:
        return
    try:
        body = json.loads(await resp.read())
        message = str(body.get("message", "")) if isinstance(body, dict) else ""
        reason = str(body.get("reason", "")) if isinstance(body, dict) else ""
    except (ValueError, aiohttp.ClientError, asyncio.TimeoutError):
        message, reason = "", ""
    finally:
        resp.release()
    message = message or f"HTTP {resp.status} {resp.reason or ''}".strip()
    if resp.status == 410:
        raise Expired(410, message, reason)
    if resp.status == 403:
        raise Forbidden(403, message, reason)
    raise ApiError(resp.status, message, reason)


def forbidden_hint(res: Resource, verb: str) -> str:
    scope = f"with fieldSelector {res.field_selector} " if res.field_selector else ""
    return (f"forbidden: cannot {verb} {res.qualified} {scope}at the cluster scope: "
            f"grant list,watch on {res.qualified}")


def object_key(kind: str, obj: Any) -> Any:
    """The store key from raw metadata (a deleted object need not be valid to be removed)."""
    meta = obj.get("metadata") if isinstance(obj, dict) else None
    if not isinstance(meta, dict) or not isinstance(meta.get("name"), str) or not meta["name"]:
        raise InvalidObject("metadata.name missing")
    if kind in ("Namespace", "Node"):
        return meta["name"]
    ns = meta.get("namespace")
    if not isinstance(ns, str) or not ns:
        raise InvalidObject("metadata.namespace missing")
    return (ns, meta["name"])


class Backoff:
    """Jittered exponential backoff: initial * 2^n, capped, each delay times 0.5..1.5."""

    def __init__(self, initial: float, maximum: float, rand: Callable[[], float] = random.random) -> None:
        self.initial, self.maximum, self._rand = initial, maximum, rand
        self._next = initial

    def reset(self) -> None:
        self._next = self.initial

    def next(self) -> float:
        delay = self._next * (0.5 + self._rand())
        self._next = min(self._next * 2, self.maximum)
        return min(delay, self.maximum)


class ApiHealth:
    """A liveness probe of the API server on its own connection, deciding when to retry.

    While the server answers, GET probe_path every probe_interval; any HTTP
    answer counts (a 401, 403 or 500 still proves the server is there). After
    probe_failures failed probes in a row (no answer within probe_timeout, or
    no connection) the server is declared unreachable: open requests are
    interrupted (a stuck server would otherwise hold them until their read
    timeouts) and reflectors wait. Meanwhile a probe starts every probe_retry,
    without waiting for the previous one, and the first answer lets every
    reflector re-watch at once.
    """

    def __init__(self, transport: Transport, opts: Options) -> None:
        self.transport = transport
        self.opts = opts
        self.down = False
        self.down_since = 0.0
        self.reason = ""
        self._failures = 0
        self._seq = 0
        self._answered_seq = 0     # newest probe that got an answer
        self._wake = asyncio.Event()
        self._down_evt = asyncio.Event()
        self._up_evt = asyncio.Event()
        self._up_evt.set()
        self._probes: set[asyncio.Task] = set()
        api_up.set(1)

    @property
    def host(self) -> str:
        return self.transport.host

    def suspect(self) -> None:
        """A request failed in a way the probe should check now (connection trouble)."""
        self._wake.set()

    async def run(self) -> None:
        try:
            while True:
                self._start_probe()
                if self.down:
                    await asyncio.sleep(self.opts.probe_retry)
                    continue
                self._wake.clear()
                delay = self.opts.probe_retry if self._failures else self.opts.probe_interval
                try:
                    await asyncio.wait_for(self._wake.wait(), delay)
                except TimeoutError:
                    pass
        finally:
            for t in self._probes:
                t.cancel()
            await asyncio.gather(*self._probes, return_exceptions=True)

    def _start_probe(self) -> None:
        # Bounded: a stuck server holds at most probe_timeout / probe_retry + 1 probes.
        if len(self._probes) > self.opts.probe_timeout / max(self.opts.probe_retry, 0.01) + 1:
            return
        self._seq += 1
        task = asyncio.ensure_future(self._probe(self._seq))
        self._probes.add(task)
        task.add_done_callback(self._probes.discard)

    async def _probe(self, seq: int) -> None:
        timeout = aiohttp.ClientTimeout(total=self.opts.probe_timeout, connect=self.opts.probe_timeout)
        try:
            resp = await self.transport.get(self.opts.probe_path, {}, timeout)
            try:
                await resp.read()
            finally:
                resp.release()
        except asyncio.CancelledError:
            raise
        except TimeoutError:
            self._failed(seq, "timeout")
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            # ValueError: aiohttp's parser on a garbled answer; a broken server is not "there".
            self._failed(seq, "connection", exc)
        else:
            self._answered(seq)

    def _answered(self, seq: int) -> None:
        api_probes_total.labels("ok").inc()
        self._answered_seq = max(self._answered_seq, seq)
        self._failures = 0
        if not self.down:
            return
        self.down = False
        api_up.set(1)
        log.warning("API server %s answers again after %.1fs; resuming the watches",
                    self.host, time.monotonic() - self.down_since)
        self._down_evt.clear()
        self._up_evt.set()

    def _failed(self, seq: int, reason: str, exc: BaseException | None = None) -> None:
        api_probes_total.labels(reason).inc()
        if seq < self._answered_seq:
            return      # an old probe timing out after a newer one got an answer
        self._failures += 1
        self._wake.set()
        if self.down or self._failures < self.opts.probe_failures:
            return
        self.down, self.down_since, self.reason = True, time.monotonic(), reason
        api_up.set(0)
        api_outages_total.labels(reason).inc()
        what = (f"accepts connections but did not answer {self.opts.probe_path} within "
                f"{self.opts.probe_timeout:g}s" if reason == "timeout" else f"cannot be reached ({exc})")
        log.warning("API server %s %s (%d probes in a row): serving the last state, "
                    "watching again when it answers", self.host, what, self._failures)
        self._up_evt.clear()
        self._down_evt.set()

    async def wait_down(self) -> None:
        await self._down_evt.wait()

    async def pause(self, delay: float) -> None:
        """Wait before retrying after connection trouble: the backoff delay, but while the
        server is unreachable until it answers again (at most backoff_max)."""
        end = time.monotonic() + delay
        while not self.down:
            remaining = end - time.monotonic()
            if remaining <= 0:
                return
            try:
                await asyncio.wait_for(self._down_evt.wait(), remaining)
            except TimeoutError:
                return
        try:
            await asyncio.wait_for(self._up_evt.wait(), self.opts.backoff_max)
        except TimeoutError:
            pass    # try anyway: the probe's path may be what is broken

    async def guard(self, coro: Any) -> Any:
        """Run a request, interrupting it when the server is declared unreachable."""
        if self.down:
            coro.close()
            raise Unreachable(self.reason)
        task = asyncio.ensure_future(coro)
        down = asyncio.ensure_future(self._down_evt.wait())
        try:
            await asyncio.wait({task, down}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            down.cancel()
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if task.cancelled():
            raise Unreachable(self.reason)
        return task.result()


class EventBatcher:
    """Applies watch events to the store, grouping those that arrive together into one version.

    Events read from an already-buffered stream arrive in one loop pass; a flush
    scheduled `window` seconds after the first pending event publishes them as
    one version, and also merges a Service with its EndpointSlice arriving on
    the other stream. Flushes are at least `spacing` seconds apart: an event
    after a quiet spell publishes after `window`, events under sustained churn
    gather up to `spacing`. A large burst flushes early.
    """

    def __init__(self, store: StateStore, window: float = 0.002, max_pending: int = 2000,
                 spacing: float = 0.0) -> None:
        self.store = store
        self.window = window
        self.spacing = spacing
        self.max_pending = max_pending
        self._pending: list[tuple[str, str, Any, str, float]] = []
        self._handle: asyncio.TimerHandle | None = None
        self._last_flush = -math.inf

    def upsert(self, kind: str, record: Any, resource: str = "") -> None:
        self._add(("upsert", kind, record, resource, time.monotonic()))

    def delete(self, kind: str, key: Any, resource: str = "") -> None:
        self._add(("delete", kind, key, resource, time.monotonic()))

    def _add(self, op: tuple) -> None:
        self._pending.append(op)
        if len(self._pending) >= self.max_pending:
            self.flush()
        elif self._handle is None:
            delay = max(self.window, self._last_flush + self.spacing - time.monotonic())
            self._handle = asyncio.get_running_loop().call_later(delay, self.flush)

    def flush(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        ops, self._pending = self._pending, []
        if not ops:
            return
        self._last_flush = time.monotonic()
        with self.store.batch():
            for op, kind, arg, _, _ in ops:
                if op == "upsert":
                    self.store.upsert(kind, arg)
                else:
                    self.store.delete(kind, arg)
        now = time.monotonic()
        for _, _, _, resource, t in ops:
            if resource:
                event_lag.labels(resource).observe(now - t)

    def replace(self, kind: str, records: list) -> None:
        with self.store.batch():   # one version; events read before the list apply first
            self.flush()
            self.store.replace(kind, records)


async def list_records(transport: Transport, res: Resource, opts: Options) -> tuple[list, str]:
    """A complete LIST, page by page; returns (records of the valid items, resourceVersion).

    Each page is converted as it arrives, so a big list's decoded JSON never all
    lives at once (at 10,000 EndpointSlices it is several times their records)."""
    timeout = aiohttp.ClientTimeout(total=opts.list_timeout, connect=opts.connect_timeout)
    records: list = []
    cont = ""
    rv = ""
    while True:
        params = {"limit": str(opts.page_size)}
        if cont:
            params["continue"] = cont
        if res.field_selector:
            params["fieldSelector"] = res.field_selector
        resp = await transport.get(res.path, params, timeout)
        try:
            await _raise_for_status(resp)
        except Expired:
            if not cont:
                raise
            # The continue token expired mid-list: start a fresh consistent list.
            log.info("%s: list continuation expired; listing again from the start", res.name)
            records, cont = [], ""
            continue
        try:
            body = json.loads(await resp.read())
        finally:
            resp.release()
        if not isinstance(body, dict) or not isinstance(body.get("items", []), list):
            raise ApiError(0, f"malformed {res.name} list response")
        meta = body.get("metadata") or {}
        records.extend(convert_items(res, body.get("items") or []))
        del body
        rv = str(meta.get("resourceVersion") or rv)
        cont = str(meta.get("continue") or "")
        if not cont:
            return records, rv


def convert_items(res: Resource, items: list[dict]) -> list:
    """Records for valid items; invalid ones are skipped with a warning and a metric."""
    records = []
    for obj in items:
        try:
            records.append(convert(res.kind, obj))
        except InvalidObject as exc:
            log.warning("skipped %s %s: %s", res.kind, object_name(obj), exc)
            metrics.invalid_objects.labels(res.kind).inc()
    return records


# Failures the liveness probe should look into: the server may be gone or stuck.
CONNECTION_TROUBLE = frozenset({"connection", "disconnected", "timeout", "unreachable"})


class Reflector:
    """List+watch of one resource into the store, until cancelled."""

    def __init__(self, transport: Transport, res: Resource, batcher: EventBatcher,
                 opts: Options = Options(), health: ApiHealth | None = None,
                 rand: Callable[[], float] = random.random) -> None:
        self.transport = transport
        self.res = res
        self.batcher = batcher
        self.opts = opts
        self.health = health
        self._rand = rand
        self.synced = asyncio.Event()
        self.resource_version = ""
        self.backoff = Backoff(opts.backoff_initial, opts.backoff_max)
        self.last_error = ""
        self._reported: str = ""
        self._reported_at = 0.0
        self._expired_streak = 0
        self._r = res.name
        self._read_timeout = opts.effective_read_timeout
        synced_gauge.labels(self._r).set(0)

    async def run(self) -> None:
        need_list = True
        reason = "initial"
        while True:
            delay = 0.0
            trouble = False
            try:
                if self.health is not None and self.health.down:
                    await self.health.pause(0.0)     # until the server answers again
                if need_list:
                    await self._request(self.list())
                    if reason != "initial":
                        relists_total.labels(self._r, reason).inc()
                    need_list = False
                    self.backoff.reset()
                if await self._request(self.watch()):
                    continue
                # A watch that ended at once with nothing in it: do not spin.
                delay = self.backoff.next()
            except asyncio.CancelledError:
                raise
            except Expired as exc:
                log.info("%s: %s; listing again", self._r, exc)
                errors_total.labels(self._r, "expired").inc()
                need_list, reason = True, "expired"
                # An immediate re-list is the cure; back off only if it keeps happening.
                self._expired_streak += 1
                delay = 0.0 if self._expired_streak == 1 else self.backoff.next()
                self.last_error = "expired"
            except Exception as exc:
                delay = self.backoff.next()
                trouble = self._report(exc, "list" if need_list else "watch", delay) in CONNECTION_TROUBLE
            if trouble and self.health is not None:
                # The probe decides: back off as usual while the server answers it,
                # or wait for its first answer while it does not.
                self.health.suspect()
                await self.health.pause(delay)
            elif delay:
                await asyncio.sleep(delay)

    async def _request(self, coro: Any) -> Any:
        return await (self.health.guard(coro) if self.health is not None else coro)

    def _report(self, exc: Exception, verb: str, delay: float) -> str:
        """Log and count a failure; returns its kind (the errors_total reason)."""
        retry = f"retrying in {delay:.1f}s"
        if isinstance(exc, Unreachable):
            kind, text = "unreachable", f"{verb} interrupted: the API server does not answer"
            retry = "retrying when it answers"
        elif isinstance(exc, Forbidden):
            kind, text = "forbidden", f"{forbidden_hint(self.res, verb)} ({exc})"
        elif isinstance(exc, ApiError):
            kind = f"http_{exc.status}" if exc.status else "protocol"
            text = f"{verb} failed: {exc}"
        elif isinstance(exc, asyncio.TimeoutError):
            kind, text = "timeout", f"{verb}: no data for {self._read_timeout:g}s"
        elif isinstance(exc, (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError)):
            kind, text = "disconnected", f"{verb} stream broken: {exc or type(exc).__name__}"
        elif isinstance(exc, (aiohttp.ClientError, OSError)):
            kind, text = "connection", f"{verb}: cannot reach {self.transport.host}: {exc}"
        elif isinstance(exc, ValueError):
            kind, text = "protocol", f"{verb}: malformed response: {exc}"
        else:
            kind, text = "internal", f"{verb}: {type(exc).__name__}: {exc}"
            log.exception("%s: unexpected error", self._r)
        errors_total.labels(self._r, kind).inc()
        self.last_error = kind
        level = logging.ERROR if kind == "forbidden" else logging.WARNING
        # A broken stream is routine (the watch resumes where it was): say it quietly.
        # An unreachable server is reported once, by the probe.
        if kind in ("disconnected", "timeout", "unreachable"):
            level = logging.INFO
        # The same trouble again is repeated at its level once a minute, not per retry.
        now = time.monotonic()
        if text != self._reported or now - self._reported_at >= 60.0:
            log.log(level, "%s: %s; %s", self._r, text, retry)
            self._reported, self._reported_at = text, now
        else:
            log.debug("%s: %s; %s", self._r, text, retry)
        return kind

    async def list(self) -> None:
        records, rv = await list_records(self.transport, self.res, self.opts)
        self.batcher.replace(self.res.kind, records)
        self.resource_version = rv
        lists_total.labels(self._r).inc()
        if self.last_error:
            log.info("%s: listed %d objects at version %s (recovered from %s)",
                     self._r, len(records), rv, self.last_error)
        else:
            log.debug("%s: listed %d objects at version %s", self._r, len(records), rv)
        self.last_error = ""
        self._reported = ""
        if not self.synced.is_set():
            synced_gauge.labels(self._r).set(1)
            self.synced.set()

    async def watch(self) -> bool:
        """One watch request; True if it was worth it (events came, or it lasted)."""
        # Jittered, so that agents that re-watched together (after an outage) drift apart.
        seconds = int(self.opts.watch_timeout * (1 + self.opts.watch_jitter * self._rand()))
        self._read_timeout = self.opts.read_timeout_for(seconds)
        params = {"watch": "true", "allowWatchBookmarks": "true",
                  "timeoutSeconds": str(seconds),
                  "resourceVersion": self.resource_version}
        if self.res.field_selector:
            params["fieldSelector"] = self.res.field_selector
        timeout = aiohttp.ClientTimeout(total=None, connect=self.opts.connect_timeout,
                                        sock_connect=self.opts.connect_timeout,
                                        sock_read=self._read_timeout)
        started = time.monotonic()
        resp = await self.transport.get(self.res.path, params, timeout)
        await _raise_for_status(resp)
        events = 0
        try:
            while True:
                line = await resp.content.readline()
                if not line:
                    break   # the server ended the watch (timeoutSeconds): re-watch
                line = line.strip()
                if not line:
                    continue
                self._event(json.loads(line))
                if events == 0:
                    self.backoff.reset()
                    self.last_error = ""
                    self._expired_streak = 0
                events += 1
        finally:
            resp.close()
        return events > 0 or time.monotonic() - started >= 1.0

    def _event(self, ev: Any) -> None:
        if not isinstance(ev, dict) or not isinstance(ev.get("object"), dict):
            raise ValueError("watch event without an object")
        etype, obj = ev.get("type"), ev["object"]
        if etype == "ERROR":
            code = obj.get("code", 0)
            msg = str(obj.get("message") or obj.get("reason") or "watch error")
            if code == 410:
                raise Expired(410, msg, str(obj.get("reason", "")))
            if code == 403:
                raise Forbidden(403, msg)
            raise ApiError(code if isinstance(code, int) else 0, msg)
        meta = obj.get("metadata")
        rv = meta.get("resourceVersion") if isinstance(meta, dict) else None
        watch_events_total.labels(self._r, str(etype)).inc()
        if etype == "BOOKMARK":
            if rv:
                self.resource_version = str(rv)
            return
        if etype not in ("ADDED", "MODIFIED", "DELETED"):
            log.warning("%s: ignoring watch event of type %r", self._r, etype)
            return
        kind = self.res.kind
        try:
            key = object_key(kind, obj)
        except InvalidObject as exc:
            log.warning("%s: %s event for an object without a name: %s", self._r, etype, exc)
            metrics.invalid_objects.labels(kind).inc()
        else:
            if etype == "DELETED":
                self.batcher.delete(kind, key, self._r)
            else:
                try:
                    self.batcher.upsert(kind, convert(kind, obj), self._r)
                except InvalidObject as exc:
                    # As a re-list would: an object we cannot use is absent.
                    log.warning("skipped %s %s: %s", kind, object_name(obj), exc)
                    metrics.invalid_objects.labels(kind).inc()
                    self.batcher.delete(kind, key, self._r)
        if rv:
            self.resource_version = str(rv)


__all__ = ["ApiError", "ApiHealth", "Backoff", "ENDPOINTSLICES", "EventBatcher", "Expired", "Forbidden",
           "NAMESPACES", "NODES", "Options", "PODS", "Reflector", "Resource", "SERVICES",
           "Transport", "Unreachable", "convert_items", "forbidden_hint", "list_records", "object_key"]
